"""Bulk loading: how `replay rebuild` refills an emptied view far faster than replaying it.

Replaying events one batch at a time resolves every slot a batch touches again and
again, and pays a lookup of the view's current rows per batch. A view that has just been
emptied needs neither: a bulk load reads the ledger up to a fixed head `H` and writes
each slot, task or index entry exactly once, in *phases*, each a series of steps:

- memories: `marks` (every supersession and confirmation up to `H` into `mem_marks`, by
  position ranges), then `slots` (every write up to `H`, a range of slots per step in
  slot order, each slot resolved once from all of its writes with
  `projections.slots.resolve_slots`, the function the live projection uses). On
  SQLite, `plain` comes between them: by position ranges (the ledger read in its own
  order, so sequentially), one `INSERT ... SELECT` writes every *plain* slot (one
  write, unmarked, content present, no expiry: most slots of a ledger) as the row
  `resolve_slot` would compute, JSON included, without Python touching it (checked
  byte for byte against Python once a process, and by property tests), and lists
  every other write in a scratch table, which `slots` then reads in slot order
  instead of the ledger. Last, `forgets` re-resolves from the ledger any plain slot a
  tombstone reaches, which SQL did not look at (normally none: reapplying the register
  erases what forgets cover before a rebuild starts);
- tasks: `notes` (task events into `task_notes`), then `tasks` (a range of task keys
  per step, summarised by `projections.task_rows.summarize_tasks`);
- vectors (`projections.vectors`): active memories, then open tasks, read from the
  views once they have reached the head, embedded in large batches;
- history (`projections.history`): on SQLite `reach` (the writes tombstones may reach,
  listed), `plain` (the plain slots' rows by SQL, vectors copied from the index), then
  `slots` (the rest, resolved in Python; elsewhere every slot).

Memory stays bounded by a step whatever the ledger size. Each step commits with its
progress (`meta` row `<projection>.bulk`, JSON: `projections.runner.read_bulk_state`)
under the projection's checkpoint lock,
taken by `projections.runner.Runner.step`, which runs the next step for any runner
while the row exists: the CLI, a worker daemon, or a later `replay rebuild` that
resumes a killed one. The last step removes the row and moves the checkpoint to `H`
in the same transaction; from there the projection runs event by event again.

A bulk load gives the same rows as replaying event by event (tests/test_bulk.py checks
it for arbitrary event mixes), because both resolve each slot and task from the same
complete set of facts up to the same position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Column,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    and_,
    delete,
    exists,
    or_,
    select,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import CANDIDATE_KINDS, MEMORY_WRITES, TASK_TYPES, encode_json
from ledger.forgets import covers_sql, tombstone_from_row
from ledger.recorder import STORED_COLUMNS
from ledger.records import stored_from_row
from ledger.store import Store
from ledger.vault import keyed
from projections.memory import (
    WRITE_COLUMNS,
    WriteFact,
    marks_of,
    resolve_slot,
    write_fact_of_row,
)
from projections.protocol import State, finished, progressed
from projections.slots import mark_row, reaches, resolve_slots
from projections.sql import bulk_sql_possible, chunks, fetch, insert_rows, page_after
from projections.task_rows import note_row, summarize_tasks

#: Positions scanned per step of a phase that reads a few event types out of all.
SCAN_SPAN: Final = 50_000

# -- memories -----------------------------------------------------------------------------

_MARK_TYPES: Final = ("memory.superseded", "memory.confirmed")
#: Secondary indexes of `mem_versions` a SQLite bulk load builds once, at its end.
_DEFERRED_INDEXES: Final = tuple(t.mem_versions.indexes)


async def memories_step(store: Store, conn: AsyncConnection, state: State,
                        size: int) -> tuple[State | None, int]:
    """One step of the memories bulk load (phases `marks`, [`plain`], `slots`,
    [`forgets`]: the bracketed ones on SQLite only)."""
    head = int(state["head"])
    ev = t.events.c
    phase = state.get("phase", "marks")
    if phase == "marks":
        after = int(state.get("after", 0))
        hi = min(after + SCAN_SPAN, head)
        q = select(*STORED_COLUMNS).where(
            ev.position > after, ev.position <= hi,
            or_(ev.type.in_(_MARK_TYPES),
                and_(ev.type.in_(tuple(MEMORY_WRITES)), ev.supersedes.is_not(None))))
        marks = [m for r in (await conn.execute(q.order_by(ev.position))).all()
                 for m in marks_of(stored_from_row(r))]
        await insert_rows(store, conn, t.mem_marks, [mark_row(m) for m in marks], ignore=True)
        if hi < head:
            state["after"] = hi
        else:
            await _start_writes(store, conn, state)
        return progressed(state, len(marks))
    if phase == "plain":
        return await _plain_step(conn, state, size)
    if phase == "forgets":
        return await _forgets_step(store, conn, state, size)
    after_slot = str(state["after"])
    q, e = _writes_query()
    if state.get("sql"):  # what the plain phase left, listed in `_REST`
        slot = _REST.c.slot
        q = q.join_from(e, _REST, _REST.c.position == e.c.position)
    else:
        slot = e.c.slot
        q = q.where(e.c.position <= head, e.c.type.in_(tuple(MEMORY_WRITES)))
    bound = (await conn.execute(select(slot).where(slot > after_slot).order_by(slot)
                                .offset(size - 1).limit(1))).scalar()
    q = q.where(slot > after_slot)
    if bound is not None:
        q = q.where(slot <= bound)
    rows = await _resolve(store, conn, q, head)
    await insert_rows(store, conn, t.mem_versions, rows)
    if bound is not None:
        state["after"] = bound
        return progressed(state, len(rows))
    await create_indexes(conn, t.mem_versions)
    if not state.get("sql"):
        return finished(state)
    await conn.run_sync(_REST.drop)
    state.update(phase="forgets", after=0, slot="")
    return progressed(state, len(rows))


def _writes_query() -> tuple[Any, Any]:
    """SELECT of `events AS e` (as `_PLAIN_SLOT` names it): each write's columns
    (`WRITE_COLUMNS`) and whether any mark targets it; and the alias."""
    e = t.events.alias("e")
    mk = t.mem_marks.c
    has_marks = exists().where(mk.tenant == e.c.tenant, mk.target == e.c.memory_id)
    return select(*[keyed(e.c[c]) if c == "payload" else e.c[c] for c in WRITE_COLUMNS],
                  has_marks), e


async def _resolve(store: Store, conn: AsyncConnection, q: Any, head: int
                   ) -> list[dict[str, Any]]:
    """The view rows of the slots whose writes (all of them, up to `head`) `q` reads."""
    slots: dict[str, list[WriteFact]] = {}
    marked: set[tuple[str, str]] = set()
    for row in await fetch(store, conn, q):
        w = write_fact_of_row(row[:-1])
        slots.setdefault(w.slot, []).append(w)
        if row[-1]:
            marked.add((w.tenant, w.memory_id))
    tenants = {ws[0].tenant for ws in slots.values()}
    tombs = await store.tombstones(conn, tenants, upto=head) if tenants else []
    return await resolve_slots(conn, slots, tombs, marked)


async def _start_writes(store: Store, conn: AsyncConnection, state: State) -> None:
    """After the marks: choose the SQL path or not, and prepare the view for loading."""
    if not bulk_sql_possible(store):
        state.update(phase="slots", after="")
        return
    # Loading into a table without its secondary indexes, then building them once
    # at the end, halves the cost of the inserts on SQLite.
    for ix in _DEFERRED_INDEXES:
        await conn.exec_driver_sql(f"DROP INDEX IF EXISTS {ix.name}")
    if await sql_rows_supported(conn):
        await conn.run_sync(_REST.drop, checkfirst=True)
        await conn.run_sync(_REST.create)
        state.update(phase="plain", after=0, sql=True)
    else:
        state.update(phase="slots", after="")


# The SQL path (SQLite): a slot that holds exactly one write up to the head, which
# nothing marks, whose content is present and not suppressed, and which has no expiry,
# resolves to one row computed from the event alone (`resolve_slot`'s first case), so
# `INSERT ... SELECT` can write it without Python touching the row. Its one unknown is
# tombstones: phase `forgets` re-resolves, from the ledger, every such slot a tombstone
# up to the head reaches (after a forget is reapplied the writes it covers are erased,
# and take the Python path anyway, so that phase usually finds nothing to do).

_WRITES_SQL: Final = "(" + ", ".join(f"'{x}'" for x in sorted(MEMORY_WRITES)) + ")"
_CANDIDATE_SQL: Final = ("(e.layer = 'long' AND e.source_kind IN ("
                         + ", ".join(f"'{k}'" for k in sorted(CANDIDATE_KINDS)) + "))")
_PAYLOAD: Final = "CAST(e.payload AS TEXT)"
#: SQL, over `events AS e` with one parameter, the head: the write is its slot's only
#: write up to the head and resolves without Python. A payload holding an escaped NUL
#: is left to Python: SQLite's `->>` cuts a string at NUL; so is a sealed one.
_PLAIN_SLOT: Final = (
    "e.payload IS NOT NULL AND e.suppressed = 0"
    # A sealed payload (`ledger.vault`) is no JSON: SQL cannot read it, Python opens it.
    " AND substr(e.payload, 1, 1) = X'7B'"
    f" AND instr({_PAYLOAD}, '\\u0000') = 0"
    f" AND {_PAYLOAD} ->> '$.data.expires_at' IS NULL"
    " AND NOT EXISTS (SELECT 1 FROM events AS o WHERE o.slot = e.slot"
    f" AND o.position <> e.position AND o.position <= ? AND o.type IN {_WRITES_SQL})"
    " AND NOT EXISTS (SELECT 1 FROM mem_marks AS m WHERE m.tenant = e.tenant"
    " AND m.target = e.memory_id)")
#: The source's wire form as `encode_json` writes it (keys sorted, absent seq and
#: event id left out).
_SOURCE_SQL: Final = (
    """'{"actor":' || json_quote(e.actor) || ',"at":' || json_quote(e.source_at)"""
    """ || CASE WHEN e.source_event_id IS NULL THEN ''"""
    """ ELSE ',"event_id":' || json_quote(e.source_event_id) END"""
    """ || ',"id":' || json_quote(e.source_id) || ',"kind":' || json_quote(e.source_kind)"""
    """ || CASE WHEN e.source_seq IS NULL THEN '' ELSE ',"seq":' || e.source_seq END"""
    """ || '}'""")
#: Each `mem_versions` column of a plain slot's row, as SQL over `events AS e`.
_PLAIN_ROW: Final = {
    "tenant": "e.tenant", "memory_id": "e.memory_id", "slot": "e.slot",
    "ns_path": "e.ns_path", "mkey": "e.mkey", "layer": "COALESCE(e.layer, 'long')",
    "task_key": "e.task_key", "session_id": f"{_PAYLOAD} ->> '$.data.session_id'",
    "position": "e.position", "order_key": "e.order_key", "version": "1",
    "status": f"CASE WHEN {_CANDIDATE_SQL} THEN 'candidate' ELSE 'active' END",
    "candidate": f"CASE WHEN {_CANDIDATE_SQL} THEN 1 ELSE 0 END",
    "value": f"CAST({_PAYLOAD} -> '$.data.value' AS BLOB)",
    "text": f"{_PAYLOAD} ->> '$.data.text'", "scope": f"{_PAYLOAD} ->> '$.data.scope'",
    "supersedes": "e.supersedes", "superseded_by": "NULL", "expires_at": "NULL",
    "expires_us": "NULL", "actor": "e.actor", "source": f"CAST({_SOURCE_SQL} AS BLOB)",
}
assert list(_PLAIN_ROW) == [c.name for c in t.mem_versions.c], "mem_versions changed"
_PLAIN_SELECT: Final = ", ".join(_PLAIN_ROW.values())


def _slot_writes(name: str) -> Table:
    """A scratch table of writes by slot (slot, position), for a load in progress. Not
    in `ledger.schema`: dropped at the end of the load."""
    return Table(
        name, MetaData(),
        Column("slot", String(32), nullable=False),
        Column("position", BigInteger, nullable=False),
        PrimaryKeyConstraint("slot", "position"),
        sqlite_with_rowid=False,
    )


#: The writes the plain phase left to Python, by slot (SQL path only; dropped at the
#: end of the load).
_REST: Final = _slot_writes("bulk_memories_rest")


async def _plain_step(conn: AsyncConnection, state: State, size: int
                      ) -> tuple[State | None, int]:
    """Write the plain slots among the writes of a range of positions (read in position
    order, so sequentially), and list the other writes in `_REST` for phase `slots`."""
    head = int(state["head"])
    after = int(state["after"])
    hi = min(after + min(SCAN_SPAN, 4 * size), head)
    where = f"e.position > ? AND e.position <= ? AND e.type IN {_WRITES_SQL}"
    res = await conn.exec_driver_sql(
        f"INSERT INTO mem_versions ({', '.join(_PLAIN_ROW)}) SELECT {_PLAIN_SELECT} "
        f"FROM events AS e WHERE {where} AND {_PLAIN_SLOT}", (after, hi, head))
    # The rest: each memory id is written once (the ledger refuses a second write of
    # one), so a write whose id the view lacks is one SQL did not take.
    await conn.exec_driver_sql(
        f"INSERT INTO {_REST.name} (slot, position) SELECT e.slot, e.position "
        f"FROM events AS e WHERE {where} AND NOT EXISTS (SELECT 1 FROM mem_versions AS v "
        "WHERE v.tenant = e.tenant AND v.memory_id = e.memory_id)", (after, hi))
    if hi < head:
        state["after"] = hi
    else:
        state.update(phase="slots", after="")
    return progressed(state, int(res.rowcount))


async def plain_rows(conn: AsyncConnection, events: Sequence[Sequence[Any]]
                     ) -> list[tuple[Any, ...]]:
    """The rows the SQL path computes for `events` rows (`WRITE_COLUMNS` order, plus
    `type`), each taken as its slot's only write: for checking it against Python."""
    cols = (*WRITE_COLUMNS, "type")
    one = "SELECT " + ", ".join(f"? AS {c}" for c in cols)
    out = []
    for r in events:
        got = (await conn.exec_driver_sql(
            f"SELECT {_PLAIN_SELECT} FROM ({one}) AS e", tuple(r))).one()
        out.append(tuple(got))
    return out


