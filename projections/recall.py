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

import asyncio
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, cast

from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.store import Store
from projections import reads
from projections.budget import fit
from projections.candidates import lagging_writes, opened, valid_candidates
from projections.embedding import embed_queries
from projections.index_cache import principal_index, read_positions
from projections.ranking import rank, relevant_tasks
from projections.recall_audit import write_audit
from projections.vectors import store_embedder


class _ReadOnFirstUse:
    """A read transaction (`Store.read`) begun when a statement first needs it.

    On a SQLite file a warm recall reads everything on the calling thread
    (`projections.sql.point_rows`: the positions, the re-check, the lexical match) and
    never touches its read connection; beginning one anyway costs a check-out, a
    `BEGIN` and a return through aiosqlite's thread (several thread hand-offs a recall,
    each a wait for a CPU on a busy machine). The connection's methods recall's steps
    use (`execute`, `exec_driver_sql`, `run_sync`, `dialect`) open it on first use, so
    the paths that need it (an index to load or patch, writes the index lags behind,
    open tasks to read, a point read SQLite could not run) get the same transaction
    they had, begun later. Its statements were never one snapshot with the point reads
    (each of those is a fresh autocommit read), so beginning it later changes nothing
    they rely on: every one reads at least what the positions read first saw."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._cm: AbstractAsyncContextManager[AsyncConnection] | None = None
        self._conn: AsyncConnection | None = None
        self._lock = asyncio.Lock()
        self.opened = False

    async def _get(self) -> AsyncConnection:
        if self._conn is None:
            async with self._lock:  # the lexical arm runs beside the main flow
                if self._conn is None:
                    cm = self._store.read()
                    conn = await cm.__aenter__()
                    self._cm, self._conn, self.opened = cm, conn, True
        return self._conn

    @property
    def dialect(self) -> Any:
        """The engine's dialect (no connection needed)."""
        return self._store.engine.dialect

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        """`AsyncConnection.execute` on the transaction, begun now if not yet."""
        return await (await self._get()).execute(*args, **kwargs)

    async def exec_driver_sql(self, *args: Any, **kwargs: Any) -> Any:
        """`AsyncConnection.exec_driver_sql`, likewise."""
        return await (await self._get()).exec_driver_sql(*args, **kwargs)

    async def run_sync(self, *args: Any, **kwargs: Any) -> Any:
        """`AsyncConnection.run_sync`, likewise."""
        return await (await self._get()).run_sync(*args, **kwargs)

    async def __aenter__(self) -> AsyncConnection:
        # Typed as the connection it stands for: recall's steps take an AsyncConnection
        # and use only the methods above.
        return cast(AsyncConnection, self)

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._cm is not None:
            cm, self._cm, self._conn = self._cm, None, None
            await cm.__aexit__(et, e, tb)


def _read(store: Store) -> AbstractAsyncContextManager[AsyncConnection]:
    """Recall's read transaction: begun on first use where point reads serve a warm
    recall (SQLite files), else at once (`Store.read`)."""
    if store.recorder.point_reads() is not None:
        return _ReadOnFirstUse(store)
    return store.read()


async def recall(store: Store, principal: str, *, query: str | None, session: str | None,
                 task: str | None, budget: int | None, limit: int, now_us: int
                 ) -> dict[str, Any]:
    """Run the recall pipeline for a principal; see the module docstring."""
    who = reads.Principal.parse(principal)
    await store.open()
    emb = await store_embedder(store)  # the ledger's recorded embedder
    qtext = (query or "").strip() or None
    qvec = embed_queries(emb, [qtext])[0] if qtext else None
    async with _read(store) as conn:
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

