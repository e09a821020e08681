"""The one error shape of the HTTP API: a JSON problem object.

`{"status": 422, "title": "invalid request", "detail": "...", "field": "body.key",
"rule": "missing"}`. `field` and `rule` say what was wrong and which rule it broke; no
problem echoes a value of the request (a rejected secret stays unsaid) and none carries
a traceback. Errors of the core are translated here, once.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ledger.errors import (
    AccessDenied,
    BrokerUnavailable,
    ConcurrencyConflict,
    IdempotencyConflict,
    MemledgerError,
    StoreUnavailable,
    ValidationError,
)


class ProblemModel(BaseModel):
    """The problem object every error response carries."""

    status: int
    title: str
    detail: str
    field: str | None = None
    rule: str | None = None


class Problem(Exception):
    """An error response: raise it from a route or a dependency."""

    def __init__(self, status: int, title: str, detail: str, *, field: str | None = None,
                 rule: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.field = field
        self.rule = rule
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON problem object."""
        return {"status": self.status, "title": self.title, "detail": self.detail,
                "field": self.field, "rule": self.rule}


def unauthorized(detail: str = "a valid API key is required: "
                               "Authorization: Bearer <key>") -> Problem:
    """401: no key, an unknown key or a revoked one (all alike)."""
    return Problem(401, "unauthorized", detail, field="authorization", rule="api_key",
                   headers={"WWW-Authenticate": "Bearer"})


def forbidden(detail: str, *, field: str | None = None, rule: str = "identity") -> Problem:
    """403: the key is valid but may not do this."""
    return Problem(403, "forbidden", detail, field=field, rule=rule)


def not_found(what: str = "memory") -> Problem:
    """404: no such thing for this principal (whether it exists elsewhere is unsaid)."""
    return Problem(404, "not found", f"no such {what}", rule="not_found")


def from_error(e: MemledgerError) -> Problem:
    """The problem of an error of the core."""
    if isinstance(e, IdempotencyConflict):
        return Problem(409, "conflict", e.message, field=e.field, rule="idempotency")
    if isinstance(e, ValidationError):
        return Problem(422, "invalid request", e.message, field=e.field or None,
                       rule="validation")
    if isinstance(e, ConcurrencyConflict):
        return Problem(409, "conflict", str(e), field="expected_version",
                       rule="expected_version")
    if isinstance(e, AccessDenied):
        return Problem(403, "forbidden", str(e), rule="access")
    if isinstance(e, StoreUnavailable | BrokerUnavailable):
        return Problem(503, "unavailable", str(e), rule="unavailable",
                       headers={"Retry-After": "1"})
    return Problem(500, "internal error", "the request failed; the server log has the "
                                          "error", rule="internal")


def reason(e: MemledgerError) -> str:
    """A metric label for a rejected request: the error's class, never its content."""
    name = type(e).__name__
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


#: Documented on every route, so the OpenAPI document says what errors look like.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ProblemModel, "description": text} for code, text in (
        (400, "malformed request"),
        (401, "no API key, or an unknown or revoked one"),
        (403, "the key may not do this"),
        (404, "no such thing for this principal"),
        (409, "idempotency or version conflict"),
        (413, "request body or batch too large"),
        (422, "a field broke a rule"),
        (429, "rate limit: retry after Retry-After seconds"),
        (503, "the database or the broker is unavailable"),
    )
}
