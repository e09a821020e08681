"""The lexical arm's cache of row sizes (`projections.sql.lexical_sizes`): read by id,
or every row's at once (`_whole_sizes`) once a process has needed many; either way
the in-process ranking stays FTS5's own, entry for entry and bit for bit, and the
cache follows every change to the index: a rewrite through the same store, a forget
(delete and merge), a write through another connection and one by another process
(R14, R20, R24)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete

from ledger import schema as t
from ledger.store import Store
from projections import lexical
from projections import sql as psql
from projections.sql import (
    _docsizes,
    _varint_array,
    _varints,
    _whole_sizes,
    lexical_delete,
    lexical_insert,
    lexical_merge,
)
from tests.projections.test_lexical_scored import PRINCIPALS, WORDS, both, index, rows_of, varint

ROOT = Path(__file__).resolve().parents[2]

#: Another process rewrites entries M0.. (argv: URL, register path, count): each gets
#: the words "refund" and "extra", under its row id as before.
REWRITE = """
import asyncio, sys
from ledger.store import Store
from projections.sql import lexical_delete, lexical_insert
from tests.projections.test_lexical_scored import rows_of

async def main():
    store = Store(sys.argv[1], register_path=sys.argv[2])
    await store.open()
    rows = rows_of([(0, "long", "T1", ["refund", "extra"])
                    for _ in range(int(sys.argv[3]))])
    async with store.write() as conn:
        await lexical_delete(store, conn, [r["docid"] for r in rows])
        await lexical_insert(store, conn, rows)
    await store.close()

asyncio.run(main())
"""


@pytest.fixture
async def sq(sqlite_url: str, register_path: str) -> AsyncIterator[Store]:
    """A SQLite store (FTS5 is SQLite's; PostgreSQL ranks with `ts_rank`)."""
    s = Store(sqlite_url, register_path=register_path)
    await s.open()
    yield s
    await s.close()


def cached(store: Store) -> Any:
    """This store's cache of row sizes (None before any)."""
    return psql._SIZES.get((store.url, id(store)))


async def rewrite(store: Store, rows: list[dict[str, Any]]) -> None:
    """Delete these entries (by row id) and insert them as given, in one transaction."""
    async with store.write() as conn:
        await lexical_delete(store, conn, [r["docid"] for r in rows])
        await lexical_insert(store, conn, rows)


long_words = [f"w{i}" for i in range(140)]  # a size of two bytes in FTS5's record
entry = st.tuples(
    st.sampled_from(range(len(PRINCIPALS))),
    st.sampled_from(["long", "long", "long", "task", "session"]),
    st.sampled_from(["T1", "T2"]),
    st.one_of(st.lists(st.sampled_from(WORDS), min_size=0, max_size=9),
              st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(
                  lambda ws: [*ws, *long_words])))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(entry, min_size=1, max_size=60),
       st.lists(st.sampled_from(WORDS), min_size=1, max_size=4),
       st.sampled_from(range(len(PRINCIPALS))), st.sampled_from([1, 5, 20]),
       st.sampled_from(["rewrite", "forget", "other connection"]),
       st.sets(st.integers(0, 59), max_size=20))
async def test_whole_sizes_rank_as_fts5_across_changes(
        sq: Store, sqlite_url: str, register_path: str, entries: Any, words: list[str],
        p: int, k: int, change: str, picked: set[int]) -> None:
    """Any corpus (entries of no terms, of long ones, of several principals and
    layers), any query: with every row's size read at once at the first need, the
    in-process ranking is FTS5's, and the cache then holds every row of the index. Then
    some entries change (rewritten one term longer, under the same row ids, through
    this store or through another connection, or forgotten: deleted and the index
    merged): the ranking is FTS5's again (no size of the index before is used) and no
    forgotten entry comes back."""
    mp = pytest.MonkeyPatch()
    psql._SIZES.pop((sq.url, id(sq)), None)  # the example before's (the store is kept)
    try:
        mp.setattr(psql, "SIZE_BULK_SHARE", 0.0)
        mp.setattr(lexical, "MIN_DF_DOCS", 10)
        rows = rows_of(entries)
        await index(sq, rows)
        # "extra": in no entry before the change, in every rewritten one after it (their
        # sizes are then needed, and a size cached before would be one term short).
        who, query = PRINCIPALS[p], " ".join([*words, "extra"])
        fts5, mine = await both(sq, who, query, k, task=None, session=None, monkeypatch=mp)
        assert mine == fts5
        sizes = cached(sq)
        if sizes is not None and len(sizes.ids):
            assert sizes.whole
            assert sizes.ids.tolist() == sorted(r["docid"] for r in rows)
        chosen = [rows[i] for i in sorted(picked) if i < len(rows)] or rows[:1]
        gone: set[str] = set()
        if change == "forget":
            async with sq.write() as conn:
                await lexical_delete(sq, conn, [r["docid"] for r in chosen])
                await lexical_merge(sq, conn)
            gone = {r["item_id"] for r in chosen}
        else:
            longer = [{**r, "terms": " ".join(lexical.terms(f"{r['terms']} extra"))}
                      for r in chosen]
            if change == "rewrite":
                await rewrite(sq, longer)
            else:
                other = Store(sqlite_url, register_path=register_path)
                await other.open()
                try:
                    await rewrite(other, longer)
                finally:
                    await other.close()
        for _ in range(2):  # sized anew, then from the cache
            fts5, mine = await both(sq, who, query, k, task=None, session=None,
                                    monkeypatch=mp)
            assert mine == fts5
            assert not gone & {m for m, _ in mine}
    finally:
        mp.undo()


