"""The packed columns of a snapshot's index (`projections.principal_index`): for any
input they read, append, freeze, repack and look up exactly like the plain lists and
dicts a load from the database builds (issue 20: a restart's first recall uses them)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from projections.principal_index import (
    KeyRows,
    PackedOrders,
    PackedText,
    RowOf,
    _Sorted,
    pack,
)

TEXT = st.text(max_size=12)
ITEMS = st.lists(TEXT, max_size=30)


def packed_text(items: list[str]) -> PackedText:
    return PackedText(*pack(items, True))


@settings(max_examples=200, deadline=None)
@given(items=ITEMS, more=ITEMS, n=st.integers(0, 70))
def test_packed_text_reads_like_its_list(items: list[str], more: list[str], n: int) -> None:
    """Items, negative indexes, slices and iteration equal the list's; appended items
    follow; a frozen prefix ignores later appends; `packed` round-trips every item."""
    col = packed_text(items)
    model = list(items)
    assert len(col) == len(model) and list(col) == model
    for i in range(-len(model), len(model)):
        assert col[i] == model[i]
    assert col[1:-1:2] == model[1:-1:2] and col[::-1] == model[::-1]
    for x in more:
        col.append(x)
        model.append(x)
    frozen = col.frozen(min(n, len(model)))
    col.append("after")
    assert list(frozen) == model[:min(n, len(model))]
    model.append("after")
    assert list(col) == model
    assert list(PackedText(*col.packed())) == model
    assert list(PackedText(*pack(col, True))) == model


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.binary(max_size=10), max_size=30),
       more=st.lists(st.binary(max_size=10), max_size=10), n=st.integers(0, 45))
def test_packed_orders_reads_like_its_list(items: list[bytes], more: list[bytes],
                                           n: int) -> None:
    """The bytes column behaves as its list: the same reads, appends, frozen prefix and
    repacking, whatever bytes (empty, NUL) it holds."""
    col = PackedOrders(*pack(items, False))
    model = list(items)
    for x in more:
        col.append(x)
        model.append(x)
    assert len(col) == len(model) and list(col) == model
    assert [col[i] for i in range(-len(model), len(model))] == model + model
    k = min(n, len(model))
    assert list(col.frozen(k)) == model[:k]
    assert list(PackedOrders(*col.packed())) == model


@settings(max_examples=200, deadline=None)
@given(items=ITEMS, data=st.data())
def test_sorted_view_is_the_column_in_row_order(items: list[str], data: Any) -> None:
    """`_Sorted` gives the column's items, as bytes, in the order of any row list."""
    rows = data.draw(st.lists(st.integers(0, max(0, len(items) - 1)), max_size=20)
                     if items else st.just([]))
    view = _Sorted(packed_text(items), np.asarray(rows, dtype=np.int64))
    expect = [items[r].encode() for r in rows]
    assert len(view) == len(expect) and [view[i] for i in range(len(view))] == expect
    assert view[::2] == expect[::2]


_OPS = st.lists(st.tuples(st.sampled_from(["set", "pop"]), st.integers(0, 40),
                          st.integers(0, 10_000)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(TEXT, unique=True, max_size=25), dead=st.sets(st.integers(0, 24)),
       ops=_OPS)
def test_row_of_equals_a_dict(ids: list[str], dead: set[int],
                              ops: list[tuple[str, int, int]]) -> None:
    """Built as a snapshot lays it out (live rows sorted by id, found by bisection),
    then changed by any sequence of sets and pops: every look-up, the length and the
    items equal a dict's given the same changes."""
    model = {m: r for r, m in enumerate(ids) if r not in dead}
    by_id = np.asarray([model[m] for m in sorted(model)], dtype=np.int64)
    row_of = RowOf(packed_text(ids), by_id)
    names = [*ids, "new-a", "new-b", "\x00", "é"]
    for op, which, row in ops:
        m = names[which % len(names)]
        if op == "set":
            row_of[m] = row
            model[m] = row
        else:
            assert row_of.pop(m) == model.pop(m, None)
        assert len(row_of) == len(model)
    for m in names:
        assert row_of.get(m) == model.get(m)
        assert (m in row_of) == (m in model)
        assert row_of.get(m, -1) == model.get(m, -1)
    assert dict(row_of.items()) == model and len(list(row_of.items())) == len(model)
    assert sorted(row_of.values()) == sorted(model.values())
    assert sorted(row_of) == sorted(model)


@settings(max_examples=300, deadline=None)
@given(base=st.dictionaries(TEXT, st.lists(st.integers(0, 50), min_size=1, max_size=4),
                            max_size=15),
       adds=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 120)), max_size=25),
       n=st.integers(0, 130))
def test_key_rows_equals_a_dict_of_lists(base: dict[str, list[int]],
                                         adds: list[tuple[int, int]], n: int) -> None:
    """Packed as a snapshot lays it out (keys sorted as UTF-8, rows of each in CSR
    form), then added to: `get`, `items` and `frozen(n)` equal a dict of lists."""
    by_key = sorted((k.encode(), rows) for k, rows in base.items())
    keys = PackedOrders(*pack([k for k, _ in by_key], False))
    starts = np.cumsum([0, *(len(r) for _, r in by_key)]).astype(np.int64)
    rows = np.asarray([r for _, rs in by_key for r in rs], dtype=np.int64)
    kr = KeyRows(keys, starts, rows)
    model = {k: list(v) for k, v in base.items()}
    names = [*base, "other", "", "ü key"]
    for which, row in adds:
        k = names[which % len(names)]
        kr.add(k, 60 + row)  # added rows come after the snapshot's
        model.setdefault(k, []).append(60 + row)
    for k in names:
        assert kr.get(k) == (model.get(k) or None)
        assert kr.get(k, []) == model.get(k, [])
    assert dict(kr.items()) == model
    frozen = kr.frozen(n)
    kr.add("later", 1)
    cut = {k: [r for r in v if r < 60 or r < n] for k, v in model.items()}
    assert {k: v for k, v in frozen.items() if v} == {k: v for k, v in cut.items() if v}
