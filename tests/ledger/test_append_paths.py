"""The append path's fast statements against the generic ones (issue 20).

On a SQLite file the group commits run on the inline thread with plain `sqlite3`
statements (`ledger.backends.sqlite.SQLiteRecorder._driver`); on PostgreSQL the lock,
the chain's last link and the tombstones go to the driver's connection. Each must give
what the generic SQLAlchemy statements give, for any input: the same outcomes and the
same rows whichever path wrote them, the same look-up answers for any pairs.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from ledger import schema as t
from ledger.backends.sqlite import SQLiteRecorder
from ledger.errors import MemledgerError
from ledger.events import Event, encode_json, parse_rfc3339, to_us
from ledger.inline import SyncBacked
from ledger.recorder import Recorder
from ledger.store import Store
from ledger.validation import parse_event
from tests.factories import event, src, write

_SETTINGS = settings(max_examples=15, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])
_TIMES = itertools.count()


def _clock() -> str:
    return f"2026-12-03T10:00:{next(_TIMES) % 60:02d}.000000Z"


#: A small vocabulary, so that generated requests reuse keys (duplicates, conflicts),
#: target each other's memories and tasks, and forget what others wrote.
_KEYS = st.sampled_from(["k1", "k2", "k3"])
_USERS = st.sampled_from(["u1", "u2"])
_IDEM = st.sampled_from([f"i{i}" for i in range(8)])


@st.composite
def _wire(draw: st.DrawFn) -> dict[str, Any]:
    user = draw(_USERS)
    kind = draw(st.sampled_from(["write", "forget_key", "forget_id", "open", "note",
                                 "versioned"]))
    idem = draw(_IDEM)
    at = f"2026-09-20T10:00:{draw(st.integers(0, 59)):02d}+08:00"
    source = src(sid=f"C{user}", at=at, seq=draw(st.integers(0, 3)))
    if kind == "write":
        return write(draw(_KEYS), draw(st.integers(0, 2)), user=user, idem=idem,
                     source=source)
    if kind == "versioned":
        return {**write(draw(_KEYS), draw(st.integers(0, 2)), user=user, idem=idem,
                        source=source), "expected_version": draw(st.integers(0, 2))}
    if kind == "forget_key":
        return event("memory.forgotten", {"namespace": ["shop-a", user, "preferences"],
                                          "key": draw(_KEYS)},
                     actor=user, idem=idem, source=source)
    if kind == "forget_id":
        return event("memory.forgotten", {"memory_id": draw(st.sampled_from(
            ["mine-1", "mine-2"]))}, actor=user, idem=idem, source=source)
    task = draw(st.sampled_from(["T1", "T2"]))
    if kind == "open":
        return event("task.opened", {"task_key": task, "namespace": ["shop-a", user]},
                     actor=user, idem=idem, source=source)
    return event("task.noted", {"task_key": task, "kind": "user_report", "text": "hi"},
                 actor=user, idem=idem, source=source)


def _events(wires: list[dict[str, Any]]) -> list[Event]:
    out = []
    for w in wires:
        if w["type"] == "memory.written" and w["idempotency_key"] in ("i0", "i1"):
            # some writes carry an explicit id that the id forgets aim at
            w = {**w, "data": {**w["data"], "memory_id": f"mine-{w['idempotency_key'][1]}"}}
        out.append(parse_event(w))
    return out


async def _outcomes(store: Store, requests: list[list[Event]]) -> list[Any]:
    out: list[Any] = []
    for req in requests:
        try:
            out.append([(r.status, r.position, r.suppressed) for r in await store.append(req)])
        except MemledgerError as e:
            out.append((type(e).__name__, str(e)))
    return out


async def _tables(store: Store) -> list[list[tuple[Any, ...]]]:
    async with store.read() as conn:
        return [[tuple(r) for r in (await conn.execute(
            select(tb).order_by(*tb.primary_key.columns))).all()]
            for tb in (t.events, t.tombstones, t.task_owners)]


@_SETTINGS
@given(st.lists(st.lists(_wire(), min_size=1, max_size=4), min_size=1, max_size=8))
def test_inline_appends_equal_the_async_path(tmp_path: Path,
                                             requests: list[list[dict[str, Any]]]) -> None:
    """Any requests, appended on the inline thread (plain `sqlite3` statements) and on
    the async driver (SQLAlchemy's), give the same outcomes (results or the same
    error) and the same `events`, `tombstones` and `task_owners` rows, hash chain
    included."""
    evs = [_events(r) for r in requests]

    async def run(inline: bool, name: str) -> tuple[list[Any], list[Any]]:
        global _TIMES
        _TIMES = itertools.count()
        db = tmp_path / f"{name}-{next(_RUNS)}.db"
        store = Store(f"sqlite+aiosqlite:///{db}", register_path=str(db) + ".forgets",
                      vault=False, clock=_clock, inline_appends=inline)
        await store.open()
        try:
            assert (store._append_inline is not None) is inline
            return await _outcomes(store, evs), await _tables(store)
        finally:
            await store.close()

    fast = asyncio.run(run(True, "inline"))
    generic = asyncio.run(run(False, "async"))
    assert fast == generic


_RUNS = itertools.count()


@st.composite
def _wire_more(draw: st.DrawFn) -> dict[str, Any]:
    """`_wire`'s events and the kinds it leaves out: marks of memories, task-layer
    writes, notes of a system with or without an owner of the task, closes, purges and
    prefix forgets (every branch of the append path's namespace path and slot)."""
    kind = draw(st.sampled_from(["wire", "confirm", "task_write", "system_note", "close",
                                 "purge", "forget_prefix"]))
    if kind == "wire":
        return draw(_wire())
    user = draw(_USERS)
    idem = draw(_IDEM)
    at = f"2026-09-20T10:00:{draw(st.integers(0, 59)):02d}+08:00"
    mine = src(sid=f"C{user}", at=at, seq=draw(st.integers(0, 3)))
    system = src(kind="system_of_record", sid="crm", at=at)
    task = draw(st.sampled_from(["T1", "T2"]))
    if kind == "confirm":
        return event("memory.confirmed", {"memory_id": draw(st.sampled_from(
            ["mine-0", "mine-1"]))}, actor=user, idem=idem, source=mine)
    if kind == "task_write":
        return write(draw(_KEYS), draw(st.integers(0, 2)), user=user, idem=idem,
                     source=mine, layer="task", task_key=task)
    if kind == "system_note":
        return event("task.noted", {"task_key": task, "kind": "system_status",
                                    "text": "shipped"}, actor="crm", idem=idem,
                     source=system)
    if kind == "close":
        return event("task.closed", {"task_key": task}, actor=user, idem=idem, source=mine)
    if kind == "purge":
        return event("task.purged", {"task_key": task}, actor="crm", idem=idem,
                     source=system)
    return event("memory.forgotten", {"namespace_prefix": ["shop-a", user]}, actor=user,
                 idem=idem, source=mine)


@_SETTINGS
@given(st.lists(st.lists(_wire_more(), min_size=1, max_size=4), min_size=1, max_size=8))
def test_appended_rows_equal_event_row(tmp_path: Path,
                                       requests: list[list[dict[str, Any]]]) -> None:
    """Any requests: every `events` row the append path wrote (`Appender._one`, which
    builds the row from what it has read of the event already) is the reference row of
    its event, `event_row` (with the task owner's path as it stood when the event was
    appended) sealed by `seal` after the row before it."""
    from ledger.appender import event_row, seal
    from ledger.chain import GENESIS
    from ledger.events import TASK_TYPES

    # First an open task and a memory with an explicit id for each user, so that the
    # drawn notes, closes, marks and forgets find targets.
    setup = [parse_event(w) for user, n in (("u1", 1), ("u2", 2)) for w in (
        event("task.opened", {"task_key": f"T{n}", "namespace": ["shop-a", user]},
              actor=user, idem=f"setup-open-{n}", source=src(sid=f"C{user}")),
        write("k1", n, user=user, idem=f"setup-write-{n}", memory_id=f"mine-{n - 1}",
              source=src(sid=f"C{user}")))]
    evs = [setup] + [_events(r) for r in requests]

    async def run() -> tuple[dict[int, Event], list[dict[str, Any]]]:
        db = tmp_path / f"rows-{next(_RUNS)}.db"
        store = Store(f"sqlite+aiosqlite:///{db}", register_path=str(db) + ".forgets",
                      vault=False, clock=_clock)
        await store.open()
        try:
            appended: dict[int, Event] = {}
            for req in evs:
                try:
                    results = await store.append(req)
                except MemledgerError:
                    continue
                appended.update((r.position, e) for r, e in zip(results, req, strict=True)
                                if r.status == "appended")
            async with store.read() as conn:
                rows = [dict(r._mapping) for r in (await conn.execute(
                    select(t.events).order_by(t.events.c.position))).all()]
            return appended, rows
        finally:
            await store.close()

    appended, rows = asyncio.run(run())
    assert sorted(appended) == [r["position"] for r in rows]
    owners: dict[tuple[str, str], str] = {}
    prev = GENESIS
    for row in rows:
        ev = appended[row["position"]]
        owner = None
        if ev.type in TASK_TYPES and ev.task_key is not None:
            owner = owners.get((ev.tenant, ev.task_key))
            if ev.type == "task.opened" and owner is None:
                owner = owners[(ev.tenant, ev.task_key)] = str(row["ns_path"])
        want = event_row(ev, row["position"], row["recorded_at"],
                         suppressed=row["suppressed"], owner_path=owner)
        seal(want, prev)
        assert row == want
        prev = row["chain"]

#: Strings that JSON and SQL treat specially, and text of other scripts.
_TEXT = st.one_of(st.sampled_from(["shop-a", "shop-b", "u1", "k1", "T1", "i0", "i3",
                                   'q"uote', "back\\slash", "$[0]", "日本語", "'; --"]),
                  st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12))
