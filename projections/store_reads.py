"""Reads for key-value store adapters (`memledger.langgraph`): rows of one tenant.

The SDK's reads answer one key of one principal; a store also lists a tenant's
namespaces and searches below a namespace prefix. The filters are the ones every read
applies (`projections.reads`): active, unexpired, not covered by any tombstone (the one
forget rule, `ledger.forgets.covers_sql`), and, for a principal-scoped store, the
principal's namespace prefix, in the SQL itself (R15, R20, R24).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.forgets import covers_sql
from projections.reads import not_expired, not_forgotten
from projections.sql import prefix_match

_first = t.mem_versions.alias("first_version")


def _created_key() -> Any:
    """SQL: the smallest order key among the slot's unforgotten versions (the first
    write since the key was last forgotten)."""
    f = _first.c
    # ORDER BY ... LIMIT 1, not min(): PostgreSQL has no min(bytea)
    return (select(f.order_key).where(
        f.tenant == t.mem_versions.c.tenant, f.slot == t.mem_versions.c.slot,
        ~select(t.tombstones.c.position).where(
            covers_sql(t.tombstones.c, f)).exists())
        .order_by(f.order_key).limit(1).scalar_subquery())


def _columns() -> list[Any]:
    mv = t.mem_versions.c
    return [mv.memory_id, mv.ns_path, mv.mkey, mv.value, mv.order_key, mv.expires_us,
            _created_key().label("created_key")]


def _live(tenant: str, now_us: int, owner_prefix: str | None) -> list[Any]:
    mv = t.mem_versions.c
    conds = [mv.tenant == tenant, mv.status == "active", mv.layer == "long",
             not_expired(now_us), not_forgotten()]
    if owner_prefix is not None:
        conds.append(prefix_match(mv.ns_path, owner_prefix))
    return conds


async def get_many(conn: AsyncConnection, tenant: str, targets: Sequence[tuple[str, str]], *,
                   now_us: int, owner_prefix: str | None = None) -> list[Any]:
    """The live long-term rows of `(ns_path, key)` pairs (a principal's only, if given)."""
    if not targets:
        return []
    mv = t.mem_versions.c
    q = select(*_columns()).where(*_live(tenant, now_us, owner_prefix))
    if len(targets) == 1:
        q = q.where(mv.ns_path == targets[0][0], mv.mkey == targets[0][1])
    else:
        q = q.where(tuple_(mv.ns_path, mv.mkey).in_(list(targets)))
    return list((await conn.execute(q)).all())


async def below(conn: AsyncConnection, tenant: str, prefix: str, *, now_us: int,
                owner_prefix: str | None = None, limit: int | None = None,
                offset: int = 0) -> list[Any]:
    """Live long-term rows whose namespace path starts with `prefix`, newest first."""
    mv = t.mem_versions.c
    q = select(*_columns()).where(*_live(tenant, now_us, owner_prefix),
                                  prefix_match(mv.ns_path, prefix))
    q = q.order_by(mv.order_key.desc(), mv.memory_id)
    if limit is not None:
        q = q.limit(limit).offset(offset)
    return list((await conn.execute(q)).all())


async def namespaces(conn: AsyncConnection, tenant: str, *, now_us: int,
                     owner_prefix: str | None = None) -> list[str]:
    """The namespace paths that hold at least one live long-term row."""
    mv = t.mem_versions.c
    q = select(mv.ns_path).where(*_live(tenant, now_us, owner_prefix)).distinct()
    return [r[0] for r in (await conn.execute(q)).all()]


async def expired(conn: AsyncConnection, tenant: str, *, now_us: int) -> list[tuple[str, str]]:
    """`(ns_path, key)` of long-term rows that expired and were not forgotten yet."""
    mv = t.mem_versions.c
    q = select(mv.ns_path, mv.mkey).where(
        mv.tenant == tenant, mv.status == "active", mv.layer == "long",
        mv.expires_us.is_not(None), mv.expires_us <= now_us, not_forgotten())
    return sorted({(r[0], r[1]) for r in (await conn.execute(q)).all()})
