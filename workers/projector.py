"""The projection side of a worker process: one coalescing runner, woken, never fed.

A wake-up (a broadcast from an appending process, a local commit, the periodic sweep)
carries no events: it asks for a *pass*, which reads the ledger head and steps lagging
projections up to it with `projections.runner.Runner.step`. Passes run one at a time
per process; any number of requests made while one runs are served by the next.

Two kinds of demand, two kinds of pass:

- `request()` (the sweep, the retention purge, a wake-up message on the `project`
  queue) waits for a *full* pass: one that started after the call and brought every
  projection to the head it read at its start. So every event committed before the
  request is projected when it returns.
- `poke()` (a wake-up after a commit) asks for the *urgent* projections (`URGENT`:
  `memories`, the active-memory view readers wait for) to be brought to the head at
  once. The others are brought up to date in the same pass only when they are due:
  every `CATCH_UP_INTERVAL_S` while appends are arriving (so their batches are larger
  and their transactions fewer), at once when the ledger is quiet, or when a `request`
  waits. A timer makes sure a due catch-up runs even if no wake-up comes.

Inside a pass the urgent projections go first, and again before every batch of the
others whenever new events were committed meanwhile, so a slow projection (the vector
index costs about half of all projection work) never holds the active-memory view back.
While appends are arriving the other projections are stepped in *slices* sized to hold
the write lock about `SLICE_S` (estimated from their measured cost per position), so an
append waiting for its turn at the lock (`ledger.backends.sqlite.WriteTurn`) never waits
long behind one; urgent projections always take whole batches. When the ledger is quiet
the projector runs in whole batches throughout.

Lost, duplicated or reordered wake-ups change nothing but timing; the sweep bounds the
delay when wake-ups are lost altogether. Across processes and machines the checkpoint
row lock taken by `Runner.step` (SQLite: the database write lock, PostgreSQL: SELECT
... FOR UPDATE) lets one runner advance a projection at a time; it is held for one
batch transaction and released by commit, rollback, or the death of its connection,
so a killed holder is replaced at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Final

import structlog

from ledger.errors import MemledgerError
from ledger.store import Store
from projections.protocol import Projection
from projections.runner import Runner

log = structlog.get_logger("memledger.workers")

#: Projections readers wait for: stepped first, and on every wake-up.
URGENT: Final = ("memories",)
#: Shortest pause between the end of a pass and the start of the next, per process:
#: commits arriving within it are projected together.
MIN_PASS_INTERVAL_S = 0.01
#: While appends are arriving, the non-urgent projections are brought up to date at
#: most this often (unless a `request` waits for them).
CATCH_UP_INTERVAL_S: Final = 0.25
#: While appends are arriving, a batch of a non-urgent projection is sized to hold the
#: write lock about this long, so an append never waits long behind one. Urgent
#: projections always take whole batches: slicing them would only make them lag.
SLICE_S: Final = 0.025
#: Smallest slice, in positions (below it a batch is mostly fixed cost).
MIN_SLICE: Final = 50
#: Appends count as "arriving" while the head moved, or a commit was announced, this
#: recently.
ACTIVE_WINDOW_S: Final = 0.5


class Projector:
    """Runs every projection of a store in passes, one pass at a time."""

    def __init__(self, store: Store, runner: Runner | None = None, *,
                 min_interval: float = MIN_PASS_INTERVAL_S,
                 urgent: tuple[str, ...] = URGENT,
                 catch_up_interval: float = CATCH_UP_INTERVAL_S) -> None:
        self.store = store
        self.runner = runner or Runner(store)
        self.min_interval = min_interval
        self.catch_up_interval = catch_up_interval
        self.urgent = [p for p in self.runner.projections if p.name in urgent]
        self.others = [p for p in self.runner.projections if p.name not in urgent]
        #: The largest batch: the runner's own batch size (used as is when quiet).
        self.max_batch = self.runner.batch_size
        #: Where the store's write transactions run inline (`Store.use_inline`, a SQLite
        #: file) a batch is one fused round (`Runner.round`: one hand-off to the inline
        #: thread, its statements on a plain `sqlite3` connection) instead of a step's
        #: statements one by one through the async driver, so it holds the write lock
        #: for less time: the urgent projections' runner, and one runner per other
        #: projection that is not `sparse` (a sparse one's step reads only its own
        #: events, `SPARSE_SPAN` batches wide, which a round of its batch would not).
        self._urgent_runner = (Runner(store, self.urgent, batch_size=self.max_batch)
                               if self.urgent else None)
        self._solo = {p.name: Runner(store, [p], batch_size=self.max_batch)
                      for p in self.others if not getattr(p, "sparse", False)}
        #: The head every projection had reached at the end of the last full pass.
        self.reached = 0
        #: The head the urgent projections had reached at the end of the last pass.
        self.urgent_reached = 0
        self.passes = 0
        self.last_pass: float | None = None
        self._pending: list[asyncio.Future[None]] = []
        self._dirty: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._caught_up_at = 0.0      # monotonic time of the last full catch-up
        self._behind = False          # non-urgent projections left behind by a pass
        self._last_head = 0
        self._active_at = float("-inf")  # last sign of appends arriving
        self._cost: dict[str, float] = {}  # seconds per position moved, per projection

    def _ensure(self) -> asyncio.Event:
        if self._dirty is None:
            self._dirty = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return self._dirty

    async def request(self, head: int | None = None) -> None:
        """Return once every event committed before this call is projected.

        With `head` (the ledger head a wake-up was sent for), return at once when the
        last full pass already reached it. Raises the pass's error (e.g.
        `StoreUnavailable`).
        """
        if head is not None and head <= self.reached:
            return
        dirty = self._ensure()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(fut)
        dirty.set()
        await fut

    def poke(self) -> None:
        """New events were committed: project the urgent views soon (no waiting)."""
        dirty = self._ensure()
        self._active_at = time.monotonic()
        dirty.set()

    def _active(self) -> bool:
        return time.monotonic() - self._active_at < ACTIVE_WINDOW_S

    async def _loop(self) -> None:
        assert self._dirty is not None
        ended = 0.0
        while True:
            await self._dirty.wait()
            # Leave room between passes: commits arriving meanwhile are projected
            # together. (Appends get the write lock between any two batches: their
            # transactions queue for it with ours, `ledger.backends.sqlite.WriteTurn`, also
            # when this process ingests too.)
            pause = ended + self.min_interval - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            self._dirty.clear()
            waiters, self._pending = self._pending, []
            full = bool(waiters) or not self._active() or (
                time.monotonic() - self._caught_up_at >= self.catch_up_interval)
            try:
                await self.run_pass(full=full)
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
            for w in waiters:
                if not w.done():
                    w.set_result(None)
            self._schedule_catch_up()

    def _schedule_catch_up(self) -> None:
        """If a pass left the other projections behind, make sure one catches them up."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._behind:
            return
        assert self._dirty is not None
        delay = max(0.0, self._caught_up_at + self.catch_up_interval - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(delay, self._dirty.set)

    async def _state(self) -> tuple[int, dict[str, int]]:
        """The ledger head and every projection's checkpoint (reads only: no lock)."""
        async with self.store.read_once() as conn:
            head = await self.store.head(conn)
            at = await self.runner.positions(conn)
        if head > self._last_head:
            if self._last_head:
                self._active_at = time.monotonic()
            self._last_head = head
        return head, at

    async def run_pass(self, *, full: bool = True) -> int:
        """Step the lagging projections; returns positions moved.

        Urgent projections go to the newest head, before every batch of the others. A
        full pass also brings the others to the head read at its start; otherwise they
        are left for a later catch-up.
        """
        await self.store.open()
        head, at = await self._state()
        if self.runner.owned is not None and not self.runner.owned:
            # Sharded, and no shard leased to this process (yet): nothing of ours to do.
            self.reached = max(self.reached, head)
            self.passes += 1
            self.last_pass = time.time()
            return 0
        target = head
        moved = 0
        while True:
            behind = [p for p in self.others if at[p.name] < target] if full else []
            # While others are still to do, the urgent ones follow the newest head
            # before each of their batches; the pass itself ends at `target`.
            goal = head if behind else target
            stepped = False
            before = moved
            if any(at[p.name] < goal for p in self.urgent):
                moved += await self._step_urgent(at, goal)
                stepped = True
            if behind:
                # In order: a projection that reads other views runs behind them.
                moved += await self._step(behind[0], target, SLICE_S, at)
                stepped = True
            if not stepped or moved == before:
                # (No progress: the shards this process owns changed under the pass.)
                break
            head, at = await self._state()
        if full:
            self.reached = max(self.reached, target)
            self._caught_up_at = time.monotonic()
        self._behind = any(at[p.name] < head for p in self.others)
        self.urgent_reached = max(self.urgent_reached,
                                  min((at[p.name] for p in self.urgent), default=head))
        self.passes += 1
        self.last_pass = time.time()
        if moved:
            log.debug("projection_pass", head=head, moved=moved, full=full)
        return moved

    async def _step_urgent(self, at: dict[str, int], goal: int) -> int:
        """One whole batch of the urgent projections towards `goal`; positions moved
        (summed over them, as `_step` counts). In one fused round where the store's
        write transactions run inline and this process steps every shard; else a step
        of each."""
        runner = self._urgent_runner
        if runner is not None and self._inline():
            low = min(at[p.name] for p in self.urgent)
            end = await runner.round(min(goal, low + self.max_batch))
            return sum(max(0, end - at[p.name]) for p in self.urgent if at[p.name] < end)
        moved = 0
        for proj in self.urgent:
            if at[proj.name] < goal:
                moved += await self._step(proj, goal, None)
        return moved

    def _inline(self) -> bool:
        """Do batches go in fused rounds (`_urgent_runner`, `_solo`)?"""
        return self.store.inline is not None and self.runner.owned is None

    async def _step(self, proj: Projection, upto: int, slice_s: float | None,
                    at: dict[str, int] | None = None) -> int:
        """One batch of one projection; while appends arrive, one of about `slice_s`
        seconds (None: a whole batch). With its checkpoint in `at`, in a fused round
        where `_inline` says so (`_solo`)."""
        size = self.max_batch
        if slice_s is not None and self._active():
            cost = self._cost.get(proj.name)
            want = int(slice_s / cost) if cost else self.max_batch // 5
            size = min(self.max_batch, max(MIN_SLICE, want))
        started = time.monotonic()
        solo = self._solo.get(proj.name)
        if solo is not None and at is not None and at[proj.name] > 0 and self._inline():
            solo.batch_size = size
            n = max(0, await solo.round(min(upto, at[proj.name] + size)) - at[proj.name])
        else:
            n = await self.runner.step(proj, upto, size)
        if n >= MIN_SLICE // 2:
            per = (time.monotonic() - started) / n
            old = self._cost.get(proj.name)
            self._cost[proj.name] = per if old is None else 0.7 * old + 0.3 * per
        return n

    async def close(self) -> None:
        """Stop the pass loop; a pass in flight is rolled back, never half-applied."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
