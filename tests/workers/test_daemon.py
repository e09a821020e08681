"""Worker daemons as they run in production: real `memledger worker` processes, real Redis.

Each test starts daemons as subprocesses with MEMLEDGER_DB_URL / MEMLEDGER_REDIS_URL,
publishes through the SDK or the CLI, and checks the ledger and the views afterwards:
nothing lost, nothing applied twice, views equal to a fresh replay, lag 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from sqlalchemy import select

from ledger import schema as t
from ledger.appender import Appender, Request
from ledger.events import Event
from ledger.store import Store
from ledger.validation import parse_event
from projections.runner import Runner
from tests.factories import src, write
from tests.helpers import dump_views, fresh_replay
from workers.publish import Publisher

MEMLEDGER = str(Path(sys.executable).parent / "memledger")
pytestmark = pytest.mark.redis


# -- helpers ------------------------------------------------------------------------------

def stream(n: int, *, prefix: str = "e", users: int = 40) -> list[dict[str, Any]]:
    """`n` wire events: long-term writes and corrections over many users and keys."""
    out = []
    for i in range(n):
        user = f"u{i % users}"
        out.append(write(f"pref{(i // users) % 9}", {"n": i, "said": f"option {i % 13}"},
                         user=user, idem=f"{prefix}-{i}",
                         source=src(sid=f"C{user}", at="2026-09-20T10:00:00+08:00", seq=i)))
    return out


class Daemon:
    """One `memledger worker` subprocess (its own process group), logs in a file."""

    def __init__(self, tmp_path: Path, env: dict[str, str], *args: str, name: str = "d"
                 ) -> None:
        self.log = tmp_path / f"{name}-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [MEMLEDGER, "worker", *args], env=env, stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"), start_new_session=True)

    def alive(self) -> bool:
        """Still running?"""
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole daemon, as an OOM killer or a power cut would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM, then wait for the graceful exit."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def tail(self, n: int = 15) -> str:
        """The last log lines, for failure messages."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture
def broker_url(redis_db: str) -> Iterator[str]:
    """This run's Redis database, empty before and after (no message leaks across tests)."""
    client = redis.Redis.from_url(redis_db)
    client.flushdb()
    yield redis_db
    client.flushdb()


@pytest.fixture
def env(db_url: str, broker_url: str, register_path: str) -> dict[str, str]:
    """The environment a daemon of this test runs with."""
    return {**os.environ, "MEMLEDGER_DB_URL": db_url, "MEMLEDGER_REDIS_URL": broker_url,
            "MEMLEDGER_FORGET_REGISTER": register_path, "MEMLEDGER_LOG_LEVEL": "INFO"}


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start daemons; every one still running at the end is killed."""
    started: list[Daemon] = []

    def start(env: dict[str, str], *args: str, name: str = "d") -> Daemon:
        d = Daemon(tmp_path, env, *args, name=name)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.alive():
            d.kill()


@pytest.fixture
def ledger(store: Store) -> Store:
    """The test's ledger, opened in the test process (the shared `store` fixture)."""
    return store


async def lag(store: Store) -> int:
    """The largest projection lag."""
    head = await store.head()
    return max(head - p for p in (await Runner(store).positions()).values())


async def caught_up(store: Store, head: int, within: float, *ds: Daemon) -> float:
    """Wait until the ledger holds `head` events and every projection reached them;
    return the seconds it took. Fails (with the daemons' logs) after `within` s."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        if await store.head() == head and await lag(store) == 0:
            return time.monotonic() - started
        await asyncio.sleep(0.25)
    logs = "\n---\n".join(d.tail() for d in ds)
    pytest.fail(f"not caught up within {within} s: head {await store.head()}/{head}, "
                f"lag {await lag(store)}\n{logs}")


async def assert_views_equal_rebuild(store: Store, tmp_path: Path, *,
                                     batch_size: int = 1000) -> None:
    """Every view equals a replay of the ledger into a fresh database."""
    fresh = await fresh_replay(store, tmp_path, name=f"fresh{time.monotonic_ns()}",
                               batch_size=batch_size)
    try:
        assert await dump_views(store, t.VIEW_TABLES) == await dump_views(fresh, t.VIEW_TABLES)
    finally:
        await fresh.close()


async def assert_gap_free(store: Store, n: int) -> None:
    """Positions are exactly 1..n: nothing lost, nothing twice, no hole."""
    async with store.read() as conn:
        pos = [r[0] for r in (await conn.execute(
            select(t.events.c.position).order_by(t.events.c.position))).all()]
    assert pos == list(range(1, n + 1))


def cli(env: dict[str, str], *args: str, stdin: bytes | None = None
        ) -> subprocess.CompletedProcess[bytes]:
    """Run `memledger ARGS` with the test's environment."""
    return subprocess.run([MEMLEDGER, *args], env=env, input=stdin, capture_output=True,
                          timeout=120, check=False)


