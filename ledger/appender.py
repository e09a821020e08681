"""The append path: checks of each request, then one insert per group commit.

`Store.append` queues requests; its writer task takes a group of them into one write
transaction (`Recorder.write`) and hands them to an `Appender`, which checks every
request against the ledger (idempotency, ownership, expected versions, tombstones),
builds and seals the rows (`event_row`, or `_row` from what the checks read of the
event already; `seal`: the one place new chain links are computed) and writes them with
the recorder's verbs. A rejected request leaves the group's state as it was (`_Undo`),
so the other requests still commit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import structlog
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.chain import chain_link
from ledger.errors import (
    ConcurrencyConflict,
    IdempotencyConflict,
    MemledgerError,
    ValidationError,
)
from ledger.events import (
    MEMORY_WRITES,
    NS_SEP,
    TASK_TYPES,
    USER_KINDS,
    Event,
    ns_path,
)
from ledger.forgets import (
    Coordinates,
    Tombstone,
    covers,
    register_entry,
    tombstone_of,
    tombstone_row,
)
from ledger.recorder import Recorder, ledger_id
from ledger.records import AppendResult
from ledger.register import ForgetRegister


class Ledger(Protocol):
    """What the append path uses of `ledger.store.Store` (a protocol, so this module
    does not import the store that imports it)."""

    recorder: Recorder
    register: ForgetRegister
    #: The recording clock: `events.recorded_at` of what is appended now.
    clock: Callable[[], str]

    async def tombstones(self, conn: AsyncConnection, tenants: Iterable[str] | None = None,
                         upto: int | None = None) -> list[Tombstone]:
        """Tombstones, optionally of some tenants and up to a position."""
        ...

log = structlog.get_logger("memledger.ledger")

#: Requests taken into one group-commit transaction, counted in events.
GROUP_MAX_EVENTS: Final = 4000


_MISSING: Final = object()
#: Marks of a memory: their target must be a memory the actor may change.
_MARKS: Final = frozenset({"memory.superseded", "memory.confirmed"})
#: The event types that may record a tombstone (`ledger.forgets.tombstone_of`).
_TOMBSTONE_TYPES: Final = frozenset({"memory.forgotten", "task.purged"})
#: The remedy for an explicit id or task key that is taken. Explicit memory ids and
#: task keys are unique in a tenant (the views key rows by them), so a taken one is
#: refused whoever took it; the answer never says who, or under which namespace.
_UNUSABLE: Final = "omit it to derive one, or choose another"
_UNUSABLE_TASK: Final = "use a new task key"


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
class Request:
    """One `Store.append` call waiting for its group commit."""

    events: Sequence[Event]
    future: asyncio.Future[list[AppendResult]]


def event_row(ev: Event, position: int, recorded: str, *, suppressed: bool,
              owner_path: str | None) -> dict[str, Any]:
    """The `events` row of an event at `position`, not yet sealed (no `chain`)."""
    d = ev.data
    is_write = ev.type in MEMORY_WRITES
    return _row(ev, d, position, recorded, suppressed, _ns_path_of(d, owner_path), is_write,
                ev.slot if is_write else None, ev.content_digest)


def _ns_path_of(d: Mapping[str, Any], owner_path: str | None) -> str | None:
    """An event row's `ns_path`: its namespace, else its namespace prefix, else (a task
    event) its task's owner path."""
    if "namespace" in d:
        return ns_path(d["namespace"])
    if "namespace_prefix" in d:
        return ns_path(d["namespace_prefix"])
    return owner_path


def _row(ev: Event, d: Mapping[str, Any], position: int, recorded: str, suppressed: bool,
         nsp: str | None, is_write: bool, slot: str | None, dig: str) -> dict[str, Any]:
    """`event_row` from what the append path has at hand already: the namespace path
    `nsp` (what `event_row` derives from the event and its task owner), whether it is
    a memory write, its slot (None unless a write) and its content digest."""
    s = ev.source
    mid = d.get("memory_id")
    tk = d.get("task_key")
    return {
        "position": position, "tenant": ev.tenant, "idempotency_key": ev.idempotency_key,
        "type": ev.type, "actor": ev.actor, "source_kind": s.kind, "source_id": s.id,
        "source_at": s.at, "source_seq": s.seq, "source_event_id": s.event_id,
        "order_key": ev.order, "slot": slot,
        "memory_id": None if mid is None else str(mid),
        "ns_path": nsp, "mkey": d.get("key"), "layer": d.get("layer"),
        "task_key": None if tk is None else str(tk),
        "supersedes": d.get("supersedes") if is_write else None,
        # A suppressed event keeps its envelope and digest, never its content (R22).
        "payload": None if suppressed else ev.encode(),
        "content_digest": dig, "recorded_at": recorded, "suppressed": suppressed,
        "redacted": False,
    }


