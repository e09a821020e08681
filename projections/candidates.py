"""Recall's candidates: semantic neighbours, key matches, the current task's and
session's memories and writes the index has not caught up with, each re-checked
against the active view (steps 2 and 3 of `projections.recall`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import namedtuple
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import orjson
from numpy.typing import NDArray
from sqlalchemy import BigInteger, bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import MEMORY_WRITES
from ledger.store import Store
from ledger.vault import open_columns
from projections import embed_cache, lexical, reads
from projections.embedding import Embedder, is_cached
from projections.index_cache import LAG_WINDOW
from projections.principal_index import Group, PrincipalIndex, cosine_scores, norm_key
from projections.sql import PointQuery, point_json_values, point_rows, prefix_match
from projections.vectors import memory_text

#: A long-term memory less similar than this to the query is not recalled.
MIN_RELEVANCE: Final = 0.05
#: Relevance of a memory whose key the query names (as words, e.g. "reply language").
KEY_NAMED: Final = 0.6
#: Semantic neighbours re-checked per round (grown when re-checks drop too many).
POOL: Final = 48
#: Writes newer than the index considered directly: at most this many.
LAG_MAX: Final = 256
#: Of those, at most this many are embedded by a model embedder during a recall (a model
#: takes tens to hundreds of ms a text); the digest cache is consulted first, and the
#: rest wait for the index (the lexical arm and key matches still find them).
LAG_MODEL_EMBED: Final = 16
#: How the semantic and lexical arms are fused: "weighted:A" (A x cosine + (1 - A) x
#: lexical score / the query's best lexical score), "rrf" (reciprocal-rank fusion) or
#: "semantic" (vectors only). The default, weighted with A = 0.5, measured best on the
#: LoCoMo development split (docs/recall.md, "Quality").
FUSION_ENV: Final = "MEMLEDGER_RECALL_FUSION"
DEFAULT_FUSION: Final = "weighted:0.5"
#: Reciprocal-rank fusion constant (the usual 60).
RRF_K: Final = 60
SEMANTIC: Final = "semantic match"
LEXICAL: Final = "lexical match"
HYBRID: Final = "semantic + lexical match"
#: Candidate bases whose reason shows the relevance.
SCORED: Final = frozenset({SEMANTIC, LEXICAL, HYBRID})


@dataclass
class Candidate:
    relevance: float
    basis: str


#: Scores per block for the semantic pool's threshold (`_top`).
TOP_BLOCK: Final = 256


def _top(scores: NDArray[np.float32], k: int, floor: float,
         orders: Sequence[bytes] | None = None) -> NDArray[np.int64]:
    """Indexes of the k best scores at or above `floor`, best first. Of rows with equal
    scores the newest (`orders`: source order, larger is newer; else the later row)
    comes first, and is kept first when they straddle the k-th place: ranking breaks
    ties by recency too (R19), so the pool keeps the ones it would rank higher.

    Only rows that can be among the k best are sorted: the k-th largest of the
    maxima of blocks of `TOP_BLOCK` scores is at most the k-th largest score (k blocks
    hold a score at least that high), so the rows at or above it hold the k best (a few
    dozen to a few hundred of 100k). A pass of maxima and one comparison of every
    score instead of a partition of them all (about a tenth of its time)."""
    n = len(scores)
    blocks = n // TOP_BLOCK
    if blocks >= k:
        maxima = scores[:blocks * TOP_BLOCK].reshape(blocks, TOP_BLOCK).max(axis=1)
        cand = np.flatnonzero(scores >= np.partition(maxima, blocks - k)[blocks - k])
    else:
        cand = np.arange(n)
    cand = cand[scores[cand] >= floor]
    sub = scores[cand]
    if len(cand) > k:
        kth = np.partition(sub, len(sub) - k)[len(sub) - k]
        above, tied = cand[sub > kth], cand[sub == kth]
        if len(above) + len(tied) > k:
            tied = tied[_newest_first(tied, orders)][:k - len(above)]
        cand = np.concatenate([above, tied])
        sub = scores[cand]
    best = np.argsort(-sub, kind="stable")
    same = sub[best[1:]] == sub[best[:-1]]
    if same.any():
        # Equal scores newest first (the lexsort's last key is its primary); only the
        # rows sharing a score need their source order read.
        tied_at = np.zeros(len(best), dtype=bool)
        tied_at[1:] |= same
        tied_at[:-1] |= same
        pos = best[tied_at]
        recency = np.zeros(len(cand), dtype=np.int64)
        recency[pos[_newest_first(cand[pos], orders)]] = np.arange(len(pos))
        best = np.lexsort((recency, -sub))
    return cand[best].astype(np.int64)


def _newest_first(rows: NDArray[np.int64], orders: Sequence[bytes] | None
                  ) -> NDArray[np.int64]:
    """Positions in `rows` ordered newest first: by source order, then by row."""
    if orders is None:
        return np.argsort(-rows, kind="stable")
    keyed = sorted(range(len(rows)), key=lambda i: (orders[int(rows[i])], int(rows[i])),
                   reverse=True)
    return np.asarray(keyed, dtype=np.int64)


def _key_matches(idx: PrincipalIndex, query: str, groups: Sequence[Group]
                 ) -> dict[str, tuple[Candidate, int | None]]:
    """Memories whose key the query is (exact) or names as a run of words:
    {memory_id: (candidate, long-term row or None)}."""
    words = norm_key(query).split()
    whole = " ".join(words)
    phrases = {" ".join(words[s:s + n]) for n in range(1, min(len(words), 6) + 1)
               for s in range(len(words) - n + 1)}
    phrases = {p for p in phrases if p != whole and (" " in p or len(p) >= 4)}

    def cand(key: str) -> Candidate | None:
        k = norm_key(key)
        if k == whole:
            return Candidate(1.0, "exact key match")
        return Candidate(KEY_NAMED, "the query names its key") if k in phrases else None

    out: dict[str, tuple[Candidate, int | None]] = {}
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


async def lagging_writes(conn: AsyncConnection, who: reads.Principal, idx: PrincipalIndex,
                         head: int) -> list[str]:
    """Memory ids of the principal's writes the index has not settled (newest first)."""
    after = idx.position if idx.pending is None else min(idx.position, idx.pending)
    if after >= head:
        return []
    ev = t.events.c
    q = (select(ev.memory_id).where(
        ev.position > max(after, head - LAG_WINDOW), ev.tenant == who.tenant,
        ev.type.in_(sorted(MEMORY_WRITES)), prefix_match(ev.ns_path, who.prefix))
        .order_by(ev.position.desc()).limit(LAG_MAX))
    return [r[0] for r in (await conn.execute(q)).all() if r[0] is not None]