def python_row(r: Sequence[Any]) -> tuple[Any, ...]:
    """The row `resolve_slot` gives an `events` row (`WRITE_COLUMNS` order) alone."""
    (row,) = resolve_slot([write_fact_of_row(r)], [], set(), [])
    return tuple(int(v) if isinstance(v, bool) else v for v in row.values())


_PROBE_VALUES: Final = (
    None, True, 0, -1, 2**63 - 1, 1.5, 1e-7, -0.0, 1e300, 0.1 + 0.2, "", "é中\U0001f600",
    "\u2028\x7f\x1f\"\\/\n\t", [1, [2, {}], {"b": 1, "a": [None, "x"]}],
    {"z": {"y": "\x01"}, "a": 1.25e-5},
)
_supported: bool | None = None


async def sql_rows_supported(conn: AsyncConnection) -> bool:
    """Does this SQLite compute plain rows byte for byte as Python does? Checked once a
    process on values whose JSON is easy to get wrong; if not, Python does every slot."""
    global _supported
    if _supported is None:
        probe = [probe_event(i, v) for i, v in enumerate(_PROBE_VALUES)]
        try:
            _supported = await plain_rows(conn, probe) == [python_row(r[:-1]) for r in probe]
        except DBAPIError:  # an SQLite without `->` / `->>` (before 3.38)
            _supported = False
    return _supported


