"""Builders for wire events of the running example (REQUIREMENTS.md)."""

from __future__ import annotations

import itertools
from typing import Any

_seq = itertools.count(1)


def src(kind: str = "explicit_user_request", sid: str = "C17",
        at: str = "2026-09-20T10:00:00+08:00", seq: int | None = None) -> dict[str, Any]:
    """A source object."""
    out: dict[str, Any] = {"kind": kind, "id": sid, "at": at}
    if seq is not None:
        out["seq"] = seq
    return out


def write(key: str, value: Any, *, tenant: str = "shop-a", user: str = "u7",
          ns: list[str] | None = None, idem: str | None = None,
          source: dict[str, Any] | None = None, actor: str | None = None,
          etype: str = "memory.written", **data: Any) -> dict[str, Any]:
    """A `memory.written` (or corrected) event."""
    return {
        "type": etype,
        "idempotency_key": idem or f"w-{next(_seq)}",
        "tenant": tenant,
        "actor": actor or user,
        "source": source or src(),
        "data": {"namespace": ns or [tenant, user, "preferences"], "key": key,
                 "value": value, **data},
    }


def event(etype: str, data: dict[str, Any], *, tenant: str = "shop-a", actor: str = "u7",
          idem: str | None = None, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """Any event."""
    return {"type": etype, "idempotency_key": idem or f"e-{next(_seq)}", "tenant": tenant,
            "actor": actor, "source": source or src(), "data": data}
