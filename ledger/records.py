"""What the ledger hands back: the outcome of an append and an event as stored.

Plain values, no database code: the recorders (`ledger.recorder`, `ledger.backends`)
build them from rows, the projections and the SDK read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from ledger.events import Event, Source, parse_rfc3339, to_us
from ledger.vault import split_keyed


def now_iso() -> str:
    """The current UTC time, RFC 3339 with microseconds."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True, slots=True)
class AppendResult:
    """The outcome of one event of an append request."""

    status: str  # appended | duplicate
    position: int
    suppressed: bool = False


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event as the ledger holds it: envelope always, content unless erased."""

    position: int
    tenant: str
    type: str
    idempotency_key: str
    actor: str
    source: Source
    order_key: bytes
    slot: str | None
    memory_id: str | None
    ns_path: str | None
    mkey: str | None
    layer: str | None
    task_key: str | None
    recorded_at: str
    suppressed: bool
    redacted: bool
    content_digest: str
    event: Event | None = field(default=None, compare=False)
    supersedes: str | None = None
    #: The id of the data key its payload is sealed under (ledger/vault.py), or None
    #: (stored in clear, or no content): view copies of its content use the same key.
    key_id: str | None = field(default=None, compare=False)

    @property
    def has_content(self) -> bool:
        """False for suppressed or erased events."""
        return self.event is not None


def event_from_wire(obj: dict[str, Any], source: Source | None = None) -> Event:
    """Rebuild an `Event` from its stored (already validated, normalised) wire form.

    `source`, when the caller has it already (the envelope columns), saves parsing the
    timestamp twice: the envelope and the payload hold the same source.
    """
    if source is None:
        s = obj["source"]
        source = Source(s["kind"], s["id"], s["at"], s.get("seq"), s.get("event_id"),
                        to_us(parse_rfc3339(s["at"])))
    return Event(obj["type"], obj["idempotency_key"], obj["tenant"], obj["actor"], source,
                 obj["data"], obj.get("expected_version"))


def stored_from_row(r: Sequence[Any]) -> StoredEvent:
    """Build a `StoredEvent` from a row selected with `ledger.recorder.STORED_COLUMNS`."""
    payload, kid = split_keyed(r[21])
    src = Source(r[5], r[6], r[7], r[8], r[9], to_us(parse_rfc3339(r[7])))
    ev = event_from_wire(orjson.loads(payload), src) if payload is not None else None
    return StoredEvent(r[0], r[1], r[2], r[3], r[4], src, bytes(r[10]), r[11], r[12], r[13],
                       r[14], r[15], r[16], r[17], bool(r[18]), bool(r[19]), r[20], ev, r[22],
                       kid)