def probe_event(i: int, value: Any, text: str = "t\x1f\"é", layer: str = "long",
                kind: str = "user_statement") -> tuple[Any, ...]:
    """An `events` row of a write of `value` (`WRITE_COLUMNS` order, then `type`)."""
    data = {"key": "k", "namespace": ["t", "u"], "value": value, "text": text,
            "scope": "s\u00e9", "layer": layer}
    payload = encode_json({"data": data, "type": "memory.written"})
    return (i + 1, "t", "act\"or", kind, "id\\1", "2026-01-01T00:00:00Z",
            i if i % 2 else None, f"e{i}" if i % 3 else None, b"\x00\x01", f"s{i}",
            f"m{i}", "t\x1fu\x1f", "k", layer, None, None, 0, payload, "memory.written")


async def _forgets_step(store: Store, conn: AsyncConnection, state: State,
                        size: int) -> tuple[State | None, int]:
    """Re-resolve, from the ledger, the slots tombstones reach that the SQL path wrote
    (they are not `forgotten`): up to `size` tombstones and `size` slots a step. The
    state holds the last tombstone done (`after`) and, when a step stopped inside the
    next one, the last of its slots done (`slot`)."""
    head = int(state["head"])
    tc, mv = t.tombstones.c, t.mem_versions.c
    tombs = (await conn.execute(select(t.tombstones).where(
        tc.position > int(state["after"]), tc.position <= head)
        .order_by(tc.position).limit(size))).all()
    found: set[str] = set()
    budget = size
    for row in tombs:
        ts = tombstone_from_row(row)
        q = select(mv.slot).where(reaches(ts), mv.status != "forgotten",
                                  mv.slot > str(state["slot"])).distinct()
        slots = [r[0] for r in (await conn.execute(q.order_by(mv.slot).limit(budget))).all()]
        found.update(slots)
        budget -= len(slots)
        if budget == 0:  # this tombstone may reach more: go on from its last slot
            state["slot"] = slots[-1]
            break
        state.update(after=ts.position, slot="")
    for chunk in chunks(sorted(found)):
        # Replace the rows of these slots with those resolved from all their writes.
        q, e = _writes_query()
        rows = await _resolve(store, conn, q.where(
            e.c.slot.in_(chunk), e.c.position <= head, e.c.type.in_(tuple(MEMORY_WRITES))),
            head)
        await conn.execute(delete(t.mem_versions).where(mv.slot.in_(chunk)))
        await insert_rows(store, conn, t.mem_versions, rows)
    if budget > 0 and len(tombs) < size:
        return finished(state)
    return progressed(state, len(tombs))