def _recheck_statement(ids: Any, task: Any, session: Any) -> Any:
    mv = t.mem_versions.c
    return select(t.mem_versions).where(
        mv.tenant == bindparam("tenant"), mv.memory_id.in_(ids),
        func.coalesce(mv.status, "") == "active",
        func.substr(mv.ns_path, 1, bindparam("plen")) == bindparam("prefix"),
        reads.layer_filter(task, session),
        reads.not_expired(bindparam("now", type_=BigInteger)),  # type: ignore[arg-type]
        reads.not_forgotten())


#: The re-check for point reads on SQLite, built and compiled once per layer filter
#: shape (task given?, session given?): the ids go in as one JSON array (`json_each`),
#: so the statement does not change with their number. Compiling the statement per
#: call cost more than running it (5-8 ms on the loaded 2-core machine).
_RECHECK_POINT: Final = {
    (has_task, has_session): PointQuery(_recheck_statement(
        point_json_values("ids"),
        bindparam("task") if has_task else None,
        bindparam("session") if has_session else None))
    for has_task in (False, True) for has_session in (False, True)}


#: The same statement for the read connection (PostgreSQL, or where point reads cannot
#: run), built once per shape: the ids are an expanding parameter, so SQLAlchemy's
#: compiled cache serves every call (building it cost ~10 ms a recall on PostgreSQL).
_RECHECK: Final = {
    (has_task, has_session): _recheck_statement(
        bindparam("ids", expanding=True),
        bindparam("task") if has_task else None,
        bindparam("session") if has_session else None)
    for has_task in (False, True) for has_session in (False, True)}


