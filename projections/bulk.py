"""Bulk loading: how `replay rebuild` refills an emptied view far faster than replaying it.

Replaying events one batch at a time resolves every slot a batch touches again and
again, and pays a lookup of the view's current rows per batch. A view that has just been
emptied needs neither: a bulk load reads the ledger up to a fixed head `H` and writes
each slot, task or index entry exactly once, in *phases*, each a series of steps:

- memories: `marks` (every supersession and confirmation up to `H` into `mem_marks`, by
  position ranges), then `slots` (every write up to `H`, a range of slots per step in
  slot order, each slot resolved once from all of its writes with
  `projections.runner.resolve_slots`, the function the live projection uses);
- tasks: `notes` (task events into `task_notes`), then `tasks` (a range of task keys
  per step, summarised by `projections.runner.summarize_tasks`);
- vectors (`projections.vectors`): active memories, then open tasks, read from the
  views once they have reached the head, embedded in large batches.

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

from sqlalchemy import and_, exists, or_, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import MEMORY_WRITES, TASK_TYPES
from ledger.store import STORED_COLUMNS, Store, stored_from_row
from projections.memory import WRITE_COLUMNS, WriteFact, marks_of, write_fact_of_row
from projections.runner import (
    insert_rows,
    mark_row,
    note_row,
    resolve_slots,
    summarize_tasks,
)

#: Positions scanned per step of a phase that reads a few event types out of all.
SCAN_SPAN: Final = 50_000

State = dict[str, Any]


def finished(state: State) -> tuple[None, int]:
    """The result of a bulk load's last step: the positions not yet reported."""
    return None, max(1, int(state["head"]) - int(state.get("reported", 0)))


def progressed(state: State, n: int) -> tuple[State, int]:
    """A step's result: the state to keep, and `n` positions of progress (at least 1)."""
    n = max(1, n)
    state["reported"] = int(state.get("reported", 0)) + n
    return state, n


async def page_after(conn: AsyncConnection, q: Any, key: Sequence[Any],
                     after: Sequence[Any] | None, size: int) -> Sequence[Any]:
    """The next `size` rows of `q` in `key` order after the key values `after` (None:
    from the start): keyset paging, so each step reads only its own rows."""
    if after is not None:
        q = q.where(tuple_(*key) > tuple_(*after))
    return (await conn.execute(q.order_by(*key).limit(size))).all()


async def fetch(store: Store, conn: AsyncConnection, stmt: Any) -> Sequence[Sequence[Any]]:
    """The rows of a query as the driver returns them.

    On SQLite this skips SQLAlchemy's result processing (a few microseconds a row, as
    much as the read itself); the statement is rendered with its values inline, which
    SQLAlchemy quotes and escapes. Columns come back as the driver's types (0/1 for
    booleans on SQLite).
    """
    if store.dialect != "sqlite":
        return (await conn.execute(stmt)).all()
    sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
    return (await conn.exec_driver_sql(sql)).all()


# -- memories -----------------------------------------------------------------------------

_MARK_TYPES: Final = ("memory.superseded", "memory.confirmed")
#: Secondary indexes of `mem_versions` a SQLite bulk load builds once, at its end.
_DEFERRED_INDEXES: Final = tuple(t.mem_versions.indexes)


async def memories_step(store: Store, conn: AsyncConnection, state: State,
                        size: int) -> tuple[State | None, int]:
    """One step of the memories bulk load (phases `marks`, then `slots`)."""
    head = int(state["head"])
    ev = t.events.c
    if state.get("phase", "marks") == "marks":
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
            state.update(phase="slots", after="")
        return progressed(state, len(marks))
    if state["after"] == "" and store.dialect == "sqlite":
        # Loading into a table without its secondary indexes, then building them once
        # at the end, halves the cost of the inserts on SQLite.
        for ix in _DEFERRED_INDEXES:
            await conn.exec_driver_sql(f"DROP INDEX IF EXISTS {ix.name}")
    after_slot = str(state["after"])
    bound = (await conn.execute(
        select(ev.slot).where(ev.slot > after_slot).order_by(ev.slot)
        .offset(size - 1).limit(1))).scalar()
    mk = t.mem_marks.c
    has_marks = exists().where(mk.tenant == ev.tenant, mk.target == ev.memory_id)
    q = select(*[ev[c] for c in WRITE_COLUMNS], has_marks).where(
        ev.slot > after_slot, ev.position <= head, ev.type.in_(tuple(MEMORY_WRITES)))
    if bound is not None:
        q = q.where(ev.slot <= bound)
    slots: dict[str, list[WriteFact]] = {}
    marked: set[tuple[str, str]] = set()
    for r in await fetch(store, conn, q):
        w = write_fact_of_row(r[:-1])
        slots.setdefault(w.slot, []).append(w)
        if r[-1]:
            marked.add((w.tenant, w.memory_id))
    tenants = {ws[0].tenant for ws in slots.values()}
    tombs = await store.tombstones(conn, tenants, upto=head) if tenants else []
    rows = await resolve_slots(conn, slots, tombs, marked)
    await insert_rows(store, conn, t.mem_versions, rows)
    if bound is not None:
        state["after"] = bound
        return progressed(state, len(rows))
    await conn.run_sync(_create_indexes)
    return finished(state)


def _create_indexes(sync_conn: Any) -> None:
    for ix in _DEFERRED_INDEXES:
        ix.create(sync_conn, checkfirst=True)


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
