"""The ledger store: the object callers hold to append events and read them back.

`Store` owns a recorder (`ledger.recorder`, one per backend in `ledger.backends`: the
engine, its transactions and every statement that writes `events`) and the append
path's queue: appends from many tasks are queued and written by one writer task in
shared transactions (group commit, `ledger.appender`), each request still atomic on
its own. On a SQLite file a group commit runs on a thread of its own over a plain
`sqlite3` connection (`ledger.inline`, `inline_appends`), where the recorder's
append statements go to that connection directly (`SQLiteRecorder._driver`).
The hash chain is `ledger.chain`; the values it returns are `ledger.records`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, TypeVar

import structlog
from sqlalchemy import LargeBinary, inspect, select, type_coerce
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import DatabaseError, DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.appender import GROUP_MAX_EVENTS, Appender, Request
from ledger.backends import recorder_for
from ledger.errors import MemledgerError, SchemaOutOfDate, StoreUnavailable
from ledger.events import Event
from ledger.forgets import Tombstone, tombstone_from_row
from ledger.inline import InlineWrites
from ledger.logs import configure_default
from ledger.recorder import WriteLock, raise_translated, short_error
from ledger.records import AppendResult, StoredEvent, now_iso
from ledger.register import ForgetRegister, default_register_path
from ledger.vault import SEALED_TYPES, KeyStore, attach, is_sealed, open_vault

configure_default()
log = structlog.get_logger("memledger.ledger")

DEFAULT_URL: Final = "sqlite+aiosqlite:///./memledger.db"
#: The ledger tables an append makes grow (`Recorder.note_growth`).
GROWING_TABLES: Final = ("events",)

T = TypeVar("T")


class Store:
    """The ledger database: append events, read them back, manage the schema."""

    def __init__(self, url: str | None = None, *, register_path: str | None = None,
                 pool_size: int = 5, write_turns: bool = False,
                 vault: bool | KeyStore | None = None,
                 clock: Callable[[], str] = now_iso, inline_appends: bool = True) -> None:
        """`write_turns`: write transactions take turns with other processes on the
        same SQLite file (`ledger.backends.sqlite.WriteTurn`; the worker daemons).

        `vault`: encrypt content under per-subject keys (`ledger.vault`): True, False,
        a `KeyStore`, or None for the setting `MEMLEDGER_VAULT`, and when that is not
        set the default (`ledger.vault.default_on`: on for a new SQLite file ledger and
        wherever the key store exists or `MEMLEDGER_VAULT_URL` names one).

        `clock` gives the recording time of an append (`events.recorded_at`, the axis
        of as-of reads): the UTC wall clock, RFC 3339 with microseconds; a test that
        replays a story as it happened sets its own.

        `inline_appends` (on by default): on a SQLite file, the append path's group
        commits run on a thread of their own with a plain `sqlite3` connection
        (`ledger.inline`), one hand-off per transaction instead of four per statement
        through aiosqlite, whether or not `use_inline` puts the other write
        transactions there too. Off, or on any other database: the async driver."""
        self.url = url or os.environ.get("MEMLEDGER_DB_URL") or DEFAULT_URL
        self.recorder = recorder_for(self.url, pool_size=pool_size, write_turns=write_turns)
        self.turn = self.recorder.turn
        #: The backend's name, `sqlite` or `postgresql`. What differs between the
        #: backends in the ledger is in `ledger.backends`, behind `self.recorder`.
        self.dialect = self.recorder.name
        self.engine = self.recorder.engine
        self.register = ForgetRegister(register_path or default_register_path(self.url))
        #: The vault (None: content is stored in clear). See `ledger.vault`.
        self.vault = open_vault(self.url, vault)
        self.recorder.vault = self.vault
        attach(self.engine.sync_engine.dialect, self.vault)
        self.clock = clock
        self._queue: list[Request] = []
        self._writer: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._listeners: list[Callable[[int], Any]] = []
        self._opened = False
        self._open_lock: asyncio.Lock | None = None
        #: The write transactions of `transaction` (appends, `Runner.round`'s view
        #: transaction, the recall audit) in one hand-off to a thread of their own
        #: (`ledger.inline`); None: through the async driver, statement by statement.
        #: `use_inline` turns it on.
        self.inline: InlineWrites | None = None
        #: Where the group commits run when `inline` is off (`inline_appends`).
        self._append_inline: InlineWrites | None = (
            InlineWrites.of(self.url, self.vault, self.turn) if inline_appends else None)

    def use_inline(self) -> bool:
        """Run write transactions on a thread of their own where the store is a SQLite
        file (`ledger.inline`); returns whether it is on. For a process that appends
        and projects in turn and waits for both (the LangGraph store)."""
        if self.inline is None:
            # the appends' thread, if they have one: a process's writes queue on one thread
            self.inline = self._append_inline or InlineWrites.of(self.url, self.vault,
                                                                 self.turn)
        return self.inline is not None

    # -- transactions (the recorder's) ----------------------------------------------------
    def write(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A write transaction that holds the ledger's write lock until it commits."""
        return self.recorder.write()

    def read(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A read transaction (one consistent snapshot on both backends)."""
        return self.recorder.read()

    def read_once(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for one statement: no explicit transaction on SQLite (a single
        SELECT is atomic there), which saves two round trips to the driver thread."""
        return self.recorder.read_once()

    def view_write(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A transaction for view updates: SQLite takes its write lock up front."""
        return self.recorder.view_write()

    async def transaction(self, body: Callable[[AsyncConnection], Awaitable[T]], *,
                          views: bool) -> T:
        """Run `body(conn)` in one write transaction and return what it returns: all
        of its writes commit when it returns, none when it raises (the error is raised
        here, as the transaction's context manager raises it).

        With inline writes on (`use_inline`, SQLite files) the whole transaction runs on
        the inline thread in one hand-off (`ledger.inline`): `BEGIN IMMEDIATE` on the
        one write lock, in turn when the store takes write turns, whatever `views`
        says (on SQLite a ledger write and a view write take the same lock). `body`
        then gets a `SyncBacked` connection and runs on that thread's own event loop,
        so it may await the connection and nothing else of the caller's loop (no
        other I/O, no lock or future of the caller's).

        Otherwise through the async driver: `views=False` is `write()` (the ledger's
        write lock: the append path), `views=True` is `view_write()` (the
        projections, the recall audit)."""
        if self.inline is not None:
            return await self.inline.run(body)
        tx = self.view_write() if views else self.write()
        async with tx as conn:
            return await body(conn)

    async def open(self) -> Store:
        """Create the schema of a new database (at the head revision) or check that an
        existing one is at the head revision; idempotent."""
        if self._opened:
            return self
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self._opened:
                return self
            try:
                async with self.engine.connect() as c0:
                    conn = await c0.execution_options(memledger_write=True)
                    await conn.begin()
                    await self.recorder.advisory_lock(conn, WriteLock.SCHEMA)
                    await conn.run_sync(self._ensure_schema)
                    row = (await conn.execute(
                        select(t.meta.c.value).where(t.meta.c.name == "schema_version")
                    )).first()
                    if row is None:
                        await conn.execute(t.meta.insert().values(
                            name="schema_version", value=str(t.SCHEMA_VERSION)))
                    if self.vault is None:
                        await self._warn_sealed_without_keys(conn)
                    await conn.commit()
            except (DatabaseError, OSError) as e:
                raise_translated(e, "cannot open ledger database")
            self._opened = True
        return self

    async def _warn_sealed_without_keys(self, conn: AsyncConnection) -> None:
        """Warn when a ledger opened without a vault holds sealed content (its newest
        content event is sealed): its content then reads as erased, as in a ledger
        restored from envelopes only, which is what a copy of the database without its
        key store (`<file>.vault`, `MEMLEDGER_VAULT_PATH`/`_URL`) looks like. One
        look-up by the position index."""
        ev = t.events.c
        blob = (await conn.execute(
            select(type_coerce(ev.payload, LargeBinary)).where(
                ev.type.in_(sorted(SEALED_TYPES)), ev.payload.is_not(None))
            .order_by(ev.position.desc()).limit(1))).scalar()
        if blob is not None and is_sealed(bytes(blob)):
            where = make_url(self.url).render_as_string(hide_password=True)
            log.warning("ledger holds sealed content but no key store is configured: "
                        "its content reads as erased", db=where,
                        hint="restore the key store beside the database (<file>.vault) "
                             "or set MEMLEDGER_VAULT_PATH / MEMLEDGER_VAULT_URL")

    def _ensure_schema(self, conn: Connection) -> None:
        """A new database is created at the head revision and stamped; any other
        revision is refused with the command that upgrades it (no silent migration:
        `MemoryLedger(migrate=True)` is the explicit opt-in)."""
        insp = inspect(conn)
        revision = None
        if insp.has_table(t.alembic_version.name):
            revision = conn.execute(select(t.alembic_version.c.version_num)).scalar()
        elif not insp.has_table(t.events.name):
            t.metadata.create_all(conn)
            t.version_metadata.create_all(conn)
            conn.execute(t.alembic_version.insert().values(version_num=t.SCHEMA_REVISION))
            return
        if revision == t.SCHEMA_REVISION:
            return
        where = make_url(self.url).render_as_string(hide_password=True)
        upgrade = f"memledger --db '{where}' db upgrade"
        if revision is None:
            raise SchemaOutOfDate(None, t.SCHEMA_REVISION, (
                f"the database was made by a memledger without schema migrations; upgrade "
                f"it to revision {t.SCHEMA_REVISION} with `{upgrade}` (take a backup "
                "first: `memledger backup PATH`)"))
        raise SchemaOutOfDate(revision, t.SCHEMA_REVISION, (
            f"the database is at schema revision {revision}, this memledger needs "
            f"{t.SCHEMA_REVISION}: if it is older, upgrade it with `{upgrade}` (take a "
            "backup first: `memledger backup PATH`); if it is newer, upgrade memledger"))

    async def close(self) -> None:
        """Finish pending appends and dispose of the connection pool."""
        if self._writer is not None:
            pending = [r.future for r in self._queue]
            if pending:
                await asyncio.wait(pending)
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
        if self.inline is not None:
            await self.inline.close()
        if self._append_inline is not None and self._append_inline is not self.inline:
            await self._append_inline.close()
        await self.recorder.dispose()
        if self.vault is not None:
            self.vault.close()

    def on_commit(self, listener: Callable[[int], Any]) -> None:
        """Call `listener(head_position)` after each append transaction commits."""
        self._listeners.append(listener)

    # -- append -------------------------------------------------------------------------------
    async def append(self, events: Sequence[Event]) -> list[AppendResult]:
        """Append events atomically: all of them, or (on any rejection) none.

        Duplicates (same idempotency key and content) are reported with their original
        position and change nothing. Concurrent calls share transactions.
        """
        if not events:
            return []
        await self.open()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[AppendResult]] = loop.create_future()
        self._queue.append(Request(list(events), fut))
        if self._writer is None or self._writer.done():
            self._wake = asyncio.Event()
            self._writer = loop.create_task(self._write_loop())
        assert self._wake is not None
        self._wake.set()
        return await fut

    async def append_one(self, event: Event) -> AppendResult:
        """Append one event."""
        return (await self.append([event]))[0]

    async def _write_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                # Let the other ready tasks enqueue first: that is what groups commits.
                await asyncio.sleep(0)
                group: list[Request] = []
                n = 0
                while self._queue and n < GROUP_MAX_EVENTS:
                    req = self._queue.pop(0)
                    group.append(req)
                    n += len(req.events)
                await self._commit_group(group)

    async def _commit_group(self, group: list[Request]) -> None:
        outcomes: list[list[AppendResult] | BaseException] = []
        head = 0
        inline = self.inline or self._append_inline
        try:
            vault = self.vault
            if vault is not None:
                # The group's keys are made durable (and their ciphers built) before its
                # write transaction, off the event loop: the key store's write and fsync
                # never hold the ledger's write lock (`Vault.reserve`).
                need = sum(1 for r in group for e in r.events if e.type in SEALED_TYPES)
                if need and not vault.ready(need):
                    await asyncio.to_thread(vault.reserve, need)
            if inline is not None:
                head, outcomes = await inline.run(lambda conn: Appender(self, conn).run(group))
            else:
                head, outcomes = await self.transaction(
                    lambda conn: Appender(self, conn).run(group), views=False)
        except BaseException as e:
            err = e if isinstance(e, MemledgerError) else StoreUnavailable(
                f"append failed: {short_error(e)}")
            if isinstance(e, MemledgerError | DBAPIError | OSError):
                log.warning("append_group_failed", error=short_error(e), requests=len(group))
            for req in group:
                if not req.future.done():
                    req.future.set_exception(err)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        for req, out in zip(group, outcomes, strict=True):
            if req.future.done():
                continue
            if isinstance(out, BaseException):
                req.future.set_exception(out)
            else:
                req.future.set_result(out)
        appended = sum(1 for out in outcomes if not isinstance(out, BaseException)
                       for r in out if r.status == "appended")
        await self.recorder.note_growth(GROWING_TABLES, appended)
        for listener in self._listeners:
            try:
                res = listener(head)
                if asyncio.iscoroutine(res):
                    await res
            except Exception as e:  # noqa: BLE001 - a listener never undoes a commit
                log.warning("commit_listener_failed", error=short_error(e))

    # -- reads --------------------------------------------------------------------------------
    async def head(self, conn: AsyncConnection | None = None) -> int:
        """The highest position in the ledger (0 when empty)."""
        await self.open()
        if conn is not None:
            return await self.recorder.max_position(conn)
        async with self.read() as c:
            return await self.recorder.max_position(c)

    async def read_events(self, conn: AsyncConnection, after: int, limit: int,
                          upto: int | None = None, types: Sequence[str] | None = None
                          ) -> list[StoredEvent]:
        """Events with position > `after` (and <= `upto`, of `types`), in position order."""
        return await self.recorder.select_events(conn, after, limit, upto, types)

    async def tombstones(self, conn: AsyncConnection, tenants: Iterable[str] | None = None,
                         upto: int | None = None) -> list[Tombstone]:
        """Tombstones, optionally of some tenants and up to a position."""
        return [tombstone_from_row(r)
                for r in await self.recorder.select_tombstones(conn, tenants, upto)]

    async def reclaim(self) -> None:
        """After an erasure: drop old copies of erased content where the backend can
        (SQLite: truncate the WAL; PostgreSQL: VACUUM the content tables)."""
        await self.recorder.reclaim()
