"""Publishing: send events to the ingest queue for the worker daemons to append.

The path agent apps use when they do not wait for the write. Events are validated
here first with the same rules as `append` (an invalid one is reported at once and
never sent), then sent in messages of up to `batch_size` events. When the broker
cannot take a message, every event in it (and every later one of the same call) is
reported `not_sent`: publishing never loses an event silently. `published` means the
broker holds it; the daemons then append it, at least once and idempotently.

    from workers.publish import publish
    for r in publish(events, redis_url="redis://127.0.0.1:6379/0"):
        if r.status != "published": ...   # tell the user it was not saved

Back-pressure is the publisher's to apply: `Publisher.backlog()` says how many messages
wait in the ingest queue, so an app can slow down (or tell its users that saving is
delayed) while the daemons are behind. Publishing itself never blocks on a backlog.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import redis
import structlog
from dramatiq import Message

from ledger.errors import BrokerUnavailable, ValidationError
from ledger.events import Event
from ledger.validation import decode_json, parse_event
from workers.broker import (
    INGEST_ACTOR,
    INGEST_QUEUE,
    LedgerBroker,
    queue_depths,
    redis_url,
    safe_url,
)

log = structlog.get_logger("memledger.workers")

#: Events per broker message: one message per event costs a broker round trip each.
DEFAULT_BATCH: Final = 100


@dataclass(frozen=True, slots=True)
class PublishResult:
    """The outcome of one event: `published`, `rejected` (invalid) or `not_sent`."""

    line: int
    status: str
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The per-line output of `memledger publish`."""
        out: dict[str, Any] = {"line": self.line, "status": self.status}
        if self.error is not None:
            out["error"] = self.error
        return out


def ingest_message(events: list[Any], *, deferrals: int = 0) -> Message[Any]:
    """The broker message that asks the ingest actor to append `events` (wire dicts)."""
    kwargs = {"deferrals": deferrals} if deferrals else {}
    return Message(queue_name=INGEST_QUEUE, actor_name=INGEST_ACTOR, args=(events,),
                   kwargs=kwargs, options={})


def _wire(item: Event | dict[str, Any] | bytes | str) -> Any:
    """Validate one item; return what to send (the object as given, or the Event's wire)."""
    if isinstance(item, Event):
        return item.to_wire()
    obj = decode_json(item) if isinstance(item, bytes | str) else item
    parse_event(obj)
    return obj


class Publisher:
    """A connection to the broker for publishing; reuse it across calls."""

    def __init__(self, url: str | None = None, *, batch_size: int = DEFAULT_BATCH) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.url = redis_url(url)
        self.batch_size = batch_size
        self.broker = LedgerBroker(self.url)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Release the broker connections."""
        self.broker.client.close()

    def send(self, events: list[Any], *, deferrals: int = 0, delay_ms: int | None = None
             ) -> None:
        """Send already validated wire events as one message; raise `BrokerUnavailable`."""
        try:
            self.broker.enqueue(ingest_message(events, deferrals=deferrals), delay=delay_ms)
        except (redis.RedisError, OSError) as e:
            raise BrokerUnavailable(
                f"broker {safe_url(self.url)} unavailable ({str(e)[:200]}); the event was "
                "not sent: publish it again later, or append it directly") from e

    def backlog(self) -> int:
        """Messages waiting in the ingest queue, not yet taken by a worker (sent ones
        and ones sent again after a delay that is over): one Redis round trip. Raises
        `BrokerUnavailable`."""
        try:
            return queue_depths(self.broker.client, (INGEST_QUEUE,))[INGEST_QUEUE]["ready"]
        except (redis.RedisError, OSError) as e:
            raise BrokerUnavailable(
                f"broker {safe_url(self.url)} unavailable ({str(e)[:200]})") from e

    def publish(self, events: Iterable[Event | dict[str, Any] | bytes | str], *,
                start: int = 1) -> list[PublishResult]:
        """Validate and send events; one result per event, numbered from `start`."""
        return list(self.publish_numbered(zip(itertools.count(start), events, strict=False)))

    def publish_numbered(self, items: Iterable[tuple[int, Any]]) -> Iterator[PublishResult]:
        """Validate and send (number, event) pairs; yield results in input order."""
        broken: BrokerUnavailable | None = None
        block: list[tuple[int, Any]] = []
        for item in items:
            block.append(item)
            if len(block) >= self.batch_size:
                results, broken = self._block(block, broken)
                yield from results
                block = []
        if block:
            results, broken = self._block(block, broken)
            yield from results

    def _block(self, block: list[tuple[int, Any]], broken: BrokerUnavailable | None
               ) -> tuple[list[PublishResult], BrokerUnavailable | None]:
        results: dict[int, PublishResult] = {}
        valid: list[tuple[int, Any]] = []
        for i, (n, item) in enumerate(block):
            try:
                valid.append((i, _wire(item)))
            except ValidationError as e:
                results[i] = PublishResult(n, "rejected", str(e))
        if valid:
            # After one failure in a call, later messages are not tried: each would
            # wait for its own connection timeout, and all would fail alike.
            if broken is None:
                try:
                    self.send([w for _, w in valid])
                except BrokerUnavailable as e:
                    broken = e
                    log.warning("publish_failed", events=len(valid), broker=safe_url(self.url))
            for i, _ in valid:
                n = block[i][0]
                results[i] = (PublishResult(n, "published") if broken is None
                              else PublishResult(n, "not_sent", str(broken)))
        return [results[i] for i in range(len(block))], broken

    async def apublish(self, events: Iterable[Event | dict[str, Any] | bytes | str], *,
                       start: int = 1) -> list[PublishResult]:
        """`publish` for asyncio apps: the blocking broker calls run in a thread."""
        items = list(events)
        return await asyncio.to_thread(self.publish, items, start=start)


def publish(events: Iterable[Event | dict[str, Any] | bytes | str], *,
            redis_url: str | None = None, batch_size: int = DEFAULT_BATCH
            ) -> list[PublishResult]:
    """Validate and send events for asynchronous ingest; one result per event.

    `published`: the broker holds it. `rejected`: invalid (`error` says why, as
    `append` would). `not_sent`: the broker was unreachable; nothing was sent, the app
    must report it as not saved or retry.
    """
    with Publisher(redis_url, batch_size=batch_size) as p:
        return p.publish(events)
