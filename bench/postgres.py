"""PostgreSQL, the scale-out backend: appends, projection, get and recall beside raw asyncpg.

The figures are taken on one database on the server named by `MEMLEDGER_BENCH_PG`
(default `postgresql://postgres@127.0.0.1:5432`), dropped after; without a reachable
server the module prints why and reports nothing. The ledger holds
`bench.common.mixed_events` (20k of them, seed 1). Two rounds on the same ledger:

- "10k events": the first 10,000 events appended to an empty ledger and projected;
- "next 10k at 200k": the ledger is then grown to 190,000 events at once in SQL
  (`pad`: 18 copies of every ledger and view row under other tenants, positions after
  the ledger's, checkpoints moved to the new head; no principal of the ledger can read
  them), and the next 10,000 events are appended and projected on it: what is timed is
  those 10,000 events with 190,000 already in every table and index.

In each round every figure is beside raw `asyncpg` doing the same rows in the same
run, into copies of the tables holding the rows they held before the step
(`snapshot`: `LIKE ... INCLUDING ALL`, same columns, keys and indexes, same size),
1,000 rows per transaction unless said otherwise:

- append batched: `Store.append` 1,000 events per call vs `executemany` of the rows it
  wrote (target >= 0.5x);
- projection, each view: `Runner` with that projection alone (in the registry's order)
  vs raw writing the rows the view gained (target >= 0.5x), and the events/s of the
  second round against the first (target: within 15%, i.e. linear); each line also
  says how many ANALYZEs ran during that catch-up (a count the load does not move);
- get p99: `Principal.get` of random active keys vs a prepared asyncpg SELECT by
  primary key (target: within 3x);
- recall p99: `Principal.recall` (a query, warm principals) vs asyncpg reading the
  principal's vectors, numpy top 5 and reading those memories;
- on fresh databases: 64 tasks calling `Store.append_one` vs raw one row per commit,
  and the CLI pair (`memledger append FILE` of 10k events then `memledger project`,
  two processes) vs raw parsing the same lines and writing the event rows and active
  rows (target >= 0.5x); its note splits the pair's seconds (each process, a third
  `project` with nothing to do, and the interpreter with `memledger`'s imports alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Final

import asyncpg
import numpy as np
import orjson
from sqlalchemy import Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import CreateIndex, CreateTable

from bench.common import (
    Clock,
    main,
    mixed_events,
    no_gc,
    percentile,
    result,
    say,
    size,
    workdir,
)
from ledger import schema as t
from ledger.events import NS_SEP, Event, ns_path
from ledger.store import Store
from memledger import MemoryLedger
from projections.registry import default_projections
from projections.runner import Runner
from projections.vectors import current_embedder

SERVER: Final = os.environ.get("MEMLEDGER_BENCH_PG", "postgresql://postgres@127.0.0.1:5432")
BATCH: Final = 1000
TASKS: Final = 64
#: The view tables of each projection (erasure writes none: it is timed, not compared).
VIEW_ROWS: Final = {"memories": (t.mem_versions, t.mem_marks),
                    "tasks": (t.task_notes, t.tasks_view), "vectors": (t.vectors,)}
QUERIES: Final = ("window seat", "delivery in the evening", "dark mode", "phone")


@contextlib.asynccontextmanager
async def database(tag: str) -> AsyncIterator[str]:
    """A new database on the server (its asyncpg DSN), dropped afterwards."""
    name = f"memledger_bench_{tag}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(f"{SERVER}/postgres", timeout=5)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield f"{SERVER}/{name}"
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def sa_url(dsn: str) -> str:
    """The SQLAlchemy URL of an asyncpg DSN."""
    return dsn.replace("postgresql://", "postgresql+asyncpg://", 1)


async def create_like(conn: asyncpg.Connection, *tables: Table) -> None:
    """Tables with exactly the columns, keys and indexes of the memledger schema."""
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    for table in tables:
        await conn.execute(str(CreateTable(table).compile(dialect=dialect)))
        for index in table.indexes:
            await conn.execute(str(CreateIndex(index).compile(dialect=dialect)))


def insert_sql(table: Table) -> str:
    """INSERT of every column of `table`, asyncpg placeholders."""
    cols = [c.name for c in table.c]
    return (f"INSERT INTO {table.name} ({', '.join(cols)}) "
            f"VALUES ({', '.join(f'${i + 1}' for i in range(len(cols)))})")


async def rows_of(dsn: str, table: Table, where: str = "") -> list[tuple[Any, ...]]:
    """Every row of a table, in key order, as insertable tuples."""
    conn = await asyncpg.connect(dsn)
    try:
        cols = ", ".join(c.name for c in table.c)
        keys = ", ".join(c.name for c in table.primary_key.columns)
        got = await conn.fetch(f"SELECT {cols} FROM {table.name} {where} ORDER BY {keys}")
        return [tuple(r) for r in got]
    finally:
        await conn.close()


async def raw_write(conn: asyncpg.Connection, table: Table, rows: Sequence[tuple[Any, ...]],
                    batch: int = BATCH) -> float:
    """Seconds for raw asyncpg to insert `rows`, `batch` per transaction."""
    sql = insert_sql(table)
    with Clock() as c:
        for i in range(0, len(rows), batch):
            async with conn.transaction():
                await conn.executemany(sql, rows[i:i + batch])
    return c.seconds


async def raw_tables(tables: Sequence[Table], rows: Sequence[Sequence[tuple[Any, ...]]],
                     batch: int = BATCH) -> float:
    """Seconds for raw asyncpg to write each table's rows into fresh copies of them."""
    async with database("raw") as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await create_like(conn, *tables)
            return sum([await raw_write(conn, tb, r, batch)
                        for tb, r in zip(tables, rows, strict=True)])
        finally:
            await conn.close()


