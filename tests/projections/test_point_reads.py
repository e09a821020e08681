"""Point reads: `get` on the calling thread over a plain sqlite3 connection (SQLite files).

The same statement as the async path, so the same answers for any ledger (R15, R24);
nothing cached above SQLite, so a forget appended by another process is unreadable at
the next call (R20); a busy file falls back to the async path; the connection never
writes and keeps no snapshot that would stop the WAL being truncated after an erasure.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ledger import builders
from ledger.backends.sqlite import PointReads, file_path
from ledger.builders import Source
from ledger.store import Store
from memledger import MemoryLedger
from projections import reads
from projections.runner import Runner
from projections.views import MemoryProjection

ROOT = Path(__file__).resolve().parents[2]
AT = "2026-09-20T10:00:00+08:00"

FORGET = """
import asyncio, sys
from memledger import MemoryLedger, Source

async def main():
    async with MemoryLedger(sys.argv[1], register_path=sys.argv[2]) as ml:
        await ml.principal("shop-a", "u7").forget(
            ["prefs"], "lang", source=Source.user_request("C99", at="2026-09-21T10:00:00+08:00"),
            wait=False)

asyncio.run(main())
"""


async def test_forget_by_another_process_is_unreadable_at_once(
        db_url: str, register_path: str) -> None:
    """Another process appends a forget and projects nothing: the next `get` here
    returns nothing, on the point-read path (SQLite) and the async path (PostgreSQL)."""
    async with MemoryLedger(db_url, register_path=register_path) as ml:
        u7 = ml.principal("shop-a", "u7")
        await u7.remember(["prefs"], "lang", "zh", source=Source.user_request("C1", at=AT))
        assert (await u7.get(["prefs"], "lang")) is not None
        assert (ml.store.recorder.point_reads() is not None) == db_url.startswith("sqlite")
        await asyncio.to_thread(subprocess.run, [sys.executable, "-c", FORGET, db_url,
                                                 register_path], cwd=ROOT, check=True,
                                timeout=120)
        assert (await u7.get(["prefs"], "lang")) is None
        # the view still holds the row as active: the tombstone alone hides it
        async with ml.store.read() as conn:
            n = (await conn.exec_driver_sql(
                "SELECT count(*) FROM mem_versions WHERE status = 'active'")).scalar()
        assert n == 1


def test_point_reads_only_for_plain_files(tmp_path: Path) -> None:
    """In-memory databases, `file:` URIs, URLs with options and PostgreSQL take the
    async path: a second connection there would not see the same database."""
    assert file_path("sqlite+aiosqlite:///./x.db") == "./x.db"
    assert file_path("sqlite+aiosqlite:///:memory:") is None
    assert file_path("sqlite+aiosqlite://") is None
    assert file_path("sqlite+aiosqlite:///x.db?mode=ro") is None
    assert file_path("sqlite+aiosqlite:///file:x.db") is None
    assert file_path("postgresql+asyncpg://u@h/db") is None
    mem = Store("sqlite+aiosqlite:///:memory:", register_path=str(tmp_path / "r.forgets"))
    assert mem.recorder.point_reads() is None


async def _ledger(path: Path) -> Store:
    store = Store(f"sqlite+aiosqlite:///{path}", register_path=str(path) + ".forgets")
    await store.open()
    ev = builders.write(tenant="shop-a", actor="u7", namespace=["shop-a", "u7", "prefs"],
                        key="lang", value="zh", source=Source.user_request("C1", at=AT))
    await store.append([ev])
    await Runner(store, [MemoryProjection()]).catch_up()
    return store


def _get_now(store: Store) -> dict[str, Any] | None:
    return reads.get_now(store, reads.Principal("shop-a", "u7"), ["shop-a", "u7", "prefs"],
                         "lang", now_us=time.time_ns() // 1000)


async def test_busy_file_falls_back_to_the_async_path(tmp_path: Path) -> None:
    """While another connection holds the file exclusively, a point read gives up at
    once (it never blocks the event loop) and `Principal.get` waits on the async path."""
    db = tmp_path / "ledger.db"
    store = await _ledger(db)
    await store.close()
    async with MemoryLedger(f"sqlite+aiosqlite:///{db}",
                            register_path=str(db) + ".forgets") as ml:
        await ml.store.engine.dispose()  # no connection of ours holds the file now
        holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        try:
            holder.execute("PRAGMA locking_mode=EXCLUSIVE")
            holder.execute("BEGIN EXCLUSIVE")
            t0 = time.perf_counter()
            assert _get_now(ml.store) is None
            assert time.perf_counter() - t0 < 1.0

            timer = threading.Timer(0.3, holder.close)  # closing drops its locks
            timer.start()
            got = await ml.principal("shop-a", "u7").get(["prefs"], "lang")
            timer.join()
        finally:
            holder.close()
        assert got is not None and got.value == "zh"
        assert _get_now(ml.store) == got.to_dict()


async def test_point_connection_never_writes_nor_pins_the_wal(tmp_path: Path) -> None:
    """The point-read connection is query-only, and after a read it holds no snapshot:
    a truncating checkpoint (what follows an erasure) empties the WAL (R20)."""
    db = tmp_path / "ledger.db"
    store = await _ledger(db)
    try:
        points = store.recorder.point_reads()
        assert isinstance(points, PointReads)
        assert points.rows("DELETE FROM mem_versions", []) is None
        assert _get_now(store) is not None
        ev = builders.write(tenant="shop-a", actor="u7", namespace=["shop-a", "u7", "prefs"],
                            key="tone", value="brief", source=Source.user_request("C2", at=AT))
        await store.append([ev])
        assert _get_now(store) is not None
        check = sqlite3.connect(db, isolation_level=None)
        try:
            busy, _log, _done = check.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            check.close()
        assert busy == 0
        assert Path(str(db) + "-wal").stat().st_size == 0  # noqa: ASYNC240
    finally:
        await store.close()


async def test_close_and_fork_open_new_connections(tmp_path: Path) -> None:
    """Closing the store closes every thread's point connection (a later read opens a
    new one); a forked child opens its own instead of using its parent's."""
    db = tmp_path / "ledger.db"
    store = await _ledger(db)
    points = store.recorder.point_reads()
    assert isinstance(points, PointReads)
    try:
        assert _get_now(store) is not None
        first = points._connection()
        other: list[Any] = []
        t = threading.Thread(target=lambda: other.append(points._connection()))
        t.start()
        t.join()
        assert other[0] is not first  # one connection per thread
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report whether it got a connection of its own
            try:
                ok = points._connection() is not first and _get_now(store) is not None
                os.write(w, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1"
        os.close(r)
        os.waitpid(pid, 0)  # noqa: ASYNC222 - the child has written, it is exiting
        assert points._connection() is first  # the parent's own is untouched
    finally:
        await store.close()
    try:
        first.execute("SELECT 1")
        raise AssertionError("the connection is still open after close")
    except sqlite3.ProgrammingError:
        pass
    assert points._connection() is not first


# -- the point path answers exactly as the async path, for any ledger -------------------

KEYS = ["lang", "tone"]
NS = [["prefs"], ["prefs", "work"], ["other"]]
step = st.one_of(
    st.tuples(st.just("write"), st.sampled_from(["u7", "u8"]), st.sampled_from(range(3)),
              st.sampled_from(KEYS), st.sampled_from(["long", "task", "session"]),
              st.booleans()),
    st.tuples(st.just("forget_key"), st.sampled_from(["u7", "u8"]), st.sampled_from(range(3)),
              st.sampled_from(KEYS)),
    st.tuples(st.just("forget_prefix"), st.sampled_from(["u7", "u8"]),
              st.sampled_from(range(3))),
    st.tuples(st.just("project")),
)


def _event(i: int, s: tuple[Any, ...]) -> Any:
    src = Source.user_request(f"C{i}", at=f"2026-09-20T10:{i // 60:02d}:{i % 60:02d}+08:00")
    kind, user = s[0], s[1]
    if kind == "write":
        ns, key, layer, expired = NS[s[2]], s[3], s[4], s[5]
        return builders.write(
            tenant="shop-a", actor=user, namespace=["shop-a", user, *ns], key=key,
            value=f"v{i}", source=src, task="T1" if layer == "task" else None,
            session="S1" if layer == "session" else None,
            expires_at="2020-01-01T00:00:00Z" if expired else None)
    if kind == "forget_key":
        return builders.forget_key(tenant="shop-a", actor=user,
                                   namespace=["shop-a", user, *NS[s[2]]], key=s[3], source=src)
    return builders.forget_prefix(tenant="shop-a", actor=user,
                                  namespace_prefix=["shop-a", user, *NS[s[2]][:1]], source=src)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=1, max_size=12))
