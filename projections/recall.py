"""Recall: pick the few memories to put before a model turn, and audit the choice.

The pipeline (docs/recall.md; R14, R15, R19, R24-R27):

1. **Narrow** by principal (tenant and `[tenant, user]` namespace prefix) and layer
   (long-term, plus the given task and session only) *before* anything is ranked, so
   similarity can never surface another user's data or another session's memories.
2. **Candidates**: exact key matches, semantic neighbours of the query (brute-force
   cosine over the principal's own vectors), every memory of the current task and
   session, and writes the index has not caught up with yet.
3. **Re-check** every candidate against the primary view: active, not expired, not
   covered by a tombstone, still the principal's. A stale or lagging index row never
   returns a superseded, expired, candidate or forgotten memory.
4. **Rank** by relevance, then source reliability, then recency (source order) as a
   tie-breaker only. How often a memory was recalled is never read.
5. **Override**: for one namespace and key, session beats task beats long-term.
6. **Budget**: tasks and items are taken in priority order (current-turn session
   memories, then task facts and corrections, then the rest), each costed with
   `estimate_tokens`, until `budget` or `limit` is reached.
7. **Tasks**: the principal's open tasks the query refers to; several equally good
   matches are all returned marked `ambiguous` (R4), never one guessed.
8. **Audit** (R25): ids, versions, scores and reasons of what was returned, with a
   digest of the query; never a value, never the query text.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import numpy as np
import orjson
import structlog
from numpy.typing import NDArray
from sqlalchemy import and_, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import MEMORY_WRITES
from ledger.store import Store
from projections import reads
from projections.embedding import Embedder
from projections.vectors import (
    PENDING_META,
    TASK_PREFIX,
    columns_from_blobs,
    current_embedder,
    from_blobs,
    memory_ids_of_slots,
    memory_text,
    slots_of,
    task_text,
    touched,
)

log = structlog.get_logger("memledger.recall")

#: How much a source is trusted when two memories are equally relevant (R19).
RELIABILITY: Final = {
    "explicit_user_request": 1.0, "operator": 0.95, "system_of_record": 0.9,
    "user_statement": 0.7, "model_inference": 0.5, "tool_output": 0.3,
    "retrieved_document": 0.3}
#: A long-term memory less similar than this to the query is not recalled.
MIN_RELEVANCE: Final = 0.05
#: Relevance of a memory whose key the query names (as words, e.g. "reply language").
KEY_NAMED: Final = 0.6
#: Relevance is compared at this precision, so that near-equal scores fall through to
#: source reliability and then recency (R19) instead of to noise in the last digits.
RELEVANCE_DIGITS: Final = 3
#: A task must be at least this similar to the query to be offered at all.
TASK_MIN: Final = 0.15
#: Tasks within this much of the best match are equally good candidates: ambiguous (R4).
TASK_MARGIN: Final = 0.1
#: Semantic neighbours re-checked per round (grown when re-checks drop too many).
POOL: Final = 48
#: Writes newer than the index considered directly: at most this many, this recent.
LAG_MAX: Final = 256
LAG_WINDOW: Final = 5000
#: A cached index is patched for at most this many new events, else reloaded.
REFRESH_MAX: Final = 2000
CACHE_ENV: Final = "MEMLEDGER_RECALL_CACHE_MB"


# -- token budget -------------------------------------------------------------------------

_RUNS: Final = re.compile(
    r"(?P<wide>[\u1100-\u11ff\u2e80-\u9fff\ua960-\ua97f\uac00-\ud7ff\uf900-\ufaff"
    r"\ufe30-\ufe4f\uff00-\uffef])"
    r"|(?P<astral>[\U00010000-\U0010ffff])"
    r"|(?P<word>[A-Za-z\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff]+)"
    r"|(?P<digits>[0-9]+)"
    r"|(?P<space>\s+)"
    r"|(?P<other>.)", re.S)


def estimate_tokens(text: str) -> int:
    """A conservative token estimate that is right for CJK text too.

    One token per CJK ideograph, kana, hangul syllable or full-width form (tokenisers
    give CJK text about one token per character, where the 4-characters-per-token rule
    of English would undercount it four times); two per character outside the BMP
    (emoji, rare ideographs); a latin, greek or cyrillic word costs one per 4 letters,
    rounded up; digits one per 3; whitespace nothing (it merges into the next token);
    any other character one.
    """
    n = 0
    for m in _RUNS.finditer(text):
        kind = m.lastgroup
        if kind == "wide" or kind == "other":
            n += 1
        elif kind == "astral":
            n += 2
        elif kind == "word":
            n += math.ceil(len(m.group()) / 4)
        elif kind == "digits":
            n += math.ceil(len(m.group()) / 3)
    return n


def render_item(item: dict[str, Any]) -> str:
    """How an app puts a memory in a prompt: `key: value` (what the budget counts)."""
    value = item["value"]
    shown = value if isinstance(value, str) else orjson.dumps(value).decode()
    return f"{item['key']}: {shown}"


def item_tokens(item: dict[str, Any]) -> int:
    """Tokens an item costs in a prompt: its rendering plus 2 for the line around it."""
    return estimate_tokens(render_item(item)) + 2


def task_tokens(task: dict[str, Any]) -> int:
    """Tokens a task summary costs: its JSON as returned, plus 2."""
    return estimate_tokens(orjson.dumps(task).decode()) + 2


# -- the principal's vector matrix, cached ------------------------------------------------

@dataclass(eq=False)
class _Group:
    """The memories of one task or one session: few, kept apart from long-term rows."""

    ids: list[str]
    keys: list[str]
    columns: NDArray[np.float32]  # (dim, k)


@dataclass(eq=False)
class PrincipalIndex:
    """One principal's vectors of one model, as of a `vectors` checkpoint.

    Long-term rows live in one transposed matrix (`columns[d, row]`), append-only with
    a liveness mask, so an update of a few entries patches the cache instead of
    reloading 100k vectors; task and session memories live in small per-group
    matrices, so the layer filter picks groups before any score is computed. Storing
    the matrix transposed makes a sparse query (the hashed n-gram embedder's sets ~60
    of 512 dimensions) read only its own dimensions (see `long_scores`).
    """

    position: int
    #: Entries of writes after this position may be missing (vectors ran ahead of views).
    pending: int | None
    model: str
    dim: int
    columns: NDArray[np.float32]  # (dim, capacity), rows [0, n) used
    n: int
    alive: NDArray[np.bool_]
    ids: list[str]
    keys: list[str]
    orders: list[bytes]
    row_of: dict[str, int]  # live long-term rows by memory id
    key_rows: dict[str, list[int]]  # normalised key -> long-term rows (live or not)
    groups: dict[tuple[str, str], _Group]
    task_ids: list[str]
    task_matrix: NDArray[np.float32]
    stamp: float = 0.0
    other_models: int = 0  # entries of another embedder (the index awaits a rebuild)
    _recency: NDArray[np.int64] | None = None

    @property
    def nbytes(self) -> int:
        """Approximate memory held."""
        extra = sum(g.columns.nbytes for g in self.groups.values())
        return int(self.columns.nbytes + self.task_matrix.nbytes + extra + 200 * self.n)

    @property
    def dead(self) -> int:
        """Long-term rows removed since the last full load."""
        return self.n - len(self.row_of)

    def has(self, memory_id: str) -> bool:
        """Does the index hold an entry for this memory?"""
        return memory_id in self.row_of or any(
            memory_id in g.ids for g in self.groups.values())

    def long_scores(self, q: NDArray[np.float32]) -> NDArray[np.float32]:
        """Cosine of the query with every long-term row (removed rows: -inf).

        Exact either way: with few non-zero query dimensions, sum those dimensions'
        rows (memory traffic ~ non-zeros x rows); otherwise one matrix product.
        """
        out = _scores(self.columns[:, :self.n], q)
        if self.dead:
            out[~self.alive[:self.n]] = -np.inf
        return out

    def recency(self) -> NDArray[np.int64]:
        """Live long-term rows, newest source order first."""
        if self._recency is None:
            rows = sorted(self.row_of.values(), key=self.orders.__getitem__, reverse=True)
            self._recency = np.asarray(rows, dtype=np.int64)
        return self._recency

    def remove(self, memory_id: str) -> None:
        """Drop an entry (its vector is zeroed: a forgotten memory leaves no copy here)."""
        row = self.row_of.pop(memory_id, None)
        if row is not None:
            self.alive[row] = False
            self.columns[:, row] = 0.0
            self._recency = None
        for key, g in list(self.groups.items()):
            if memory_id in g.ids:
                keep = [i for i, m in enumerate(g.ids) if m != memory_id]
                if not keep:
                    del self.groups[key]
                    continue
                self.groups[key] = _Group([g.ids[i] for i in keep], [g.keys[i] for i in keep],
                                          np.ascontiguousarray(g.columns[:, keep]))

    def add(self, r: Any, vec: NDArray[np.float32]) -> None:
        """Add one entry (a row of `_ROW_COLUMNS`)."""
        key = r.mkey or ""
        if r.layer != "long":
            gk = _group_key(r)
            g = self.groups.get(gk)
            col = vec.reshape(self.dim, 1)
            self.groups[gk] = (_Group([r.item_id], [key], col) if g is None else _Group(
                [*g.ids, r.item_id], [*g.keys, key], np.hstack([g.columns, col])))
            return
        if self.n == self.columns.shape[1]:
            grown = np.zeros((self.dim, max(16, self.n * 5 // 4)), dtype=np.float32)
            grown[:, :self.n] = self.columns[:, :self.n]
            alive = np.zeros(grown.shape[1], dtype=bool)
            alive[:self.n] = self.alive[:self.n]
            self.columns, self.alive = grown, alive
        row = self.n
        self.columns[:, row] = vec
        self.alive[row] = True
        self.ids.append(r.item_id)
        self.keys.append(key)
        self.orders.append(bytes(r.order_key) if r.order_key is not None else b"")
        self.row_of[r.item_id] = row
        self.key_rows.setdefault(_norm_key(key), []).append(row)
        self.n += 1
        self._recency = None


def _scores(columns: NDArray[np.float32], q: NDArray[np.float32]) -> NDArray[np.float32]:
    """Cosine of a unit query with the unit columns of a transposed matrix."""
    nz = np.flatnonzero(q)
    if len(nz) * 3 > columns.shape[0]:
        return np.asarray(q @ columns, dtype=np.float32)
    out = np.zeros(columns.shape[1], dtype=np.float32)
    for d in nz:
        out += q[d] * columns[d]
    return out


def _group_key(r: Any) -> tuple[str, str]:
    return (r.layer, (r.task_key if r.layer == "task" else r.session_id) or "")


class IndexCache:
    """An LRU of principal indexes, bounded in bytes (`MEMLEDGER_RECALL_CACHE_MB`)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        mb = int(os.environ.get(CACHE_ENV, "1024"))
        self.max_bytes = max_bytes if max_bytes is not None else mb * 1024 * 1024
        self._items: OrderedDict[tuple[str, ...], PrincipalIndex] = OrderedDict()
        self._bytes = 0
        self.loads = 0
        self.patches = 0

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


