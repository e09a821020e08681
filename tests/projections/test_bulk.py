"""Bulk loads (`projections.bulk`): what `replay rebuild` uses to refill emptied views.

A bulk load must give exactly the rows that replaying event by event gives (R17, R22),
resume wherever it was cut off, whoever resumes it, and never let a second runner apply
a step twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import create_async_engine

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.store import Store
from ledger.validation import parse_event
from projections import bulk
from projections.runner import Runner, read_bulk_state
from projections.views import MemoryProjection
from replay.rebuild import in_progress, rebuild, reset_projection
from replay.status import status_report
from replay.verify import verify
from tests.factories import event, src, write
from tests.helpers import dump_views, fresh_replay
from tests.projections.test_views import gen_events
from tests.replay.test_verify import at, load, story


async def _bulk_state(store: Store, name: str) -> dict[str, object] | None:
    async with store.read() as conn:
        return await read_bulk_state(conn, name)


async def _checkpoint(store: Store, name: str) -> int:
    async with store.read() as conn:
        return int((await conn.execute(select(t.checkpoints.c.position).where(
            t.checkpoints.c.name == name))).scalar_one())


async def _sqlite_indexes(store: Store, table: str) -> set[str]:
    async with store.read() as conn:
        rows = (await conn.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ? "
            "AND sql IS NOT NULL", (table,))).all()
    return {r[0] for r in rows}


@given(seed=st.integers(0, 10**6), n=st.integers(5, 60), size=st.integers(1, 9))
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_bulk_load_equals_event_by_event(tmp_path: Path, seed: int, n: int,
                                               size: int) -> None:
    """For any mix of writes, corrections, supersessions, confirmations, forgets and task
    notes, and any step size, a bulk rebuild gives every view row for row as projecting
    the events one small batch at a time (property)."""
    rng = random.Random(seed)
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    store = Store(f"sqlite+aiosqlite:///{d / 'l.db'}", register_path=str(d / "l.forgets"))
    await store.open()
    try:
        for e in gen_events(rng, n):
            await store.append_one(parse_event(e))
        await Runner(store, batch_size=rng.randint(1, 5)).catch_up()
        incremental = await dump_views(store, t.VIEW_TABLES)
        fts = await _fts_instances(store)
        res = await rebuild(store, batch_size=size, progress=False)
        assert await dump_views(store, t.VIEW_TABLES) == incremental
        assert await _fts_instances(store) == fts
        head = await store.head()
        assert all(p["events"] == head for p in res["projections"].values())
        assert await in_progress(store) == set()
        for name in ("memories", "tasks", "vectors", "history"):
            assert await _bulk_state(store, name) is None
            assert await _checkpoint(store, name) == head
        # The loads of the history, the index and the lexical index dropped their
        # secondary indexes and built them again.
        for table in (t.mem_history, t.vectors, t.lexical_docs):
            assert await _sqlite_indexes(store, table.name) == {
                ix.name for ix in table.indexes}
    finally:
        await store.close()


async def test_bulk_rebuild_passes_verify(store: Store) -> None:
    """On both backends: a bulk rebuild of the story equals what was projected live, and
    `replay verify` (which replays into a scratch database) agrees."""
    await load(store)
    live = await dump_views(store, t.VIEW_TABLES)
    await rebuild(store, batch_size=2, progress=False)
    assert await dump_views(store, t.VIEW_TABLES) == live
    assert (await verify(store))["ok"]


async def test_killed_bulk_load_is_finished_by_any_runner(store: Store) -> None:
    """A bulk load cut off after a few steps is finished by the next runner that steps
    the projection (a worker's, here), which then moves the checkpoint to the load's
    head; on SQLite the deferred indexes are back."""
    await load(store)
    expected = await dump_views(store, t.VIEW_TABLES)
    head = await store.head()
    runner = Runner(store, batch_size=2)
    memories = next(p for p in runner.projections if p.name == "memories")
    await reset_projection(store, memories)
    for _ in range(3):
        assert await runner.step(memories, head) >= 1  # ... and then the process died
    state = await _bulk_state(store, "memories")
    assert state is not None and state["phase"] == "slots"
    assert await _checkpoint(store, "memories") == 0
    shown = (await status_report(store))["projections"]["memories"]
    assert shown["bulk_load"] == {"head": head, "phase": "slots"}
    assert "rebuilding_since" in shown and shown["lag"] == head
    if store.dialect == "sqlite":
        assert not await _sqlite_indexes(store, "mem_versions") & {"ix_mem_lookup"}
    await Runner(store, batch_size=3).catch_up()  # a worker's pass
    assert await _bulk_state(store, "memories") is None
    assert await _checkpoint(store, "memories") == head
    assert await in_progress(store) == set()
    shown = (await status_report(store))["projections"]["memories"]
    # Nothing of the load is left in the report (no bulk_load, no rebuilding_since);
    # every shard of the projection stands at the head too.
    shards = shown.pop("shards")
    assert shown == {"position": head, "lag": 0, "slowest_shard_lag": 0}
    assert shards and all(s["position"] == head and s["lag"] == 0 for s in shards)
    assert await dump_views(store, t.VIEW_TABLES) == expected
    if store.dialect == "sqlite":
        assert await _sqlite_indexes(store, "mem_versions") == {
            ix.name for ix in t.mem_versions.indexes}


async def test_rebuild_resumes_a_bulk_load(store: Store) -> None:
    """`replay rebuild` run again continues a cut-off bulk load instead of starting over."""
    await load(store)
    expected = await dump_views(store, t.VIEW_TABLES)
    runner = Runner(store, batch_size=2)
    tasks = next(p for p in runner.projections if p.name == "tasks")
    await reset_projection(store, tasks)
    await runner.step(tasks)
    res = await rebuild(store, ["tasks"], runner=runner, progress=False)
    assert res["resumed"] == ["tasks"]
    assert await dump_views(store, t.VIEW_TABLES) == expected


async def test_appends_during_a_bulk_load_are_projected_after_it(store: Store,
                                                                 tmp_path: Path) -> None:
    """Events appended while a bulk load runs (a correction of a loaded slot, a forget)
    are past the load's head: the projection applies them after the load, and the views
    equal a fresh replay of everything."""
    await load(store)
    runner = Runner(store, batch_size=2)
    for p in runner.projections:
        await reset_projection(store, p)
    memories = runner.projections[0]
    await runner.step(memories)
    await runner.step(memories)
    more = [
        write("lang", "French", idem="late1", memory_id="L3", supersedes="L2",
              etype="memory.corrected", source=src(at=at(40))),
        write("pet", "cat", idem="late2", source=src(at=at(41))),
        event("memory.forgotten", {"namespace": ["shop-a", "u7", "preferences"],
                                   "key": "style"}, idem="late3", source=src(at=at(42))),
    ]
    for e in more:
        await store.append_one(parse_event(e))
    await runner.catch_up()
    fresh = await fresh_replay(store, tmp_path)
    try:
        assert await dump_views(store, t.VIEW_TABLES) == await dump_views(
            fresh, t.VIEW_TABLES)
    finally:
        await fresh.close()


async def test_two_runners_share_a_bulk_load(db_url: str, register_path: str) -> None:
    """Two runners (two stores, as two processes would) stepping one bulk load: the
    checkpoint lock serialises the steps, so no row is inserted twice."""
    a = Store(db_url, register_path=register_path)
    b = Store(db_url, register_path=register_path)
    try:
        await a.open()
        rng = random.Random(5)
        await a.append([parse_event(e) for e in gen_events(rng, 150)])
        await Runner(a).catch_up()
        expected = await dump_views(a, t.VIEW_TABLES)
        ra, rb = Runner(a, batch_size=3), Runner(b, batch_size=5)
        for p in ra.projections:
            await reset_projection(a, p)
        await asyncio.gather(ra.catch_up(), rb.catch_up())
        assert await dump_views(a, t.VIEW_TABLES) == expected
        # The view rebuilt event by event (no bulk load) keeps its marker here.
        assert await in_progress(a) == {"erasure"}
    finally:
        await a.close()
        await b.close()


async def test_story_bulk_with_one_step_per_item(store: Store) -> None:
    """The smallest step (one item) crosses every phase boundary of every load."""
    for e in story():
        await store.append_one(parse_event(e))
    await Runner(store, batch_size=1).catch_up()
    expected = await dump_views(store, t.VIEW_TABLES)
    await rebuild(store, batch_size=1, progress=False)
    assert await dump_views(store, t.VIEW_TABLES) == expected


# -- the SQL path (SQLite): plain slots written by INSERT ... SELECT -----------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(blacklist_characters="\x00"), max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10)


@given(values=st.lists(_json, min_size=1, max_size=6),
       text=st.text(st.characters(blacklist_characters="\x00"), max_size=20),
       layer=st.sampled_from(["long", "session", "task"]),
       kind=st.sampled_from(["explicit_user_request", "user_statement", "operator"]))
@settings(max_examples=60, deadline=None)
async def test_sql_rows_equal_python_rows(values: list[object], text: str, layer: str,
                                          kind: str) -> None:
    """For any JSON value, text and source, the row SQLite computes for a plain slot is
    byte for byte the row `resolve_slot` computes in Python (property; R17)."""
    engine = create_async_engine("sqlite+aiosqlite://")
    try:
        async with engine.connect() as conn:
            assert await bulk.sql_rows_supported(conn)
            evs = [bulk.probe_event(i, v, text, layer, kind) for i, v in enumerate(values)]
            assert await bulk.plain_rows(conn, evs) == [bulk.python_row(e[:-1]) for e in evs]
    finally:
        await engine.dispose()


# No NUL: validation refuses it on both backends (docs/events.md, "Limits").
_TRICKY = ["", "é中🙂", "a\x01b", "\x1b", "tab\tquote\"back\\slash", "\u2028\x7f\x1f",
           "expires_at", '{"expires_at": 1}']


def _random_fields(rng: random.Random, ids: list[str], *, expiring: float
                   ) -> tuple[str, dict[str, object]]:
    """A random write's layer and optional fields: text, its task or session, an
    expiry (with probability `expiring`), and sometimes a supersedes of an earlier id."""
    layer = rng.choice(["long", "long", "task", "session"])
    extra: dict[str, object] = {"text": rng.choice(_TRICKY) or None}
    if layer == "task":
        extra["task_key"] = "T1"
    if layer == "session":
        extra["session_id"] = "C17"
    if rng.random() < expiring:
        extra["expires_at"] = "2026-10-01T00:00:00Z"
    if rng.random() < 0.15 and ids:
        extra["supersedes"] = rng.choice(ids)
    return layer, extra


@given(seed=st.integers(0, 10**6), n=st.integers(5, 50), size=st.integers(1, 7))
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_bulk_sql_path_equals_event_by_event(tmp_path: Path, seed: int, n: int,
                                                   size: int) -> None:
    """Mostly one write per slot (the SQL path), with tricky content (control characters,
    escapes, unicode, the word expires_at), expiries, every layer, sources with and without seq
    and event id, corrections and forgets: a bulk rebuild equals projecting event by
    event (property)."""
    rng = random.Random(seed)
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    store = Store(f"sqlite+aiosqlite:///{d / 'l.db'}", register_path=str(d / "l.forgets"))
    await store.open()
    try:
        ids: list[str] = []
        for i in range(n):
            user = rng.choice(["u7", "u8"])
            s = src(rng.choice(["explicit_user_request", "user_statement", "operator"]),
                    rng.choice(["C17", "C\\18\""]), at(rng.randrange(30)),
                    seq=rng.choice([None, rng.randrange(5)]))
            if rng.random() < 0.3:
                s["event_id"] = f"ev{i}"
            if rng.random() < 0.1 and ids:
                await store.append_one(parse_event(event(
                    "memory.forgotten", {"memory_id": rng.choice(ids)}, actor="ops",
                    source=src("operator", "ops", at(rng.randrange(30))), idem=f"i{i}")))
                continue
            layer, extra = _random_fields(rng, ids, expiring=0.2)
            mid = f"M{i}"
            ids.append(mid)
            value = rng.choice([rng.choice(_TRICKY), {"k": rng.choice(_TRICKY), "n": 1.5e-7},
                                [None, True, 2**63], -0.0])
            key = f"k{rng.randrange(n)}"  # mostly one write per key: plain slots
            await store.append_one(parse_event(write(
                key, value, user=user, ns=["shop-a", user, "p"], memory_id=mid,
                layer=layer, source=s, actor=user, idem=f"i{i}", **extra)))
        await Runner(store, projections=[MemoryProjection()],
                     batch_size=rng.randint(1, 5)).catch_up()
        incremental = await dump_views(store, (t.mem_versions,))
        await rebuild(store, ["memories"], batch_size=size, progress=False)
        assert await dump_views(store, (t.mem_versions,)) == incremental
    finally:
        await store.close()


async def test_forgets_phase_reresolves_plain_slots(db_url: str, register_path: str) -> None:
    """Writes tombstones cover whose content is still in the ledger (their erasure has
    not run) look plain to SQL; the `forgets` phase resolves them from the ledger, so the
    bulk load shows them forgotten, as projecting event by event does, whatever the
    step size (R20, R22). The SQL path reads payloads as JSON, so it serves ledgers
    without the vault (sealed payloads are opened in Python): this ledger has none."""
    store = Store(db_url, register_path=register_path, vault=False)
    await store.open()
    try:
        await _forgets_phase(store)
    finally:
        await store.close()


async def _forgets_phase(store: Store) -> None:
    ops = src("operator", "ops", at(9))
    for e in (write("lang", "Simplified Chinese", idem="w1", memory_id="L1",
                    source=src(at=at(0))),
              write("style", "terse", idem="w2", memory_id="S1", source=src(at=at(1))),
              write("tone", "warm", idem="w3", memory_id="T1", source=src(at=at(2))),
              write("size", "M", idem="w4", memory_id="Z1", source=src(at=at(3))),
              event("memory.forgotten", {"namespace": ["shop-a", "u7", "preferences"],
                                         "key": "lang"}, actor="ops", source=ops, idem="f1"),
              event("memory.forgotten", {"memory_id": "S1"}, actor="ops", source=ops,
                    idem="f2"),
              event("memory.forgotten", {"memory_id": "T1"}, actor="ops", source=ops,
                    idem="f3")):
        await store.append_one(parse_event(e))
    memories = MemoryProjection()
    runner = Runner(store, projections=[memories])
    await runner.catch_up()
    expected = await dump_views(store, (t.mem_versions,))
    status = [c.name for c in t.mem_versions.c if c.name != "position"].index("status")
    assert {(r[1], r[status]) for r in expected["mem_versions"]} == {
        ("L1", "forgotten"), ("S1", "forgotten"), ("T1", "forgotten"), ("Z1", "active")}
    async with store.read() as conn:
        kept = (await conn.execute(select(func.count()).where(
            t.events.c.memory_id.in_(["L1", "S1", "T1"]), t.events.c.payload.is_not(None),
            t.events.c.type == "memory.written")
        )).scalar_one()
    assert kept == 3  # not erased: only the erasure projection erases
    for size in (1, 2, 4000):
        await reset_projection(store, memories)
        phases: list[str] = []
        plain = 0  # rows SQL wrote (at least 1 a step): the four writes look plain to it
        while True:
            state = await _bulk_state(store, "memories")
            if state is None:
                break
            phases.append(state.get("phase", "marks"))
            moved = await runner.step(memories, size=size)
            plain += moved if phases[-1] == "plain" else 0
        # PostgreSQL has no SQL path, so nothing to redo
        assert ("forgets" in phases) == (store.dialect == "sqlite")
        assert plain >= 4 if store.dialect == "sqlite" else plain == 0  # (a step reports >= 1)
        assert await dump_views(store, (t.mem_versions,)) == expected, size


async def test_bulk_load_cut_off_then_rebuilt_event_by_event(store: Store) -> None:
    """A bulk load killed midway and then replaced by an event-by-event rebuild leaves
    nothing behind: the view's indexes are back, the scratch table is gone, the rows are
    right."""
    for e in story():
        await store.append_one(parse_event(e))
    await Runner(store).catch_up()
    expected = await dump_views(store, (t.mem_versions,))
    memories = MemoryProjection()
    runner = Runner(store, projections=[memories])
    await reset_projection(store, memories)
    for _ in range(3):  # marks, then into the writes
        await runner.step(memories, size=1)
    state = await _bulk_state(store, "memories")
    assert state is not None
    indexes = {ix.name for ix in t.mem_versions.indexes}
    if store.dialect == "sqlite":
        assert state["phase"] == "plain"
        assert not indexes & await _sqlite_indexes(store, "mem_versions")
    await rebuild(store, ["memories"], restart=True, bulk=False, progress=False)
    assert await dump_views(store, (t.mem_versions,)) == expected
    if store.dialect == "sqlite":
        assert indexes <= await _sqlite_indexes(store, "mem_versions")
        async with store.read() as conn:
            assert not (await conn.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE name = 'bulk_memories_rest'")).all()


async def _fts_instances(store: Store) -> list[tuple[object, ...]]:
    """Every (term, row id, column, offset) the lexical full-text index holds (SQLite)."""
    async with store.read() as conn:
        await conn.exec_driver_sql(
            f"CREATE VIRTUAL TABLE IF NOT EXISTS temp.fts_instances USING fts5vocab("
            f"main, {t.LEXICAL_FTS}, 'instance')")
        return [tuple(r) for r in (await conn.exec_driver_sql(
            "SELECT term, doc, col, \"offset\" FROM temp.fts_instances "
            "ORDER BY term, doc, col, \"offset\"")).all()]


async def test_lexical_load_fills_the_full_text_index(sqlite_url: str,
                                                       register_path: str) -> None:
    """The lexical index's load writes its rows without the insert trigger, then their
    full-text entries in row id order: the index then holds exactly what projecting
    event by event put in it, its triggers are back, and a load cut off between the two
    phases is emptied whole by a reset (`delete-all`), leaving no entry behind."""
    from projections.lexical import LexicalProjection

    store = Store(sqlite_url, register_path=register_path)
    await store.open()
    try:
        evs = gen_events(random.Random(5), 80)
        for e in evs[:60]:
            await store.append_one(parse_event(e))
        await Runner(store, batch_size=3).catch_up()
        expected = await _fts_instances(store)
        assert expected
        rows = await dump_views(store, (t.lexical_docs,))
        lexical = LexicalProjection()
        runner = Runner(store, projections=[lexical])
        await reset_projection(store, lexical)
        assert await _fts_instances(store) == []
        await runner.step(lexical, size=2)  # rows, no full-text entries yet
        async with store.read() as conn:
            triggers = {r[0] for r in (await conn.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE type = 'trigger'")).all()}
        assert "lexical_docs_ai" not in triggers
        assert await _fts_instances(store) == []
        await reset_projection(store, lexical)  # cut off: emptied and started again
        assert await dump_views(store, (t.lexical_docs,)) == {"lexical_docs": []}
        await rebuild(store, ["lexical"], batch_size=2, progress=False)
        assert await dump_views(store, (t.lexical_docs,)) == rows
        assert await _fts_instances(store) == expected
        async with store.read() as conn:
            triggers = {r[0] for r in (await conn.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE type = 'trigger'")).all()}
        assert {"lexical_docs_ai", "lexical_docs_ad", "lexical_docs_au"} <= triggers
        # Live updates after the load go through the triggers again.
        for e in evs[60:]:
            await store.append_one(parse_event(e))
        await Runner(store, batch_size=3).catch_up()
        after = await _fts_instances(store)
        await rebuild(store, ["lexical"], bulk=False, restart=True, progress=False)
        assert await _fts_instances(store) == after
    finally:
        await store.close()


def _plain_mix(rng: random.Random, n: int) -> list[dict[str, object]]:
    """Mostly one write per key (plain slots), with corrections, candidates (a user's
    statement on the long layer), confirmations and supersessions of them, expiries,
    and forgets by memory id, by key and by namespace prefix."""
    evs: list[dict[str, object]] = []
    ids: list[str] = []
    for i in range(n):
        user = rng.choice(["u7", "u8"])
        ns = ["shop-a", user, rng.choice(["p", "q"])]
        ops = src("operator", "ops", at(rng.randrange(30)))
        roll = rng.random()
        if roll < 0.7 or not ids:
            s = src(rng.choice(["explicit_user_request", "user_statement", "operator"]),
                    rng.choice(["C17", "C18"]), at(rng.randrange(30)),
                    seq=rng.choice([None, rng.randrange(5)]))
            layer, extra = _random_fields(rng, ids, expiring=0.1)
            mid = f"M{i}"
            ids.append(mid)
            evs.append(write(f"k{rng.randrange(3 * n)}", rng.choice(_TRICKY), user=user,
                             ns=ns, memory_id=mid, layer=layer, source=s, actor=user,
                             idem=f"i{i}", **extra))
        elif roll < 0.78:
            evs.append(event("memory.confirmed", {"memory_id": rng.choice(ids)},
                             actor="ops", source=ops, idem=f"i{i}"))
        elif roll < 0.84:
            evs.append(event("memory.superseded", {"memory_id": rng.choice(ids)},
                             actor="ops", source=ops, idem=f"i{i}"))
        else:
            target: dict[str, object] = rng.choice([
                {"memory_id": rng.choice(ids)},
                {"namespace": ns, "key": f"k{rng.randrange(3 * n)}"}, {"namespace": ns[:2]}])
            evs.append(event("memory.forgotten", target, actor="ops", source=ops,
                             idem=f"i{i}"))
    return evs


@given(seed=st.integers(0, 10**6), n=st.integers(5, 50), size=st.integers(1, 7))
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_bulk_sql_paths_of_every_view_equal_event_by_event(
        tmp_path: Path, seed: int, n: int, size: int) -> None:
    """Without the vault (payloads in clear: the SQLite SQL paths of memories and
    history apply), mostly plain slots among candidates, confirmations, supersessions,
    expiries and forgets of every kind: a bulk rebuild of every view equals projecting
    event by event, row for row, vectors of the history included (property)."""
    rng = random.Random(seed)
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    store = Store(f"sqlite+aiosqlite:///{d / 'l.db'}", register_path=str(d / "l.forgets"),
                  vault=False)
    await store.open()
    try:
        for e in _plain_mix(rng, n):
            # A forget of a memory id the ledger refuses is left out.
            with contextlib.suppress(ValidationError):
                await store.append_one(parse_event(e))
        await Runner(store, batch_size=rng.randint(1, 5)).catch_up()
        incremental = await dump_views(store, t.VIEW_TABLES)
        await rebuild(store, batch_size=size, progress=False)
        assert await dump_views(store, t.VIEW_TABLES) == incremental
        async with store.read() as conn:
            left = (await conn.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE name LIKE 'bulk_%'")).all()
        assert left == []
    finally:
        await store.close()


async def test_history_sql_path_writes_plain_slots(tmp_path: Path) -> None:
    """On SQLite without the vault, the history's load writes plain slots by SQL (phase
    `plain`), with the index's vector for an active one and none for a candidate, and
    leaves to Python the slots a forget reaches, a corrected one and a marked one: the
    rows equal projecting event by event."""
    store = Store(f"sqlite+aiosqlite:///{tmp_path / 'l.db'}",
                  register_path=str(tmp_path / "l.forgets"), vault=False)
    await store.open()
    try:
        ops = src("operator", "ops", at(9))
        for e in (write("lang", "zh", idem="w1", memory_id="L1", source=src(at=at(0))),
                  write("tone", "warm", idem="w2", memory_id="T1",
                        source=src("user_statement", at=at(1))),
                  write("size", "M", idem="w3", memory_id="Z1", source=src(at=at(2))),
                  write("size", "L", idem="w4", memory_id="Z2", source=src(at=at(3)),
                        etype="memory.corrected", supersedes="Z1"),
                  write("gone", "x", idem="w5", memory_id="G1", source=src(at=at(4))),
                  event("memory.forgotten", {"memory_id": "G1"}, actor="ops", source=ops,
                        idem="f1"),
                  write("kept", "y", idem="w6", memory_id="K1", source=src(at=at(5))),
                  event("memory.superseded", {"memory_id": "K1"}, actor="ops", source=ops,
                        idem="s1")):
            await store.append_one(parse_event(e))
        runner = Runner(store)
        await runner.catch_up()
        expected = await dump_views(store, (t.mem_history,))
        history = next(p for p in runner.projections if p.name == "history")
        await reset_projection(store, history)
        phases: list[str] = []
        by_sql: set[str] = set()
        while (state := await _bulk_state(store, "history")) is not None:
            phases.append(str(state.get("phase", "first")))
            if phases[-1] == "slots" and not by_sql:  # what the SQL path wrote
                async with store.read() as conn:
                    by_sql = {r[0] for r in (await conn.execute(
                        select(t.mem_history.c.memory_id))).all()}
            await runner.step(history, size=1)
        assert "reach" in phases and "plain" in phases
        assert by_sql == {"L1", "T1"}  # active (with its vector); a candidate
        assert await dump_views(store, (t.mem_history,)) == expected
        async with store.read() as conn:
            vecs = dict((await conn.execute(select(
                t.mem_history.c.memory_id, t.mem_history.c.vector).where(
                t.mem_history.c.memory_id.in_(["L1", "T1"])))).all())
        assert vecs["L1"] is not None and vecs["T1"] is None
    finally:
        await store.close()
