"""The projection runner: reads the ledger after a checkpoint and updates the views.

The view change and the new checkpoint commit in one transaction, so a batch is
applied exactly once however often a runner is woken or restarted. The checkpoint row
is locked for the whole transaction (SQLite: BEGIN IMMEDIATE; PostgreSQL: SELECT ...
FOR UPDATE), so a second runner of the same projection waits instead of applying the
batch twice, and a killed holder's lock dies with its connection.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final, Protocol, runtime_checkable

import orjson
import structlog
from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import MEMORY_WRITES, TASK_TYPES, encode_json, ns_path
from ledger.recorder import Recorder, pairs_in
from ledger.records import StoredEvent
from ledger.store import Store, Tombstone
from projections.memory import Mark, WriteFact, fact_from_row, marks_of, resolve_slot, write_fact
from projections.reads import prefix_match
from projections.tasks import Note, note_body, summarize

log = structlog.get_logger("memledger.projections")

WRITE_TYPES = tuple(MEMORY_WRITES)
#: `meta` row of a bulk load in progress: `<projection name>` + this (`projections.bulk`).
BULK_SUFFIX: Final = ".bulk"
#: `meta` rows marking a rebuild in progress: `rebuild:<projection name>` (`replay
#: rebuild` sets them; a bulk load's last step removes its projection's).
REBUILD_MARKER: Final = "rebuild:"
TASK_CONTENT_TYPES = ("task.opened", "task.noted", "task.closed")


class Projection(Protocol):
    """A view kept up to date from the ledger."""

    name: str
    tables: tuple[Any, ...]

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        """Apply a batch of events (in position order) to the view, inside `conn`'s tx."""


@runtime_checkable
class BulkLoadable(Protocol):
    """A projection that can refill its emptied view in bulk (`projections.bulk`)."""

    name: str

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: dict[str, Any],
                        size: int) -> tuple[dict[str, Any] | None, int]:
        """Do one step of at most about `size` items, inside `conn`'s transaction.

        Returns the state to record (None when the load is complete) and the positions
        of progress to report (at least 1).
        """


