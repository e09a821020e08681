"""The active-memory view as a pure function of facts: writes, marks and tombstones.

Nothing here does I/O or reads a clock. A slot's rows are *resolved* from the set of
facts about it, so the view cannot depend on the order in which events arrived, on
batching, or on redelivery (R17): the same set of facts always gives the same rows.
Expiry is decided at read time, because "now" is not a fact of the ledger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ledger.events import (
    CANDIDATE_KINDS,
    MEMORY_WRITES,
    NS_SEP,
    USER_KINDS,
    encode_json,
    parse_rfc3339,
    source_wire,
    to_us,
)
from ledger.forgets import Coordinates, Tombstone, covers
from ledger.records import StoredEvent
from ledger.vault import (
    SealedText,
    SealedView,
    keyed,
    split_keyed,
    subject,
    subject_text,
)


@dataclass(frozen=True, slots=True)
class WriteFact:
    """One memory write as the view needs it (content absent once erased)."""

    tenant: str
    memory_id: str
    slot: str
    ns_path: str
    key: str
    layer: str
    task_key: str | None
    session_id: str | None
    position: int
    order: bytes
    candidate: bool
    actor: str
    source: bytes
    value: bytes | None = None
    text: str | None = None
    scope: str | None = None
    supersedes: str | None = None
    expires_at: str | None = None
    suppressed: bool = False


@dataclass(frozen=True, slots=True)
class Mark:
    """A supersession or a confirmation aimed at a memory id."""

    position: int
    tenant: str
    target: str
    kind: str  # superseded | confirmed
    order: bytes
    by_id: str | None = None
    via_candidate: str | None = None
    #: For a `supersedes` written on a user's own behalf: the namespace path prefix
    #: `[tenant, user]` the target must lie under, or the mark does nothing (R24).
    owner: str | None = None


def _fact(tenant: str, memory_id: str, slot: str, nsp: str, key: str, layer: str | None,
          task_key: str | None, position: int, order: bytes, actor: str,
          source: dict[str, Any], data: Mapping[str, Any], supersedes: str | None,
          suppressed: bool, kid: str | None) -> WriteFact:
    """A write fact from the envelope's fields, the source's wire form and the `data`
    (empty once the content is erased); `kid`: the key its event's payload is sealed
    under, which seals the view's copies too (None: the payload is in clear)."""
    return WriteFact(
        tenant=tenant, memory_id=memory_id, slot=slot, ns_path=nsp, key=key,
        layer=layer or "long", task_key=task_key, session_id=data.get("session_id"),
        position=position, order=order,
        candidate=layer == "long" and source["kind"] in CANDIDATE_KINDS, actor=actor,
        source=encode_json({**source, "actor": actor}),
        # Content bytes carry their subject's key id: the view seals them (ledger.vault).
        value=subject(encode_json(data["value"]), kid or "") if "value" in data else None,
        text=subject_text(data.get("text"), kid or ""), scope=data.get("scope"),
        supersedes=supersedes,
        expires_at=data.get("expires_at"), suppressed=suppressed,
    )


#: The `events` columns `write_fact_of_row` reads, in its order (payload last).
WRITE_COLUMNS = ("position", "tenant", "actor", "source_kind", "source_id", "source_at",
                 "source_seq", "source_event_id", "order_key", "slot", "memory_id",
                 "ns_path", "mkey", "layer", "task_key", "supersedes", "suppressed",
                 "payload")


def write_fact_of_row(r: Sequence[Any]) -> WriteFact:
    """The write fact of an `events` row selected as `WRITE_COLUMNS`.

    The same fact `write_fact` builds from a `StoredEvent`, without building the event:
    a bulk rebuild reads every write once, and the stored payload is already validated
    and normalised (`replay verify` checks it against its digest).
    """
    (position, tenant, actor, kind, sid, at, seq, event_id, order, slot, memory_id, nsp,
     key, layer, task_key, supersedes, suppressed, payload) = r
    # Read through `keyed`: content and key id; a sealed payload read raw (no vault
    # here, so not opened) has no content.
    payload, kid = split_keyed(payload)
    data = orjson.loads(payload)["data"] if payload is not None else {}
    return _fact(tenant, memory_id, slot, nsp, key, layer, task_key, int(position),
                 bytes(order), actor, source_wire(kind, sid, at, seq, event_id), data,
                 supersedes, bool(suppressed) or payload is None, kid)


def write_fact(se: StoredEvent) -> WriteFact:
    """The write fact of a `memory.written` / `memory.corrected` stored event."""
    assert se.type in MEMORY_WRITES and se.slot and se.memory_id and se.ns_path and se.mkey
    return _fact(se.tenant, se.memory_id, se.slot, se.ns_path, se.mkey, se.layer,
                 se.task_key, se.position, se.order_key, se.actor, se.source.to_wire(),
                 se.event.data if se.event is not None else {}, se.supersedes,
                 se.suppressed or se.event is None, se.key_id)


def marks_of(se: StoredEvent) -> list[Mark]:
    """The marks an event sets: explicit supersessions, confirmations, `supersedes`.

    A write's `supersedes` is read from the envelope, so it holds for suppressed and
    erased writes too: the view must not depend on whether content arrived (R17).
    """
    if se.type in MEMORY_WRITES:
        if not se.supersedes or not se.memory_id:
            return []
        candidate = se.layer == "long" and se.source.kind in CANDIDATE_KINDS
        owner = None
        if se.source.kind in USER_KINDS and se.ns_path:
            owner = NS_SEP.join(se.ns_path.split(NS_SEP)[:2]) + NS_SEP
        return [Mark(se.position, se.tenant, se.supersedes, "superseded", se.order_key,
                     se.memory_id, se.memory_id if candidate else None, owner)]
    ev = se.event
    if ev is None:
        return []
    d = ev.data
    if se.type == "memory.superseded":
        return [Mark(se.position, se.tenant, d["memory_id"], "superseded", se.order_key,
                     d.get("superseded_by"))]
    if se.type == "memory.confirmed":
        return [Mark(se.position, se.tenant, d["memory_id"], "confirmed", se.order_key)]
    return []


