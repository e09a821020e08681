"""The SQLite recorder (aiosqlite): the embedded default.

WAL, a busy timeout, secure delete, `BEGIN IMMEDIATE` for write transactions (SQLite
has one write lock per database, so its write transactions are serial and need no
other lock), and after an erasure a WAL checkpoint that truncates the log, so the
erased bytes are gone from the files.

Write turns (`Store(..., write_turns=True)`, what the worker daemons use): hand
SQLite's write lock from one process to the next at once.

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
lock waiters itself: only SQLite files take turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import operator
import os
import queue
import sqlite3
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar, Final

import orjson
from sqlalchemy import Table
from sqlalchemy import event as sa_event
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError, DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.sql.dml import Insert

from ledger.events import MEMORY_WRITES
from ledger.recorder import (
    EVENT_COLUMNS,
    EVENT_TUPLE,
    LAST_LINK_SQL,
    TOMBSTONE_COLUMNS,
    IntegrityReport,
    Recorder,
    TombstoneRow,
    WriteLock,
    link_of,
    raise_translated,
)
from ledger.schema import LEXICAL_VOCAB_DDL

PRAGMAS: Final = ("busy_timeout=30000", "journal_mode=WAL", "synchronous=NORMAL",
                  "secure_delete=ON", "foreign_keys=ON")
#: How long a writer waits for its turn before going ahead without it.
TURN_TIMEOUT_S: Final = 30.0
#: How often `reclaim` tries a truncating checkpoint that another one kept busy, and
#: how long it waits between tries.
RECLAIM_TRIES: Final = 50
RECLAIM_WAIT_S: Final = 0.02
#: The turn file: the database's path plus this.
TURN_SUFFIX: Final = "-turn"
#: The lock file a schema migration holds: the database's path plus this.
MIGRATE_SUFFIX: Final = "-migrate"
_INSERT_EVENTS: Final = (f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) "
                         f"VALUES ({', '.join('?' for _ in EVENT_COLUMNS)})")
#: The append path's statements on the inline thread's plain `sqlite3` connection
#: (`SQLiteRecorder._driver`): fixed SQL text, so `sqlite3` prepares each once per
#: connection (its statement cache), and the pairs go as one JSON array (`json_each`)
#: whatever their number. `CROSS JOIN` keeps the array as the outer loop, so each pair
#: is one look-up in the table's index on `(tenant, ...)`.
_PAIRS_JOIN: Final = ("FROM json_each(?) AS k CROSS JOIN {table} AS e "
                      "ON e.tenant = json_extract(k.value, '$[0]') "
                      "AND e.{column} = json_extract(k.value, '$[1]')")
_KNOWN_KEYS: Final = ("SELECT e.tenant, e.idempotency_key, e.content_digest, e.position, "
                      "e.suppressed " + _PAIRS_JOIN.format(table="events",
                                                          column="idempotency_key"))
_MEMORY_WRITERS: Final = (
    "SELECT e.tenant, e.memory_id, e.ns_path "
    + _PAIRS_JOIN.format(table="events", column="memory_id")
    + " WHERE e.type IN (" + ", ".join(f"'{t}'" for t in sorted(MEMORY_WRITES)) + ")")
_TASK_OWNERS: Final = ("SELECT e.tenant, e.task_key, e.ns_path "
                       + _PAIRS_JOIN.format(table="task_owners", column="task_key"))
_INSERT_TOMBSTONES: Final = (f"INSERT INTO tombstones ({', '.join(TOMBSTONE_COLUMNS)}) "
                             f"VALUES ({', '.join('?' for _ in TOMBSTONE_COLUMNS)})")
_TOMBSTONE_TUPLE: Final = operator.itemgetter(*TOMBSTONE_COLUMNS)
#: `select_tombstones` by (tenants given, upto given).
_SELECT_TOMBSTONES: Final = {
    (tenants, upto): f"SELECT {', '.join(TOMBSTONE_COLUMNS)} FROM tombstones"
    + " AND ".join(([" WHERE tenant IN (SELECT value FROM json_each(?))"] if tenants else [])
                   + ([("" if tenants else " WHERE ") + "position <= ?"] if upto else []))
    for tenants in (False, True) for upto in (False, True)}



class SQLiteRecorder(Recorder):
    """SQLite: one file (or `:memory:`), one writer at a time."""

    name: ClassVar[str] = "sqlite"
    integrity_check_name: ClassVar[str] = "sqlite quick_check, integrity_check"
    insert_events_sql: ClassVar[str | None] = _INSERT_EVENTS

    def __init__(self, url: str, *, pool_size: int = 5, write_turns: bool = False) -> None:
        super().__init__(url, pool_size=pool_size)
        path = turn_path(url) if write_turns else None
        self.turn = WriteTurn(path) if path is not None else None
        db = file_path(url)
        self._points = PointReads(db) if db is not None else None

    def point_reads(self) -> PointReads | None:
        """Plain `sqlite3` reads on the calling thread, for file databases."""
        return self._points

    # -- the append path on the inline thread's own connection ------------------------------
    @staticmethod
    def _driver(conn: Any) -> sqlite3.Connection | None:
        """The plain `sqlite3` connection under a connection of the inline thread
        (`ledger.inline.SyncBacked`, inside its transaction), else None: an
        `AsyncConnection` of the async driver takes the generic statements."""
        if isinstance(conn, AsyncConnection):
            return None
        sync = getattr(conn, "sync_connection", None)
        raw = getattr(getattr(sync, "connection", None), "driver_connection", None)
        return raw if isinstance(raw, sqlite3.Connection) else None

    async def insert_events(self, conn: AsyncConnection, rows: Sequence[dict[str, Any]]
                            ) -> None:
        db = self._driver(conn)
        if db is None:
            await super().insert_events(conn, rows)
            return
        if self.vault is not None:
            self.vault.seal_rows(rows)
        with _driver_errors(_INSERT_EVENTS):
            db.executemany(_INSERT_EVENTS, map(EVENT_TUPLE, rows))

    async def insert_tombstones(self, conn: AsyncConnection,
                                rows: Sequence[dict[str, Any]]) -> None:
        db = self._driver(conn)
        if db is None:
            await super().insert_tombstones(conn, rows)
            return
        with _driver_errors(_INSERT_TOMBSTONES):
            db.executemany(_INSERT_TOMBSTONES, map(_TOMBSTONE_TUPLE, rows))

    async def select_tombstones(self, conn: AsyncConnection,
                                tenants: Iterable[str] | None = None,
                                upto: int | None = None) -> Sequence[Any]:
        db = self._driver(conn)
        if db is None:
            return await super().select_tombstones(conn, tenants, upto)
        params: list[Any] = []
        if tenants is not None:
            params.append(_json_array(sorted(set(tenants))))
        if upto is not None:
            params.append(upto)
        sql = _SELECT_TOMBSTONES[(tenants is not None, upto is not None)]
        with _driver_errors(sql):
            return [TombstoneRow._make(r) for r in db.execute(sql, params).fetchall()]

    async def known_keys(self, conn: AsyncConnection, keys: Sequence[tuple[str, str]]
                         ) -> list[tuple[str, str, str, int, bool]]:
        db = self._driver(conn)
        if db is None:
            return await super().known_keys(conn, keys)
        return [(r[0], r[1], r[2], int(r[3]), bool(r[4]))
                for r in _pairs(db, _KNOWN_KEYS, keys)]

    async def memory_writers(self, conn: AsyncConnection, ids: Sequence[tuple[str, str]]
                             ) -> list[tuple[str, str, str]]:
        db = self._driver(conn)
        if db is None:
            return await super().memory_writers(conn, ids)
        return [(r[0], r[1], r[2]) for r in _pairs(db, _MEMORY_WRITERS, ids)]

    async def task_owner_paths(self, conn: AsyncConnection, tasks: Sequence[tuple[str, str]]
                               ) -> list[tuple[str, str, str]]:
        db = self._driver(conn)
        if db is None:
            return await super().task_owner_paths(conn, tasks)
        return [(r[0], r[1], r[2]) for r in _pairs(db, _TASK_OWNERS, tasks)]

    async def last_link(self, conn: AsyncConnection) -> tuple[int, str]:
        db = self._driver(conn)
        if db is None:
            return await super().last_link(conn)
        with _driver_errors(LAST_LINK_SQL):
            last = db.execute(LAST_LINK_SQL).fetchone()
        return link_of(last)

    def create_engine(self, pool_size: int) -> AsyncEngine:
        engine = create_async_engine(self.url, poolclass=NullPool
                                     if ":memory:" in self.url else None)
        _install_hooks(engine)
        return engine

    async def lock_events(self, conn: AsyncConnection) -> None:
        return  # BEGIN IMMEDIATE (the `memledger_write` option) took the write lock

    async def begin_snapshot(self, conn: AsyncConnection) -> None:
        return  # a SQLite read transaction is a snapshot already

    async def keep_transaction_open(self, conn: AsyncConnection) -> None:
        return  # no server, no idle timeout

    async def advisory_lock(self, conn: AsyncConnection, lock: WriteLock) -> None:
        return  # write transactions are serial: BEGIN IMMEDIATE holds the one write lock

    @asynccontextmanager
    async def migration_lock(self, conn: AsyncConnection) -> AsyncIterator[None]:
        """An exclusive `flock` on a file beside the database (`-migrate`): each
        migration's BEGIN IMMEDIATE serialises its statements, but a second upgrader
        must also wait for the first to finish before it reads the revision."""
        db = turn_path(self.url)
        if db is None:  # in memory: one process only
            yield
            return
        path = db[: -len(TURN_SUFFIX)] + MIGRATE_SUFFIX
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def write(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A write transaction, in turn when write turns are on."""
        return self._write() if self.turn is None else self._in_turn(self._write())

    def view_write(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A view transaction, in turn when write turns are on."""
        return self._view_write() if self.turn is None else self._in_turn(self._view_write())

    @asynccontextmanager
    async def _in_turn(self, tx: AbstractAsyncContextManager[AsyncConnection]
                       ) -> AsyncIterator[AsyncConnection]:
        assert self.turn is not None
        async with self.turn.hold(), tx as conn:
            yield conn

    async def dispose(self) -> None:
        """Close the connection pool, the point-read connections, then the turn file."""
        await super().dispose()
        if self._points is not None:
            self._points.close()
        if self.turn is not None:
            self.turn.close()

    def read_once(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """No explicit transaction (a single SELECT is atomic in SQLite), which saves
        two round trips to the driver thread."""
        return self._read_once()

    @asynccontextmanager
    async def _read_once(self) -> AsyncIterator[AsyncConnection]:
        try:
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(memledger_no_begin=True)
                yield conn
        except (DatabaseError, OSError) as e:
            raise_translated(e)

    async def after_import(self, conn: AsyncConnection) -> None:
        return  # a new integer key is the largest one plus one

    def insert_ignore(self, table: Table) -> Insert:
        return sqlite_insert(table).on_conflict_do_nothing()

    async def integrity_check(self, limit: int) -> IntegrityReport:
        """`PRAGMA quick_check` (every page and b-tree), then, if that is clean,
        `PRAGMA integrity_check` (also every index against its table). quick_check
        first because it lists damaged pages where integrity_check, reading an index
        through them, may only fail with "database disk image is malformed"."""
        rep = IntegrityReport(self.integrity_check_name)
        n = max(1, int(limit))
        async with self._read_once() as conn:
            for pragma in ("quick_check", "integrity_check"):
                rows = (await conn.exec_driver_sql(f"PRAGMA {pragma}({n})")).all()
                rep.problems = [line for r in rows
                                for line in str(r[0]).splitlines()
                                if line.strip() and str(r[0]) != "ok"
                                and not line.startswith("*** in database")]
                if rep.problems:
                    break
        return rep

    async def reclaim(self) -> None:
        """Move the WAL into the main file and truncate it (with secure_delete on, the
        erased bytes are then gone from the files).

        A checkpoint another connection is running (an inline thread's PASSIVE one,
        `ledger.inline.Checkpointer`, or another process's) makes this one return busy
        at once, without the busy timeout: it is tried again, for up to
        `RECLAIM_TRIES` short waits, until SQLite says the log was truncated."""
        async with self._read_once() as conn:
            for _ in range(RECLAIM_TRIES):
                row = (await conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")).first()
                if row is None or not row[0]:
                    return
                await asyncio.sleep(RECLAIM_WAIT_S)

    async def compact(self) -> None:
        async with self.engine.connect() as c0:
            conn = await c0.execution_options(memledger_no_begin=True)
            await conn.exec_driver_sql("VACUUM")
            await conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    async def note_growth(self, tables: Iterable[str], rows: int) -> None:
        """Nothing to refresh: SQLite serves `col IN (...)` from an index on `col`
        whatever its statistics say (and the bulk paths never rely on them)."""

    async def erasure_leftovers(self) -> list[dict[str, Any]]:
        """A WAL that still holds page images, or secure_delete off (file databases)."""
        if ":memory:" in self.url:
            return []
        out: list[dict[str, Any]] = []
        await self.reclaim()
        wal = database_files(self.url)[1]
        if wal.exists() and wal.stat().st_size > 0:
            out.append({"place": str(wal),
                        "detail": "the WAL still holds page images (another connection kept "
                                  "a read snapshot open); run again when it is idle"})
        async with self._read_once() as c:
            sd = (await c.exec_driver_sql("PRAGMA secure_delete")).scalar()
        if not sd:
            out.append({"place": "sqlite", "detail": "PRAGMA secure_delete is off"})
        return out


#: Bumped in a forked child: a child never uses its parent's connections (os.getpid()
#: per read would cost a system call).
_FORKS = [0]
os.register_at_fork(after_in_child=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


class _Held:
    """A thread's point-read connection (a holder, since a sqlite3 connection cannot be
    referenced weakly): freed, and so closed, when its thread ends."""

    __slots__ = ("__weakref__", "conn", "forks", "generation")

    def __init__(self, conn: sqlite3.Connection, generation: int) -> None:
        self.conn = conn
        self.generation = generation
        self.forks = _FORKS[0]


class PointReads:
    """Single SELECTs on a plain `sqlite3` connection of the calling thread.

    The point reads (`get` and the store adapter's look-ups) take 15-40 us in SQLite;
    through SQLAlchemy async and aiosqlite's worker thread each statement costs five
    hand-offs between threads (check-out, execute, fetch, reset, return), several
    hundred microseconds, most of it waiting for a CPU on a busy machine. Run inline,
    the statement blocks the event loop for less time than one hand-off costs.

    Each thread has its own connection (opened on first use, `query_only`, never
    writing). Nothing is cached above SQLite: every call is a fresh autocommit
    statement, so it sees every transaction committed before it, by this process or
    another, a forget's tombstone included (R20). Rows are fetched to the end, so no
    statement keeps a read snapshot (or the WAL) pinned between calls. The busy
    timeout is zero: where SQLite would make a reader wait (recovering a WAL after a
    crash), `rows` returns None at once and the caller takes the async path, which
    waits in the driver's thread instead of blocking the event loop. A forked child
    opens its own connections; it never uses its parent's.
    """

    def __init__(self, path: str) -> None:
        self.uri = Path(path).absolute().as_uri() + "?mode=rw"  # never creates the file
        self._local = threading.local()
        self._generation = 0
        self._open: weakref.WeakSet[_Held] = weakref.WeakSet()
        self._mutex = threading.Lock()

    def _connection(self) -> sqlite3.Connection:
        held: _Held | None = getattr(self._local, "held", None)
        if held is not None and held.generation == self._generation \
                and held.forks == _FORKS[0]:
            return held.conn
        conn = sqlite3.connect(self.uri, uri=True, isolation_level=None,
                               check_same_thread=False, cached_statements=64)
        conn.execute("PRAGMA busy_timeout=0")
        # Before query_only: a TEMP view of the full-text index's vocabulary (recall's
        # frequent-term look-up); it writes nothing to the database file.
        with contextlib.suppress(sqlite3.Error):
            conn.execute(LEXICAL_VOCAB_DDL)
        conn.execute("PRAGMA query_only=ON")
        held = _Held(conn, self._generation)
        with self._mutex:
            self._open.add(held)
        self._local.held = held
        return conn

    def rows(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]] | None:
        """Every row of one SELECT, or None if SQLite could not run it now (busy, no
        file, damaged: the async path then runs it and reports what is wrong)."""
        try:
            return self._connection().execute(sql, params).fetchall()
        except sqlite3.Error:
            return None

    def close(self) -> None:
        """Close every thread's connection (a later call opens a new one)."""
        with self._mutex:
            self._generation += 1
            held, self._open = list(self._open), weakref.WeakSet()
        for h in held:
            if h.forks == _FORKS[0]:
                with contextlib.suppress(sqlite3.Error):
                    h.conn.close()


def _json_array(items: Sequence[Any]) -> str:
    """A JSON array of strings (or pairs of them) for `json_each`: the append path's
    strings are valid text without NUL (validation), so they round-trip exactly."""
    return orjson.dumps(items).decode()


def _pairs(db: sqlite3.Connection, sql: str, pairs: Sequence[tuple[str, str]]
           ) -> list[Any]:
    """The rows of one of the append path's pair look-ups (none for no pairs)."""
    if not pairs:
        return []
    with _driver_errors(sql):
        return db.execute(sql, (_json_array(pairs),)).fetchall()


@contextlib.contextmanager
def _driver_errors(statement: str) -> Iterator[None]:
    """`sqlite3` errors of a statement run on the driver's connection, as the SQLAlchemy
    errors the same statement through the engine raises (so a damaged file is still
    `DatabaseCorrupt` and a busy one `StoreUnavailable`: `raise_translated`)."""
    try:
        yield
    except sqlite3.Error as e:
        raise DBAPIError.instance(statement, None, e, sqlite3.Error) from e


def file_path(url: str) -> str | None:
    """The file of a plain SQLite file URL; None for PostgreSQL, in-memory databases,
    `file:` URIs and URLs with query options (their connections are not ours to copy)."""
    u = make_url(url)
    if not u.drivername.startswith("sqlite") or u.query:
        return None
    db = u.database or ""
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return db


def database_files(url: str) -> list[Path]:
    """The database file of a SQLite URL and its WAL."""
    path = url.split(":///", 1)[1].split("?", 1)[0]
    return [Path(path + suffix) for suffix in ("", "-wal")]


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
    return db + TURN_SUFFIX


def _install_hooks(engine: AsyncEngine) -> None:
    """WAL, a busy timeout, secure delete, and BEGIN IMMEDIATE for write transactions.

    pysqlite's own transaction handling is switched off (SQLAlchemy's documented recipe)
    so we choose the BEGIN: a deferred transaction that reads and then writes fails with
    SQLITE_BUSY_SNAPSHOT under WAL instead of waiting, so writers take the lock first.
    """

    @sa_event.listens_for(engine.sync_engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        for pragma in PRAGMAS:
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @sa_event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: Any) -> None:
        opts = conn.get_execution_options()
        if opts.get("memledger_no_begin", False):
            return  # autocommit: each statement is its own transaction
        conn.exec_driver_sql("BEGIN IMMEDIATE" if opts.get("memledger_write", False) else "BEGIN")
