"""The recorder: every statement that writes the `events` table, behind verbs.

`Recorder` is the interface (the `eventsourcing` library's split of `persistence.py`
from its `sqlite.py` and `postgres.py`): the engine and its transactions, and the
verbs the ledger, the replay tools and the erasure projection use to change or read
the ledger's own tables. What is the same on both backends is written here once; what
differs is in one module per backend, `ledger.backends.sqlite` and
`ledger.backends.postgres` (`ledger.backends.recorder_for` picks one for a URL).

No other module inserts into, updates or deletes from `events`.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Final, NamedTuple, NoReturn, Protocol

from sqlalchemy import (
    ColumnElement,
    Select,
    Table,
    and_,
    bindparam,
    delete,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.exc import DatabaseError, DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.dml import Insert

from ledger import schema as t
from ledger.chain import GENESIS
from ledger.errors import DatabaseCorrupt, StoreUnavailable
from ledger.events import MEMORY_WRITES
from ledger.records import StoredEvent, stored_from_row
from ledger.vault import Vault, keyed

STORED_COLUMNS: Final = (
    t.events.c.position, t.events.c.tenant, t.events.c.type, t.events.c.idempotency_key,
    t.events.c.actor, t.events.c.source_kind, t.events.c.source_id, t.events.c.source_at,
    t.events.c.source_seq, t.events.c.source_event_id, t.events.c.order_key,
    t.events.c.slot, t.events.c.memory_id, t.events.c.ns_path, t.events.c.mkey,
    t.events.c.layer, t.events.c.task_key, t.events.c.recorded_at, t.events.c.suppressed,
    t.events.c.redacted, t.events.c.content_digest,
    # With the key id of a sealed payload: view copies are sealed under it.
    keyed(t.events.c.payload), t.events.c.supersedes,
)
#: The `events` columns in table order (the order `insert_events` rows are written in).
EVENT_COLUMNS: Final = tuple(c.name for c in t.events.c)
#: An `events` row dict as a tuple in `EVENT_COLUMNS` order (one C call per row).
EVENT_TUPLE: Final = operator.itemgetter(*EVENT_COLUMNS)
#: The last event's position and link, as one driver statement (a backend's own
#: `last_link` on its driver's connection; the same SQL on both).
LAST_LINK_SQL: Final = "SELECT position, chain FROM events ORDER BY position DESC LIMIT 1"


class TombstoneRow(NamedTuple):
    """A `tombstones` row read on a driver's own connection (what
    `ledger.forgets.tombstone_from_row` reads of SQLAlchemy's rows); its fields are
    the table's columns in order (`TOMBSTONE_COLUMNS`)."""

    position: int
    tenant: str
    kind: str
    memory_id: str | None
    ns_path: str | None
    mkey: str | None
    task_key: str | None
    order_key: bytes


TOMBSTONE_COLUMNS: Final = tuple(c.name for c in t.tombstones.c)
assert TombstoneRow._fields == TOMBSTONE_COLUMNS, "TombstoneRow must follow ledger.schema"


def link_of(row: Any) -> tuple[int, str]:
    """`last_link`'s answer from its row: (position, chain), `(0, GENESIS)` when the
    ledger is empty (no row)."""
    return (int(row[0]), str(row[1])) if row else (0, GENESIS)
#: What SQLite says of a damaged file (SQLITE_CORRUPT, SQLITE_NOTADB).
CORRUPTION_MESSAGES: Final = ("database disk image is malformed", "file is not a database")


class Turn(Protocol):
    """A queue in front of the backend's write lock (`ledger.backends.sqlite.WriteTurn`;
    a protocol here so the interface does not import a backend)."""

    timeouts: int

    def hold(self) -> AbstractAsyncContextManager[bool]:
        """Hold the turn for the block; yields whether it was granted."""
        ...

    def close(self) -> None:
        """Stop waiting for turns (the store is closed)."""
        ...


class PointReads(Protocol):
    """Single SELECTs run on the calling thread, without the async driver's thread hop
    (`ledger.backends.sqlite.PointReads`; a protocol here so the interface does not
    import a backend)."""

    def rows(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]] | None:
        """The rows of one statement in the driver's own SQL and types, or None when it
        could not run here and now (the caller then takes the async path)."""
        ...

    def close(self) -> None:
        """Close the connections (they reopen on the next use)."""
        ...