async def append_batched(store: Store, events: Sequence[Event]) -> float:
    """Seconds for `Store.append` to take `events`, `BATCH` per call."""
    with Clock() as c:
        for i in range(0, len(events), BATCH):
            res = await store.append(events[i:i + BATCH])
            assert res[-1].status == "appended"
    return c.seconds


async def analyses(dsn: str) -> int:
    """ANALYZEs the server has run on this database's tables (manual and automatic;
    counted at once, unlike the scan counters, which reach the server later)."""
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT COALESCE(sum(analyze_count + "
                                       "autoanalyze_count), 0) FROM pg_stat_user_tables"))
    finally:
        await conn.close()


async def project_each(store: Store, dsn: str) -> dict[str, tuple[float, int]]:
    """Seconds each projection takes to catch up alone, in the registry's order, and
    the ANALYZEs run meanwhile (a figure the load does not move)."""
    out: dict[str, tuple[float, int]] = {}
    for proj in default_projections():
        before = await analyses(dsn)
        with Clock() as c:
            await Runner(store, [proj]).catch_up()
        out[proj.name] = (c.seconds, await analyses(dsn) - before)
    return out


async def get_latencies(ml: MemoryLedger, dsn: str, n: int, rng: random.Random
                        ) -> tuple[list[float], list[float]]:
    """Microseconds of `Principal.get` and of a raw SELECT by primary key, same keys."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT tenant, memory_id, ns_path, mkey FROM mem_versions "
                                "WHERE status = 'active' AND layer = 'long' "
                                "AND tenant NOT LIKE '%~%'")  # not `pad`'s copies
        picks = [rows[rng.randrange(len(rows))] for _ in range(n)]
        ours: list[float] = []
        for r in picks:
            tenant, user, *ns = [p for p in r["ns_path"].split(NS_SEP) if p]
            who = ml.principal(tenant, user)
            t0 = time.perf_counter_ns()
            got = await who.get(ns, r["mkey"])
            ours.append((time.perf_counter_ns() - t0) / 1000)
            assert got is not None
        stmt = await conn.prepare("SELECT * FROM mem_versions WHERE tenant = $1 "
                                  "AND memory_id = $2")
        raw: list[float] = []
        for r in picks:
            t0 = time.perf_counter_ns()
            assert await stmt.fetchrow(r["tenant"], r["memory_id"]) is not None
            raw.append((time.perf_counter_ns() - t0) / 1000)
        return ours, raw
    finally:
        await conn.close()


async def recall_latencies(ml: MemoryLedger, dsn: str, n: int, rng: random.Random
                           ) -> tuple[list[float], list[float]]:
    """Milliseconds of `Principal.recall` (warm) and of raw asyncpg + numpy top 5."""
    emb = current_embedder()
    conn = await asyncpg.connect(dsn)
    try:
        people = sorted({tuple(p for p in r[0].split(NS_SEP) if p)[:2] for r in await conn.fetch(
            "SELECT DISTINCT ns_path FROM vectors WHERE kind = 'memory' "
            "AND tenant NOT LIKE '%~%'")})
        asks = [(people[rng.randrange(len(people))], rng.choice(QUERIES)) for _ in range(n)]
        for (tenant, user), q in asks[:20]:  # warm the principals' caches once
            await ml.principal(tenant, user).recall(q, limit=5)
        ours: list[float] = []
        for (tenant, user), q in asks:
            t0 = time.perf_counter()
            await ml.principal(tenant, user).recall(q, limit=5)
            ours.append((time.perf_counter() - t0) * 1000)
        vec = await conn.prepare(
            "SELECT item_id, vector FROM vectors WHERE tenant = $1 AND ns_path >= $2 "
            "AND ns_path < $3 AND kind = 'memory' AND layer = 'long' AND model = $4")
        mem = await conn.prepare("SELECT memory_id, value FROM mem_versions WHERE "
                                 "tenant = $1 AND status = 'active' AND memory_id = ANY($2)")
        raw: list[float] = []
        for (tenant, user), q in asks:
            t0 = time.perf_counter()
            qv = emb.embed([q])[0]
            prefix = ns_path([tenant, user])
            rows = await vec.fetch(tenant, prefix, prefix[:-1] + "\x20", emb.name)
            matrix = np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(
                len(rows), emb.dim)
            scores = matrix @ qv
            k = min(5, len(rows))
            top = np.argpartition(-scores, k - 1)[:k] if k else []
            await mem.fetch(tenant, [rows[int(i)][0] for i in top])
            raw.append((time.perf_counter() - t0) * 1000)
        return ours, raw
    finally:
        await conn.close()


#: The schema the raw baselines write in, beside the ledger's own tables.
RAW: Final = "raw"


async def snapshot(dsn: str, tables: Sequence[Table]) -> None:
    """Copies of `tables` in the `raw` schema (`LIKE ... INCLUDING ALL`: the same
    columns, keys and indexes) holding their rows as they are now, with statistics:
    the raw baseline then writes the rows a step adds into tables of the same size."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {RAW}")
        for tb in tables:
            await conn.execute(f"DROP TABLE IF EXISTS {RAW}.{tb.name}")
            await conn.execute(f"CREATE TABLE {RAW}.{tb.name} "
                               f"(LIKE public.{tb.name} INCLUDING ALL)")
            await conn.execute(f"INSERT INTO {RAW}.{tb.name} SELECT * FROM public.{tb.name}")
            await conn.execute(f"ANALYZE {RAW}.{tb.name}")
    finally:
        await conn.close()


