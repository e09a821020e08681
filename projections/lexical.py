"""The lexical index: the terms of every active memory, for recall's keyword arm.

Projection `lexical` keeps `lexical_docs` equal to {active memories} (the same rows the
vector index holds, recomputed the same way: from the *current* rows of `mem_versions`
for the slots a batch touches, `projections.vectors.touched` / `slots_of`), each with
its set of terms. Searched by `search`, always inside one principal's scope in SQL.

Terms (`terms`): the text is NFKC-normalised and casefolded; a run of latin letters or
digits is one term, with one common English inflection stripped (the default
embedder's `light_stem`: "groups" -> "group"; measured on the LoCoMo development split,
docs/recall.md); a run of CJK characters (ideographs, kana, hangul) gives its
character bigrams (a one-character run: that character). Bigrams need no dictionary,
match any Chinese word of two or more characters and are what CJK full-text indexes
commonly use. A memory's entry is the *set* of its terms, sorted: no order, no
positions, no counts, so the index cannot give the text back; it still tells which
words a memory contains, which is why a forget deletes the entry (R20).

Backends:

- SQLite: FTS5, contentless (`content=''`, FTS5's default `detail=full`), so the index
  stores only term -> row and position lists; triggers on `lexical_docs` keep it equal
  to that table, and a batch with a forget merges the index (`optimize`) so the
  forgotten terms leave its segments (with `secure_delete` on, the freed pages are
  zeroed). Ranked by FTS5's BM25 (k1 1.2, b 0.75), the principal's scope filtered by a
  hashed principal term in the match itself and again on the joined row; FTS5's best are
  taken before the join. By default that ranking is computed in process (`scored_hits`:
  each term's row ids from FTS5, the rows' sizes cached while the index is unchanged,
  every row's at once when a process has needed many of them, FTS5's formula in numpy;
  the same entries, order and scores), since FTS5's `bm25` looks up every match's size.
- PostgreSQL: an expression GIN index `to_tsvector('simple', terms)`; ranked by
  `ts_rank` (term frequency, no IDF: PostgreSQL has no BM25), the scope filtered on the
  row, over at most `PG_MATCH_CAP` matching rows. Deleting the row deletes its index
  entries (VACUUM reclaims them).

Query terms in more than `MAX_DF_FRACTION` of the entries are dropped before matching
(`frequent_terms`): they cost a score per matching entry and add next to nothing.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import unicodedata
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray
from sqlalchemy import and_, bindparam, delete, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.forgets import Tombstone, covers_sql
from ledger.records import StoredEvent
from ledger.store import Store
from projections.bulk import FTS_LOAD_ROWS, lexical_fts_step, lexical_load_start
from projections.embedding import light_stem
from projections.protocol import finished, progressed
from projections.reads import Principal, not_forgotten
from projections.sql import (
    in_list,
    insert_rows,
    lexical_delete,
    lexical_hits,
    lexical_insert,
    lexical_merge,
    lexical_postings,
    lexical_rows,
    lexical_sizes,
    lexical_term_shares,
    page_after,
    pairs_of,
    prefix_match,
    prefix_range,
    prepared,
    tenant_parts,
)
from projections.vectors import (
    apply_settling,
    memory_text,
    slot_rows,
    slots_of,
    touched,
)

#: `meta` row: events after this position may have been indexed from a lagging view.
PENDING_META: Final = "lexical.pending_after"
#: Terms of a query used at most (the first ones, in order of appearance).
MAX_QUERY_TERMS: Final = 32
#: A query term in more than this fraction of the index's entries is dropped (its BM25
#: IDF is next to nothing, and matching it costs a score per entry). Chosen on the
#: LoCoMo development split (docs/recall.md, "The lexical arm's cost").
MAX_DF_FRACTION: Final = 0.03
#: Below this many entries no term is dropped (fractions of a few entries mean nothing).
MIN_DF_DOCS: Final = 50
#: FTS5's best `FTS_FACTOR x k` entries are joined to their rows, of which `k` are kept
#: (the join re-checks tenant, namespace prefix and layer, which may drop some).
FTS_FACTOR: Final = 2
#: SQLite: when the principal's entries are at least this share of the index, its scope
#: term is left out of the full-text match and checked on the joined rows only
#: (`projections.sql.lexical_hits`: the same best entries, half the work for a
#: principal that is most of the index).
UNSCOPED_FROM: Final = 0.5
#: PostgreSQL: matching rows ranked by `ts_rank` at most (taken in index order).
PG_MATCH_CAP: Final = 2000
#: SQLite: the arm is scored in process from the terms' row ids (`scored_hits`: FTS5's
#: own BM25, the same order) unless this is "0" (then FTS5's `bm25` ranks every match).
IN_PROCESS_ENV: Final = "MEMLEDGER_LEXICAL_IN_PROCESS"
#: FTS5's BM25 constants (fts5_aux.c).
BM25_K1: Final = 1.2
BM25_B: Final = 0.75
#: Per-connection TEMP `fts5vocab` view of the index (term document counts).
VOCAB: Final = "lexical_vocab"
SEP: Final = "\x1f"

_TERM: Final = re.compile(
    r"(?P<lat>[0-9a-z\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff]+)"
    r"|(?P<cjk>[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+)")


def _ordered_terms(text: str) -> list[str]:
    out: list[str] = []
    # `findall` gives each match's (latin, cjk) groups, one of them empty: the same
    # matches as `finditer`, without a match object each.
    for lat, cjk in _TERM.findall(unicodedata.normalize("NFKC", text).casefold()):
        if lat:
            out.append(light_stem(lat))
        elif len(cjk) > 1:
            out.extend(cjk[i:i + 2] for i in range(len(cjk) - 1))
        else:
            out.append(cjk)
    return out


def terms(text: str) -> list[str]:
    """The sorted set of a text's terms (latin words; CJK character bigrams)."""
    return sorted(set(_ordered_terms(text)))


