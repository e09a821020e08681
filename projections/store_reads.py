"""Reads for key-value store adapters (`memledger.langgraph`): rows of one tenant.

The SDK's reads answer one key of one principal; a store also lists a tenant's
namespaces and searches below a namespace prefix. The filters are the ones every read
applies (`projections.reads`): active, unexpired, not covered by any tombstone (the one
forget rule, `ledger.forgets.covers_sql`), and, for a principal-scoped store, the
principal's namespace prefix, in the SQL itself (R15, R20, R24).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
from sqlalchemy import bindparam, case, exists, func, select, true, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import NS_SEP
from ledger.store import Store
from projections.reads import not_expired, not_forgotten, unforgotten
from projections.sql import PointQuery, point_rows, prefix_match

_first = t.mem_versions.alias("first_version")
_deep = t.mem_versions.alias("deep_version")


def _first_of_slot(version: Any, order_key: Any, looked_up: Any) -> Any:
    """SQL: a live row's created key, `looked_up` (the slot's first unforgotten order
    key) evaluated only for a row that is not its slot's version 1.

    The memories view numbers a slot's rows by their effective order from 1
    (`projections.memory.resolve_slot`), and an active row of version 1 has no row of
    its slot with a smaller order key (every other row ranks after it and is a pending
    candidate, whose order key is its rank's; any other row would supersede it;
    tests/memledger/test_langgraph_created.py), so its created key is its own order
    key; a live row is unforgotten (every read tests its tombstones). Most items are
    written once: the look-up, a sub-select with its own tombstone test, is saved for
    them."""
    return case((version == 1, order_key), else_=looked_up)


def _created_key() -> Any:
    """SQL: the smallest order key among the slot's unforgotten versions (the first
    write since the key was last forgotten), of a live row."""
    f = _first.c
    mv = t.mem_versions.c
    # ORDER BY ... LIMIT 1, not min(): PostgreSQL has no min(bytea). The tenant test is
    # written so that no index serves it (`tenant || ''`): without statistics SQLite
    # chose `ix_mem_status` (tenant) over `ix_mem_slot` and read every version of the
    # tenant for each row (1-5 ms per LangGraph get on 5,000 items instead of ~25 us).
    return _first_of_slot(mv.version, mv.order_key, select(f.order_key).where(
        f.tenant.concat("") == mv.tenant, f.slot == mv.slot, unforgotten(f))
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
    if conn.dialect.name == "sqlite":
        q = q.where(*_range(mv.ns_path, prefix, prefix[:-1] + "\x20"))
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


# -- point reads on the calling thread (SQLite files; `projections.sql.point_rows`) ------
#: A row of `_columns()` as the driver returns it, with the columns as attributes.
Row = namedtuple("Row", ["memory_id", "ns_path", "mkey", "value", "order_key",  # type: ignore[misc]
                         "expires_us", "created_key"])
#: A row of `below_now`: no `created_key` (`created_now` gives it for a page), the slot
#: and the row's version (a version 1 row's created key is its order key: `first_of`).
BelowRow = namedtuple("BelowRow", ["memory_id", "ns_path", "mkey", "value",  # type: ignore[misc]
                                   "order_key", "expires_us", "slot", "version"])
#: A row of `page_now`: `BelowRow` and the slot's `created_key`.
PageRow = namedtuple("PageRow", ["memory_id", "ns_path", "mkey", "value",  # type: ignore[misc]
                                 "order_key", "expires_us", "slot", "created_key"])


#: The character after the namespace separator: a prefix `p` (ending in the separator)
#: is the range `p <= path < p[:-1] + _AFTER_SEP`.
_AFTER_SEP = chr(ord(NS_SEP) + 1)


def _range(col: Any, lo: Any, hi: Any) -> list[Any]:
    """SQL: `lo <= col < hi`, the bytewise range of a namespace path prefix ending in the
    separator (`projections.sql.prefix_range`): SQLite only, where TEXT compares
    bytewise; it lets `ix_mem_lookup` serve the prefix. It is the prefix test itself,
    not a hint beside one: a path in the range starts with `lo` (its characters up to
    the separator are `lo`'s, and the next one lies in [separator, `_AFTER_SEP`), which
    holds the separator only), and every path that starts with `lo` is in it
    (tests/memledger/test_langgraph_reads.py checks it against `startswith` for any
    labels). So the point reads test no `substr` beside it, for every row below the
    prefix (9 us of the 100 us of a search's statement over 100 rows, measured)."""
    return [col >= lo, col < hi]


def _point_live(owner: bool, tombstones: bool = True) -> list[Any]:
    """The live filters of the point reads; `tombstones=False` leaves out the tombstone
    test (a caller that tests the rows it keeps: the `window` page). The principal's
    prefix is the range of `owner` to `owner_hi` (`_range`, `_hi`)."""
    mv = t.mem_versions.c
    conds = [mv.tenant == bindparam("tenant"), mv.status == "active", mv.layer == "long",
             not_expired(bindparam("now"))]  # type: ignore[arg-type]
    if tombstones:
        conds.append(not_forgotten())
    if owner:
        conds.extend(_range(mv.ns_path, bindparam("owner"), bindparam("owner_hi")))
    return conds


def _below_prefix() -> list[Any]:
    """SQL (point reads): the row's namespace path starts with `prefix` (`_range` of
    `prefix` to `hi`, exact for a path that ends in the separator)."""
    return _range(t.mem_versions.c.ns_path, bindparam("prefix"), bindparam("hi"))


def _deeper() -> Any:
    """SQL (point reads): whether the tenant has an active long-term row in a namespace
    below `prefix` (a path in `prefix`'s range other than `prefix` itself), by
    `ix_mem_order`'s own columns. Without one, the rows below `prefix` are the rows of
    `prefix` itself (`window_now`). Expiry, tombstones and a principal's prefix are not
    tested: a row they would leave out only sends the search to the range's statement,
    which gives the same rows."""
    d = _deep.c
    return exists().where(d.tenant == bindparam("tenant"), d.ns_path > bindparam("prefix"),
                          d.ns_path < bindparam("hi"), d.status == "active",
                          d.layer == "long")


def _hi(prefix: str | None) -> str | None:
    """The upper bound of `_range` for a namespace path prefix (None stays None)."""
    if prefix is None:
        return None
    if not prefix.endswith(NS_SEP):
        raise ValueError(f"a namespace path prefix ends in the separator: {prefix!r}")
    return prefix[:-1] + _AFTER_SEP


def _first_key(slot: Any) -> Any:
    """SQL (point reads): the created key of `slot` (`_created_key` for a slot given
    as a column of a page or of a JSON list)."""
    f = _first.c
    # The planner cannot tell how many slots a page or json_each holds and would look
    # the versions up by tenant (every row of it): the tenant test is written so that no
    # index serves it (`tenant || ''`), which leaves the slot index.
    return select(f.order_key).where(
        f.tenant.concat("") == bindparam("tenant"), f.slot == slot, unforgotten(f)
    ).order_by(f.order_key).limit(1).scalar_subquery()


_POINT: dict[tuple[str, bool, bool], PointQuery] = {}


def _point(kind: str, owner: bool = False, limited: bool = False) -> PointQuery:
    got = _POINT.get((kind, owner, limited))
    if got is not None:
        return got
    mv = t.mem_versions.c
    if kind == "get":
        q = select(*_columns()).where(*_point_live(owner), mv.ns_path == bindparam("ns"),
                                      mv.mkey == bindparam("key"))
    elif kind == "below":
        q = select(mv.memory_id, mv.ns_path, mv.mkey, mv.value, mv.order_key, mv.expires_us,
                   mv.slot, mv.version).where(
            *_point_live(owner), *_below_prefix()).order_by(mv.order_key.desc(),
                                                            mv.memory_id)
        if limited:
            q = q.limit(bindparam("limit")).offset(bindparam("offset"))
    elif kind == "namespaces":
        q = select(mv.ns_path).where(*_point_live(owner)).distinct()
    elif kind == "page":
        # `below` paged by SQL, with each page row's created key: the created key's
        # look-up runs for the page's rows only (outside the LIMIT's subquery; in the
        # select list of the ordered query SQLite would compute it for every row before
        # the sort), in the same statement, so in the same snapshot as the rows.
        inner = select(mv.memory_id, mv.ns_path, mv.mkey, mv.value, mv.order_key,
                       mv.expires_us, mv.slot, mv.version).where(
            *_point_live(owner), *_below_prefix()).order_by(mv.order_key.desc(),
                                                            mv.memory_id).limit(
            bindparam("limit")).offset(bindparam("offset")).subquery("page")
        p = inner.c
        q = select(p.memory_id, p.ns_path, p.mkey, p.value, p.order_key, p.expires_us,
                   p.slot, _first_of_slot(p.version, p.order_key, _first_key(p.slot))
                   .label("created_key")).order_by(
            p.order_key.desc(), p.memory_id)
    elif kind in ("window", "window_exact"):
        # `page` for the first `limit` rows, with the tombstone test run on those rows
        # only (a column, `live`), not on every row below the prefix before the sort:
        # when all of them are live they are the page (`page_now`). `window_exact`:
        # the rows of the namespace `prefix` itself, read in order from `ix_mem_order`
        # up to the limit, beside whether any live-status row lies deeper (`_deeper`).
        exact = kind == "window_exact"
        inner = select(mv.tenant, mv.memory_id, mv.ns_path, mv.mkey, mv.task_key, mv.value,
                       mv.order_key, mv.expires_us, mv.slot, mv.version).where(
            *_point_live(owner, tombstones=False),
            *([mv.ns_path == bindparam("prefix")] if exact else _below_prefix())
        ).order_by(mv.order_key.desc(), mv.memory_id).limit(
            bindparam("limit")).subquery("page")
        p = inner.c
        q = select(p.memory_id, p.ns_path, p.mkey, p.value, p.order_key, p.expires_us,
                   p.slot, _first_of_slot(p.version, p.order_key, _first_key(p.slot))
                   .label("created_key"), unforgotten(p).label("live"))
        if exact:
            d = select(_deeper().label("deeper")).subquery("deeper")
            q = q.add_columns(d.c.deeper).select_from(d.outerjoin(inner, true()))
        q = q.order_by(p.order_key.desc(), p.memory_id)
    else:  # created: the created key of each slot of a JSON list (SQLite's json_each)
        page = func.json_each(bindparam("slots")).table_valued("value").alias("page")
        q = select(page.c.value, _first_key(page.c.value))
    got = _POINT[(kind, owner, limited)] = PointQuery(q)
    return got


def _owner_values(owner_prefix: str | None) -> dict[str, Any]:
    return {"owner": owner_prefix, "owner_hi": _hi(owner_prefix)}


def get_now(store: Store, tenant: str, target: tuple[str, str], *, now_us: int,
            owner_prefix: str | None = None) -> list[Any] | None:
    """`get_many` of one `(ns_path, key)` on the calling thread where the backend can;
    None where it cannot (then await `get_many`). The same filters, in the SQL."""
    vals = {"tenant": tenant, "now": now_us, "ns": target[0], "key": target[1],
            **_owner_values(owner_prefix)}
    rows = point_rows(store, _point("get", owner_prefix is not None), vals)
    return None if rows is None else [Row._make(r) for r in rows]


def below_now(store: Store, tenant: str, prefix: str, *, now_us: int,
              owner_prefix: str | None = None, limit: int | None = None,
              offset: int = 0, opened: bool = True) -> Iterator[Any] | None:
    """`below` on the calling thread where the backend can (None where it cannot), as
    rows made when iterated, without `created_key`: `created_now` gives it for the
    rows a caller keeps, so a search that pages or filters in Python looks it up for
    its page only. `opened=False`: the values as stored (sealed), for a caller that
    opens the few it decodes (`value_opener`). `prefix` ends in the separator (a
    namespace path)."""
    vals = {"tenant": tenant, "now": now_us, "prefix": prefix, "hi": _hi(prefix),
            "limit": limit, "offset": offset, **_owner_values(owner_prefix)}
    rows = point_rows(store, _point("below", owner_prefix is not None, limit is not None),
                      vals, opened=opened)
    return None if rows is None else map(BelowRow._make, rows)  # made as they are used


def window_now(store: Store, tenant: str, prefix: str, *, now_us: int, limit: int,
               owner_prefix: str | None = None) -> tuple[list[Any], bool] | None:
    """The newest `limit` rows below `prefix` that are active, long-term and unexpired,
    with each row's `created_key` (`PageRow`s, values as stored), in one statement on
    the calling thread, and whether none of them is covered by a tombstone; None where
    point reads are not available.

    The tombstone test runs on these rows only, not on every row below the prefix
    before the sort (four index seeks a row: 31 us of a 131 us statement over 100
    rows, measured). When it passes for all of them (almost always: a forget's rows
    leave the active status once it is projected) they are the newest `limit` rows of
    the fully filtered query (`below`), in the same snapshot; when one is covered the
    caller reads the fully filtered query instead (another statement)."""
    vals = {"tenant": tenant, "now": now_us, "prefix": prefix, "hi": _hi(prefix),
            "limit": limit, **_owner_values(owner_prefix)}
    owner = owner_prefix is not None
    # First the namespace `prefix` itself, read in order by `ix_mem_order` up to the
    # limit (30 us for 10 of 100 rows, against 93 us for the range read and sorted),
    # in one statement with whether any row lies deeper (always one row: the page's
    # columns are NULL where it is empty). Without a deeper row these are the rows
    # below the prefix, in the same snapshot; with one (a search of a parent
    # namespace) the range's statement answers.
    exact = point_rows(store, _point("window_exact", owner), vals, opened=False)
    if exact is None:
        return None
    if exact[0][-1]:  # a row lies deeper
        window = point_rows(store, _point("window", owner), vals, opened=False)
        if window is None:
            return None
    else:
        window = [r[:-1] for r in exact if r[0] is not None]
    return [PageRow._make(r[:-1]) for r in window], all(r[-1] for r in window)


def page_now(store: Store, tenant: str, prefix: str, *, now_us: int, limit: int,
             offset: int = 0, owner_prefix: str | None = None) -> list[Any] | None:
    """A page of `below` (`limit` rows from `offset`, newest first) with each row's
    `created_key`, in one statement on the calling thread; None where point reads are
    not available. The values as stored (`value_opener` opens them)."""
    # The newest `offset + limit` rows with the tombstone test on them only: when none
    # is covered (almost always) they are the rows the filtered query would give, in
    # the same snapshot; else the filtered query pages it (another statement).
    got = window_now(store, tenant, prefix, now_us=now_us, limit=offset + limit,
                     owner_prefix=owner_prefix)
    if got is None:
        return None
    window, live = got
    if live:
        return window[offset:]
    vals = {"tenant": tenant, "now": now_us, "prefix": prefix, "hi": _hi(prefix),
            "limit": limit, "offset": offset, **_owner_values(owner_prefix)}
    rows = point_rows(store, _point("page", owner_prefix is not None), vals, opened=False)
    return None if rows is None else [PageRow._make(r) for r in rows]


def namespaces_now(store: Store, tenant: str, *, now_us: int,
                   owner_prefix: str | None = None) -> list[str] | None:
    """`namespaces` on the calling thread where the backend can; None where it cannot
    (then await `namespaces`). The same filters, in the SQL."""
    rows = point_rows(store, _point("namespaces", owner_prefix is not None),
                      {"tenant": tenant, "now": now_us, **_owner_values(owner_prefix)})
    return None if rows is None else [r[0] for r in rows]


def first_of(rows: Sequence[Any]) -> dict[str, bytes]:
    """The created keys that `below_now` rows give without a look-up: a version 1
    row's own order key (`_first_of_slot`), by slot."""
    return {r.slot: r.order_key for r in rows if r.version == 1}


def created_now(store: Store, tenant: str, slots: Sequence[str]) -> dict[str, bytes] | None:
    """The created key (`_created_key`: the first unforgotten version's order key) of
    each slot, on the calling thread; None where point reads are not available. A
    caller asks for the slots `first_of` does not answer."""
    if not slots:
        return {}
    rows = point_rows(store, _point("created"), {
        "tenant": tenant, "slots": orjson.dumps(sorted(set(slots))).decode()})
    return None if rows is None else {r[0]: r[1] for r in rows if r[1] is not None}