# -- history (SQLite) ---------------------------------------------------------------------
#
# A plain slot (as above: one write up to the head, nothing marks it, content present and
# not suppressed, no expiry) that no tombstone up to the head reaches has one history
# row: the row `resolve_slot` computes at its write's position, open (`valid_to` NULL),
# unredacted, with the vector index's entry of the memory when it is active (what
# `projections.history._embed` takes first). `INSERT ... SELECT` writes it with the
# vector copied inside SQLite; every other write is listed in `_HISTORY_REST`, whose
# slots the history's Python path then resolves as before. An active plain memory the
# index lacks (by the ledger's embedder) is left to Python, which embeds it.

#: The writes the history's SQL path left to Python, by slot (dropped at the end of
#: the load). Filled first with the writes a tombstone up to the head may reach.
_HISTORY_REST: Final = _slot_writes("bulk_history_rest")
_HISTORY_COLUMNS: Final = (*_PLAIN_ROW, "valid_from", "valid_to", "redacted", "model",
                           "vector")
assert set(_HISTORY_COLUMNS) == {c.name for c in t.mem_history.c}, "mem_history changed"
_HISTORY_SELECT: Final = (
    f"{_PLAIN_SELECT}, e.position, NULL, 0, "
    f"CASE WHEN {_CANDIDATE_SQL} THEN NULL ELSE x.model END, "
    f"CASE WHEN {_CANDIDATE_SQL} THEN NULL ELSE x.vector END")


