"""Write transactions run in one hand-off to a thread of their own (SQLite files).

Through SQLAlchemy async and aiosqlite every statement costs four hand-offs between the
event loop's thread and the driver's (cursor, execute, fetch, close): about 0.5 ms a
statement on a 2-core machine, most of it waiting for a CPU, where SQLite itself takes
tens of microseconds. A LangGraph put was an append of seven statements and a
projection round of about fifty (docs/benchmarks.md, "LangGraph store: transactions in
one hand-off"), so the hand-offs were most of its time.

`InlineWrites.run(body)` runs a whole write transaction on a dedicated thread instead,
on a plain `sqlite3` connection that thread owns (SQLAlchemy's synchronous pysqlite
dialect, the recorder's pragmas, `BEGIN IMMEDIATE`, the ledger's vault attached): one
hand-off for the transaction. `body` is the same async code the async path runs (the
appender, the projections' `apply`, the recall audit's inserts); it gets a `SyncBacked`
connection whose awaitables complete at once, and runs to its end on the thread's own
event loop. Callers do not choose between the two paths themselves:
`Store.transaction(body, views=...)` runs `body` here when the store's inline writes
are on (`Store.use_inline`) and through `Store.write` / `Store.view_write` otherwise.

It takes the same SQLite write lock as `Store.write` and `Store.view_write` (BEGIN
IMMEDIATE on the same file, waited for in this thread under the same busy timeout), in
turn when the store takes write turns, so the transaction is like any other: all of
it commits or none. Its writes queue on the one thread, so a process's own appends and
rounds never meet at SQLite's lock. PostgreSQL, in-memory databases and `file:` URIs
keep the async path (`InlineWrites.of` returns None for them).

Who turns it on (`Store.use_inline`): the SDK's `MemoryLedger` (unless
`inline_writes=False`; so the CLI's principal-scoped commands and `memledger serve`
too) and the LangGraph store. The worker daemons and the CLI's other commands use a
plain `Store` and keep the async path for their other transactions; a `Store`'s group
commits (its appends) run here on every SQLite file unless it was made with
`inline_appends=False`, and there the recorder's append statements (the pair
look-ups, the last link, the tombstones, the inserts) go straight to this thread's
`sqlite3` connection (`ledger.backends.sqlite.SQLiteRecorder._driver`).

WAL checkpoints do not run on the thread: SQLite's automatic checkpoint (at a commit,
about every 1,000 pages) would hold up every transaction queued behind that commit
(measured: one checkpoint at load 4-5 held six audits behind it for over a second).
The thread's connection has `wal_autocheckpoint=0`, and after a commit a PASSIVE
checkpoint is asked of a second thread with a connection of its own, at most one at a
time and one per `CHECKPOINT_EVERY_S`: it copies what the WAL holds into the database
while writers go on (a PASSIVE checkpoint takes no write lock), as the automatic one
would have, only not in the writers' way. A commit that comes within that second is
not dropped: the thread runs one more checkpoint when the second is up, so the WAL is
copied out whenever the writes pause, and the next write starts it over.

Under writes that never pause, no PASSIVE checkpoint on another thread ever finds the
WAL fully copied when a transaction begins, and only then does SQLite start the WAL
over (at that transaction's first write, if no reader still reads an older part): the
file grew without end (a 100k-item LangGraph load left 1 GB of WAL beside a 370 MB
database, docs/benchmarks.md, "The WAL starts over"). So when a checkpoint finds the
WAL holding `RESTART_FRAMES` frames or more, the background thread runs its
checkpoints one after another instead of one a second, and the writing thread, before
its next transaction (at most once per `CHECKPOINT_EVERY_S`), runs a TRUNCATE
checkpoint: it copies the little the background ones left, waits at most
`CATCH_UP_WAIT_MS` for readers still in the WAL, and starts the WAL over with its file
cut to nothing. (Leaving the start-over to the next transaction, as SQLite does when a
transaction begins on a fully copied WAL, lost the race with the background thread's
next checkpoint on a quiet machine: 593 MB of WAL after the 100k-item load.) Where the
writing thread itself starts the WAL over, `journal_size_limit` cuts the file back to
`WAL_LIMIT_BYTES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar, cast

from sqlalchemy import create_engine
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DatabaseError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.pool import NullPool

from ledger.backends.sqlite import PRAGMAS, file_path
from ledger.recorder import Turn, raise_translated
from ledger.vault import Vault, attach

T = TypeVar("T")

#: At most one background WAL checkpoint per this many seconds (module doc).
CHECKPOINT_EVERY_S: Final = 1.0
#: A checkpoint that finds the WAL holding this many frames (64 MiB of 4 KiB pages) has
#: the writing thread finish it before the next transaction, which starts the WAL over.
RESTART_FRAMES: Final = 16_384
#: The size the WAL file is cut back to when it starts over (`journal_size_limit`).
WAL_LIMIT_BYTES: Final = 64 << 20
#: How long the writing thread's catch-up waits for readers still in the WAL (and for
#: another process's writer) before it leaves the WAL as it is until the next one.
CATCH_UP_WAIT_MS: Final = 20


class SyncBacked:
    """The part of `AsyncConnection` the projections use (execute, exec_driver_sql,
    scalar, run_sync, begin_nested, dialect), over a synchronous `Connection`: every
    awaitable completes at once, so a coroutine using it never suspends."""

    def __init__(self, sync: Connection) -> None:
        self.sync_connection = sync

    @property
    def dialect(self) -> Any:
        """The connection's dialect (the vault's result processors read it)."""
        return self.sync_connection.dialect

    async def execute(self, statement: Any, parameters: Any = None, *,
                      execution_options: Any = None) -> Any:
        """`Connection.execute`; the result is read as an async one is."""
        return self.sync_connection.execute(statement, parameters,
                                            execution_options=execution_options)

    async def exec_driver_sql(self, statement: str, parameters: Any = None,
                              execution_options: Any = None) -> Any:
        """`Connection.exec_driver_sql` (`?` parameters; a list of them: executemany)."""
        return self.sync_connection.exec_driver_sql(statement, parameters,
                                                    execution_options=execution_options)

    async def scalar(self, statement: Any, parameters: Any = None) -> Any:
        """The first column of the first row."""
        return self.sync_connection.scalar(statement, parameters)

    async def run_sync(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(sync_connection, ...)`, as `AsyncConnection.run_sync` calls it."""
        return fn(self.sync_connection, *args, **kwargs)

    @contextlib.asynccontextmanager
    async def begin_nested(self) -> AsyncIterator[Any]:
        """A savepoint for the block, rolled back if it raises."""
        with self.sync_connection.begin_nested() as sp:
            yield sp

    def in_transaction(self) -> bool:
        """Whether a transaction is open (always, inside `InlineWrites.run`)."""
        return self.sync_connection.in_transaction()

    def get_execution_options(self) -> Any:
        """The connection's execution options."""
        return self.sync_connection.get_execution_options()


