"""The tasks view's rows in the database: task notes as stored, and the `tasks_view`
rows of some tasks recomputed from their notes (`projections.tasks`).

Shared by the live projection (`projections.views.TaskProjection`) and its bulk load
(`projections.bulk`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import encode_json
from ledger.forgets import Coordinates, Tombstone, covers
from ledger.records import StoredEvent
from ledger.store import Store
from ledger.vault import Subject, subject, summary_key_id
from projections.sql import any_of, batches, insert_rows, none_of_array, pairs_of
from projections.tasks import Note, note_body, summarize


async def summarize_tasks(store: Store, conn: AsyncConnection,
                          keys: Sequence[tuple[str, str]], upto: int,
                          batch: Sequence[Note] = ()) -> None:
    """Recompute the `tasks_view` rows of these (tenant, task key)s from their notes.

    `task_notes` must hold every note up to `upto`; covered note bodies are erased.
    `batch`: the notes of task events just stored (`note_of`, `note_row`). On
    PostgreSQL they are used as they are rather than read back, and the notes read are
    the others (`position <> ALL(...)`, one array); elsewhere every note is read, as
    before.
    """
    tn, tv = t.task_notes.c, t.tasks_view.c
    tasks: dict[tuple[str, str], list[Note]] = {k: [] for k in keys}
    apart = none_of_array(conn, tn.position, [note.position for note in batch])
    outside: list[Any] = [] if apart is None else [apart]
    if apart is not None:
        for note in batch:
            tasks[(note.tenant, note.task_key)].append(note)
    to = t.task_owners.c
    tombs_of: dict[str, list[Tombstone]] = {}
    for x in await store.tombstones(conn, {k[0] for k in keys}, upto=upto):
        tombs_of.setdefault(x.tenant, []).append(x)
    rows = []
    erase: list[int] = []
    vault = store.vault
    fenced: set[str] = set()
    if vault is not None:
        fenced = vault.fenced(summary_key_id(*k) for k in tasks)
    # The notes of one statement's tasks at a time, summarised before the next are
    # read: a bulk-load step of 4,000 tasks held every decoded note body at once (about
    # 4 KB a task, 17 MB of peak RSS), more than the rest of the rebuild's core needs.
    for chunk in batches(conn, list(tasks)):
        by_task = {k: tasks.pop(k) for k in chunk}  # not held past their summaries
        q = select(t.task_notes).where(pairs_of(conn, tn.tenant, tn.task_key, chunk),
                                       *outside)
        for r in (await conn.execute(q)).all():
            body = _dec(r.body)
            by_task[(r.tenant, r.task_key)].append(
                Note(r.position, r.tenant, r.task_key, r.type, bytes(r.order_key), body))
        q2 = select(to.tenant, to.task_key, to.ns_path).where(
            pairs_of(conn, to.tenant, to.task_key, chunk))
        owners = {(r[0], r[1]): r[2] for r in (await conn.execute(q2)).all()}
        for (tenant, task_key), ns in by_task.items():
            rows.append(_task_row(store, tenant, task_key, owners.get((tenant, task_key)),
                                  ns, tombs_of.get(tenant, []), fenced, erase))
    if vault is not None:
        vault.ensure(r["summary"].kid for r in rows if isinstance(r["summary"], Subject))
    for chunk in batches(conn, erase, 500):
        await conn.execute(update(t.task_notes).where(any_of(conn, tn.position, chunk))
                           .values(body=None))
    for chunk in batches(conn, keys):
        await conn.execute(delete(t.tasks_view).where(
            pairs_of(conn, tv.tenant, tv.task_key, chunk)))
    await insert_rows(store, conn, t.tasks_view, rows)


def _task_row(store: Store, tenant: str, task_key: str, owner: str | None,
              ns: Sequence[Note], tt: Sequence[Tombstone], fenced: set[str],
              erase: list[int]) -> dict[str, Any]:
    """The `tasks_view` row of one task from all of its notes; adds to `erase` the
    positions of the notes whose bodies a purge or forget covers."""
    res = summarize(tenant, task_key, owner, ns, tt)
    erase.extend(n.position for n in ns if n.body is not None and (
        res["purged"] or any(covers(x, Coordinates(tenant, n.order, ns_path=owner,
                                                   task_key=task_key)) for x in tt)))
    # The task as a whole, by its owner's namespace alone: a prefix forget of it.
    forgotten_owner = owner is not None and any(
        covers(x, Coordinates(tenant, ns_path=owner)) for x in tt)
    summary = res["summary"]
    vault = store.vault
    if vault is not None:
        # Sealed under the task's summary key; a task a purge or prefix forget has
        # reached is never served again and keeps a summary without content.
        kid = summary_key_id(tenant, task_key)
        if res["purged"] or forgotten_owner or kid in fenced:
            summary = encode_json({"task_key": task_key, "status": res["status"],
                                   "purged": True})
        else:
            summary = subject(summary, kid)
    return {"tenant": tenant, "task_key": task_key, "ns_path": owner,
            "status": res["status"], "retain_until_us": res["retain_until_us"],
            "purged": bool(res["purged"] or forgotten_owner), "summary": summary}


def note_of(se: StoredEvent) -> Note:
    """The note of a task event, as `summarize_tasks` reads it from its `note_row`."""
    return Note(se.position, se.tenant, str(se.task_key), se.type, bytes(se.order_key),
                note_body(se))


def note_row(se: StoredEvent, note: Note | None = None) -> dict[str, Any]:
    """The `task_notes` row of a task event (`note`: its `note_of`, if built)."""
    body = note_body(se) if note is None else note.body
    return {"position": se.position, "tenant": se.tenant, "task_key": se.task_key,
            "type": se.type, "order_key": se.order_key,
            # The body carries its event's key id: the view seals it (ledger.vault).
            "body": subject(_enc(body), se.key_id or "")}


def _enc(obj: Any) -> bytes | None:
    return encode_json(obj) if obj is not None else None


def _dec(raw: bytes | None) -> dict[str, Any] | None:
    return orjson.loads(raw) if raw is not None else None