async def history_sql_start(conn: AsyncConnection) -> bool:
    """Before the history's load on SQLite: whether its SQL path applies (the plain rows
    are computed as Python computes them); if so, its scratch table is made afresh."""
    if not await sql_rows_supported(conn):
        return False
    await conn.run_sync(_HISTORY_REST.drop, checkfirst=True)
    await conn.run_sync(_HISTORY_REST.create)
    return True


async def history_reach_step(conn: AsyncConnection, head: int, after: int, size: int
                             ) -> int | None:
    """List in `_HISTORY_REST` the writes up to `head` of up to `size` tombstones after
    position `after` may reach (whatever the order: a superset, as a batch looks);
    returns the last tombstone's position, or None when there were no more."""
    tc, ev = t.tombstones.c, t.events.c
    tombs = (await conn.execute(select(t.tombstones).where(
        tc.position > after, tc.position <= head).order_by(tc.position).limit(size))).all()
    for row in tombs:
        ts = tombstone_from_row(row)
        reached = select(ev.slot, ev.position).where(
            ev.type.in_(tuple(MEMORY_WRITES)), ev.position <= head,
            covers_sql(ts, ev, order_key=None))
        await conn.execute(_HISTORY_REST.insert().prefix_with("OR IGNORE").from_select(
            ["slot", "position"], reached))
    return int(tombs[-1].position) if tombs else None