def query_terms(text: str) -> list[str]:
    """A query's distinct terms in order of appearance, at most `MAX_QUERY_TERMS`."""
    return list(dict.fromkeys(_ordered_terms(text)))[:MAX_QUERY_TERMS]


@functools.lru_cache(maxsize=1 << 12)
def scope_term(tenant: str, user: str) -> str:
    """The hashed principal a memory belongs to: the FTS5 filter term (no name in it)."""
    return "p" + hashlib.blake2b(f"{tenant}{SEP}{user}".encode(), digest_size=10).hexdigest()


def docid(tenant: str, item_id: str) -> int:
    """The entry's full-text row id: a deterministic positive 63-bit hash."""
    h = hashlib.blake2b(f"{tenant}{SEP}{item_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


def doc_rows(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """The `lexical_docs` rows of active `mem_versions` rows (tenant, memory_id, ns_path,
    mkey, layer, task_key, session_id, value, text)."""
    out = []
    for r in rows:
        user = r.ns_path.split(SEP)[1] if r.ns_path.count(SEP) >= 2 else ""
        out.append({"tenant": r.tenant, "item_id": r.memory_id,
                    "docid": docid(r.tenant, r.memory_id), "ns_path": r.ns_path,
                    "layer": r.layer, "task_key": r.task_key, "session_id": r.session_id,
                    "scope": scope_term(r.tenant, user),
                    "terms": " ".join(terms(memory_text(r.mkey, r.value, r.text)))})
    return out


_MEM_COLUMNS: Final = ("tenant", "memory_id", "ns_path", "mkey", "layer", "task_key",
                       "session_id", "value", "text")


class LexicalProjection:
    """Keeps `lexical_docs` (and, on SQLite, its FTS5 index) equal to {active memories}."""

    name = "lexical"
    tables = (t.lexical_docs,)
    types: tuple[str, ...] | None = None  # any event may touch an indexed memory
    depends_on: tuple[str, ...] = ("memories",)

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: dict[str, Any],
                        size: int) -> tuple[dict[str, Any] | None, int]:
        """One step of a bulk load: index the active memories by primary key (phase
        `docs`); on SQLite the rows go in without their full-text entries, which phase
        `fts` then writes from them in row id order (`projections.bulk`)."""
        if "phase" not in state:
            state["phase"] = "docs"
            state["fts"] = await lexical_load_start(store, conn)
        if state["phase"] == "fts":
            last = await lexical_fts_step(conn, state.get("after"))
            if last is None:
                return finished(state)
            state["after"] = last
            return progressed(state, FTS_LOAD_ROWS)
        mv = t.mem_versions.c
        rows = await page_after(conn, select(*[mv[c] for c in _MEM_COLUMNS]).where(
            mv.status == "active", not_forgotten()), (mv.tenant, mv.memory_id),
            state.get("after"), size)
        if state["fts"]:
            await insert_rows(store, conn, t.lexical_docs, doc_rows(rows))
        else:
            await lexical_insert(store, conn, doc_rows(rows))
        if len(rows) < size:
            if not state["fts"]:
                return finished(state)
            state.update(phase="fts", after=None)
            return progressed(state, len(rows))
        state["after"] = [rows[-1].tenant, rows[-1].memory_id]
        return progressed(state, len(rows))

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        """Recompute the entries of every memory slot the batch touches.

        As `projections.vectors` does: when `memories` lags behind this batch, the
        range it could not settle is kept (`meta` row `lexical.pending_after`) and
        read again with the next batch, so the index converges.
        """
        await apply_settling(store, conn, batch, self._sync, PENDING_META, self.depends_on)

    async def _sync(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent], upto: int) -> None:
        touch = touched(batch)
        tombs = await touch.tombstones(store, conn, upto)
        ld = t.lexical_docs.c
        for ts in tombs:
            await conn.execute(delete(t.lexical_docs).where(ld.tenant == ts.tenant,
                                                            _covered(ts)))
        slots = await slots_of(conn, touch.mem_ids, touch.slots, tombs)
        # Every row of those slots, read once: which memories the batch reaches, and
        # (`keep`) which of them are indexed.
        every: set[tuple[str, str]] = set(touch.mem_ids)
        wanted: list[Any] = []
        for r in await slot_rows(conn, slots):
            every.add((r.tenant, r.memory_id))
            if r.indexed:
                wanted.append(r)
        # Only what changed is written: an entry the index holds already, the same, stays
        # (a full-text delete and insert of it would cost as much as a new entry).
        new = {(d["tenant"], d["item_id"]): d for d in doc_rows(wanted)}
        stale: list[int] = []
        for r in await _entries(conn, every):
            have = dict(zip(_DOC_COLUMNS, r, strict=True))
            if new.get((r.tenant, r.item_id)) == have:
                del new[(r.tenant, r.item_id)]
            else:
                stale.append(int(r.docid))
        await lexical_delete(store, conn, stale)
        await lexical_insert(store, conn, list(new.values()))
        if tombs:
            await lexical_merge(store, conn)


