"""Events as values: the envelope, the source order, and the canonical wire form.

An `Event` is created once by `ledger.validation.parse_event` (which enforces every
rule of the contract) and never changed afterwards; `dataclasses.replace` makes a
new one. Its wire form is a pure encode/decode pair over orjson.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import orjson

SOURCE_KINDS: Final = (
    "explicit_user_request",
    "user_statement",
    "system_of_record",
    "operator",
    "model_inference",
    "tool_output",
    "retrieved_document",
)
#: Kinds written on a user's own behalf: the actor must own the namespace.
USER_KINDS: Final = frozenset({"explicit_user_request", "user_statement", "model_inference"})
#: Kinds whose long-term writes are candidates until confirmed (R10, R13).
CANDIDATE_KINDS: Final = frozenset({"user_statement", "model_inference"})
#: Kinds that never authorise a task or long-term write (R9).
UNTRUSTED_KINDS: Final = frozenset({"tool_output", "retrieved_document"})

MEMORY_WRITES: Final = frozenset({"memory.written", "memory.corrected"})
TASK_TYPES: Final = frozenset({"task.opened", "task.noted", "task.closed", "task.purged"})
EVENT_TYPES: Final = (
    "memory.written",
    "memory.corrected",
    "memory.superseded",
    "memory.confirmed",
    "memory.forgotten",
    "task.opened",
    "task.noted",
    "task.closed",
    "task.purged",
)
LAYERS: Final = ("long", "task", "session")
NOTE_KINDS: Final = ("user_report", "correction", "system_status", "todo", "todo_done")

#: Separator used in stored namespace paths; validation forbids control characters in
#: namespace parts, so prefix matching on the joined path equals prefix matching on parts.
NS_SEP: Final = "\x1f"

_RFC3339 = re.compile(
    r"^(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$"
)


#: The range of UTC times every timestamp field may take (what Python's datetime, the
#: views' microsecond columns and both databases all hold).
MIN_TIMESTAMP: Final = "0001-01-01T00:00:00Z"
MAX_TIMESTAMP: Final = "9999-12-31T23:59:59.999999Z"


def parse_rfc3339(text: str) -> datetime:
    """Parse an RFC 3339 timestamp that carries an offset; raise ValueError otherwise.

    A timestamp whose UTC value falls outside `MIN_TIMESTAMP`..`MAX_TIMESTAMP` (e.g.
    `9999-12-31T23:59:59-23:59`) is a ValueError too.
    """
    m = _RFC3339.match(text)
    if m is None:
        raise ValueError("not an RFC 3339 timestamp with offset")
    date, time, frac, off = m.groups()
    frac = (frac or "")[:7]  # datetime keeps microseconds: drop the rest
    off = "+00:00" if off in ("Z", "z") else off
    moment = datetime.fromisoformat(f"{date}T{time}{frac}{off}")
    # The views convert to UTC (microseconds since the epoch); a local time near either
    # end of year 1..9999 can fall outside what datetime (and so every view) holds.
    try:
        moment.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"is outside {MIN_TIMESTAMP}..{MAX_TIMESTAMP} once converted "
                         "to UTC") from None
    return moment


_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(moment: datetime) -> int:
    """Microseconds since the epoch, UTC, for an aware datetime."""
    if moment.tzinfo is None:  # a naive time is local time, as `astimezone` reads it
        moment = moment.astimezone(UTC)
    # aware minus aware is computed in UTC (no conversion of its own to overflow)
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def ns_path(parts: tuple[str, ...] | list[str]) -> str:
    """The stored form of a namespace: parts joined and terminated by `NS_SEP`."""
    return NS_SEP.join(parts) + NS_SEP if parts else ""


def ns_parts(path: str) -> tuple[str, ...]:
    """Inverse of `ns_path`."""
    return tuple(path.split(NS_SEP)[:-1])


def encode_json(obj: Any) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, UTF-8.

    Returned as a copy of exactly its length: orjson (3.13) hands back its output in
    the buffer it wrote it to, at least 4 KiB, whatever the JSON's length. Held by the
    thousand (a bulk-load step keeps each write's value and source, a history row
    both), that was 4 KiB per short value: 100,000 of them held 392 MB of RSS, the
    copies 6 MB. The copy costs about 0.15 us.
    """
    return bytes(memoryview(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)))


def digest(data: bytes) -> str:
    """Hex SHA-256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def derive_memory_id(tenant: str, idempotency_key: str) -> str:
    """The default memory_id of a write: stable for a tenant and idempotency key."""
    h = hashlib.sha256(f"{tenant}\x00{idempotency_key}".encode()).hexdigest()
    return "m_" + h[:24]


@dataclass(frozen=True, slots=True)
class Source:
    """Where an event comes from and when it happened there."""

    kind: str
    id: str
    at: str
    seq: int | None = None
    event_id: str | None = None
    at_us: int = field(default=0, compare=False, repr=False)

    def to_wire(self) -> dict[str, Any]:
        """The wire form, omitting absent optional fields."""
        return source_wire(self.kind, self.id, self.at, self.seq, self.event_id)


def source_wire(kind: str, sid: str, at: str, seq: int | None, event_id: str | None
                ) -> dict[str, Any]:
    """A source's wire form from its fields (the `events` envelope columns hold them)."""
    out: dict[str, Any] = {"kind": kind, "id": sid, "at": at}
    if seq is not None:
        out["seq"] = seq
    if event_id is not None:
        out["event_id"] = event_id
    return out