#: A re-checked row read on the calling thread whose sealed columns (`value`, `text`
#: with the vault on) are still as stored: `opened` opens them for the few rows a
#: recall returns, instead of decrypting every candidate (a hundred-odd a recall, a
#: sixth of its CPU).
SealedVersionRow = namedtuple(  # type: ignore[misc]
    "SealedVersionRow", reads.MemVersionRow._fields)


def opened(store: Store, row: Any) -> Any:
    """`row` with its sealed content opened (`SealedVersionRow`); any other row as is."""
    if not isinstance(row, SealedVersionRow):
        return row
    pq = _RECHECK_POINT[(False, False)]  # no vault: a sealed value opens as None
    return reads.MemVersionRow._make(
        open_columns([row], pq.sealed, store.engine.sync_engine.dialect)[0])


async def recheck(conn: AsyncConnection, who: reads.Principal, memory_ids: Sequence[str], *,
                  now_us: int, task: str | None, session: str | None,
                  store: Store | None = None, sealed: bool = False) -> list[Any]:
    """The rows of those ids that are valid now: the principal's, in scope, active, not
    expired, not forgotten (R14, R15) -- the conditions of `reads.active_memories`.

    On a SQLite file (`store` given) the statement runs on the calling thread
    (`projections.sql.point_rows`: a fresh autocommit read, so it sees every commit
    before it, tombstones included); elsewhere on `conn`. `sealed`: rows read on the
    calling thread keep their sealed columns as stored (`SealedVersionRow`, opened by
    `opened`); a key erased meanwhile then opens as None, as an erased one does.

    The status test is written as an expression on purpose: on SQLite, without table
    statistics, a bare `status = 'active'` makes the planner scan the tenant's whole
    `(tenant, status)` index instead of looking the few ids up by primary key.
    """
    values = {"tenant": who.tenant, "plen": len(who.prefix), "prefix": who.prefix,
              "now": now_us, "task": task, "session": session}
    if store is not None and store.recorder.point_reads() is not None:  # SQLite files
        pq = _RECHECK_POINT[(task is not None, session is not None)]
        rows = point_rows(store, pq, {**values, "ids": orjson.dumps(list(memory_ids)).decode()},
                          opened=not sealed)
        if rows is not None:
            make = SealedVersionRow._make if sealed else reads.MemVersionRow._make
            return [make(r) for r in rows]
    q = _RECHECK[(task is not None, session is not None)]
    return list((await conn.execute(q, {**values, "ids": list(memory_ids)})).all())


def fusion() -> tuple[str, float]:
    """The fusion in force: ("rrf", 0), ("weighted", A) or ("semantic", 0)."""
    raw = os.environ.get(FUSION_ENV, "").strip().lower() or DEFAULT_FUSION
    if raw in ("rrf", "semantic"):
        return raw, 0.0
    kind, _, a = raw.partition(":")
    if kind == "weighted":
        with contextlib.suppress(ValueError):
            if 0.0 <= float(a) <= 1.0:
                return "weighted", float(a)
    raise ValueError(f"{FUSION_ENV}={raw!r}: use 'rrf', 'semantic' or 'weighted:A' "
                     "with 0 <= A <= 1")


def _tied_ranks(scores: Sequence[float]) -> list[int]:
    """Ranks of scores sorted best first; equal scores share the better rank, so that
    equally relevant memories stay equal and fall through to reliability (R19)."""
    out: list[int] = []
    for i, v in enumerate(scores):
        out.append(out[-1] if i and v == scores[i - 1] else i)
    return out


