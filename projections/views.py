"""The memories and tasks projections: the views `mem_versions`/`mem_marks` and
`task_notes`/`tasks_view`, kept up to date batch by batch (and bulk-loaded by
`projections.bulk`). The folds themselves are pure (`projections.memory`,
`projections.tasks`); this module reads what a batch touches and writes the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import MEMORY_WRITES, TASK_TYPES
from ledger.forgets import covers_sql, tombstone_of
from ledger.records import StoredEvent
from ledger.store import Store
from projections import bulk, rounds
from projections.memory import WriteFact, fact_from_row, marks_of, view_columns, write_fact
from projections.protocol import State
from projections.slots import covered_slots, mark_row, resolve_slots
from projections.sql import batches, in_list, insert_rows, pairs_of, prepared
from projections.task_rows import note_of, note_row, summarize_tasks

FORGETS = ("memory.forgotten", "task.purged")


class MemoryProjection:
    """Slots, versions and statuses of every memory write (the active-memory view)."""

    name = "memories"
    tables = (t.mem_versions, t.mem_marks)
    types: tuple[str, ...] | None = (*MEMORY_WRITES, "memory.superseded", "memory.confirmed",
                                     *FORGETS)
    depends_on: tuple[str, ...] = ()

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        """Re-resolve every slot the batch reaches (writes, marks, forgets)."""
        mv, mk = t.mem_versions.c, t.mem_marks.c
        writes = [write_fact(se) for se in batch if se.type in MEMORY_WRITES]
        marks = [m for se in batch for m in marks_of(se)]
        forgets = [se for se in batch if se.type in FORGETS]
        if not writes and not marks and not forgets:
            return
        if marks:
            await insert_rows(store, conn, t.mem_marks, [mark_row(m) for m in marks],
                              ignore=True)
        tenants = {se.tenant for se in batch}
        upto = batch[-1].position
        tombs = await rounds.tombstones(store, conn, tenants, upto)
        slots: set[str] = {w.slot for w in writes}
        # Slots reached through marks: targets, and the targets of confirmed candidates.
        targets = {(m.tenant, m.target) for m in marks}
        confirmed_now = [(m.tenant, m.target) for m in marks if m.kind == "confirmed"]
        for chunk in batches(conn, sorted(confirmed_now)):
            q = select(mk.tenant, mk.target).where(
                pairs_of(conn, mk.tenant, mk.via_candidate, chunk))
            targets.update((r[0], r[1]) for r in (await conn.execute(q)).all())
        for chunk in batches(conn, sorted(targets)):
            q = select(mv.slot).where(pairs_of(conn, mv.tenant, mv.memory_id, chunk))
            slots.update(r[0] for r in (await conn.execute(q)).all())
        for se in forgets:
            ts = next((x for x in tombs if x.position == se.position), None)
            if ts is not None:
                slots.update(await covered_slots(conn, ts))
        if not slots:
            return
        slot_list = sorted(slots)
        existing: dict[str, list[WriteFact]] = {}
        new_ids = {(w.tenant, w.memory_id) for w in writes}
        stored: set[str] = set()  # the slots that hold rows now (a new slot holds none)
        for chunk in batches(conn, slot_list):
            for r in (await conn.execute(_rows_of_slots(conn), {"slots": list(chunk)})).all():
                stored.add(r.slot)
                if (r.tenant, r.memory_id) not in new_ids:
                    existing.setdefault(r.slot, []).append(fact_from_row(r))
        for w in writes:
            existing.setdefault(w.slot, []).append(w)
        rows = await resolve_slots(conn, existing, tombs)
        for chunk in batches(conn, sorted(stored), 500):
            await conn.execute(_delete_slots(conn), {"slots": list(chunk)})
        await insert_rows(store, conn, t.mem_versions, rows)

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: State,
                        size: int) -> tuple[State | None, int]:
        """One step of a bulk load into the emptied view (`projections.bulk`)."""
        return await bulk.memories_step(store, conn, state, size)


def _rows_of_slots(conn: AsyncConnection) -> Any:
    """Every `mem_versions` row of the slots `:slots` (built once: `prepared`)."""
    mv = t.mem_versions.c
    return prepared(("views.rows_of_slots", conn.dialect.name), lambda: select(
        *view_columns(t.mem_versions)).where(in_list(conn, mv.slot, "slots")))


def _delete_slots(conn: AsyncConnection) -> Any:
    """DELETE the `mem_versions` rows of the slots `:slots` (built once)."""
    mv = t.mem_versions.c
    return prepared(("views.delete_slots", conn.dialect.name), lambda: delete(
        t.mem_versions).where(in_list(conn, mv.slot, "slots")))


class TaskProjection:
    """Task summaries: one row per task, rebuilt from its notes whenever one arrives."""

    name = "tasks"
    tables = (t.task_notes, t.tasks_view)
    types: tuple[str, ...] | None = (*TASK_TYPES, "memory.forgotten")
    depends_on: tuple[str, ...] = ()
    #: About one event in ten: `Runner.catch_up` steps it on its own (`Runner.groups`).
    sparse = True

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        """Store the batch's notes and re-summarise every task it touches or forgets."""
        tv = t.tasks_view.c
        events = [se for se in batch if se.type in TASK_TYPES and se.task_key]
        affected: set[tuple[str, str]] = {(se.tenant, str(se.task_key)) for se in events}
        notes = [note_of(se) for se in events]
        if events:
            await insert_rows(store, conn, t.task_notes, [
                note_row(se, n) for se, n in zip(events, notes, strict=True)], ignore=True)
        upto = batch[-1].position
        for se in batch:
            ts = tombstone_of(se.event, se.position) if se.event is not None else None
            if ts is not None:
                # The tasks a forget reaches as a whole (by owner namespace or task key).
                q = select(tv.tenant, tv.task_key).where(covers_sql(ts, tv, order_key=None))
                affected.update((r[0], r[1]) for r in (await conn.execute(q)).all())
        if affected:
            await summarize_tasks(store, conn, sorted(affected), upto, notes)

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: State,
                        size: int) -> tuple[State | None, int]:
        """One step of a bulk load into the emptied view (`projections.bulk`)."""
        return await bulk.tasks_step(store, conn, state, size)
