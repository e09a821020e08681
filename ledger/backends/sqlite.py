"""The SQLite recorder (aiosqlite): the embedded default.

WAL, a busy timeout, secure delete, `BEGIN IMMEDIATE` for write transactions (SQLite
has one write lock per database, so its write transactions are serial and need no
other lock), and after an erasure a WAL checkpoint that truncates the log, so the
erased bytes are gone from the files.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar, Final

from sqlalchemy import Table
from sqlalchemy import event as sa_event
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.sql.dml import Insert

from ledger.errors import StoreUnavailable
from ledger.recorder import EVENT_COLUMNS, Recorder, WriteLock, short_error

PRAGMAS: Final = ("busy_timeout=30000", "journal_mode=WAL", "synchronous=NORMAL",
                  "secure_delete=ON", "foreign_keys=ON")
_INSERT_EVENTS: Final = (f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) "
                         f"VALUES ({', '.join('?' for _ in EVENT_COLUMNS)})")


class SQLiteRecorder(Recorder):
    """SQLite: one file (or `:memory:`), one writer at a time."""

    name: ClassVar[str] = "sqlite"

    def create_engine(self, pool_size: int) -> AsyncEngine:
        engine = create_async_engine(self.url, poolclass=NullPool
                                     if ":memory:" in self.url else None)
        _install_hooks(engine)
        return engine

    async def lock_events(self, conn: AsyncConnection) -> None:
        return  # BEGIN IMMEDIATE (the `memledger_write` option) took the write lock

    async def begin_snapshot(self, conn: AsyncConnection) -> None:
        return  # a SQLite read transaction is a snapshot already

    async def keep_snapshot_open(self, conn: AsyncConnection) -> None:
        return  # no server, no idle timeout

    async def advisory_lock(self, conn: AsyncConnection, lock: WriteLock) -> None:
        return  # write transactions are serial: BEGIN IMMEDIATE holds the one write lock

    @asynccontextmanager
    async def read_once(self) -> AsyncIterator[AsyncConnection]:
        """No explicit transaction (a single SELECT is atomic in SQLite), which saves
        two round trips to the driver thread."""
        try:
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(memledger_no_begin=True)
                yield conn
        except (OperationalError, OSError) as e:
            raise StoreUnavailable(f"ledger database unavailable: {short_error(e)}") from e

    async def insert_events(self, conn: AsyncConnection, rows: Sequence[dict[str, Any]]
                            ) -> None:
        # SQLAlchemy's per-row parameter processing cost ~10 us a row here; the driver
        # takes plain tuples in column order (no type needs converting).
        await conn.exec_driver_sql(_INSERT_EVENTS, [
            tuple(r[c] for c in EVENT_COLUMNS) for r in rows])

    async def after_import(self, conn: AsyncConnection) -> None:
        return  # a new integer key is the largest one plus one

    def insert_ignore(self, table: Table) -> Insert:
        return sqlite_insert(table).on_conflict_do_nothing()

    async def reclaim(self) -> None:
        """Move the WAL into the main file and truncate it (with secure_delete on, the
        erased bytes are then gone from the files)."""
        async with self.engine.connect() as conn:
            await conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            await conn.commit()

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
        async with self.engine.connect() as c:
            sd = (await c.exec_driver_sql("PRAGMA secure_delete")).scalar()
        if not sd:
            out.append({"place": "sqlite", "detail": "PRAGMA secure_delete is off"})
        return out


def database_files(url: str) -> list[Path]:
    """The database file of a SQLite URL and its WAL."""
    path = url.split(":///", 1)[1].split("?", 1)[0]
    return [Path(path + suffix) for suffix in ("", "-wal")]


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
