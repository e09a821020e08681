"""Asynchronous ingest: append published events with `append`'s validation and idempotency.

`ingest_events` is what the ingest actor runs for one broker message (a list of wire
events). Each event is validated with `ledger.validation.parse_event` and appended on
its own (`Store.append([ev])`, all of them concurrently so they share one group-commit
transaction). A redelivered message therefore finds its events already there and they
are duplicates, never second events (R11). An event the ledger rejects for good
becomes a row of `dead_letters` (content withheld when it was a secret, R23); one
whose referent has not arrived yet is sent again a little later; a transient failure
raises so that dramatiq retries the whole message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.events import Event, encode_json
from ledger.recorder import WriteLock
from ledger.records import now_iso
from ledger.store import Store
from ledger.validation import parse_event
from ledger.vault import dead_letter
from projections.erasure import dead_letter_covered
from workers.policy import (
    MAX_DEFERRALS,
    Disposition,
    classify,
    dead_letter_fields,
    defer_delay_ms,
)

log = structlog.get_logger("memledger.workers")

#: Sends events again after a delay: (raw events, deferral count, delay in ms).
Deferrer = Callable[[list[Any], int, int], Awaitable[None]]
#: Appends each event on its own; one result (or the error) per event.
AppendEach = Callable[[Sequence[Event]], Awaitable[list[Any]]]


def append_each(store: Store) -> AppendEach:
    """Append every event as its own request, all at once: one group commit, each atomic."""
    async def run(events: Sequence[Event]) -> list[Any]:
        return list(await asyncio.gather(*(store.append([ev]) for ev in events),
                                         return_exceptions=True))
    return run


class AppendBatcher:
    """Lets the appends of concurrent ingest messages meet in one group commit.

    Messages of a few events arrive spread out in time; committing each on its own
    costs a transaction per message. The batcher holds appends for up to `linger`
    seconds (or until `max_events` are waiting) and sends them to the store together,
    so they share one transaction (each event still its own atomic request).
    """

    def __init__(self, store: Store, *, linger: float = 0.002, max_events: int = 1000) -> None:
        self.store = store
        self.linger = linger
        self.max_events = max_events
        self._waiting: list[tuple[Sequence[Event], asyncio.Future[list[Any]]]] = []
        self._count = 0
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, events: Sequence[Event]) -> list[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Any]] = loop.create_future()
        self._waiting.append((events, fut))
        self._count += len(events)
        if self._count >= self.max_events:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.linger, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting, self._count = self._waiting, [], 0
        if waiting:
            asyncio.get_running_loop().create_task(self._send(waiting))

    async def _send(self, waiting: list[tuple[Sequence[Event], asyncio.Future[list[Any]]]]
                    ) -> None:
        flat = [ev for evs, _ in waiting for ev in evs]
        results = await append_each(self.store)(flat)
        i = 0
        for evs, fut in waiting:
            if not fut.done():
                fut.set_result(results[i:i + len(evs)])
            i += len(evs)


@dataclass(frozen=True, slots=True)
class IngestOutcome:
    """What one ingest message did."""

    appended: int = 0
    duplicates: int = 0
    dead: int = 0
    deferred: int = 0


async def ingest_events(store: Store, events: Any, *, deferrals: int = 0,
                        defer: Deferrer | None = None, append: AppendEach | None = None
                        ) -> IngestOutcome:
    """Validate and append one message's events; dead-letter or defer what is rejected.

    Raises the first transient error (`StoreUnavailable`, ...) so the message is
    retried as a whole; what was appended before is then a duplicate.
    """
    if not isinstance(events, list):
        await record_dead_letters(store, [(events, ValidationError(
            "", f"an ingest message must carry a list of events, got {type(events).__name__}"
        ))])
        return IngestOutcome(dead=1)
    dead: list[tuple[Any, BaseException]] = []
    parsed: list[tuple[Any, Event]] = []
    for raw in events:
        try:
            parsed.append((raw, parse_event(raw)))
        except ValidationError as e:
            dead.append((raw, e))
    results = await (append or append_each(store))([ev for _, ev in parsed])
    appended = duplicates = 0
    later: list[tuple[Any, BaseException]] = []
    for (raw, _), res in zip(parsed, results, strict=True):
        if not isinstance(res, BaseException):
            if res[0].status == "appended":
                appended += 1
            else:
                duplicates += 1
            continue
        disposition = classify(res)
        if disposition is Disposition.RETRY:
            raise res
        if disposition is Disposition.DEFER:
            later.append((raw, res))
        else:
            dead.append((raw, res))
    if later and (defer is None or deferrals >= MAX_DEFERRALS):
        dead.extend((raw, _gave_up(e, deferrals)) for raw, e in later)
        later = []
    if dead:
        await record_dead_letters(store, dead)
    if later:
        assert defer is not None
        await defer([raw for raw, _ in later], deferrals + 1, defer_delay_ms(deferrals))
    if dead or later or deferrals:
        log.info("ingest_rejections", dead=len(dead), deferred=len(later), attempt=deferrals)
    return IngestOutcome(appended, duplicates, len(dead), len(later))


def _gave_up(error: BaseException, deferrals: int) -> ValidationError:
    msg = str(error)
    if deferrals:
        msg += (f" (still missing after {deferrals + 1} attempts: the event it refers to "
                "was never ingested)")
    return ValidationError("", msg)


# -- dead letters -------------------------------------------------------------------------

def _same(col: Any, value: Any) -> Any:
    return col.is_(None) if value is None else col == value


async def record_dead_letters(store: Store, items: Sequence[tuple[Any, BaseException]]
                              ) -> int:
    """Store a dead letter per rejected event; a redelivered one is not stored twice.

    Returns how many new rows were written.
    """
    if not items:
        return 0
    await store.open()
    received = now_iso()
    rows = []
    for raw, err in items:
        f = dead_letter_fields(raw, err)
        payload = encode_json(f["payload"]) if f["payload"] is not None else None
        rows.append({"received_at": received, "tenant": f["tenant"],
                     "idempotency_key": f["idempotency_key"], "error": f["error"],
                     "payload": payload})
        log.warning("dead_letter", tenant=f["tenant"], withheld=f["withheld"],
                    reason=f["error"][:200])
    written = 0
    async with store.view_write() as conn:
        # Two daemons recording the same redelivered message must not both insert.
        await store.recorder.advisory_lock(conn, WriteLock.DEAD_LETTERS)
        tombs = await store.tombstones(conn, {r["tenant"] for r in rows if r["tenant"]})
        for row in rows:
            if row["payload"] is not None and any(
                    dead_letter_covered(orjson.loads(row["payload"]), ts) for ts in tombs):
                row["payload"] = None  # a forget already covers what it names (R20)
            if not await _exists(conn, row):
                if row["payload"] is not None:  # sealed when the vault is on
                    row["payload"] = dead_letter(store.vault, row["tenant"], row["payload"])
                await conn.execute(t.dead_letters.insert().values(**row))
                written += 1
    return written


async def _exists(conn: AsyncConnection, row: dict[str, Any]) -> bool:
    dl = t.dead_letters.c
    q = select(dl.payload).where(_same(dl.tenant, row["tenant"]),
                                 _same(dl.idempotency_key, row["idempotency_key"]),
                                 dl.error == row["error"])
    payloads = [r[0] for r in (await conn.execute(q)).all()]
    return any((bytes(p) if p is not None else None) == row["payload"] for p in payloads)


async def list_dead_letters(store: Store, *, tenant: str | None = None,
                            limit: int = 1000) -> list[dict[str, Any]]:
    """Dead letters, oldest first: id, when, tenant, key, error and what was kept."""
    await store.open()
    dl = t.dead_letters.c
    q = select(t.dead_letters).order_by(dl.id).limit(limit)
    if tenant is not None:
        q = q.where(dl.tenant == tenant)
    async with store.read() as conn:
        rows = (await conn.execute(q)).all()
    out = []
    for r in rows:
        event = orjson.loads(r.payload) if r.payload is not None else None
        out.append({"id": r.id, "received_at": r.received_at, "tenant": r.tenant,
                    "idempotency_key": r.idempotency_key, "error": r.error, "event": event,
                    # A secret's dead letter keeps the envelope only (R23).
                    "content_withheld": "(R23)" in r.error})
    return out