def fuse(sem: dict[str, float], lex: Sequence[tuple[str, float]],
         how: tuple[str, float] | None = None) -> dict[str, Candidate]:
    """Fuse the semantic arm (cosine by id) with the lexical one (ids and scores, best
    first) into one relevance in [0, 1] per id, by `how` (default: `fusion()`)."""
    kind, a = how or fusion()
    if kind == "semantic":
        return {m: Candidate(v, SEMANTIC) for m, v in sem.items()}
    lex_ids = {m for m, _ in lex}
    basis = {m: HYBRID if m in lex_ids else SEMANTIC for m in sem}
    basis.update(dict.fromkeys(lex_ids - sem.keys(), LEXICAL))
    if kind == "weighted":
        best = max((v for _, v in lex), default=0.0)
        ls = {m: v / best for m, v in lex} if best > 0 else {}
        return {m: Candidate(a * max(sem.get(m, 0.0), 0.0) + (1 - a) * ls.get(m, 0.0), b)
                for m, b in basis.items()}
    out: dict[str, float] = {}
    sem_order = sorted(sem.items(), key=lambda p: -p[1])
    for (m, _), r in zip(sem_order, _tied_ranks([v for _, v in sem_order]), strict=True):
        out[m] = 1.0 / (RRF_K + r + 1)
    for (m, _), r in zip(lex, _tied_ranks([v for _, v in lex]), strict=True):
        out[m] = out.get(m, 0.0) + 1.0 / (RRF_K + r + 1)
    # Scaled so that first in both arms is 1.0 and first in one arm is 0.5.
    return {m: Candidate(v * (RRF_K + 1) / 2, basis[m]) for m, v in out.items()}


async def _lag_vectors(conn: AsyncConnection, emb: Embedder, rows: Sequence[Any]
                       ) -> tuple[NDArray[np.float32], NDArray[np.bool_]]:
    """Vectors of writes the index has not settled, and which of them were scored. The
    default embedder embeds them all; a model embedder takes what the digest cache holds
    and embeds at most `LAG_MODEL_EMBED` more (newest first), leaving the rest zero
    (unscored) until the index catches up, so a backlog never costs a recall seconds."""
    texts = [memory_text(r.mkey, r.value, r.text) for r in rows]
    if not is_cached(emb):
        return emb.embed(texts), np.ones(len(rows), dtype=bool)
    keys = [embed_cache.digest(x) for x in texts]
    have = await embed_cache.cached(conn, emb, keys)
    out = np.zeros((len(rows), emb.dim), dtype=np.float32)
    scored = np.zeros(len(rows), dtype=bool)
    todo: list[int] = []
    for i, k in enumerate(keys):
        if k in have:
            out[i], scored[i] = have[k], True
        elif len(todo) < LAG_MODEL_EMBED:
            todo.append(i)
    if todo:
        out[todo] = emb.embed([texts[i] for i in todo])
        scored[todo] = True
    return out, scored


