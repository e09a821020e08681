"""Wire events of the running example (docs/requirements.md), built by the shared builder.

Tests need wire objects, valid and deliberately invalid, so these return the bare wire
dict of `ledger.builders.wire` (validated only where a test appends it).
"""

from __future__ import annotations

import itertools
from typing import Any

from ledger.builders import Source, wire

_seq = itertools.count(1)


def src(kind: str = "explicit_user_request", sid: str = "C17",
        at: str = "2026-09-20T10:00:00+08:00", seq: int | None = None) -> dict[str, Any]:
    """A source object."""
    return Source(kind, sid, at, seq).to_wire()


def write(key: str, value: Any, *, tenant: str = "shop-a", user: str = "u7",
          ns: list[str] | None = None, idem: str | None = None,
          source: dict[str, Any] | None = None, actor: str | None = None,
          etype: str = "memory.written", **data: Any) -> dict[str, Any]:
    """A `memory.written` (or corrected) event."""
    body = {"namespace": ns or [tenant, user, "preferences"], "key": key, "value": value,
            **data}
    return event(etype, body, tenant=tenant, actor=actor or user,
                 idem=idem or f"w-{next(_seq)}", source=source)


def event(etype: str, data: dict[str, Any], *, tenant: str = "shop-a", actor: str = "u7",
          idem: str | None = None, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """Any event."""
    return wire(etype, data, tenant=tenant, actor=actor, source=source or src(),
                idempotency_key=idem or f"e-{next(_seq)}")
