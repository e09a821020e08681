"""MemledgerStore's fast paths (docs/langgraph.md, docs/benchmarks.md).

Reads on a SQLite file are answered on the caller's thread by point reads: the same
answers as the loop path for any get and unranked search (filters, paging, created
times after an update and after a delete and a new put), the principal's scope and
the tombstones in the SQL (R20, R24).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("langgraph.store.base")

from langgraph.store.base import GetOp, ListNamespacesOp, MatchCondition, PutOp, SearchOp

from memledger.langgraph import MemledgerStore, _ranked, _rows
from projections import reads, store_reads

ROOT = Path(__file__).resolve().parents[2]


def _dicts(results: list[Any]) -> list[Any]:
    out: list[Any] = []
    for r in results:
        if isinstance(r, list):
            out.append([i if isinstance(i, tuple) else (i.dict(), getattr(i, "score", None))
                        for i in r])
        else:
            out.append(None if r is None else r.dict())
    return out


def _fill(store: MemledgerStore) -> None:
    for u in ("u7", "u8"):
        for i in range(6):
            store.put((u, "prefs"), f"k{i}", {"i": i, "tag": "even" if i % 2 == 0 else "odd",
                                              "nested": {"n": i * 10}})
        store.put((u, "notes", "deep"), "n1", {"i": 99, "tag": "even", "nested": {"n": 1}})
    time.sleep(0.002)
    store.put(("u7", "prefs"), "k1", {"i": 11, "tag": "odd", "nested": {"n": 5}})  # updated
    store.delete(("u7", "prefs"), "k2")
    store.put(("u7", "prefs"), "k2", {"i": 22, "tag": "even", "nested": {"n": 30}})  # again
    store.delete(("u8", "prefs"), "k3")


OPS: list[Any] = [
    GetOp(("u7", "prefs"), "k1"), GetOp(("u7", "prefs"), "k2"), GetOp(("u8", "prefs"), "k3"),
    GetOp(("u8", "prefs"), "k0"), GetOp(("nobody",), "k0"),
    SearchOp(("u7",), limit=3), SearchOp(("u7",), limit=3, offset=2),
    SearchOp(("u7", "prefs"), filter={"tag": "even"}, limit=2, offset=1),
    SearchOp((), filter={"nested.n": {"$gte": 20}}, limit=20),
    SearchOp((), filter={"tag": {"$ne": "odd"}, "i": {"$lt": 50}}, limit=5),
    SearchOp(("u8", "notes"), limit=10), SearchOp(("u9",), limit=10),
    ListNamespacesOp(), ListNamespacesOp(max_depth=1, limit=1, offset=1),
    ListNamespacesOp((MatchCondition("prefix", ("u7",)),)),
    ListNamespacesOp((MatchCondition("suffix", ("prefs",)),), max_depth=1),
]


@pytest.mark.parametrize("principal", [None, "langgraph/u7"])
def test_caller_thread_reads_answer_as_the_loop_path(sqlite_url: str,
                                                     principal: str | None) -> None:
    """Every get, unranked search and namespace listing gives on the caller's thread
    exactly what the store's loop path gives: items, order, paging, created and updated
    times; a principal-scoped store sees only its user on both paths (R24)."""
    admin = MemledgerStore(url=sqlite_url)
    try:
        _fill(admin)
    finally:
        admin.close()
    store = MemledgerStore(url=sqlite_url, principal=principal)
    try:
        store.setup()
        fast = store._read_now(OPS, embeds=True)
        assert fast is not None  # taken on this thread
        slow = store._call(store._batch(OPS))
        assert _dicts(fast) == _dicts(slow)
        by_key = {(i.namespace, i.key): i for i in fast[8]}
        updated = store.get(("u7", "prefs"), "k1")
        if principal is None:
            assert updated is not None and updated.created_at < updated.updated_at
            again = store.get(("u7", "prefs"), "k2")
            assert again is not None and again.created_at == again.updated_at
            assert fast[2] is None and (("u8", "prefs"), "k3") not in by_key
            assert fast[3] is not None
            assert fast[-1] == [("u7",), ("u8",)]
        else:
            assert fast[3] is None and all(i.namespace[0] == "u7" for i in fast[8])
            assert fast[10] == []
            assert fast[-1] == [("u7",)]
    finally:
        store.close()


DELETE = """
import sys
from memledger.langgraph import MemledgerStore
s = MemledgerStore(url=sys.argv[1])
s.delete(("u7", "prefs"), "lang")
s.close()
"""


def test_delete_by_another_process_is_unreadable_at_once(sqlite_url: str) -> None:
    """Another process deletes a key: the next get and search here, on the caller's
    thread, no longer return it (nothing is cached above SQLite, R20)."""
    store = MemledgerStore(url=sqlite_url)
    try:
        store.put(("u7", "prefs"), "lang", {"v": "zh"})
        assert store.get(("u7", "prefs"), "lang") is not None  # waits for the put's round
        assert store._read_now([GetOp(("u7", "prefs"), "lang")], embeds=True) is not None
        subprocess.run([sys.executable, "-c", DELETE, sqlite_url], cwd=ROOT, check=True,
                       timeout=120)
        assert store.get(("u7", "prefs"), "lang") is None
        assert store.search(("u7",)) == []
    finally:
        store.close()


def test_put_and_delete_return_once_every_view_has_them(sqlite_url: str) -> None:
    """A put is readable when it returns, and a delete returns only once every view the
    store keeps, the erasure included, has applied it (R16, R20): nothing is left to a
    background."""
    store = MemledgerStore(url=sqlite_url)
    try:
        for i in range(3):
            store.put(("u7", "prefs"), f"k{i}", {"i": i})
            assert store.get(("u7", "prefs"), f"k{i}") is not None
        store.delete(("u7", "prefs"), "k0")
        head = store._call(store._ml.store.head())
        assert set(store._call(store._rounds.runner.positions()).values()) == {head}
    finally:
        store.close()


def _embed(texts: list[str]) -> list[list[float]]:
    return [[float(t.count(c)) for c in "0123456789"] for t in texts]


RANKED: list[Any] = [
    SearchOp(("u7",), query="k1 11", limit=3), SearchOp(("u7",), query="k4", limit=2, offset=2),
    SearchOp((), query="even 30", filter={"tag": "even"}, limit=20),
    SearchOp(("u8", "prefs"), query="nothing", limit=10),
]


def test_ranked_search_on_the_caller_thread_answers_as_the_loop_path(
        sqlite_url: str) -> None:
    """A search with a query is ranked on the caller's thread (point reads, the
    vectors this process cached) with the loop path's items, scores and order, items
    without vectors last; where a candidate's vectors are not cached (written by
    another store) or the call is async, the loop path answers."""
    index: Any = {"dims": 10, "embed": _embed, "fields": ["tag", "nested.n"]}
    store = MemledgerStore(url=sqlite_url, index=index)
    try:
        _fill(store)
        store.put(("u8", "prefs"), "plain", {"tag": "none"}, index=False)
        # the put returned before its round: the caller's thread does not read views
        # behind this store's own writes (`batch` waits for the round first)
        assert store._read_now(RANKED, embeds=True) is None
        store.flush()
        fast = store._read_now(RANKED, embeds=True)
        assert fast is not None
        slow = store._call(store._batch(RANKED))
        assert _dicts(fast) == _dicts(slow)
        assert fast[0] and all(i.score is not None for i in fast[0])
        assert [i.key for i in fast[3]][-1] == "plain" and fast[3][-1].score is None
        assert store._read_now(RANKED, embeds=False) is None
    finally:
        store.close()
    other = MemledgerStore(url=sqlite_url, index=index)
    try:
        other.setup()
        assert other._read_now(RANKED[:1], embeds=True) is None  # nothing cached
        # embedded on first query (with the configured fields: the per-put
        # `index=False` of "plain", in the last search, is not known to another store)
        assert _dicts(other.batch(RANKED[:3])) == _dicts(slow[:3])
        assert other._read_now(RANKED[:3], embeds=True) is not None
    finally:
        other.close()


# -- issue 16: searches read less (docs/langgraph.md "Searches") -----------------------
def _fill_many(store: MemledgerStore) -> None:
    """Three users' items written in batches, some updated and some deleted later, so
    the newest rows are neither the first written nor all alike."""
    store.batch([PutOp((u, "prefs"), f"k{i}", {"i": i, "tag": ("even", "odd")[i % 2],
                                               "nested": {"n": (i * 7) % 30}})
                 for u in ("u7", "u8", "u9") for i in range(14)])
    store.batch([PutOp(("u7", "prefs"), f"k{i}", {"i": 100 + i, "tag": "odd",
                                                  "nested": {"n": i}}) for i in (0, 4, 9)])
    store.batch([PutOp(("u8", "prefs"), f"k{i}", None) for i in (1, 2, 13)])
    store.batch([PutOp(("u7", "notes", "deep"), f"n{i}", {"i": i, "tag": "even",
                                                         "nested": {"n": 25 + i}})
                 for i in range(4)])


FILTERS: list[dict[str, Any] | None] = [
    None, {"tag": "even"}, {"tag": "odd"}, {"i": {"$gte": 100}}, {"i": {"$lt": 3}},
    {"nested.n": {"$gt": 20}}, {"tag": "even", "i": {"$gte": 6}}, {"tag": "none"},
]
PREFIXES: list[tuple[str, ...]] = [(), ("u7",), ("u7", "prefs"), ("u8", "prefs"), ("u9",),
                                   ("u7", "notes")]


@pytest.mark.parametrize("principal", [None, "langgraph/u7"])
def test_any_search_on_the_caller_thread_answers_as_the_loop_path(
        sqlite_url: str, principal: str | None) -> None:
    """For any prefix, filter, offset and limit (hypothesis), an unranked search on the
    caller's thread (one statement without a filter; with one, windows of the newest
    rows grown until the page is full) gives the loop path's items, order and times;
    a principal's store only its user's (R24). Selective filters need every row."""
    admin = MemledgerStore(url=sqlite_url)
    try:
        _fill_many(admin)
    finally:
        admin.close()
    store = MemledgerStore(url=sqlite_url, principal=principal)
    try:
        store.setup()

        @settings(max_examples=80, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(st.sampled_from(PREFIXES), st.sampled_from(FILTERS),
               st.integers(0, 12), st.integers(1, 15))
        def check(prefix: tuple[str, ...], flt: dict[str, Any] | None, offset: int,
                  limit: int) -> None:
            ops: list[Any] = [SearchOp(prefix, filter=flt, limit=limit, offset=offset)]
            fast = store._read_now(ops, embeds=True)
            assert fast is not None
            assert _dicts(fast) == _dicts(store._call(store._batch(ops)))
            if principal is not None:
                assert all(i.namespace[0] == "u7" for i in fast[0])

        check()
    finally:
        store.close()


def _matches(value: dict[str, Any], flt: dict[str, Any] | None) -> bool:
    """The test's own reading of FILTERS (equality, `$gte`, `$lt`, `$gt`; a dotted key
    is a path)."""
    for key, want in (flt or {}).items():
        got: Any = value
        for part in key.split("."):
            got = got.get(part) if isinstance(got, dict) else None
        if isinstance(want, dict):
            ((opname, bound),) = want.items()
            if got is None or not {"$gte": got >= bound, "$lt": got < bound,
                                   "$gt": got > bound}[opname]:
                return False
        elif got != want:
            return False
    return True


def test_filtered_pages_are_slices_of_the_newest_first_order(db_url: str) -> None:
    """On both backends: a filtered search's page is the slice, at its offset, of the
    items passing the filter in the store's newest-first order, whatever the filter
    passes (all, few, none); deleted items never appear (R20)."""
    store = MemledgerStore(url=db_url)
    try:
        _fill_many(store)
        every = store.search((), limit=1000)
        assert len(every) == 42 - 3 + 4
        assert not {("u8", "prefs", f"k{i}") for i in (1, 2, 13)} & {
            (*i.namespace, i.key) for i in every}
        for flt in FILTERS:
            passing = [i for i in every if _matches(i.value, flt)]
            for offset, limit in ((0, 1), (0, 10), (3, 4), (9, 30)):
                got = store.search((), filter=flt, limit=limit, offset=offset)
                assert [(i.namespace, i.key, i.value) for i in got] == [
                    (i.namespace, i.key, i.value) for i in passing[offset:offset + limit]]
    finally:
        store.close()


def test_a_value_erased_after_the_read_is_left_out(sqlite_url: str) -> None:
    """Rows read with their values as stored (a search opens only the ones it keeps):
    an item deleted between the read and the opening opens as None (its key destroyed,
    R20) and `_decoded` leaves it out instead of returning it."""
    store = MemledgerStore(url=sqlite_url)
    try:
        store.put(("u7", "prefs"), "gone", {"v": 1})
        store.put(("u7", "prefs"), "kept", {"v": 2})
        store.flush()  # the views, read below without the store, show both puts
        ml = store._ml.store
        assert ml.vault is not None
        prefix = store._prefix(("u7",))
        rows = list(store_reads.below_now(ml, "langgraph", prefix, now_us=time.time_ns()
                                          // 1000, opened=False) or [])
        assert [r.mkey for r in rows] == ["kept", "gone"]
        store.delete(("u7", "prefs"), "gone")
        opener = reads.value_opener(ml)
        assert opener(rows[1].value) is None
        kept = store._decoded([(r, None, None) for r in rows], opener)
        assert [(r.mkey, ns, v) for r, ns, v in kept] == [("kept", ("u7", "prefs"), {"v": 2})]
    finally:
        store.close()


def _ranked_reference(q: np.ndarray[Any, Any], vecs: list[np.ndarray[Any, Any]], offset: int,
                      limit: int) -> list[tuple[int, float | None]]:
    """A candidate's score is its best cosine; order by score, then candidate number;
    the ones without vectors after, in order."""
    scored = []
    for n, v in enumerate(vecs):
        if len(v):
            cos = [float(r @ q) / (float(np.linalg.norm(r)) * float(np.linalg.norm(q)))
                   if np.linalg.norm(r) and np.linalg.norm(q) else 0.0 for r in v]
            scored.append((n, max(cos)))
    scored.sort(key=lambda x: (-x[1], x[0]))
    page: list[tuple[int, float | None]] = list(scored[offset:offset + limit])
    page += [(n, None) for n, v in enumerate(vecs) if not len(v)][:limit - len(page)]
    return page


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(-3, 3), min_size=3, max_size=3),
                         max_size=3), max_size=12),
       st.lists(st.integers(-3, 3), min_size=3, max_size=3), st.integers(0, 14),
       st.integers(1, 14))
def test_ranked_pages_order_by_best_score_then_candidate(
        vecs: list[list[list[int]]], q: list[int], offset: int, limit: int) -> None:
    """`_ranked` (one matrix product, the order by numpy's stable sort) gives, for any
    field vectors (none, one or several a candidate, zero vectors, ties), the page the
    plain definition gives: best cosine first, ties in candidate order, then the
    candidates without vectors."""
    arrays = [_rows(v) if v else _rows([]) for v in vecs]
    qa = np.asarray(q, dtype=float)
    got = _ranked(qa, arrays, offset, limit)
    want = _ranked_reference(qa, arrays, offset, limit)
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-9)


# -- issue 16: the point reads' prefix is a range, a filter's window tests its own rows --
#: Labels whose encodings sort next to each other and next to the separator: a space
#: (the character after the separator), `!`, `~` (the escape), characters above ASCII,
#: a label that is another's prefix, one with `/` (encoded) and one with the separator
#: itself (a control character: encoded).
TRICKY = ["a", "a ", "a!", "ab", "a~", "~a", "é", "a\u00ff", "A", "a/b", "a\x1fb", "z"]


def _fill_tricky(store: MemledgerStore) -> list[tuple[str, ...]]:
    spaces = [(x,) for x in TRICKY] + [(x, y) for x in TRICKY[:6] for y in TRICKY[:6]]
    store.batch([PutOp(ns, f"k{n}", {"n": n, "even": n % 2 == 0})
                 for n, ns in enumerate(spaces)])
    return spaces


@pytest.mark.parametrize("principal", [None, "langgraph/a", "langgraph/a "])
def test_point_read_prefix_ranges_select_what_startswith_selects(
        sqlite_url: str, principal: str | None) -> None:
    """The point reads test a namespace prefix (and a principal's) as a range of paths,
    without `substr`: for any prefix of labels that sort beside each other and beside
    the separator (hypothesis), the caller's thread finds exactly the items whose
    namespace starts with the prefix, as the loop path's `substr` test does, with and
    without a filter; a principal's store only its user's (R24)."""
    admin = MemledgerStore(url=sqlite_url)
    try:
        spaces = _fill_tricky(admin)
    finally:
        admin.close()
    store = MemledgerStore(url=sqlite_url, principal=principal)
    user = None if principal is None else principal.split("/", 1)[1]
    try:
        store.setup()

        @settings(max_examples=60, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(st.lists(st.sampled_from(TRICKY), max_size=3),
               st.sampled_from([None, {"even": True}]))
        def check(prefix: list[str], flt: dict[str, Any] | None) -> None:
            ops: list[Any] = [SearchOp(tuple(prefix), filter=flt, limit=100)]
            fast = store._read_now(ops, embeds=True)
            assert fast is not None
            assert _dicts(fast) == _dicts(store._call(store._batch(ops)))
            want = {ns for n, ns in enumerate(spaces) if ns[:len(prefix)] == tuple(prefix)
                    and (user is None or ns[0] == user)
                    and (flt is None or n % 2 == 0)}
            assert {i.namespace for i in fast[0]} == want

        check()
    finally:
        store.close()


def test_hi_needs_a_path_that_ends_in_the_separator() -> None:
    """`store_reads._hi` bounds the range of a namespace path only (ending in the
    separator); anything else is refused, not turned into a wrong range."""
    assert store_reads._hi("langgraph\x1fu7\x1f") == "langgraph\x1fu7\x20"
    assert store_reads._hi(None) is None
    with pytest.raises(ValueError, match="ends in the separator"):
        store_reads._hi("langgraph\x1fu7")


def test_filtered_search_tests_the_tombstones_of_its_window(sqlite_url: str) -> None:
    """A filtered search reads its first window with the tombstone test on the
    window's rows only (`store_reads.window_now`): an item whose forget is recorded but
    not projected yet (its row still active in the view) is covered there, and the
    search then reads every row with the full test, so the item is in no page (R20)
    and each page is the one the loop path gives."""
    from sqlalchemy import insert

    from ledger import schema as t
    from ledger.forgets import Tombstone, tombstone_row

    store = MemledgerStore(url=sqlite_url)
    try:
        for i in range(8):
            store.put(("u7", "prefs"), f"k{i}", {"i": i})
        store.flush()
        ml = store._ml.store
        prefix = store._prefix(("u7", "prefs"))
        now = time.time_ns() // 1000
        got = store_reads.window_now(ml, "langgraph", prefix, now_us=now, limit=3)
        assert got is not None and got[1]
        newest = got[0][1]  # the second newest: inside every window below
        gone = Tombstone(10**9, "langgraph", "key", b"\xff" * 16, ns_path=newest.ns_path,
                         mkey=newest.mkey)

        async def cover() -> None:
            async with ml.view_write() as conn:
                await conn.execute(insert(t.tombstones), [tombstone_row(gone)])

        store._call(cover())
        got = store_reads.window_now(ml, "langgraph", prefix, now_us=now, limit=3)
        assert got is not None and not got[1]
        assert newest.mkey in [r.mkey for r in got[0]]
        for offset, limit in ((0, 1), (0, 3), (1, 2), (2, 10)):
            ops: list[Any] = [SearchOp(("u7",), filter={"i": {"$gte": 0}}, limit=limit,
                                       offset=offset)]
            fast = store._read_now(ops, embeds=True)
            assert fast is not None
            assert newest.mkey not in [i.key for i in fast[0]]
            assert _dicts(fast) == _dicts(store._call(store._batch(ops)))
            want = [f"k{i}" for i in range(7, -1, -1) if f"k{i}" != newest.mkey]
            assert [i.key for i in fast[0]] == want[offset:offset + limit]
    finally:
        store.close()


def test_a_namespace_search_reads_its_rows_in_order_and_stops(sqlite_url: str) -> None:
    """A search of one namespace reads that namespace's rows newest first from
    `ix_mem_order`, stopping at the page's end, and tests the live filter on the
    index's columns (no sort of the namespace's rows); `get` still seeks by key
    (`ix_mem_lookup`), which the new index must not take from it."""
    import sqlite3

    from ledger.backends.sqlite import file_path

    store = MemledgerStore(url=sqlite_url)
    try:
        store.batch([PutOp(("u7", "prefs"), f"k{i}", {"i": i}) for i in range(30)])
        store.flush()
    finally:
        store.close()
    path = file_path(sqlite_url)
    assert path is not None
    db = sqlite3.connect(path)
    try:
        ns = "langgraph\x1fu7\x1fprefs\x1f"
        values = {"tenant": "langgraph", "now": 0, "owner": None, "owner_hi": None,
                  "prefix": ns, "hi": store_reads._hi(ns), "limit": 10, "ns": ns,
                  "key": "k1"}

        def plan(kind: str) -> list[str]:
            q = store_reads._point(kind)
            return [r[3] for r in db.execute("EXPLAIN QUERY PLAN " + q.sql,
                                             q.parameters(values)).fetchall()]

        window = plan("window_exact")
        assert "SEARCH mem_versions USING INDEX ix_mem_order (tenant=? AND ns_path=?)" \
            in window, window
        get = plan("get")
        assert get[0].startswith("SEARCH mem_versions USING INDEX ix_mem_lookup "
                                 "(tenant=? AND ns_path=? AND mkey=?"), get
    finally:
        db.close()


def test_a_namespace_search_with_deeper_namespaces_gone_or_expired(sqlite_url: str) -> None:
    """`window_now` answers a namespace from its own rows when no active row lies
    deeper, and from the whole range otherwise: the same items as the loop path while
    the deeper namespaces hold items, while only an expired item is left there (its row
    still active in the view: the range answers) and after the sweep forgot it too
    (the namespace's own rows answer), for any page (R20)."""
    import sqlite3

    from langgraph.store.base import TTLConfig

    from ledger.backends.sqlite import file_path

    ttl: TTLConfig = {"default_ttl": None, "refresh_on_read": False}
    store = MemledgerStore(url=sqlite_url, ttl=ttl)
    path = file_path(sqlite_url)
    assert path is not None
    try:
        store.batch([PutOp(("a",), f"k{i}", {"i": i}) for i in range(9)])
        store.batch([PutOp(("a", "b"), f"d{i}", {"i": 100 + i}) for i in range(4)])
        # expired at once (TTLs are minutes): the sweep has not forgotten it yet
        store.batch([PutOp(("a", "b", "c"), "gone", {"i": 200}, ttl=1e-9)])
        store.batch([PutOp(("a",), "k2", {"i": 22})])  # an update: a newer version
        store.flush()

        def same(stage: str) -> list[Any]:
            for prefix in (("a",), ("a", "b"), ("a", "b", "c")):
                for offset, limit in ((0, 3), (2, 5), (0, 30)):
                    ops: list[Any] = [SearchOp(prefix, limit=limit, offset=offset),
                                      SearchOp(prefix, filter={"i": {"$gte": 5}},
                                               limit=limit, offset=offset)]
                    fast = store._read_now(ops, embeds=True)
                    assert fast is not None
                    assert _dicts(fast) == _dicts(store._call(store._batch(ops))), (
                        stage, prefix, offset, limit)
            return [(i.namespace, i.key) for i in store.search(("a",), limit=100)]

        def deeper() -> int:
            q = store_reads._point("window_exact")
            ns = "langgraph\x1fa\x1f"
            with sqlite3.connect(path) as db:
                row = db.execute(q.sql, q.parameters({
                    "tenant": "langgraph", "now": 0, "owner": None, "owner_hi": None,
                    "prefix": ns, "hi": store_reads._hi(ns), "limit": 1})).fetchone()
            return int(row[-1])

        own = [(("a",), k) for k in ["k2", *(f"k{i}" for i in range(8, -1, -1) if i != 2)]]
        got = same("deeper items")
        assert len(got) == 9 + 4 and deeper() == 1
        store.batch([PutOp(("a", "b"), f"d{i}", None) for i in range(4)])
        store.flush()
        assert same("an expired item deeper") == own and deeper() == 1
        assert store.sweep_ttl() == 1
        store.flush()
        assert same("nothing deeper") == own and deeper() == 0
    finally:
        store.close()


def test_a_sealed_ledger_without_its_key_store_reads_as_erased(tmp_path: Path) -> None:
    """A copy of a ledger file without its key store (`<file>.vault`) opens without a
    vault: its content reads as erased on every path, as a ledger restored from
    envelopes only does (the SDK's typed reads already did): a get finds nothing, a
    search leaves the items out, on the calling thread and on the loop, and nothing
    hands the sealed bytes on as a value; opening it logs a warning that names the
    missing key store."""
    import shutil

    from structlog.testing import capture_logs

    url = f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    store = MemledgerStore(url=url)
    try:
        store.batch([PutOp(("u7", "prefs"), f"k{i}", {"i": i}) for i in range(5)])
        assert store.get(("u7", "prefs"), "k1") is not None
    finally:
        store.close()
    shutil.copy(tmp_path / "a.db", tmp_path / "b.db")  # the file alone, no b.db.vault
    copy = MemledgerStore(url=f"sqlite+aiosqlite:///{tmp_path / 'b.db'}")
    try:
        with capture_logs() as logs:
            copy.setup()
        ops: list[Any] = [GetOp(("u7", "prefs"), "k1"), SearchOp(("u7",), limit=10),
                          SearchOp(("u7", "prefs"), filter={"i": 1}, limit=10)]
        fast = copy._read_now(ops, embeds=True)
        assert fast == [None, [], []]
        assert copy._call(copy._batch(ops)) == [None, [], []]
        assert copy.get(("u7", "prefs"), "k1") is None
    finally:
        copy.close()
    assert any("no key store" in e["event"] for e in logs), logs
