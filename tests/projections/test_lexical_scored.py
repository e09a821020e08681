"""The lexical arm scored in process (`projections.lexical.scored_hits`) ranks exactly
as FTS5's own `bm25` ranking (`projections.sql.lexical_hits`): the same entries, in the
same order, with bit-equal scores, for any corpus, query, principal share, layer filter
and k; its cache of row sizes follows every change to the index (R14, R24)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete

from ledger import schema as t
from ledger.store import Store
from projections import lexical, reads
from projections.lexical import docid, scope_term, search, terms
from projections.sql import _docsizes, _varints, lexical_insert

SEP = lexical.SEP
WORDS = ["kiwi", "mango", "refund", "earbud", "ticket", "python", "order", "reply",
         "language", "tea", "gift", "budget", "2024", "a123", "回复语言", "耳机", "工单",
         "退款", "x"]
PRINCIPALS = [reads.Principal("shop-a", "u7"), reads.Principal("shop-a", "u8"),
              reads.Principal("shop-b", "u7")]

entry = st.tuples(
    st.sampled_from(range(len(PRINCIPALS))),
    st.sampled_from(["long", "long", "long", "task", "session"]),
    st.sampled_from(["T1", "T2"]),
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=9))


def rows_of(entries: list[tuple[int, str, str, list[str]]]) -> list[dict[str, Any]]:
    out = []
    for i, (p, layer, tag, words) in enumerate(entries):
        who = PRINCIPALS[p]
        item = f"M{i}"
        out.append({"tenant": who.tenant, "item_id": item, "docid": docid(who.tenant, item),
                    "ns_path": SEP.join([who.tenant, who.user, "notes"]) + SEP,
                    "layer": layer, "task_key": tag if layer == "task" else None,
                    "session_id": tag if layer == "session" else None,
                    "scope": scope_term(who.tenant, who.user),
                    "terms": " ".join(terms(" ".join(words)))})
    return out


async def index(store: Store, rows: list[dict[str, Any]]) -> None:
    async with store.write() as conn:
        await conn.execute(delete(t.lexical_docs))
        await lexical_insert(store, conn, rows)


async def both(store: Store, who: reads.Principal, query: str, k: int, *,
               task: str | None, session: str | None, monkeypatch: pytest.MonkeyPatch
               ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(FTS5's ranking, the in-process one)."""
    out = []
    for mode in ("0", "1"):
        monkeypatch.setenv(lexical.IN_PROCESS_ENV, mode)
        async with store.read() as conn:
            out.append(await search(conn, store, who, query, task=task, session=session,
                                    k=k))
    return out[0], out[1]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(entry, min_size=1, max_size=70),
       st.lists(st.sampled_from(WORDS), min_size=1, max_size=5),
       st.sampled_from(range(len(PRINCIPALS))), st.sampled_from([1, 3, 10]),
       st.sampled_from([1e-9, 0.5, 1.01]), st.sampled_from([None, "T1"]),
       st.sampled_from([None, "T2"]))
async def test_in_process_bm25_ranks_as_fts5(store: Store, entries: Any, words: list[str],
                                             p: int, k: int, unscoped_from: float,
                                             task: str | None, session: str | None) -> None:
    """Any corpus (entries of several principals and tenants, of every layer, of any
    length, duplicates included, so scores tie), any query: the in-process ranking is
    FTS5's, entry for entry and bit for bit, scoped or unscoped; asked twice (the row
    sizes from the cache the second time) and after the index changed under it."""
    if store.dialect != "sqlite":
        pytest.skip("FTS5 is SQLite's; PostgreSQL ranks with ts_rank, one path")
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(lexical, "UNSCOPED_FROM", unscoped_from)
        mp.setattr(lexical, "MIN_DF_DOCS", 10)
        await index(store, rows_of(entries))
        who, query = PRINCIPALS[p], " ".join(words)
        for _ in range(2):
            fts5, mine = await both(store, who, query, k, task=task, session=session,
                                    monkeypatch=mp)
            assert mine == fts5
            assert len(mine) <= k
        # The index changes (every entry one term longer): no cached size is used.
        await index(store, rows_of([(q, layer, tag, [*ws, "extra"])
                                    for q, layer, tag, ws in entries]))
        fts5, mine = await both(store, who, query, k, task=task, session=session,
                                monkeypatch=mp)
        assert mine == fts5
    finally:
        mp.undo()


