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
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql.dml import Insert

from ledger.recorder import Recorder, WriteLock

#: Advisory lock ids, one per `WriteLock`.
ADVISORY_LOCK_IDS: Final = {WriteLock.SCHEMA: 7231001, WriteLock.DEAD_LETTERS: 7231006}
#: Milliseconds a session may sit idle inside a transaction before the server ends it.
IDLE_IN_TRANSACTION_MS: Final = 60000
LOCK_TIMEOUT: Final = "30s"
#: The tables that hold (or held) content an erasure removes.
CONTENT_TABLES: Final = ("events", "mem_versions", "task_notes", "tasks_view", "vectors")


class PostgresRecorder(Recorder):
    """PostgreSQL: a server, a connection pool, many writers queued on its locks."""

    name: ClassVar[str] = "postgresql"

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
