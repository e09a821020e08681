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

The steps live in modules of their own: `projections.index_cache` (the principal's
vectors, cached; `projections.principal_index` holds and scores them),
`projections.candidates` (steps 1-3), `projections.ranking` (4, 5 and 7),
`projections.budget` (6) and `projections.recall_audit` (8).
"""

from __future__ import annotations

from typing import Any

from ledger.store import Store
from projections import reads
from projections.budget import fit
from projections.candidates import lagging_writes, opened, valid_candidates
from projections.embedding import embed_queries
from projections.index_cache import principal_index, read_positions
from projections.ranking import rank, relevant_tasks
from projections.recall_audit import write_audit
from projections.vectors import store_embedder


async def recall(store: Store, principal: str, *, query: str | None, session: str | None,
                 task: str | None, budget: int | None, limit: int, now_us: int
                 ) -> dict[str, Any]:
    """Run the recall pipeline for a principal; see the module docstring."""
    who = reads.Principal.parse(principal)
    await store.open()
    emb = await store_embedder(store)  # the ledger's recorded embedder
    qtext = (query or "").strip() or None
    qvec = embed_queries(emb, [qtext])[0] if qtext else None
    async with store.read() as conn:
        at = await read_positions(conn, who.tenant, store)
        idx = await principal_index(conn, store, who, emb, at)
        lag = await lagging_writes(conn, who, idx, at.head)
        rows, cands = await valid_candidates(conn, store, who, idx, qtext, qvec, lag, emb,
                                             task=task, session=session, limit=limit,
                                             now_us=now_us)
        # An index that is caught up lists every open task: none there, none to read.
        settled = idx.pending is None and idx.position >= at.head and not idx.other_models
        open_tasks = await reads.tasks(conn, who) if idx.task_ids or not settled else []
    items = rank(rows, cands, qtext is not None)
    chosen_tasks = relevant_tasks(open_tasks, idx, emb, qtext, qvec, task)
    picked_tasks, picked, used = fit(chosen_tasks, items, budget, limit,
                                     lambda r: opened(store, r))
    audit_id = await write_audit(store, who, qtext, picked, picked_tasks, now_us)
    return {"items": picked, "tasks": picked_tasks, "audit_id": audit_id,
            "tokens": used, "budget": budget}

