"""The PostgreSQL recorder (asyncpg).

Every append transaction takes `LOCK TABLE events IN EXCLUSIVE MODE` (with a lock
timeout), so insert order equals commit order and a poller reading
`position > checkpoint` never skips a late committer; a session stuck in a transaction
is ended by the server (`idle_in_transaction_session_timeout`) so it cannot pin the
projections behind its snapshot; after an erasure the content tables are vacuumed.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from sqlalchemy import Select, String, Table, Text, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql.dml import Insert

from ledger import schema as t
from ledger.recorder import IntegrityReport, Recorder, WriteLock, short_error

#: Advisory lock ids, one per `WriteLock`.
ADVISORY_LOCK_IDS: Final = {WriteLock.SCHEMA: 7231001, WriteLock.DEAD_LETTERS: 7231006}
#: Milliseconds a session may sit idle inside a transaction before the server ends it.
IDLE_IN_TRANSACTION_MS: Final = 60000
LOCK_TIMEOUT: Final = "30s"
#: The tables that hold (or held) content an erasure removes.
CONTENT_TABLES: Final = ("events", "mem_versions", "task_notes", "tasks_view", "vectors",
                         "lexical_docs")
#: SQLSTATEs that mean "this role may not run amcheck here", not "the data is damaged".
_NOT_PERMITTED: Final = ("42501", "0A000", "58P01", "42883")
_BTREE_INDEXES: Final = text(
    "SELECT ic.relname FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid "
    "JOIN pg_class tc ON tc.oid = i.indrelid JOIN pg_am am ON am.oid = ic.relam "
    "WHERE tc.relname = ANY(:tables) AND am.amname = 'btree' "
    "AND pg_table_is_visible(tc.oid) ORDER BY ic.relname")


class PostgresRecorder(Recorder):
    """PostgreSQL: a server, a connection pool, many writers queued on its locks."""

    name: ClassVar[str] = "postgresql"
    integrity_check_name: ClassVar[str] = "postgresql amcheck"

    def create_engine(self, pool_size: int) -> AsyncEngine:
        return create_async_engine(
            self.url, pool_size=pool_size, max_overflow=10, pool_pre_ping=True,
            connect_args={"server_settings": {
                # A stuck session must not pin the projections behind its snapshot.
                "idle_in_transaction_session_timeout": str(IDLE_IN_TRANSACTION_MS),
                "application_name": "memledger",
            }},
        )

    async def lock_events(self, conn: AsyncConnection) -> None:
        await conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
        await conn.execute(text("LOCK TABLE events IN EXCLUSIVE MODE"))

    async def begin_snapshot(self, conn: AsyncConnection) -> None:
        await conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))

    async def keep_transaction_open(self, conn: AsyncConnection) -> None:
        await conn.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))

    async def advisory_lock(self, conn: AsyncConnection, lock: WriteLock) -> None:
        await conn.execute(text(f"SELECT pg_advisory_xact_lock({ADVISORY_LOCK_IDS[lock]})"))

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

    async def dead_row_counts(self, conn: AsyncConnection) -> dict[str, int]:
        q = text("SELECT relname, n_dead_tup FROM pg_stat_user_tables "
                 "WHERE relname = ANY(:names)")
        return {r[0]: int(r[1]) for r in
                (await conn.execute(q, {"names": list(CONTENT_TABLES)})).all()}


def _sqlstate(e: DBAPIError) -> str | None:
    """The SQLSTATE of a driver error (asyncpg's, through SQLAlchemy's adapter)."""
    code = getattr(e.orig, "sqlstate", None) or getattr(e.orig, "pgcode", None)
    return str(code) if code is not None else None
