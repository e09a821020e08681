"""Pure policy of the workers: which failures retry, how long to wait, what a dead letter keeps.

No I/O here: the actors call these functions, and the tests exercise them directly.
"""

from __future__ import annotations

import enum
from typing import Any, Final

from ledger.errors import (
    MemledgerError,
    RegisterError,
    StoreUnavailable,
    ValidationError,
)

#: Transient failures (database busy or unreachable) of one ingest message are retried
#: this many times, with exponential backoff from `INGEST_MIN_BACKOFF_MS` up to
#: `INGEST_MAX_BACKOFF_MS` (about 25 minutes in all), before dramatiq gives up on it.
INGEST_MAX_RETRIES: Final = 30
INGEST_MIN_BACKOFF_MS: Final = 500
INGEST_MAX_BACKOFF_MS: Final = 60_000
#: An ingest message's actor is interrupted after this long (then retried).
INGEST_TIME_LIMIT_MS: Final = 60_000

#: A wake-up that failed is retried a little; the periodic sweep covers the rest.
WAKE_MAX_RETRIES: Final = 2
WAKE_MIN_BACKOFF_MS: Final = 500
WAKE_MAX_BACKOFF_MS: Final = 5_000
WAKE_TIME_LIMIT_MS: Final = 120_000

#: An event whose referent (the task it notes, the memory it confirms) has not been
#: ingested yet is tried again this many times, `DEFER_BASE_MS` doubling each time
#: (0.25 s, 0.5 s, ... 8 s: about 16 s in all), then dead-lettered. Published events
#: carry no order, so a note can overtake the task.opened it belongs to.
MAX_DEFERRALS: Final = 6
DEFER_BASE_MS: Final = 250

#: Longest error text kept in a dead letter.
MAX_ERROR_CHARS: Final = 2000
#: Envelope fields a dead letter keeps when the content was rejected as a secret.
ENVELOPE_FIELDS: Final = ("type", "idempotency_key", "tenant", "actor", "source",
                          "expected_version")


class Disposition(enum.Enum):
    """What to do with an event the ledger did not take."""

    RETRY = "retry"   # transient: raise, so dramatiq retries the message with backoff
    DEFER = "defer"   # its referent may still arrive: send it again a little later
    DEAD = "dead"     # invalid for good: record a dead letter, never retry


def classify(error: BaseException) -> Disposition:
    """The disposition of an append failure."""
    if isinstance(error, StoreUnavailable | RegisterError):
        return Disposition.RETRY
    if isinstance(error, ValidationError):
        if is_missing_referent(error):
            return Disposition.DEFER
        return Disposition.DEAD
    if isinstance(error, MemledgerError):
        return Disposition.DEAD  # e.g. ConcurrencyConflict: a logical conflict, final
    return Disposition.RETRY  # an unexpected failure: never drop, let retries decide


def is_missing_referent(error: ValidationError) -> bool:
    """Did the store reject the event because what it refers to is not in the ledger yet?"""
    return (error.field == "data.task_key" and error.message.startswith("no open task ")) or (
        error.field == "data.memory_id" and error.message.startswith("no memory "))


def should_retry(retries: int, error: BaseException) -> bool:
    """dramatiq's `retry_when` for ingest: transient failures only, at most N times."""
    return classify(error) is Disposition.RETRY and retries < INGEST_MAX_RETRIES


def defer_delay_ms(deferrals: int) -> int:
    """How long to wait before trying an event with a missing referent again."""
    return int(DEFER_BASE_MS * 2 ** min(deferrals, 16))


def is_secret_rejection(error: BaseException) -> bool:
    """Was the event rejected because its content looks like a secret (R23)?"""
    return isinstance(error, ValidationError) and "(R23)" in error.message


def error_text(error: BaseException) -> str:
    """The error as a dead letter keeps it (our messages never echo a secret)."""
    text = str(error) or type(error).__name__
    return text[:MAX_ERROR_CHARS]


def envelope_only(raw: Any) -> dict[str, Any] | None:
    """The envelope of a raw event, without `data`: what a secret's dead letter keeps."""
    if not isinstance(raw, dict):
        return None
    return {k: raw[k] for k in ENVELOPE_FIELDS if k in raw}


def dead_letter_fields(raw: Any, error: BaseException) -> dict[str, Any]:
    """tenant, idempotency_key, error and the payload to keep for a rejected event.

    The payload is the event as received, except for a secret rejection (R23): then
    only its envelope, so the secret is never stored anywhere.
    """
    tenant = raw.get("tenant") if isinstance(raw, dict) else None
    key = raw.get("idempotency_key") if isinstance(raw, dict) else None
    kept = envelope_only(raw) if is_secret_rejection(error) else raw
    return {
        "tenant": tenant[:128] if isinstance(tenant, str) else None,
        "idempotency_key": key[:256] if isinstance(key, str) else None,
        "error": error_text(error),
        "payload": kept,
        "withheld": is_secret_rejection(error),
    }
