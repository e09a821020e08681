"""PostgreSQL plans: every query of the projection and read paths is served by an index.

A projection batch that scans a view is quadratic over a ledger's life (issue 20: 10k
events made `memledger project` read 825,000 `mem_versions` rows). These tests run the
real code paths, collect every statement they send (a `before_cursor_execute`
listener, and the point reads' own asyncpg connections: `DriverReads.rows`; no
hand-copied SQL), grow the tables to a realistic size and ask PostgreSQL for each
statement's plan (the point reads' also as the generic plan a prepared statement may
settle on). They also show that the ledger gathers the planner's
statistics itself as tables grow (R14: the views are derived from the ledger, and
must keep up with it at any size).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncConnection

from bench.common import mixed_events
from ledger import schema as t
from ledger.builders import Source
from memledger import MemoryLedger
from projections import store_reads
from tests.factories import src as fsrc
from tests.factories import write

pytestmark = pytest.mark.postgres

#: Events appended (and projected, in batches of 1,000) before the probes.
LEDGER_EVENTS = 2400
#: Rows every ledger and view table is grown to (copies of its rows under other
#: tenants) before EXPLAIN: far more than a batch reads, as in a ledger in service.
PAD_ROWS = 120_000
#: A sequential scan of a table holding at least this many rows fails the test (the
#: configuration tables, `checkpoints` and `meta`, hold a handful of rows by design).
SCAN_LIMIT_ROWS = 1000
#: The tables grown for EXPLAIN: the ledger's and the views' (not configuration).
PADDED = (t.events, t.tombstones, t.task_owners, t.mem_versions, t.mem_marks, t.task_notes,
          t.tasks_view, t.vectors, t.recall_audit_items, t.mem_history, t.lexical_docs)
_VERBS = ("SELECT", "DELETE", "UPDATE", "WITH", "INSERT INTO MEM_VERSIONS (TENANT")


def _weight(params: Any) -> int:
    """How many values a parameter set carries (arrays counted by their length)."""
    values = params.values() if isinstance(params, dict) else params or ()
    return sum(len(v) if isinstance(v, list | tuple) else 1 for v in values)


def _keep(seen: dict[str, Any], statement: str, params: Any) -> None:
    """Keep, per statement, its parameters with the most values: a batch's look-up of
    hundreds of keys plans differently from a probe's look-up of one."""
    if statement not in seen or _weight(params) >= _weight(seen[statement]):
        seen[statement] = params


def _collect(ml: MemoryLedger, seen: dict[str, Any]) -> Any:
    """Record each statement the ledger's engine sends (`_keep`)."""

    def before(_conn: Any, _cursor: Any, statement: str, params: Any, _context: Any,
               executemany: bool) -> None:
        head = statement.lstrip().upper()
        if executemany or not head.startswith(_VERBS) or "PG_CLASS" in head:
            return
        _keep(seen, statement, params)

    event.listen(ml.store.engine.sync_engine, "before_cursor_execute", before)
    return before


def _collect_driver(ml: MemoryLedger, seen: dict[str, Any]) -> None:
    """Record each statement the point reads send on their own asyncpg connections
    (`DriverReads`, past SQLAlchemy's events): the reader's own `rows` runs them."""
    reader = ml.store.recorder.driver_reads()
    assert reader is not None
    inner = reader.rows

    async def rows(sql: str, params: Any) -> Any:
        _keep(seen, sql, tuple(params))
        return await inner(sql, params)

    reader.rows = rows  # type: ignore[method-assign]