async def valid_candidates(conn: AsyncConnection, store: Store, who: reads.Principal,
                           idx: PrincipalIndex, qtext: str | None,
                           qvec: NDArray[np.float32] | None, lag: list[str], emb: Embedder,
                           *, task: str | None, session: str | None, limit: int,
                           now_us: int) -> tuple[list[Any], dict[str, Candidate]]:
    """Candidates re-checked against the active view: (rows, relevance by memory id).

    With a query, the semantic arm (cosine over the principal's vectors) and the
    lexical arm (`projections.lexical.search`, inside the same scope in SQL) each
    propose their best; every id of either is re-checked, then both are fused.
    """
    cands: dict[str, Candidate] = {}
    sem: dict[str, float] = {}
    basis = SEMANTIC if qvec is not None else "in scope"
    # Every memory of the current task and session: their groups only (R2).
    groups = [idx.groups[g] for g in (("task", task or ""), ("session", session or ""))
              if g[1] and g in idx.groups]
    for g in groups:
        sims = cosine_scores(g.columns, qvec) if qvec is not None else np.ones(len(g.ids))
        for m, sim in zip(g.ids, sims, strict=True):
            cands[m] = Candidate(float(sim), basis)
            if qvec is not None:
                sem[m] = float(sim)
    # The lexical arm's full-text match runs on another thread (`lexical.search`,
    # `read_sql(beside=True)`) while this one scores the vectors: both release the GIL.
    k = POOL + 4 * limit
    lex_job: asyncio.Task[list[tuple[str, float]]] | None = None
    if qtext is not None and qvec is not None and fusion()[0] != "semantic":
        lex_job = asyncio.ensure_future(
            lexical.search(conn, store, who, qtext, task=task, session=session, k=k))
        await asyncio.sleep(0)  # let it reach its match before the scan takes this thread
    try:
        scores = idx.long_scores(qvec) if qvec is not None else None
        if qtext is not None:
            for m, (c, row) in _key_matches(idx, qtext, groups).items():
                have = cands[m].relevance if m in cands else (
                    float(scores[row]) if scores is not None and row is not None else 0.0)
                if c.relevance > have:
                    cands[m] = c

        # Long-term neighbours, best first; fetched in growing rounds when re-checks
        # drop many (a stale index), so a lagging index costs time, never correctness.
        def ranked(k: int) -> NDArray[np.int64]:
            if scores is None:
                return idx.recency()[:k]
            return _top(scores, k, MIN_RELEVANCE, idx.orders)

        first = ranked(k)
        lag_ids = [m for m in lag if not idx.has(m)]
        lex = await lex_job if lex_job is not None else []
    finally:
        if lex_job is not None and not lex_job.done():
            lex_job.cancel()
    valid: dict[str, Any] = {}
    checked: set[str] = set()
    want = [*cands, *lag_ids, *(m for m, _ in lex)]
    for _round in range(4):
        order = first if _round == 0 else ranked(k)
        for i in order:
            mid = idx.ids[int(i)]
            if scores is not None:
                sem.setdefault(mid, float(scores[int(i)]))
            if mid not in cands:
                cands[mid] = Candidate(float(scores[int(i)]) if scores is not None else 1.0,
                                       basis)
            want.append(mid)
        todo = [m for m in dict.fromkeys(want) if m not in checked]
        for s in range(0, len(todo), 500):
            for r in await recheck(conn, who, todo[s:s + 500], now_us=now_us, task=task,
                                   session=session, store=store, sealed=True):
                valid[r.memory_id] = r
        checked.update(todo)
        want = []
        if len(order) < k or sum(1 for r in valid.values() if r.layer == "long") >= limit:
            break
        k *= 4
    # Writes the index has not caught up with: score their text now.
    fresh = [opened(store, valid[m]) for m in lag_ids if m in valid and m not in cands]
    if fresh:
        scored = np.ones(len(fresh), dtype=bool)
        if qvec is not None:
            matrix, scored = await _lag_vectors(conn, emb, fresh)
            sims = matrix @ qvec
        else:
            sims = np.ones(len(fresh))
        q = norm_key(qtext) if qtext is not None else None
        for r, sim, ok in zip(fresh, sims, scored, strict=True):
            cands[r.memory_id] = (Candidate(1.0, "exact key match") if q == norm_key(r.mkey)
                                  else Candidate(float(sim), basis))
            if qvec is not None and q != norm_key(r.mkey) and ok:
                sem[r.memory_id] = float(sim)
    if qvec is not None:
        for m, fc in fuse(sem, lex).items():
            prev = cands.get(m)
            # A key match keeps its own relevance when it is higher.
            if prev is None or prev.basis in SCORED or fc.relevance > prev.relevance:
                cands[m] = fc
    return list(valid.values()), cands