class Appender:
    """One group-commit transaction: checks every request, then inserts in one go."""

    def __init__(self, store: Ledger, conn: AsyncConnection) -> None:
        self.store = store
        self.recorder = store.recorder
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
        #: Asked once per group: a filtered `log.debug` still costs microseconds per call,
        #: as much as a tenth of an event's own work on the append path.
        self.debug = log.is_enabled_for(logging.DEBUG)

    async def _prefetch(self, group: list[Request]) -> None:
        evs = [e for r in group for e in r.events]
        keys = sorted({(e.tenant, e.idempotency_key) for e in evs})
        tenants = sorted({e.tenant for e in evs})
        # A derived id needs no lookup: it is unique when its idempotency key is, and no
        # explicit id may take that form (validation). Targets of marks are looked up.
        mids = sorted({(e.tenant, e.memory_id) for e in evs
                       if e.memory_id and not e.has_derived_id})
        tks = sorted({(e.tenant, e.task_key) for e in evs if e.task_key})
        c, rec = self.conn, self.recorder
        for tenant, key, dig, pos, sup in await rec.known_keys(c, keys):
            self.idem[(tenant, key)] = (dig, pos, sup)
        for tenant, mid, path in await rec.memory_writers(c, mids):
            self.mem_owner[(tenant, mid)] = path
        for tenant, tk, path in await rec.task_owner_paths(c, tks):
            self.task_owner[(tenant, tk)] = path
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

    async def run(self, group: list[Request]
                  ) -> tuple[int, list[list[AppendResult] | BaseException]]:
        await self._prefetch(group)
        position, chain = await self.recorder.last_link(self.conn)
        outcomes: list[list[AppendResult] | BaseException] = []
        recorded = self.store.clock()
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
            await self.recorder.insert_events(self.conn, self.rows)
            if self.tomb_rows:
                await self.recorder.insert_tombstones(self.conn, self.tomb_rows)
            if self.owner_rows:
                # The recorder's view-row verb: on PostgreSQL one statement on the
                # driver's connection instead of SQLAlchemy's executemany.
                await self.recorder.write_rows(self.conn, t.task_owners, [
                    {"tenant": k[0], "task_key": k[1], "ns_path": v}
                    for k, v in self.owner_rows.items()])
        return position, outcomes

    async def _one(self, ev: Event, position: int, chain: str, recorded: str,
                   undo: _Undo) -> tuple[AppendResult, int, str]:
        # Runs once per appended event: each field and derived value of the event is read
        # once, into locals, and the row is built from them (`_row`) rather than from
        # the event again (`event_row`).
        dig = ev.content_digest
        tenant = ev.tenant
        ikey = (tenant, ev.idempotency_key)
        idem = self.idem
        prior = idem.get(ikey)
        if prior is not None:
            if prior[0] != dig:
                raise IdempotencyConflict(ev.idempotency_key)
            return AppendResult("duplicate", prior[1], prior[2]), position, chain
        etype = ev.type
        d = ev.data
        is_write = etype in MEMORY_WRITES
        owner_path: str | None = None
        if is_write:
            mkey = (tenant, d["memory_id"])
            if mkey in self.mem_owner:
                # Whose write holds it is not said: the same answer for the user's own
                # earlier write and for anyone else's (see `_UNUSABLE`).
                raise ValidationError("data.memory_id", f"memory_id {d['memory_id']!r} "
                                      f"is already used; {_UNUSABLE}")
        elif etype in _MARKS or (etype == "memory.forgotten" and "memory_id" in d):
            self._check_target_owner(ev, d["memory_id"])
        tk = d.get("task_key")
        task_key = None if tk is None else str(tk)
        is_task = etype in TASK_TYPES
        if task_key is not None and is_task:
            owner_path = self._check_task(ev, undo)
        nsp = _ns_path_of(d, owner_path)  # a write's: its namespace's
        slot = ev.slot if is_write else None
        target = slot if slot is not None else (task_key if is_task else None)
        if ev.expected_version is not None:
            if slot is None and task_key is None:
                raise ValidationError("expected_version", "applies only to memory writes "
                                      "and task events")
            actual = await self._count(slot if slot is not None else str(task_key),
                                       task=slot is None, tenant=tenant)
            if actual != ev.expected_version:
                # The key or task key the request named, never its namespace parts.
                label = (f"slot {d.get('key')!r}" if slot else f"task {task_key!r}")
                raise ConcurrencyConflict(label, ev.expected_version, actual)
        suppressed = self._covered(ev, nsp if is_write else owner_path, is_write)
        position += 1
        row = _row(ev, d, position, recorded, suppressed, nsp, is_write, slot, dig)
        chain = seal(row, chain)
        self.rows.append(row)
        # Neither key was there (checked above), so the undo entries say "absent".
        log_ = undo.log
        log_.append((idem, ikey, _MISSING))
        idem[ikey] = (dig, position, suppressed)
        if is_write:
            log_.append((self.mem_owner, mkey, _MISSING))
            self.mem_owner[mkey] = str(nsp)
        if target is not None and target in self.counts:
            undo.set(self.counts, target, self.counts[target] + 1)
        if etype in _TOMBSTONE_TYPES and not suppressed:
            ts = tombstone_of(ev, position)
            if ts is not None:
                self.tomb_rows.append(tombstone_row(ts))
                lst = self.tombs.setdefault(tenant, [])
                undo.set(self.tombs, tenant, [*lst, ts])
                self.register.append(register_entry(ev, position))
        if self.debug:
            log.debug("event_appended", tenant=tenant, position=position, type=etype,
                      suppressed=suppressed)
        return AppendResult("appended", position, suppressed), position, chain

    def _check_target_owner(self, ev: Event, memory_id: str) -> None:
        owner = self.mem_owner.get((ev.tenant, memory_id))
        if ev.source.kind not in USER_KINDS:
            return
        if owner is None or owner.split(NS_SEP)[1] != ev.actor:
            # One message for "no such memory" and "another user's memory": a user must
            # not learn what others hold. It names only what the request said.
            raise ValidationError("data.memory_id", f"no memory {memory_id!r} that "
                                  f"{ev.actor!r} may change")

    def _check_task(self, ev: Event, undo: _Undo) -> str | None:
        k = (ev.tenant, str(ev.task_key))
        owner = self.task_owner.get(k)
        if ev.type == "task.opened":
            path = ns_path(ev.data["namespace"])
            if owner is not None and owner != path:
                # Not "under another owner": the same answer whoever holds the key
                # (another user, or this user under another namespace).
                raise ValidationError("data.task_key", f"task {ev.task_key!r} cannot be "
                                      f"opened under this namespace; {_UNUSABLE_TASK}")
            if owner is None:
                undo.set(self.task_owner, k, path)
                undo.set(self.owner_rows, k, path)
            return path
        if ev.source.kind in USER_KINDS and (
                owner is None or owner.split(NS_SEP)[1] != ev.actor):
            raise ValidationError("data.task_key", f"no open task {ev.task_key!r} owned by "
                                  f"{ev.actor!r}; open it first (task.opened)")
        return owner

    def _covered(self, ev: Event, path: str | None, is_write: bool) -> bool:
        """Is the event covered by a tombstone of its tenant? `path`: a write's
        namespace path, or a task event's owner path."""
        tombs = self.tombs.get(ev.tenant)
        if not tombs:
            return False
        order = ev.order
        d = ev.data
        if is_write:
            v = Coordinates(ev.tenant, order, d["memory_id"], path, d["key"],
                            d.get("task_key"))
        elif ev.type in TASK_TYPES and ev.type != "task.purged":
            v = Coordinates(ev.tenant, order, ns_path=path, task_key=str(ev.task_key))
        else:
            return False
        return any(covers(ts, v) for ts in tombs)


def seal(row: dict[str, Any], prev: str) -> str:
    """Link a new row to the chain after `prev`; returns (and sets) its `chain`."""
    row["chain"] = chain_link(prev, row)
    return str(row["chain"])


async def record_unchecked(store: Ledger, conn: AsyncConnection, ev: Event) -> int:
    """Append one event without the append path's checks, inside a write transaction
    (`Store.write`), with its tombstone if it is a forget or purge; returns its
    position. For `replay.rebuild`: a register forget whose target is absent."""
    position, prev = await store.recorder.last_link(conn)
    position += 1
    row = event_row(ev, position, store.clock(), suppressed=False, owner_path=None)
    seal(row, prev)
    await store.recorder.insert_events(conn, [row])
    ts = tombstone_of(ev, position)
    if ts is not None:
        await store.recorder.insert_tombstones(conn, [tombstone_row(ts)])
    return position