async def raw_added(dsn: str, tables: Sequence[Table], batch: int = BATCH
                    ) -> tuple[float, int]:
    """Seconds for raw asyncpg to insert into each `snapshot` copy the rows its table
    gained since (rows with a key the copy lacks, in key order, `batch` per
    transaction), and how many rows that was."""
    conn = await asyncpg.connect(dsn)
    try:
        secs, count = 0.0, 0
        for tb in tables:
            cols = ", ".join(c.name for c in tb.c)
            keys = [c.name for c in tb.primary_key.columns]
            rows = [tuple(r) for r in await conn.fetch(
                f"SELECT {cols} FROM public.{tb.name} p WHERE NOT EXISTS (SELECT 1 FROM "
                f"{RAW}.{tb.name} r WHERE {' AND '.join(f'r.{k} = p.{k}' for k in keys)}) "
                f"ORDER BY {', '.join(keys)}")]
            sql = insert_sql(tb).replace(f"INTO {tb.name} ", f"INTO {RAW}.{tb.name} ", 1)
            with Clock() as c:
                for i in range(0, len(rows), batch):
                    async with conn.transaction():
                        await conn.executemany(sql, rows[i:i + batch])
            secs += c.seconds
            count += len(rows)
        return secs, count
    finally:
        await conn.close()


