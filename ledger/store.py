"""The ledger store: schema, the append path with group commit, and event reads.

One SQLAlchemy async code path serves SQLite (aiosqlite, the embedded default) and
PostgreSQL (asyncpg). Appends from many tasks are queued and written by one writer
task in shared transactions (group commit), each request still atomic on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import orjson
import structlog
from sqlalchemy import and_, func, or_, select, text
from sqlalchemy import event as sa_event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from ledger import schema as t
from ledger.errors import (
    ConcurrencyConflict,
    IdempotencyConflict,
    MemledgerError,
    StoreUnavailable,
    ValidationError,
)
from ledger.events import (
    MEMORY_WRITES,
    NS_SEP,
    TASK_TYPES,
    USER_KINDS,
    Event,
    Source,
    derive_memory_id,
    digest,
    encode_json,
    ns_path,
    parse_rfc3339,
    to_us,
)
from ledger.logs import configure_default
from ledger.register import ForgetRegister, default_register_path

configure_default()
log = structlog.get_logger("memledger.ledger")

DEFAULT_URL: Final = "sqlite+aiosqlite:///./memledger.db"
GENESIS: Final = "0" * 64
#: Requests taken into one group-commit transaction, counted in events.
GROUP_MAX_EVENTS: Final = 4000


def now_iso() -> str:
    """The current UTC time, RFC 3339 with microseconds."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


# -- integrity ----------------------------------------------------------------------------

def envelope_of(row: dict[str, Any]) -> dict[str, Any]:
    """The fields of a stored event that the hash chain covers (everything but the
    payload, which may be erased, and the `redacted` flag, which erasure sets)."""
    return {
        "position": row["position"],
        "tenant": row["tenant"],
        "idempotency_key": row["idempotency_key"],
        "type": row["type"],
        "actor": row["actor"],
        "source": [row["source_kind"], row["source_id"], row["source_at"],
                   row["source_seq"], row["source_event_id"]],
        "order_key": bytes(row["order_key"]).hex(),
        "index": [row["slot"], row["memory_id"], row["ns_path"], row["mkey"], row["layer"],
                  row["task_key"], row["supersedes"]],
        "content_digest": row["content_digest"],
        "suppressed": bool(row["suppressed"]),
        "recorded_at": row["recorded_at"],
    }


def chain_link(prev: str, row: dict[str, Any]) -> str:
    """The chain value of a row: hash of the previous link and the row's envelope."""
    return digest(prev.encode() + b"|" + encode_json(envelope_of(row)))


def pairs_in(a: Any, b: Any, pairs: Iterable[tuple[Any, Any]]) -> Any:
    """SQL: `(a, b)` is one of `pairs`, written `a = x AND b IN (...)` per distinct `x`.

    SQLite (3.40) never uses an index for a multi-row `(a, b) IN (VALUES ...)`: it scans
    the whole table, which made appends and projections slow down as the ledger grew.
    """
    grouped: dict[Any, list[Any]] = {}
    for x, y in pairs:
        grouped.setdefault(x, []).append(y)
    return or_(*(and_(a == x, b.in_(ys)) for x, ys in grouped.items()))