#: Every column of `lexical_docs`, as `doc_rows` gives them.
_DOC_COLUMNS: Final = tuple(c.name for c in t.lexical_docs.c)


async def _entries(conn: AsyncConnection, pairs: set[tuple[str, str]]) -> list[Any]:
    """The `lexical_docs` rows (every column) of these (tenant, item id)s.

    SQLite: per tenant, `tenant = ? AND item_id IN (...)` in chunks (the primary key on
    both columns; a row-value IN would scan). PostgreSQL: one statement for them all,
    over arrays (`in_list` for one tenant, else `pairs_of`)."""
    ld = t.lexical_docs.c
    held = prepared(("lexical.entries", conn.dialect.name), lambda: select(
        *[ld[c] for c in _DOC_COLUMNS]).where(ld.tenant == bindparam("tenant"),
                                              in_list(conn, ld.item_id, "ids")))
    rows: list[Any] = []
    for tenant, part in tenant_parts(conn, pairs):
        if tenant is not None:
            rows += (await conn.execute(held, {"tenant": tenant, "ids": part})).all()
        else:
            rows += (await conn.execute(select(*[ld[c] for c in _DOC_COLUMNS]).where(
                pairs_of(conn, ld.tenant, ld.item_id, part)))).all()
    return rows


def _covered(ts: Tombstone) -> Any:
    """SQL over `lexical_docs`: entries a tombstone reaches (key from `mem_versions`)."""
    ld, mv = t.lexical_docs.c, t.mem_versions.c
    mkey = select(mv.mkey).where(mv.tenant == ld.tenant, mv.memory_id == ld.item_id
                                 ).scalar_subquery()
    return covers_sql(ts, ld, memory_id=ld.item_id, mkey=mkey)


