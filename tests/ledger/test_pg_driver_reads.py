"""PostgreSQL point reads on the recorder's own asyncpg connections (issue 20: get p99
within 3x of a raw asyncpg SELECT). `Principal.get` runs its one statement straight on
a driver connection (`ledger.backends.postgres.DriverReads`); these tests show it keeps
what the pooled path gave: the principal's scope and the tombstones in the statement
(R15, R20), fresh reads across processes, a killed backend retried once, and the pooled
path when every point-read connection is busy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from ledger.builders import Source
from memledger import MemoryLedger
from projections import reads

pytestmark = pytest.mark.postgres

SRC = Source.user_request("C1")
_KILL = ("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
         "WHERE application_name = 'memledger' AND datname = current_database() "
         "AND pid <> pg_backend_pid()")


async def _admin(pg_url: str, sql: str) -> int:
    conn = await asyncpg.connect(pg_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        return int(await conn.fetchval(sql))
    finally:
        await conn.close()


async def test_get_runs_on_driver_connections_with_the_same_answer(pg_url: str,
                                                                  tmp_path: Path) -> None:
    """The driver path answers as the pooled SQLAlchemy path does, for the owner, another
    user of the tenant and a user of another tenant with the same namespace names; gets
    beyond the point-read connections' limit run on the pool."""
    async with MemoryLedger(pg_url, register_path=str(tmp_path / "f")) as ml:
        me = ml.principal("shop-a", "u1")
        await me.remember(["prefs"], "seat", "window", source=SRC)
        await me.remember(["prefs"], "seat", "aisle", source=SRC, session="S1")
        await ml.principal("shop-b", "u1").remember(["prefs"], "seat", "middle",
                                                    source=SRC)
        store = ml.store
        for who, ns in ((me._who, ["shop-a", "u1", "prefs"]),
                        (reads.Principal("shop-b", "u1"), ["shop-b", "u1", "prefs"]),
                        (reads.Principal("shop-a", "u2"), ["shop-a", "u1", "prefs"]),
                        (reads.Principal("shop-c", "u1"), ["shop-c", "u1", "prefs"])):
            for session in (None, "S1"):
                fast = await reads.get_driver(store, who, ns, "seat", now_us=0,
                                              session=session)
                async with store.read_once() as conn:
                    slow = await reads.get(conn, who, ns, "seat", now_us=0,
                                           session=session)
                assert fast == slow
        got = await me.get(["prefs"], "seat", session="S1")
        assert got is not None and got.value == "aisle"
        reader = store.recorder.driver_reads()
        assert reader is not None and reader._idle  # the point read took its own path
        # More concurrent gets than point-read connections: the rest take the pooled
        # path, and the point reads never open more than their limit.
        many = await asyncio.gather(*(me.get(["prefs"], "seat") for _ in range(40)))
        assert all(g is not None and g.value == "window" for g in many)
        assert 1 <= len(reader._idle) <= reader._limit


async def test_a_second_process_sees_writes_and_forgets_at_once(pg_url: str,
                                                                tmp_path: Path) -> None:
    """Nothing is cached above the server: a ledger opened separately (another process)
    reads a value the moment it is projected, and loses it the moment a forget is
    appended, before any projection ran (R20)."""
    async with MemoryLedger(pg_url, register_path=str(tmp_path / "a")) as writer, \
            MemoryLedger(pg_url, register_path=str(tmp_path / "b")) as other:
        mine, theirs = writer.principal("shop-a", "u1"), other.principal("shop-a", "u1")
        assert await theirs.get(["prefs"], "tone") is None
        await mine.remember(["prefs"], "tone", "brief", source=SRC)
        got = await theirs.get(["prefs"], "tone")
        assert got is not None and got.value == "brief"
        later = Source.user_request("C2", at="2999-01-01T00:00:00Z")  # after the write
        await mine.forget(["prefs"], "tone", source=later, wait=False)
        assert await theirs.get(["prefs"], "tone") is None


async def test_get_right_after_its_backend_is_killed_is_retried(pg_url: str,
                                                               tmp_path: Path) -> None:
    """A point read whose connection the server just ended (the client has not seen the
    close yet) runs again on a new connection: no error reaches the caller."""
    async with MemoryLedger(pg_url, register_path=str(tmp_path / "f")) as ml:
        me = ml.principal("shop-a", "u1")
        await me.remember(["prefs"], "seat", "window", source=SRC)
        assert await me.get(["prefs"], "seat") is not None
        reader = ml.store.recorder.driver_reads()
        assert reader is not None
        before = {c.get_server_pid() for c in reader._idle}
        assert before
        assert await _admin(pg_url, _KILL) >= 1
        got = await me.get(["prefs"], "seat")  # no pause: the retry saves it
        assert got is not None and got.value == "window"
        assert {c.get_server_pid() for c in reader._idle}.isdisjoint(before)
