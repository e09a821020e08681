"""A live row's created key without a look-up when it is its slot's version 1
(`projections.store_reads._first_of_slot`, docs/langgraph.md).

The store's reads give an item's `created_at` as the first unforgotten version of its
slot; for a row of version 1 they use the row's own order key. That holds when the
memories view never holds an active version 1 row with an older row beside it: checked
here on `resolve_slot` (the pure function every view row comes from) for any writes,
marks, confirmations and tombstones, including tombstones appended after the view was
resolved; and end to end through the store for any puts, updates, deletes and puts
again, on both backends and both read paths.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("langgraph.store.base")

from langgraph.store.base import GetOp, SearchOp

from ledger.forgets import Coordinates, Tombstone, covers
from memledger.langgraph import MemledgerStore
from projections.memory import Mark, WriteFact, resolve_slot

TENANT = "t"
NS = "t\x1fu\x1f"
KEY = "k"
ORDERS = st.integers(0, 6).map(lambda n: n.to_bytes(2, "big"))


@st.composite
def _slot(draw: Any) -> tuple[list[WriteFact], list[Mark], set[str], list[Tombstone],
                              list[Tombstone]]:
    n = draw(st.integers(1, 5))
    writes = [WriteFact(
        tenant=TENANT, memory_id=f"m{i}", slot="s", ns_path=NS, key=KEY, layer="long",
        task_key=None, session_id=None, position=i + 1, order=draw(ORDERS),
        candidate=draw(st.booleans()), actor="a", source=b"{}",
        supersedes=draw(st.none() | st.sampled_from([f"m{j}" for j in range(n)])),
        suppressed=draw(st.booleans())) for i in range(n)]
    ids = [w.memory_id for w in writes]
    marks = [Mark(position=100 + i, tenant=TENANT, target=draw(st.sampled_from(ids)),
                  kind=draw(st.sampled_from(["superseded", "confirmed"])),
                  order=draw(ORDERS), by_id=draw(st.none() | st.sampled_from(ids)),
                  via_candidate=draw(st.none() | st.sampled_from(ids)))
             for i in range(draw(st.integers(0, 3)))]
    confirmed = set(draw(st.lists(st.sampled_from(ids), max_size=n)))

    def tombs(start: int) -> list[Tombstone]:
        out = []
        for i in range(draw(st.integers(0, 2))):
            if draw(st.booleans()):
                out.append(Tombstone(start + i, TENANT, "memory_id", draw(ORDERS),
                                     memory_id=draw(st.sampled_from(ids))))
            else:
                out.append(Tombstone(start + i, TENANT, "key", draw(ORDERS), ns_path=NS,
                                     mkey=KEY))
        return out

    return writes, marks, confirmed, tombs(200), tombs(300)


def _covered(row: dict[str, Any], tombs: list[Tombstone]) -> bool:
    v = Coordinates(TENANT, row["order_key"], row["memory_id"], row["ns_path"], row["mkey"])
    return any(covers(ts, v) for ts in tombs)


@settings(max_examples=2000, deadline=None)
@given(_slot())
def test_an_active_first_version_is_its_slots_first_unforgotten_row(
        case: tuple[list[WriteFact], list[Mark], set[str], list[Tombstone],
                    list[Tombstone]]) -> None:
    """For any slot: every active row of version 1 that no tombstone covers (those the
    view was resolved with, and any appended since) has the smallest order key among
    the slot's rows that no tombstone covers: what the created key's look-up returns."""
    writes, marks, confirmed, at_resolve, later = case
    rows = resolve_slot(writes, marks, confirmed, at_resolve)
    assert sorted(r["version"] for r in rows) == list(range(1, len(rows) + 1))
    tombs = at_resolve + later
    for row in rows:
        if row["status"] == "active" and row["version"] == 1 and not _covered(row, tombs):
            first = min(r["order_key"] for r in rows if not _covered(r, tombs))
            assert first == row["order_key"], (row, rows)


KEYS = ("a", "b")
STEPS = st.lists(st.tuples(st.sampled_from(["put", "delete"]), st.sampled_from(KEYS)),
                 min_size=1, max_size=8)


def test_created_at_is_the_first_put_since_the_last_delete(db_url: str) -> None:
    """For any puts, updates, deletes and puts again of a few keys, `created_at` is
    the `updated_at` of the key's first put since its last delete, from a get and a
    search, on the caller's thread and on the loop."""
    store = MemledgerStore(url=db_url)
    fresh = itertools.count()
    try:
        store.setup()

        @settings(max_examples=15, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(STEPS)
        def check(steps: list[tuple[str, str]]) -> None:
            ns = ("u", str(next(fresh)))
            created: dict[str, Any] = {}
            for i, (kind, key) in enumerate(steps):
                if kind == "put":
                    store.put(ns, key, {"i": i})
                    if key not in created:
                        got = store.get(ns, key)
                        assert got is not None
                        created[key] = got.updated_at
                else:
                    store.delete(ns, key)
                    created.pop(key, None)
            ops: list[Any] = [GetOp(ns, k) for k in KEYS] + [
                SearchOp(ns, limit=10), SearchOp(ns, filter={"i": {"$gte": 0}}, limit=10)]
            paths = [store._call(store._batch(ops))]
            fast = store._read_now(ops, embeds=True)
            if fast is not None:  # SQLite
                paths.append(fast)
            for res in paths:
                gets = {k: (None if r is None else r.created_at)
                        for k, r in zip(KEYS, res[:2], strict=True)}
                assert gets == {k: created.get(k) for k in KEYS}
                for found in res[2:]:
                    assert {it.key: it.created_at for it in found} == created

        check()
    finally:
        store.close()