async def test_a_write_by_another_process_is_seen(sq: Store, sqlite_url: str,
                                                  register_path: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row's size cached, another process rewrites half the entries one term
    longer: the next ranking is FTS5's over the new sizes (the rewritten entries now
    rank below the others), not the cache's."""
    monkeypatch.setattr(psql, "SIZE_BULK_SHARE", 0.0)
    await index(sq, rows_of([(0, "long", "T1", ["refund"]) for _ in range(40)]))
    who = PRINCIPALS[0]
    fts5, before = await both(sq, who, "refund", 40, task=None, session=None,
                              monkeypatch=monkeypatch)
    assert before == fts5
    assert cached(sq).whole
    await asyncio.to_thread(subprocess.run, [sys.executable, "-c", REWRITE, sqlite_url,
                                             register_path, "20"], cwd=ROOT, check=True,
                            timeout=120)
    fts5, after = await both(sq, who, "refund", 40, task=None, session=None,
                             monkeypatch=monkeypatch)
    assert after == fts5
    rewritten = {f"M{i}" for i in range(20)}
    assert {m for m, _ in after[20:]} == rewritten
    assert after[0][1] > before[0][1] > after[-1][1]


async def test_every_size_is_read_once_many_were_needed(
        sq: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes are read by id until those read so under one index reach
    `SIZE_BULK_SHARE` of its rows (or one recall needs twice that): then every row's
    at once, after which a query of other terms reads no size; a change to the index
    starts again by id."""
    monkeypatch.setattr(lexical, "MIN_DF_DOCS", 10)
    n = 64  # an eighth: 8 rows; a quarter: 16
    await index(sq, rows_of([(0, "long", "T1", ["refund", f"g{i % 16}"]) for i in range(n)]))
    statements: list[str] = []
    read_sql = psql.read_sql

    async def counted(store: Store, conn: Any, sql: str, params: Any, **kw: Any) -> Any:
        statements.append(sql)
        return await read_sql(store, conn, sql, params, **kw)

    monkeypatch.setattr(psql, "read_sql", counted)
    who = PRINCIPALS[0]

    async def ask(query: str) -> None:
        fts5, mine = await both(sq, who, query, 5, task=None, session=None,
                                monkeypatch=monkeypatch)
        assert mine == fts5
        assert mine

    await ask("g1")  # 4 rows by id
    assert not cached(sq).whole and cached(sq).read == 4
    await ask("g2")  # 4 more: 8 read by id
    assert not cached(sq).whole and cached(sq).read == 8
    await ask("g3")  # an eighth read before: every row
    assert cached(sq).whole and len(cached(sq).ids) == n
    statements.clear()
    await ask("g4 g5")
    assert not [s for s in statements if "_docsize" in s]
    # A change: a new structure record, sizes by id again; a query of 16 rows at once
    # (a quarter of the index) reads them all whole.
    await rewrite(sq, rows_of([(0, "long", "T1", ["refund", "g0", "extra"])]))
    await ask("g6")
    assert not cached(sq).whole and cached(sq).read == 4
    await rewrite(sq, rows_of([(0, "long", "T1", ["refund", "g0"])]))
    await ask("g7 g8 g9 g10")
    assert cached(sq).whole


async def test_whole_sizes_of_an_empty_index(sq: Store) -> None:
    """No rows: nothing to read, and the structure record the statement saw."""
    async with sq.write() as conn:
        await conn.execute(delete(t.lexical_docs))
    async with sq.read() as conn:
        ids, sizes, _ = await _whole_sizes(sq, conn)
    assert len(ids) == 0 and len(sizes) == 0


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 20)), min_size=1, max_size=40),
       st.sampled_from([1, 3, 7, 131_072]))
async def test_whole_sizes_equal_each_rows_record(sq: Store, shapes: list[tuple[int, int]],
                                                  per_statement: int) -> None:
    """For any index (entries of no terms, some, and over 127: sizes of one and two
    bytes, zero bytes in the joined blob), read in one statement or in ranges of row
    ids, `_whole_sizes` gives every row id, sorted, with the size its own record holds
    (`_docsizes` of the rows read one by one), and the structure record they saw."""
    entries = [(p, "long", "T1", [f"t{j}" for j in range(m if m < 18 else 130 + m)])
               for p, m in shapes]
    await index(sq, rows_of(entries))
    fts = t.LEXICAL_FTS
    mp = pytest.MonkeyPatch()
    mp.setattr(psql, "SIZE_BULK_SLICE", per_statement)
    try:
        async with sq.read() as conn:
            ids, sizes, seen = await _whole_sizes(sq, conn, len(entries))
    finally:
        mp.undo()
    async with sq.read() as conn:
        rows = (await conn.exec_driver_sql(f"SELECT id, sz FROM {fts}_docsize")).all()
        block = (await conn.exec_driver_sql(
            f"SELECT block FROM {fts}_data WHERE id = 10")).scalar()
    want_ids, want_sizes = _docsizes(rows)
    order = np.argsort(want_ids)
    assert ids.tolist() == want_ids[order].tolist()
    assert sizes.tolist() == want_sizes[order].tolist()
    assert seen == bytes(block)


async def test_whole_sizes_across_a_change_are_not_kept(
        sq: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index changes between two statements of the bulk read: their structure
    records differ, so `_whole_sizes` names none (a reader still on the record before
    must not take sizes read after it), and the sizes serve the recall that read them
    but are not cached (the next recall reads again, and ranks as FTS5 does)."""
    monkeypatch.setattr(psql, "SIZE_BULK_SHARE", 0.0)
    monkeypatch.setattr(psql, "SIZE_BULK_SLICE", 4)
    await index(sq, rows_of([(0, "long", "T1", ["refund", f"g{i}"]) for i in range(20)]))
    read_sql = psql.read_sql
    bulk: list[str] = []

    async def writes_between(store: Store, conn: Any, sql: str, params: Any,
                             **kw: Any) -> Any:
        got = await read_sql(store, conn, sql, params, **kw)
        if "group_concat(sz" in sql:
            bulk.append(sql)
            if len(bulk) == 1:  # another writer, between this range and the next
                await rewrite(sq, rows_of([(0, "long", "T1", ["refund", "g0", "extra"])]))
        return got

    monkeypatch.setattr(psql, "read_sql", writes_between)
    async with sq.read() as conn:
        _, _, seen = await _whole_sizes(sq, conn, 20)
        assert seen is None and len(bulk) == 5
        bulk.clear()
        got = await lexical.search(conn, sq, PRINCIPALS[0], "refund", task=None,
                                   session=None, k=5)
    assert got and len(bulk) > 1
    assert not cached(sq).whole
    monkeypatch.setattr(psql, "read_sql", read_sql)
    fts5, mine = await both(sq, PRINCIPALS[0], "refund", 20, task=None, session=None,
                            monkeypatch=monkeypatch)
    assert mine == fts5
    assert cached(sq).whole


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 127), st.integers(0, 2**56 - 1)), max_size=50))
def test_varint_array_decodes_as_varints(values: list[int]) -> None:
    """`_varint_array` (numpy) decodes any run of varints of up to 8 bytes as
    `_varints` does one by one."""
    buf = b"".join(varint(v) for v in values)
    got = _varint_array(buf)
    assert got is not None
    assert got.tolist() == _varints(buf) == values


def test_varint_array_declines_what_it_cannot_decode() -> None:
    """A varint of nine bytes (a value of 2**56 or more) or one cut off: None (the
    caller reads the rows one by one)."""
    nine = bytes([0x81] * 8 + [0x05])
    assert _varint_array(varint(3) + nine) is None
    assert _varint_array(varint(3) + bytes([0x81])) is None
    assert _varint_array(b"") is not None and len(_varint_array(b"")) == 0  # type: ignore[arg-type]
