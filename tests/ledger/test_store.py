"""The ledger contract on every backend: append, idempotency, order, concurrency (R11, R18)."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from ledger import schema as t
from ledger.chain import GENESIS, chain_link
from ledger.errors import ConcurrencyConflict, IdempotencyConflict, ValidationError
from ledger.store import Store
from ledger.validation import parse_event
from tests.factories import event, src, write


async def rows(store: Store) -> list[Any]:
    async with store.read() as conn:
        return list((await conn.execute(select(t.events).order_by(t.events.c.position))).all())


async def test_append_assigns_positions_from_one(store: Store) -> None:
    """Positions start at 1 and grow by one per appended event."""
    res = await store.append([parse_event(write("a", 1)), parse_event(write("b", 2))])
    assert [r.position for r in res] == [1, 2]
    assert [r.status for r in res] == ["appended", "appended"]
    assert await store.head() == 2


async def test_duplicate_reports_original_position(store: Store) -> None:
    """The same key with the same content is a duplicate: no new event (R11)."""
    ev = parse_event(write("a", 1, idem="k1"))
    first = await store.append_one(ev)
    again = await store.append_one(parse_event(write("a", 1, idem="k1")))
    assert again.status == "duplicate"
    assert again.position == first.position
    assert await store.head() == 1


async def test_reused_key_with_other_content_rejected(store: Store) -> None:
    """The same key with different content is rejected with the contract's message."""
    await store.append_one(parse_event(write("a", 1, idem="k2")))
    with pytest.raises(IdempotencyConflict, match="idempotency key 'k2' reused with "
                       "different content"):
        await store.append_one(parse_event(write("a", 2, idem="k2")))


async def test_key_is_per_tenant(store: Store) -> None:
    """Idempotency keys are unique within a tenant, not across tenants."""
    await store.append_one(parse_event(write("a", 1, idem="k")))
    res = await store.append_one(parse_event(write("a", 1, idem="k", tenant="shop-b")))
    assert res.status == "appended"


async def test_batch_is_atomic(store: Store) -> None:
    """A batch with one rejected event appends none of its events."""
    await store.append_one(parse_event(write("a", 1, idem="taken")))
    with pytest.raises(IdempotencyConflict):
        await store.append([parse_event(write("b", 1)), parse_event(write("a", 9, idem="taken"))])
    assert await store.head() == 1


async def test_expected_version_conflict_appends_nothing(store: Store) -> None:
    """A stale expected version raises a conflict and appends nothing (R18)."""
    first = write("lang", "zh")
    await store.append_one(parse_event({**first, "expected_version": 0}))
    second = write("lang", "en")
    await store.append_one(parse_event({**second, "expected_version": 1}))
    with pytest.raises(ConcurrencyConflict, match=r"expected version 1 .* at 2"):
        await store.append_one(parse_event({**write("lang", "fr"), "expected_version": 1}))
    assert await store.head() == 2