def _engine(path: str, vault: Any) -> Engine:
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)

    @sa_event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we choose the BEGIN (as the recorder does)
        for pragma in PRAGMAS:
            dbapi_conn.execute(f"PRAGMA {pragma}")
        # checkpoints run on the checkpointer's thread, never at this thread's commits
        dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")
        dbapi_conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")

    @sa_event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    attach(engine.dialect, vault)
    return engine


class InlineWrites:
    """Write transactions on one SQLite file, each run in one hand-off to a dedicated
    thread that owns a plain `sqlite3` connection (kept open between transactions, so
    its statement and page caches stay warm)."""

    def __init__(self, path: str, vault: Vault | None, turn: Turn | None) -> None:
        self.path = path
        self.vault = vault
        self.turn = turn
        self._pid = os.getpid()
        self._pool: ThreadPoolExecutor | None = None
        self._engine: Engine | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._checkpoints = Checkpointer(path)

    @classmethod
    def of(cls, url: str, vault: Vault | None, turn: Turn | None) -> InlineWrites | None:
        """Inline write transactions for a SQLite file URL; None for any other."""
        path = file_path(url) if url.startswith("sqlite") else None
        return None if path is None else cls(path, vault, turn)

    async def run(self, body: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """Run `body` in one write transaction (committed if it returns, rolled back if
        it raises), on the dedicated thread; awaited here in one hand-off. `body` gets
        a `SyncBacked` connection (typed as the `AsyncConnection` it stands for)."""
        if self._pid != os.getpid():  # a forked child never uses its parent's thread
            self._pool, self._engine, self._conn, self._loop = None, None, None, None
            self._checkpoints = Checkpointer(self.path)
            self._pid = os.getpid()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="memledger-views")
        loop = asyncio.get_running_loop()
        turn = self.turn
        if turn is None:
            return await loop.run_in_executor(self._pool, self._transaction, body)
        async with turn.hold():
            return await loop.run_in_executor(self._pool, self._transaction, body)

    def _transaction(self, body: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """On the dedicated thread: BEGIN IMMEDIATE, `body`, COMMIT."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.current_thread()
        try:
            if self._conn is None:
                if self._engine is None:
                    self._engine = _engine(self.path, self.vault)
                self._conn = self._engine.connect()
            conn = self._conn
            self._checkpoints.catch_up()
            try:
                with conn.begin():
                    out = self._loop.run_until_complete(_call(body, SyncBacked(conn)))
                self._checkpoints.soon()
                return out
            finally:
                if conn.invalidated or conn.closed:
                    self._drop()
        except (DatabaseError, OSError) as e:
            raise_translated(e)

    def _drop(self) -> None:
        """Forget the connection after a database error (the next run opens another)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _close_here(self) -> None:
        self._drop()
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    async def close(self) -> None:
        """Close the connection and stop the thread (a later `run` starts them again)."""
        pool, self._pool = self._pool, None
        if pool is None or self._pid != os.getpid():
            return
        await asyncio.get_running_loop().run_in_executor(pool, self._close_here)
        pool.shutdown(wait=False)
        await self._checkpoints.close()


class Checkpointer:
    """PASSIVE WAL checkpoints of one SQLite file on a thread of its own (module doc):
    `soon()` asks for one; it runs at once unless one ran less than
    `CHECKPOINT_EVERY_S` ago, else when that time is up. `catch_up()` is the writing
    thread's own, when the WAL does not start over.

    The thread is a daemon: a process that exits without `close` does not wait for a
    checkpoint (an interrupted one loses nothing: the WAL is durable and the next
    connection checkpoints it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        self._cond = threading.Condition()  # `_due`, `_closing`, `_thread`
        self._busy = threading.Lock()  # held while a checkpoint runs, on either thread
        self._thread: threading.Thread | None = None
        self._due = False  # a commit since the last checkpoint began
        self._closing = False
        self._last = float("-inf")
        self._caught = float("-inf")
        self._wait_ms = -1  # the checkpoint connection's busy timeout, as last set
        #: the last checkpoint found `RESTART_FRAMES` frames or more in the WAL
        self.restart_due = False
        #: checkpoints run (what the tests read)
        self.runs = 0

    def soon(self) -> None:
        """Called after a commit, on the writing thread; never waits."""
        with self._cond:
            self._due = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name="memledger-checkpoint")
                self._thread.start()
            else:
                self._cond.notify()

    def _work(self) -> None:
        """The thread: a checkpoint per `CHECKPOINT_EVERY_S` while commits ask for them
        (the last commit's included: it waits for its turn, not dropped; at `close` it
        runs at once), one after another while the WAL does not start over. Ends at
        `close`, and after a quiet minute."""
        while True:
            with self._cond:
                while not self._due:
                    if self._closing or not self._cond.wait(60.0):
                        self._thread = None
                        return
                # past RESTART_FRAMES: one after another, so that little is left
                # for the writing thread's `catch_up`
                wait = (0.0 if self._closing or self.restart_due
                        else self._last + CHECKPOINT_EVERY_S - time.monotonic())
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                self._due = False
                self._last = time.monotonic()
            frames = self._checkpoint()
            if frames is not None:
                self.restart_due = frames >= RESTART_FRAMES

    def catch_up(self) -> None:
        """On the writing thread, before a transaction: if the WAL is not starting over
        (`restart_due`), a TRUNCATE checkpoint (waiting for a running one): it copies
        what the background ones left, waits up to `CATCH_UP_WAIT_MS` for readers still
        in the WAL, and starts the WAL over itself, its file cut to nothing. At most
        once per `CHECKPOINT_EVERY_S`: a long reader (a backup, another process) keeps
        it from finishing, and the writer does not pay that wait per transaction."""
        if not self.restart_due:
            return
        now = time.monotonic()
        if now - self._caught < CHECKPOINT_EVERY_S:
            return
        self._caught = now
        self.restart_due = False
        self._checkpoint("TRUNCATE", CATCH_UP_WAIT_MS)

    def _checkpoint(self, mode: str = "PASSIVE", wait_ms: int = 30_000) -> int | None:
        """One checkpoint (`mode`, waiting up to `wait_ms` where the mode waits); the
        frames the WAL held (None if it could not run: a later commit asks again,
        nothing is lost, the WAL only waits longer)."""
        with self._busy:
            try:
                if self._db is None:
                    self._db = sqlite3.connect(self.path, isolation_level=None,
                                               check_same_thread=False)
                    self._wait_ms = -1
                db = self._db
                if wait_ms != self._wait_ms:  # set when it changes, not per checkpoint
                    db.execute(f"PRAGMA busy_timeout={wait_ms}")
                    self._wait_ms = wait_ms
                row = db.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
            except sqlite3.Error:
                self._drop_db()
                return None
            self.runs += 1
            return int(row[1])

    def _drop_db(self) -> None:
        """(`_busy` held.) Close the checkpoint connection (the next one opens another)."""
        db, self._db = self._db, None
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()

    async def close(self) -> None:
        """Run the checkpoint a commit asked for at once (or let a running one finish),
        then close its connection and end its thread (a later `soon` starts another)."""
        with self._cond:
            thread = self._thread
            self._closing = True
            self._cond.notify()
        try:
            if thread is not None:
                await asyncio.get_running_loop().run_in_executor(None, thread.join)
            with self._busy:
                self._drop_db()
        finally:
            with self._cond:
                self._closing = False


async def _call(body: Callable[[AsyncConnection], Awaitable[T]], conn: SyncBacked) -> T:
    return await body(cast(AsyncConnection, conn))
