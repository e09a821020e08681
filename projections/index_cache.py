"""The principals' vector indexes, cached: loaded from the `vectors` view, patched with
what changed since, bounded in bytes (`MEMLEDGER_RECALL_CACHE_MB`); and their snapshot
files written by the projection side after a bulk catch-up (`write_snapshots`), so the
first recall after `memledger project` maps a file instead of loading the user.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import structlog
from sqlalchemy import BigInteger, Integer, String, and_, bindparam, cast, func, literal, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import ns_parts
from ledger.store import Store
from projections import matrix_snapshot, reads
from projections.embedding import Embedder
from projections.principal_index import Group, PrincipalIndex, norm_key
from projections.shards import DEFAULT_SHARDS, SHARDS_META, tenant_hash
from projections.sql import PointQuery, point_rows, prefix_match, prefix_range
from projections.vectors import (
    PENDING_META,
    TASK_PREFIX,
    columns_from_blobs,
    from_blobs,
    memory_ids_of_slots,
    slots_of,
    store_embedder,
    touched,
)

log = structlog.get_logger("memledger.recall")

#: Writes newer than the index considered directly: at most this many, this recent
#: (`projections.candidates`); a cached index this far behind is patched, not reloaded.
LAG_WINDOW: Final = 5000
#: A cached index is patched for at most this many new events, else reloaded.
REFRESH_MAX: Final = 2000
CACHE_ENV: Final = "MEMLEDGER_RECALL_CACHE_MB"


class IndexCache:
    """An LRU of principal indexes, bounded in bytes (`MEMLEDGER_RECALL_CACHE_MB`)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        mb = int(os.environ.get(CACHE_ENV, "1024"))
        self.max_bytes = max_bytes if max_bytes is not None else mb * 1024 * 1024
        self._items: OrderedDict[tuple[str, ...], PrincipalIndex] = OrderedDict()
        self._bytes = 0
        self.loads = 0
        self.patches = 0
        self.snapshot_loads = 0  # indexes mapped from a snapshot file (`matrix_snapshot`)

    def get(self, key: tuple[str, ...]) -> PrincipalIndex | None:
        """The cached index, marked as recently used."""
        idx = self._items.get(key)
        if idx is not None:
            self._items.move_to_end(key)
        return idx

    def put(self, key: tuple[str, ...], idx: PrincipalIndex) -> None:
        """Cache an index, evicting the least recently used beyond the byte bound."""
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._items[key] = idx
        self._bytes += idx.nbytes
        while self._bytes > self.max_bytes and len(self._items) > 1:
            _, gone = self._items.popitem(last=False)
            self._bytes -= gone.nbytes

    def clear(self) -> None:
        """Forget every cached index."""
        self._items.clear()
        self._bytes = 0


CACHE = IndexCache()


@dataclass(frozen=True, slots=True)
class Positions:
    vectors: int  # the `vectors` checkpoint
    stamp: float  # when its last step committed (tells a same-position rebuild apart)
    pending: int | None  # start of the range the index could not settle, if any
    head: int  # the ledger's head


def _positions_statement() -> Any:
    cp, meta, sc = t.checkpoints.c, t.meta.c, t.shard_checkpoints.c
    count = func.coalesce(select(cast(meta.value, Integer)).where(
        meta.name == SHARDS_META).scalar_subquery(), DEFAULT_SHARDS)
    shard = bindparam("tenant_hash", type_=BigInteger) % count
    mine = (sc.projection == "vectors") & (sc.shard == shard)
    pending = select(func.min(cast(meta.value, BigInteger))).where(
        (meta.name == PENDING_META)
        | (meta.name == literal(PENDING_META + ".") + cast(shard, String))).scalar_subquery()
    return select(
        select(cp.position).where(cp.name == "vectors").scalar_subquery(),
        select(cp.updated_at).where(cp.name == "vectors").scalar_subquery(),
        select(sc.position).where(mine).scalar_subquery(),
        select(sc.updated_at).where(mine).scalar_subquery(),
        pending,
        select(func.max(t.events.c.position)).scalar_subquery())


#: Built and compiled once (every recall runs it first); point reads on SQLite files.
_POSITIONS: Final = PointQuery(_positions_statement())


