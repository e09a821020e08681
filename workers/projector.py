"""The projection side of a worker process: one coalescing runner, woken, never fed.

A wake-up (a broker message, a local commit, the periodic sweep) carries no events:
it asks for a *pass*, which reads the ledger head and steps every lagging projection
up to it with `projections.runner.Runner.step`. Passes run one at a time per process;
any number of requests made while one runs are served by the next. A request returns
once a pass that started after it has finished, so every event committed before the
request is projected by then. Lost, duplicated or reordered wake-ups therefore change
nothing but timing; the sweep bounds the delay when wake-ups are lost altogether.

Across processes and machines the checkpoint row lock taken by `Runner.step` (SQLite:
the database write lock, PostgreSQL: SELECT ... FOR UPDATE) lets one runner advance a
projection at a time; it is held for one batch transaction and released by commit,
rollback, or the death of its connection, so a killed holder is replaced at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from ledger.errors import MemledgerError
from ledger.store import Store
from projections.runner import Runner

log = structlog.get_logger("memledger.workers")

#: Shortest pause between the end of a pass and the start of the next, per process.
MIN_PASS_INTERVAL_S = 0.05


class Projector:
    """Runs every projection of a store in passes, one pass at a time."""

    def __init__(self, store: Store, runner: Runner | None = None, *,
                 min_interval: float = MIN_PASS_INTERVAL_S, share: bool = False) -> None:
        self.store = store
        self.runner = runner or Runner(store)
        self.min_interval = min_interval
        #: This process ingests too: leave it as much time between passes as a pass took.
        self.share = share
        #: The head every projection had reached at the end of the last pass.
        self.reached = 0
        self.passes = 0
        self.last_pass: float | None = None
        self._pending: list[asyncio.Future[None]] = []
        self._dirty: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def _ensure(self) -> asyncio.Event:
        if self._dirty is None:
            self._dirty = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return self._dirty

    async def request(self, head: int | None = None) -> None:
        """Return once every event committed before this call is projected.

        With `head` (the ledger head a wake-up was sent for), return at once when the
        last pass already reached it. Raises the pass's error (e.g. `StoreUnavailable`).
        """
        if head is not None and head <= self.reached:
            return
        dirty = self._ensure()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(fut)
        dirty.set()
        await fut

    def poke(self) -> None:
        """Ask for a pass without waiting for it (after a local commit)."""
        self._ensure().set()

    async def _loop(self) -> None:
        assert self._dirty is not None
        ended = took = 0.0
        while True:
            await self._dirty.wait()
            # Leave room between passes: under a stream of commits each pass then takes
            # many events at once, and appends get the (SQLite) write lock in between. When
            # this process ingests too, the pause is as long as the last pass, so its
            # appends get the lock, and the process's one loop, at least half the time.
            rest = max(self.min_interval, took) if self.share else self.min_interval
            pause = ended + rest - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            self._dirty.clear()
            waiters, self._pending = self._pending, []
            started = time.monotonic()
            try:
                await self.run_pass()
            except asyncio.CancelledError:
                for w in waiters:
                    w.cancel()
                raise
            except Exception as e:
                if not isinstance(e, MemledgerError):
                    log.exception("projection_pass_failed")
                for w in waiters:
                    if not w.done():
                        w.set_exception(e)
                continue
            finally:
                ended = time.monotonic()
                took = ended - started
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    async def run_pass(self) -> int:
        """Step every lagging projection up to the head read now; returns events applied."""
        head = await self.store.head()
        positions = await self.runner.positions()
        applied = 0
        for proj in self.runner.projections:
            if positions.get(proj.name, 0) >= head:
                continue
            while True:
                n = await self.runner.step(proj, head)
                if n == 0:
                    break
                applied += n
        self.reached = max(self.reached, head)
        self.passes += 1
        self.last_pass = time.time()
        if applied:
            log.debug("projection_pass", head=head, applied=applied)
        return applied

    async def close(self) -> None:
        """Stop the pass loop; a pass in flight is rolled back, never half-applied."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for w in self._pending:
            w.cancel()
        self._pending.clear()


async def sweep_forever(projector: Projector, interval: float,
                        on_sweep: Callable[[float], None]) -> None:
    """Request a pass now and every `interval` seconds: catches up on lost wake-ups,
    and keeps the views moving while the broker is down."""
    failing = False
    while True:
        try:
            await projector.request()
        except Exception as e:  # noqa: BLE001 - the sweep must outlive any one failure
            if not failing:
                log.warning("sweep_failed", error=str(e)[:300] or type(e).__name__)
            failing = True
        else:
            if failing:
                log.info("sweep_recovered")
            failing = False
            on_sweep(time.time())
        await asyncio.sleep(interval)
