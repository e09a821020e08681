"""Sharded projections across real `memledger worker` processes on PostgreSQL and Redis
(`workers.leases`, `projections.shards`): leases move to a joining process, away from a
SIGKILLed one within the takeover bound, and at once from one stopped gracefully; every
shard applies every event once (an audit trigger records each checkpoint move), and the
views equal a fresh single-process replay."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import text

from ledger.backends.postgres import SHARD_LEASE_LOCK, advisory_holders
from ledger.store import Store
from projections.registry import default_projections
from projections.shards import DEFAULT_SHARDS
from tests.factories import src, write
from tests.workers.test_daemon import (
    Daemon,
    assert_gap_free,
    assert_views_equal_rebuild,
    caught_up,
    cli,
)
from workers.leases import REBALANCE_S
from workers.publish import Publisher

pytestmark = [pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow,
              pytest.mark.parametrize("db_url", ["postgresql"], indirect=True),
              # The suite's 300 s would be tight at this scale on a loaded machine; a
              # hang still fails.
              pytest.mark.timeout(900)]

#: Events and tenants: the issue's scale (20,000 events over 200 tenants). 2 to 3 minutes
#: on the shared 2-core machine at load 7-12, most of it the daemons projecting and the
#: single-process replay the views are compared with.
EVENTS = 20_000
TENANTS = 200
#: A dead process's shards move within this (docs/workers.md: one rebalance tick after
#: its session ends, plus a batch in flight); the test allows a loaded machine 5 ticks.
TAKEOVER_BOUND_S = 5 * REBALANCE_S

#: The test's audit of every committed shard checkpoint move (a trigger writes in the
#: mover's own transaction, so only committed moves are recorded).
AUDIT = (
    """CREATE TABLE shard_audit (id bigserial PRIMARY KEY, projection text, shard int,
                                 old_pos bigint, new_pos bigint, tx bigint)""",
    """CREATE FUNCTION shard_audit_fn() RETURNS trigger AS $$
       BEGIN
         INSERT INTO shard_audit (projection, shard, old_pos, new_pos, tx)
         VALUES (NEW.projection, NEW.shard,
                 CASE WHEN TG_OP = 'UPDATE' THEN OLD.position END, NEW.position,
                 txid_current());
         RETURN NEW;
       END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER shard_audit_tg AFTER INSERT OR UPDATE ON shard_checkpoints
       FOR EACH ROW EXECUTE FUNCTION shard_audit_fn()""",
)


def tenant_stream(n: int, prefix: str) -> list[dict[str, Any]]:
    """`n` writes and corrections spread over `TENANTS` tenants."""
    out = []
    for i in range(n):
        tenant, user = f"tenant-{i % TENANTS}", f"u{i % 7}"
        out.append(write(f"pref{(i // TENANTS) % 5}", {"n": i}, tenant=tenant, user=user,
                         idem=f"{prefix}-{i}",
                         source=src(sid=f"C{user}", at="2026-09-20T10:00:00+08:00", seq=i)))
    return out


async def owners(store: Store) -> dict[int, str]:
    """Shard -> the application name of the session holding its lease."""
    async with store.read_once() as conn:
        return await advisory_holders(conn, SHARD_LEASE_LOCK)


def pid_of(owner: str) -> int:
    return int(owner.rsplit(":", 1)[1])


async def wait_for(cond: Callable[[dict[int, str]], bool], store: Store, within: float,
                   *ds: Daemon) -> float:
    """Seconds until the lease holders satisfy `cond` (fails after `within`)."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        if cond(await owners(store)):
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    logs = "\n---\n".join(d.tail() for d in ds)
    pytest.fail(f"leases not as expected within {within} s: {await owners(store)}\n{logs}")


