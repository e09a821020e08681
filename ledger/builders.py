"""Builders for every event type: keyword arguments in, a validated `Event` out.

Each builder assembles the wire object and runs it through `parse_event`, so an event
built here is validated exactly as one that arrives as JSON. `wire(...)` gives the bare
wire object (not validated) for callers that send JSON or test the validator itself.

The idempotency key defaults to a value derived from the source: the source stream, its
`seq` or `event_id`, the event type and the target. A retried call therefore builds the
same key and is reported as a duplicate, never as a second memory. A source without
`seq` or `event_id` falls back to its time and the event's content, which is stable only
if the caller passes the same `at` again: give `seq`, `event_id` or an explicit key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ledger.events import Event, encode_json
from ledger.secrets import find_secret_in_text
from ledger.validation import parse_event


def now_rfc3339() -> str:
    """The current time as RFC 3339 with a UTC offset, microsecond precision."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True, slots=True)
class Source:
    """Where an event comes from: its kind, the source stream, and its order there.

    Use the constructors named after the kinds: `Source.user_request("C17", seq=2)` for
    "remember this" said by the logged-in user, `Source.system("aftersales")` for a
    system of record, and so on. `at` defaults to now.
    """

    kind: str
    id: str
    at: str = field(default_factory=now_rfc3339)
    seq: int | None = None
    event_id: str | None = None

    @classmethod
    def user_request(cls, id: str, *, seq: int | None = None, at: str | None = None,
                     event_id: str | None = None) -> Source:
        """An explicit request by the user ("remember that", "forget that")."""
        return cls._of("explicit_user_request", id, seq, at, event_id)

    @classmethod
    def user_statement(cls, id: str, *, seq: int | None = None, at: str | None = None,
                       event_id: str | None = None) -> Source:
        """Something the user said in passing: long-term writes become candidates."""
        return cls._of("user_statement", id, seq, at, event_id)

    @classmethod
    def system(cls, id: str, *, seq: int | None = None, at: str | None = None,
               event_id: str | None = None) -> Source:
        """A system of record (orders, tickets): may state task status."""
        return cls._of("system_of_record", id, seq, at, event_id)

    @classmethod
    def operator(cls, id: str, *, seq: int | None = None, at: str | None = None,
                 event_id: str | None = None) -> Source:
        """An operator acting on the user's behalf."""
        return cls._of("operator", id, seq, at, event_id)

    @classmethod
    def model(cls, id: str, *, seq: int | None = None, at: str | None = None,
              event_id: str | None = None) -> Source:
        """A model's inference: long-term writes become candidates."""
        return cls._of("model_inference", id, seq, at, event_id)

    @classmethod
    def tool(cls, id: str, *, seq: int | None = None, at: str | None = None,
             event_id: str | None = None) -> Source:
        """A tool's output: may write session memories only."""
        return cls._of("tool_output", id, seq, at, event_id)

    @classmethod
    def document(cls, id: str, *, seq: int | None = None, at: str | None = None,
                 event_id: str | None = None) -> Source:
        """A retrieved document: may write session memories only."""
        return cls._of("retrieved_document", id, seq, at, event_id)

    @classmethod
    def _of(cls, kind: str, id: str, seq: int | None, at: str | None,
            event_id: str | None) -> Source:
        return cls(kind, id, at or now_rfc3339(), seq, event_id)

    def to_wire(self) -> dict[str, Any]:
        """The wire form, omitting absent optional fields."""
        out: dict[str, Any] = {"kind": self.kind, "id": self.id, "at": self.at}
        if self.seq is not None:
            out["seq"] = self.seq
        if self.event_id is not None:
            out["event_id"] = self.event_id
        return out


SourceLike = Source | Mapping[str, Any]


def _source_wire(source: SourceLike) -> dict[str, Any]:
    return source.to_wire() if isinstance(source, Source) else dict(source)