async def test_concurrent_expected_version_one_winner(store: Store) -> None:
    """Of concurrent writers stating the same expected version, exactly one wins (R18)."""
    evs = [parse_event({**write("lang", f"v{i}"), "expected_version": 0}) for i in range(6)]
    results = await asyncio.gather(*(store.append_one(e) for e in evs), return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 1
    assert all(isinstance(r, ConcurrencyConflict) for r in results
               if isinstance(r, BaseException))


async def test_user_cannot_touch_others_memory(store: Store) -> None:
    """A user-sourced supersede of another user's memory is rejected without revealing it."""
    res = await store.append_one(parse_event(write("lang", "zh", user="u7")))
    async with store.read() as conn:
        mid = (await conn.execute(select(t.events.c.memory_id))).scalar()
    with pytest.raises(ValidationError, match="that 'u8' may change"):
        await store.append_one(parse_event(event("memory.superseded", {"memory_id": mid},
                                                 actor="u8")))
    assert res.position == 1


async def test_user_notes_need_own_open_task(store: Store) -> None:
    """A user's task note must name a task the user owns (R24)."""
    await store.append_one(parse_event(event("task.opened", {
        "task_key": "T900", "namespace": ["shop-a", "u7", "tickets"]},
        source=src("system_of_record", "aftersales"), actor="aftersales")))
    note = {"task_key": "T900", "kind": "user_report", "text": "left earbud crackles"}
    assert (await store.append_one(parse_event(event("task.noted", note)))).status == "appended"
    with pytest.raises(ValidationError, match="no open task 'T900' owned by 'u8'"):
        await store.append_one(parse_event(event("task.noted", note, actor="u8")))


async def test_memory_id_reuse_rejected(store: Store) -> None:
    """An explicit memory_id names one write only."""
    await store.append_one(parse_event(write("a", 1, memory_id="M18")))
    with pytest.raises(ValidationError, match="memory_id 'M18' is already used"):
        await store.append_one(parse_event(write("a", 2, memory_id="M18")))


async def test_hash_chain_links_every_event(store: Store) -> None:
    """Each event's chain value hashes the previous one and its envelope."""
    await store.append([parse_event(write(f"k{i}", i)) for i in range(5)])
    prev = GENESIS
    for r in await rows(store):
        prev = chain_link(prev, dict(r._mapping))
        assert r.chain == prev


async def test_forget_goes_to_register_before_return(store: Store) -> None:
    """A forget is in the forget register (without its reason) once append returns (R21)."""
    await store.append_one(parse_event(event("memory.forgotten", {
        "namespace": ["shop-a", "u7", "preferences"], "key": "lang",
        "reason": "user asked on C18"})))
    entries = list(store.register.entries())
    assert len(entries) == 1
    assert entries[0]["event"]["data"] == {"namespace": ["shop-a", "u7", "preferences"],
                                           "key": "lang"}


@pytest.mark.slow
async def test_concurrent_appenders_and_tailing_readers(store: Store) -> None:
    """8 appenders x 500 events with 2 tailers: no skipped, duplicate or interleaved position."""
    per, writers = 500, 8
    done = asyncio.Event()
    seen: list[list[int]] = [[], []]

    async def appender(w: int) -> list[list[int]]:
        batches = []
        for b in range(per // 10):
            evs = [parse_event(write(f"w{w}", i, idem=f"w{w}-{b}-{i}")) for i in range(10)]
            res = await store.append(evs)
            batches.append([r.position for r in res])
        return batches

    async def tailer(n: int) -> None:
        pos = 0
        while True:
            async with store.read() as conn:
                got = await store.read_events(conn, pos, 500)
            for se in got:
                assert se.position == pos + 1, "a reader skipped a position"
                pos = se.position
                seen[n].append(pos)
            if not got:
                if done.is_set() and pos == per * writers:
                    return
                await asyncio.sleep(0.005)

    tails = [asyncio.create_task(tailer(i)) for i in range(2)]
    results = await asyncio.gather(*(appender(w) for w in range(writers)))
    done.set()
    await asyncio.wait_for(asyncio.gather(*tails), 60)
    for batches in results:
        for b in batches:
            assert b == list(range(b[0], b[0] + len(b))), "a batch was interleaved"
    all_pos = sorted(p for batches in results for b in batches for p in b)
    assert all_pos == list(range(1, per * writers + 1))
    assert seen[0] == seen[1] == all_pos


async def test_concurrent_duplicates_store_one_event(store: Store) -> None:
    """Concurrent appends of one idempotency key store exactly one event (R11)."""
    evs = [parse_event(write("a", 1, idem="same")) for _ in range(20)]
    results = await asyncio.gather(*(store.append_one(e) for e in evs))
    assert {r.position for r in results} == {1}
    assert sorted(r.status for r in results).count("appended") == 1
    assert await store.head() == 1


async def test_two_stores_share_one_database(db_url: str, register_path: str) -> None:
    """Two processes' worth of stores append concurrently without clashing positions."""
    a, b = Store(db_url, register_path=register_path), Store(db_url, register_path=register_path)
    try:
        await asyncio.gather(*(s.append([parse_event(write("k", i, idem=f"{n}-{i}"))])
                               for n, s in (("a", a), ("b", b)) for i in range(50)))
        assert await a.head() == 100
    finally:
        await a.close()
        await b.close()


_BODIES = st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(0, 3)),
                   min_size=1, max_size=6)


@pytest.mark.parametrize("inline", [False, True], ids=["async", "inline"])
@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies=_BODIES)
async def test_transaction_commits_all_of_a_body_or_nothing(
        store: Store, inline: bool, bodies: list[tuple[bool, bool, int]]) -> None:
    """`Store.transaction` (the append group, the projection round and the recall audit
    run through it), on the async driver and on the inline thread, as a ledger write
    and as a view write: for any sequence of bodies, each writing some rows and then
    returning or raising, exactly the rows of the bodies that returned are there, each
    body's value is returned and each body's error raised as it was (R14's
    commit-or-nothing). PostgreSQL has no inline path: `use_inline` is off there."""
    from sqlalchemy.ext.asyncio import AsyncConnection

    from ledger.inline import SyncBacked

    if inline and not store.use_inline():
        assert store.dialect != "sqlite" and store.inline is None
        return
    assert (store.inline is not None) is inline
    run = uuid.uuid4().hex
    expected: set[str] = set()
    for i, (views, fails, n) in enumerate(bodies):
        names = [f"tx:{run}:{i}:{k}" for k in range(n)]

        async def body(conn: AsyncConnection, names: list[str] = names,
                       fails: bool = fails) -> int:
            assert isinstance(conn, SyncBacked) is inline
            for name in names:
                await conn.execute(t.meta.insert().values(name=name, value="x"))
            if fails:
                raise LookupError(f"body {names}")
            return len(names)

        if fails:
            with pytest.raises(LookupError, match="body"):
                await store.transaction(body, views=views)
        else:
            assert await store.transaction(body, views=views) == n
            expected.update(names)
    async with store.read() as conn:
        got = {str(r[0]) for r in (await conn.execute(select(t.meta.c.name).where(
            t.meta.c.name.startswith(f"tx:{run}:")))).all()}
    assert got == expected


