"""`replay audit`: the history of a memory, a key or a task, and the recalls that used it.

Every event that wrote, marked, confirmed, forgot or purged the subject is listed in
ledger order with its envelope (position, type, actor, source, recorded time) and its
content, or `"redacted": true` when the content is gone (suppressed, erased, or covered
by a forget whose erasure has not run yet: an audit never shows what a forget covers).
Writes carry the version and status the memories view gives them. Recalls are listed
from the recall audit tables: audit id, time, principal, score and reason, never values
(R25). An event a projection quarantined carries `"quarantined"`: for each such view,
the error's class and safe message, code version, time and attempts
(docs/projections.md#quarantine). An operator command: no principal, `--tenant` narrows.

`audit_as_of` is the same history cut at a past instant, with what was active then
and which event made it so (`projections.asof`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.events import MEMORY_WRITES, ns_parts, ns_path, parse_rfc3339, to_us
from ledger.forgets import Coordinates, Tombstone, covers, tombstone_from_row
from ledger.store import Store
from projections import asof, quarantine
from replay.rows import by_tenant, covering, row_dict

_CHUNK = 400


def _chunks(items: Sequence[Any], n: int = _CHUNK) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


async def _events_at(conn: AsyncConnection, positions: Iterable[int]) -> list[dict[str, Any]]:
    ev = t.events.c
    out: list[dict[str, Any]] = []
    for chunk in _chunks(sorted(set(positions))):
        q = select(t.events).where(ev.position.in_(chunk))
        out.extend(row_dict(r) for r in (await conn.execute(q)).all())
    return out


async def _tombstones(conn: AsyncConnection, tenants: Iterable[str]) -> list[Tombstone]:
    q = select(t.tombstones).where(t.tombstones.c.tenant.in_(sorted(set(tenants)) or [""]))
    return [tombstone_from_row(r) for r in (await conn.execute(q)).all()]


async def _memory_positions(conn: AsyncConnection, pairs: set[tuple[str, str]]) -> set[int]:
    """Events naming these memories, and marks (supersessions, confirmations) on them."""
    ev, mk = t.events.c, t.mem_marks.c
    found: set[int] = set()
    tenants: dict[str, list[str]] = {}
    for tenant, mid in pairs:
        tenants.setdefault(tenant, []).append(mid)
    for tenant, ids in tenants.items():
        for chunk in _chunks(sorted(ids)):
            q = select(ev.position).where(ev.tenant == tenant, ev.memory_id.in_(chunk))
            found.update(int(r[0]) for r in (await conn.execute(q)).all())
            q2 = select(mk.position).where(mk.tenant == tenant, mk.target.in_(chunk))
            found.update(int(r[0]) for r in (await conn.execute(q2)).all())
    return found


def _covering_writes(tombs: Sequence[Tombstone], writes: Sequence[dict[str, Any]]
                     ) -> set[int]:
    """Positions of forgets and purges that cover any of these writes."""
    return {ts.position for ts in tombs for w in writes if covers(ts, Coordinates(
        w["tenant"], bytes(w["order_key"]), w["memory_id"], w["ns_path"], w["mkey"],
        w["task_key"]))}


async def _versions(conn: AsyncConnection, pairs: set[tuple[str, str]]
                    ) -> dict[tuple[str, str], Any]:
    mv = t.mem_versions.c
    out: dict[tuple[str, str], Any] = {}
    tenants: dict[str, list[str]] = {}
    for tenant, mid in pairs:
        tenants.setdefault(tenant, []).append(mid)
    for tenant, ids in tenants.items():
        for chunk in _chunks(sorted(ids)):
            q = select(mv.tenant, mv.memory_id, mv.version, mv.status, mv.layer,
                       mv.superseded_by).where(mv.tenant == tenant, mv.memory_id.in_(chunk))
            out.update({(r[0], r[1]): r for r in (await conn.execute(q)).all()})
    return out


def _item(row: dict[str, Any], tombs: dict[str, list[Tombstone]],
          versions: dict[tuple[str, str], Any]) -> dict[str, Any]:
    item: dict[str, Any] = {
        "position": row["position"], "type": row["type"], "tenant": row["tenant"],
        "actor": row["actor"], "idempotency_key": row["idempotency_key"],
        "source": {"kind": row["source_kind"], "id": row["source_id"],
                   "seq": row["source_seq"], "at": row["source_at"],
                   "event_id": row["source_event_id"]},
        "recorded_at": row["recorded_at"],
    }
    for k in ("memory_id", "task_key", "layer", "supersedes"):
        if row.get(k) is not None:
            item[k] = row[k]
    if row["ns_path"] is not None:
        item["namespace"] = list(ns_parts(row["ns_path"]))
    if row["mkey"] is not None:
        item["key"] = row["mkey"]
    ts = covering(tombs, row)
    if row["payload"] is None or ts is not None:
        item["redacted"] = True
        if row["suppressed"]:
            item["suppressed"] = True
        if ts is not None:
            item["forgotten_by"] = ts.position
    else:
        item["content"] = orjson.loads(row["payload"]).get("data")
    if row["type"] in MEMORY_WRITES and row["memory_id"]:
        v = versions.get((row["tenant"], row["memory_id"]))
        if v is not None:
            item["version"] = v.version
            item["status"] = v.status
            if v.superseded_by:
                item["superseded_by"] = v.superseded_by
        else:
            item["version"] = None
            item["status"] = "not projected"
    return item


async def _recalls_of_memories(conn: AsyncConnection, pairs: set[tuple[str, str]]
                               ) -> list[dict[str, Any]]:
    ai, ra = t.recall_audit_items.c, t.recall_audit.c
    hits: dict[str, set[str]] = {}
    tenants: dict[str, list[str]] = {}
    for tenant, mid in pairs:
        tenants.setdefault(tenant, []).append(mid)
    for tenant, ids in tenants.items():
        for chunk in _chunks(sorted(ids)):
            q = select(ai.audit_id, ai.memory_id).where(ai.tenant == tenant,
                                                       ai.memory_id.in_(chunk))
            for r in (await conn.execute(q)).all():
                hits.setdefault(r[0], set()).add(r[1])
    out: list[dict[str, Any]] = []
    for chunk in _chunks(sorted(hits)):
        q2 = select(t.recall_audit).where(ra.audit_id.in_(chunk))
        for r in (await conn.execute(q2)).all():
            for entry in orjson.loads(r.items):
                if entry.get("memory_id") in hits[r.audit_id]:
                    out.append(_recall_entry(r, entry))
    return sorted(out, key=lambda x: (x["at"], x["audit_id"]))


async def _recalls_of_tasks(conn: AsyncConnection, pairs: set[tuple[str, str]]
                            ) -> list[dict[str, Any]]:
    ra = t.recall_audit.c
    out: list[dict[str, Any]] = []
    for tenant in sorted({p[0] for p in pairs}):
        keys = {p[1] for p in pairs if p[0] == tenant}
        result = await conn.stream(select(t.recall_audit).where(ra.tenant == tenant))
        async for part in result.partitions(500):
            for r in part:
                for entry in orjson.loads(r.items):
                    if entry.get("kind") == "task" and entry.get("task_key") in keys:
                        out.append(_recall_entry(r, entry))
    return sorted(out, key=lambda x: (x["at"], x["audit_id"]))


def _recall_entry(r: Any, entry: dict[str, Any]) -> dict[str, Any]:
    out = {"audit_id": r.audit_id, "at": r.at, "principal": r.principal}
    for k in ("memory_id", "task_key", "version", "layer", "score", "reason"):
        if k in entry:
            out[k] = entry[k]
    return out


async def audit(store: Store, *, memory_id: str | None = None,
                namespace: Sequence[str] | None = None, key: str | None = None,
                task: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    """The history of one subject: a memory id, a namespace + key, or a task."""
    chosen = [x for x in (memory_id, key or namespace, task) if x]
    if len(chosen) != 1 or (key is None) != (namespace is None):
        raise ValidationError("audit", "give exactly one of memory_id, namespace with key, "
                              "or task")
    await store.open()
    ev, to = t.events.c, t.task_owners.c
    query: dict[str, Any] = {}
    async with store.read() as conn:
        positions: set[int] = set()
        writes: list[dict[str, Any]] = []
        task_pairs: set[tuple[str, str]] = set()
        if memory_id is not None:
            query = {"memory_id": memory_id}
            q = select(t.events).where(ev.memory_id == memory_id)
            if tenant is not None:
                q = q.where(ev.tenant == tenant)
            rows = [row_dict(r) for r in (await conn.execute(q)).all()]
            positions.update(int(r["position"]) for r in rows)
            writes = [r for r in rows if r["type"] in MEMORY_WRITES]
            pairs = {(r["tenant"], memory_id) for r in rows}
            if tenant is not None:
                pairs.add((tenant, memory_id))
        elif namespace is not None and key is not None:
            if len(namespace) < 2:
                raise ValidationError("namespace", "needs at least tenant/user")
            if tenant is not None and tenant != namespace[0]:
                raise ValidationError("tenant", "differs from the namespace's tenant")
            query = {"namespace": list(namespace), "key": key}
            q = select(t.events).where(ev.tenant == namespace[0],
                                       ev.ns_path == ns_path(list(namespace)), ev.mkey == key)
            rows = [row_dict(r) for r in (await conn.execute(q)).all()]
            positions.update(int(r["position"]) for r in rows)
            writes = [r for r in rows if r["type"] in MEMORY_WRITES]
            pairs = {(w["tenant"], w["memory_id"]) for w in writes if w["memory_id"]}
        else:
            assert task is not None
            query = {"task": task}
            q = select(to.tenant, to.task_key).where(to.task_key == task)
            if tenant is not None:
                q = q.where(to.tenant == tenant)
            task_pairs = {(r[0], r[1]) for r in (await conn.execute(q)).all()}
            if tenant is not None:
                task_pairs.add((tenant, task))
            rows = []
            for tn, tk in sorted(task_pairs):
                q2 = select(t.events).where(ev.tenant == tn, ev.task_key == tk)
                rows.extend(row_dict(r) for r in (await conn.execute(q2)).all())
            positions.update(int(r["position"]) for r in rows)
            writes = [r for r in rows if r["type"] in MEMORY_WRITES]
            pairs = {(w["tenant"], w["memory_id"]) for w in writes if w["memory_id"]}
        if tenant is not None:
            query["tenant"] = tenant
        positions.update(int(w["position"]) for w in writes)
        positions.update(await _memory_positions(conn, pairs))
        tenants = {p[0] for p in pairs} | {p[0] for p in task_pairs}
        tombs = await _tombstones(conn, tenants)
        positions.update(_covering_writes(tombs, writes))
        owners = {(r[0], r[1]): r[2] for tn, tk in task_pairs for r in (await conn.execute(
            select(to.tenant, to.task_key, to.ns_path).where(to.tenant == tn,
                                                             to.task_key == tk))).all()}
        # The tasks as a whole (whatever the order): by key or by owner namespace.
        positions.update(ts.position for ts in tombs for (tn, tk) in task_pairs
                         if covers(ts, Coordinates(tn, ns_path=owners.get((tn, tk)),
                                                   task_key=tk)))
        rows = await _events_at(conn, positions)
        # Memories reached through marks and targets: their versions too.
        pairs |= {(r["tenant"], r["memory_id"]) for r in rows
                  if r["type"] in MEMORY_WRITES and r["memory_id"]}
        versions = await _versions(conn, pairs)
        grouped = by_tenant(tombs)
        events = [_item(r, grouped, versions) for r in sorted(rows, key=lambda r: r["position"])]
        held: dict[int, list[dict[str, Any]]] = {}
        for qe in await quarantine.entries(conn, positions=[e["position"] for e in events]):
            held.setdefault(int(qe["position"]), []).append(
                {k: qe[k] for k in ("projection", "error", "message", "code_version",
                                   "recorded_at", "attempts")})
        for e in events:
            if e["position"] in held:
                e["quarantined"] = held[e["position"]]
        memories = [{"tenant": k[0], "memory_id": k[1], "version": v.version,
                     "status": v.status, "layer": v.layer}
                    for k, v in sorted(versions.items())]
        recalls = await _recalls_of_memories(conn, pairs)
        tasks_out: list[dict[str, Any]] = []
        if task_pairs:
            recalls += await _recalls_of_tasks(conn, task_pairs)
            tv = t.tasks_view.c
            for tn, tk in sorted(task_pairs):
                r = (await conn.execute(select(tv.status, tv.purged).where(
                    tv.tenant == tn, tv.task_key == tk))).first()
                tasks_out.append({"tenant": tn, "task_key": tk,
                                  "status": r[0] if r else "not projected",
                                  "purged": bool(r[1]) if r else False})
    out: dict[str, Any] = {"query": query, "events": events, "memories": memories,
                           "recalls": recalls}
    if task is not None:
        out["tasks"] = tasks_out
    return out


async def audit_as_of(store: Store, memory_id: str, as_of: str, *,
                      tenant: str | None = None) -> dict[str, Any]:
    """`replay audit --memory-id M --as-of T`: the memory's history as the ledger held it
    at that instant (events recorded after it are left out), what was active in its slot
    then, and which event made it so (docs/projections.md#as-of)."""
    full = await audit(store, memory_id=memory_id, tenant=tenant)
    async with store.read() as conn:
        instant = await asof.resolve(conn, as_of)
        tenants = sorted({e["tenant"] for e in full["events"]} | ({tenant} if tenant else set()))
        then = {tn: await asof.explain_memory(conn, tn, memory_id, instant) for tn in tenants}
    events = [e for e in full["events"] if e["position"] <= instant.position]
    recalls = [r for r in full["recalls"] if to_us(parse_rfc3339(r["at"])) <= instant.now_us]
    return {"query": {**full["query"], "as_of": as_of}, **instant.wire(),
            "then": [{"tenant": tn, **x} for tn, x in then.items() if x is not None],
            "events": events, "recalls": recalls}


async def audit_record(store: Store, audit_id: str) -> dict[str, Any]:
    """One recall audit record: who recalled what, when, with which scores and reasons."""
    await store.open()
    ra = t.recall_audit.c
    async with store.read() as conn:
        r = (await conn.execute(select(t.recall_audit).where(ra.audit_id == audit_id))).first()
    if r is None:
        raise ValidationError("audit_id", f"no recall audit record {audit_id!r}")
    return {"audit_id": r.audit_id, "at": r.at, "tenant": r.tenant, "principal": r.principal,
            "query_digest": r.query_digest, "items": orjson.loads(r.items)}