@dataclass(frozen=True, slots=True)
class Event:
    """One validated event: envelope plus normalised `data` (defaults filled in)."""

    type: str
    idempotency_key: str
    tenant: str
    actor: str
    source: Source
    data: Mapping[str, Any]
    expected_version: int | None = None
    # Derived values (encoding, digest, order, slot) computed once: an event is a value,
    # so they never change; `dataclasses.replace` starts a fresh cache.
    _memo: dict[str, Any] = field(default_factory=dict, init=False, compare=False,
                                  repr=False, hash=False)

    # -- wire form ---------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """The normalised wire object (what `encode` serialises)."""
        out: dict[str, Any] = {
            "type": self.type,
            "idempotency_key": self.idempotency_key,
            "tenant": self.tenant,
            "actor": self.actor,
            "source": self.source.to_wire(),
            "data": dict(self.data),
        }
        if self.expected_version is not None:
            out["expected_version"] = self.expected_version
        return out

    def encode(self) -> bytes:
        """Canonical JSON of the whole event."""
        enc: bytes | None = self._memo.get("enc")
        if enc is None:
            # `to_wire` without its copies (orjson only reads): the same object, so the
            # same bytes.
            s = self.source
            src: dict[str, Any] = {"kind": s.kind, "id": s.id, "at": s.at}
            if s.seq is not None:
                src["seq"] = s.seq
            if s.event_id is not None:
                src["event_id"] = s.event_id
            data = self.data
            out: dict[str, Any] = {
                "type": self.type, "idempotency_key": self.idempotency_key,
                "tenant": self.tenant, "actor": self.actor, "source": src,
                "data": data if type(data) is dict else dict(data)}
            if self.expected_version is not None:
                out["expected_version"] = self.expected_version
            enc = self._memo["enc"] = encode_json(out)
        return enc

    @property
    def content_digest(self) -> str:
        """Digest of the canonical event: equal content means equal digest."""
        dig: str | None = self._memo.get("dig")
        if dig is None:
            dig = self._memo["dig"] = digest(self.encode())
        return dig

    # -- ordering ----------------------------------------------------------------------
    @property
    def order(self) -> bytes:
        """The source order as bytes whose byte order equals the contract's tuple order."""
        key: bytes | None = self._memo.get("order")
        if key is None:
            key = self._memo["order"] = order_key(
                self.source.at_us, self.source.seq or 0, self.source.id,
                self.idempotency_key)
        return key

    @property
    def has_derived_id(self) -> bool:
        """A write whose memory id is the derived one (`derive_memory_id`)."""
        mid = self.data.get("memory_id") if self.type in MEMORY_WRITES else None
        if mid is None:
            return False
        known = self._memo.get("derived")
        if known is None:
            known = self._memo["derived"] = derive_memory_id(self.tenant,
                                                             self.idempotency_key)
        return bool(mid == known)

    # -- typed accessors ---------------------------------------------------------------
    @property
    def is_write(self) -> bool:
        """True for `memory.written` and `memory.corrected`."""
        return self.type in MEMORY_WRITES

    @property
    def namespace(self) -> tuple[str, ...] | None:
        """The namespace the event names, if any."""
        ns = self.data.get("namespace")
        return tuple(ns) if ns is not None else None

    @property
    def memory_id(self) -> str | None:
        """The memory the event writes or targets, if any."""
        mid = self.data.get("memory_id")
        return str(mid) if mid is not None else None

    @property
    def task_key(self) -> str | None:
        """The task the event belongs to: task events, and task-layer writes."""
        tk = self.data.get("task_key")
        return str(tk) if tk is not None else None

    @property
    def is_candidate(self) -> bool:
        """A long-term write from a kind that needs confirmation first (R10, R13)."""
        return (
            self.is_write
            and self.data.get("layer") == "long"
            and self.source.kind in CANDIDATE_KINDS
        )

    @property
    def slot(self) -> str | None:
        """The slot id of a write: tenant, namespace, key, layer and task or session."""
        if not self.is_write:
            return None
        if "slot" not in self._memo:
            d = self.data
            scope = d.get("task_key") or d.get("session_id") or ""
            self._memo["slot"] = slot_id(self.tenant, ns_path(d["namespace"]), d["key"],
                                         d["layer"], scope)
        return str(self._memo["slot"])


def slot_id(tenant: str, namespace_path: str, key: str, layer: str, scope: str) -> str:
    """A stable, fixed-length id for a slot."""
    raw = "\x00".join((tenant, namespace_path, key, layer, scope))
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


_U64 = struct.Struct(">QQ")


def order_key(at_us: int, seq: int, source_id: str, idempotency_key: str) -> bytes:
    """Encode `(source.at, source.seq, source.id, idempotency_key)` as comparable bytes.

    Stored as a BLOB/bytea so SQLite and PostgreSQL compare it with memcmp, whatever
    the database collation: the byte order is exactly the contract's tuple order.
    Identifiers never contain NUL (validation forbids control characters).
    """
    return (
        _U64.pack(at_us + (1 << 63), seq)
        + source_id.encode()
        + b"\x00"
        + idempotency_key.encode()
    )


MAX_ORDER: Final = b"\xff" * 17