async def test_sizes_cache_follows_a_rewritten_entry(store: Store,
                                                     monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    """An entry deleted and written again under the same row id with another length
    (the cache holds its old size) is scored with its new one."""
    if store.dialect != "sqlite":
        pytest.skip("FTS5 is SQLite's")
    base = [(0, "long", "T1", ["refund", "order"] + (["tea"] if i % 2 else []))
            for i in range(30)]
    await index(store, rows_of(base))
    who = PRINCIPALS[0]
    fts5, mine = await both(store, who, "refund", 10, task=None, session=None,
                            monkeypatch=monkeypatch)
    assert mine == fts5
    longer = rows_of([(0, "long", "T1", ["refund", *WORDS[:8]])])
    async with store.write() as conn:
        await conn.execute(delete(t.lexical_docs).where(
            t.lexical_docs.c.docid == longer[0]["docid"]))
        await lexical_insert(store, conn, longer)
    fts5, mine = await both(store, who, "refund", 10, task=None, session=None,
                            monkeypatch=monkeypatch)
    assert mine == fts5
    assert "M0" not in [m for m, _ in mine[:1]]  # longer now: ranked lower than before


async def test_in_process_ranking_stays_in_scope(store: Store,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Another principal's entries, sharing every term, never come back (R24), and a
    session memory comes back only in its session (R2)."""
    if store.dialect != "sqlite":
        pytest.skip("FTS5 is SQLite's")
    entries = [(1, "long", "T1", ["refund", "order"]), (2, "long", "T1", ["refund"]),
               (0, "session", "T2", ["refund"]), (0, "long", "T1", ["order", "tea"])]
    await index(store, rows_of(entries * 5))
    monkeypatch.setattr(lexical, "UNSCOPED_FROM", 0.0)
    for session in (None, "T2"):
        fts5, mine = await both(store, PRINCIPALS[0], "refund order", 50, task=None,
                                session=session, monkeypatch=monkeypatch)
        assert mine == fts5
        ids = {int(m[1:]) % 4 for m, _ in mine}
        assert ids == ({2, 3} if session else {3})


async def test_long_entries_sizes_of_several_bytes(store: Store,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries of more than 127 and 16,383 terms (their sizes take two and three bytes
    in FTS5's records) are scored as FTS5 scores them."""
    if store.dialect != "sqlite":
        pytest.skip("FTS5 is SQLite's")
    long_words = [f"w{i}" for i in range(200)]
    entries = [(0, "long", "T1", ["refund", *long_words]),
               (0, "long", "T1", ["refund", *(f"v{i}" for i in range(17_000))]),
               *((0, "long", "T1", ["refund", "order"]) for _ in range(5))]
    await index(store, rows_of(entries))
    for query in ("refund", "refund w3", "w7 order v9"):
        fts5, mine = await both(store, PRINCIPALS[0], query, 10, task=None, session=None,
                                monkeypatch=monkeypatch)
        assert mine == fts5
        assert mine


def varint(n: int) -> bytes:
    """A SQLite varint (big-endian groups of 7 bits, the high bit set on all but the
    last; values below 2**56 here)."""
    out = [n & 0x7F]
    n >>= 7
    while n:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    return bytes(reversed(out))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-(2**40), 2**40),
                          st.lists(st.one_of(st.integers(0, 127), st.integers(0, 2**20)),
                                   min_size=0, max_size=3)), max_size=60))
def test_docsize_decoding_sums_each_rows_varints(rows: list[tuple[int, list[int]]]) -> None:
    """`_docsizes` (numpy where every varint is one byte) gives each row the sum of its
    columns' sizes, as `_varints` decodes them one by one, for any mix of short and
    long varints and empty size records."""
    raw = [(d, b"".join(varint(x) for x in cols)) for d, cols in rows]
    ids, sizes = _docsizes(raw)
    assert ids.tolist() == [d for d, _ in rows]
    assert sizes.tolist() == [float(sum(_varints(b))) for _, b in raw]
    assert sizes.tolist() == [float(sum(cols)) for _, cols in rows]