def derive_idempotency_key(etype: str, source: SourceLike, target: Any) -> str:
    """The default idempotency key: stable for the same source position and target.

    `target` is what the event is about (namespace and key, memory id, task key); it
    keeps two events of one source message (a write and a task note, say) apart.
    """
    src = _source_wire(source)
    if src.get("seq") is not None:
        where = f"seq={src['seq']}"
    elif src.get("event_id") is not None:
        where = f"event={src['event_id']}"
    else:
        where = f"at={src.get('at')}"
    h = hashlib.sha256(encode_json([etype, src.get("kind"), target])).hexdigest()[:16]
    head = str(src.get("id", ""))[:160]
    key = f"{head}:{where}:{etype}:{h}"[:256]
    if h.isdigit() and find_secret_in_text(key) is not None:
        # Sixteen hex digits that are all decimal can pass for a card number (about one
        # key in 40,000), which validation rejects (R23). Only such a key, which was
        # never accepted, gets another form: every key ever stored is derived as before.
        key = f"{head}:{where}:{etype}:h{h}"[:256]
    return key


def wire(etype: str, data: Mapping[str, Any], *, tenant: str, actor: str,
         source: SourceLike, idempotency_key: str | None = None,
         expected_version: int | None = None) -> dict[str, Any]:
    """The wire object of any event, `data` as given (not validated; `parse_event` is)."""
    body = dict(data)
    key = idempotency_key or derive_idempotency_key(etype, source, body)
    out: dict[str, Any] = {"type": etype, "idempotency_key": key, "tenant": tenant,
                           "actor": actor, "source": _source_wire(source), "data": body}
    if expected_version is not None:
        out["expected_version"] = expected_version
    return out


def _build(etype: str, data: Mapping[str, Any], target: Any, *, tenant: str, actor: str,
           source: SourceLike, idempotency_key: str | None,
           expected_version: int | None = None) -> Event:
    # Optional fields left at None are omitted, as a hand-written event would omit them;
    # a memory's value is required and may be JSON null.
    body = {k: v for k, v in data.items() if v is not None or k == "value"}
    key = idempotency_key or derive_idempotency_key(etype, source, target)
    return parse_event(wire(etype, body, tenant=tenant, actor=actor, source=source,
                            idempotency_key=key, expected_version=expected_version))


def _layer(layer: str | None, task: str | None, session: str | None) -> str | None:
    if layer is not None:
        return layer
    if session is not None:
        return "session"
    if task is not None:
        return "task"
    return None


def write(*, tenant: str, actor: str, namespace: Sequence[str], key: str, value: Any,
          source: SourceLike, layer: str | None = None, task: str | None = None,
          session: str | None = None, memory_id: str | None = None,
          scope: str | None = None, supersedes: str | None = None,
          expires_at: str | None = None, text: str | None = None,
          idempotency_key: str | None = None, expected_version: int | None = None,
          etype: str = "memory.written") -> Event:
    """A `memory.written` event; the layer follows from `task` / `session` if not given."""
    ns = list(namespace)
    data = {"namespace": ns, "key": key, "value": value,
            "layer": _layer(layer, task, session), "task_key": task, "session_id": session,
            "memory_id": memory_id, "scope": scope, "supersedes": supersedes,
            "expires_at": expires_at, "text": text}
    target = ["slot", ns, key, data["layer"], task, session]
    return _build(etype, data, target, tenant=tenant, actor=actor, source=source,
                  idempotency_key=idempotency_key, expected_version=expected_version)


def correct(*, tenant: str, actor: str, namespace: Sequence[str], key: str, value: Any,
            supersedes: str, source: SourceLike, layer: str | None = None,
            task: str | None = None, session: str | None = None,
            memory_id: str | None = None, scope: str | None = None,
            expires_at: str | None = None, text: str | None = None,
            idempotency_key: str | None = None,
            expected_version: int | None = None) -> Event:
    """A `memory.corrected` event: a new version that supersedes `supersedes`."""
    return write(tenant=tenant, actor=actor, namespace=namespace, key=key, value=value,
                 source=source, layer=layer, task=task, session=session,
                 memory_id=memory_id, scope=scope, supersedes=supersedes,
                 expires_at=expires_at, text=text, idempotency_key=idempotency_key,
                 expected_version=expected_version, etype="memory.corrected")