@example(steps=[("write", "u7", 0, "lang", "long", False), ("project",),
                ("forget_key", "u7", 0, "lang")])
@example(steps=[("write", "u7", 1, "tone", "task", False), ("project",),
                ("forget_prefix", "u7", 1), ("write", "u7", 1, "tone", "long", False)])
async def test_point_path_answers_as_the_async_path(tmp_path: Path, steps: list[Any]) -> None:
    """For any sequence of writes (every layer, some expired), forgets by key and by
    prefix and projection runs, every principal, key, task and session: the point read
    and the async `reads.get` give the same answer (the same SQL, R15, R20, R24)."""
    db = tmp_path / f"p{time.monotonic_ns()}.db"
    store = Store(f"sqlite+aiosqlite:///{db}", register_path=str(db) + ".forgets")
    await store.open()
    try:
        runner = Runner(store, [MemoryProjection()])
        for i, s in enumerate(steps):
            if s[0] == "project":
                await runner.catch_up()
            else:
                await store.append([_event(i, s)])
        now = time.time_ns() // 1000
        for user in ("u7", "u8"):
            who = reads.Principal("shop-a", user)
            for owner in ("u7", "u8"):
                for ns in NS:
                    for key in KEYS:
                        for task, session in ((None, None), ("T1", None), ("T1", "S1")):
                            full = ["shop-a", owner, *ns]
                            fast = reads.get_now(store, who, full, key, now_us=now,
                                                 task=task, session=session)
                            async with store.read() as conn:
                                slow = await reads.get(conn, who, full, key, now_us=now,
                                                       task=task, session=session)
                            assert fast == slow
                            if owner != user:
                                assert fast == {"found": False}
    finally:
        await store.close()


NAME = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)


@settings(max_examples=300, deadline=None)
@given(tenant=NAME, user=NAME, tail=st.lists(NAME, max_size=3), key=NAME,
       task=st.none() | NAME, session=st.none() | NAME,
       now=st.integers(-(2**63), 2**63 - 1))
def test_get_parameters_are_the_statements_own(tenant: str, user: str, tail: list[str],
                                               key: str, task: str | None,
                                               session: str | None, now: int) -> None:
    """`get_now`'s positional parameters, filled into a template, are for any values
    the ones `PointQuery.parameters` gives by name: the statement's own values (status,
    layers, tombstone kinds, the substr start) in place, each of the call's at its bind."""
    who = reads.Principal(tenant, user)
    ns = [tenant, user, *tail]
    want = reads._GET_POINT.parameters(reads._get_values(who, ns, key, now, task, session))
    got = reads._get_parameters(who, ns, key, now, task, session)
    assert got == want
    assert reads._get_parameters(who, ns, key, now, task, session) is not got  # a copy
    blank = reads._GET_POINT.parameters(dict.fromkeys(reads._GET_VARIABLES))
    assert blank == reads._GET_TEMPLATE  # the template itself never changes