async def history_plain_step(conn: AsyncConnection, head: int, after: int, size: int,
                             model: str) -> tuple[int, int]:
    """Write the history rows of the plain slots among the writes of a range of
    positions after `after` (the ledger read in its own order), list the other writes
    in `_HISTORY_REST`; returns (the range's end, rows written). `model`: the ledger's
    embedder, whose index entries are the rows' vectors."""
    hi = min(after + min(SCAN_SPAN, 4 * size), head)
    where = (f"e.position > ? AND e.position <= ? AND e.type IN {_WRITES_SQL} "
             "AND e.slot > ''")
    res = await conn.exec_driver_sql(
        f"INSERT INTO mem_history ({', '.join(_HISTORY_COLUMNS)}) SELECT {_HISTORY_SELECT} "
        "FROM events AS e LEFT JOIN vectors AS x ON x.tenant = e.tenant "
        "AND x.item_id = e.memory_id AND x.kind = 'memory' AND x.model = ? "
        f"WHERE {where} AND ({_CANDIDATE_SQL} OR x.vector IS NOT NULL) AND {_PLAIN_SLOT} "
        f"AND NOT EXISTS (SELECT 1 FROM {_HISTORY_REST.name} AS r WHERE r.slot = e.slot)",
        (model, after, hi, head))
    # Each memory id is written once: a write whose id has no row is one SQL left.
    await conn.exec_driver_sql(
        f"INSERT OR IGNORE INTO {_HISTORY_REST.name} (slot, position) "
        f"SELECT e.slot, e.position FROM events AS e WHERE {where} AND NOT EXISTS "
        "(SELECT 1 FROM mem_history AS h WHERE h.tenant = e.tenant "
        "AND h.memory_id = e.memory_id)", (after, hi))
    return hi, int(res.rowcount)


async def history_rest_slots(conn: AsyncConnection, after: str, size: int
                             ) -> tuple[list[str], bool]:
    """The next slots after `after` that the SQL path left to Python: those of the next
    `size` writes listed (the last slot whole), and whether any are left after them.
    Bounded by writes, not slots: the slots left are those with many writes."""
    r = _HISTORY_REST.c
    bound = (await conn.execute(select(r.slot).where(r.slot > after).order_by(r.slot)
                                .offset(size - 1).limit(1))).scalar()
    q = select(r.slot).where(r.slot > after).distinct().order_by(r.slot)
    if bound is not None:
        q = q.where(r.slot <= bound)
    return [x[0] for x in (await conn.execute(q))], bound is not None


async def history_sql_end(conn: AsyncConnection) -> None:
    """Drop the history's scratch table at the end of its load."""
    await conn.run_sync(_HISTORY_REST.drop, checkfirst=True)


async def drop_indexes(conn: AsyncConnection, table: Table) -> None:
    """Drop a view table's secondary indexes for a SQLite load into it (built once at
    its end, `create_indexes`: far fewer page writes than keeping them row by row)."""
    for ix in table.indexes:
        await conn.exec_driver_sql(f"DROP INDEX IF EXISTS {ix.name}")


async def create_indexes(conn: AsyncConnection, table: Table) -> None:
    """Build the secondary indexes `drop_indexes` dropped."""
    await conn.run_sync(_create_indexes, (table,))


def _create_indexes(sync_conn: Any, tables: Sequence[Table]) -> None:
    for table in tables:
        for ix in table.indexes:
            ix.create(sync_conn, checkfirst=True)


def restore_shape(sync_conn: Any, name: str, tables: Sequence[Table]) -> None:
    """Undo what a bulk load of projection `name` cut off and never resumed left
    behind (SQLite: view indexes dropped for the load, its scratch table, the lexical
    index's triggers), so the projection can be rebuilt event by event. For
    `replay.rebuild.reset_projection`, after `clear_table`."""
    _create_indexes(sync_conn, tables)
    if name == "memories":
        _REST.drop(sync_conn, checkfirst=True)
    if t.mem_history in tables:
        _HISTORY_REST.drop(sync_conn, checkfirst=True)
    if t.lexical_docs in tables and sync_conn.dialect.name == "sqlite":
        _lexical_triggers(sync_conn)