def _header_pages(path: str) -> int:
    """The database size in pages that the file's own header records (bytes 28-31):
    what a checkpoint has copied out of the WAL, not what the WAL still holds."""
    with open(path, "rb") as f:
        return int.from_bytes(f.read(100)[28:32], "big")


async def test_inline_commits_leave_checkpoints_to_the_checkpointer(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the inline thread SQLite's automatic checkpoint is off (it would hold up the
    transactions queued behind the commit that runs it); the WAL still reaches the
    database file, by PASSIVE checkpoints on a thread of their own (`ledger.inline`)."""
    import sqlite3

    from ledger import inline as inline_mod
    from ledger.backends.sqlite import file_path

    if not store.use_inline():
        assert store.dialect != "sqlite"
        return
    monkeypatch.setattr(inline_mod, "CHECKPOINT_EVERY_S", 0.0)
    assert store.inline is not None
    for i in range(40):
        await store.append([parse_event(write(f"m{i}-{k}", k, text="x" * 2000))
                            for k in range(20)])

    async def autocheckpoint(conn: Any) -> int:
        return int((await conn.exec_driver_sql("PRAGMA wal_autocheckpoint")).scalar())

    assert await store.inline.run(autocheckpoint) == 0
    checkpoints = store.inline._checkpoints
    await checkpoints.close()  # lets a running checkpoint finish
    assert checkpoints.runs >= 1
    path = file_path(store.url)
    assert path is not None
    db = sqlite3.connect(path)
    try:
        pages = int(db.execute("PRAGMA page_count").fetchone()[0])
    finally:
        db.close()
    # the checkpoints after the last commits copied every page into the file
    assert _header_pages(path) == pages > 100


def _wal_file_frames(path: str) -> int:
    """How many frames (4 KiB pages and their headers) the WAL file has room for."""
    return os.path.getsize(f"{path}-wal") // (4096 + 24)


async def test_the_last_commits_are_checkpointed_without_a_later_commit(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that comes while the checkpointer waits out `CHECKPOINT_EVERY_S` is not
    dropped: once the interval is up the WAL is copied into the database with no
    commit after it (before, the last commits of a burst stayed in the WAL until the
    next write, a second or more later)."""
    from ledger import inline as inline_mod
    from ledger.backends.sqlite import file_path

    if not store.use_inline():
        assert store.dialect != "sqlite"
        return
    monkeypatch.setattr(inline_mod, "CHECKPOINT_EVERY_S", 0.5)
    assert store.inline is not None
    path = file_path(store.url)
    assert path is not None
    for i in range(10):  # a burst well inside one interval
        await store.append([parse_event(write(f"b{i}-{k}", k, text="x" * 2000))
                            for k in range(5)])
    checkpoints = store.inline._checkpoints
    deadline = asyncio.get_running_loop().time() + 10.0
    while asyncio.get_running_loop().time() < deadline:
        if _header_pages_equal(path):
            break
        await asyncio.sleep(0.05)
    assert _header_pages_equal(path), "the burst's last commits were never checkpointed"
    assert checkpoints.runs >= 2


def _header_pages_equal(path: str) -> bool:
    """Does the database file's header count every page (the WAL fully copied)?"""
    import sqlite3

    db = sqlite3.connect(path)
    try:
        pages = int(db.execute("PRAGMA page_count").fetchone()[0])
    finally:
        db.close()
    return _header_pages(path) == pages


async def test_writes_that_never_pause_still_start_the_wal_over(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under back-to-back transactions no checkpoint on another thread finds the WAL
    fully copied when a transaction begins, which is when SQLite starts it over: the
    WAL grew by every write (1 GB beside a 370 MB database after 100k LangGraph puts).
    Once a checkpoint finds `RESTART_FRAMES` frames, the writing thread checkpoints the
    rest before its next transaction, and the WAL starts over (and its file is cut
    back to `WAL_LIMIT_BYTES`)."""
    from ledger import inline as inline_mod
    from ledger.backends.sqlite import file_path

    if not store.use_inline():
        assert store.dialect != "sqlite"
        return
    monkeypatch.setattr(inline_mod, "CHECKPOINT_EVERY_S", 0.02)
    monkeypatch.setattr(inline_mod, "RESTART_FRAMES", 64)
    monkeypatch.setattr(inline_mod, "WAL_LIMIT_BYTES", 0)
    # the mechanism, not the reader wait: on a loaded machine 20 ms can pass before
    # the appenders' own read transactions have left the WAL
    monkeypatch.setattr(inline_mod, "CATCH_UP_WAIT_MS", 1000)
    assert store.inline is not None
    await store.inline.close()  # its next connection takes the patched limit
    path = file_path(store.url)
    assert path is not None

    async def writer(w: int) -> None:  # four of them: the thread always has one queued
        for i in range(100):
            await store.append([parse_event(write(f"c{w}-{i}-{k}", k, text="y" * 3000))
                                for k in range(4)])

    await asyncio.gather(*(writer(w) for w in range(4)))
    frames = _wal_file_frames(path)
    # about 5 pages a transaction, 2,000 frames in all: without restarts the WAL holds
    # every one of them; with them, what came since the last restart
    assert frames < 600, frames
