"""The memories view's slots in the database: which slots a tombstone reaches, and the
rows of a set of slots resolved from all their facts (`projections.memory`).

Shared by the live projection (`projections.views.MemoryProjection`), its bulk load
(`projections.bulk`) and the vector index (`projections.vectors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.forgets import Tombstone, covers_sql
from projections.memory import Mark, WriteFact, resolve_slot
from projections.sql import batches, in_list, one_tenant, pairs_of, prepared


def reaches(ts: Tombstone) -> Any:
    """SQL: the `mem_versions` row has the tombstone's coordinates, whatever its order
    (the slot's resolution then decides which of its versions are covered)."""
    return covers_sql(ts, t.mem_versions.c, order_key=None)


async def covered_slots(conn: AsyncConnection, ts: Tombstone) -> set[str]:
    """The slots of `mem_versions` a tombstone reaches."""
    mv = t.mem_versions.c
    q = select(mv.slot).where(reaches(ts)).distinct()
    return {r[0] for r in (await conn.execute(q)).all()}


async def resolve_slots(conn: AsyncConnection, slots: dict[str, list[WriteFact]],
                        tombs: Sequence[Tombstone],
                        marked: set[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """The view rows of these slots, each given every write it holds.

    Reads the marks aimed at the slots' memory ids (and which candidates that could
    supersede through them are confirmed) from `mem_marks`, which must be complete up
    to the position the writes and `tombs` were read up to; `marked`, when the caller
    knows it, narrows that to the (tenant, memory id)s that have marks. Every slot must
    belong to a tenant whose tombstones are all in `tombs`.

    The rows come slot by slot in `path_order` (a slot's rows in `resolve_slot`'s order).
    """
    mk = t.mem_marks.c
    ids = sorted({(w.tenant, w.memory_id) for ws in slots.values() for w in ws}
                 if marked is None else marked)
    slot_marks: dict[tuple[str, str], list[Mark]] = {}
    vias: set[tuple[str, str]] = set()
    for chunk in batches(conn, ids):
        for r in await marks_aimed(conn, chunk):
            m = Mark(r.position, r.tenant, r.target, r.kind, bytes(r.order_key), r.by_id,
                     r.via_candidate, r.owner)
            slot_marks.setdefault((m.tenant, m.target), []).append(m)
            if m.via_candidate:
                vias.add((m.tenant, m.via_candidate))
    confirmed: set[str] = set()
    for chunk in batches(conn, sorted(vias)):
        q = select(mk.target).where(pairs_of(conn, mk.tenant, mk.target, chunk),
                                    mk.kind == "confirmed")
        confirmed.update(r[0] for r in (await conn.execute(q)).all())
    by_tenant: dict[str, list[Tombstone]] = {}
    for ts in tombs:
        by_tenant.setdefault(ts.tenant, []).append(ts)
    rows: list[dict[str, Any]] = []
    for slot in sorted((s for s in slots if slots[s]), key=lambda s: path_order(s, slots[s])):
        ws = slots[slot]
        ms = [m for w in ws for m in slot_marks.get((w.tenant, w.memory_id), ())]
        rows.extend(resolve_slot(ws, ms, confirmed, by_tenant.get(ws[0].tenant, [])))
    return rows


def path_order(slot: str, writes: Sequence[WriteFact]) -> tuple[str, str, str, str, str]:
    """The order `resolve_slots` gives its slots' rows in: by tenant, namespace path and
    key (then layer and slot id), so a round inserts one namespace's rows next to each
    other. On SQLite a table's rows lie in the order they were inserted (their rowids),
    and a search reads every row below a namespace prefix: in slot order, a hash, one
    namespace written in one round was spread over every page the round filled. Only
    where the rows lie changes, never which rows the view holds (every write of a slot
    shares its tenant, path, key and layer: `ledger.events.slot_id`)."""
    w = writes[0]
    return (w.tenant, w.ns_path, w.key, w.layer, slot)


async def marks_aimed(conn: AsyncConnection, pairs: Sequence[tuple[str, str]]
                      ) -> Sequence[Any]:
    """The `mem_marks` rows aimed at these (tenant, memory id)s: of one tenant by a
    statement built once (`prepared`), of several by one `pairs_of` statement."""
    mk = t.mem_marks.c
    one = one_tenant(pairs)
    if one is None:
        return (await conn.execute(select(t.mem_marks).where(
            pairs_of(conn, mk.tenant, mk.target, pairs)))).all()
    q = prepared(("slots.marks_aimed", conn.dialect.name), lambda: select(t.mem_marks).where(
        mk.tenant == bindparam("tenant"), in_list(conn, mk.target, "ids")))
    return (await conn.execute(q, {"tenant": one[0], "ids": list(one[1])})).all()


def mark_row(m: Mark) -> dict[str, Any]:
    """The `mem_marks` row of a mark."""
    return {"position": m.position, "tenant": m.tenant, "target": m.target, "kind": m.kind,
            "order_key": m.order, "by_id": m.by_id, "via_candidate": m.via_candidate,
            "owner": m.owner}