def _norm_key(text: str) -> str:
    return " ".join(re.findall(r"[^\W_]+", text.casefold()))


@dataclass(frozen=True, slots=True)
class _Positions:
    vectors: int  # the `vectors` checkpoint
    stamp: float  # when its last step committed (tells a same-position rebuild apart)
    pending: int | None  # start of the range the index could not settle, if any
    head: int  # the ledger's head


async def _positions(conn: AsyncConnection) -> _Positions:
    """Where the index and the ledger stand, in one round trip."""
    cp, meta = t.checkpoints.c, t.meta.c
    row = (await conn.execute(select(
        select(cp.position).where(cp.name == "vectors").scalar_subquery(),
        select(cp.updated_at).where(cp.name == "vectors").scalar_subquery(),
        select(meta.value).where(meta.name == PENDING_META).scalar_subquery(),
        select(func.max(t.events.c.position)).scalar_subquery()))).one()
    return _Positions(int(row[0] or 0), float(row[1] or 0.0),
                      int(row[2]) if row[2] is not None else None, int(row[3] or 0))


async def principal_index(conn: AsyncConnection, store: Store, who: reads.Principal,
                          emb: Embedder, at: _Positions | None = None) -> PrincipalIndex:
    """The principal's vectors at the current `vectors` checkpoint (cached)."""
    at = at or await _positions(conn)
    key = (store.url, who.tenant, who.user, emb.name)
    cached = CACHE.get(key)
    # The step time tells a rebuild that ended at the same position from no change.
    if cached is not None and (cached.position, cached.stamp) == (at.vectors, at.stamp):
        return cached
    if cached is not None and at.pending is None and cached.pending is None \
            and cached.position < at.vectors <= cached.position + LAG_WINDOW \
            and await _refresh(conn, store, who, emb, cached, at.vectors):
        cached.position, cached.stamp = at.vectors, at.stamp
        CACHE.put(key, cached)  # its size may have changed
        return cached
    idx = await _load_index(conn, store, who, emb, at.vectors, at.pending)
    idx.stamp = at.stamp
    CACHE.put(key, idx)
    return idx


