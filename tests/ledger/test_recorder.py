"""The recorder contract, one suite for both backends (`db_url` runs it on SQLite and on
PostgreSQL): every verb of `ledger.recorder.Recorder` (docs/architecture.md, R18)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.appender import event_row, seal
from ledger.backends.postgres import PostgresRecorder
from ledger.backends.sqlite import SQLiteRecorder, database_files
from ledger.chain import GENESIS, ChainCheck
from ledger.recorder import Recorder, WriteLock
from ledger.records import now_iso
from ledger.store import Store
from ledger.validation import parse_event
from tests.factories import src, write


def _events(n: int, prefix: str) -> list[Any]:
    return [parse_event(write(f"k{i % 3}", f"{prefix}-{i}", idem=f"{prefix}-{i}",
                              source=src(seq=i)))
            for i in range(n)]


async def _sealed(rec: Recorder, conn: AsyncConnection, evs: list[Any]) -> list[dict[str, Any]]:
    """Rows for `evs` after the last stored event, linked to the chain."""
    position, prev = await rec.last_link(conn)
    rows = []
    for ev in evs:
        position += 1
        row = event_row(ev, position, now_iso(), suppressed=False, owner_path=None)
        prev = seal(row, prev)
        rows.append(row)
    return rows


async def _all_rows(store: Store) -> list[dict[str, Any]]:
    async with store.read() as conn:
        res = await conn.execute(select(t.events).order_by(t.events.c.position))
        return [dict(r._mapping) for r in res.all()]


def test_recorder_is_the_backends_own(store: Store) -> None:
    """A SQLite URL gets the SQLite recorder, any other the PostgreSQL one."""
    want = SQLiteRecorder if store.url.startswith("sqlite") else PostgresRecorder
    assert type(store.recorder) is want
    assert store.dialect == store.recorder.name == want.name
    assert store.engine is store.recorder.engine


async def test_empty_ledger(store: Store) -> None:
    """No events: head 0, the chain starts at GENESIS, nothing to select."""
    rec = store.recorder
    async with store.read() as conn:
        assert await rec.max_position(conn) == 0
        assert await rec.last_link(conn) == (0, GENESIS)
        assert await rec.select_events(conn, 0, 10) == []
        assert list(await rec.select_tombstones(conn)) == []


async def test_insert_then_select_events(store: Store) -> None:
    """Inserted rows come back in position order, filtered by after/upto/limit/types,
    with their content decoded; max position and last link follow the inserts."""
    rec = store.recorder
    evs = _events(6, "ins")
    async with store.write() as conn:
        rows = await _sealed(rec, conn, evs)
        await rec.insert_events(conn, rows)
    async with store.read() as conn:
        got = await rec.select_events(conn, 0, 100)
        assert [se.position for se in got] == [1, 2, 3, 4, 5, 6]
        assert [se.idempotency_key for se in got] == [e.idempotency_key for e in evs]
        assert all(se.event is not None and se.event.data == e.data
                   for se, e in zip(got, evs, strict=True))
        assert [se.position for se in await rec.select_events(conn, 2, 2)] == [3, 4]
        assert [se.position for se in await rec.select_events(conn, 2, 100, upto=4)] == [3, 4]
        assert await rec.select_events(conn, 0, 100, types=("task.opened",)) == []
        assert len(await rec.select_events(conn, 0, 100, types=("memory.written",))) == 6
        assert await rec.max_position(conn) == 6
        assert await rec.last_link(conn) == (6, rows[-1]["chain"])
    check = ChainCheck()
    assert all(check.holds(r) for r in await _all_rows(store))


async def test_insert_events_is_atomic_on_a_taken_key(store: Store) -> None:
    """A row whose (tenant, idempotency key) or position is taken fails the insert, and
    the transaction writes nothing."""
    rec = store.recorder
    await store.append(_events(2, "taken"))

    async def insert_both() -> None:
        async with store.write() as conn:
            fresh = await _sealed(rec, conn, _events(1, "fresh"))
            again = await _sealed(rec, conn, _events(1, "taken"))
            again[0]["position"] = fresh[0]["position"] + 1
            await rec.insert_events(conn, [*fresh, *again])

    with pytest.raises(IntegrityError):
        await insert_both()
    assert await store.head() == 2


async def test_positions_are_gap_free_under_concurrent_appends(store: Store) -> None:
    """Concurrent appends (many transactions) get positions 1..n without a gap, and the
    chain links every row to the one before."""
    batches = [_events(5, f"c{i}") for i in range(12)]
    await asyncio.gather(*(store.append(b) for b in batches))
    rows = await _all_rows(store)
    assert [r["position"] for r in rows] == list(range(1, 61))
    check = ChainCheck()
    assert all(check.holds(r) for r in rows)


async def test_insert_ignore_is_idempotent(store: Store) -> None:
    """An insert-ignore of a key already there changes nothing, however often."""
    rec = store.recorder
    cp = t.checkpoints.c
    for _ in range(3):
        async with store.view_write() as conn:
            await conn.execute(rec.insert_ignore(t.checkpoints).values(name="x", position=0))
    async with store.view_write() as conn:
        await conn.execute(update(t.checkpoints).where(cp.name == "x").values(position=7))
        await conn.execute(rec.insert_ignore(t.checkpoints).values(name="x", position=0))
    async with store.read() as conn:
        rows = (await conn.execute(select(cp.name, cp.position).where(cp.name == "x"))).all()
    assert [tuple(r) for r in rows] == [("x", 7)]


async def test_erase_payloads(store: Store) -> None:
    """Erasure nulls the payloads it matches and marks them redacted, only once; the
    envelopes and the chain stay."""
    rec = store.recorder
    res = await store.append(_events(6, "er"))
    ev = t.events.c
    async with store.view_write() as conn:
        n = await Recorder.erase_payloads(conn, ev.mkey == "k0")
        again = await Recorder.erase_payloads(conn, ev.mkey == "k0")
    assert (n, again) == (2, 0)
    async with store.read() as conn:
        got = await rec.select_events(conn, 0, 100)
    erased = [se.position for se in got if se.redacted]
    assert erased == [res[0].position, res[3].position]
    assert all(se.event is None for se in got if se.redacted)
    assert all(se.event is not None for se in got if not se.redacted)
    check = ChainCheck()
    assert all(check.holds(r) for r in await _all_rows(store))


async def test_tombstones(store: Store) -> None:
    """Tombstone rows go in and come back by tenant and up to a position."""
    rec = store.recorder
    rows = [{"position": p, "tenant": tn, "kind": "key", "memory_id": None,
             "ns_path": f"{tn}\x1fu7", "mkey": "k", "task_key": None,
             "order_key": bytes([p]) * 16}
            for p, tn in ((1, "shop-a"), (2, "shop-b"), (3, "shop-a"))]
    async with store.write() as conn:
        await rec.insert_tombstones(conn, rows)
    async with store.read() as conn:
        assert sorted(r.position for r in await rec.select_tombstones(conn)) == [1, 2, 3]
        assert sorted(r.position for r in
                      await rec.select_tombstones(conn, ["shop-a"])) == [1, 3]
        assert sorted(r.position for r in
                      await rec.select_tombstones(conn, ["shop-a"], upto=2)) == [1]
        ts = await store.tombstones(conn, ["shop-b"])
    assert [(x.position, x.tenant, x.kind, x.order_key) for x in ts] == [
        (2, "shop-b", "key", bytes([2]) * 16)]


async def test_import_rows_keep_positions_and_links(store: Store, tmp_path: Path) -> None:
    """Imported rows (a restore) keep their positions and links: appends continue the
    chain after them, and generated keys continue after the imported ones."""
    source = Store(f"sqlite+aiosqlite:///{tmp_path / 'source.db'}",
                   register_path=str(tmp_path / "source.forgets"))
    await source.open()
    try:
        await source.append(_events(4, "imp"))
        rows = await _all_rows(source)
    finally:
        await source.close()
    rec = store.recorder
    async with store.write() as conn:
        await rec.import_rows(conn, t.events, rows)
        await rec.import_rows(conn, t.dead_letters, [
            {"id": 41, "received_at": now_iso(), "tenant": "shop-a", "idempotency_key": "d",
             "error": "bad", "payload": None}])
        await rec.after_import(conn)
    assert await _all_rows(store) == rows
    res = await store.append(_events(2, "after"))
    assert [r.position for r in res] == [5, 6]
    check = ChainCheck()
    assert all(check.holds(r) for r in await _all_rows(store))
    async with store.view_write() as conn:
        await conn.execute(t.dead_letters.insert().values(
            received_at=now_iso(), tenant="shop-a", idempotency_key="e", error="bad"))
    async with store.read() as conn:
        ids = sorted(int(r[0]) for r in (await conn.execute(select(t.dead_letters.c.id))).all())
    assert ids[0] == 41 and ids[1] > 41


async def test_delete_rows(store: Store) -> None:
    """Rows go, all of a table or those matching a condition."""
    rec = store.recorder
    m = t.meta.c
    async with store.write() as conn:
        await conn.execute(t.meta.insert(), [{"name": "a", "value": "1"},
                                             {"name": "b", "value": "2"}])
        await rec.delete_rows(conn, t.meta, m.name == "a")
    async with store.read() as conn:
        names = {r[0] for r in (await conn.execute(select(m.name))).all()}
    assert "a" not in names and {"b", "schema_version"} <= names
    await store.append(_events(2, "del"))
    async with store.write() as conn:
        await rec.delete_rows(conn, t.events)
    assert await store.head() == 0


async def test_bytewise_order_is_the_same_on_both_backends(store: Store) -> None:
    """Text keys sort bytewise (as Python sorts str), whatever the collation: on
    PostgreSQL even a column read under a linguistic (ICU) collation."""
    rec = store.recorder
    names = ["b", "B", "a", "_x", "A1", "é", "Z", "~"]
    async with store.write() as conn:
        await conn.execute(t.meta.insert(), [{"name": n, "value": ""} for n in names])
    col: Any = t.meta.c.name
    if isinstance(rec, PostgresRecorder):
        col = col.collate("und-x-icu")  # sorts a, A1, b, B, ... unless made bytewise
    async with store.read() as conn:
        q = select(t.meta.c.name).where(t.meta.c.name != "schema_version")
        got = [r[0] for r in (await conn.execute(q.order_by(rec.bytewise(col))))]
    assert got == sorted(names)


async def _serialised(first: Callable[[asyncio.Event], Awaitable[None]],
                      second: Callable[[], Awaitable[None]]) -> None:
    """Start `first`, then `second` once `first` (holding its transaction open) says
    it is in."""
    inside = asyncio.Event()
    a = asyncio.create_task(first(inside))
    await asyncio.wait_for(inside.wait(), 30)
    await asyncio.gather(a, second())


async def test_write_transactions_are_serial(store: Store) -> None:
    """A second write transaction takes the ledger's write lock only after the first
    commits (so insert order equals commit order)."""
    log: list[str] = []

    async def first(inside: asyncio.Event) -> None:
        async with store.write() as conn:
            await store.recorder.max_position(conn)
            log.append("first in")
            inside.set()
            await asyncio.sleep(0.4)
            log.append("first out")

    async def second() -> None:
        async with store.write() as conn:
            log.append("second in")
            await store.recorder.max_position(conn)

    await _serialised(first, second)
    assert log == ["first in", "first out", "second in"]


@pytest.mark.parametrize("lock", list(WriteLock))
async def test_advisory_lock_serialises_its_writers(store: Store, lock: WriteLock) -> None:
    """Two view transactions holding the same write lock run one after the other."""
    log: list[str] = []

    async def hold(name: str, pause: float, inside: asyncio.Event | None = None) -> None:
        async with store.view_write() as conn:
            await store.recorder.advisory_lock(conn, lock)
            log.append(f"{name} in")
            if inside is not None:
                inside.set()
            await asyncio.sleep(pause)
            await conn.execute(store.recorder.for_update(
                select(t.meta.c.value).where(t.meta.c.name == "schema_version")))
            log.append(f"{name} out")

    await _serialised(lambda inside: hold("first", 0.4, inside), lambda: hold("second", 0))
    assert log == ["first in", "first out", "second in", "second out"]


async def test_read_is_one_snapshot(store: Store) -> None:
    """A read transaction keeps seeing the ledger as it was at its first read."""
    await store.append(_events(2, "snap"))
    async with store.read() as conn:
        assert await store.recorder.max_position(conn) == 2
        await store.append(_events(3, "later"))
        assert await store.recorder.max_position(conn) == 2
        assert len(await store.recorder.select_events(conn, 0, 100)) == 2
    async with store.read_once() as conn:
        assert await store.recorder.max_position(conn) == 5


async def test_session_set_up(store: Store) -> None:
    """Each backend's session settings: SQLite WAL and secure delete; PostgreSQL an
    idle-in-transaction timeout that a long transaction can lift for itself."""
    rec = store.recorder
    async with store.read() as conn:
        await rec.keep_transaction_open(conn)
        if isinstance(rec, SQLiteRecorder):
            assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
            assert (await conn.exec_driver_sql("PRAGMA secure_delete")).scalar() == 1
        else:
            show = text("SHOW idle_in_transaction_session_timeout")
            assert (await conn.execute(show)).scalar() == "0"
    if isinstance(rec, PostgresRecorder):
        async with store.read() as conn:
            assert (await conn.execute(show)).scalar() == "1min"
            assert (await conn.execute(text("SHOW application_name"))).scalar() == "memledger"


async def test_reclaim_after_an_erasure(store: Store) -> None:
    """After an erasure, reclaiming leaves no old copies where the backend can tell
    (SQLite: an empty WAL, secure delete on)."""
    await store.append(_events(30, "rc"))
    async with store.view_write() as conn:
        assert await Recorder.erase_payloads(conn, t.events.c.mkey == "k1") == 10
    await store.reclaim()
    assert await store.recorder.erasure_leftovers() == []
    async with store.read() as conn:
        counts = await store.recorder.dead_row_counts(conn)
    if isinstance(store.recorder, SQLiteRecorder):
        wal = database_files(store.url)[1]
        assert not wal.exists() or wal.stat().st_size == 0
        assert counts == {}
    else:
        assert set(counts) <= {"events", "mem_versions", "task_notes", "tasks_view",
                               "vectors", "lexical_docs", "mem_history", "dead_letters"} \
            and "events" in counts