#: The ledger and view tables `pad` grows, and how each copy's columns are changed:
#: every tenant renamed (`TENANT~g`: a copy no principal of the ledger can read),
#: positions moved past the ledger's, slots and full-text ids made distinct.
PADDED: Final = (t.events, t.tombstones, t.task_owners, t.mem_versions, t.mem_marks,
                 t.task_notes, t.tasks_view, t.vectors, t.lexical_docs, t.mem_history)


async def pad(dsn: str, copies: int) -> int:
    """Grow the ledger to `copies + 1` times its events at once, in SQL: each ledger and
    view table gets `copies` copies of its rows under other tenants (`PADDED`), event
    positions following on from the ledger's (copy g holds positions g*H+1 .. (g+1)*H),
    then statistics are gathered and every projection's checkpoint is moved to the new
    head (the copies are projected already: their view rows are copied with them).
    The hash chain is not extended over the copies (nothing here verifies it). Returns
    the new head."""
    conn = await asyncpg.connect(dsn)
    try:
        head = int(await conn.fetchval("SELECT max(position) FROM events"))
        assert await conn.fetchval("SELECT min(position) FROM checkpoints") == head, \
            "pad a ledger whose projections have caught up"
        for tb in PADDED:
            cols = [c.name for c in tb.c]
            exprs = [f"{c} || '~' || g" if c == "tenant" else
                     "md5(slot || '~' || g)" if c == "slot" else
                     f"position + g::bigint * {head}" if c == "position" else
                     "docid # (g::bigint << 48)" if c == "docid" else c for c in cols]
            async with conn.transaction():
                await conn.execute(
                    f"INSERT INTO {tb.name} ({', '.join(cols)}) SELECT {', '.join(exprs)} "
                    f"FROM {tb.name}, generate_series(1, {copies}) AS g "
                    f"WHERE {tb.name}.tenant NOT LIKE '%~%'")
        new_head = head * (copies + 1)
        await conn.execute("UPDATE checkpoints SET position = $1", new_head)
        await conn.execute("UPDATE shard_checkpoints SET position = $1", new_head)
        await conn.execute("VACUUM ANALYZE")
        return new_head
    finally:
        await conn.close()