# -- the lexical index (SQLite) -----------------------------------------------------------
#
# Its FTS5 index is kept equal to `lexical_docs` by triggers, one full-text insert per
# row. A load into the emptied index (`projections.lexical.LexicalProjection.bulk_step`)
# drops the insert trigger, writes the rows, then fills the full-text index from them
# in row id order, many rows a statement (FTS5 then writes few, large segments), and
# creates the trigger again. A view is emptied with FTS5's `delete-all` (contentless:
# a `delete` per row must name each row's terms, and a row a cut-off load wrote
# without its full-text entry must not be deleted from the index).

_LEXICAL_TRIGGERS: Final = tuple(x for x in t._SQLITE_LEXICAL_DDL if "TRIGGER" in x)
#: Full-text entries written per step of the load's last phase.
FTS_LOAD_ROWS: Final = 50_000


def _lexical_triggers(sync_conn: Any) -> None:
    for ddl in _LEXICAL_TRIGGERS:
        sync_conn.exec_driver_sql(ddl)


async def clear_table(store: Store, conn: AsyncConnection, table: Table) -> None:
    """Delete every row of a view table; the lexical index's on SQLite with its
    full-text index at once (`delete-all`), not an FTS5 `delete` per row."""
    if table is not t.lexical_docs or not bulk_sql_possible(store):
        await conn.execute(delete(table))
        return
    await conn.exec_driver_sql("DROP TRIGGER IF EXISTS lexical_docs_ad")
    await conn.execute(delete(table))
    await conn.exec_driver_sql(
        f"INSERT INTO {t.LEXICAL_FTS}({t.LEXICAL_FTS}) VALUES ('delete-all')")
    await conn.run_sync(_lexical_triggers)


async def lexical_load_start(store: Store, conn: AsyncConnection) -> bool:
    """Before a load into the emptied lexical index: on SQLite drop the insert trigger
    (the full-text index is filled at the end, `lexical_fts_step`); returns whether."""
    if not bulk_sql_possible(store):
        return False
    await conn.exec_driver_sql("DROP TRIGGER IF EXISTS lexical_docs_ai")
    await drop_indexes(conn, t.lexical_docs)
    return True


async def lexical_fts_step(conn: AsyncConnection, after: int | None) -> int | None:
    """Write the full-text entries of the next `FTS_LOAD_ROWS` rows of `lexical_docs`
    after row id `after`, in row id order; returns the last row id written, or None
    when there were no more (the triggers are then created again)."""
    lo = -1 if after is None else int(after)
    last = (await conn.exec_driver_sql(
        "SELECT max(docid) FROM (SELECT docid FROM lexical_docs WHERE docid > ? "
        "ORDER BY docid LIMIT ?)", (lo, FTS_LOAD_ROWS))).scalar()
    if last is None:
        await conn.run_sync(_lexical_triggers)
        await create_indexes(conn, t.lexical_docs)
        return None
    await conn.exec_driver_sql(
        f"INSERT INTO {t.LEXICAL_FTS}(rowid, scope, terms) SELECT docid, scope, terms "
        "FROM lexical_docs WHERE docid > ? AND docid <= ? ORDER BY docid", (lo, int(last)))
    return int(last)


# -- tasks --------------------------------------------------------------------------------

async def tasks_step(store: Store, conn: AsyncConnection, state: State,
                     size: int) -> tuple[State | None, int]:
    """One step of the tasks bulk load (phases `notes`, then `tasks`)."""
    head = int(state["head"])
    if state.get("phase", "notes") == "notes":
        after = int(state.get("after", 0))
        batch = await store.read_events(conn, after, size, upto=head,
                                        types=tuple(TASK_TYPES))
        notes = [se for se in batch if se.task_key]
        await insert_rows(store, conn, t.task_notes, [note_row(se) for se in notes],
                          ignore=True)
        if len(batch) == size:
            state["after"] = batch[-1].position
        else:
            state.update(phase="tasks", after=None)
        return progressed(state, len(batch))
    tn = t.task_notes.c
    keys = [(r[0], r[1]) for r in await page_after(
        conn, select(tn.tenant, tn.task_key).distinct(), (tn.tenant, tn.task_key),
        state.get("after"), size)]
    if keys:
        await summarize_tasks(store, conn, keys, head)
    if len(keys) < size:
        return finished(state)
    state["after"] = list(keys[-1])
    return progressed(state, len(keys))