async def test_shards_move_between_worker_processes(
        env: dict[str, str], daemons: Callable[..., Daemon], ledger: Store,
        broker_url: str, tmp_path: Path) -> None:
    """Two workers share the 16 shards; one is SIGKILLed mid-stream and its shards are
    taken over within the bound; a third joins and gets its fair share without restarts;
    a graceful stop hands its shards over at once. Every (projection, shard) checkpoint
    moved in one unbroken chain from 0 to the head, each move from where the previous
    one ended (no event applied twice, none skipped), and the views equal a replay."""
    async with ledger.view_write() as conn:
        for stmt in AUDIT:
            await conn.execute(text(stmt))
    a = daemons(env, "--sweep-interval", "0.5", name="a")
    b = daemons(env, "--sweep-interval", "0.5", name="b")
    both = {a.proc.pid, b.proc.pid}
    await wait_for(lambda o: len(o) == DEFAULT_SHARDS and {pid_of(v) for v in o.values()}
                   == both, ledger, 60, a, b)
    events = tenant_stream(EVENTS, "s")
    half = EVENTS // 2
    with Publisher(broker_url, batch_size=50) as pub:
        assert {r.status for r in pub.publish(events[:half // 2])} == {"published"}
        a.kill()  # SIGKILL mid-stream
        killed = time.monotonic()
        assert {r.status for r in pub.publish(events[half // 2:half])} == {"published"}
        took = await wait_for(lambda o: len(o) == DEFAULT_SHARDS and {
            pid_of(v) for v in o.values()} == {b.proc.pid}, ledger, 60, b)
        takeover = time.monotonic() - killed
        c = daemons(env, "--sweep-interval", "0.5", name="c")  # joins mid-stream
        assert {r.status for r in pub.publish(events[half:])} == {"published"}
        await wait_for(lambda o: sorted(
            sum(1 for v in o.values() if pid_of(v) == p) for p in (b.proc.pid, c.proc.pid))
            == [DEFAULT_SHARDS // 2] * 2, ledger, 60, b, c)
    assert takeover <= TAKEOVER_BOUND_S, f"takeover took {takeover:.2f} s ({took:.2f})"
    published = time.monotonic()
    await caught_up(ledger, EVENTS, 600, b, c)
    projected = time.monotonic()
    # A graceful stop hands the shards over at once: the survivor holds all of them
    # within a rebalance tick or two of the stopped process's exit.
    stop_started = time.monotonic()
    assert b.stop() == 0
    exited = time.monotonic()
    await wait_for(lambda o: len(o) == DEFAULT_SHARDS and {pid_of(v) for v in o.values()}
                   == {c.proc.pid}, ledger, 3 * REBALANCE_S + 2, c)
    handover = time.monotonic() - exited
    extra = tenant_stream(40, "after")
    with Publisher(broker_url) as pub:
        assert {r.status for r in pub.publish(extra)} == {"published"}
    await caught_up(ledger, EVENTS + 40, 60, c)
    await assert_gap_free(ledger, EVENTS + 40)
    replay_started = time.monotonic()
    # The replay steps each projection over the whole ledger in one batch (views do not
    # depend on batch bounds: tests/projections/test_shards.py): minutes fewer than
    # batches of 1,000 at this scale, with the same views.
    await assert_views_equal_rebuild(ledger, tmp_path, batch_size=EVENTS + 40)
    replayed = time.monotonic() - replay_started
    head = EVENTS + 40
    async with ledger.read() as conn:
        rows = (await conn.execute(text(
            "SELECT projection, shard, old_pos, new_pos FROM shard_audit ORDER BY id"))).all()
    chains: dict[tuple[str, int], list[tuple[int | None, int]]] = {}
    for proj, shard, old, new in rows:
        chains.setdefault((proj, shard), []).append((old, new))
    assert set(chains) == {(p.name, k) for p in default_projections()
                           for k in range(DEFAULT_SHARDS)}
    for key, moves in chains.items():
        assert moves[0] == (None, 0), key  # created at the base, before any event
        for (_, prev), (old, new) in itertools.pairwise(moves):
            assert old == prev and new > old, (key, old, new)
        assert moves[-1][1] == head, key
    status = orjson.loads(cli(env, "status").stdout)
    assert status["shards"]["count"] == DEFAULT_SHARDS
    assert {p["slowest_shard_lag"] for p in status["projections"].values()} == {0}
    shown = {s["owner"] for s in status["projections"]["memories"]["shards"]}
    assert {pid_of(o) for o in shown} == {c.proc.pid}
    assert c.stop() == 0
    print(f"takeover {takeover:.2f} s after SIGKILL; graceful handover "
          f"{handover:.2f} s after exit ({exited - stop_started:.2f} s to stop); "
          f"{EVENTS:,} events projected {projected - published:.1f} s after the last "
          f"publish; fresh replay {replayed:.1f} s")