@contextlib.contextmanager
def no_gc_pauses() -> Iterator[None]:
    """Hold CPython's cyclic garbage collector off for the duration of one batch.

    A batch allocates thousands of containers (decoded events, facts, rows) that live
    until it ends; the collections their allocation triggers walk them all again, and
    in a process with a large heap a full collection lands in the middle of a batch.
    Measured on a bulk load, decoding a 465-byte payload cost 7.9 us with the
    collector on and 2.4 us with it off. Reference counting still frees everything at
    the end of the batch; cycles, if any, wait for the next collection.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def read_bulk_state(conn: AsyncConnection, projection: str) -> dict[str, Any] | None:
    """The bulk-load state of a projection, or None when none is in progress."""
    row = (await conn.execute(select(t.meta.c.value).where(
        t.meta.c.name == projection + BULK_SUFFIX))).first()
    if row is None:
        return None
    state: dict[str, Any] = orjson.loads(row[0])
    return state


async def write_bulk_state(conn: AsyncConnection, projection: str,
                           state: dict[str, Any] | None) -> None:
    """Record (or, with None, end) a projection's bulk load, inside `conn`'s transaction.

    A load starts with the checkpoint at 0 (`replay.rebuild.reset_projection`) and its
    last step moves it to the load's head, so a checkpoint above 0 means no load runs.
    Ending it also ends the rebuild it belongs to: the view is complete at its head.
    """
    m = t.meta.c
    await conn.execute(t.meta.delete().where(m.name == projection + BULK_SUFFIX))
    if state is None:
        await conn.execute(t.meta.delete().where(m.name == REBUILD_MARKER + projection))
    else:
        await conn.execute(t.meta.insert().values(name=projection + BULK_SUFFIX,
                                                  value=orjson.dumps(state).decode()))


def chunks(items: Sequence[Any], n: int = 400) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class MemoryProjection:
    """Slots, versions and statuses of every memory write (the active-memory view)."""

    name = "memories"
    tables = (t.mem_versions, t.mem_marks)
    types = (*MEMORY_WRITES, "memory.superseded", "memory.confirmed", "memory.forgotten",
             "task.purged")

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        mv, mk = t.mem_versions.c, t.mem_marks.c
        writes = [write_fact(se) for se in batch if se.type in MEMORY_WRITES]
        marks = [m for se in batch for m in marks_of(se)]
        forgets = [se for se in batch if se.type in ("memory.forgotten", "task.purged")]
        if not writes and not marks and not forgets:
            return
        if marks:
            await insert_rows(store, conn, t.mem_marks, [mark_row(m) for m in marks],
                              ignore=True)
        tenants = {se.tenant for se in batch}
        upto = batch[-1].position
        tombs = await store.tombstones(conn, tenants, upto=upto)
        slots: set[str] = {w.slot for w in writes}
        # Slots reached through marks: targets, and the targets of confirmed candidates.
        targets = {(m.tenant, m.target) for m in marks}
        confirmed_now = [(m.tenant, m.target) for m in marks if m.kind == "confirmed"]
        for chunk in chunks(sorted(confirmed_now)):
            q = select(mk.tenant, mk.target).where(pairs_in(mk.tenant, mk.via_candidate, chunk))
            targets.update((r[0], r[1]) for r in (await conn.execute(q)).all())
        for chunk in chunks(sorted(targets)):
            q = select(mv.slot).where(pairs_in(mv.tenant, mv.memory_id, chunk))
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
        for chunk in chunks(slot_list):
            for r in (await conn.execute(select(t.mem_versions).where(mv.slot.in_(chunk)))).all():
                if (r.tenant, r.memory_id) not in new_ids:
                    existing.setdefault(r.slot, []).append(fact_from_row(r))
        for w in writes:
            existing.setdefault(w.slot, []).append(w)
        rows = await resolve_slots(conn, existing, tombs)
        for chunk in chunks(slot_list, 500):
            await conn.execute(delete(t.mem_versions).where(mv.slot.in_(chunk)))
        await insert_rows(store, conn, t.mem_versions, rows)

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: dict[str, Any],
                        size: int) -> tuple[dict[str, Any] | None, int]:
        """One step of a bulk load into the emptied view (`projections.bulk`)."""
        from projections import bulk  # bulk builds on this module

        return await bulk.memories_step(store, conn, state, size)


async def resolve_slots(conn: AsyncConnection, slots: dict[str, list[WriteFact]],
                        tombs: Sequence[Tombstone],
                        marked: set[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """The view rows of these slots, each given every write it holds.

    Reads the marks aimed at the slots' memory ids (and which candidates that could
    supersede through them are confirmed) from `mem_marks`, which must be complete up
    to the position the writes and `tombs` were read up to; `marked`, when the caller
    knows it, narrows that to the (tenant, memory id)s that have marks. Every slot must
    belong to a tenant whose tombstones are all in `tombs`.
    """
    mk = t.mem_marks.c
    ids = sorted({(w.tenant, w.memory_id) for ws in slots.values() for w in ws}
                 if marked is None else marked)
    slot_marks: dict[tuple[str, str], list[Mark]] = {}
    vias: set[tuple[str, str]] = set()
    for chunk in chunks(ids):
        q = select(t.mem_marks).where(pairs_in(mk.tenant, mk.target, chunk))
        for r in (await conn.execute(q)).all():
            m = Mark(r.position, r.tenant, r.target, r.kind, bytes(r.order_key), r.by_id,
                     r.via_candidate, r.owner)
            slot_marks.setdefault((m.tenant, m.target), []).append(m)
            if m.via_candidate:
                vias.add((m.tenant, m.via_candidate))
    confirmed: set[str] = set()
    for chunk in chunks(sorted(vias)):
        q = select(mk.target).where(pairs_in(mk.tenant, mk.target, chunk),
                                    mk.kind == "confirmed")
        confirmed.update(r[0] for r in (await conn.execute(q)).all())
    by_tenant: dict[str, list[Tombstone]] = {}
    for ts in tombs:
        by_tenant.setdefault(ts.tenant, []).append(ts)
    rows: list[dict[str, Any]] = []
    for slot in sorted(slots):
        ws = slots[slot]
        if not ws:
            continue
        ms = [m for w in ws for m in slot_marks.get((w.tenant, w.memory_id), ())]
        rows.extend(resolve_slot(ws, ms, confirmed, by_tenant.get(ws[0].tenant, [])))
    return rows


_INSERTS: dict[tuple[str, bool], tuple[str, Callable[[dict[str, Any]], tuple[Any, ...]]]] = {}


async def insert_rows(store: Store, conn: AsyncConnection, table: Any,
                      rows: Sequence[dict[str, Any]], *, ignore: bool = False) -> None:
    """Insert view rows (dicts with every column), skipping existing keys if `ignore`.

    On SQLite the rows go to the driver as plain tuples in column order: SQLAlchemy's
    per-row parameter processing costs about 10 us a row, more than the insert itself.
    """
    if not rows:
        return
    if store.dialect != "sqlite":
        await conn.execute(insert_ignore(store, table) if ignore else table.insert(), rows)
        return
    key = (table.name, ignore)
    got = _INSERTS.get(key)
    if got is None:
        cols = [c.name for c in table.c]
        got = _INSERTS[key] = (f"INSERT INTO {table.name} ({', '.join(cols)}) "
                               f"VALUES ({', '.join('?' for _ in cols)})"
                               + (" ON CONFLICT DO NOTHING" if ignore else ""),
                               operator.itemgetter(*cols))
    sql, values = got
    await conn.exec_driver_sql(sql, [values(r) for r in rows])


def mark_row(m: Mark) -> dict[str, Any]:
    return {"position": m.position, "tenant": m.tenant, "target": m.target, "kind": m.kind,
            "order_key": m.order, "by_id": m.by_id, "via_candidate": m.via_candidate,
            "owner": m.owner}


def covering(ts: Tombstone) -> Any:
    """SQL: the `mem_versions` row matches the tombstone's coordinates (whatever the
    orders: `Tombstone.covers_write` decides, the query only narrows)."""
    mv = t.mem_versions.c
    if ts.kind == "memory_id":
        cond = mv.memory_id == ts.memory_id
    elif ts.kind == "key":
        cond = and_(mv.ns_path == ts.ns_path, mv.mkey == ts.mkey)
    elif ts.kind == "prefix":
        cond = prefix_match(mv.ns_path, ts.ns_path or "\x00")
    else:
        cond = and_(mv.layer == "task", mv.task_key == ts.task_key)
    return and_(mv.tenant == ts.tenant, cond)


async def covered_slots(conn: AsyncConnection, ts: Tombstone) -> set[str]:
    """The slots of `mem_versions` a tombstone reaches."""
    mv = t.mem_versions.c
    q = select(mv.slot).where(covering(ts)).distinct()
    return {r[0] for r in (await conn.execute(q)).all()}


class TaskProjection:
    """Task summaries: one row per task, rebuilt from its notes whenever one arrives."""

    name = "tasks"
    tables = (t.task_notes, t.tasks_view)
    types = (*TASK_TYPES, "memory.forgotten")

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        tv = t.tasks_view.c
        notes = [se for se in batch if se.type in TASK_TYPES and se.task_key]
        affected: set[tuple[str, str]] = {(se.tenant, str(se.task_key)) for se in notes}
        if notes:
            await insert_rows(store, conn, t.task_notes, [note_row(se) for se in notes],
                              ignore=True)
        upto = batch[-1].position
        for se in batch:
            if se.type == "memory.forgotten" and se.ns_path and se.event is not None \
                    and "namespace_prefix" in se.event.data:
                q = select(tv.tenant, tv.task_key).where(
                    tv.tenant == se.tenant, prefix_match(tv.ns_path, se.ns_path))
                affected.update((r[0], r[1]) for r in (await conn.execute(q)).all())
        if affected:
            await summarize_tasks(store, conn, sorted(affected), upto)

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: dict[str, Any],
                        size: int) -> tuple[dict[str, Any] | None, int]:
        """One step of a bulk load into the emptied view (`projections.bulk`)."""
        from projections import bulk  # bulk builds on this module

        return await bulk.tasks_step(store, conn, state, size)


async def summarize_tasks(store: Store, conn: AsyncConnection,
                          keys: Sequence[tuple[str, str]], upto: int) -> None:
    """Recompute the `tasks_view` rows of these (tenant, task key)s from their notes.

    `task_notes` must hold every note up to `upto`; covered note bodies are erased.
    """
    tn, tv = t.task_notes.c, t.tasks_view.c
    by_task: dict[tuple[str, str], list[Note]] = {k: [] for k in keys}
    owners: dict[tuple[str, str], str] = {}
    to = t.task_owners.c
    for chunk in chunks(keys):
        q = select(t.task_notes).where(pairs_in(tn.tenant, tn.task_key, chunk))
        for r in (await conn.execute(q)).all():
            body = _dec(r.body)
            by_task[(r.tenant, r.task_key)].append(
                Note(r.position, r.tenant, r.task_key, r.type, bytes(r.order_key), body))
        q2 = select(to.tenant, to.task_key, to.ns_path).where(
            pairs_in(to.tenant, to.task_key, chunk))
        owners.update({(r[0], r[1]): r[2] for r in (await conn.execute(q2)).all()})
    tombs_of: dict[str, list[Tombstone]] = {}
    for x in await store.tombstones(conn, {k[0] for k in keys}, upto=upto):
        tombs_of.setdefault(x.tenant, []).append(x)
    rows = []
    erase: list[int] = []
    for (tenant, task_key), ns in by_task.items():
        owner = owners.get((tenant, task_key))
        tt = tombs_of.get(tenant, [])
        res = summarize(tenant, task_key, owner, ns, tt)
        erase.extend(n.position for n in ns if n.body is not None and (
            res["purged"] or any(x.covers_task(tenant, task_key, owner, n.order)
                                 for x in tt)))
        forgotten_owner = owner is not None and any(
            x.kind == "prefix" and owner.startswith(x.ns_path or "\x00") for x in tt)
        rows.append({"tenant": tenant, "task_key": task_key, "ns_path": owner,
                     "status": res["status"], "retain_until_us": res["retain_until_us"],
                     "purged": bool(res["purged"] or forgotten_owner),
                     "summary": res["summary"]})
    for chunk in chunks(erase, 500):
        await conn.execute(update(t.task_notes).where(tn.position.in_(chunk))
                           .values(body=None))
    for chunk in chunks(keys):
        await conn.execute(delete(t.tasks_view).where(pairs_in(tv.tenant, tv.task_key, chunk)))
    await insert_rows(store, conn, t.tasks_view, rows)


def note_row(se: StoredEvent) -> dict[str, Any]:
    """The `task_notes` row of a task event."""
    return {"position": se.position, "tenant": se.tenant, "task_key": se.task_key,
            "type": se.type, "order_key": se.order_key, "body": _enc(note_body(se))}


def _enc(obj: Any) -> bytes | None:
    return encode_json(obj) if obj is not None else None


def _dec(raw: bytes | None) -> dict[str, Any] | None:
    return orjson.loads(raw) if raw is not None else None


class ErasureProjection:
    """Erases covered content from the ledger's own payloads once a forget is appended.

    The envelope, digest and hash chain stay, so `replay verify` still passes; the
    content goes (R20). Views erase their own copies in their own projections.
    """

    name = "erasure"
    tables = ()
    types = ("memory.forgotten", "task.purged")

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        tombs = [ts for ts in await store.tombstones(
            conn, {se.tenant for se in batch if se.type in ("memory.forgotten", "task.purged")},
            upto=batch[-1].position) if batch[0].position <= ts.position]
        for ts in tombs:
            await erase_payloads(conn, ts)
            await erase_dead_letters(conn, ts)


def dead_letter_covered(obj: Any, ts: Tombstone) -> bool:
    """Does a rejected event (as received) name what a tombstone covers?

    A dead letter never became a memory, so it has no place in source order: any that
    names the covered target is erased, whatever its time (the cautious reading).
    """
    if not isinstance(obj, dict) or obj.get("tenant") != ts.tenant:
        return False
    d = obj.get("data")
    if not isinstance(d, dict):
        return False
    ns = d.get("namespace") or d.get("namespace_prefix")
    path = ns_path([str(p) for p in ns]) if isinstance(ns, list) else None
    if ts.kind == "memory_id":
        return ts.memory_id in (d.get("memory_id"), d.get("supersedes"))
    if ts.kind == "key":
        return path == ts.ns_path and d.get("key") == ts.mkey
    if ts.kind == "prefix":
        return path is not None and path.startswith(ts.ns_path or "\x00")
    return d.get("task_key") == ts.task_key


async def erase_dead_letters(conn: AsyncConnection, ts: Tombstone) -> int:
    """Null the stored payload of dead letters that name what a tombstone covers."""
    dl = t.dead_letters.c
    rows = (await conn.execute(select(dl.id, dl.payload).where(
        dl.tenant == ts.tenant, dl.payload.is_not(None)))).all()
    hit = []
    for r in rows:
        try:
            obj = orjson.loads(r.payload)
        except orjson.JSONDecodeError:
            continue
        if dead_letter_covered(obj, ts):
            hit.append(r.id)
    for chunk in chunks(hit, 500):
        await conn.execute(update(t.dead_letters).where(dl.id.in_(chunk)).values(payload=None))
    return len(hit)


async def erase_payloads(conn: AsyncConnection, ts: Tombstone) -> int:
    """Null the payload of every event a tombstone covers; returns how many rows."""
    ev = t.events.c
    cond: Any
    if ts.kind == "memory_id":
        cond = and_(ev.memory_id == ts.memory_id, ev.type.in_(WRITE_TYPES))
    elif ts.kind == "key":
        cond = and_(ev.ns_path == ts.ns_path, ev.mkey == ts.mkey, ev.type.in_(WRITE_TYPES),
                    ev.order_key <= ts.order_key)
    elif ts.kind == "prefix":
        cond = and_(prefix_match(ev.ns_path, ts.ns_path or ""),
                    ev.type.in_((*WRITE_TYPES, *TASK_CONTENT_TYPES)),
                    ev.order_key <= ts.order_key)
    else:
        cond = and_(ev.task_key == ts.task_key, ev.order_key <= ts.order_key, or_(
            ev.type.in_(TASK_CONTENT_TYPES), and_(ev.type.in_(WRITE_TYPES), ev.layer == "task")))
    return await Recorder.erase_payloads(conn, ev.tenant == ts.tenant, cond)


def default_projections() -> list[Projection]:
    """Every projection, in the order `project` runs them."""
    projs: list[Projection] = [MemoryProjection(), TaskProjection(), ErasureProjection()]
    try:
        vectors = importlib.import_module("projections.vectors")
    except ImportError:  # the vector index is optional until its module exists
        return projs
    projs.append(vectors.VectorProjection())
    return projs


class Runner:
    """Runs projections: one batch per call of `step`, or until caught up."""

    def __init__(self, store: Store, projections: Sequence[Projection] | None = None,
                 batch_size: int = 1000) -> None:
        self.store = store
        self.projections = list(projections or default_projections())
        self.batch_size = batch_size

    async def step(self, proj: Projection, upto: int | None = None,
                   size: int | None = None) -> int:
        """Apply one batch of at most `size` positions (default: `batch_size`) to one
        projection; returns how many positions it moved."""
        with no_gc_pauses():
            return await self._step(proj, upto, size or self.batch_size)

    async def _step(self, proj: Projection, upto: int | None, size: int) -> int:
        cp = t.checkpoints.c
        async with self.store.view_write() as conn:
            q = select(cp.position).where(cp.name == proj.name)
            if self.store.dialect == "postgresql":
                q = q.with_for_update()
            row = (await conn.execute(q)).first()
            if row is None:
                await _ensure_checkpoint(conn, self.store, proj.name)
                row = (await conn.execute(q)).first()
                assert row is not None
            position = int(row[0])
            # Only at 0 can a bulk load be running. Its state is read in a statement of
            # its own, after the lock: on PostgreSQL a subquery of the locking SELECT
            # would see the snapshot from before the wait.
            if position == 0 and isinstance(proj, BulkLoadable):
                moved = await self._bulk_step(proj, conn, size)
                if moved is not None:
                    return moved
            end = upto if upto is not None else await self.store.head(conn)
            if end <= position:
                return 0
            # Positions are gap-free, so a batch is a range of positions; a projection
            # that names its event types reads only those, and still moves past the rest.
            hi = min(position + size, end)
            types = getattr(proj, "types", None)
            batch = await self.store.read_events(conn, position, size, hi, types=types)
            started = time.perf_counter()
            if batch:
                await proj.apply(self.store, conn, batch)
            await conn.execute(update(t.checkpoints).where(cp.name == proj.name)
                               .values(position=hi, updated_at=time.time()))
        log.debug("projection_batch", projection=proj.name, after=position, position=hi,
                  events=len(batch), ms=round((time.perf_counter() - started) * 1000, 1))
        if proj.name == "erasure" and any(
                se.type in ("memory.forgotten", "task.purged") for se in batch):
            await self.store.reclaim()
        return hi - position

    async def _bulk_step(self, proj: BulkLoadable, conn: AsyncConnection,
                         size: int) -> int | None:
        """Run the next step of the projection's bulk load, if one is in progress.

        Returns the positions of progress it reports (at least 1), or None when there
        is no bulk load. The last step moves the checkpoint to the load's head.
        """
        state = await read_bulk_state(conn, proj.name)
        if state is None:
            return None
        started = time.perf_counter()
        new, moved = await proj.bulk_step(self.store, conn, state, size)
        await write_bulk_state(conn, proj.name, new)
        if new is None:
            await conn.execute(update(t.checkpoints).where(t.checkpoints.c.name == proj.name)
                               .values(position=int(state["head"]), updated_at=time.time()))
        log.debug("projection_bulk_step", projection=proj.name, phase=state.get("phase"),
                  done=new is None, ms=round((time.perf_counter() - started) * 1000, 1))
        return moved

    async def catch_up(self, upto: int | None = None) -> dict[str, int]:
        """Run every projection until it reaches `upto` (default: the head now)."""
        await self.store.open()
        head = upto if upto is not None else await self.store.head()
        applied: dict[str, int] = {}
        for proj in self.projections:
            n = 0
            while True:
                got = await self.step(proj, head)
                n += got
                if got == 0:
                    break
            applied[proj.name] = n
        return applied

    async def positions(self, conn: AsyncConnection | None = None) -> dict[str, int]:
        """Each projection's checkpoint position (read in `conn`, if given; no lock)."""
        cp = t.checkpoints.c
        if conn is None:
            await self.store.open()
            async with self.store.read() as c:
                rows = (await c.execute(select(cp.name, cp.position))).all()
        else:
            rows = (await conn.execute(select(cp.name, cp.position))).all()
        found = {r[0]: int(r[1]) for r in rows}
        return {p.name: found.get(p.name, 0) for p in self.projections}


def insert_ignore(store: Store, table: Any) -> Any:
    """INSERT that skips rows already there: re-applying a batch changes nothing."""
    ins = pg_insert if store.dialect == "postgresql" else sqlite_insert
    return ins(table).on_conflict_do_nothing()


async def _ensure_checkpoint(conn: AsyncConnection, store: Store, name: str) -> None:
    ins = pg_insert if store.dialect == "postgresql" else sqlite_insert
    await conn.execute(ins(t.checkpoints).values(name=name, position=0).on_conflict_do_nothing())