async def read_positions(conn: AsyncConnection, tenant: str, store: Store | None = None
                         ) -> Positions:
    """Where the tenant's shard of the index and the ledger stand, in one round trip
    (on the calling thread for a SQLite file when `store` is given).

    The index of a tenant is as far as its shard of the `vectors` projection
    (`projections.shards`): its own row if it moved on its own, else the base.
    """
    values = {"tenant_hash": tenant_hash(tenant)}
    got = point_rows(store, _POSITIONS, values) if store is not None else None
    row = got[0] if got else (await conn.execute(_POSITIONS.stmt, values)).one()
    position = max(int(row[0] or 0), int(row[2] or 0))
    stamp = max(float(row[1] or 0.0), float(row[3] or 0.0))
    return Positions(position, stamp, int(row[4]) if row[4] is not None else None,
                     int(row[5] or 0))


async def principal_index(conn: AsyncConnection, store: Store, who: reads.Principal,
                          emb: Embedder, at: Positions | None = None) -> PrincipalIndex:
    """The principal's vectors at the current `vectors` checkpoint (cached).

    Not cached in this process: its snapshot file (`projections.matrix_snapshot`), if
    any, is mapped and then treated like a cached index (used as it is, patched
    forward, or reloaded); a full load writes a new snapshot, and so does a patch that
    leaves the file `SNAPSHOT_BEHIND` positions behind.
    """
    at = at or await read_positions(conn, who.tenant)
    key = (store.url, who.tenant, who.user, emb.name)
    cached = CACHE.get(key)
    if cached is None:
        cached = matrix_snapshot.load(store, who.tenant, who.prefix, emb.name, emb.dim)
        if cached is not None:
            CACHE.snapshot_loads += 1
            cached.saved_at = cached.position
    # The step time tells a rebuild that ended at the same position from no change.
    if cached is not None and (cached.position, cached.stamp) == (at.vectors, at.stamp):
        CACHE.put(key, cached)
        return cached
    if cached is not None and at.pending is None and cached.pending is None \
            and cached.position < at.vectors <= cached.position + LAG_WINDOW \
            and await _refresh(conn, store, who, emb, cached, at.vectors):
        cached.position, cached.stamp = at.vectors, at.stamp
        CACHE.put(key, cached)  # its size may have changed
        if cached.saved_at is not None and cached.position - cached.saved_at > SNAPSHOT_BEHIND:
            _save_snapshot(store, who, cached, matrix_snapshot.generation(
                matrix_snapshot.directory(store.url)))
        return cached
    gen = matrix_snapshot.generation(matrix_snapshot.directory(store.url))
    idx = await _load_index(conn, store, who, emb, at.vectors, at.pending)
    idx.stamp = at.stamp
    CACHE.put(key, idx)
    _save_snapshot(store, who, idx, gen)
    return idx


#: A snapshot this far behind the index patched from it is written again.
SNAPSHOT_BEHIND: Final = LAG_WINDOW // 4


def _save_snapshot(store: Store, who: reads.Principal, idx: PrincipalIndex, gen: int) -> None:
    """Write the index's snapshot in a worker thread (SQLite files, snapshots on)."""
    if idx.pending is not None or matrix_snapshot.directory(store.url) is None \
            or not matrix_snapshot.enabled():
        return
    idx.saved_at = idx.position
    matrix_snapshot.save_soon(store, who.tenant, who.prefix, idx, gen)


def _index_rows(who: reads.Principal, store: Store) -> Any:
    """SELECT of the principal's index entries, with key and source order beside."""
    vc, mv = t.vectors.c, t.mem_versions.c
    # The range lets the (tenant, ns_path) index serve the prefix where it can.
    conds = [vc.tenant == who.tenant, prefix_match(vc.ns_path, who.prefix),
             *prefix_range(store, vc.ns_path, who.prefix)]
    return (select(vc.item_id, vc.kind, vc.layer, vc.task_key, vc.session_id, vc.model,
                   vc.dim, vc.vector, mv.mkey, mv.order_key)
            .select_from(t.vectors.outerjoin(t.mem_versions, and_(
                mv.tenant == vc.tenant, mv.memory_id == vc.item_id)))
            .where(*conds))


