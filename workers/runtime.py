"""What one worker process runs against: its settings, store, projector and wake-ups.

Everything here lives on the process's single asyncio loop (dramatiq's event loop
thread), which every actor call and the sweep share, so concurrent ingest messages
meet in the store's group commit and wake-ups coalesce in one projector.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from typing import Any

import structlog

from ledger.errors import MemledgerError
from ledger.store import Store
from projections import matrix_snapshot
from workers.broker import (
    DEFAULT_THREADS,
    INGEST_QUEUE,
    PROJECT_QUEUE,
    QUEUES,
    LedgerBroker,
    safe_url,
)
from workers.ingest import AppendBatcher
from workers.leases import ShardLeases
from workers.projector import Projector, sweep_forever
from workers.publish import ingest_message
from workers.wake import WakeListener, WakeSender, broker_sender

log = structlog.get_logger("memledger.workers")

DEFAULT_SWEEP_S = 2.0
#: How often the sweeping process purges closed tasks past their retention (R6, R28).
RETENTION_EVERY_S = 60.0


@dataclass(frozen=True)
class Settings:
    """How a worker daemon runs (from the command line and the environment)."""

    redis_url: str
    db_url: str | None = None
    register_path: str | None = None
    queues: tuple[str, ...] = QUEUES
    processes: int = 1
    threads: int = DEFAULT_THREADS
    sweep_interval: float = DEFAULT_SWEEP_S
    #: PostgreSQL: share the projection shards among the projecting processes by leases
    #: (False: every projecting process steps every shard, taking turns per projection).
    shard_leases: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.queues) - set(QUEUES))
        if unknown:
            raise ValueError(f"unknown queue {unknown[0]!r}; queues are {', '.join(QUEUES)}")
        if not self.queues:
            raise ValueError("no queue to consume")
        if self.processes < 1 or self.threads < 1:
            raise ValueError("processes and threads must be at least 1")
        if self.sweep_interval <= 0:
            raise ValueError("sweep_interval must be positive")

    @property
    def projects(self) -> bool:
        """Does this daemon run projections (consume the project queue, sweep)?"""
        return PROJECT_QUEUE in self.queues

    @property
    def ingests(self) -> bool:
        """Does this daemon consume the ingest queue?"""
        return INGEST_QUEUE in self.queues


class Runtime:
    """The store, projector, wake-ups and sweep of one worker process."""

    def __init__(self, settings: Settings, broker: LedgerBroker, *, sweep: bool) -> None:
        self.settings = settings
        self.broker = broker
        # Write transactions take turns with the other worker processes (SQLite).
        self.store = Store(settings.db_url, register_path=settings.register_path,
                           write_turns=True)
        if settings.projects:
            # A projecting process's fused rounds (the urgent views' batches,
            # `Projector`) run on the inline thread, where its appends already run.
            self.store.use_inline()
        self.append = AppendBatcher(self.store)
        self.projector = (Projector(self.store) if settings.projects
                          else None)
        self.wakes = WakeSender(broker_sender(broker), label=safe_url(broker.url))
        self.store.on_commit(self._committed)
        self.sweeps = sweep and self.projector is not None
        self.last_sweep: float | None = None
        self.listener: WakeListener | None = None
        # On PostgreSQL the projecting processes share the shards (`workers.leases`);
        # on SQLite one process steps every shard (its write lock is global anyway).
        self.leases: ShardLeases | None = None
        if self.projector is not None and self.store.recorder.shard_leases \
                and settings.shard_leases:
            self.leases = ShardLeases(self.store, self.projector.runner,
                                      on_gain=self.projector.poke)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Open the store (tolerating an unreachable database) and start the sweep."""
        try:
            await self.store.open()
        except MemledgerError as e:
            log.warning("store_unavailable_at_start", error=str(e)[:300],
                        note="will retry on every message and sweep")
        if self.projector is not None:
            # Wake-ups broadcast by every appending process (this one's own commits
            # poke the projector directly too).
            loop = asyncio.get_running_loop()
            poke = self.projector.poke

            def woken() -> None:
                loop.call_soon_threadsafe(poke)

            self.listener = WakeListener(self.settings.redis_url, woken)
            self.listener.start()
        if self.leases is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self.leases.run()))
        if self.sweeps:
            assert self.projector is not None
            loop = asyncio.get_running_loop()
            self._tasks.append(loop.create_task(
                sweep_forever(self.projector, self.settings.sweep_interval, self._swept)))
            self._tasks.append(loop.create_task(self._retention_forever()))

    async def _retention_forever(self) -> None:
        """Append `task.purged` for closed tasks past `retain_until`, every minute."""
        try:
            from projections.retention import sweep_retention
        except ImportError:  # retention is optional until its module exists
            return
        assert self.projector is not None
        while True:
            try:
                # Read tasks_view caught up: a task closed a moment ago is seen, and one
                # purged a moment ago is not purged again.
                await self.projector.request()
                purged = await sweep_retention(self.store)
                if purged:
                    log.info("retention_purged", tasks=len(purged))
            except MemledgerError as e:
                # E.g. another daemon purged the same task first: the next round skips it.
                log.info("retention_skipped", error=str(e)[:300])
            except Exception:
                log.exception("retention_failed")
            await asyncio.sleep(RETENTION_EVERY_S)

    def _swept(self, at: float) -> None:
        self.last_sweep = at

    def _committed(self, head: int) -> None:
        # Our own projector first (no broker round trip), then every other daemon.
        if self.projector is not None:
            self.projector.poke()
        self.wakes.notify(head)

    async def defer(self, events: list[Any], deferrals: int, delay_ms: int) -> None:
        """Send events again after `delay_ms` (their referent may not be ingested yet)."""
        await asyncio.to_thread(self.broker.enqueue,
                                ingest_message(events, deferrals=deferrals), delay=delay_ms)

    async def close(self) -> None:
        """Give the shard leases back, stop the sweep and the projector, flush the last
        wake-up, close the store."""
        if self.leases is not None:
            # At once: the other processes take the shards on their next tick (a batch
            # of ours still in flight holds its rows until it rolls back below).
            await self.leases.close()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.listener is not None:
            await asyncio.to_thread(self.listener.stop)
        if self.projector is not None:
            await self.projector.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.wakes.close(), 5)
        # Recall snapshots a bulk catch-up is writing (a few seconds at most): a file
        # cut off here would only be a temporary file, but the write would be lost.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(matrix_snapshot.settled(), 30)
        await self.store.close()


def describe(settings: Settings, daemon_id: str) -> dict[str, Any]:
    """The static part of a daemon process's status record."""
    return {"id": daemon_id, "pid": os.getpid(), "queues": list(settings.queues),
            "threads": settings.threads}
