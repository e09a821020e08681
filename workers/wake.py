"""Wake-ups: after an append commits, tell the projection workers there is more to read.

A wake-up is a broker message carrying only the new head position: no content, no
order. `WakeSender` coalesces them (at most one in flight, at most one every
`MIN_INTERVAL_S`, the latest head always sent last), and never lets a broker failure
reach the append: a lost wake-up only delays projection until the next sweep.
`attach(store)` wires it to any `Store`, so an app appending through the SDK wakes
the daemons too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Final

import structlog
from dramatiq import Message

from ledger.store import Store
from workers.broker import PROJECT_QUEUE, WAKE_ACTOR, LedgerBroker, redis_url, safe_url

log = structlog.get_logger("memledger.workers")

MIN_INTERVAL_S: Final = 0.02
#: While the broker is down, one warning per this many seconds.
WARN_EVERY_S: Final = 60.0


def wake_message(head: int) -> Message[Any]:
    """The broker message that wakes a projection runner for ledger head `head`."""
    return Message(queue_name=PROJECT_QUEUE, actor_name=WAKE_ACTOR, args=(head,), kwargs={},
                   options={})


class WakeSender:
    """Sends coalesced wake-ups from an asyncio loop through a blocking `send(head)`."""

    def __init__(self, send: Callable[[int], None], *, label: str = "broker") -> None:
        self._send = send
        self._label = label
        self._latest = 0
        self._sent = 0
        self._task: asyncio.Task[None] | None = None
        self._warned_at = 0.0
        self.failures = 0

    def notify(self, head: int) -> None:
        """Called after a commit (on the store's loop): make sure `head` gets announced."""
        if head <= self._latest:
            return
        self._latest = head
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._latest > self._sent:
            head = self._latest
            try:
                await asyncio.to_thread(self._send, head)
            except Exception as e:  # noqa: BLE001 - a lost wake-up is covered by the sweep
                self.failures += 1
                now = time.monotonic()
                if now - self._warned_at >= WARN_EVERY_S:
                    self._warned_at = now
                    log.warning("wake_not_sent", head=head, broker=self._label,
                                error=str(e)[:200], note="the sweep will catch up")
            self._sent = head
            await asyncio.sleep(MIN_INTERVAL_S)

    async def close(self) -> None:
        """Wait for the wake-up in flight, if any."""
        if self._task is not None and not self._task.done():
            await self._task


def broker_sender(broker: LedgerBroker) -> Callable[[int], None]:
    """A blocking `send(head)` through a broker."""
    def send(head: int) -> None:
        broker.enqueue(wake_message(head))
    return send


def attach(store: Store, url: str | None = None) -> WakeSender:
    """Send a wake-up to the worker daemons after each of `store`'s append commits."""
    broker = LedgerBroker(redis_url(url))
    sender = WakeSender(broker_sender(broker), label=safe_url(broker.url))
    store.on_commit(sender.notify)
    return sender
