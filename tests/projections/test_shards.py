"""Projections sharded by tenant (`projections.shards`): a shard's runner applies its
tenants' events only, beside runners of other shards, and the union of the shards is
the unsharded view (R14, R17)."""

from __future__ import annotations

import asyncio
import random
import tempfile
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import literal, select

from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections import shards
from projections.recall import recall
from projections.registry import default_projections
from projections.runner import Runner
from projections.sql import shard_filter
from replay.rebuild import rebuild, set_shards
from tests.conftest import PG_HOST, RUN_ID, _pg_admin, unavailable
from tests.helpers import dump_views, fresh_replay
from tests.projections.test_views import gen_events

TENANTS = ["shop-a", "shop-b", "acme", "globex", "租户-七", "t5", "initech", "x"]


def tenant_events(rng: random.Random, tenant: str, n: int) -> list[dict[str, Any]]:
    """`gen_events` (writes, corrections, candidates, confirmations, supersessions,
    forgets, task notes) for one tenant."""
    raw = orjson.dumps(gen_events(rng, n)).replace(b'"shop-a"', orjson.dumps(tenant))
    out: list[dict[str, Any]] = orjson.loads(raw)
    return out


def interleave(rng: random.Random, tenants: list[str], n: int) -> list[dict[str, Any]]:
    """Each tenant's events in their own order, the tenants' streams shuffled together."""
    streams = [deque(tenant_events(rng, ten, n)) for ten in tenants]
    out: list[dict[str, Any]] = []
    while any(streams):
        s = rng.choice([s for s in streams if s])
        out.append(s.popleft())
    return out


async def set_count(store: Store, count: int) -> None:
    async with store.view_write() as conn:
        await shards.write_shard_count(conn, count)


async def project_sharded(store: Store, rng: random.Random, count: int) -> None:
    """Step runners owning random groups of shards (and now and then one stepping every
    shard) in random turns with random batch sizes until every shard is at the head."""
    order = list(range(count))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, count), min(count - 1, rng.randint(0, 3))))
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, count], strict=True)]
    runners = []
    for g in groups:
        r = Runner(store, batch_size=rng.randint(1, 7))
        r.owned = frozenset(g)
        runners.append(r)
    whole = Runner(store, batch_size=rng.randint(1, 7))
    head = await store.head()
    for _ in range(10_000):
        r = whole if rng.random() < 0.1 else rng.choice(runners)
        for proj in r.projections:  # in registry order, as a worker does
            await r.step(proj, head)
        if set((await whole.positions()).values()) == {head}:
            return
    raise AssertionError("sharded runners did not reach the head")


def test_shard_of_is_stable() -> None:
    """The hash is a fixed function of the tenant's name (MD5), whatever the process."""
    assert shards.tenant_hash("shop-a") == 799250431
    assert shards.shard_of("shop-a", 16) == 799250431 % 16
    assert {shards.shard_of(f"t{i}", 16) for i in range(400)} == set(range(16))


async def test_postgres_computes_the_same_shard(pg_url: str, register_path: str) -> None:
    """PostgreSQL's `shard_filter` keeps exactly the tenants Python puts in the shard,
    for any S."""
    store = Store(pg_url, register_path=register_path)
    await store.open()
    names = ["shop-a", "租户-七", "", "a" * 128, "Ünïcode ✓", *(f"t{i}" for i in range(60))]
    try:
        async with store.read() as conn:
            for count in (1, 2, 7, 16, 1024):
                for name in names:
                    want = shards.shard_of(name, count)
                    for k in {want, (want + 1) % count}:
                        cond = shard_filter(store, literal(name), count, [k])
                        got = (await conn.execute(select(cond))).scalar()
                        assert got is (k == want), (name, count, k)
    finally:
        await store.close()


async def check_union(url: str, d: Path, seed: int, n: int, tenants: int,
                      count: int) -> None:
    """The property of `test_union_of_shards_equals_unsharded*` on one ledger: `url`, new
    and empty (SQLite: Python keeps a shard's events; PostgreSQL: the SQL filter does)."""
    rng = random.Random(seed)
    store = Store(url, register_path=str(d / "l.forgets"))
    await store.open()
    try:
        await set_count(store, count)
        evs = interleave(rng, rng.sample(TENANTS, tenants), n)
        half = rng.randrange(len(evs) + 1)
        for e in evs[:half]:
            await store.append_one(parse_event(e))
        await project_sharded(store, rng, count)
        for e in evs[half:]:  # more events after the shards have moved apart
            await store.append_one(parse_event(e))
        await project_sharded(store, rng, count)
        fresh = await fresh_replay(store, d)
        try:
            assert await dump_views(store, t.VIEW_TABLES) == await dump_views(
                fresh, t.VIEW_TABLES)
        finally:
            await fresh.close()
        head = await store.head()
        assert set((await Runner(store).positions()).values()) == {head}
    finally:
        await store.close()