# -- the tests ----------------------------------------------------------------------------

@pytest.mark.slow
async def test_five_thousand_published_events_equal_a_rebuild(
        env: dict[str, str], daemons: Callable[..., Daemon], ledger: Store,
        tmp_path: Path) -> None:
    """5,000 events through `memledger publish` and one daemon: every view equals a
    rebuild, and `memledger status` shows lag 0 and an empty broker."""
    d = daemons(env)
    lines = b"".join(orjson.dumps(e) + b"\n" for e in stream(5000))
    res = cli(env, "publish", "-", stdin=lines)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    outs = [orjson.loads(x) for x in res.stdout.splitlines()]
    assert len(outs) == 5000 and {o["status"] for o in outs} == {"published"}
    await caught_up(ledger, 5000, 120, d)
    await assert_gap_free(ledger, 5000)
    await assert_views_equal_rebuild(ledger, tmp_path)
    status = orjson.loads(cli(env, "status").stdout)
    assert {p["lag"] for p in status["projections"].values()} == {0}
    assert status["head"] == 5000 and status["dead_letters"] == 0
    assert status["broker"]["reachable"] and status["broker"]["daemons"]
    assert status["broker"]["queues"]["ingest"]["unacked"] == 0
    assert d.stop() == 0  # graceful SIGTERM


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_sigkilled_worker_loses_nothing_and_catches_up(
        env: dict[str, str], daemons: Callable[..., Daemon], ledger: Store,
        broker_url: str, tmp_path: Path) -> None:
    """SIGKILL a daemon mid-stream and start another: its in-flight messages come back
    (heartbeat timeout), no event is lost or doubled, and it catches up within 60 s."""
    events = stream(3000)
    first = daemons(env, name="killed")
    done = threading.Event()

    def produce() -> None:
        with Publisher(broker_url, batch_size=10) as pub:
            for i in range(0, len(events), 10):
                assert {r.status for r in pub.publish(events[i:i + 10])} == {"published"}
                time.sleep(0.002)
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    while await ledger.head() < 600:
        assert first.alive(), first.tail()
        await asyncio.sleep(0.05)
    first.kill()
    second = daemons(env, name="restarted")
    await asyncio.to_thread(producer.join)
    assert done.is_set()
    await caught_up(ledger, 3000, 60, second)  # fails past 60 s
    await assert_gap_free(ledger, 3000)
    await assert_views_equal_rebuild(ledger, tmp_path)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_redis_outage_reports_not_sent_and_projection_goes_on(
        env: dict[str, str], daemons: Callable[..., Daemon], ledger: Store,
        tmp_path: Path) -> None:
    """Redis stopped and started again: publishes meanwhile are reported not sent, SDK
    appends keep working and are projected by the sweep, and after Redis returns
    everything published is ingested and projected."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"

    def redis_server() -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                              "--appendonly", "no", "--bind", "127.0.0.1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            with contextlib.suppress(redis.RedisError):
                if redis.Redis.from_url(url).ping():
                    return p
            time.sleep(0.05)
        pytest.fail("redis-server did not start")

    server = redis_server()
    try:
        local = {**env, "MEMLEDGER_REDIS_URL": url}
        d = daemons(local)
        before = stream(200, prefix="before")
        assert {r.status for r in Publisher(url).publish(before)} == {"published"}
        await caught_up(ledger, 200, 60, d)

        server.terminate()
        server.wait(10)
        during = stream(50, prefix="during")
        res = Publisher(url).publish(during)
        assert {r.status for r in res} == {"not_sent"}
        cli_res = cli(local, "publish", "-",
                      stdin=b"".join(orjson.dumps(e) + b"\n" for e in during[:5]))
        assert cli_res.returncode == 1
        assert [orjson.loads(x)["status"] for x in cli_res.stdout.splitlines()] == \
            ["not_sent"] * 5
        sdk = [parse_event(e) for e in stream(50, prefix="sdk")]
        results = await ledger.append(sdk)
        assert {r.status for r in results} == {"appended"}
        await caught_up(ledger, 250, 60, d)  # the sweep projects without the broker
        assert d.alive()

        server = redis_server()
        assert {r.status for r in Publisher(url).publish(during)} == {"published"}
        await caught_up(ledger, 300, 60, d)
        await assert_gap_free(ledger, 300)
        await assert_views_equal_rebuild(ledger, tmp_path)
        assert d.alive()
    finally:
        server.terminate()
        server.wait(10)


async def test_duplicated_messages_and_bogus_wakeups_converge(
        env: dict[str, str], daemons: Callable[..., Daemon], ledger: Store,
        broker_url: str, tmp_path: Path) -> None:
    """The same ingest message delivered five times plus reordered, repeated and bogus
    wake-ups: each event is appended once and the views equal a rebuild (R11)."""
    from workers.broker import LedgerBroker
    from workers.wake import wake_message

    events = stream(300, prefix="dup")
    with Publisher(broker_url) as pub:
        for _ in range(5):
            for i in range(0, 300, 100):
                pub.send(events[i:i + 100])
    broker = LedgerBroker(broker_url)
    for head in (10**9, 300, 0, -7, 150, 300, "x"):
        broker.enqueue(wake_message(head))  # type: ignore[arg-type]
    broker.client.close()
    d = daemons(env)
    await caught_up(ledger, 300, 60, d)
    await assert_gap_free(ledger, 300)
    await assert_views_equal_rebuild(ledger, tmp_path)
    assert d.stop() == 0


@pytest.mark.slow
async def test_two_daemons_never_apply_a_batch_twice(
        env: dict[str, str], daemons: Callable[..., Daemon], ledger: Store,
        broker_url: str, tmp_path: Path) -> None:
    """Two daemons on one database: every position is applied exactly once per
    projection and shard (from their batch logs; on PostgreSQL they share the shards),
    and the views equal a rebuild."""
    debug = {**env, "MEMLEDGER_LOG_LEVEL": "DEBUG"}
    a = daemons(debug, "--sweep-interval", "0.5", name="a")
    b = daemons(debug, "--sweep-interval", "0.5", name="b")
    with Publisher(broker_url, batch_size=20) as pub:
        assert {r.status for r in pub.publish(stream(2000, prefix="two"))} == {"published"}
    # Direct appends too: no wake-up at all, only the two sweeps race for them.
    await ledger.append([parse_event(e) for e in stream(200, prefix="direct")])
    await caught_up(ledger, 2200, 90, a, b)
    assert a.stop() == 0 and b.stop() == 0
    applied: dict[tuple[str, str | None], list[tuple[int, int]]] = {}
    for d in (a, b):
        for line in d.log.read_bytes().splitlines():
            rec = orjson.loads(line) if line.startswith(b"{") else {}
            if rec.get("event") == "projection_batch":
                last = rec["position"]
                first = rec["after"] + 1 if "after" in rec else last - rec["events"] + 1
                # A shard batch says where each shard it moved stood; else every shard.
                moved = rec.get("shards") or {None: first - 1}
                for shard, frm in moved.items():
                    applied.setdefault((rec["projection"], shard), []).append((frm + 1, last))
    assert applied, "no projection_batch lines in the daemon logs"
    sharded = {k for k in applied if k[1] is not None}
    assert not sharded or not {k for k in applied if k[1] is None}, "mixed batch kinds"
    for key, ranges in applied.items():
        covered = sorted(p for lo, hi in ranges for p in range(lo, hi + 1))
        assert covered == list(range(1, 2201)), f"{key}: applied twice or skipped"
    await assert_views_equal_rebuild(ledger, tmp_path)


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
async def test_postgres_slow_commit_is_not_skipped_and_rollback_leaves_no_hole(
        env: dict[str, str], daemons: Callable[..., Daemon], ledger: Store,
        db_url: str, register_path: str, tmp_path: Path) -> None:
    """PostgreSQL: while an append transaction is held open, later appends wait behind
    it and the projection stops before it; once it commits it is projected, never
    skipped. A rolled-back append leaves no hole: positions stay gap-free."""
    d = daemons(env, "--sweep-interval", "0.3")
    await ledger.append([parse_event(e) for e in stream(20, prefix="pre")])
    await caught_up(ledger, 20, 60, d)
    other = Store(db_url, register_path=register_path)
    await other.open()

    async def held_append(ev: Event, commit: bool, hold: float) -> None:
        """The ledger's own append path, with the transaction kept open for `hold` s."""
        req = Request([ev], asyncio.get_running_loop().create_future())
        with contextlib.suppress(RuntimeError):
            async with ledger.write() as conn:
                _, outcomes = await Appender(ledger, conn).run([req])
                assert not isinstance(outcomes[0], BaseException)
                await asyncio.sleep(hold)
                if not commit:
                    raise RuntimeError("roll back")

    slow = parse_event(write("slow", "held", idem="slow-1", user="u1",
                             source=src(sid="Cu1", at="2026-09-20T09:00:00+08:00")))
    holder = asyncio.create_task(held_append(slow, commit=True, hold=4.0))
    await asyncio.sleep(0.5)
    later = asyncio.create_task(other.append(
        [parse_event(e) for e in stream(5, prefix="later")]))
    await asyncio.sleep(2.5)  # give the daemon's sweeps time to run past it, if they could
    assert not later.done()  # later appends wait behind the open transaction
    assert await ledger.head() == 20
    assert set((await Runner(ledger).positions()).values()) == {20}
    await holder
    positions = [r.position for r in await later]
    assert positions == [22, 23, 24, 25, 26]
    await caught_up(ledger, 26, 60, d)
    async with ledger.read() as conn:
        row = (await conn.execute(select(t.mem_versions.c.position, t.mem_versions.c.status)
                                  .where(t.mem_versions.c.mkey == "slow"))).one()
    assert tuple(row) == (21, "active")

    aborted = parse_event(write("gone", "never", idem="rolled-back-1"))
    await held_append(aborted, commit=False, hold=0.5)
    await other.append([parse_event(e) for e in stream(3, prefix="after")])
    await caught_up(ledger, 29, 60, d)
    await assert_gap_free(ledger, 29)
    await assert_views_equal_rebuild(ledger, tmp_path)
    await other.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_dead_letters_command_lists_rejections_without_secrets(
        env: dict[str, str], daemons: Callable[..., Daemon], ledger: Store,
        broker_url: str) -> None:
    """Events the daemon rejects are listed by `memledger dead-letters` with their
    error; a secret's entry has no content (R23)."""
    good = write("lang", "zh", idem="g-1")
    with Publisher(broker_url) as pub:
        # Sent raw, as an app skipping validation would: the worker validates again.
        pub.send([good, write("card", "4111 1111 1111 1111", idem="card-1"),
                  write("lang", "en", idem="g-1")])
    d = daemons(env)
    await caught_up(ledger, 1, 60, d)
    for _ in range(200):
        out = orjson.loads(cli(env, "dead-letters").stdout)
        if out["count"] == 2:
            break
        await asyncio.sleep(0.2)
    assert out["count"] == 2
    by_key = {x["idempotency_key"]: x for x in out["dead_letters"]}
    assert by_key["card-1"]["content_withheld"] and "4111" not in orjson.dumps(out).decode()
    assert "reused with different content" in by_key["g-1"]["error"]
    assert "4111" not in d.log.read_text()
    assert d.stop() == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_supervisor_exits_when_a_worker_process_dies(
        env: dict[str, str], daemons: Callable[..., Daemon]) -> None:
    """With --processes 2, the death of one worker process stops the daemon with exit
    status 1 (for systemd or supervisord to restart it), as the dramatiq CLI does."""
    d = daemons(env, "--processes", "2", "--threads", "2")
    children: list[int] = []
    for _ in range(200):
        found = await asyncio.to_thread(
            subprocess.run, ["pgrep", "-P", str(d.proc.pid), "-f", "spawn_main"],
            capture_output=True, text=True, check=False)
        out = found.stdout.split()
        children = [int(x) for x in out]
        if len(children) >= 2:
            break
        await asyncio.sleep(0.1)
    assert len(children) >= 2, d.tail()
    await asyncio.sleep(1.0)
    os.kill(children[0], signal.SIGKILL)
    assert await asyncio.to_thread(d.proc.wait, 60) == 1
    assert "worker_process_died" in d.log.read_text()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_daemon_purges_tasks_past_retention(
        env: dict[str, str], daemons: Callable[..., Daemon], ledger: Store) -> None:
    """The daemon's sweep purges a closed task past its retain_until (R6, R28)."""
    from tests.factories import event

    await ledger.append([parse_event(e) for e in (
        event("task.opened", {"task_key": "T900", "namespace": ["shop-a", "u7"]}),
        event("task.closed", {"task_key": "T900", "retain_until": "2026-09-21T00:00:00Z"},
              source=src(at="2026-09-20T12:00:00+08:00")))])
    d = daemons(env)
    await caught_up(ledger, 3, 60, d)
    async with ledger.read() as conn:
        types = [r[0] for r in (await conn.execute(
            select(t.events.c.type).order_by(t.events.c.position))).all()]
        purged = (await conn.execute(select(t.tasks_view.c.purged))).scalar()
    assert types[-1] == "task.purged" and purged
    assert d.stop() == 0