def _index_rows(who: reads.Principal, store: Store) -> Any:
    """SELECT of the principal's index entries, with key and source order beside."""
    vc, mv = t.vectors.c, t.mem_versions.c
    conds = [vc.tenant == who.tenant, reads.prefix_match(vc.ns_path, who.prefix)]
    if store.dialect == "sqlite":
        # A range the (tenant, ns_path) index can serve; SQLite compares TEXT bytewise.
        conds += [vc.ns_path >= who.prefix, vc.ns_path < who.prefix[:-1] + "\x20"]
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
                                       reads.prefix_match(mv.ns_path, who.prefix))
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


async def _load_index(conn: AsyncConnection, store: Store, who: reads.Principal,
                      emb: Embedder, position: int, pending: int | None) -> PrincipalIndex:
    rows = (await conn.execute(_index_rows(who, store))).all()
    CACHE.loads += 1
    other = sum(1 for r in rows if r.model != emb.name or r.dim != emb.dim)
    if other:
        log.warning("vectors_of_other_model", entries=other, model=emb.name,
                    hint="run `memledger replay rebuild --projection vectors`")
    ours = [r for r in rows if r.model == emb.name and r.dim == emb.dim]
    longs = [r for r in ours if r.kind == "memory" and r.layer == "long"]
    tasks = [r for r in ours if r.kind == "task"]
    grouped: dict[tuple[str, str], list[Any]] = {}
    for r in ours:
        if r.kind == "memory" and r.layer != "long":
            grouped.setdefault(_group_key(r), []).append(r)
    key_rows: dict[str, list[int]] = {}
    for i, r in enumerate(longs):
        key_rows.setdefault(_norm_key(r.mkey or ""), []).append(i)
    ids = [r.item_id for r in longs]
    return PrincipalIndex(
        position=position, pending=pending, model=emb.name, dim=emb.dim,
        # Room for 1/16 more rows, so new writes are appended without copying the matrix.
        columns=columns_from_blobs([bytes(r.vector) for r in longs], emb.dim,
                                   capacity=len(longs) + max(64, len(longs) // 16)),
        n=len(longs), alive=np.arange(len(longs) + max(64, len(longs) // 16)) < len(longs),
        ids=ids, keys=[r.mkey or "" for r in longs],
        orders=[bytes(r.order_key) if r.order_key is not None else b"" for r in longs],
        row_of={m: i for i, m in enumerate(ids)}, key_rows=key_rows,
        groups={k: _Group([r.item_id for r in g], [r.mkey or "" for r in g],
                          columns_from_blobs([bytes(r.vector) for r in g], emb.dim))
                for k, g in grouped.items()},
        task_ids=[r.item_id[len(TASK_PREFIX):] for r in tasks],
        task_matrix=from_blobs([bytes(r.vector) for r in tasks], emb.dim),
        other_models=other)


# -- candidates ---------------------------------------------------------------------------

@dataclass
class _Candidate:
    relevance: float
    basis: str


def _top(scores: NDArray[np.float32], k: int, floor: float) -> NDArray[np.int64]:
    """Indexes of the k best scores at or above `floor`, best first."""
    idx = np.argpartition(-scores, k - 1)[:k] if len(scores) > k else np.arange(len(scores))
    idx = idx[scores[idx] >= floor]
    return idx[np.argsort(-scores[idx], kind="stable")].astype(np.int64)


def _key_matches(idx: PrincipalIndex, query: str, groups: Sequence[_Group]
                 ) -> dict[str, tuple[_Candidate, int | None]]:
    """Memories whose key the query is (exact) or names as a run of words:
    {memory_id: (candidate, long-term row or None)}."""
    words = _norm_key(query).split()
    whole = " ".join(words)
    phrases = {" ".join(words[s:s + n]) for n in range(1, min(len(words), 6) + 1)
               for s in range(len(words) - n + 1)}
    phrases = {p for p in phrases if p != whole and (" " in p or len(p) >= 4)}

    def cand(key: str) -> _Candidate | None:
        k = _norm_key(key)
        if k == whole:
            return _Candidate(1.0, "exact key match")
        return _Candidate(KEY_NAMED, "the query names its key") if k in phrases else None

    out: dict[str, tuple[_Candidate, int | None]] = {}
    for k in (whole, *phrases):
        for row in idx.key_rows.get(k, []):
            c = cand(idx.keys[row])
            if c is not None and idx.alive[row]:
                out[idx.ids[row]] = (c, row)
    for g in groups:
        for m, key in zip(g.ids, g.keys, strict=True):
            c = cand(key)
            if c is not None:
                out[m] = (c, None)
    return out


async def _lagging_writes(conn: AsyncConnection, who: reads.Principal, idx: PrincipalIndex,
                          head: int) -> list[str]:
    """Memory ids of the principal's writes the index has not settled (newest first)."""
    after = idx.position if idx.pending is None else min(idx.position, idx.pending)
    if after >= head:
        return []
    ev = t.events.c
    q = (select(ev.memory_id).where(
        ev.position > max(after, head - LAG_WINDOW), ev.tenant == who.tenant,
        ev.type.in_(sorted(MEMORY_WRITES)), reads.prefix_match(ev.ns_path, who.prefix))
        .order_by(ev.position.desc()).limit(LAG_MAX))
    return [r[0] for r in (await conn.execute(q)).all() if r[0] is not None]


async def recheck(conn: AsyncConnection, who: reads.Principal, memory_ids: Sequence[str], *,
                  now_us: int, task: str | None, session: str | None) -> list[Any]:
    """The rows of those ids that are valid now: the principal's, in scope, active, not
    expired, not forgotten (R14, R15) -- the conditions of `reads.active_memories`.

    The status test is written as an expression on purpose: on SQLite, without table
    statistics, a bare `status = 'active'` makes the planner scan the tenant's whole
    `(tenant, status)` index instead of looking the few ids up by primary key.
    """
    mv = t.mem_versions.c
    q = select(t.mem_versions).where(
        mv.tenant == who.tenant, mv.memory_id.in_(list(memory_ids)),
        func.coalesce(mv.status, "") == "active", reads.prefix_match(mv.ns_path, who.prefix),
        reads.layer_filter(task, session), reads.not_expired(now_us), reads.not_forgotten())
    return list((await conn.execute(q)).all())


# -- the pipeline -------------------------------------------------------------------------

async def recall(store: Store, principal: str, *, query: str | None, session: str | None,
                 task: str | None, budget: int | None, limit: int, now_us: int
                 ) -> dict[str, Any]:
    """Run the recall pipeline for a principal; see the module docstring."""
    who = reads.Principal.parse(principal)
    await store.open()
    emb = current_embedder()
    qtext = (query or "").strip() or None
    qvec = emb.embed([qtext])[0] if qtext else None
    async with store.read() as conn:
        at = await _positions(conn)
        idx = await principal_index(conn, store, who, emb, at)
        lag = await _lagging_writes(conn, who, idx, at.head)
        rows, cands = await _valid_candidates(conn, who, idx, qtext, qvec, lag, emb,
                                              task=task, session=session, limit=limit,
                                              now_us=now_us)
        # An index that is caught up lists every open task: none there, none to read.
        settled = idx.pending is None and idx.position >= at.head and not idx.other_models
        open_tasks = await reads.tasks(conn, who) if idx.task_ids or not settled else []
    items = _rank(rows, cands, qtext is not None)
    chosen_tasks = _relevant_tasks(open_tasks, idx, emb, qtext, qvec, task)
    picked_tasks, picked, used = _fit(chosen_tasks, items, budget, limit)
    audit_id = await _audit(store, who, qtext, picked, picked_tasks, now_us)
    return {"items": picked, "tasks": picked_tasks, "audit_id": audit_id,
            "tokens": used, "budget": budget}


async def _valid_candidates(conn: AsyncConnection, who: reads.Principal,
                            idx: PrincipalIndex, qtext: str | None,
                            qvec: NDArray[np.float32] | None, lag: list[str], emb: Embedder,
                            *, task: str | None, session: str | None, limit: int,
                            now_us: int) -> tuple[list[Any], dict[str, _Candidate]]:
    """Candidates re-checked against the active view: (rows, relevance by memory id)."""
    cands: dict[str, _Candidate] = {}
    basis = "semantic match" if qvec is not None else "in scope"
    # Every memory of the current task and session: their groups only (R2).
    groups = [idx.groups[g] for g in (("task", task or ""), ("session", session or ""))
              if g[1] and g in idx.groups]
    for g in groups:
        sims = _scores(g.columns, qvec) if qvec is not None else np.ones(len(g.ids))
        for m, sim in zip(g.ids, sims, strict=True):
            cands[m] = _Candidate(float(sim), basis)
    scores = idx.long_scores(qvec) if qvec is not None else None
    if qtext is not None:
        for m, (c, row) in _key_matches(idx, qtext, groups).items():
            have = cands[m].relevance if m in cands else (
                float(scores[row]) if scores is not None and row is not None else 0.0)
            if c.relevance > have:
                cands[m] = c

    # Long-term neighbours, best first; fetched in growing rounds when re-checks drop
    # many (a stale index), so a lagging index costs time, never correctness.
    def ranked(k: int) -> NDArray[np.int64]:
        if scores is None:
            return idx.recency()[:k]
        return _top(scores, k, MIN_RELEVANCE)

    lag_ids = [m for m in lag if not idx.has(m)]
    valid: dict[str, Any] = {}
    checked: set[str] = set()
    want = [*cands, *lag_ids]
    k = POOL + 4 * limit
    for _round in range(4):
        order = ranked(k)
        for i in order:
            mid = idx.ids[int(i)]
            if mid not in cands:
                cands[mid] = _Candidate(float(scores[int(i)]) if scores is not None else 1.0,
                                        basis)
            want.append(mid)
        todo = [m for m in dict.fromkeys(want) if m not in checked]
        for s in range(0, len(todo), 500):
            for r in await recheck(conn, who, todo[s:s + 500], now_us=now_us, task=task,
                                   session=session):
                valid[r.memory_id] = r
        checked.update(todo)
        want = []
        if len(order) < k or sum(1 for r in valid.values() if r.layer == "long") >= limit:
            break
        k *= 4
    # Writes the index has not caught up with: score their text now.
    fresh = [valid[m] for m in lag_ids if m in valid and m not in cands]
    if fresh:
        sims = (emb.embed([memory_text(r.mkey, r.value, r.text) for r in fresh]) @ qvec
                if qvec is not None else np.ones(len(fresh)))
        q = _norm_key(qtext) if qtext is not None else None
        for r, sim in zip(fresh, sims, strict=True):
            cands[r.memory_id] = (_Candidate(1.0, "exact key match") if q == _norm_key(r.mkey)
                                  else _Candidate(float(sim), basis))
    return list(valid.values()), cands


def _tier(r: Any) -> int:
    """Budget priority (R26): the current turn's session memories, then task facts and
    corrections, then everything else."""
    if r.layer == "session":
        return 0
    if r.layer == "task" or r.version > 1 or r.supersedes:
        return 1
    return 2


def _rank(rows: Sequence[Any], cands: dict[str, _Candidate], has_query: bool
          ) -> list[tuple[Any, float, str]]:
    """Overrides, then priority and rank order: [(row, relevance, reason)]."""
    by_key: dict[tuple[str, str], list[Any]] = {}
    for r in rows:
        by_key.setdefault((r.ns_path, r.mkey), []).append(r)
    out: list[tuple[Any, float, str]] = []
    for group in by_key.values():
        group.sort(key=lambda r: reads.LAYER_RANK[r.layer])
        win = group[0]
        c = cands.get(win.memory_id, _Candidate(0.0, "semantic match"))
        rel = max(cands[r.memory_id].relevance if r.memory_id in cands else 0.0
                  for r in group)
        basis = c.basis if c.relevance >= rel else next(
            cands[r.memory_id].basis for r in group
            if r.memory_id in cands and cands[r.memory_id].relevance == rel)
        if win.layer == "long" and has_query and rel < MIN_RELEVANCE:
            continue
        reason = [f"{basis} {rel:.2f}" if basis == "semantic match" else basis]
        lower = [r.layer for r in group[1:]]
        if win.layer == "session":
            reason.append("current session memory"
                          + (", overrides the stored value for this turn (R27)"
                             if lower else ""))
        elif win.layer == "task":
            reason.append("current task fact"
                          + (", overrides the long-term value in this task (R8)"
                             if lower else ""))
        else:
            reason.append("long-term memory")
        if win.layer == "long" and (win.version > 1 or win.supersedes):
            reason.append(f"correction (version {win.version})")
        kind = _source_kind(win)
        reason.append(f"source {kind}")
        out.append((win, rel, "; ".join(reason)))
    # Recency (source order, newest first) only breaks ties left by relevance and then
    # by source reliability (R19); both sorts are stable.
    out.sort(key=lambda x: bytes(x[0].order_key), reverse=True)
    out.sort(key=lambda x: (_tier(x[0]), -round(x[1], RELEVANCE_DIGITS),
                            -RELIABILITY.get(_source_kind(x[0]), 0.5)))
    return out


def _source_kind(r: Any) -> str:
    return str(orjson.loads(r.source).get("kind", ""))


_REF_EDGE = r"(?<![0-9a-z]){}(?![0-9a-z])"


def _relevant_tasks(open_tasks: list[dict[str, Any]], idx: PrincipalIndex, emb: Embedder,
                    qtext: str | None, qvec: NDArray[np.float32] | None, task: str | None
                    ) -> list[dict[str, Any]]:
    """The open tasks the turn is about (R4): the current one, or the query's matches."""
    if task is not None:
        return [{**x, "score": 1.0, "reason": "current task", "ambiguous": False}
                for x in open_tasks if x["task_key"] == task]
    if qtext is None or qvec is None:
        return [{**x, "score": 1.0, "reason": "open task", "ambiguous": False}
                for x in open_tasks]
    if not open_tasks:
        return []
    q = qtext.casefold()
    exact: list[dict[str, Any]] = []
    for x in open_tasks:
        refs = [x["task_key"], *[str(v) for v in (x.get("refs") or {}).values()]]
        if any(len(ref) >= 2 and re.search(_REF_EDGE.format(re.escape(ref.casefold())), q)
               for ref in refs):
            exact.append(x)
    if exact:
        amb = len(exact) > 1
        return [{**x, "score": 1.0, "reason": "the query names this task or one of its "
                 "references" + ("; several tasks match equally: ask which (R4)" if amb else ""),
                 "ambiguous": amb} for x in exact]
    pos = {k: i for i, k in enumerate(idx.task_ids)}
    missing = [x for x in open_tasks if x["task_key"] not in pos]
    sims: dict[str, float] = {}
    if idx.task_ids:
        s = idx.task_matrix @ qvec
        sims = {k: float(s[i]) for k, i in pos.items()}
    if missing:  # not indexed yet: embed the summary now
        s2 = emb.embed([task_text(x["task_key"], x) for x in missing]) @ qvec
        sims.update({x["task_key"]: float(v) for x, v in zip(missing, s2, strict=True)})
    scored = sorted(((sims.get(x["task_key"], 0.0), x) for x in open_tasks),
                    key=lambda p: -p[0])
    best = scored[0][0]
    if best < TASK_MIN:
        return []
    close = [(s, x) for s, x in scored if s >= max(TASK_MIN, best - TASK_MARGIN)]
    amb = len(close) > 1
    return [{**x, "score": round(s, 4),
             "reason": f"semantic match {s:.2f} with the task summary"
             + ("; several tasks match about equally: ask which (R4)" if amb else ""),
             "ambiguous": amb} for s, x in close]


def _fit(tasks: list[dict[str, Any]], ranked: list[tuple[Any, float, str]],
         budget: int | None, limit: int
         ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Take tasks, then items in priority order, while they fit the budget and limit."""
    used = 0
    picked_tasks: list[dict[str, Any]] = []
    for x in tasks:
        cost = task_tokens(x)
        if budget is not None and used + cost > budget:
            continue
        used += cost
        picked_tasks.append(x)
    items: list[dict[str, Any]] = []
    for r, rel, reason in ranked:
        if len(items) >= limit:
            break
        item = reads.memory_item(r)
        cost = item_tokens(item)
        if budget is not None and used + cost > budget:
            continue  # a smaller item further down may still fit
        used += cost
        items.append({**item, "score": round(rel, 4), "reason": reason, "tokens": cost})
    return picked_tasks, items, used


async def _audit(store: Store, who: reads.Principal, query: str | None,
                 items: list[dict[str, Any]], tasks: list[dict[str, Any]],
                 now_us: int) -> str:
    """Write the audit record of a recall (R25): ids and scores, never values."""
    audit_id = uuid.uuid4().hex
    # Only what the ledger's envelope keeps after a forget (ids, version, layer,
    # namespace, source kind/id/time/position) plus score and a templated reason: a
    # forget leaves nothing in here to erase.
    record: list[dict[str, Any]] = [
        {"kind": "memory", "memory_id": i["memory_id"], "version": i["version"],
         "layer": i["layer"], "namespace": i["namespace"], "score": i["score"],
         "reason": i["reason"],
         "source": {k: i["source"].get(k) for k in ("kind", "id", "at", "position")}}
        for i in items]
    record.extend({"kind": "task", "task_key": x["task_key"], "score": x["score"],
                   "reason": x["reason"], "ambiguous": x["ambiguous"]} for x in tasks)
    at = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=now_us)).isoformat(
        timespec="microseconds")
    async with store.view_write() as conn:
        await conn.execute(t.recall_audit.insert().values(
            audit_id=audit_id, at=at, tenant=who.tenant,
            principal=f"{who.tenant}/{who.user}",
            query_digest=hashlib.sha256(query.encode()).hexdigest() if query else None,
            items=orjson.dumps(record)))
        if items:
            await conn.execute(t.recall_audit_items.insert(), [
                {"audit_id": audit_id, "tenant": who.tenant, "memory_id": i["memory_id"]}
                for i in items])
    return audit_id
