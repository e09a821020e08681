"""The PostgreSQL recorder (asyncpg).

Every append transaction takes `LOCK TABLE events IN EXCLUSIVE MODE` (with a lock
timeout), so insert order equals commit order and a poller reading
`position > checkpoint` never skips a late committer; a session stuck in a transaction
is ended by the server (`idle_in_transaction_session_timeout`) so it cannot pin the
projections behind its snapshot; after an erasure the content tables are vacuumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Final, cast

import asyncpg
import structlog
from sqlalchemy import Select, String, Table, Text, event, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import (
    DatabaseError,
    DBAPIError,
    DisconnectionError,
    IntegrityError,
    ProgrammingError,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql.dml import Insert

from ledger import schema as t
from ledger.errors import StoreUnavailable
from ledger.events import MEMORY_WRITES
from ledger.recorder import (
    EVENT_COLUMNS,
    EVENT_TUPLE,
    LAST_LINK_SQL,
    STORED_COLUMNS,
    TOMBSTONE_COLUMNS,
    IntegrityReport,
    Recorder,
    TombstoneRow,
    WriteLock,
    link_of,
    raise_translated,
    short_error,
)
from ledger.records import StoredEvent, stored_from_row
from ledger.vault import open_columns, seal_columns

log = structlog.get_logger("memledger.ledger")

#: Advisory lock ids, one per `WriteLock`.
ADVISORY_LOCK_IDS: Final = {WriteLock.SCHEMA: 7231001, WriteLock.DEAD_LETTERS: 7231006}
#: Advisory lock classes (two-key form `(class, n)`) of the sharded projections: a worker
#: holds `(SHARD_LEASE_LOCK, shard)` while it owns a shard and `(WORKER_MEMBER_LOCK, id)`
#: while it takes part in sharing them (`workers.leases`); both end with its session.
SHARD_LEASE_LOCK: Final = 7231100
WORKER_MEMBER_LOCK: Final = 7231101
_HOLDERS: Final = text(
    "SELECT l.objid, l.pid, a.application_name FROM pg_locks l "
    "LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.classid = :cls AND l.objsubid = 2 AND l.granted "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())")


async def advisory_holders(conn: AsyncConnection, lock_class: int) -> dict[int, str]:
    """Who holds the advisory locks of a class in this database: `{n: application name}`
    (the session's `application_name`, else `pid <n>`)."""
    rows = (await conn.execute(_HOLDERS, {"cls": lock_class})).all()
    return {int(r[0]): str(r[2] or f"pid {r[1]}") for r in rows}


#: The session-level advisory lock a schema migration holds (`migration_lock`).
MIGRATION_LOCK_ID: Final = 7231010
#: Milliseconds a session may sit idle inside a transaction before the server ends it.
IDLE_IN_TRANSACTION_MS: Final = 60000
LOCK_TIMEOUT: Final = "30s"
#: The tables that hold (or held) content an erasure removes.
CONTENT_TABLES: Final = ("events", "mem_versions", "task_notes", "tasks_view", "vectors",
                         "lexical_docs", "dead_letters", "mem_history")
#: SQLSTATEs that mean "this role may not run amcheck here", not "the data is damaged".
_NOT_PERMITTED: Final = ("42501", "0A000", "58P01", "42883")
#: A table's statistics are refreshed once it has gained this many rows, and at least
#: `STATS_GROWTH` times the rows it held when they were last gathered.
STATS_MIN_ROWS: Final = 1000
STATS_GROWTH: Final = 1.0
#: The columns whose statistics a refresh gathers, for tables where plans depend on a
#: few of them: `events`' filter and join columns. Its content, digest, link and
#: source columns are never filtered on, and sorting their sampled values by the
#: database collation was more than half of each `ANALYZE events` (which runs inside
#: the append path, under the ledger's lock). Other tables: every column.
STATS_COLUMNS: Final = {"events": ("position", "tenant", "type", "slot", "memory_id",
                                   "ns_path", "mkey", "layer", "task_key", "recorded_at",
                                   "order_key", "suppressed")}
#: How long a statistics refresh waits for a table lock before giving up for now.
STATS_LOCK_TIMEOUT: Final = "2s"
#: The append path's look-ups, one statement each whatever the number of pairs: the
#: pairs go as two arrays (`unnest`), so the SQL never changes (asyncpg prepares it
#: once per connection) and no `IN` list of hundreds of parameters is rendered.
_KNOWN_KEYS: Final = (
    "SELECT e.tenant, e.idempotency_key, e.content_digest, e.position, e.suppressed "
    "FROM unnest($1::text[], $2::text[]) AS k(tenant, idem) "
    "JOIN events e ON e.tenant = k.tenant AND e.idempotency_key = k.idem")
_MEMORY_WRITERS: Final = (
    "SELECT e.tenant, e.memory_id, e.ns_path "
    "FROM unnest($1::text[], $2::text[]) AS k(tenant, memory_id) "
    "JOIN events e ON e.tenant = k.tenant AND e.memory_id = k.memory_id "
    "WHERE e.type = ANY($3::text[])")
_TASK_OWNERS: Final = (
    "SELECT o.tenant, o.task_key, o.ns_path "
    "FROM unnest($1::text[], $2::text[]) AS k(tenant, task_key) "
    "JOIN task_owners o ON o.tenant = k.tenant AND o.task_key = k.task_key")
#: `select_events`' statement: the columns of `ledger.recorder.STORED_COLUMNS`, in their
#: order; one text per shape (with an upper bound, with types), sent as it is (asyncpg
#: prepares it once per connection).
_STORED_NAMES: Final = ", ".join(c.name for c in STORED_COLUMNS)
_SELECT_EVENTS: Final = {
    (upto, typed): f"SELECT {_STORED_NAMES} FROM events WHERE position > $1"
                   + (" AND position <= $3" if upto else "")
                   + (f" AND type = ANY(${4 if upto else 3}::varchar[])" if typed else "")
                   + " ORDER BY position LIMIT $2"
    for upto in (False, True) for typed in (False, True)}
#: The sealed column of those rows (`events.payload`, read with its key id), by index.
_STORED_SEALED: Final = tuple((i, c.type) for i, c in enumerate(STORED_COLUMNS)
                              if c.name == "payload")
#: `lock_events`' two statements in one (a DO block runs as one statement in the
#: transaction: the setting and the table lock both last until it ends).
_LOCK_EVENTS: Final = text(
    "DO $$ BEGIN PERFORM set_config('lock_timeout', '" + LOCK_TIMEOUT + "', true); "
    "LOCK TABLE events IN EXCLUSIVE MODE; END $$")
#: `select_tombstones` by (tenants given, upto given).
_SELECT_TOMBSTONES: Final = {
    (tenants, upto): f"SELECT {', '.join(TOMBSTONE_COLUMNS)} FROM tombstones"
    + (" WHERE " if tenants or upto else "")
    + " AND ".join((["tenant = ANY($1::text[])"] if tenants else [])
                   + ([f"position <= ${2 if tenants else 1}"] if upto else []))
    for tenants in (False, True) for upto in (False, True)}



_BTREE_INDEXES: Final = text(
    "SELECT ic.relname FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid "
    "JOIN pg_class tc ON tc.oid = i.indrelid JOIN pg_am am ON am.oid = ic.relam "
    "WHERE tc.relname = ANY(:tables) AND am.amname = 'btree' "
    "AND pg_table_is_visible(tc.oid) ORDER BY ic.relname")


def _drop_closed(dbapi_conn: Any, record: Any, proxy: Any) -> None:
    """At checkout: a connection whose socket has closed is discarded (the pool then
    connects anew, as `pool_pre_ping` would after its failed ping, without a round trip).

    The closing is seen once the event loop has read it; a backend killed in the
    instant between checkout and the statement still fails that statement, which the
    pool answers by discarding every connection older than the failure, so the next
    request gets a new one (`raise_translated` reports the failure as transient)."""
    if dbapi_conn.driver_connection.is_closed():
        raise DisconnectionError("the server closed this pooled connection")


class _RetryOnce:
    """A `read_once` connection that tries a statement once more, on a new connection,
    when its connection turns out dead (`connection_invalidated`: the server restarted
    or ended the backend after `_drop_closed` let it through). A `read_once` statement
    runs alone in autocommit and only reads, so running it again is safe; the second
    failure is the caller's (`StoreUnavailable`). Everything but the statement verbs
    goes to the connection itself."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.conn: AsyncConnection | None = None
        self._spare: AsyncConnection | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        assert self.conn is not None
        try:
            return await self.conn.execute(*args, **kwargs)
        except DBAPIError as e:
            if not e.connection_invalidated or self._spare is not None:
                raise
            log.info("pg.read_retry", error=short_error(e))
        self._spare = await self.engine.connect()
        self.conn = await self._spare.execution_options(isolation_level="AUTOCOMMIT")
        return await self.conn.execute(*args, **kwargs)

    async def scalar(self, *args: Any, **kwargs: Any) -> Any:
        return (await self.execute(*args, **kwargs)).scalar()

    async def scalars(self, *args: Any, **kwargs: Any) -> Any:
        return (await self.execute(*args, **kwargs)).scalars()

    async def close_spare(self) -> None:
        if self._spare is not None:
            await self._spare.close()


#: Driver errors that mean the connection failed, not the statement: the server ended
#: the backend (57P01 and the rest of class 57), the connection broke (class 08), the
#: socket closed under the client, or the client's protocol state was left broken by
#: the server's unsolicited FATAL message (`InternalClientError`, "another operation is
#: in progress", seen when a backend is ended while its connection idles).
_CONNECTION_LOST: Final = (asyncpg.PostgresConnectionError,
                           asyncpg.exceptions.OperatorInterventionError,
                           asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError,
                           OSError)
#: `random_page_cost` of memledger's sessions (`SERVER_SETTINGS`).
RANDOM_PAGE_COST: Final = "1.1"
#: Settings of every memledger session (the pool's and `DriverReads`').
SERVER_SETTINGS: Final = {
    # A stuck session must not pin the projections behind its snapshot.
    "idle_in_transaction_session_timeout": str(IDLE_IN_TRANSACTION_MS),
    "application_name": "memledger",
    # The planner's price of a random page read against a sequential one (default 4, a
    # spinning disk's). A batch looks up hundreds of keys; at the default, hashing a
    # whole view looked cheaper than that many index probes until the view held
    # several hundred thousand rows, so each batch read the whole view (a cost growing
    # with the ledger: docs/operations.md, "PostgreSQL: planner statistics"). 1.1, the usual
    # value for SSDs and for data in memory, keeps those look-ups on their indexes.
    "random_page_cost": RANDOM_PAGE_COST,
}


class DriverReads:
    """Point reads (`get`) awaited on plain asyncpg connections of their own.

    Through SQLAlchemy a point read paid for a pool checkout and return (with their
    events and reset), the statement's compiled-cache look-up and parameter
    processing, a result object and its row processing: a few hundred microseconds
    of Python against the server's 30-100, and on a loaded machine each extra slice
    of CPU is another chance to be preempted (get p50 4.6 ms vs 0.18 ms for asyncpg's
    prepared SELECT at load 6). Here a statement is one `fetch` on an idle connection:
    asyncpg prepares it once per connection (its statement cache) and reuses it.

    At most `limit` connections are opened (lazily); when all are busy, `rows`
    returns None and the caller takes the pooled `read_once` path. Every statement runs
    alone in autocommit, so it sees every commit made before it, by any process (a
    forget's tombstone included, R20): nothing is cached above the server but the
    statement's plan. A connection the server ended (a restart, `pg_terminate_backend`)
    is dropped at the first sight of it; a statement that fails because its connection
    was lost is run once more on a newly opened one, and a second loss is
    `StoreUnavailable`, as on `read_once`. Any other error of the statement gives None
    (the `read_once` path then runs it and reports the error as every read does). The
    connections belong to one event loop and one process: another loop or a forked
    child opens its own.
    """

    def __init__(self, connect: Callable[[], Awaitable[Any]], limit: int) -> None:
        self._connect = connect
        self._limit = max(1, limit)
        self._idle: list[Any] = []
        self._busy = 0
        self._generation = 0
        self._owner: tuple[int, asyncio.AbstractEventLoop] | None = None

    async def rows(self, sql: str, params: Sequence[Any]) -> list[Any] | None:
        owner = (os.getpid(), asyncio.get_running_loop())
        if self._owner != owner:
            if self._owner is not None and self._owner[0] == owner[0]:
                self._abandon()  # another loop of this process: its sockets are not ours
            self._idle, self._busy, self._owner = [], 0, owner
            self._generation += 1
        conn = None
        while self._idle and conn is None:
            conn = self._idle.pop()
            if conn.is_closed():  # the client has seen the server end it
                conn = None
        if conn is None and self._busy >= self._limit:
            return None
        self._busy += 1
        generation = self._generation
        try:
            for attempt in (0, 1):
                if conn is None:
                    try:
                        conn = await self._connect()
                    except (asyncpg.PostgresError, TimeoutError, *_CONNECTION_LOST) as e:
                        if attempt:
                            raise StoreUnavailable(
                                f"ledger database unavailable: {short_error(e)}") from e
                        return None  # the pooled path connects and reports
                try:
                    return await conn.fetch(sql, *params)  # type: ignore[no-any-return]
                except _CONNECTION_LOST as e:
                    _terminate(conn)
                    conn = None
                    if attempt:
                        raise StoreUnavailable(
                            f"ledger database unavailable: {short_error(e)}") from e
                    log.info("pg.read_retry", error=short_error(e))
                except asyncpg.PostgresError:
                    return None
            raise AssertionError("unreachable")
        except BaseException:
            # Cancelled or failed mid-statement: the connection's state is unknown.
            if conn is not None:
                _terminate(conn)
                conn = None
            raise
        finally:
            if self._owner == owner and self._generation == generation:
                self._busy -= 1
                if conn is not None and not conn.is_closed():
                    self._idle.append(conn)
            elif conn is not None:
                _terminate(conn)

    def _abandon(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            _terminate(conn)

    async def close(self) -> None:
        """Close the idle connections; busy ones close when their statement ends (a
        later call opens new ones)."""
        idle, self._idle = self._idle, []
        self._generation += 1
        self._busy = 0
        owner = self._owner
        self._owner = None
        if owner is None or owner[0] != os.getpid():
            return
        for conn in idle:
            try:
                await asyncio.wait_for(conn.close(), 2)
            except (TimeoutError, RuntimeError, *_CONNECTION_LOST):
                _terminate(conn)


def _terminate(conn: Any) -> None:
    """Drop a driver connection at once (no round trip; its loop may be gone)."""
    with contextlib.suppress(Exception):
        conn.terminate()


class PostgresRecorder(Recorder):
    """PostgreSQL: a server, a connection pool, many writers queued on its locks."""

    name: ClassVar[str] = "postgresql"
    integrity_check_name: ClassVar[str] = "postgresql amcheck"

    def __init__(self, url: str, *, pool_size: int = 5) -> None:
        super().__init__(url, pool_size=pool_size)
        #: Per table: rows written since its statistics were gathered, and the rows it
        #: held then (read from `pg_class` the first time a table is counted).
        self._grown: dict[str, int] = {}
        self._analyzed_rows: dict[str, float] = {}
        #: Per table: the server's count of ANALYZEs of it (manual and automatic) when
        #: this recorder last read its size: a change means another process gathered
        #: its statistics since (`note_growth`).
        self._analyses: dict[str, int] = {}
        self._driver_reads = DriverReads(self._driver_connect, pool_size)

    async def insert_events(self, conn: AsyncConnection, rows: Sequence[dict[str, Any]]
                            ) -> None:
        """Sealed event rows go to the server by `COPY ... FROM STDIN` (binary) on the
        write transaction's own asyncpg connection: one stream for the whole group
        instead of `executemany`'s bind and execute per row (about a third of the time
        raw asyncpg takes to `executemany` the same rows). The same transaction, under
        the same lock; the unique keys are checked as for an INSERT."""
        if self.vault is not None:
            self.vault.seal_rows(rows)
        if not rows:
            return
        driver = await _driver_of(conn)
        async with _driver_errors(conn, "COPY events"):
            await driver.copy_records_to_table(
                "events", records=list(map(EVENT_TUPLE, rows)), columns=EVENT_COLUMNS)

    async def write_rows(self, conn: AsyncConnection, table: Table,
                         rows: Sequence[dict[str, Any]], *, ignore: bool = False) -> None:
        """View rows go to the write transaction's own asyncpg connection as tuples:
        by `COPY ... FROM STDIN` (binary), or, to skip existing keys (`ignore`) or for a
        few rows, as one `INSERT ... SELECT FROM unnest(<one array per column>)`. Either
        is one statement for the whole batch instead of an `executemany`, and skips
        SQLAlchemy's per-row parameter processing, which cost more than the server's
        insert (docs/benchmarks.md, "PostgreSQL projection, set-based (issue 20)").
        Sealed view columns are sealed first, as their column types would."""
        if not rows:
            return
        driver = await _driver_of(conn)
        if not driver.is_in_transaction():
            # Outside a transaction the driver would commit on its own: only the
            # generic path keeps SQLAlchemy's transaction rules.
            await super().write_rows(conn, table, rows, ignore=ignore)
            return
        plan = _row_plan(table)
        records = list(map(plan.values, seal_columns(table, rows, conn.dialect)))
        if ignore or len(records) < COPY_MIN_ROWS:
            sql = plan.unnest_ignore if ignore else plan.unnest
            async with _driver_errors(conn, sql):
                await driver.execute(sql, *map(list, zip(*records, strict=True)))
        else:
            async with _driver_errors(conn, f"COPY {table.name}"):
                await driver.copy_records_to_table(table.name, records=records,
                                                   columns=plan.columns)

    async def select_events(self, conn: AsyncConnection, after: int, limit: int,
                            upto: int | None = None, types: Sequence[str] | None = None
                            ) -> list[StoredEvent]:
        """The generic statement's rows, sent as driver SQL (`_SELECT_EVENTS`): the same
        columns, no compiled statement and no per-row type processing (a batch's read
        of 1,000 events spent about as long in SQLAlchemy's result rows as in decoding
        them); the payload is opened here as its column type would open it."""
        params: list[Any] = [after, limit]
        if upto is not None:
            params.append(upto)
        if types is not None:
            params.append(list(types))
        sql = _SELECT_EVENTS[(upto is not None, types is not None)]
        rows: Sequence[Sequence[Any]] = (await conn.exec_driver_sql(sql, tuple(params))).all()
        if self.vault is not None and rows:
            rows = open_columns(rows, _STORED_SEALED, conn.dialect)
        return [stored_from_row(r) for r in rows]

    async def known_keys(self, conn: AsyncConnection, keys: Sequence[tuple[str, str]]
                         ) -> list[tuple[str, str, str, int, bool]]:
        if not keys:
            return []
        rows = await self._pairs(conn, _KNOWN_KEYS, keys)
        return [(r[0], r[1], r[2], int(r[3]), bool(r[4])) for r in rows]

    async def memory_writers(self, conn: AsyncConnection, ids: Sequence[tuple[str, str]]
                             ) -> list[tuple[str, str, str]]:
        if not ids:
            return []
        rows = await self._pairs(conn, _MEMORY_WRITERS, ids, sorted(MEMORY_WRITES))
        return [(r[0], r[1], r[2]) for r in rows]

    async def task_owner_paths(self, conn: AsyncConnection, tasks: Sequence[tuple[str, str]]
                               ) -> list[tuple[str, str, str]]:
        if not tasks:
            return []
        return [(r[0], r[1], r[2]) for r in await self._pairs(conn, _TASK_OWNERS, tasks)]

    @staticmethod
    async def _pairs(conn: AsyncConnection, sql: str, pairs: Sequence[tuple[str, str]],
                     *more: Any) -> Sequence[Any]:
        """One of the append path's look-ups: a prepared statement on the write
        transaction's own asyncpg connection (as `last_link`), past SQLAlchemy's
        cursor and result rows."""
        firsts = [p[0] for p in pairs]
        seconds = [p[1] for p in pairs]
        driver = await _driver_of(conn)
        if not driver.is_in_transaction():
            return (await conn.exec_driver_sql(sql, (firsts, seconds, *more))).all()
        async with _driver_errors(conn, sql):
            return await driver.fetch(sql, firsts, seconds, *more)  # type: ignore[no-any-return]

    def driver_reads(self) -> DriverReads:
        """Point reads on plain asyncpg connections (`DriverReads`)."""
        return self._driver_reads

    async def _driver_connect(self) -> Any:
        """A plain asyncpg connection to the engine's database, with its settings."""
        args, kw = self.engine.dialect.create_connect_args(self.engine.url)
        for adapter_only in ("prepared_statement_cache_size", "prepared_statement_name_func",
                             "async_creator_fn"):
            kw.pop(adapter_only, None)
        kw.setdefault("timeout", 10)
        return await asyncpg.connect(*args, **kw, server_settings=dict(SERVER_SETTINGS))

    async def dispose(self) -> None:
        """Close the point-read connections, then the pool."""
        await self._driver_reads.close()
        await super().dispose()

    def create_engine(self, pool_size: int) -> AsyncEngine:
        # No `pool_pre_ping`: its round trip per checkout cost about 40% of a point read.
        # A pooled connection whose server side went away (a restart, a terminated
        # backend) is known without asking the server: asyncpg's protocol sees the
        # socket close while the connection idles in the pool (the event loop reads every
        # pooled socket), so `_drop_closed` swaps it for a fresh one at checkout.
        engine = create_async_engine(
            self.url, pool_size=pool_size, max_overflow=10,
            connect_args={"server_settings": dict(SERVER_SETTINGS)},
        )
        event.listen(engine.sync_engine.pool, "checkout", _drop_closed)
        return engine

    shard_leases: ClassVar[bool] = True

    async def lease_holders(self, conn: AsyncConnection, lock_class: int) -> dict[int, str]:
        return await advisory_holders(conn, lock_class)
    def read_once(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """Autocommit: one statement reads one snapshot by itself, so the BEGIN, the
        SET TRANSACTION and the COMMIT of `read` (three round trips, most of a point
        read's time) are saved."""
        return self._read_once()

    @asynccontextmanager
    async def _read_once(self) -> AsyncIterator[AsyncConnection]:
        retrying = _RetryOnce(self.engine)
        try:
            async with self.engine.connect() as c0:
                retrying.conn = await c0.execution_options(isolation_level="AUTOCOMMIT")
                yield cast(AsyncConnection, retrying)
        except (DatabaseError, OSError) as e:
            if isinstance(e, DBAPIError) and e.connection_invalidated:
                raise StoreUnavailable(f"ledger database unavailable: {short_error(e)}") from e
            raise_translated(e)
        finally:
            await retrying.close_spare()

    async def lock_events(self, conn: AsyncConnection) -> None:
        """`SET LOCAL lock_timeout` then `LOCK TABLE events IN EXCLUSIVE MODE`, as one
        statement (`_LOCK_EVENTS`: one round trip where two statements took two; both
        hold to the end of the transaction, as they did)."""
        await conn.execute(_LOCK_EVENTS)

    async def last_link(self, conn: AsyncConnection) -> tuple[int, str]:
        """The last link by one prepared statement on the driver's connection."""
        driver = await _driver_of(conn)
        if not driver.is_in_transaction():
            return await super().last_link(conn)
        async with _driver_errors(conn, LAST_LINK_SQL):
            last = await driver.fetchrow(LAST_LINK_SQL)
        return link_of(last)

    async def select_tombstones(self, conn: AsyncConnection,
                                tenants: Iterable[str] | None = None,
                                upto: int | None = None) -> Sequence[Any]:
        """One prepared statement on the driver's connection (the tenants as an array,
        so the SQL never changes), rows as `TombstoneRow`s."""
        args: list[Any] = []
        if tenants is not None:
            args.append(sorted(set(tenants)))
        if upto is not None:
            args.append(upto)
        sql = _SELECT_TOMBSTONES[(tenants is not None, upto is not None)]
        driver = await _driver_of(conn)
        if not driver.is_in_transaction():
            # not begun yet (SQLAlchemy begins at its first statement), or autocommit
            return await super().select_tombstones(conn, tenants, upto)
        async with _driver_errors(conn, sql):
            rows = await driver.fetch(sql, *args)
        return [TombstoneRow(*r) for r in rows]

    async def insert_tombstones(self, conn: AsyncConnection,
                                rows: Sequence[dict[str, Any]]) -> None:
        """As view rows are written: one statement on the driver's connection."""
        await self.write_rows(conn, t.tombstones, rows)

    async def begin_snapshot(self, conn: AsyncConnection) -> None:
        await conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))

    async def keep_transaction_open(self, conn: AsyncConnection) -> None:
        await conn.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))

    async def advisory_lock(self, conn: AsyncConnection, lock: WriteLock) -> None:
        await conn.execute(text(f"SELECT pg_advisory_xact_lock({ADVISORY_LOCK_IDS[lock]})"))

    @asynccontextmanager
    async def migration_lock(self, conn: AsyncConnection) -> AsyncIterator[None]:
        """A session-level advisory lock: it outlives the transaction of each migration
        (a transaction-level one would end with the first), and the server drops it
        if the process dies. A second upgrader waits here, then finds nothing to do."""
        await conn.execute(text(f"SELECT pg_advisory_lock({MIGRATION_LOCK_ID})"))
        await conn.commit()
        try:
            yield
        finally:
            if conn.in_transaction():
                await conn.rollback()
            await conn.execute(text(f"SELECT pg_advisory_unlock({MIGRATION_LOCK_ID})"))
            await conn.commit()

    async def after_import(self, conn: AsyncConnection) -> None:
        await conn.execute(text(
            "SELECT setval(pg_get_serial_sequence('dead_letters', 'id'), "
            "COALESCE(MAX(id), 1), MAX(id) IS NOT NULL) FROM dead_letters"))

    def insert_ignore(self, table: Table) -> Insert:
        return pg_insert(table).on_conflict_do_nothing()

    def for_update(self, q: Select[Any]) -> Select[Any]:
        return q.with_for_update()

    def bytewise(self, column: Any) -> Any:
        """PostgreSQL sorts text by the database collation; `COLLATE "C"` makes it
        bytewise, which is how SQLite sorts (BINARY)."""
        if isinstance(column.type, String | Text):
            return column.collate("C")
        return column

    async def integrity_check(self, limit: int) -> IntegrityReport:
        """amcheck: `verify_heapam` on each memledger table and `bt_index_check` (every
        heap tuple indexed) on each of their indexes.

        The extension is created if missing (`CREATE EXTENSION IF NOT EXISTS amcheck`,
        which needs a role allowed to); where it cannot be created or its functions may
        not be run by this role, the report says so and is not a failure."""
        rep = IntegrityReport(self.integrity_check_name)
        tables = sorted(t.metadata.tables)
        async with self.engine.connect() as c0:
            conn = await c0.execution_options(isolation_level="AUTOCOMMIT")
            try:
                await conn.execute(text("CREATE EXTENSION IF NOT EXISTS amcheck"))
                indexes = [r[0] for r in
                           (await conn.execute(_BTREE_INDEXES, {"tables": tables})).all()]
                for table in tables:
                    rows = (await conn.execute(text(
                        "SELECT blkno, offnum, msg FROM verify_heapam("
                        "to_regclass(quote_ident(:rel)), on_error_stop => false) "
                        "LIMIT :n"), {"rel": table, "n": limit})).all()
                    rep.problems += [f"table {table} block {r[0]} item {r[1]}: {r[2]}"
                                     for r in rows]
                for index in indexes:
                    try:
                        await conn.execute(text(
                            "SELECT bt_index_check(to_regclass(quote_ident(:rel)), true)"),
                            {"rel": index})
                    except DBAPIError as e:
                        if _sqlstate(e) in _NOT_PERMITTED:
                            raise
                        rep.problems.append(f"index {index}: {short_error(e.orig or e)}")
            except DBAPIError as e:
                if _sqlstate(e) not in _NOT_PERMITTED:
                    raise
                return IntegrityReport(
                    rep.check, available=False,
                    note=f"amcheck cannot run for this role here ({short_error(e.orig or e)}); "
                         "install it as a superuser (CREATE EXTENSION amcheck) and grant "
                         "its functions to check tables and indexes")
        rep.problems = rep.problems[:limit]
        return rep

    async def reclaim(self) -> None:
        """VACUUM the tables that held the content, so dead row versions are reclaimed
        now rather than at autovacuum's leisure (their bytes may still sit in WAL
        archives: docs/forgetting.md)."""
        async with self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.exec_driver_sql(f"VACUUM {', '.join(CONTENT_TABLES)}")

    async def compact(self) -> None:
        async with self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.exec_driver_sql(f"VACUUM FULL {', '.join(CONTENT_TABLES)}")
    async def note_growth(self, tables: Iterable[str], rows: int) -> None:
        """ANALYZE the tables that have doubled since their statistics were taken.

        Without statistics (a fresh table: autovacuum looks at it about once a minute)
        the planner takes `col IN (400 values)` to match the whole table and scans it,
        so each projection batch read every view row: quadratic. Refreshing at geometric
        steps keeps the statistics within a factor of the truth for O(log n) ANALYZEs,
        each of which reads a bounded sample of the table."""
        names = list(tables)
        if rows <= 0 or not names:
            return
        unknown = [n for n in names if n not in self._analyzed_rows]
        due: list[str] = []
        for name in names:
            self._grown[name] = self._grown.get(name, 0) + rows
        if not unknown and not self._due(names):
            return  # the common case: no connection, no statement
        try:
            async with self.engine.connect() as c0:
                conn = await c0.execution_options(isolation_level="AUTOCOMMIT")
                if unknown:
                    await self._read_reltuples(conn, unknown)
                due = self._due(names)
                known = [n for n in due if n not in unknown]
                if known:
                    # Due by this process's count; but another process (a runner of
                    # other shards, a bulk load, autovacuum, an operator) may have
                    # gathered them since, on a table that grew without this process:
                    # then the server's size and its rows changed since that ANALYZE
                    # decide, and a refresh of a large table is not repeated for nothing.
                    await self._read_reltuples(conn, known, adopt=True)
                    due = self._due(names)
                if not due:
                    return
                # One round trip (a simple-protocol query string, which the server runs
                # as one implicit transaction): if ANALYZE fails, its SET is rolled
                # back with it, so the pooled connection keeps its own lock_timeout.
                script = (f"SET lock_timeout = '{STATS_LOCK_TIMEOUT}'; ANALYZE " + ", ".join(
                    f"{n} ({', '.join(STATS_COLUMNS[n])})" if n in STATS_COLUMNS else n
                    for n in due) + "; RESET lock_timeout")
                driver = await _driver_of(conn)
                async with _driver_errors(conn, script):
                    await driver.execute(script)
                await self._read_reltuples(conn, due)
                for name in due:
                    self._grown[name] = 0
        except DBAPIError as e:
            # Statistics speed plans up; a refresh that cannot run now (a lock held
            # too long, a role that may not) is retried after the next writes.
            log.warning("statistics_refresh_failed", tables=due, error=short_error(e))

    def _due(self, names: list[str]) -> list[str]:
        """The tables (of those whose size is known) grown enough for an ANALYZE."""
        return [n for n in names if n in self._analyzed_rows and self._grown[n] >= max(
            STATS_MIN_ROWS, STATS_GROWTH * self._analyzed_rows[n])]

    async def _read_reltuples(self, conn: AsyncConnection, names: list[str], *,
                              adopt: bool = False) -> None:
        """Read the tables' sizes as of their last statistics (`pg_class.reltuples`)
        and the server's count of their ANALYZEs. With `adopt`, only for a table whose
        count moved since this recorder's last reading (another process analyzed it):
        its size then, and as its growth the rows changed since that ANALYZE
        (`n_mod_since_analyze`, which the server counts over every process)."""
        q = text("SELECT c.relname, c.reltuples, COALESCE(s.analyze_count "
                 "+ s.autoanalyze_count, 0), COALESCE(s.n_mod_since_analyze, 0) "
                 "FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid "
                 "WHERE c.relname = ANY(:names) AND c.relkind = 'r' "
                 "AND pg_table_is_visible(c.oid)")
        got = {r[0]: (float(r[1]), int(r[2]), int(r[3]))
               for r in (await conn.execute(q, {"names": names})).all()}
        for name in names:
            rows, analyses, changed = got.get(name, (0.0, 0, 0))
            if adopt:
                if analyses == self._analyses.get(name):
                    continue  # nobody else has: this recorder's count stands
                self._grown[name] = changed
            self._analyses[name] = analyses
            # -1: never analyzed (PostgreSQL 14+); 0 before that.
            self._analyzed_rows[name] = max(0.0, rows)

    async def dead_row_counts(self, conn: AsyncConnection) -> dict[str, int]:
        q = text("SELECT relname, n_dead_tup FROM pg_stat_user_tables "
                 "WHERE relname = ANY(:names)")
        return {r[0]: int(r[1]) for r in
                (await conn.execute(q, {"names": list(CONTENT_TABLES)})).all()}