async def _refresh(conn: AsyncConnection, store: Store, who: reads.Principal, emb: Embedder,
                   idx: PrincipalIndex, position: int) -> bool:
    """Patch the cached index with what changed in (idx.position, position].

    Uses the projection's own notion of what a run of events touches (`touched`,
    `slots_of`), restricted to this principal. Returns False when a full reload is the
    better choice (a prefix forget, many changes, many removed rows).
    """
    events = [se for se in await store.read_events(conn, idx.position, REFRESH_MAX + 1,
                                                   upto=position)
              if se.tenant == who.tenant]
    if len(events) > REFRESH_MAX:
        return False
    mine = [se for se in events if _concerns(se, who, idx)]
    seen = {se.position for se in mine}
    unknown = sorted({se.memory_id for se in events if se.ns_path is None
                      and se.memory_id and se.position not in seen})
    if unknown:  # supersessions or confirmations of ids the index does not hold
        mv = t.mem_versions.c
        q = select(mv.memory_id).where(mv.tenant == who.tenant, mv.memory_id.in_(unknown),
                                       prefix_match(mv.ns_path, who.prefix))
        theirs = {r[0] for r in (await conn.execute(q)).all()}
        mine.extend(se for se in events if se.memory_id in theirs and se.ns_path is None)
    if not mine:
        return True
    if any(se.type == "memory.forgotten" and se.mkey is None and se.memory_id is None
           for se in mine):
        return False  # a namespace-prefix forget: reload
    touch = touched(mine)
    tombs = await touch.tombstones(store, conn, position)
    ids = {m for _, m in await memory_ids_of_slots(
        conn, await slots_of(conn, touch.mem_ids, touch.slots, tombs))}
    ids.update(m for _, m in touch.mem_ids)
    vc = t.vectors.c
    rows: list[Any] = []
    for chunk in _chunk_list(sorted(ids)):
        q = _index_rows(who, store).where(vc.item_id.in_(chunk), vc.kind == "memory",
                                          vc.model == emb.name, vc.dim == emb.dim)
        rows.extend((await conn.execute(q)).all())
    for m in ids:
        idx.remove(m)
    vecs = from_blobs([bytes(r.vector) for r in rows], emb.dim)
    for r, vec in zip(rows, vecs, strict=True):
        idx.add(r, vec)
    if touch.tasks or tombs:
        q = _index_rows(who, store).where(vc.kind == "task", vc.model == emb.name,
                                          vc.dim == emb.dim)
        tasks = (await conn.execute(q)).all()
        idx.task_ids = [r.item_id[len(TASK_PREFIX):] for r in tasks]
        idx.task_matrix = from_blobs([bytes(r.vector) for r in tasks], emb.dim)
    CACHE.patches += 1
    return idx.dead <= max(1024, idx.n // 4)  # past that, compact by reloading


def _concerns(se: Any, who: reads.Principal, idx: PrincipalIndex) -> bool:
    """Is the event about this principal's namespaces (or an id its index holds)?"""
    if se.ns_path is not None:
        return bool(se.ns_path.startswith(who.prefix) or who.prefix.startswith(se.ns_path))
    return se.memory_id is not None and idx.has(se.memory_id)


def _chunk_list(items: Sequence[str], n: int = 400) -> list[Sequence[str]]:
    return [items[i:i + n] for i in range(0, len(items), n)]


def _point_index_rows() -> Any:
    """`_index_rows` with the principal as bound values, for `point_rows` (SQLite: the
    range on `ns_path` lets the (tenant, ns_path) index serve the prefix)."""
    vc, mv = t.vectors.c, t.mem_versions.c
    prefix = bindparam("prefix", type_=String)
    return (select(vc.item_id, vc.kind, vc.layer, vc.task_key, vc.session_id, vc.model,
                   vc.dim, vc.vector, mv.mkey, mv.order_key)
            .select_from(t.vectors.outerjoin(t.mem_versions, and_(
                mv.tenant == vc.tenant, mv.memory_id == vc.item_id)))
            .where(vc.tenant == bindparam("tenant", type_=String),
                   func.substr(vc.ns_path, 1, bindparam("prefix_len", type_=Integer)) == prefix,
                   vc.ns_path >= prefix, vc.ns_path < bindparam("prefix_end", type_=String)))


_INDEX_ROWS: Final = PointQuery(_point_index_rows())
# Columns of an index row (`_index_rows`), by position.
_ID, _KIND, _LAYER, _TASK, _SESSION, _MODEL, _DIM, _VEC, _KEY, _ORDER = range(10)


async def _index_row_tuples(conn: AsyncConnection, store: Store, who: reads.Principal
                            ) -> Sequence[Sequence[Any]]:
    """Every index row of the principal: on the calling thread for a SQLite file (plain
    `sqlite3` tuples, no thread hop, no SQLAlchemy row objects), else asynchronously."""
    got = point_rows(store, _INDEX_ROWS, {
        "tenant": who.tenant, "prefix": who.prefix, "prefix_len": len(who.prefix),
        "prefix_end": who.prefix[:-1] + "\x20"})
    if got is not None:
        return got
    return (await conn.execute(_index_rows(who, store))).all()


async def _load_index(conn: AsyncConnection, store: Store, who: reads.Principal,
                      emb: Embedder, position: int, pending: int | None) -> PrincipalIndex:
    rows = await _index_row_tuples(conn, store, who)
    CACHE.loads += 1
    name, dim = emb.name, emb.dim
    ids: list[str] = []
    keys: list[str] = []
    orders: list[bytes] = []
    blobs: list[bytes] = []
    tasks: list[Sequence[Any]] = []
    grouped: dict[tuple[str, str], list[Sequence[Any]]] = {}
    other = 0
    # One pass, by position: a row object per entry costs more than the read itself.
    for r in rows:
        if r[_MODEL] != name or r[_DIM] != dim:
            other += 1
        elif r[_KIND] == "memory":
            layer = r[_LAYER]
            if layer == "long":
                ids.append(r[_ID])
                keys.append(r[_KEY] or "")
                orders.append(bytes(r[_ORDER]) if r[_ORDER] is not None else b"")
                blobs.append(r[_VEC])
            else:
                gk = (layer, (r[_TASK] if layer == "task" else r[_SESSION]) or "")
                grouped.setdefault(gk, []).append(r)
        elif r[_KIND] == "task":
            tasks.append(r)
    del rows
    if other:
        log.warning("vectors_of_other_model", entries=other, model=emb.name,
                    hint="run `memledger replay rebuild --projection vectors`")
    n = len(ids)
    key_rows: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        key_rows.setdefault(norm_key(k), []).append(i)
    # Room for 1/16 more rows, so new writes are appended without copying the matrix.
    capacity = n + max(64, n // 16)
    return PrincipalIndex(
        position=position, pending=pending, model=emb.name, dim=emb.dim,
        columns=columns_from_blobs(blobs, dim, capacity=capacity),
        n=n, alive=np.arange(capacity) < n, ids=ids, keys=keys, orders=orders,
        row_of={m: i for i, m in enumerate(ids)}, key_rows=key_rows,
        groups={k: Group([r[_ID] for r in g], [r[_KEY] or "" for r in g],
                         columns_from_blobs([bytes(r[_VEC]) for r in g], dim))
                for k, g in grouped.items()},
        task_ids=[r[_ID][len(TASK_PREFIX):] for r in tasks],
        task_matrix=from_blobs([bytes(r[_VEC]) for r in tasks], dim),
        other_models=other)


# -- snapshots written by the projection side ------------------------------------------

#: Events of one principal in a catch-up from which its snapshot is written after it
#: (`MEMLEDGER_RECALL_SNAPSHOT_MIN`): the recall's own rewrite threshold. Below it a
#: principal's load from the database is short anyway (about 30 us a row on SQLite).
SNAPSHOT_MIN_ENV: Final = "MEMLEDGER_RECALL_SNAPSHOT_MIN"


def snapshot_min() -> int:
    """Events of a principal in one catch-up that make it write the snapshot (>= 1;
    the default when the variable is not a number: a typo must not stop a catch-up)."""
    try:
        return max(1, int(os.environ.get(SNAPSHOT_MIN_ENV, str(SNAPSHOT_BEHIND))))
    except ValueError:
        return SNAPSHOT_BEHIND


def _worth(start: int, end: int, min_events: int) -> bool:
    """Can a catch-up over (start, end] call for a snapshot: as many events as one
    principal needs, or enough to leave an existing file too far behind to patch?"""
    return end - start >= min(min_events, REFRESH_MAX + 1)


def _principal_counts() -> Any:
    """(tenant, ns_path, events) of the events in a range of positions."""
    e = t.events.c
    return (select(e.tenant, e.ns_path, func.count())
            .where(e.position > bindparam("start"), e.position <= bindparam("end"),
                   e.ns_path.is_not(None))
            .group_by(e.tenant, e.ns_path))


async def snapshot_candidates(store: Store, start: int, end: int, min_events: int,
                              model: str) -> list[reads.Principal]:
    """The principals whose snapshot a catch-up over (start, end] should write: those
    with at least `min_events` events in it, and those whose file (a recall wrote it)
    the range leaves too far behind to patch (`REFRESH_MAX`); never one whose file of
    `model` is within `SNAPSHOT_BEHIND` of `end` (a recall patches that much itself,
    the rule by which it rewrites a file)."""
    async with store.read_once() as conn:
        rows = (await conn.execute(_principal_counts(), {"start": start, "end": end})).all()
    counts: dict[tuple[str, str], int] = {}
    for tenant, path, n in rows:
        parts = ns_parts(path)
        if len(parts) >= 2 and parts[0] == tenant:
            counts[(tenant, parts[1])] = counts.get((tenant, parts[1]), 0) + int(n)
    chosen = {k for k, n in counts.items() if n >= min_events}
    if end - start > REFRESH_MAX:
        for path in matrix_snapshot.all_files(matrix_snapshot.directory(store.url)):
            h = matrix_snapshot.held_header(path)
            if h is None or int(h["position"]) + REFRESH_MAX >= end:
                continue
            parts = ns_parts(h["prefix"])
            if len(parts) == 2 and parts[0] == h["tenant"]:
                chosen.add((parts[0], parts[1]))
    d = matrix_snapshot.directory(store.url)
    out = []
    for tenant, user in sorted(chosen):
        who = reads.Principal(tenant, user)
        held = None if d is None else matrix_snapshot.held_position(
            matrix_snapshot.path_for(d, tenant, who.prefix, model))
        if held is None or held < end - SNAPSHOT_BEHIND:
            out.append(who)
    return out


async def write_snapshot(store: Store, who: reads.Principal, emb: Embedder) -> bool:
    """Load the principal's index from the view and write its snapshot (not cached:
    a projector would otherwise hold every user's matrix). False when it was not
    written (`matrix_snapshot.save`'s refusals: a rebuild or a forget since the load,
    a newer file; or the index awaits vectors still pending)."""
    gen = matrix_snapshot.generation(matrix_snapshot.directory(store.url))
    async with store.read() as conn:
        at = await read_positions(conn, who.tenant, store)
        if at.pending is not None:
            return False
        idx = await _load_index(conn, store, who, emb, at.vectors, None)
    idx.stamp = at.stamp
    im = matrix_snapshot.image(who.tenant, who.prefix, idx)
    del idx
    path = await asyncio.get_running_loop().run_in_executor(
        None, matrix_snapshot.save, store, im, gen)
    return path is not None


async def write_snapshots(store: Store, start: int, end: int, *,
                          min_events: int | None = None) -> list[str]:
    """Write the snapshots a catch-up over (start, end] calls for
    (`snapshot_candidates`), one principal at a time, off any view transaction.
    Nothing on a database without files beside it (PostgreSQL) or with snapshots off
    (`MEMLEDGER_RECALL_SNAPSHOTS=0`). Returns the principals written (`TENANT/USER`)."""
    if matrix_snapshot.directory(store.url) is None or not matrix_snapshot.enabled():
        return []
    need = snapshot_min() if min_events is None else min_events
    if not _worth(start, end, need):
        return []
    emb = await store_embedder(store)
    done: list[str] = []
    for who in await snapshot_candidates(store, start, end, need, emb.name):
        if await write_snapshot(store, who, emb):
            done.append(f"{who.tenant}/{who.user}")
    if done:
        log.info("recall_snapshots_written", principals=len(done), start=start, end=end)
    return done


#: Per store URL with a `snapshot_soon` task running: the range asked for since it
#: started its pass (covered by its next pass).
_NEXT: dict[str, tuple[int, int] | None] = {}


def snapshot_soon(store: Store, start: int, end: int) -> None:
    """`write_snapshots` for (start, end] in the background (a task `matrix_snapshot.
    settled` waits for). One task per store: a range asked for while it runs is merged
    into its next pass, so a worker's bulk catch-ups never stack up loads."""
    if matrix_snapshot.directory(store.url) is None or not matrix_snapshot.enabled() \
            or not _worth(start, end, snapshot_min()):
        return
    url = store.url
    if url in _NEXT:
        more = _NEXT[url]
        _NEXT[url] = (start, end) if more is None else (min(more[0], start),
                                                         max(more[1], end))
        return
    _NEXT[url] = None

    async def passes(lo: int, hi: int) -> None:
        try:
            while True:
                await write_snapshots(store, lo, hi)
                more = _NEXT.get(url)
                if more is None:
                    return
                _NEXT[url] = None
                lo, hi = more
        finally:
            _NEXT.pop(url, None)

    matrix_snapshot.track(asyncio.get_running_loop().create_task(passes(start, end)))
