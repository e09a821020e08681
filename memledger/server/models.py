"""Request and response bodies of the HTTP API (they make the OpenAPI document).

Requests are strict (`extra="forbid"`): an unknown field is a 422 naming it. Responses
allow what the SDK's `to_dict()` adds, so they are exactly the CLI's JSON shapes
(docs/events.md, docs/recall.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

Name = Field(min_length=1, max_length=256)
SourceKind = Literal["explicit_user_request", "user_statement", "system_of_record",
                     "operator", "model_inference", "tool_output", "retrieved_document"]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class SourceIn(_In):
    """Where the event comes from (docs/events.md): `at` defaults to now."""

    kind: SourceKind
    id: str = Field(min_length=1, max_length=256)
    seq: int | None = Field(default=None, ge=0, le=2**62)
    event_id: str | None = Field(default=None, min_length=1, max_length=256)
    at: str | None = Field(default=None, min_length=1, max_length=64)


class Owner(_In):
    """Optional: a body may name its principal; it must be the key's own (else 403)."""

    tenant: str | None = Field(default=None, max_length=128)
    user: str | None = Field(default=None, max_length=256)


class RememberIn(Owner):
    """A memory to write for the key's principal; `namespace` is below the user."""

    namespace: list[str] = Field(max_length=6)
    key: str = Field(min_length=1, max_length=256)
    value: JsonValue
    source: SourceIn
    task: str | None = Field(default=None, min_length=1, max_length=256)
    session: str | None = Field(default=None, min_length=1, max_length=256)
    memory_id: str | None = Field(default=None, min_length=1, max_length=256)
    scope: str | None = Field(default=None, min_length=1, max_length=256)
    supersedes: str | None = Field(default=None, min_length=1, max_length=256)
    expires_at: str | None = Field(default=None, min_length=1, max_length=64)
    text: str | None = Field(default=None, max_length=16384)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)
    expected_version: int | None = Field(default=None, ge=0, le=2**31)


class ForgetIn(Owner):
    """Exactly one target: `memory_id`, `namespace` + `key`, or `namespace_prefix`
    (below the user; `[]` is everything about the user)."""

    memory_id: str | None = Field(default=None, min_length=1, max_length=256)
    namespace: list[str] | None = Field(default=None, max_length=6)
    key: str | None = Field(default=None, min_length=1, max_length=256)
    namespace_prefix: list[str] | None = Field(default=None, max_length=6)
    reason: str | None = Field(default=None, max_length=1024)
    source: SourceIn | None = None
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)


class RecallIn(Owner):
    """What to recall before a model turn."""

    query: str | None = Field(default=None, max_length=4096)
    session: str | None = Field(default=None, min_length=1, max_length=256)
    task: str | None = Field(default=None, min_length=1, max_length=256)
    budget: int | None = Field(default=None, ge=0, le=10_000_000)
    limit: int = Field(default=20, ge=1, le=500)
    #: Recall as the ledger held it then: an RFC 3339 time or `position:N`.
    as_of: str | None = Field(default=None, min_length=1, max_length=64)


class VerifyIn(_In):
    """What `POST /v1/verify` checks (`memledger replay verify` and its flags)."""

    forgotten: bool = False
    catch_up: bool = True
    views: bool = True
    limit: int = Field(default=50, ge=0, le=10_000)


class WriteOut(_Out):
    """The outcome of a typed write: `appended` or `duplicate` (or `published`)."""

    status: str
    position: int | None = None
    suppressed: bool = False
    memory_id: str | None = None


class ForgetOut(WriteOut):
    """A forget's outcome and what it covered: the ids of the principal's memory
    versions the forget covers (once projected; `[]` without waiting)."""

    target: dict[str, Any]
    covered: list[str]


class EventResult(_Out):
    """One event of `POST /v1/events`, as `memledger append` reports a line (`line`
    counts from 1 in the request's order), or as `memledger publish` does."""

    line: int
    status: str
    position: int | None = None
    error: str | None = None
    suppressed: bool | None = None


class EventsOut(_Out):
    """Every event's result, in the request's order, and how many were rejected."""

    results: list[EventResult]
    rejected: int


class MemoryOut(_Out):
    """A memory as `memledger get` prints it (with `found: true`)."""

    found: bool
    memory_id: str
    namespace: list[str]
    key: str
    value: JsonValue
    layer: str
    version: int
    status: str
    source: dict[str, Any]


class VersionOut(_Out):
    """One version of a key's history; forgotten ones are redacted."""

    memory_id: str
    key: str
    layer: str
    version: int
    status: str
    value: JsonValue


class HistoryOut(_Out):
    """Every version of the memory's key, oldest first."""

    versions: list[VersionOut]


class RecallOut(_Out):
    """What `memledger recall` prints."""

    items: list[dict[str, Any]]
    tasks: list[dict[str, Any]]
    audit_id: str


class TasksOut(_Out):
    """What `memledger tasks` prints."""

    tasks: list[dict[str, Any]]


class Health(_Out):
    """Liveness."""

    ok: bool


class Ready(_Out):
    """Readiness: the database answers and the projections' lag is within bounds."""

    ready: bool
    head: int | None = None
    lag: dict[str, int] = Field(default_factory=dict)
    detail: str | None = None
