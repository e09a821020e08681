"""`replay verify --forgotten`: no copy of covered content is left.

Tombstone by tombstone: no view, index, recall snapshot file or ledger payload still
holds covered content, every register entry is in the ledger, and the backend keeps no
old copies (SQLite: the WAL no longer holds old pages, secure_delete is on; PostgreSQL:
dead row versions are counted). It checks structure (covered content is NULL or
absent): it cannot keep the forgotten text to search for it.
"""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import and_, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.errors import RegisterError
from ledger.forgets import Coordinates, Tombstone, covers, covers_sql, tombstone_from_row
from ledger.store import Store
from projections import matrix_snapshot
from projections.erasure import dead_letter_covered
from projections.runner import Runner
from replay.rebuild import register_events, register_problems
from replay.rows import by_tenant, covering, row_dict, stream_rows
from replay.verify.report import MAX_PROBLEMS, Report


async def _check_views_erased(conn: AsyncConnection, tombs: list[Tombstone], rep: Report,
                              covered_ids: set[tuple[str, str]] | None = None,
                              purged_tasks: set[tuple[str, str]] | None = None
                              ) -> dict[str, int]:
    """Check the views; fills `covered_ids` (memories) and `purged_tasks` (tasks) with
    the covered items it found, for the checks of copies outside the database."""
    mv, tn, tv, vc = t.mem_versions.c, t.task_notes.c, t.tasks_view.c, t.vectors.c
    covered_ids = set() if covered_ids is None else covered_ids
    purged_tasks = set() if purged_tasks is None else purged_tasks
    checked = {"mem_versions": 0, "task_notes": 0, "tasks_view": 0, "vectors": 0,
               "lexical_docs": 0, "embedding_refs": 0, "mem_history": 0}
    er = t.embedding_refs.c
    mh = t.mem_history.c
    for ts in tombs:
        # The stored past (as-of reads): every interval of a covered version, cleared.
        for r in (await conn.execute(select(t.mem_history).where(covers_sql(ts, mh)))).all():
            checked["mem_history"] += 1
            held = [c for c in ("value", "text", "scope", "expires_at", "session_id",
                                "vector") if getattr(r, c) is not None]
            if held or not r.redacted:
                rep.add("forgotten", place="mem_history", tombstone=ts.position,
                        tenant=r.tenant, memory_id=r.memory_id, valid_from=r.valid_from,
                        columns=held)
        q = select(t.mem_versions).where(covers_sql(ts, mv))
        for r in (await conn.execute(q)).all():
            checked["mem_versions"] += 1
            covered_ids.add((r.tenant, r.memory_id))
            held = [c for c in ("value", "text", "scope", "session_id")
                    if getattr(r, c) is not None]
            if held or r.status != "forgotten":
                rep.add("forgotten", place="mem_versions", tombstone=ts.position,
                        tenant=r.tenant, memory_id=r.memory_id, columns=held,
                        status=r.status)
        to = t.task_owners.c  # a note's namespace is its task owner's
        q2 = select(tn.position, tn.tenant, tn.task_key, tn.order_key, tn.body.is_not(None)
                    ).select_from(t.task_notes.outerjoin(t.task_owners, and_(
                        to.tenant == tn.tenant, to.task_key == tn.task_key))
                    ).where(covers_sql(ts, tn, ns_path=to.ns_path))
        for r in (await conn.execute(q2)).all():
            checked["task_notes"] += 1
            if r[4]:
                rep.add("forgotten", place="task_notes", tombstone=ts.position, tenant=r[1],
                        task_key=r[2], position=int(r[0]))
        q3 = select(t.tasks_view).where(covers_sql(ts, tv, order_key=None))
        for r in (await conn.execute(q3)).all():
            checked["tasks_view"] += 1
            purged_tasks.add((r.tenant, r.task_key))
            if not r.purged:
                rep.add("forgotten", place="tasks_view", tombstone=ts.position,
                        tenant=r.tenant, task_key=r.task_key,
                        detail="task covered by a purge or prefix forget is not purged")
            if covers(ts, Coordinates(r.tenant, task_key=r.task_key)):  # a purge of it
                summary = orjson.loads(r.summary)
                extra = sorted(set(summary) - {"task_key", "status", "purged"})
                if extra:
                    rep.add("forgotten", place="tasks_view", tombstone=ts.position,
                            tenant=r.tenant, task_key=r.task_key, columns=extra,
                            detail="purged task summary still holds content")
    for tenant, memory_id in sorted(covered_ids):
        checked["vectors"] += 1
        hit = (await conn.execute(select(func.count()).where(
            vc.tenant == tenant, vc.kind == "memory", vc.item_id == memory_id))).scalar()
        if hit:
            rep.add("forgotten", place="vectors", tenant=tenant, memory_id=memory_id)
        # The lexical index: its row (and so, by its triggers, its FTS5 entry).
        checked["lexical_docs"] += 1
        ld = t.lexical_docs.c
        if (await conn.execute(select(func.count()).where(
                ld.tenant == tenant, ld.item_id == memory_id))).scalar():
            rep.add("forgotten", place="lexical_docs", tenant=tenant, memory_id=memory_id)
        # The embedding cache: a covered item still naming a digest means its cached
        # vector was not erased (`projections.embed_cache.erase_items` drops both).
        checked["embedding_refs"] += 1
        if (await conn.execute(select(func.count()).where(
                er.tenant == tenant, er.item_id == memory_id))).scalar():
            rep.add("forgotten", place="embedding_cache", tenant=tenant, memory_id=memory_id)
    for tenant, task_key in sorted(purged_tasks):
        hit = (await conn.execute(select(func.count()).where(
            vc.tenant == tenant, vc.kind == "task", vc.task_key == task_key))).scalar()
        if hit:
            rep.add("forgotten", place="vectors", tenant=tenant, task_key=task_key)
        checked["embedding_refs"] += 1
        if (await conn.execute(select(func.count()).where(
                er.tenant == tenant, er.item_id == "task:" + task_key))).scalar():
            rep.add("forgotten", place="embedding_cache", tenant=tenant, task_key=task_key)
    return checked