class DriverReads(Protocol):
    """Single SELECTs awaited straight on the driver's own connections, past
    SQLAlchemy's compilation, result and pool machinery
    (`ledger.backends.postgres.DriverReads`; a protocol here so the interface does not
    import a backend)."""

    async def rows(self, sql: str, params: Sequence[Any]) -> list[Any] | None:
        """The rows of one statement in the driver's own SQL (`$n` parameters) and
        types, or None when it could not run here and now (the caller then takes the
        `read_once` path, which reports what is wrong)."""
        ...


class WriteLock(Enum):
    """Transaction-scoped locks that serialise one kind of write across processes
    (PostgreSQL advisory locks; SQLite's write transactions are serial already)."""

    SCHEMA = "schema"              # creating the schema: two processes at once would race
    DEAD_LETTERS = "dead_letters"  # two daemons recording one redelivered message


@dataclass
class IntegrityReport:
    """What the backend's own integrity check (`Recorder.integrity_check`) found."""

    #: The check that ran, e.g. `sqlite integrity_check` or `postgresql amcheck`.
    check: str
    #: One line per problem the check reported (empty: none).
    problems: list[str] = field(default_factory=list)
    #: False when the check could not run here (`note` says why): not a failure.
    available: bool = True
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The `integrity` member of `replay verify`'s output."""
        out: dict[str, Any] = {"check": self.check, "available": self.available,
                               "ok": not self.problems}
        if self.note is not None:
            out["note"] = self.note
        return out