def is_covered(w: WriteFact, tombstones: Sequence[Tombstone]) -> bool:
    """Is the write covered by any of the tombstones (R20, R22)?"""
    if not tombstones:
        return False
    v = Coordinates(w.tenant, w.order, w.memory_id, w.ns_path, w.key, w.task_key)
    return any(covers(ts, v) for ts in tombstones)


def resolve_slot(writes: Sequence[WriteFact], marks: Sequence[Mark],
                 confirmed: set[str], tombstones: Sequence[Tombstone]) -> list[dict[str, Any]]:
    """The view rows of one slot, from every fact known about it.

    `marks` are those aimed at the slot's memory ids; `confirmed` holds the ids of
    candidates confirmed anywhere (a candidate's `supersedes` counts only then).
    """
    if len(writes) == 1 and not marks:
        # Most slots hold one write that nothing marks: skip the ranking.
        w = writes[0]
        forgotten = w.suppressed or is_covered(w, tombstones)
        status = "forgotten" if forgotten else "candidate" if w.candidate else "active"
        row = _row(w, status, forgotten, None)
        row["version"] = 1
        return [row]
    confirm_order: dict[str, bytes] = {}
    explicit: dict[str, Mark] = {}
    paths = {w.memory_id: w.ns_path for w in writes}
    for m in sorted(marks, key=lambda m: m.order):
        if m.owner is not None and not paths.get(m.target, "").startswith(m.owner):
            continue  # a user's `supersedes` never reaches another user's memory
        if m.kind == "confirmed":
            confirm_order.setdefault(m.target, m.order)
        elif m.via_candidate is None or m.via_candidate in confirmed:
            explicit.setdefault(m.target, m)

    def eff(w: WriteFact) -> bytes:
        # A confirmation makes a candidate count from the confirmation's source order.
        c = confirm_order.get(w.memory_id) if w.candidate else None
        return max(w.order, c) if c is not None else w.order

    def pending(w: WriteFact) -> bool:
        return w.candidate and w.memory_id not in confirm_order

    ranked = sorted(writes, key=eff)
    rows: list[dict[str, Any]] = []
    newer_firm: str | None = None  # nearest newer write that is not a pending candidate
    for w in reversed(ranked):
        forgotten = w.suppressed or is_covered(w, tombstones)
        mark = explicit.get(w.memory_id)
        if forgotten:
            status = "forgotten"
        elif pending(w):
            status = "candidate"
        elif mark is not None or newer_firm is not None:
            status = "superseded"
        else:
            status = "active"
        superseded_by = (mark.by_id if mark is not None else None) or newer_firm
        rows.append(_row(w, status, forgotten, superseded_by))
        if not pending(w):
            newer_firm = w.memory_id
    rows.reverse()
    for version, row in enumerate(rows, start=1):
        row["version"] = version
    return rows


def _row(w: WriteFact, status: str, erased: bool, superseded_by: str | None) -> dict[str, Any]:
    # An erased write's expiry goes with its content: erasure removes it from the
    # payload, so a rebuild after the erasure could not show it either.
    expires_at = None if erased else w.expires_at
    expires_us = to_us(parse_rfc3339(expires_at)) if expires_at else None
    return {
        "tenant": w.tenant, "memory_id": w.memory_id, "slot": w.slot, "ns_path": w.ns_path,
        "mkey": w.key, "layer": w.layer, "task_key": w.task_key,
        "session_id": None if erased else w.session_id, "position": w.position,
        "order_key": w.order, "version": 0, "status": status, "candidate": w.candidate,
        "value": None if erased else w.value, "text": None if erased else w.text,
        "scope": None if erased else w.scope, "supersedes": w.supersedes,
        "superseded_by": superseded_by if status == "superseded" else None,
        "expires_at": expires_at, "expires_us": expires_us, "actor": w.actor,
        "source": w.source,
    }


def fact_from_row(r: Any) -> WriteFact:
    """Rebuild the write fact of a stored view row, selected with its sealed columns
    read through `ledger.vault.keyed` (`VIEW_COLUMNS`): they are sealed again under
    the key they were sealed under, their event's."""
    value, kid = split_keyed(r.value)
    text, tkid = split_keyed(r.text)
    kid = kid or tkid or ""
    return WriteFact(
        tenant=r.tenant, memory_id=r.memory_id, slot=r.slot, ns_path=r.ns_path, key=r.mkey,
        layer=r.layer, task_key=r.task_key, session_id=r.session_id, position=r.position,
        order=bytes(r.order_key), candidate=bool(r.candidate), actor=r.actor,
        # Rewritten rows are sealed again under their subject's key (ledger.vault).
        source=bytes(r.source),
        value=subject(bytes(value), kid) if value is not None else None,
        text=subject_text(text, kid), scope=r.scope, supersedes=r.supersedes,
        expires_at=r.expires_at,
        suppressed=r.status == "forgotten",
    )


def view_columns(table: Any) -> list[Any]:
    """`table`'s columns (`mem_versions`), its sealed ones read with their key id
    (`fact_from_row`)."""
    return [keyed(c) if isinstance(c.type, SealedView | SealedText) else c
            for c in table.c]


def decode_value(raw: bytes | None) -> Any:
    """The JSON value of a view row."""
    return orjson.loads(raw) if raw is not None else None
