"""Write turns: hand SQLite's write lock from one worker process to the next at once.

SQLite has one write lock per database, and a connection that finds it taken does
not queue for it: it sleeps and tries again (the busy timeout's backoff: 1, 2, 5, 10,
... up to 100 ms between tries). Two processes that both write often (one appending,
one projecting) then keep missing each other's free moments: whoever just committed
begins its next transaction before the sleeper wakes up, and a waiter can sleep
through tens of milliseconds of a free lock. Measured on the worker benchmark, such
waits were the largest part of the lag.

`WriteTurn` puts a queue in front of the lock: a worker takes its *turn* (an exclusive
`flock` on a file beside the database, waited for in a thread, so the kernel wakes
the next waiter the moment the holder lets go) before `BEGIN IMMEDIATE`, and gives it
back after the commit. Inside a process an `asyncio.Lock` queues the process's own
writers (appends, projection batches, dead letters) first, in arrival order.

The turn is only about latency. Correctness still rests on SQLite's own lock:
writers that take no turn (an app appending through the SDK, the CLI) wait for it as
before, and a turn not granted within `TURN_TIMEOUT_S` (a stopped process holding
it) is given up on, the write going ahead under the busy timeout alone. A turn held
by a killed process ends with it (the kernel drops its locks). PostgreSQL queues its
lock waiters itself: `TurnStore` takes turns on SQLite files only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Final

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.store import Store

#: How long a writer waits for its turn before going ahead without it.
TURN_TIMEOUT_S: Final = 30.0
#: The turn file: the database's path plus this.
SUFFIX: Final = "-turn"


class _Attempt:
    """One wait for the file lock, shared by the waiting task and the waiting thread."""

    def __init__(self, done: Callable[[BaseException | None], None]) -> None:
        self.done = done
        self.mutex = threading.Lock()
        self.fd: int | None = None     # the descriptor holding the lock, once acquired
        self.abandoned = False

    def release(self) -> None:
        """Give the turn back (once)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)


class WriteTurn:
    """A queue for the write lock among worker processes on one SQLite file.

    The waits happen on one daemon thread per `WriteTurn`, which owns the file
    descriptor: a wait that never ends (a stopped process holding the turn) cannot
    keep the process from exiting, and the descriptor is never closed under a wait.
    """

    def __init__(self, path: str, *, timeout: float = TURN_TIMEOUT_S) -> None:
        self.path = path
        self.timeout = timeout
        self._local: asyncio.Lock | None = None
        self._requests: queue.SimpleQueue[_Attempt | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        #: Turns given up on after `timeout` (the write went ahead without one).
        self.timeouts = 0

    # -- the waiting thread --------------------------------------------------------------
    def _serve(self, requests: queue.SimpleQueue[_Attempt | None]) -> None:
        fd: int | None = None
        try:
            while (attempt := requests.get()) is not None:
                try:
                    if fd is None:
                        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError as e:
                    attempt.done(e)
                    continue
                with attempt.mutex:
                    abandoned = attempt.abandoned
                    if not abandoned:
                        attempt.fd = fd
                if abandoned:  # nobody waits for it any more: give it back
                    fcntl.flock(fd, fcntl.LOCK_UN)
                else:
                    attempt.done(None)
        finally:
            if fd is not None:
                os.close(fd)

    def _submit(self, attempt: _Attempt) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._requests = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, args=(self._requests,),
                                            daemon=True, name="memledger-turn")
            self._thread.start()
        self._requests.put(attempt)

    # -- the waiting task ----------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[bool]:
        """Hold the turn for the block; yields whether it was granted (False: timed
        out or the turn file could not be used, and the block runs without it)."""
        if self._local is None:
            self._local = asyncio.Lock()
        async with self._local:
            attempt = await self._acquire()
            try:
                yield attempt is not None
            finally:
                if attempt is not None:
                    attempt.release()

    async def _acquire(self) -> _Attempt | None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def settle(err: BaseException | None) -> None:
            if not fut.done():
                if err is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(err)

        def done(err: BaseException | None) -> None:  # on the waiting thread
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(settle, err)

        attempt = _Attempt(done)
        self._submit(attempt)
        try:
            await asyncio.wait_for(fut, self.timeout)
            return attempt
        except (TimeoutError, asyncio.CancelledError) as e:  # (before OSError: a subclass)
            with attempt.mutex:
                attempt.abandoned = True
                got = attempt.fd is not None
            if isinstance(e, asyncio.CancelledError):
                attempt.release()
                raise
            self.timeouts += 1
            return attempt if got else None  # granted just as the wait timed out: use it
        except OSError:
            return None  # no turn file (read-only directory ...): SQLite's lock alone

    def close(self) -> None:
        """Stop the waiting thread once its waits are over; it closes the turn file.
        (Call it when no turn is held: the store is closed.)"""
        if self._thread is not None:
            self._requests.put(None)
            self._thread = None


def turn_path(url: str) -> str | None:
    """The turn file of a SQLite file database URL; None for PostgreSQL or in-memory."""
    u = make_url(url)
    if not u.drivername.startswith("sqlite"):
        return None
    db = u.database or ""
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return db + SUFFIX


class TurnStore(Store):
    """A `Store` whose write transactions take a `WriteTurn` first (SQLite files)."""

    def __init__(self, url: str | None = None, *, register_path: str | None = None,
                 pool_size: int = 5) -> None:
        super().__init__(url, register_path=register_path, pool_size=pool_size)
        path = turn_path(self.url)
        self.turn = WriteTurn(path) if path is not None else None

    def _in_turn(self) -> contextlib.AbstractAsyncContextManager[object]:
        return self.turn.hold() if self.turn is not None else contextlib.nullcontext()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """`Store.write`, in turn."""
        async with self._in_turn(), super().write() as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def view_write(self) -> AsyncIterator[AsyncConnection]:
        """`Store.view_write`, in turn."""
        async with self._in_turn(), super().view_write() as conn:
            yield conn

    async def close(self) -> None:
        """`Store.close`, then the turn file."""
        await super().close()
        if self.turn is not None:
            self.turn.close()
