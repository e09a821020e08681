"""The reads' tombstone test seeks the tombstones it needs, and covers what the rule covers.

Every read filters its rows by the ledger's tombstones (R20). As one sub-select over
every kind, the test could seek the tombstones by tenant only, so each row read every
tombstone of its tenant and each delete slowed all later reads of the tenant (a
LangGraph store keeps every namespace under one tenant). `projections.reads.unforgotten`
tests each kind of tombstone apart, by an index seek; these tests show that it covers
exactly what the one rule (`ledger.forgets.covers`) covers, on both backends, and that
the plans of the reads seek the tombstone indexes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from sqlalchemy import exists, insert, select, text

from ledger import schema as t
from ledger.events import ns_path
from ledger.forgets import Coordinates, Tombstone, covers, covers_sql, tombstone_row
from ledger.store import Store
from projections import reads, store_reads

TENANTS = ("shop-a", "shop-b")
USERS = ("u1", "u2")
KEYS = ("k0", "k1", "k2")
TASKS = ("T1", "T2")


def _paths() -> list[list[str]]:
    return [[tn, u, *rest] for tn in TENANTS for u in USERS
            for rest in ([], ["preferences"], ["preferences", "food"])]


def _items(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """`mem_versions` rows with random coordinates from small pools (so tombstones hit)."""
    rows = []
    for i in range(n):
        ns = rng.choice([p for p in _paths() if len(p) > 2])
        layer = rng.choice(("long", "long", "task", "session"))
        rows.append({
            "tenant": ns[0], "memory_id": f"m{i}", "slot": f"s{i}", "ns_path": ns_path(ns),
            "mkey": rng.choice(KEYS), "layer": layer,
            "task_key": rng.choice(TASKS) if layer == "task" else None,
            "session_id": "S1" if layer == "session" else None, "position": i + 1,
            "order_key": bytes([rng.randrange(8)]), "version": 1, "status": "active",
            "candidate": False, "value": None, "actor": ns[1], "source": b"{}"})
    return rows


def _tombstones(rng: random.Random, n: int, items: list[dict[str, Any]]) -> list[Tombstone]:
    out = []
    for i in range(n):
        kind = rng.choice(("memory_id", "key", "prefix", "task"))
        tenant = rng.choice(TENANTS)
        order = bytes([rng.randrange(8)])
        pos = 10_000 + i
        if kind == "memory_id":
            ts = Tombstone(pos, tenant, kind, order, memory_id=rng.choice(items)["memory_id"])
        elif kind == "key":
            ts = Tombstone(pos, tenant, kind, order,
                           ns_path=ns_path(rng.choice([p for p in _paths() if len(p) > 2])),
                           mkey=rng.choice(KEYS))
        elif kind == "prefix":
            ts = Tombstone(pos, tenant, kind, order, ns_path=ns_path(rng.choice(_paths())))
        else:
            ts = Tombstone(pos, tenant, kind, order, task_key=rng.choice(TASKS))
        out.append(ts)
    return out


def _covered(items: list[dict[str, Any]], tombs: list[Tombstone]) -> set[str]:
    """The oracle: the items some tombstone covers, by the rule in Python."""
    return {r["memory_id"] for r in items if any(covers(ts, Coordinates(
        r["tenant"], r["order_key"], r["memory_id"], r["ns_path"], r["mkey"], r["task_key"]))
        for ts in tombs)}


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_per_kind_test_covers_what_the_rule_covers(store: Store, seed: int) -> None:
    """For random items and tombstones of every kind (and of two tenants), the rows that
    `not_forgotten` keeps are exactly those no tombstone covers, by the Python rule and
    by the one-sub-select SQL of the rule, on SQLite and PostgreSQL."""
    rng = random.Random(seed)
    items = _items(rng, 120)
    tombs = _tombstones(rng, 40, items)
    mv = t.mem_versions.c
    async with store.view_write() as conn:
        await conn.execute(insert(t.mem_versions), items)
        await conn.execute(insert(t.tombstones), [tombstone_row(ts) for ts in tombs])
    async with store.read() as conn:
        kept = {r[0] for r in (await conn.execute(
            select(mv.memory_id).where(reads.not_forgotten()))).all()}
        one = {r[0] for r in (await conn.execute(select(mv.memory_id).where(
            ~exists().where(covers_sql(t.tombstones.c, mv))))).all()}
    every = {r["memory_id"] for r in items}
    covered = _covered(items, tombs)
    assert covered and covered != every  # the draw hits some items and misses others
    assert kept == every - covered
    assert one == kept


def _sqlite_plan(db: Any, sql: str, params: list[Any]) -> list[str]:
    return [r[3] for r in db.execute("EXPLAIN QUERY PLAN " + sql, params).fetchall()]


def _point_statements() -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """The point reads' statements (get; the store's get, page, windows and created
    keys) with values to plan them with."""
    ns = ns_path(["shop-a", "u1", "preferences"])
    yield "reads.get", reads._GET_POINT, {"tenant": "shop-a", "ns": ns, "key": "k1",
                                          "task": None, "session": None, "now": 0}
    common = {"tenant": "shop-a", "now": 0, "owner": None}
    yield "store get", store_reads._point("get"), {**common, "ns": ns, "key": "k1"}
    yield "store page", store_reads._point("page"), {
        **common, "prefix": ns, "hi": ns[:-1] + "\x20", "limit": 10, "offset": 0}
    for kind in ("window", "window_exact"):
        yield f"store {kind}", store_reads._point(kind), {
            **common, "prefix": ns, "hi": ns[:-1] + "\x20", "limit": 10}
    yield "store created", store_reads._point("created"), {
        "tenant": "shop-a", "slots": orjson.dumps(["s1"]).decode()}


async def test_sqlite_plans_seek_the_tombstone_indexes(sqlite_url: str) -> None:
    """SQLite's EXPLAIN QUERY PLAN of each point read seeks `tombstones` by tenant,
    kind and the coordinates of that kind (a key forget by path and key, a memory-id
    forget by id, a task purge by task key; a prefix forget by tenant and kind):
    never by the tenant alone, never by a scan."""
    import sqlite3

    from ledger.backends.sqlite import file_path

    s = Store(sqlite_url)
    await s.open()
    try:
        rng = random.Random(4)
        items = _items(rng, 50)
        async with s.view_write() as conn:
            await conn.execute(insert(t.mem_versions), items)
            await conn.execute(insert(t.tombstones),
                               [tombstone_row(ts) for ts in _tombstones(rng, 1000, items)])
    finally:
        await s.close()
    path = file_path(sqlite_url)
    assert path is not None
    db = sqlite3.connect(path)
    try:
        for name, q, values in _point_statements():
            lines = [ln for ln in _sqlite_plan(db, q.sql, q.parameters(values))
                     if "tombstones" in ln]
            assert lines, name
            for ln in lines:
                assert ln.startswith("SEARCH tombstones USING INDEX ix_tombstones_"), (name, ln)
                assert "(tenant=? AND kind=?" in ln, (name, ln)
            joined = "\n".join(lines)
            assert "ix_tombstones_key (tenant=? AND kind=? AND ns_path=? AND mkey=?)" \
                in joined, (name, joined)
            assert "ix_tombstones_memory (tenant=? AND kind=? AND memory_id=?)" in joined, (
                name, joined)
    finally:
        db.close()


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for sub in plan.get("Plans", ()):
        yield from _nodes(sub)


@pytest.mark.postgres
async def test_postgres_plans_seek_the_tombstone_indexes(pg_url: str) -> None:
    """PostgreSQL's plan of `get` (the statement the driver prepares), with 3,000
    tombstones in the tenant and the planner's statistics gathered, reads `tombstones`
    only by index scans of the seek indexes, the key forgets by path and key."""
    s = Store(pg_url)
    await s.open()
    try:
        rng = random.Random(5)
        items = _items(rng, 2000)
        tombs = [ts for ts in _tombstones(rng, 3000, items) if ts.tenant == "shop-a"]
        async with s.view_write() as conn:
            await conn.execute(insert(t.mem_versions), items)
            await conn.execute(insert(t.tombstones), [tombstone_row(ts) for ts in tombs])
        async with s.engine.connect() as conn:
            await conn.execute(text("ANALYZE tombstones"))
            await conn.execute(text("ANALYZE mem_versions"))
            _, q, values = next(_point_statements())
            sql, _names, _defaults = q.pg
            got = (await conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + sql,
                                              tuple(q.pg_parameters(values)))).scalar_one()
            plan = (orjson.loads(got) if isinstance(got, str | bytes) else got)[0]["Plan"]
            await conn.rollback()
    finally:
        await s.close()
    nodes = list(_nodes(plan))
    heap = [n for n in nodes if n.get("Relation Name") == "tombstones"]
    assert heap, plan
    # every read of `tombstones` is by an index (an index scan, or the bitmap heap scan
    # of a bitmap index scan), of the seek indexes only
    assert all(n["Node Type"] in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan")
               for n in heap), plan
    by_index = [n for n in nodes if n.get("Index Name", "").startswith("ix_tombstones")]
    assert {n["Index Name"] for n in by_index} <= {
        "ix_tombstones_key", "ix_tombstones_memory", "ix_tombstones_task"}, plan
    assert len(by_index) >= len(heap), plan
    conds = [n.get("Index Cond", "") for n in by_index]
    assert any("ns_path" in c and "mkey" in c for c in conds), plan
    assert any("memory_id" in c for c in conds), plan


async def test_page_tests_tombstones_of_its_window_and_falls_back(sqlite_url: str) -> None:
    """`store_reads.page_now` tests the tombstones of its newest rows only: a key whose
    forget is appended but not projected yet (its row still active in the view, R20) is
    left out of every page, and each page equals the fully filtered query's (`below`)."""
    from ledger.validation import parse_event
    from projections.runner import Runner
    from projections.views import MemoryProjection
    from tests.factories import src, write

    s = Store(sqlite_url)
    await s.open()
    try:
        await s.append([parse_event(write(f"k{i}", {"i": i}, source=src(
            at=f"2026-09-20T10:00:{i:02d}+08:00"))) for i in range(8)])
        await Runner(s, [MemoryProjection()]).catch_up()
        prefix = ns_path(["shop-a", "u7", "preferences"])
        async with s.read() as conn:
            rows = await store_reads.below(conn, "shop-a", prefix, now_us=0)
        newest = rows[1]  # the second newest: inside the first page's window
        gone = Tombstone(10**6, "shop-a", "key", b"\xff" * 16, ns_path=newest.ns_path,
                         mkey=newest.mkey)
        async with s.view_write() as conn:
            await conn.execute(insert(t.tombstones), [tombstone_row(gone)])
        async with s.read() as conn:
            live = await store_reads.below(conn, "shop-a", prefix, now_us=0)
        assert [r.memory_id for r in live] == [r.memory_id for r in rows
                                                if r.memory_id != newest.memory_id]
        for offset in range(4):
            for limit in (1, 2, 5):
                page = store_reads.page_now(s, "shop-a", prefix, now_us=0, limit=limit,
                                            offset=offset)
                assert page is not None
                want = live[offset:offset + limit]
                assert [r.memory_id for r in page] == [r.memory_id for r in want]
                assert [r.created_key for r in page] == [r.created_key for r in want]
    finally:
        await s.close()
