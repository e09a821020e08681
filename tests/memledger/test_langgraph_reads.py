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

import pytest

pytest.importorskip("langgraph.store.base")

from langgraph.store.base import GetOp, ListNamespacesOp, MatchCondition, SearchOp

from memledger.langgraph import MemledgerStore

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
        assert store._read_now([GetOp(("u7", "prefs"), "lang")], embeds=True) is not None
        assert store.get(("u7", "prefs"), "lang") is not None
        subprocess.run([sys.executable, "-c", DELETE, sqlite_url], cwd=ROOT, check=True,
                       timeout=120)
        assert store.get(("u7", "prefs"), "lang") is None
        assert store.search(("u7",)) == []
    finally:
        store.close()


def test_put_and_delete_return_once_every_view_has_them(sqlite_url: str) -> None:
    """A put is readable when it returns, and a delete returns only once every view,
    the erasure included, has applied it (R16, R20): nothing is left to a background."""
    store = MemledgerStore(url=sqlite_url)
    try:
        for i in range(3):
            store.put(("u7", "prefs"), f"k{i}", {"i": i})
            assert store.get(("u7", "prefs"), f"k{i}") is not None
        store.delete(("u7", "prefs"), "k0")
        ml = store._ml
        head = store._call(ml.store.head())
        assert set(store._call(ml.runner.positions()).values()) == {head}
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