async def one_size(ml: MemoryLedger, dsn: str, events: Sequence[Event], k: str,
                   out: list[dict[str, Any]], rates: dict[str, dict[str, float]]) -> None:
    """Append `events` to the ledger, project them (each view alone), then read: every
    figure beside raw asyncpg writing the same rows into tables of the same size."""
    n = len(events)
    say(f"postgres {k}: Store.append, {BATCH} per call")
    await snapshot(dsn, [t.events])
    secs = await append_batched(ml.store, events)
    raw, _ = await raw_added(dsn, [t.events])
    out.append(result(f"pg append batched ({BATCH}/call, {k})", n / secs,
                      "events/s", n / raw, "rows/s",
                      "raw: asyncpg executemany of the same rows into a copy of the "
                      "table (same size, keys, indexes); target >= 0.5x"))
    say(f"postgres {k}: projections")
    await snapshot(dsn, [tb for tables in VIEW_ROWS.values() for tb in tables])
    each = await project_each(ml.store, dsn)
    total = sum(secs for secs, _ in each.values())
    for name, (secs, analyzed) in each.items():
        rates.setdefault(name, {})[k] = n / secs
        tables = VIEW_ROWS.get(name)
        if tables is None:
            out.append(result(f"pg projection {name} ({k})", n / secs,
                              "events/s", None, note=f"{analyzed} ANALYZE; view rows "
                              "not compared"))
            continue
        raw, count = await raw_added(dsn, tables)
        out.append(result(
            f"pg projection {name} ({k})", n / secs, "events/s", n / raw,
            "events/s", f"{analyzed} ANALYZE; raw: asyncpg writing the {count:,} view "
            "rows it added into copies of its tables (same size, keys, indexes); "
            "target >= 0.5x"))
    rates.setdefault("all views", {})[k] = n / total
    say(f"postgres {k}: get and recall")
    rng = random.Random(7)
    ours, base = await get_latencies(ml, dsn, size(2000, 100), rng)
    out.append(result(f"pg get p99 ({k})", percentile(ours, 99), "us",
                      percentile(base, 99), note=(
                          f"p50 {percentile(ours, 50):,.0f} us vs raw "
                          f"{percentile(base, 50):,.0f} us; raw: asyncpg prepared "
                          "SELECT by primary key; target: within 3x")))
    ours, base = await recall_latencies(ml, dsn, size(200, 20), rng)
    out.append(result(f"pg recall p99 ({k})", percentile(ours, 99), "ms",
                      percentile(base, 99), note=(
                          f"p50 {percentile(ours, 50):.1f} ms vs raw "
                          f"{percentile(base, 50):.1f} ms; raw: asyncpg reading "
                          "the principal's vectors, numpy top 5, those memories")))


