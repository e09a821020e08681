"""The two dramatiq actors: thin, each one call into the core.

- `memledger_ingest(events, deferrals=0)` on queue `ingest`: `ingest_events`.
- `memledger_wake(head)` on queue `project`: ask this process's projector for a pass.

Retry policy is explicit (dramatiq's defaults, 20 retries over days, are not what a
ledger wants): ingest retries transient failures only (`policy.should_retry`), with
backoff from 0.5 s to 60 s, never an invalid event (`throws`); both have time limits.
"""

from __future__ import annotations

from typing import Any

import dramatiq
import structlog
from dramatiq.middleware import Retries, TimeLimit

from ledger.errors import MemledgerError, ValidationError
from workers import policy
from workers.broker import INGEST_ACTOR, INGEST_QUEUE, PROJECT_QUEUE, WAKE_ACTOR
from workers.ingest import ingest_events
from workers.runtime import Runtime

log = structlog.get_logger("memledger.workers")

_runtime: Runtime | None = None


def install(runtime: Runtime | None) -> None:
    """Make `runtime` the one the actors of this process use."""
    global _runtime
    _runtime = runtime


def current() -> Runtime:
    """The runtime of this worker process."""
    if _runtime is None:
        raise RuntimeError("no worker runtime in this process: actors run inside "
                           "`memledger worker`")
    return _runtime


async def memledger_ingest(events: Any, deferrals: int = 0) -> None:
    """Append one published message's events (see `workers.ingest`)."""
    rt = current()
    out = await ingest_events(rt.store, events, deferrals=int(deferrals), defer=rt.defer,
                              append=rt.append)
    log.debug("ingested", appended=out.appended, duplicates=out.duplicates, dead=out.dead,
              deferred=out.deferred)


async def memledger_wake(head: Any = None) -> None:
    """Project everything committed up to `head` (a hint: any value is harmless)."""
    rt = current()
    if rt.projector is None:
        return
    try:
        await rt.projector.request(head if isinstance(head, int) else None)
    except MemledgerError as e:
        # The database is down or busy: the sweep tries again every few seconds.
        log.warning("wake_failed", error=str(e)[:300])


def middleware() -> list[Any]:
    """The broker middleware a worker process needs (and nothing else)."""
    return [
        TimeLimit(time_limit=policy.INGEST_TIME_LIMIT_MS, interval=1000),
        Retries(max_retries=policy.INGEST_MAX_RETRIES, min_backoff=policy.INGEST_MIN_BACKOFF_MS,
                max_backoff=policy.INGEST_MAX_BACKOFF_MS),
    ]


def declare(broker: Any) -> dict[str, Any]:
    """Declare both actors (and so both queues) on `broker`."""
    ingest = dramatiq.actor(
        broker=broker, actor_name=INGEST_ACTOR, queue_name=INGEST_QUEUE,
        max_retries=policy.INGEST_MAX_RETRIES, min_backoff=policy.INGEST_MIN_BACKOFF_MS,
        max_backoff=policy.INGEST_MAX_BACKOFF_MS, retry_when=policy.should_retry,
        throws=(ValidationError,), time_limit=policy.INGEST_TIME_LIMIT_MS)(memledger_ingest)
    wake = dramatiq.actor(
        broker=broker, actor_name=WAKE_ACTOR, queue_name=PROJECT_QUEUE,
        max_retries=policy.WAKE_MAX_RETRIES, min_backoff=policy.WAKE_MIN_BACKOFF_MS,
        max_backoff=policy.WAKE_MAX_BACKOFF_MS, time_limit=policy.WAKE_TIME_LIMIT_MS,
    )(memledger_wake)
    return {INGEST_ACTOR: ingest, WAKE_ACTOR: wake}