class Recorder(ABC):
    """One backend's engine, transactions and ledger statements."""

    #: The backend's name: `sqlite` or `postgresql` (`Store.dialect`, backup headers).
    name: ClassVar[str]
    #: What `integrity_check` runs, as its report names it.
    integrity_check_name: ClassVar[str]
    #: The driver's own INSERT of one `events` row, parameters in `EVENT_COLUMNS` order
    #: (None: `insert_events` goes through SQLAlchemy).
    insert_events_sql: ClassVar[str | None] = None

    def __init__(self, url: str, *, pool_size: int = 5) -> None:
        self.url = url
        self.engine = self.create_engine(pool_size)
        #: The vault that seals content payloads before they are inserted (None: off;
        #: `ledger.vault`). Reads open them through the engine (`ledger.vault.attach`).
        self.vault: Vault | None = None
        #: The write turn taken before each write transaction, if the backend has one
        #: and it was asked for (`ledger.backends.sqlite.WriteTurn`).
        self.turn: Turn | None = None

    # -- engine and session set-up ----------------------------------------------------------
    @abstractmethod
    def create_engine(self, pool_size: int) -> AsyncEngine:
        """The async engine, with the backend's session settings."""

    @abstractmethod
    async def lock_events(self, conn: AsyncConnection) -> None:
        """Take the ledger's write lock inside a write transaction: insert order must
        equal commit order, or a poller reading `position > checkpoint` could skip a
        late committer."""

    @abstractmethod
    async def begin_snapshot(self, conn: AsyncConnection) -> None:
        """Make a just-begun read transaction one consistent, read-only snapshot."""

    @abstractmethod
    async def keep_transaction_open(self, conn: AsyncConnection) -> None:
        """Let a long transaction (backup, restore, verify) outlive the server's
        idle-in-transaction timeout."""

    @abstractmethod
    async def advisory_lock(self, conn: AsyncConnection, lock: WriteLock) -> None:
        """Hold `lock` until the transaction ends."""

    #: Can worker processes share projection shards by session-held locks
    #: (`workers.leases`)? Else one process steps every shard.
    shard_leases: ClassVar[bool] = False

    async def lease_holders(self, conn: AsyncConnection, lock_class: int) -> dict[int, str]:
        """Who holds the session locks of a class: `{n: holder}` (none without leases)."""
        return {}

    @abstractmethod
    def migration_lock(self, conn: AsyncConnection) -> AbstractAsyncContextManager[None]:
        """Held while a schema migration runs on `conn`, which must not be inside a
        transaction (each migration then commits its own): two processes never
        migrate one database at once."""

    # -- transactions -----------------------------------------------------------------------
    def write(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A write transaction that holds the ledger's write lock until it commits."""
        return self._write()

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        try:
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(memledger_write=True)
                async with conn.begin():
                    await self.lock_events(conn)
                    yield conn
        except (OperationalError, DBAPIError, OSError) as e:
            raise_corrupt(e)
            if isinstance(e, DBAPIError) and not is_transient(e):
                raise
            raise StoreUnavailable(f"ledger database unavailable: {short_error(e)}") from e

    def read(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A read transaction (one consistent snapshot on both backends)."""
        return self._read()

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        try:
            async with self.engine.connect() as conn, conn.begin():
                await self.begin_snapshot(conn)
                yield conn
        except (DatabaseError, OSError) as e:
            raise_translated(e)

    def read_once(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for one statement (a read transaction unless the backend makes
        a single statement atomic by itself)."""
        return self.read()

    def point_reads(self) -> PointReads | None:
        """Synchronous single-statement reads on the calling thread, where the backend
        offers them (SQLite files); None elsewhere: use `read_once`."""
        return None

    def driver_reads(self) -> DriverReads | None:
        """Awaited single-statement reads on the driver's own connections, where the
        backend offers them (PostgreSQL); None elsewhere."""
        return None

    def view_write(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A transaction for view updates: SQLite takes its write lock up front."""
        return self._view_write()

    @asynccontextmanager
    async def _view_write(self) -> AsyncIterator[AsyncConnection]:
        try:
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(memledger_write=True)
                async with conn.begin():
                    yield conn
        except (DatabaseError, OSError) as e:
            raise_translated(e)

    @abstractmethod
    async def integrity_check(self, limit: int) -> IntegrityReport:
        """Run the backend's own check of its files (pages, indexes), at most `limit`
        problems listed; in its own connection, outside any transaction. A check the
        backend cannot run here is reported as not available, not as a failure."""

    async def dispose(self) -> None:
        """Close the connection pool."""
        await self.engine.dispose()

    # -- events -----------------------------------------------------------------------------
    async def insert_events(self, conn: AsyncConnection, rows: Sequence[dict[str, Any]]
                            ) -> None:
        """Insert sealed event rows (every `events` column, `chain` set); with the vault
        on, content payloads are encrypted here, the one place new payloads are written."""
        if self.vault is not None:
            self.vault.seal_rows(rows)
        if self.insert_events_sql is None:
            await conn.execute(t.events.insert(), list(rows))
            return
        # Plain tuples in column order go straight to the driver's executemany: no
        # SQLAlchemy per-row parameter processing (~10 us a row), no type to convert.
        await conn.exec_driver_sql(self.insert_events_sql, list(map(EVENT_TUPLE, rows)))

    # -- the append path's look-ups (under the write lock) -------------------------------------
    async def known_keys(self, conn: AsyncConnection, keys: Sequence[tuple[str, str]]
                         ) -> list[tuple[str, str, str, int, bool]]:
        """For the `(tenant, idempotency key)` pairs already in the ledger: `(tenant, key,
        content digest, position, suppressed)`."""
        ev = t.events.c
        out: list[tuple[str, str, str, int, bool]] = []
        for chunk in _chunks(keys, 400):
            q = select(ev.tenant, ev.idempotency_key, ev.content_digest, ev.position,
                       ev.suppressed).where(pairs_in(ev.tenant, ev.idempotency_key, chunk))
            out += [(r[0], r[1], r[2], int(r[3]), bool(r[4]))
                    for r in (await conn.execute(q)).all()]
        return out

    async def memory_writers(self, conn: AsyncConnection, ids: Sequence[tuple[str, str]]
                             ) -> list[tuple[str, str, str]]:
        """For the `(tenant, memory id)` pairs some write already holds: `(tenant, memory
        id, namespace path of that write)`."""
        ev = t.events.c
        out: list[tuple[str, str, str]] = []
        for chunk in _chunks(ids, 400):
            q = select(ev.tenant, ev.memory_id, ev.ns_path).where(
                pairs_in(ev.tenant, ev.memory_id, chunk), ev.type.in_(MEMORY_WRITES))
            out += [(r[0], r[1], r[2]) for r in (await conn.execute(q)).all()]
        return out

    async def task_owner_paths(self, conn: AsyncConnection, tasks: Sequence[tuple[str, str]]
                               ) -> list[tuple[str, str, str]]:
        """For the `(tenant, task key)` pairs that have an owner: `(tenant, task key,
        owner's namespace path)`."""
        to = t.task_owners.c
        out: list[tuple[str, str, str]] = []
        for chunk in _chunks(tasks, 400):
            q = select(to.tenant, to.task_key, to.ns_path).where(
                pairs_in(to.tenant, to.task_key, chunk))
            out += [(r[0], r[1], r[2]) for r in (await conn.execute(q)).all()]
        return out

    async def select_events(self, conn: AsyncConnection, after: int, limit: int,
                            upto: int | None = None, types: Sequence[str] | None = None
                            ) -> list[StoredEvent]:
        """Events with position > `after` (and <= `upto`, of `types`), in position order."""
        q = select(*STORED_COLUMNS).where(t.events.c.position > after)
        if upto is not None:
            q = q.where(t.events.c.position <= upto)
        if types is not None:
            q = q.where(t.events.c.type.in_(types))
        rows = (await conn.execute(q.order_by(t.events.c.position).limit(limit))).all()
        return [stored_from_row(r) for r in rows]

    async def max_position(self, conn: AsyncConnection) -> int:
        """The highest position in the ledger (0 when empty)."""
        return int((await conn.execute(select(func.max(t.events.c.position)))).scalar() or 0)

    async def last_link(self, conn: AsyncConnection) -> tuple[int, str]:
        """The last event's position and chain link (`(0, GENESIS)` when empty)."""
        return link_of((await conn.execute(
            select(t.events.c.position, t.events.c.chain)
            .order_by(t.events.c.position.desc()).limit(1))).first())

    @staticmethod
    async def erase_payloads(conn: AsyncConnection, *where: ColumnElement[bool]) -> int:
        """Null the payload of the events matching `where` that still hold one, and mark
        them redacted; returns how many rows. (The same statement on both backends.)"""
        res = await conn.execute(update(t.events).where(*where, t.events.c.payload.is_not(None))
                                 .values(payload=None, redacted=True))
        return int(res.rowcount or 0)

    @staticmethod
    async def replace_payloads(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> int:
        """Set the payload (and `redacted`) of events by position: `memledger vault
        encrypt` replacing plaintext content by its sealed form. Envelopes, digests
        and links are untouched, so the chain still holds."""
        if not rows:
            return 0
        await conn.execute(update(t.events).where(t.events.c.position == bindparam("pos"))
                           .values(payload=bindparam("new_payload"),
                                   redacted=bindparam("new_redacted")),
                           [{"pos": r["position"], "new_payload": r["payload"],
                             "new_redacted": r["redacted"]} for r in rows])
        return len(rows)

    # -- tombstones -------------------------------------------------------------------------
    async def select_tombstones(self, conn: AsyncConnection,
                                tenants: Iterable[str] | None = None,
                                upto: int | None = None) -> Sequence[Any]:
        """`tombstones` rows, optionally of some tenants and up to a position."""
        q = select(t.tombstones)
        if tenants is not None:
            q = q.where(t.tombstones.c.tenant.in_(sorted(set(tenants))))
        if upto is not None:
            q = q.where(t.tombstones.c.position <= upto)
        return (await conn.execute(q)).all()

    async def insert_tombstones(self, conn: AsyncConnection,
                                rows: Sequence[dict[str, Any]]) -> None:
        """Insert `tombstones` rows."""
        await conn.execute(t.tombstones.insert(), list(rows))

    # -- whole tables (restore, scratch replay) ---------------------------------------------
    async def import_rows(self, conn: AsyncConnection, table: Table,
                          rows: Sequence[dict[str, Any]]) -> None:
        """Insert rows as they are (a restore, or a copy into a scratch database): event
        rows keep their positions and links."""
        await conn.execute(table.insert(), list(rows))

    async def delete_rows(self, conn: AsyncConnection, table: Table,
                          where: ColumnElement[bool] | None = None) -> None:
        """Delete every row of `table` (or those matching `where`)."""
        q = delete(table)
        await conn.execute(q if where is None else q.where(where))

    @abstractmethod
    async def after_import(self, conn: AsyncConnection) -> None:
        """Bring what the database generates (sequences) past imported rows."""

    # -- statements that differ in spelling -------------------------------------------------
    @abstractmethod
    def insert_ignore(self, table: Table) -> Insert:
        """INSERT that skips rows whose key is already there."""

    def for_update(self, q: Select[Any]) -> Select[Any]:
        """Lock the selected rows for the transaction (where rows can be locked)."""
        return q

    async def write_rows(self, conn: AsyncConnection, table: Table,
                         rows: Sequence[dict[str, Any]], *, ignore: bool = False) -> None:
        """Insert view rows (dicts with every column of `table`) in `conn`'s
        transaction, skipping rows whose key is already there if `ignore`. This form is
        SQLAlchemy's executemany; a backend may hand the rows to its driver instead
        (PostgreSQL: COPY, or one statement over arrays)."""
        if rows:
            await conn.execute(self.insert_ignore(table) if ignore else table.insert(), rows)

    def bytewise(self, column: Any) -> Any:
        """An ORDER BY term that sorts text bytewise, alike on both backends."""
        return column

    # -- reclaiming erased content ----------------------------------------------------------
    @abstractmethod
    async def reclaim(self) -> None:
        """After an erasure: drop old copies of erased content where the backend can."""

    @abstractmethod
    async def compact(self) -> None:
        """Rewrite the content tables' files so no old copy of a row is left in them
        (SQLite: VACUUM, then truncate the WAL; PostgreSQL: VACUUM FULL, which locks
        each table while it is rewritten). For `memledger vault encrypt`."""

    async def dead_row_counts(self, conn: AsyncConnection) -> dict[str, int]:
        """Dead row versions still held per content table (where the backend keeps them)."""
        return {}

    # -- planner statistics -----------------------------------------------------------------
    @abstractmethod
    async def note_growth(self, tables: Iterable[str], rows: int) -> None:
        """Count `rows` written to each of `tables` (after the commit that wrote them), and
        refresh the planner's statistics of a table that has grown enough since they were
        last gathered, where the backend plans from statistics (PostgreSQL)."""

    async def erasure_leftovers(self) -> list[dict[str, Any]]:
        """Places outside the tables that may still hold erased content (after
        `reclaim`), as `replay verify --forgotten` problems."""
        return []


def pairs_in(a: Any, b: Any, pairs: Iterable[tuple[Any, Any]]) -> Any:
    """SQL: `(a, b)` is one of `pairs`, written `a = x AND b IN (...)` per distinct `x`.

    SQLite (3.40) never uses an index for a multi-row `(a, b) IN (VALUES ...)`: it scans
    the whole table, which made appends and projections slow down as the ledger grew.
    """
    grouped: dict[Any, list[Any]] = {}
    for x, y in pairs:
        grouped.setdefault(x, []).append(y)
    return or_(*(and_(a == x, b.in_(ys)) for x, ys in grouped.items()))


def _chunks(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def short_error(e: BaseException) -> str:
    """The first line of an error, at most 300 characters."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return msg[:300]


def corrupt_cause(e: BaseException) -> str | None:
    """What the driver said if `e` means the database file is damaged, else None."""
    if not isinstance(e, DatabaseError):
        return None
    text = str(e.orig if e.orig is not None else e).lower()
    return next((m for m in CORRUPTION_MESSAGES if m in text), None)


def raise_translated(e: BaseException, what: str = "ledger database unavailable") -> NoReturn:
    """Raise the memledger error a driver error stands for, at the one boundary where
    they are translated: `DatabaseCorrupt` for a damaged file, `StoreUnavailable` for an
    operational failure (locked, gone, out of space), `e` itself for anything else (a
    constraint or programming error is a bug to see, not to retry). Call it from the
    `except` block that caught `e`."""
    raise_corrupt(e)
    if not isinstance(e, OperationalError | OSError):
        raise e
    raise StoreUnavailable(f"{what}: {short_error(e)}") from e


def raise_corrupt(e: BaseException) -> None:
    """Raise `DatabaseCorrupt` from `e` if `e` says the database is damaged."""
    cause = corrupt_cause(e)
    if cause is not None:
        raise DatabaseCorrupt(cause) from e


def is_transient(e: DBAPIError) -> bool:
    """Could the same statement succeed if tried again (a lock, a lost connection)?"""
    return bool(e.connection_invalidated) or "lock" in str(e).lower() or \
        "could not serialize" in str(e).lower()


async def ledger_id(conn: AsyncConnection) -> str | None:
    """The ledger's identity: the hash-chain link of its first event (None while empty).

    It never changes (events are never removed, erasure keeps the envelope) and travels
    with every backup, so the forget register can name the ledger it belongs to.
    """
    row = (await conn.execute(
        select(t.events.c.chain).where(t.events.c.position == 1))).first()
    return str(row[0]) if row is not None else None