class _Recording:
    """An asyncpg connection that records the statements with parameters sent to it
    directly (`PostgresRecorder.write_rows`' INSERTs over arrays, `select_tombstones`,
    `last_link`: past SQLAlchemy's events), then runs them."""

    def __init__(self, driver: Any, seen: dict[str, Any]) -> None:
        self._driver, self._seen = driver, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)

    def _note(self, sql: str, args: tuple[Any, ...]) -> None:
        if sql.lstrip().upper().startswith((*_VERBS, "INSERT")):
            _keep(self._seen, sql, args)

    async def execute(self, sql: str, *args: Any) -> Any:
        self._note(sql, args)
        return await self._driver.execute(sql, *args)

    async def fetch(self, sql: str, *args: Any) -> Any:
        self._note(sql, args)
        return await self._driver.fetch(sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        self._note(sql, args)
        return await self._driver.fetchrow(sql, *args)


def _collect_tx_driver(monkeypatch: pytest.MonkeyPatch, seen: dict[str, Any]) -> None:
    """Record the statements the recorder sends on a transaction's own asyncpg
    connection (`ledger.backends.postgres._driver_of`)."""
    from ledger.backends import postgres as backend
    inner = backend._driver_of

    async def driver_of(conn: AsyncConnection) -> Any:
        return _Recording(await inner(conn), seen)

    monkeypatch.setattr(backend, "_driver_of", driver_of)


def _literal(v: Any) -> str:
    """A bound value of a point read as an SQL literal (strings, integers, NULL)."""
    if v is None:
        return "NULL"
    if isinstance(v, bool | int):
        return str(int(v))
    assert isinstance(v, str), type(v)
    return "'" + v.replace("'", "''") + "'"


async def _probes(ml: MemoryLedger) -> None:
    """Every kind of event the projections fold, for two users, then every read."""
    src = Source.user_request("C90")
    u, v = ml.principal("shop-1", "u5"), ml.principal("shop-2", "u6")
    await u.remember(["preferences"], "seat", "window", source=src, memory_id="p-seat1",
                     wait=False)
    await u.correct(["preferences"], "seat", "aisle", supersedes="p-seat1", source=src,
                    memory_id="p-seat2", wait=False)
    await ml.append(write("tone", "brief", tenant="shop-1", user="u5", memory_id="p-cand",
                          source=fsrc(kind="model_inference")))
    await u.confirm("p-cand", source=src, wait=False)
    await u.remember(["preferences"], "meal", "veg", source=src, memory_id="p-meal",
                     wait=False)
    await u.supersede("p-meal", source=src, wait=False)
    await u.remember(["profile"], "city", "Hangzhou", source=src, wait=False)
    await u.remember(["tmp"], "note", "x", source=src, session="S1", wait=False)
    await u.forget(["profile"], "city", source=src, wait=False)
    await v.remember(["preferences"], "lang", "zh", source=src, memory_id="p-lang",
                     wait=False)
    gone = await v.forget_memory("p-lang", source=src, wait=False)
    await v.remember(["scratch", "a"], "k", 1, source=src, wait=False)
    await v.forget_all(["scratch"], source=src, wait=False)
    await u.open_task("T-probe", source=src, refs={"order": "A123"}, wait=False)
    await u.note_task("T-probe", "user_report", "left earbud crackles", source=src,
                      wait=False)
    await u.close_task("T-probe", source=src, wait=False)
    await ml.project()
    for who in (u, v):
        await who.get(["preferences"], "seat")
        await who.get(["tmp"], "note", session="S1")
        await who.get_by_id("p-seat1")
        await who.history(["preferences"], "seat")
        await who.tasks()
        await who.tasks(include_closed=True)
        await who.covered_by(gone.position)
        await who.recall("window seat")
        await who.recall(None, session="S1", task="T-probe", budget=200)
    async with ml.store.read() as conn:
        ns = "shop-1\x1fu5\x1f"
        await store_reads.get_many(conn, "shop-1", [(ns + "preferences\x1f", "seat")],
                                   now_us=0)
        await store_reads.below(conn, "shop-1", ns, now_us=0)
        await store_reads.namespaces(conn, "shop-1", now_us=0)
        await store_reads.expired(conn, "shop-1", now_us=0)


async def _pad(conn: AsyncConnection) -> None:
    """Copy the rows of each ledger and view table under other tenants (positions moved
    past the ledger's, slots and audit ids made distinct) until it holds about
    `PAD_ROWS`, then gather statistics."""
    for table in PADDED:
        n = int((await conn.exec_driver_sql(f"SELECT count(*) FROM {table.name}")).scalar_one())
        if n == 0:
            continue
        cols = [c.name for c in table.c]
        exprs = [f"{c} || '~' || g" if c in ("tenant", "audit_id") else
                 "md5(slot || '~' || g)" if c == "slot" else
                 f"position + g::bigint * {10**9}" if c == "position" else
                 "docid # (g::bigint << 48)" if c == "docid" else c for c in cols]
        await conn.exec_driver_sql(
            f"INSERT INTO {table.name} ({', '.join(cols)}) SELECT {', '.join(exprs)} "
            f"FROM {table.name}, generate_series(1, {-(-PAD_ROWS // n)}) AS g")
    await conn.commit()
    await conn.exec_driver_sql("ANALYZE")


def _scans(plan: dict[str, Any]) -> Iterator[str]:
    """The relations a plan reads by sequential scan."""
    if plan.get("Node Type") == "Seq Scan":
        yield str(plan["Relation Name"])
    for sub in plan.get("Plans", ()):
        yield from _scans(sub)


async def _row_counts(conn: AsyncConnection) -> dict[str, float]:
    rows = (await conn.execute(text(
        "SELECT relname, reltuples FROM pg_class WHERE relkind = 'r' "
        "AND relnamespace = 'public'::regnamespace"))).all()
    return {r[0]: float(r[1]) for r in rows}


async def test_every_projection_and_read_query_uses_an_index(
        pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each statement the projections (applying batches of 1,000 and single events) and
    the read paths (get, history, tasks, covered_by, recall, the store reads) send is
    planned, on tables of about 120k rows, without a sequential scan of any large table:
    those through SQLAlchemy, and those the recorder sends on the transaction's asyncpg
    connection (view rows over arrays, tombstones, the last link)."""
    seen: dict[str, Any] = {}
    driver: dict[str, Any] = {}
    direct: dict[str, Any] = {}
    async with MemoryLedger(pg_url, register_path=str(tmp_path / "f")) as ml:
        listener = _collect(ml, seen)
        _collect_driver(ml, driver)
        _collect_tx_driver(monkeypatch, direct)
        events = mixed_events(LEDGER_EVENTS, seed=5, tenants=4)
        for i in range(0, len(events), 1000):
            await ml.store.append(events[i:i + 1000])
        await ml.project()
        await _probes(ml)
        event.remove(ml.store.engine.sync_engine, "before_cursor_execute", listener)
        monkeypatch.undo()
        async with ml.store.engine.connect() as conn:
            await _pad(conn)
            sizes = await _row_counts(conn)
            assert sizes["mem_versions"] > 100_000 and sizes["events"] > 100_000
            offenders = []
            # The point reads' statements are prepared once per connection: after five
            # runs PostgreSQL may keep a generic plan (no values), which must use an
            # index too.
            for n, (statement, params) in enumerate(driver.items()):
                await conn.exec_driver_sql(f"PREPARE point_{n} AS {statement}")
                await conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
                got = (await conn.exec_driver_sql(
                    f"EXPLAIN (FORMAT JSON) EXECUTE point_{n}"
                    f"({', '.join(map(_literal, params))})")).scalar_one()
                await conn.exec_driver_sql("RESET plan_cache_mode")
                plan = (orjson.loads(got) if isinstance(got, str | bytes) else got)[0]["Plan"]
                big = [r for r in _scans(plan) if sizes.get(r, 0) >= SCAN_LIMIT_ROWS]
                if big:
                    offenders.append(f"generic {big}: {' '.join(statement.split())[:300]}")
            for statement, params in [*seen.items(), *driver.items(), *direct.items()]:
                got = (await conn.exec_driver_sql(
                    "EXPLAIN (FORMAT JSON) " + statement, tuple(params))).scalar_one()
                plan = (orjson.loads(got) if isinstance(got, str | bytes) else got)[0]["Plan"]
                big = [r for r in _scans(plan) if sizes.get(r, 0) >= SCAN_LIMIT_ROWS]
                if big:
                    offenders.append(f"{big}: {' '.join(statement.split())[:300]}")
            await conn.rollback()
    assert len(seen) > 40  # the probes reached the projection and read paths
    assert driver  # and `get`'s point read on the driver's connections
    # and the recorder's own statements: tombstones, view rows over arrays
    assert any("FROM tombstones" in s for s in direct), sorted(direct)
    assert any(s.startswith("INSERT INTO task_notes") for s in direct), sorted(direct)
    assert not offenders, "\n".join(offenders)


async def test_projection_and_append_gather_planner_statistics(pg_url: str,
                                                               tmp_path: Path) -> None:
    """Appending and projecting a few thousand events ANALYZEs the ledger and the views
    themselves, long before autovacuum would look at a fresh table."""
    async with MemoryLedger(pg_url, register_path=str(tmp_path / "f")) as ml:
        for i in range(0, 2400, 800):
            await ml.store.append(mixed_events(2400, seed=6)[i:i + 800])
        await ml.project()
        async with ml.store.read() as conn:
            rows = (await conn.execute(text(
                "SELECT relname, analyze_count FROM pg_stat_user_tables"))).all()
    counts = {r[0]: int(r[1]) for r in rows}
    for table in ("events", "mem_versions", "mem_marks", "task_notes", "tasks_view",
                  "vectors"):
        assert counts[table] >= 1, table