_PAIRS = st.lists(st.tuples(_TEXT, _TEXT), max_size=12, unique=True)


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A ledger with writes, explicit ids, tasks and forgets in two tenants."""
    db = tmp_path_factory.mktemp("filled") / "ledger.db"
    store = Store(f"sqlite+aiosqlite:///{db}", register_path=str(db) + ".forgets")

    async def fill() -> None:
        await store.open()
        for tenant in ("shop-a", "shop-b"):
            for i in range(6):
                user = f"u{i % 2 + 1}"
                extra = {"memory_id": f"mid-{i}"} if i % 2 else {}
                await store.append([parse_event(write(
                    f"k{i % 3 + 1}", i, tenant=tenant, user=user, idem=f"i{i}", **extra))])
            await store.append([parse_event(event(
                "task.opened", {"task_key": "T1", "namespace": [tenant, "u1"]},
                tenant=tenant, actor="u1", idem="open-T1"))])
            await store.append([parse_event(event(
                "memory.forgotten", {"namespace": [tenant, "u2", "preferences"],
                                     "key": "k2"}, tenant=tenant, actor="u2",
                idem="forget-k2"))])
        assert store.use_inline()

    asyncio.run(fill())
    yield store
    asyncio.run(store.close())


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=_PAIRS, tenants=st.none() | st.lists(_TEXT, max_size=4),
       upto=st.none() | st.integers(0, 20))
def test_raw_lookups_equal_the_generic_statements(
        filled: Store, keys: list[tuple[str, str]], tenants: list[str] | None,
        upto: int | None) -> None:
    """For any pairs (absent ones, quotes, backslashes, JSON path syntax, other
    scripts), the `sqlite3` look-ups of the inline thread answer what the generic
    statements answer on the same connection, and so do the tombstones and the last
    link."""
    rec = filled.recorder
    assert isinstance(rec, SQLiteRecorder)
    known = [("shop-a", "i1"), ("shop-b", "i4"), ("shop-a", "mid-1"), ("shop-b", "T1"),
             ("shop-a", "T1")]
    pairs = sorted(set(keys) | set(known))

    async def body(conn: Any) -> None:
        assert isinstance(conn, SyncBacked) and rec._driver(conn) is not None
        for name in ("known_keys", "memory_writers", "task_owner_paths"):
            fast = await getattr(rec, name)(conn, pairs)
            generic = await getattr(Recorder, name)(rec, conn, pairs)
            assert sorted(fast) == sorted(generic), name
        assert await rec.last_link(conn) == await Recorder.last_link(rec, conn)
        fast_t = await rec.select_tombstones(conn, tenants, upto)
        generic_t = await Recorder.select_tombstones(rec, conn, tenants, upto)
        assert sorted(map(tuple, fast_t)) == sorted(map(tuple, generic_t))
        assert [r.order_key for r in fast_t] == [bytes(r.order_key) for r in fast_t]

    assert filled.inline is not None
    asyncio.run(filled.inline.run(body))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                               max_size=3),
    max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(value=_JSON, seq=st.none() | st.integers(0, 2**40),
       event_id=st.none() | st.sampled_from(["ev-1", "x"]),
       expected=st.none() | st.integers(0, 9),
       at=st.datetimes(timezones=st.timezones()))
def test_encoding_and_source_time_equal_their_definitions(
        value: Any, seq: int | None, event_id: str | None, expected: int | None,
        at: Any) -> None:
    """`Event.encode` (built without `to_wire`'s copies) is the canonical JSON of
    `to_wire()` for any event, and the source time in microseconds (parsed once) is
    what the UTC difference from the epoch says."""
    from datetime import UTC, datetime

    stamp = at.isoformat()
    try:
        moment = parse_rfc3339(stamp)
    except ValueError:
        return  # outside what every view holds: refused by validation
    wire = write("k", value, source={"kind": "explicit_user_request", "id": "C1",
                                     "at": stamp, **({"seq": seq} if seq is not None else {}),
                                     **({"event_id": event_id} if event_id else {})})
    if expected is not None:
        wire["expected_version"] = expected
    try:
        ev = parse_event(wire)
    except MemledgerError:
        return  # a value the rules refuse (a secret, too large): nothing to encode
    assert ev.encode() == encode_json(ev.to_wire())
    delta = moment.astimezone(UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    assert ev.source.at_us == to_us(moment) == (
        (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds)


@pytest.mark.postgres
async def test_pg_driver_statements_equal_the_generic_ones(pg_url: str,
                                                           register_path: str) -> None:
    """PostgreSQL: the lock taken in one statement still serialises appends (the
    writes of concurrent calls keep one chain), and the last link and the tombstones
    read on the driver's connection equal the generic statements' answers."""
    store = Store(pg_url, register_path=register_path)
    await store.open()
    try:
        await asyncio.gather(*(store.append([parse_event(write(
            f"k{i}", i, tenant=tenant, idem=f"i{i}"))]) for i in range(12)
            for tenant in ("shop-a", "shop-b")))
        for tenant in ("shop-a", "shop-b"):
            await store.append([parse_event(event(
                "memory.forgotten", {"namespace": [tenant, "u7", "preferences"],
                                     "key": "k3"}, tenant=tenant, idem="f3"))])
        rec = store.recorder
        async with store.write() as conn:
            assert await rec.last_link(conn) == await Recorder.last_link(rec, conn)
            for tenants in (None, ["shop-a"], ["shop-a", "shop-b", "none"], []):
                for upto in (None, 0, 20, 100):
                    fast = await rec.select_tombstones(conn, tenants, upto)
                    generic = await Recorder.select_tombstones(rec, conn, tenants, upto)
                    assert sorted(map(tuple, fast)) == sorted(
                        (r.position, r.tenant, r.kind, r.memory_id, r.ns_path, r.mkey,
                         r.task_key, bytes(r.order_key)) for r in generic)
        from ledger.chain import ChainCheck
        async with store.read() as conn:
            stored = (await conn.execute(select(t.events).order_by(
                t.events.c.position))).mappings().all()
        check = ChainCheck()
        assert all(check.holds(dict(r)) for r in stored)
        assert [r["position"] for r in stored] == list(range(1, 27))
    finally:
        await store.close()