def _layers(task: str | None, session: str | None) -> Any:
    ld = t.lexical_docs.c
    conds = [ld.layer == "long"]
    if task is not None:
        conds.append(and_(ld.layer == "task", ld.task_key == task))
    if session is not None:
        conds.append(and_(ld.layer == "session", ld.session_id == session))
    return or_(*conds)


async def frequent_terms(conn: AsyncConnection, store: Store, qt: Sequence[str],
                         scope: str | None = None) -> set[str]:
    """Those of the query terms `qt` in more than `MAX_DF_FRACTION` of the entries."""
    return (await _frequent_and_scope_share(conn, store, qt, scope))[0]


async def _frequent_and_scope_share(conn: AsyncConnection, store: Store, qt: Sequence[str],
                                    scope: str | None) -> tuple[set[str], float | None]:
    """The frequent query terms, and the share of the index that is the principal's
    (hashed `scope` term; None where not known), from one look-up."""
    shares, own = await lexical_term_shares(store, conn, qt, vocab=VOCAB,
                                            min_docs=MIN_DF_DOCS, scope_term=scope)
    return {x for x, share in shares.items() if share > MAX_DF_FRACTION}, own


async def search(conn: AsyncConnection, store: Store, who: Principal, query: str, *,
                 task: str | None, session: str | None, k: int) -> list[tuple[str, float]]:
    """The principal's memory ids that share terms with the query, with their score
    (higher is better), best first, at most `k`: long-term ones and those of the given
    task and session only (R2, R24).

    Bounded work: query terms in more than `MAX_DF_FRACTION` of the index's entries are
    dropped (their IDF is next to nothing; a query of only such terms keeps them all),
    and the full-text engine's best `FTS_FACTOR x k` are taken before any join.
    """
    qt = query_terms(query)
    if not qt:
        return []
    mine = scope_term(who.tenant, who.user)
    frequent, own = await _frequent_and_scope_share(conn, store, qt, mine)
    qt = [x for x in qt if x not in frequent] or qt
    ld = t.lexical_docs.c
    scope = [ld.tenant == who.tenant, prefix_match(ld.ns_path, who.prefix),
             *prefix_range(store, ld.ns_path, who.prefix), _layers(task, session)]
    if os.environ.get(IN_PROCESS_ENV, "1").strip() != "0":
        fts_k = FTS_FACTOR * k
        if own and own >= UNSCOPED_FROM:  # as `lexical_hits`: unscoped first
            got = await scored_hits(store, conn, mine, qt, who, task=task, session=session,
                                    k=k, page=min(math.ceil(fts_k / own), 4 * fts_k),
                                    unscoped=True)
            if got is not None and (len(got[0]) >= k or not got[1]):
                return got[0]
        got = await scored_hits(store, conn, mine, qt, who, task=task, session=session,
                                k=k, page=fts_k, unscoped=False)
        if got is not None:
            return got[0]
    rows = await lexical_hits(store, conn, mine, qt, tenant=who.tenant, prefix=who.prefix,
                              task=task, session=session, scope=scope, k=k,
                              fts_k=FTS_FACTOR * k, pg_cap=PG_MATCH_CAP, scope_share=own,
                              unscoped_from=UNSCOPED_FROM)
    return [(item, float(score)) for item, score in rows]


