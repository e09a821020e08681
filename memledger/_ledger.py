"""The SDK an agent app uses: append, remember, forget, get, recall, tasks, history.

`MemoryLedger` is a thin facade over the store, the projection runner and the
principal-scoped reads; it adds no rules of its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from ledger.errors import ValidationError
from ledger.events import Event
from ledger.records import AppendResult
from ledger.store import Store
from ledger.validation import parse_event


def _now_us() -> int:
    return time.time_ns() // 1000


def as_event(obj: Event | dict[str, Any]) -> Event:
    """Accept a validated `Event` or a wire dict (validated here)."""
    return obj if isinstance(obj, Event) else parse_event(obj)


class MemoryLedger:
    """An open ledger: use as `async with MemoryLedger(url) as ml: ...`."""

    def __init__(self, url: str | None = None, *, register_path: str | None = None) -> None:
        from projections.runner import Runner

        self.store = Store(url, register_path=register_path)
        self.runner = Runner(self.store)

    async def __aenter__(self) -> MemoryLedger:
        await self.store.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Release the database connections."""
        await self.store.close()

    async def append(self, events: Sequence[Event | dict[str, Any]]) -> list[AppendResult]:
        """Append events atomically (all or none); see `Store.append`."""
        return await self.store.append([as_event(e) for e in events])

    async def remember(self, event: Event | dict[str, Any], *, wait: bool = True
                       ) -> AppendResult:
        """Append one event; with `wait`, return only once it is durable and projected.

        Confirm "I'll remember that" to the user only after this returns (R16): on any
        error the event was not saved, and the app must say so.
        """
        res = await self.store.append_one(as_event(event))
        if wait:
            await self.runner.catch_up(upto=max(res.position, 0))
        return res

    async def project(self) -> dict[str, int]:
        """Run every projection in this process until it has caught up."""
        return await self.runner.catch_up()

    async def get(self, principal: str, namespace: Sequence[str], key: str, *,
                  task: str | None = None, session: str | None = None) -> dict[str, Any]:
        """The active value of `key` for the principal (session > task > long-term)."""
        from projections import reads

        who = reads.Principal.parse(principal)
        async with self.store.read_once() as conn:
            return await reads.get(conn, who, list(namespace), key, now_us=_now_us(),
                                   task=task, session=session)

    async def tasks(self, principal: str, *, include_closed: bool = False
                    ) -> list[dict[str, Any]]:
        """The principal's task summaries (open ones unless `include_closed`)."""
        from projections import reads

        who = reads.Principal.parse(principal)
        async with self.store.read() as conn:
            return await reads.tasks(conn, who, include_closed=include_closed)

    async def history(self, principal: str, namespace: Sequence[str], key: str
                      ) -> list[dict[str, Any]]:
        """Every version of a key the principal owns (forgotten ones redacted)."""
        from projections import reads

        who = reads.Principal.parse(principal)
        async with self.store.read() as conn:
            return await reads.history(conn, who, list(namespace), key)

    async def recall(self, principal: str, *, query: str | None = None,
                     session: str | None = None, task: str | None = None,
                     budget: int | None = None, limit: int = 20) -> dict[str, Any]:
        """Memories and open tasks to put before a model turn, with an audit id."""
        from projections.recall import recall

        if limit < 1:
            raise ValidationError("limit", "must be at least 1")
        return await recall(self.store, principal, query=query, session=session, task=task,
                            budget=budget, limit=limit, now_us=_now_us())
