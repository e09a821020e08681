"""Wake-ups: after an append commits, tell the projection workers there is more to read.

A wake-up carries only the new head position: no content, no order. It is broadcast
on the Redis pub/sub channel `WAKE_CHANNEL`, so every projecting process hears it at
once (`WakeListener`, a thread that pokes its projector); nothing is queued, and a
wake-up nobody hears is simply gone. `WakeSender` coalesces them (at most one in
flight, at most one every `MIN_INTERVAL_S`, the latest head always sent last), and
never lets a broker failure reach the append: a lost wake-up only delays projection
until the next sweep. `attach(store)` wires it to any `Store`, so an app appending
through the SDK wakes the daemons too.

The `project` queue's `memledger_wake` messages (`wake_message`) still work: they ask
for a full pass and wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import redis
import structlog
from dramatiq import Message

from ledger.store import Store
from workers.broker import (
    NAMESPACE,
    PROJECT_QUEUE,
    WAKE_ACTOR,
    LedgerBroker,
    redis_client,
    redis_url,
    safe_url,
)

log = structlog.get_logger("memledger.workers")

#: The pub/sub channel wake-ups are broadcast on.
WAKE_CHANNEL: Final = f"{NAMESPACE}:wake"
#: At most one wake-up per this many seconds per sending process.
MIN_INTERVAL_S: Final = 0.005
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
    """A blocking `send(head)`: broadcast on the broker's wake-up channel."""
    def send(head: int) -> None:
        broker.client.publish(WAKE_CHANNEL, str(head))
    return send


class WakeListener:
    """A thread subscribed to `WAKE_CHANNEL`; calls `on_wake()` for every wake-up, and
    once after each (re)subscription, since wake-ups sent meanwhile were not heard.

    `on_wake` runs on this thread: make it thread-safe (`loop.call_soon_threadsafe`).
    While the broker is unreachable it tries again every `retry_s` (quietly: the
    housekeeping thread reports the broker's state).
    """

    def __init__(self, url: str, on_wake: Callable[[], None], *, retry_s: float = 1.0
                 ) -> None:
        self.url = url
        self.on_wake = on_wake
        self.retry_s = retry_s
        self.heard = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="memledger-wake-listener")

    def start(self) -> None:
        """Start listening."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening (within about half a second)."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            client = redis_client(self.url)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(WAKE_CHANNEL)
                self.on_wake()
                while not self._stop.is_set():
                    if pubsub.get_message(timeout=0.5) is not None:
                        self.heard += 1
                        self.on_wake()
            except (redis.RedisError, OSError):
                self._stop.wait(self.retry_s)
            except Exception:  # a listener failure must not end wake-ups
                log.exception("wake_listener_failed")
                self._stop.wait(self.retry_s)
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()
                client.close()


def attach(store: Store, url: str | None = None) -> WakeSender:
    """Send a wake-up to the worker daemons after each of `store`'s append commits."""
    broker = LedgerBroker(redis_url(url))
    sender = WakeSender(broker_sender(broker), label=safe_url(broker.url))
    store.on_commit(sender.notify)
    return sender
