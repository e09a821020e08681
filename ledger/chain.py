"""The hash chain over the ledger's envelopes.

Each stored event carries `chain`, the hash of the previous event's link and its own
envelope (everything but the payload, which erasure may remove, and the `redacted`
flag, which erasure sets). The appender (`ledger.appender.seal`) is the one place that
computes links for new rows; `ChainCheck` walks stored rows and tells which links hold
(`replay verify`, the restore's file check).
"""

from __future__ import annotations

from typing import Any, Final

from ledger.events import digest, encode_json

GENESIS: Final = "0" * 64


def envelope_of(row: dict[str, Any]) -> dict[str, Any]:
    """The fields of a stored event that the hash chain covers (everything but the
    payload, which may be erased, and the `redacted` flag, which erasure sets)."""
    return {
        "position": row["position"],
        "tenant": row["tenant"],
        "idempotency_key": row["idempotency_key"],
        "type": row["type"],
        "actor": row["actor"],
        "source": [row["source_kind"], row["source_id"], row["source_at"],
                   row["source_seq"], row["source_event_id"]],
        "order_key": bytes(row["order_key"]).hex(),
        "index": [row["slot"], row["memory_id"], row["ns_path"], row["mkey"], row["layer"],
                  row["task_key"], row["supersedes"]],
        "content_digest": row["content_digest"],
        "suppressed": bool(row["suppressed"]),
        "recorded_at": row["recorded_at"],
    }


def chain_link(prev: str, row: dict[str, Any]) -> str:
    """The chain value of a row: hash of the previous link and the row's envelope."""
    return digest(prev.encode() + b"|" + encode_json(envelope_of(row)))


class ChainCheck:
    """Walks stored event rows in position order: `holds(row)` says whether the row's
    stored link equals the one recomputed from the previous row's link."""

    def __init__(self) -> None:
        self.prev = GENESIS

    def holds(self, row: dict[str, Any]) -> bool:
        """Check one row's link, then move on to it (whether it held or not).

        Raises KeyError, TypeError or ValueError on an envelope missing or damaging
        a field."""
        ok = bool(chain_link(self.prev, row) == row["chain"])
        self.prev = row["chain"]
        return ok