# -- results and stored events ------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AppendResult:
    """The outcome of one event of an append request."""

    status: str  # appended | duplicate
    position: int
    suppressed: bool = False


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event as the ledger holds it: envelope always, content unless erased."""

    position: int
    tenant: str
    type: str
    idempotency_key: str
    actor: str
    source: Source
    order_key: bytes
    slot: str | None
    memory_id: str | None
    ns_path: str | None
    mkey: str | None
    layer: str | None
    task_key: str | None
    recorded_at: str
    suppressed: bool
    redacted: bool
    content_digest: str
    event: Event | None = field(default=None, compare=False)
    supersedes: str | None = None

    @property
    def has_content(self) -> bool:
        """False for suppressed or erased events."""
        return self.event is not None


def event_from_wire(obj: dict[str, Any], source: Source | None = None) -> Event:
    """Rebuild an `Event` from its stored (already validated, normalised) wire form.

    `source`, when the caller has it already (the envelope columns), saves parsing the
    timestamp twice: the envelope and the payload hold the same source.
    """
    if source is None:
        s = obj["source"]
        source = Source(s["kind"], s["id"], s["at"], s.get("seq"), s.get("event_id"),
                        to_us(parse_rfc3339(s["at"])))
    return Event(obj["type"], obj["idempotency_key"], obj["tenant"], obj["actor"], source,
                 obj["data"], obj.get("expected_version"))


STORED_COLUMNS: Final = (
    t.events.c.position, t.events.c.tenant, t.events.c.type, t.events.c.idempotency_key,
    t.events.c.actor, t.events.c.source_kind, t.events.c.source_id, t.events.c.source_at,
    t.events.c.source_seq, t.events.c.source_event_id, t.events.c.order_key,
    t.events.c.slot, t.events.c.memory_id, t.events.c.ns_path, t.events.c.mkey,
    t.events.c.layer, t.events.c.task_key, t.events.c.recorded_at, t.events.c.suppressed,
    t.events.c.redacted, t.events.c.content_digest, t.events.c.payload,
    t.events.c.supersedes,
)


def stored_from_row(r: Sequence[Any]) -> StoredEvent:
    """Build a `StoredEvent` from a row selected with `STORED_COLUMNS`."""
    payload = r[21]
    src = Source(r[5], r[6], r[7], r[8], r[9], to_us(parse_rfc3339(r[7])))
    ev = event_from_wire(orjson.loads(payload), src) if payload is not None else None
    return StoredEvent(r[0], r[1], r[2], r[3], r[4], src, bytes(r[10]), r[11], r[12], r[13],
                       r[14], r[15], r[16], r[17], bool(r[18]), bool(r[19]), r[20], ev, r[22])


# -- tombstones ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Tombstone:
    """A forget (or task purge) as the read and write paths apply it."""

    position: int
    tenant: str
    kind: str  # memory_id | key | prefix | task
    order_key: bytes
    memory_id: str | None = None
    ns_path: str | None = None
    mkey: str | None = None
    task_key: str | None = None

    def covers_write(self, tenant: str, memory_id: str, nspath: str, key: str,
                     task_key: str | None, order: bytes) -> bool:
        """Does this tombstone cover a memory write with these coordinates?"""
        if tenant != self.tenant:
            return False
        if self.kind == "memory_id":
            return memory_id == self.memory_id  # whatever its order
        if order > self.order_key:
            return False  # said again after the forget: a new memory
        if self.kind == "key":
            return nspath == self.ns_path and key == self.mkey
        if self.kind == "prefix":
            return nspath.startswith(self.ns_path or "\x00")
        return task_key is not None and task_key == self.task_key

    def covers_task(self, tenant: str, task_key: str, owner_path: str | None,
                    order: bytes) -> bool:
        """Does this tombstone cover a task event with these coordinates?"""
        if tenant != self.tenant or order > self.order_key:
            return False
        if self.kind == "task":
            return task_key == self.task_key
        if self.kind == "prefix" and owner_path is not None:
            return owner_path.startswith(self.ns_path or "\x00")
        return False


def tombstone_of(ev: Event, position: int) -> Tombstone | None:
    """The tombstone a forget or purge event records, or None for other events."""
    d = ev.data
    if ev.type == "memory.forgotten":
        if "memory_id" in d:
            return Tombstone(position, ev.tenant, "memory_id", ev.order, memory_id=d["memory_id"])
        if "namespace_prefix" in d:
            return Tombstone(position, ev.tenant, "prefix", ev.order,
                             ns_path=ns_path(d["namespace_prefix"]))
        return Tombstone(position, ev.tenant, "key", ev.order, ns_path=ns_path(d["namespace"]),
                         mkey=d["key"])
    if ev.type == "task.purged":
        return Tombstone(position, ev.tenant, "task", ev.order, task_key=d["task_key"])
    return None


def tombstone_from_row(r: Any) -> Tombstone:
    """Build a `Tombstone` from a `tombstones` row."""
    return Tombstone(r.position, r.tenant, r.kind, bytes(r.order_key), r.memory_id, r.ns_path,
                     r.mkey, r.task_key)


def tombstone_row(ts: Tombstone) -> dict[str, Any]:
    """The `tombstones` row of a tombstone."""
    return {"position": ts.position, "tenant": ts.tenant, "kind": ts.kind,
            "memory_id": ts.memory_id, "ns_path": ts.ns_path, "mkey": ts.mkey,
            "task_key": ts.task_key, "order_key": ts.order_key}


def register_entry(ev: Event, position: int) -> dict[str, Any]:
    """What the forget register keeps of a forget or purge: the event without reason."""
    wire = ev.to_wire()
    wire["data"] = {k: v for k, v in wire["data"].items() if k != "reason"}
    return {"position": position, "event": wire}


async def ledger_id(conn: AsyncConnection) -> str | None:
    """The ledger's identity: the hash-chain link of its first event (None while empty).

    It never changes (events are never removed, erasure keeps the envelope) and travels
    with every backup, so the forget register can name the ledger it belongs to.
    """
    row = (await conn.execute(
        select(t.events.c.chain).where(t.events.c.position == 1))).first()
    return str(row[0]) if row is not None else None


# -- the store ----------------------------------------------------------------------------

_MISSING: Final = object()


class _Undo:
    """An undo log over dicts, so a failed request leaves the group state untouched."""

    def __init__(self) -> None:
        self.log: list[tuple[dict[Any, Any], Any, Any]] = []

    def set(self, d: dict[Any, Any], k: Any, v: Any) -> None:
        self.log.append((d, k, d.get(k, _MISSING)))
        d[k] = v

    def rollback(self) -> None:
        for d, k, old in reversed(self.log):
            if old is _MISSING:
                d.pop(k, None)
            else:
                d[k] = old
        self.log.clear()


@dataclass
class _Request:
    events: Sequence[Event]
    future: asyncio.Future[list[AppendResult]]


class Store:
    """The ledger database: append events, read them back, manage the schema."""

    def __init__(self, url: str | None = None, *, register_path: str | None = None,
                 pool_size: int = 5) -> None:
        self.url = url or os.environ.get("MEMLEDGER_DB_URL") or DEFAULT_URL
        self.dialect = "sqlite" if self.url.startswith("sqlite") else "postgresql"
        self.register = ForgetRegister(register_path or default_register_path(self.url))
        self.engine = self._make_engine(pool_size)
        self._queue: list[_Request] = []
        self._writer: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._listeners: list[Callable[[int], Any]] = []
        self._opened = False
        self._open_lock: asyncio.Lock | None = None

    # -- engine and connections -----------------------------------------------------------
    def _make_engine(self, pool_size: int) -> AsyncEngine:
        if self.dialect == "sqlite":
            engine = create_async_engine(self.url, poolclass=NullPool
                                         if ":memory:" in self.url else None)
            _install_sqlite_hooks(engine)
            return engine
        return create_async_engine(
            self.url, pool_size=pool_size, max_overflow=10, pool_pre_ping=True,
            connect_args={"server_settings": {
                # A stuck session must not pin the projections behind its snapshot.
                "idle_in_transaction_session_timeout": "60000",
                "application_name": "memledger",
            }},
        )

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction that holds the ledger's write lock until it commits."""
        try:
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(memledger_write=True)
                async with conn.begin():
                    if self.dialect == "postgresql":
                        # Insert order must equal commit order, or a poller reading
                        # `position > checkpoint` could skip a late committer.
                        await conn.execute(text("SET LOCAL lock_timeout = '30s'"))
                        await conn.execute(text("LOCK TABLE events IN EXCLUSIVE MODE"))
                    yield conn
        except (OperationalError, DBAPIError, OSError) as e:
            if isinstance(e, DBAPIError) and not _is_transient(e):
                raise
            raise StoreUnavailable(f"ledger database unavailable: {_short(e)}") from e

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A read transaction (one consistent snapshot on both backends)."""
        try:
            async with self.engine.connect() as conn, conn.begin():
                if self.dialect == "postgresql":
                    await conn.execute(text(
                        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
                yield conn
        except (OperationalError, OSError) as e:
            raise StoreUnavailable(f"ledger database unavailable: {_short(e)}") from e

    @asynccontextmanager
    async def read_once(self) -> AsyncIterator[AsyncConnection]:
        """A connection for one statement: no explicit transaction on SQLite (a single
        SELECT is atomic there), which saves two round trips to the driver thread."""
        if self.dialect == "postgresql":
            async with self.read() as conn:
                yield conn
            return
        try:
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(memledger_no_begin=True)
                yield conn
        except (OperationalError, OSError) as e:
            raise StoreUnavailable(f"ledger database unavailable: {_short(e)}") from e

    @asynccontextmanager
    async def view_write(self) -> AsyncIterator[AsyncConnection]:
        """A transaction for view updates: SQLite takes its write lock up front."""
        try:
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(memledger_write=True)
                async with conn.begin():
                    yield conn
        except (OperationalError, OSError) as e:
            raise StoreUnavailable(f"ledger database unavailable: {_short(e)}") from e

    async def open(self) -> Store:
        """Create the schema if needed and check its version; idempotent."""
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
                    if self.dialect == "postgresql":
                        # Two processes creating the schema at once would race.
                        await conn.execute(text("SELECT pg_advisory_xact_lock(7231001)"))
                    await conn.run_sync(t.metadata.create_all)
                    row = (await conn.execute(
                        select(t.meta.c.value).where(t.meta.c.name == "schema_version")
                    )).first()
                    if row is None:
                        await conn.execute(t.meta.insert().values(
                            name="schema_version", value=str(t.SCHEMA_VERSION)))
                    elif int(row[0]) > t.SCHEMA_VERSION:
                        raise MemledgerError(
                            f"database schema version {row[0]} is newer than this "
                            f"memledger ({t.SCHEMA_VERSION}); upgrade memledger")
                    await conn.commit()
            except (OperationalError, OSError) as e:
                raise StoreUnavailable(f"cannot open ledger database: {_short(e)}") from e
            self._opened = True
        return self

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
        await self.engine.dispose()

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
        self._queue.append(_Request(list(events), fut))
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
                group: list[_Request] = []
                n = 0
                while self._queue and n < GROUP_MAX_EVENTS:
                    req = self._queue.pop(0)
                    group.append(req)
                    n += len(req.events)
                await self._commit_group(group)

    async def _commit_group(self, group: list[_Request]) -> None:
        outcomes: list[list[AppendResult] | BaseException] = []
        head = 0
        try:
            async with self.write() as conn:
                head, outcomes = await _Appender(self, conn).run(group)
        except BaseException as e:
            err = e if isinstance(e, MemledgerError) else StoreUnavailable(
                f"append failed: {_short(e)}")
            if isinstance(e, MemledgerError | DBAPIError | OSError):
                log.warning("append_group_failed", error=_short(e), requests=len(group))
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
        for listener in self._listeners:
            try:
                res = listener(head)
                if asyncio.iscoroutine(res):
                    await res
            except Exception as e:  # noqa: BLE001 - a listener never undoes a commit
                log.warning("commit_listener_failed", error=_short(e))

    # -- reads --------------------------------------------------------------------------------
    async def head(self, conn: AsyncConnection | None = None) -> int:
        """The highest position in the ledger (0 when empty)."""
        await self.open()
        if conn is not None:
            return int((await conn.execute(select(func.max(t.events.c.position)))).scalar() or 0)
        async with self.read() as c:
            return int((await c.execute(select(func.max(t.events.c.position)))).scalar() or 0)

    async def read_events(self, conn: AsyncConnection, after: int, limit: int,
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

    async def tombstones(self, conn: AsyncConnection, tenants: Iterable[str] | None = None,
                         upto: int | None = None) -> list[Tombstone]:
        """Tombstones, optionally of some tenants and up to a position."""
        q = select(t.tombstones)
        if tenants is not None:
            q = q.where(t.tombstones.c.tenant.in_(sorted(set(tenants))))
        if upto is not None:
            q = q.where(t.tombstones.c.position <= upto)
        return [tombstone_from_row(r) for r in (await conn.execute(q)).all()]

    async def sqlite_checkpoint(self) -> None:
        """After an erasure: drop old page images of erased content where we can.

        SQLite: move the WAL into the main file and truncate it (with secure_delete on,
        the erased bytes are then gone from the files). PostgreSQL: VACUUM the tables
        that held the content, so dead row versions are reclaimed now rather than at
        autovacuum's leisure (their bytes may still sit in WAL archives: docs/forgetting.md).
        """
        if self.dialect == "postgresql":
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                await conn.exec_driver_sql(
                    "VACUUM events, mem_versions, task_notes, tasks_view, vectors")
            return
        async with self.engine.connect() as conn:
            await conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            await conn.commit()


_EVENT_COLUMNS: Final = tuple(c.name for c in t.events.c)
_SQLITE_INSERT: Final = (f"INSERT INTO events ({', '.join(_EVENT_COLUMNS)}) "
                         f"VALUES ({', '.join('?' for _ in _EVENT_COLUMNS)})")


class _Appender:
    """One group-commit transaction: checks every request, then inserts in one go."""

    def __init__(self, store: Store, conn: AsyncConnection) -> None:
        self.store = store
        self.conn = conn
        self.idem: dict[tuple[str, str], tuple[str, int, bool]] = {}
        self.mem_owner: dict[tuple[str, str], str] = {}   # (tenant, memory_id) -> ns_path
        self.task_owner: dict[tuple[str, str], str] = {}  # (tenant, task_key) -> ns_path
        self.tombs: dict[str, list[Tombstone]] = {}
        self.counts: dict[str, int] = {}
        self.rows: list[dict[str, Any]] = []
        self.tomb_rows: list[dict[str, Any]] = []
        self.owner_rows: dict[tuple[str, str], str] = {}
        self.register: list[dict[str, Any]] = []

    async def _prefetch(self, group: list[_Request]) -> None:
        evs = [e for r in group for e in r.events]
        keys = sorted({(e.tenant, e.idempotency_key) for e in evs})
        tenants = sorted({e.tenant for e in evs})
        # A derived id needs no lookup: it is unique when its idempotency key is, and no
        # explicit id may take that form (validation). Targets of marks are looked up.
        mids = sorted({(e.tenant, e.memory_id) for e in evs if e.memory_id and not (
            e.is_write and e.memory_id == derive_memory_id(e.tenant, e.idempotency_key))})
        tks = sorted({(e.tenant, e.task_key) for e in evs if e.task_key})
        c = self.conn
        ev = t.events.c
        for chunk in _chunks(keys, 400):
            q1 = select(ev.tenant, ev.idempotency_key, ev.content_digest, ev.position,
                        ev.suppressed).where(pairs_in(ev.tenant, ev.idempotency_key, chunk))
            for r in (await c.execute(q1)).all():
                self.idem[(r[0], r[1])] = (r[2], r[3], bool(r[4]))
        for chunk in _chunks(mids, 400):
            q2 = select(ev.tenant, ev.memory_id, ev.ns_path).where(
                pairs_in(ev.tenant, ev.memory_id, chunk), ev.type.in_(MEMORY_WRITES))
            for r2 in (await c.execute(q2)).all():
                self.mem_owner[(r2[0], r2[1])] = r2[2]
        to = t.task_owners.c
        for chunk in _chunks(tks, 400):
            q3 = select(to.tenant, to.task_key, to.ns_path).where(
                pairs_in(to.tenant, to.task_key, chunk))
            for r3 in (await c.execute(q3)).all():
                self.task_owner[(r3[0], r3[1])] = r3[2]
        for ts in await self.store.tombstones(c, tenants):
            self.tombs.setdefault(ts.tenant, []).append(ts)

    async def _count(self, target: str, *, task: bool, tenant: str) -> int:
        if target not in self.counts:
            ev = t.events.c
            if task:
                q = select(func.count()).where(ev.tenant == tenant, ev.task_key == target,
                                               ev.type.in_(TASK_TYPES))
            else:
                q = select(func.count()).where(ev.slot == target)
            self.counts[target] = int((await self.conn.execute(q)).scalar() or 0)
        return self.counts[target]

    async def run(self, group: list[_Request]
                  ) -> tuple[int, list[list[AppendResult] | BaseException]]:
        await self._prefetch(group)
        last = (await self.conn.execute(
            select(t.events.c.position, t.events.c.chain)
            .order_by(t.events.c.position.desc()).limit(1))).first()
        position, chain = (int(last[0]), str(last[1])) if last else (0, GENESIS)
        outcomes: list[list[AppendResult] | BaseException] = []
        recorded = now_iso()
        for req in group:
            undo = _Undo()
            mark = (len(self.rows), len(self.tomb_rows), len(self.register), position, chain)
            try:
                results: list[AppendResult] = []
                for ev in req.events:
                    res, position, chain = await self._one(ev, position, chain, recorded, undo)
                    results.append(res)
                outcomes.append(results)
            except MemledgerError as e:
                undo.rollback()
                del self.rows[mark[0]:]
                del self.tomb_rows[mark[1]:]
                del self.register[mark[2]:]
                position, chain = mark[3], mark[4]
                outcomes.append(e)
        if self.rows:
            # Register first: if the commit then fails, reapplying a forget that was asked
            # for is harmless; a committed forget missing from the register is not.
            if self.register:
                first = self.rows[0] if self.rows[0]["position"] == 1 else None
                self.store.register.append(self.register, ledger=(
                    first["chain"] if first is not None else await ledger_id(self.conn)))
            if self.store.dialect == "sqlite":
                # SQLAlchemy's per-row parameter processing cost ~10 us a row here; the
                # driver takes plain tuples in column order (no type needs converting).
                await self.conn.exec_driver_sql(_SQLITE_INSERT, [
                    tuple(r[c] for c in _EVENT_COLUMNS) for r in self.rows])
            else:
                await self.conn.execute(t.events.insert(), self.rows)
            if self.tomb_rows:
                await self.conn.execute(t.tombstones.insert(), self.tomb_rows)
            if self.owner_rows:
                await self.conn.execute(t.task_owners.insert(), [
                    {"tenant": k[0], "task_key": k[1], "ns_path": v}
                    for k, v in self.owner_rows.items()])
        return position, outcomes

    async def _one(self, ev: Event, position: int, chain: str, recorded: str,
                   undo: _Undo) -> tuple[AppendResult, int, str]:
        dig = ev.content_digest
        prior = self.idem.get((ev.tenant, ev.idempotency_key))
        if prior is not None:
            if prior[0] != dig:
                raise IdempotencyConflict(ev.idempotency_key)
            return AppendResult("duplicate", prior[1], prior[2]), position, chain
        d = ev.data
        slot = ev.slot
        owner_path: str | None = None
        if ev.is_write:
            mkey = (ev.tenant, d["memory_id"])
            if mkey in self.mem_owner:
                raise ValidationError("data.memory_id", f"memory_id {d['memory_id']!r} is "
                                      "already used by another write; omit it to derive one")
        if ev.type in ("memory.superseded", "memory.confirmed") or (
                ev.type == "memory.forgotten" and "memory_id" in d):
            self._check_target_owner(ev, d["memory_id"])
        if ev.task_key is not None and ev.type in TASK_TYPES:
            owner_path = self._check_task(ev, undo)
        if ev.expected_version is not None:
            target = slot if slot is not None else ev.task_key
            if target is None:
                raise ValidationError("expected_version", "applies only to memory writes "
                                      "and task events")
            actual = await self._count(target, task=slot is None, tenant=ev.tenant)
            if actual != ev.expected_version:
                label = (f"slot {d.get('key')!r} in {'/'.join(d['namespace'])}"
                         if slot else f"task {ev.task_key!r}")
                raise ConcurrencyConflict(label, ev.expected_version, actual)
        suppressed = self._covered(ev, owner_path)
        position += 1
        row = self._row(ev, position, dig, recorded, suppressed, owner_path)
        chain = chain_link(chain, row)
        row["chain"] = chain
        self.rows.append(row)
        undo.set(self.idem, (ev.tenant, ev.idempotency_key), (dig, position, suppressed))
        if ev.is_write:
            undo.set(self.mem_owner, (ev.tenant, d["memory_id"]), ns_path(d["namespace"]))
        target = slot if slot is not None else (ev.task_key if ev.type in TASK_TYPES else None)
        if target is not None and target in self.counts:
            undo.set(self.counts, target, self.counts[target] + 1)
        ts = None if suppressed else tombstone_of(ev, position)
        if ts is not None:
            self.tomb_rows.append(tombstone_row(ts))
            lst = self.tombs.setdefault(ev.tenant, [])
            undo.set(self.tombs, ev.tenant, [*lst, ts])
            self.register.append(register_entry(ev, position))
        log.debug("event_appended", tenant=ev.tenant, position=position, type=ev.type,
                  suppressed=suppressed)
        return AppendResult("appended", position, suppressed), position, chain

    def _check_target_owner(self, ev: Event, memory_id: str) -> None:
        owner = self.mem_owner.get((ev.tenant, memory_id))
        if ev.source.kind not in USER_KINDS:
            return
        if owner is None:
            raise ValidationError("data.memory_id", f"no memory {memory_id!r} in tenant "
                                  f"{ev.tenant!r} that {ev.actor!r} may change")
        if owner.split(NS_SEP)[1] != ev.actor:
            # Same message as "no such memory": a user must not learn what others hold.
            raise ValidationError("data.memory_id", f"no memory {memory_id!r} in tenant "
                                  f"{ev.tenant!r} that {ev.actor!r} may change")

    def _check_task(self, ev: Event, undo: _Undo) -> str | None:
        k = (ev.tenant, str(ev.task_key))
        owner = self.task_owner.get(k)
        if ev.type == "task.opened":
            path = ns_path(ev.data["namespace"])
            if owner is not None and owner != path:
                raise ValidationError("data.task_key", f"task {ev.task_key!r} is already "
                                      "open under another owner; use a new task key")
            if owner is None:
                undo.set(self.task_owner, k, path)
                undo.set(self.owner_rows, k, path)
            return path
        if ev.source.kind in USER_KINDS and (
                owner is None or owner.split(NS_SEP)[1] != ev.actor):
            raise ValidationError("data.task_key", f"no open task {ev.task_key!r} owned by "
                                  f"{ev.actor!r}; open it first (task.opened)")
        return owner

    def _covered(self, ev: Event, owner_path: str | None) -> bool:
        tombs = self.tombs.get(ev.tenant)
        if not tombs:
            return False
        order = ev.order
        d = ev.data
        if ev.is_write:
            nsp = ns_path(d["namespace"])
            return any(ts.covers_write(ev.tenant, d["memory_id"], nsp, d["key"],
                                       d.get("task_key"), order) for ts in tombs)
        if ev.type in TASK_TYPES and ev.type != "task.purged":
            return any(ts.covers_task(ev.tenant, str(ev.task_key), owner_path, order)
                       for ts in tombs)
        return False

    def _row(self, ev: Event, position: int, dig: str, recorded: str, suppressed: bool,
             owner_path: str | None) -> dict[str, Any]:
        d = ev.data
        nsp: str | None = None
        if "namespace" in d:
            nsp = ns_path(d["namespace"])
        elif "namespace_prefix" in d:
            nsp = ns_path(d["namespace_prefix"])
        elif owner_path is not None:
            nsp = owner_path
        s = ev.source
        return {
            "position": position, "tenant": ev.tenant, "idempotency_key": ev.idempotency_key,
            "type": ev.type, "actor": ev.actor, "source_kind": s.kind, "source_id": s.id,
            "source_at": s.at, "source_seq": s.seq, "source_event_id": s.event_id,
            "order_key": ev.order, "slot": ev.slot, "memory_id": ev.memory_id,
            "ns_path": nsp, "mkey": d.get("key"), "layer": d.get("layer"),
            "task_key": ev.task_key,
            "supersedes": d.get("supersedes") if ev.is_write else None,
            # A suppressed event keeps its envelope and digest, never its content (R22).
            "payload": None if suppressed else ev.encode(),
            "content_digest": dig, "recorded_at": recorded, "suppressed": suppressed,
            "redacted": False,
        }



def _chunks(items: list[Any], n: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def _short(e: BaseException) -> str:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return msg[:300]


def _is_transient(e: DBAPIError) -> bool:
    return bool(e.connection_invalidated) or "lock" in str(e).lower() or \
        "could not serialize" in str(e).lower()


def _install_sqlite_hooks(engine: AsyncEngine) -> None:
    """WAL, a busy timeout, secure delete, and BEGIN IMMEDIATE for write transactions.

    pysqlite's own transaction handling is switched off (SQLAlchemy's documented recipe)
    so we choose the BEGIN: a deferred transaction that reads and then writes fails with
    SQLITE_BUSY_SNAPSHOT under WAL instead of waiting, so writers take the lock first.
    """

    @sa_event.listens_for(engine.sync_engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        for pragma in ("busy_timeout=30000", "journal_mode=WAL", "synchronous=NORMAL",
                       "secure_delete=ON", "foreign_keys=ON"):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @sa_event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: Any) -> None:
        opts = conn.get_execution_options()
        if opts.get("memledger_no_begin", False):
            return  # autocommit: each statement is its own transaction
        conn.exec_driver_sql("BEGIN IMMEDIATE" if opts.get("memledger_write", False) else "BEGIN")