async def growth(out: list[dict[str, Any]], d: Path) -> None:
    """The figures on a fresh ledger of `SMALL` events, then on the same ledger grown to
    `LARGE` by `pad` with `SMALL` more events appended and projected: the projection's
    events/s at the large size against the small."""
    small, large = size(10_000, 1_000), size(200_000, 4_000)
    with no_gc():
        events = mixed_events(2 * small, seed=1)
    rates: dict[str, dict[str, float]] = {}
    ks, kl = f"{small // 1000}k events", f"next {small // 1000}k at {large // 1000}k"
    async with database("growth") as dsn:
        ml = MemoryLedger(sa_url(dsn), register_path=str(d / "growth.forgets"))
        await ml.open()
        try:
            await one_size(ml, dsn, events[:small], ks, out, rates)
            say(f"postgres: padding the ledger to {large - small:,} events in SQL")
            await pad(dsn, (large - small) // small - 1)
            await one_size(ml, dsn, events[small:], kl, out, rates)
        finally:
            await ml.close()
    for name, by in rates.items():
        out.append(result(
            f"pg projection {name}: {large // 1000}k vs {small // 1000}k", by[kl],
            "events/s", by[ks], "events/s",
            f"the {small // 1000}k events after {large - small:,} vs the first "
            f"{small // 1000}k; target >= 0.85x"))


async def concurrent_appends(n: int, d: Path) -> dict[str, Any]:
    """64 tasks each calling `Store.append_one` vs raw one row per commit."""
    with no_gc():
        events = mixed_events(n, seed=2)
    async with database("single") as dsn:
        store = Store(sa_url(dsn), register_path=str(d / "single.forgets"))
        await store.open()
        shares = [events[i::TASKS] for i in range(TASKS)]

        async def worker(mine: Sequence[Event]) -> None:
            for ev in mine:
                await store.append_one(ev)

        try:
            with Clock() as c:
                await asyncio.gather(*(worker(s) for s in shares))
        finally:
            await store.close()
        rows = await rows_of(dsn, t.events)
    raw = await raw_tables([t.events], [rows], batch=1)
    return result(f"pg append_one x{TASKS} concurrent ({n:,} events)", n / c.seconds,
                  "events/s", n / raw, "rows/s", "raw: asyncpg one row per commit")


async def cli_pair(n: int, d: Path) -> dict[str, Any]:
    """`memledger append FILE` + `memledger project` vs raw parsing and writing the event
    rows and the active rows."""
    with no_gc():
        events = mixed_events(n, seed=4)
    path = d / "events.jsonl"
    path.write_bytes(b"".join(orjson.dumps(ev.to_wire()) + b"\n" for ev in events))
    async with database("cli") as dsn:
        env = {**os.environ, "MEMLEDGER_DB_URL": sa_url(dsn),
               "MEMLEDGER_FORGET_REGISTER": str(d / "cli.forgets")}
        each: list[float] = []
        with Clock() as imports:  # the interpreter and `memledger`'s imports alone
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", "import memledger.cli.app, memledger.cli.operator",
                env=env)
            assert await proc.wait() == 0
        for args in (["append", str(path)], ["project"], ["project"]):
            with Clock() as one:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "memledger", *args, env=env,
                    stdout=subprocess.DEVNULL)
                assert await proc.wait() == 0, f"memledger {args[0]} failed"
            each.append(one.seconds)
        # The third run (`project` with nothing left to do: start-up, imports, opening
        # the ledger) is not part of the pair; it shows the pair's fixed cost.
        pair = each[0] + each[1]
        ev_rows = await rows_of(dsn, t.events)
        active = await rows_of(dsn, t.mem_versions, "WHERE status = 'active'")
    async with database("cli_raw") as raw_dsn:
        conn = await asyncpg.connect(raw_dsn)
        try:
            await create_like(conn, t.events, t.mem_versions)
            ev_sql, mv_sql = insert_sql(t.events), insert_sql(t.mem_versions)
            with Clock() as r:
                lines = path.read_bytes().splitlines()
                for i in range(0, len(lines), BATCH):
                    for line in lines[i:i + BATCH]:
                        orjson.loads(line)
                    async with conn.transaction():
                        await conn.executemany(ev_sql, ev_rows[i:i + BATCH])
                        await conn.executemany(mv_sql, active[i:i + BATCH])
        finally:
            await conn.close()
    return result(f"pg CLI append + project ({n // 1000}k events, every view)",
                  n / pair, "events/s", n / r.seconds, "events/s",
                  f"two processes: append {each[0]:.2f} s, project {each[1]:.2f} s; "
                  f"a project with nothing to do (start-up and open) {each[2]:.2f} s, "
                  f"of which the interpreter and imports {imports.seconds:.2f} s; "
                  f"raw {r.seconds:.2f} s: asyncpg parsing the lines and writing event "
                  "and active rows, 1,000/commit; target >= 0.5x")


async def reachable() -> str | None:
    """None when the server answers, else why not."""
    try:
        conn = await asyncpg.connect(f"{SERVER}/postgres", timeout=5)
    except (TimeoutError, OSError, asyncpg.PostgresError) as e:
        return f"{type(e).__name__}: {e}"
    await conn.close()
    return None


async def run() -> list[dict[str, Any]]:
    """Every figure at each size, then how the projection's speed grew."""
    why = await reachable()
    if why is not None:
        say(f"postgres: skipped, no server at {SERVER} ({why}); "
            "start one or set MEMLEDGER_BENCH_PG")
        return []
    out: list[dict[str, Any]] = []
    with workdir("postgres") as d:
        await growth(out, d)
        say("postgres: 64-way append_one")
        out.append(await concurrent_appends(size(TASKS * 100, TASKS * 5), d))
        say("postgres: CLI append + project")
        out.append(await cli_pair(size(10_000, 1_000), d))
    return out


if __name__ == "__main__":
    sys.exit(main(run))