def supersede(*, tenant: str, actor: str, memory_id: str, source: SourceLike,
              superseded_by: str | None = None,
              idempotency_key: str | None = None) -> Event:
    """A `memory.superseded` event: the memory stops being active."""
    return _build("memory.superseded", {"memory_id": memory_id, "superseded_by": superseded_by},
                  ["memory", memory_id], tenant=tenant, actor=actor, source=source,
                  idempotency_key=idempotency_key)


def confirm(*, tenant: str, actor: str, memory_id: str, source: SourceLike,
            idempotency_key: str | None = None) -> Event:
    """A `memory.confirmed` event: a candidate becomes active (user request or operator)."""
    return _build("memory.confirmed", {"memory_id": memory_id}, ["memory", memory_id],
                  tenant=tenant, actor=actor, source=source, idempotency_key=idempotency_key)


def forget_memory(*, tenant: str, actor: str, memory_id: str, source: SourceLike,
                  reason: str | None = None, idempotency_key: str | None = None) -> Event:
    """Forget one memory by id, whatever its order."""
    return _build("memory.forgotten", {"memory_id": memory_id, "reason": reason},
                  ["memory", memory_id], tenant=tenant, actor=actor, source=source,
                  idempotency_key=idempotency_key)


def forget_key(*, tenant: str, actor: str, namespace: Sequence[str], key: str,
               source: SourceLike, reason: str | None = None,
               idempotency_key: str | None = None) -> Event:
    """Forget a key in every layer: every version up to this forget's source order."""
    ns = list(namespace)
    return _build("memory.forgotten", {"namespace": ns, "key": key, "reason": reason},
                  ["key", ns, key], tenant=tenant, actor=actor, source=source,
                  idempotency_key=idempotency_key)


def forget_prefix(*, tenant: str, actor: str, namespace_prefix: Sequence[str],
                  source: SourceLike, reason: str | None = None,
                  idempotency_key: str | None = None) -> Event:
    """Forget every slot and task whose namespace starts with the prefix."""
    ns = list(namespace_prefix)
    return _build("memory.forgotten", {"namespace_prefix": ns, "reason": reason},
                  ["prefix", ns], tenant=tenant, actor=actor, source=source,
                  idempotency_key=idempotency_key)


def open_task(*, tenant: str, actor: str, task_key: str, namespace: Sequence[str],
              source: SourceLike, refs: Mapping[str, str] | None = None,
              title: str | None = None, idempotency_key: str | None = None) -> Event:
    """A `task.opened` event: a task owned by `namespace`."""
    data = {"task_key": task_key, "namespace": list(namespace),
            "refs": dict(refs) if refs is not None else None, "title": title}
    return _build("task.opened", data, ["task", task_key], tenant=tenant, actor=actor,
                  source=source, idempotency_key=idempotency_key)


def note_task(*, tenant: str, actor: str, task_key: str, kind: str, text: str,
              source: SourceLike, fields: Mapping[str, Any] | None = None,
              idempotency_key: str | None = None) -> Event:
    """A `task.noted` event (`system_status` needs a system-of-record source)."""
    data = {"task_key": task_key, "kind": kind, "text": text,
            "fields": dict(fields) if fields is not None else None}
    return _build("task.noted", data, ["task", task_key, kind, text], tenant=tenant,
                  actor=actor, source=source, idempotency_key=idempotency_key)


def close_task(*, tenant: str, actor: str, task_key: str, source: SourceLike,
               resolution: str | None = None, retain_until: str | None = None,
               idempotency_key: str | None = None) -> Event:
    """A `task.closed` event, optionally with the time its content may be purged."""
    data = {"task_key": task_key, "resolution": resolution, "retain_until": retain_until}
    return _build("task.closed", data, ["task", task_key], tenant=tenant, actor=actor,
                  source=source, idempotency_key=idempotency_key)


def purge_task(*, tenant: str, actor: str, task_key: str, source: SourceLike,
               reason: str | None = None, idempotency_key: str | None = None) -> Event:
    """A `task.purged` event: the task's content is erased, like a forget."""
    return _build("task.purged", {"task_key": task_key, "reason": reason},
                  ["task", task_key], tenant=tenant, actor=actor, source=source,
                  idempotency_key=idempotency_key)
