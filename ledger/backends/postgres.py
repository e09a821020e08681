"""The PostgreSQL recorder (asyncpg).

Every append transaction takes `LOCK TABLE events IN EXCLUSIVE MODE` (with a lock
timeout), so insert order equals commit order and a poller reading
`position > checkpoint` never skips a late committer; a session stuck in a transaction
is ended by the server (`idle_in_transaction_session_timeout`) so it cannot pin the
projections behind its snapshot; after an erasure the content tables are vacuumed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, ClassVar, Final

import structlog
from sqlalchemy import Select, String, Table, Text, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DatabaseError, DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql.dml import Insert

from ledger import schema as t
from ledger.recorder import (
    EVENT_COLUMNS,
    IntegrityReport,
    Recorder,
    WriteLock,
    raise_translated,
    short_error,
)

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
                         "lexical_docs", "mem_history")
#: SQLSTATEs that mean "this role may not run amcheck here", not "the data is damaged".
_NOT_PERMITTED: Final = ("42501", "0A000", "58P01", "42883")
#: A table's statistics are refreshed once it has gained this many rows, and at least
#: `STATS_GROWTH` times the rows it held when they were last gathered.
STATS_MIN_ROWS: Final = 1000
STATS_GROWTH: Final = 1.0
#: How long a statistics refresh waits for a table lock before giving up for now.
STATS_LOCK_TIMEOUT: Final = "2s"
_INSERT_EVENTS: Final = (f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) "
                         f"VALUES ({', '.join(f'${i + 1}' for i in range(len(EVENT_COLUMNS)))})")
_BTREE_INDEXES: Final = text(
    "SELECT ic.relname FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid "
    "JOIN pg_class tc ON tc.oid = i.indrelid JOIN pg_am am ON am.oid = ic.relam "
    "WHERE tc.relname = ANY(:tables) AND am.amname = 'btree' "
    "AND pg_table_is_visible(tc.oid) ORDER BY ic.relname")


class PostgresRecorder(Recorder):
    """PostgreSQL: a server, a connection pool, many writers queued on its locks."""

    name: ClassVar[str] = "postgresql"
    integrity_check_name: ClassVar[str] = "postgresql amcheck"
    insert_events_sql: ClassVar[str | None] = _INSERT_EVENTS

    def __init__(self, url: str, *, pool_size: int = 5) -> None:
        super().__init__(url, pool_size=pool_size)
        #: Per table: rows written since its statistics were gathered, and the rows it
        #: held then (read from `pg_class` the first time a table is counted).
        self._grown: dict[str, int] = {}
        self._analyzed_rows: dict[str, float] = {}

    def create_engine(self, pool_size: int) -> AsyncEngine:
        return create_async_engine(
            self.url, pool_size=pool_size, max_overflow=10, pool_pre_ping=True,
            connect_args={"server_settings": {
                # A stuck session must not pin the projections behind its snapshot.
                "idle_in_transaction_session_timeout": str(IDLE_IN_TRANSACTION_MS),
                "application_name": "memledger",
            }},
        )

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
        try:
            async with self.engine.connect() as c0:
                yield await c0.execution_options(isolation_level="AUTOCOMMIT")
        except (DatabaseError, OSError) as e:
            raise_translated(e)

    async def lock_events(self, conn: AsyncConnection) -> None:
        await conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
        await conn.execute(text("LOCK TABLE events IN EXCLUSIVE MODE"))

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
        try:
            async with self.engine.connect() as c0:
                conn = await c0.execution_options(isolation_level="AUTOCOMMIT")
                if unknown:
                    await self._read_reltuples(conn, unknown)
                for name in names:
                    self._grown[name] = self._grown.get(name, 0) + rows
                    if self._grown[name] >= max(STATS_MIN_ROWS,
                                                STATS_GROWTH * self._analyzed_rows[name]):
                        due.append(name)
                if not due:
                    return
                await conn.execute(text(f"SET lock_timeout = '{STATS_LOCK_TIMEOUT}'"))
                await conn.exec_driver_sql(f"ANALYZE {', '.join(due)}")
                await conn.execute(text("RESET lock_timeout"))
                await self._read_reltuples(conn, due)
                for name in due:
                    self._grown[name] = 0
        except DBAPIError as e:
            # Statistics speed plans up; a refresh that cannot run now (a lock held
            # too long, a role that may not) is retried after the next writes.
            log.warning("statistics_refresh_failed", tables=due, error=short_error(e))

    async def _read_reltuples(self, conn: AsyncConnection, names: list[str]) -> None:
        q = text("SELECT relname, reltuples FROM pg_class WHERE relname = ANY(:names) "
                 "AND relkind = 'r' AND pg_table_is_visible(oid)")
        got = {r[0]: float(r[1]) for r in (await conn.execute(q, {"names": names})).all()}
        for name in names:
            # -1: never analyzed (PostgreSQL 14+); 0 before that.
            self._analyzed_rows[name] = max(0.0, got.get(name, 0.0))

    async def dead_row_counts(self, conn: AsyncConnection) -> dict[str, int]:
        q = text("SELECT relname, n_dead_tup FROM pg_stat_user_tables "
                 "WHERE relname = ANY(:names)")
        return {r[0]: int(r[1]) for r in
                (await conn.execute(q, {"names": list(CONTENT_TABLES)})).all()}


def _sqlstate(e: DBAPIError) -> str | None:
    """The SQLSTATE of a driver error (asyncpg's, through SQLAlchemy's adapter)."""
    code = getattr(e.orig, "sqlstate", None) or getattr(e.orig, "pgcode", None)
    return str(code) if code is not None else None