#: Below this many rows `write_rows` sends one INSERT over arrays instead of a COPY,
#: whose protocol costs a second round trip (an audit row, a batch of few changes).
COPY_MIN_ROWS: Final = 32


@dataclass(frozen=True, slots=True)
class _RowPlan:
    """How `write_rows` sends one table's rows: column order, a dict-to-tuple getter, and
    the INSERTs over one array per column (plain and skipping existing keys)."""

    columns: tuple[str, ...]
    values: Callable[[dict[str, Any]], tuple[Any, ...]]
    unnest: str
    unnest_ignore: str


_ROW_PLANS: dict[str, _RowPlan] = {}


def _row_plan(table: Table) -> _RowPlan:
    got = _ROW_PLANS.get(table.name)
    if got is None:
        dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
        cols = tuple(c.name for c in table.c)
        arrays = ", ".join(f"${i}::{c.type.compile(dialect=dialect)}[]"
                           for i, c in enumerate(table.c, start=1))
        sql = f"INSERT INTO {table.name} ({', '.join(cols)}) SELECT * FROM unnest({arrays})"
        got = _ROW_PLANS[table.name] = _RowPlan(cols, operator.itemgetter(*cols), sql,
                                                sql + " ON CONFLICT DO NOTHING")
    return got


async def _driver_of(conn: AsyncConnection) -> Any:
    """The asyncpg connection under `conn` (in its transaction, once one has begun)."""
    raw = await conn.get_raw_connection()
    driver = raw.driver_connection
    assert driver is not None
    return driver


@asynccontextmanager
async def _driver_errors(conn: AsyncConnection, statement: str) -> AsyncIterator[None]:
    """Driver errors of a statement sent to asyncpg directly, as the SQLAlchemy errors
    the same statement through the engine raises (its asyncpg adapter's mapping: key
    violations are IntegrityError, syntax and access ProgrammingError, the rest of the
    server's errors DBAPIError); the quarantine tells an event's fault from the
    database's by them (`projections.quarantine.is_poison`)."""
    try:
        yield
    except asyncpg.IntegrityConstraintViolationError as e:
        raise IntegrityError(statement, None, e) from e
    except asyncpg.exceptions.SyntaxOrAccessError as e:
        raise ProgrammingError(statement, None, e) from e
    except _CONNECTION_LOST as e:
        await conn.invalidate()
        raise DBAPIError(statement, None, e, connection_invalidated=True) from e
    except asyncpg.PostgresError as e:
        raise DBAPIError(statement, None, e) from e


def _sqlstate(e: DBAPIError) -> str | None:
    """The SQLSTATE of a driver error (asyncpg's, through SQLAlchemy's adapter)."""
    code = getattr(e.orig, "sqlstate", None) or getattr(e.orig, "pgcode", None)
    return str(code) if code is not None else None