def test_every_projection_is_compared() -> None:
    """The property compares `VIEW_TABLES`: every table of every registered projection
    (lexical included), so a projection added later cannot escape it."""
    tables = {tb.name for p in default_projections() for tb in p.tables}
    assert tables <= {tb.name for tb in t.VIEW_TABLES}
    assert {p.name for p in default_projections()} >= {
        "memories", "tasks", "erasure", "vectors", "lexical"}


@given(seed=st.integers(0, 10**6), n=st.integers(3, 10), tenants=st.integers(1, 6),
       count=st.integers(1, 9))
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_union_of_shards_equals_unsharded(tmp_path: Path, seed: int, n: int,
                                                tenants: int, count: int) -> None:
    """For any mix of events over several tenants and any number of shards, runners that
    each own some shards, stepped in any interleaving (with whole-ledger steps among
    them), leave every view exactly as one unsharded runner does (property, SQLite)."""
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    await check_union(f"sqlite+aiosqlite:///{d / 'l.db'}", d, seed, n, tenants, count)


@pytest.mark.postgres
@given(seed=st.integers(0, 10**6), n=st.integers(3, 8), tenants=st.integers(1, 6),
       count=st.integers(1, 9))
@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_union_of_shards_equals_unsharded_on_postgres(
        tmp_path: Path, seed: int, n: int, tenants: int, count: int) -> None:
    """The same property on PostgreSQL, where a shard's batch filters its tenants in
    SQL (`projections.sql.shard_filter`) and the runners' batches lock shard rows."""
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    name = f"memledger_t_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    try:
        await _pg_admin(f'CREATE DATABASE "{name}"')
    except Exception as e:  # noqa: BLE001 - any failure to connect means "no server"
        unavailable("PostgreSQL", e)
    try:
        await check_union(f"{PG_HOST}/{name}", d, seed, n, tenants, count)
    finally:
        await _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def test_shards_run_side_by_side_on_both_backends(store: Store, tmp_path: Path) -> None:
    """On SQLite and PostgreSQL: four runners of four disjoint shard groups running at
    once (concurrent transactions on PostgreSQL) give the unsharded views; each shard's
    checkpoint is at the head and recall reads each tenant's shard of the index."""
    rng = random.Random(7)
    await set_count(store, 8)
    for e in interleave(rng, TENANTS, 12):
        await store.append_one(parse_event(e))
    head = await store.head()

    async def run(group: list[int]) -> None:
        r = Runner(store, batch_size=5)
        r.owned = frozenset(group)
        while any(p < head for p in (await r.positions()).values()):
            for proj in r.projections:
                await r.step(proj, head)

    await asyncio.gather(*(run([k, k + 4]) for k in range(4)))
    async with store.read() as conn:
        at = await shards.shard_positions(conn, ["memories", "vectors"], 8)
    assert {p for per in at.values() for p in per.values()} == {head}
    fresh = await fresh_replay(store, tmp_path)
    try:
        assert await dump_views(store, t.VIEW_TABLES) == await dump_views(fresh, t.VIEW_TABLES)
        for ten in ("shop-a", "租户-七"):
            got = await recall(store, f"{ten}/u7", query="lang", session=None, task=None,
                               budget=None, limit=5, now_us=0)
            want = await recall(fresh, f"{ten}/u7", query="lang", session=None, task=None,
                                budget=None, limit=5, now_us=0)
            assert [i["memory_id"] for i in got["items"]] == [
                i["memory_id"] for i in want["items"]]
    finally:
        await fresh.close()


async def test_a_shard_behind_is_lag_and_rebuild_levels_the_shards(store: Store) -> None:
    """A shard left behind holds its projection's position (the slowest shard's) back;
    a rebuild runs unsharded and leaves every shard at the head; `set_shards` records
    the new S and rebuilds."""
    rng = random.Random(3)
    await set_count(store, 4)
    for e in interleave(rng, TENANTS[:5], 10):
        await store.append_one(parse_event(e))
    head = await store.head()
    lagging = shards.shard_of("shop-a", 4)
    r = Runner(store)
    r.owned = frozenset(set(range(4)) - {lagging})
    for proj in r.projections:
        while await r.step(proj, head):
            pass
    assert set((await r.positions()).values()) == {head}
    assert set((await Runner(store).positions()).values()) == {0}
    live = await dump_views(store, t.VIEW_TABLES)
    assert not [row for row in live["mem_versions"] if row[0] == "shop-a"]
    await rebuild(store, progress=False)
    async with store.read() as conn:
        assert (await conn.execute(select(t.shard_checkpoints))).first() is None
    assert set((await Runner(store).positions()).values()) == {head}
    res = await set_shards(store, 6, progress=False)
    assert res["shards"] == 6 and res["was"] == 4
    async with store.read() as conn:
        assert await shards.shard_count(conn) == 6
    assert set((await Runner(store).positions()).values()) == {head}
    with pytest.raises(Exception, match="out of range"):
        await set_shards(store, 0, progress=False)
