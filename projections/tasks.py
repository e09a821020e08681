"""Task summaries as a pure function of a task's notes (R3-R6, R30).

User statements and system facts stay apart: `system` is built only from
`system_status` notes (which validation lets only the system of record write), user
corrections stay listed as corrections (pending until the system of record states a
fact after them), and any note that claims a field the system states differently is
flagged as a conflict, never merged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ledger.events import encode_json, parse_rfc3339, to_us
from ledger.forgets import Coordinates, Tombstone, covers
from ledger.records import StoredEvent


@dataclass(frozen=True, slots=True)
class Note:
    """One task event as the summary needs it; `body` is None once erased."""

    position: int
    tenant: str
    task_key: str
    type: str
    order: bytes
    body: dict[str, Any] | None


def note_body(se: StoredEvent) -> dict[str, Any] | None:
    """What a task note keeps: its data, source and actor (None if content is gone)."""
    if se.event is None:
        return None
    src = se.source.to_wire()
    return {"data": dict(se.event.data), "source": src, "actor": se.actor}


def _src(body: dict[str, Any], position: int) -> dict[str, Any]:
    # The ledger position is left out: a view must not depend on arrival order (R17).
    return {**body["source"], "actor": body["actor"]}


def summarize(tenant: str, task_key: str, owner_path: str | None, notes: Sequence[Note],
              tombstones: Sequence[Tombstone]) -> dict[str, Any]:
    """The summary row of one task, from all of its notes in source order."""
    ordered = sorted(notes, key=lambda n: n.order)
    # The task as a whole, by its key alone: only a purge of it covers that.
    whole = Coordinates(tenant, task_key=task_key)
    purged = any(covers(ts, whole) for ts in tombstones) or any(
        n.type == "task.purged" for n in ordered)
    live = [n for n in ordered if n.body is not None and not any(
        covers(ts, Coordinates(tenant, n.order, ns_path=owner_path, task_key=task_key))
        for ts in tombstones)]
    closed = [n for n in live if n.type == "task.closed"]
    opened = [n for n in live if n.type == "task.opened"]
    status = "closed" if closed or purged else "open"
    retain_until = None
    summary: dict[str, Any] = {"task_key": task_key, "status": status}
    if purged:
        summary["purged"] = True
        return {"status": status, "purged": True, "retain_until_us": None,
                "summary": encode_json(summary)}
    refs: dict[str, str] = {}
    title = None
    for n in opened:
        assert n.body is not None
        refs.update(n.body["data"].get("refs", {}))
        title = n.body["data"].get("title", title)
    reports: list[dict[str, Any]] = []
    corrections: list[dict[str, Any]] = []
    todos: list[dict[str, Any]] = []
    system_notes: list[Note] = []
    for n in live:
        if n.type != "task.noted":
            continue
        assert n.body is not None
        d = n.body["data"]
        item = {"text": d["text"], "source": _src(n.body, n.position)}
        if d.get("fields"):
            item["fields"] = d["fields"]
        kind = d["kind"]
        if kind == "user_report":
            reports.append(item)
        elif kind == "correction":
            corrections.append({**item, "_order": n.order})
        elif kind == "system_status":
            system_notes.append(n)
        elif kind == "todo":
            todos.append({**item, "done": False})
        elif kind == "todo_done":
            for td in todos:
                same_id = d.get("fields", {}).get("id") is not None and \
                    td.get("fields", {}).get("id") == d["fields"]["id"]
                if not td["done"] and (same_id or td["text"] == d["text"]):
                    td["done"] = True
                    td["done_source"] = item["source"]
                    break
    system: dict[str, Any] = {"status": None, "as_of": None, "fields": {}}
    last_sys: Note | None = system_notes[-1] if system_notes else None
    if last_sys is not None:
        assert last_sys.body is not None
        d = last_sys.body["data"]
        fields = dict(d.get("fields") or {})
        system = {
            "status": fields.get("status", d["text"]),
            "as_of": last_sys.body["source"]["at"],
            "fields": fields,
            "text": d["text"],
            "source": _src(last_sys.body, last_sys.position),
        }
    for c in corrections:
        # A user correction changes the task's description only once the system of record
        # states a fact after it (R5); until then it stays pending, apart from the facts.
        order = c.pop("_order")
        c["pending"] = last_sys is None or last_sys.order < order
    conflicts = _conflicts(reports, corrections, system)
    for n in closed:
        assert n.body is not None
        ru = n.body["data"].get("retain_until")
        if ru is not None:
            us = to_us(parse_rfc3339(ru))
            retain_until = us if retain_until is None else max(retain_until, us)
    summary.update(
        title=title, refs=refs, owner=owner_path.split("\x1f")[:-1] if owner_path else None,
        reports=reports, corrections=corrections, system=system, todos=todos,
        conflicts=conflicts,
    )
    if closed:
        last = closed[-1]
        assert last.body is not None
        summary["closed"] = {"resolution": last.body["data"].get("resolution"),
                             "retain_until": last.body["data"].get("retain_until"),
                             "source": _src(last.body, last.position)}
    return {"status": status, "purged": False, "retain_until_us": retain_until,
            "summary": encode_json(summary)}


def _conflicts(reports: list[dict[str, Any]], corrections: list[dict[str, Any]],
               system: dict[str, Any]) -> list[dict[str, Any]]:
    """Non-system notes that claim a field the system of record states differently (R30)."""
    out: list[dict[str, Any]] = []
    facts = {**system.get("fields", {})}
    if system.get("status") is not None:
        facts.setdefault("status", system["status"])
    if not facts:
        return out
    for item in (*reports, *corrections):
        for field, claimed in (item.get("fields") or {}).items():
            if field in facts and facts[field] != claimed:
                out.append({"field": field, "claimed": claimed, "system": facts[field],
                            "system_as_of": system.get("as_of"),
                            "source": item["source"]})
    return out
