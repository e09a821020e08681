"""Recall's candidates: semantic neighbours, key matches, the current task's and
session's memories and writes the index has not caught up with, each re-checked
against the active view (steps 2 and 3 of `projections.recall`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import MEMORY_WRITES
from projections import reads
from projections.embedding import Embedder
from projections.index_cache import LAG_WINDOW
from projections.principal_index import Group, PrincipalIndex, cosine_scores, norm_key
from projections.sql import prefix_match
from projections.vectors import memory_text

#: A long-term memory less similar than this to the query is not recalled.
MIN_RELEVANCE: Final = 0.05
#: Relevance of a memory whose key the query names (as words, e.g. "reply language").
KEY_NAMED: Final = 0.6
#: Semantic neighbours re-checked per round (grown when re-checks drop too many).
POOL: Final = 48
#: Writes newer than the index considered directly: at most this many.
LAG_MAX: Final = 256


@dataclass
class Candidate:
    relevance: float
    basis: str


def _top(scores: NDArray[np.float32], k: int, floor: float) -> NDArray[np.int64]:
    """Indexes of the k best scores at or above `floor`, best first."""
    idx = np.argpartition(-scores, k - 1)[:k] if len(scores) > k else np.arange(len(scores))
    idx = idx[scores[idx] >= floor]
    return idx[np.argsort(-scores[idx], kind="stable")].astype(np.int64)


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
        func.coalesce(mv.status, "") == "active", prefix_match(mv.ns_path, who.prefix),
        reads.layer_filter(task, session), reads.not_expired(now_us), reads.not_forgotten())
    return list((await conn.execute(q)).all())


async def valid_candidates(conn: AsyncConnection, who: reads.Principal,
                           idx: PrincipalIndex, qtext: str | None,
                           qvec: NDArray[np.float32] | None, lag: list[str], emb: Embedder,
                           *, task: str | None, session: str | None, limit: int,
                           now_us: int) -> tuple[list[Any], dict[str, Candidate]]:
    """Candidates re-checked against the active view: (rows, relevance by memory id)."""
    cands: dict[str, Candidate] = {}
    basis = "semantic match" if qvec is not None else "in scope"
    # Every memory of the current task and session: their groups only (R2).
    groups = [idx.groups[g] for g in (("task", task or ""), ("session", session or ""))
              if g[1] and g in idx.groups]
    for g in groups:
        sims = cosine_scores(g.columns, qvec) if qvec is not None else np.ones(len(g.ids))
        for m, sim in zip(g.ids, sims, strict=True):
            cands[m] = Candidate(float(sim), basis)
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
                cands[mid] = Candidate(float(scores[int(i)]) if scores is not None else 1.0,
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
        q = norm_key(qtext) if qtext is not None else None
        for r, sim in zip(fresh, sims, strict=True):
            cands[r.memory_id] = (Candidate(1.0, "exact key match") if q == norm_key(r.mkey)
                                  else Candidate(float(sim), basis))
    return list(valid.values()), cands