def fts5_idf(n_row: int, n_hit: int) -> float:
    """FTS5's IDF of a phrase in `n_hit` of `n_row` rows (fts5_aux.c: never <= 0)."""
    idf = math.log((n_row - n_hit + 0.5) / (n_hit + 0.5))
    return idf if idf > 0.0 else 1e-6


def bm25_scores(present: Sequence[NDArray[np.bool_]], idf: Sequence[float],
                sizes: NDArray[np.float64], avgdl: float) -> NDArray[np.float64]:
    """FTS5's `bm25` (negated: higher is better) of rows holding each query phrase at
    most once (`present[i]`: which rows hold phrase i; `sizes`: each row's length in
    tokens, every column), with the same double arithmetic in the same order as
    fts5_aux.c, so equal inputs give bit-equal scores (an entry is a *set* of terms:
    a phrase occurs once in it or not at all)."""
    k1, b = BM25_K1, BM25_B
    # (1 - b + b * D / avgdl), as C evaluates it: ((1 - b) + ((b * D) / avgdl)).
    norm = k1 * ((1 - b) + (b * sizes) / avgdl)
    score = np.zeros(len(sizes), dtype=np.float64)
    for mask, w in zip(present, idf, strict=True):
        freq = mask.astype(np.float64)
        score = score + w * ((freq * (k1 + 1.0)) / (freq + norm))
    return score


async def scored_hits(store: Store, conn: AsyncConnection, scope: str, qt: Sequence[str],
                      who: Principal, *, task: str | None, session: str | None, k: int,
                      page: int, unscoped: bool
                      ) -> tuple[list[tuple[str, float]], bool] | None:
    """`lexical_hits`' SQLite ranking computed in process (None where it cannot be:
    PostgreSQL, an empty index): the row ids holding each term
    (`projections.sql.lexical_postings`; inside the principal's hashed `scope` term
    unless `unscoped`), their sizes (cached while the index is unchanged), FTS5's BM25
    over them (`bm25_scores`), ranked as FTS5 ranks them (score, then row id); the best
    `page` are joined to their rows and checked for tenant, namespace prefix and layer,
    and the first `k` of those that pass kept. Returns them and whether the page was
    cut (more rows matched than `page`): the same as `lexical_hits`' subquery with its
    LIMIT, without FTS5 computing `bm25` (and looking up each row's size) per match."""
    post = await lexical_postings(store, conn, qt, scope_term=None if unscoped else scope)
    if post is None:
        return None
    lists = [np.asarray(x, dtype=np.int64) for x in post.docids]
    every = np.concatenate(lists)
    if not len(every):
        return [], False
    ids, inv = np.unique(every, return_inverse=True)
    present = []
    at = 0
    for x in lists:
        mask = np.zeros(len(ids), dtype=bool)
        mask[inv[at:at + len(x)]] = True
        at += len(x)
        present.append(mask)
    sizes = await lexical_sizes(store, conn, ids, post.structure, post.n_row)
    scores = bm25_scores(present, [fts5_idf(post.n_row, n) for n in post.n_hit], sizes,
                         post.n_token / post.n_row)
    order = np.lexsort((ids, -scores))[:page]
    page_ids = ids[order].tolist()
    page_scores = scores[order].tolist()
    found: list[tuple[str, float]] = []
    # The page's rows in two reads at most: its first k (where the principal holds the
    # matches, as a scoped match or an unscoped one where it is most of the index
    # ensure, they usually pass), then the rest only if fewer than k of those did.
    start = 0
    for end in (k, len(page_ids)):
        if start >= end or len(found) >= k:
            break
        rows = await lexical_rows(store, conn, page_ids[start:end], tenant=who.tenant,
                                  prefix=who.prefix, task=task, session=session)
        for d, s in zip(page_ids[start:end], page_scores[start:end], strict=True):
            got = rows.get(d)
            if got is not None and got[1]:
                found.append((got[0], s))
        start = end
    return found[:k], len(ids) >= page