def _check_snapshots_erased(store: Store, covered_ids: set[tuple[str, str]],
                            purged_tasks: set[tuple[str, str]], rep: Report) -> int:
    """Recall's snapshot files beside a SQLite database (`projections.matrix_snapshot`):
    none may hold a covered memory or task (nor be unreadable). Returns files checked."""
    tenants: dict[str, tuple[set[str], set[str]]] = {}
    for tenant, memory_id in covered_ids:
        tenants.setdefault(tenant, (set(), set()))[0].add(memory_id)
    for tenant, task_key in purged_tasks:
        tenants.setdefault(tenant, (set(), set()))[1].add(task_key)
    d = matrix_snapshot.directory(store.url)
    for tenant, (mems, tasks) in sorted(tenants.items()):
        for name in matrix_snapshot.holding(store.url, tenant, mems, tasks):
            rep.add("forgotten", place="recall_snapshot", tenant=tenant, file=name,
                    detail="a recall snapshot holds a covered item (or cannot be read)")
    return len(matrix_snapshot.all_files(d))


async def _check_payloads_erased(conn: AsyncConnection, store: Store,
                                 tombs: list[Tombstone], rep: Report) -> int:
    grouped = by_tenant(tombs)
    ev = t.events.c
    n = 0
    where = ev.payload.is_not(None) & ev.tenant.in_(sorted(grouped) or [""])
    async for part in stream_rows(conn, t.events, store.recorder, where=where, batch=2000):
        for r in part:
            row = row_dict(r)
            ts = covering(grouped, row)
            if ts is not None:
                n += 1
                rep.add("forgotten", place="events.payload", tombstone=ts.position,
                        position=int(row["position"]))
    return n


async def _check_dead_letters_erased(conn: AsyncConnection, tombs: list[Tombstone],
                                     rep: Report) -> int:
    """Dead letters that name a covered target must hold no payload."""
    dl = t.dead_letters.c
    grouped = by_tenant(tombs)
    rows = (await conn.execute(select(dl.id, dl.tenant, dl.payload).where(
        dl.payload.is_not(None), dl.tenant.in_(sorted(grouped) or [""])))).all()
    for r in rows:
        if r.payload is None:  # sealed and its key destroyed: unreadable
            continue
        try:
            obj = orjson.loads(r.payload)
        except orjson.JSONDecodeError:
            continue
        for ts in grouped.get(r.tenant, []):
            if dead_letter_covered(obj, ts):
                rep.add("forgotten", place="dead_letters.payload", tombstone=ts.position,
                        dead_letter=int(r.id))
                break
    return len(rows)


async def verify_forgotten(store: Store, *, catch_up: bool = True,
                           limit: int = MAX_PROBLEMS) -> dict[str, Any]:
    """Prove that no copy of covered content is left; see the module docstring."""
    await store.open()
    if catch_up:
        await Runner(store).catch_up()
    rep = Report(limit)
    notes: list[str] = []
    scan = store.register.scan()
    try:
        register = register_events(store)
    except RegisterError:
        register = []  # the damage is reported below, from the scan
    async with store.read() as conn:
        await store.recorder.keep_transaction_open(conn)
        for problem in await register_problems(conn, scan):
            rep.add("forgotten", place="forget_register", detail=problem)
        if scan.format == "legacy":
            notes.append(f"forget register {scan.path} is in the legacy format (no ledger "
                         "id, sequence or chain): the next forget or `memledger replay "
                         "rebuild` rewrites it in format 2")
        tombs = sorted((tombstone_from_row(r) for r in
                        (await conn.execute(select(t.tombstones))).all()),
                       key=lambda x: x.position)
        covered_ids: set[tuple[str, str]] = set()
        purged_tasks: set[tuple[str, str]] = set()
        checked = await _check_views_erased(conn, tombs, rep, covered_ids, purged_tasks)
        checked["recall_snapshots"] = _check_snapshots_erased(store, covered_ids,
                                                              purged_tasks, rep)
        checked["payloads_still_held"] = await _check_payloads_erased(conn, store, tombs, rep)
        checked["dead_letters"] = await _check_dead_letters_erased(conn, tombs, rep)
        ev = t.events.c
        for e in register:
            row = (await conn.execute(select(ev.position).where(
                ev.tenant == e.tenant, ev.idempotency_key == e.idempotency_key))).first()
            if row is None:
                rep.add("forgotten", place="register",
                        tenant=e.tenant, idempotency_key=e.idempotency_key,
                        detail="forget in the register is missing from the ledger; run "
                               "`memledger replay rebuild` to reapply it")
        stats = await store.recorder.dead_row_counts(conn)
    for leftover in await store.recorder.erasure_leftovers():
        rep.add("forgotten", **leftover)
    if stats and any(stats.values()):
        notes.append("PostgreSQL keeps dead row versions until VACUUM: run `VACUUM events, "
                     "mem_versions, task_notes, tasks_view, vectors, lexical_docs, "
                     "mem_history` to reclaim them")
    out = rep.result(tombstones=len(tombs), register_entries=len(register), checked=checked)
    if stats:
        out["pg_dead_tuples"] = stats
    if notes:
        out["notes"] = notes
    return out
