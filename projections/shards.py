"""Projections sharded by tenant: which shard an event belongs to, and where shards stand.

Every projection is split into S shards (the `meta` row `shards`, default 16) by a
stable hash of the tenant: the first four bytes of the MD5 of its UTF-8 name, as an
unsigned integer, modulo S. Every view row belongs to one tenant, so two shards never
write the same rows, and a shard's batch may run beside another's.

The hash is computed, not stored: PostgreSQL computes the same number in SQL
(`projections.sql.shard_filter`) to filter a shard's events in the statement that
reads them, and events stay immutable (a stored shard number would tie every row to
one S, and `memledger shards set` would have to rewrite the ledger). SQLite filters in
Python: its write lock is global, so there shards take turns anyway.

Where a shard stands: its row in `shard_checkpoints` if it has moved on its own, else
its projection's `checkpoints` position (the *base*). A projection's position as a whole
(what `status`, `project` and the SDK's waits read) is its slowest shard's.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.recorder import STORED_COLUMNS
from ledger.records import StoredEvent, stored_from_row
from ledger.store import Store
from projections.sql import prepared, shard_filter

#: Shards per projection when the ledger records none.
DEFAULT_SHARDS: Final = 16
#: The most shards `memledger shards set` accepts.
MAX_SHARDS: Final = 1024
#: `meta` row holding S.
SHARDS_META: Final = "shards"


@lru_cache(maxsize=65536)
def tenant_hash(tenant: str) -> int:
    """The tenant's stable hash: the MD5 of its UTF-8 name, first four bytes, unsigned."""
    digest = hashlib.md5(tenant.encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[:4], "big")


def shard_of(tenant: str, count: int) -> int:
    """The shard (0..count-1) of a tenant's events and view rows."""
    return tenant_hash(tenant) % count


async def shard_count(conn: AsyncConnection) -> int:
    """S of this ledger (`meta` row `shards`; default `DEFAULT_SHARDS`)."""
    q = prepared("shards.count", lambda: select(t.meta.c.value).where(
        t.meta.c.name == SHARDS_META))
    row = (await conn.execute(q)).first()
    return int(row[0]) if row is not None else DEFAULT_SHARDS


async def write_shard_count(conn: AsyncConnection, count: int) -> None:
    """Record S (inside `conn`'s transaction); every shard checkpoint row goes with the old
    S (the caller rebuilds the views: `replay.rebuild.set_shards`)."""
    if not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"shard count {count} out of range 1..{MAX_SHARDS}")
    await conn.execute(t.meta.delete().where(t.meta.c.name == SHARDS_META))
    await conn.execute(t.meta.insert().values(name=SHARDS_META, value=str(count)))
    await conn.execute(t.shard_checkpoints.delete())


@dataclass(frozen=True, slots=True)
class Scope:
    """The shards a batch covers: `shards` of `count` (None: all of them)."""

    count: int
    shards: frozenset[int] | None = None

    def covers(self, tenant: str) -> bool:
        """Is the tenant's shard in this scope?"""
        return self.shards is None or shard_of(tenant, self.count) in self.shards

    def members(self) -> list[int]:
        """The shard numbers of the scope, in order."""
        return sorted(self.shards) if self.shards is not None else list(range(self.count))


_SCOPE: ContextVar[Scope | None] = ContextVar("memledger_shard_scope", default=None)


def current_scope() -> Scope | None:
    """The scope of the batch being applied (set by the runner; None outside a batch)."""
    return _SCOPE.get()


@contextlib.contextmanager
def in_scope(scope: Scope) -> Iterator[None]:
    """Apply a batch of this scope: projections that keep per-shard bookkeeping of their
    own (`projections.vectors`) read it with `current_scope`."""
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)


async def shard_positions(conn: AsyncConnection, names: Sequence[str], count: int,
                          shards: Iterable[int] | None = None) -> dict[str, dict[int, int]]:
    """Where each shard of the named projections stands (no lock): `{name: {shard: p}}`."""
    cp, sc = t.checkpoints.c, t.shard_checkpoints.c
    wanted = sorted(set(shards)) if shards is not None else list(range(count))
    base = {r[0]: int(r[1]) for r in (await conn.execute(
        select(cp.name, cp.position).where(cp.name.in_(list(names))))).all()}
    q = select(sc.projection, sc.shard, sc.position).where(sc.projection.in_(list(names)))
    rows = (await conn.execute(q)).all()
    out = {n: dict.fromkeys(wanted, base.get(n, 0)) for n in names}
    for name, shard, pos in rows:
        k = int(shard)
        if k in out[name]:
            out[name][k] = max(out[name][k], int(pos))
    return out


async def low_watermarks(conn: AsyncConnection, names: Sequence[str]) -> dict[str, int]:
    """Each projection's slowest shard: every event at or before it is applied."""
    count = await shard_count(conn)
    at = await shard_positions(conn, names, count)
    return {n: min(at[n].values()) for n in names}


async def read_events(store: Store, conn: AsyncConnection, after: int, limit: int,
                      upto: int, types: Sequence[str] | None,
                      scope: Scope) -> tuple[list[StoredEvent], int]:
    """Up to `limit` events of the scope's shards in (after, upto], in position order,
    and the position up to which every event of those shards has been read.

    PostgreSQL filters in the statement; SQLite reads every shard's events and keeps
    the scope's (the limit then counts them all).
    """
    ev = t.events.c
    q = select(*STORED_COLUMNS).where(ev.position > after, ev.position <= upto)
    if types is not None:
        q = q.where(ev.type.in_(list(types)))
    cond = None if scope.shards is None else shard_filter(
        store, ev.tenant, scope.count, sorted(scope.shards))
    if cond is not None:
        q = q.where(cond)
    rows = (await conn.execute(q.order_by(ev.position).limit(limit))).all()
    events = [stored_from_row(r) for r in rows]
    reached = upto if len(events) < limit else events[-1].position
    if cond is None:
        events = [se for se in events if scope.covers(se.tenant)]
    return events, reached
