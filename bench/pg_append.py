"""PostgreSQL `Store.append` alone, beside raw asyncpg, at 10k and at 200k events.

The append part of the `postgres` module, without its projections, reads and CLI
runs, so a change to the append path can be timed in a minute and run back to back
against another tree: `python -m bench.pg_append [--quick]`. On one database on the
`MEMLEDGER_BENCH_PG` server (dropped after):

- "10k events": `Store.append` of `mixed_events(2 * N, seed=1)[:N]`, 1,000 per call,
  into an empty ledger, beside raw asyncpg `executemany` of the rows it wrote into a
  copy of `events` (`bench.postgres.snapshot`: same columns, keys, indexes and size);
- "next 10k at 200k": `events` is then grown in SQL to 190k rows (copies of its rows
  under other tenants, positions after the ledger's, statistics gathered), and the next
  N events are appended and compared the same way.
"""

from __future__ import annotations

import sys
from typing import Any

import asyncpg

from bench.common import main, mixed_events, no_gc, result, say, size, workdir
from bench.postgres import (
    BATCH,
    SERVER,
    append_batched,
    database,
    raw_added,
    reachable,
    sa_url,
    snapshot,
)
from ledger import schema as t
from ledger.store import Store


async def pad_events(dsn: str, copies: int) -> None:
    """`copies` more copies of every `events` row under other tenants (`TENANT~g`),
    positions following the ledger's; then ANALYZE."""
    conn = await asyncpg.connect(dsn)
    try:
        head = int(await conn.fetchval("SELECT max(position) FROM events"))
        cols = [c.name for c in t.events.c]
        exprs = [f"{c} || '~' || g" if c == "tenant" else
                 "md5(slot || '~' || g)" if c == "slot" else
                 f"position + g::bigint * {head}" if c == "position" else c for c in cols]
        await conn.execute(
            f"INSERT INTO events ({', '.join(cols)}) SELECT {', '.join(exprs)} FROM events, "
            f"generate_series(1, {copies}) AS g")
        await conn.execute("VACUUM ANALYZE events")
    finally:
        await conn.close()


async def run() -> list[dict[str, Any]]:
    why = await reachable()
    if why is not None:
        say(f"pg_append: skipped, no server at {SERVER} ({why})")
        return []
    n, large = size(10_000, 2_000), size(200_000, 20_000)
    with no_gc():
        events = mixed_events(2 * n, seed=1)
    out: list[dict[str, Any]] = []
    with workdir("pg_append") as d:
        async with database("append") as dsn:
            store = Store(sa_url(dsn), register_path=str(d / "append.forgets"))
            await store.open()
            try:
                for k, evs in ((f"{n // 1000}k events", events[:n]),
                               (f"next {n // 1000}k at {large // 1000}k", events[n:])):
                    if evs is events[n:]:
                        say(f"pg_append: growing events to {large - n:,} rows in SQL")
                        await pad_events(dsn, (large - n) // n - 1)
                    await snapshot(dsn, [t.events])
                    say(f"pg_append {k}: Store.append, {BATCH} per call")
                    secs = await append_batched(store, evs)
                    raw, _ = await raw_added(dsn, [t.events])
                    out.append(result(
                        f"pg append batched ({BATCH}/call, {k})", n / secs, "events/s",
                        n / raw, "rows/s", "raw: asyncpg executemany of the same rows into "
                        "a copy of the table (same size, keys, indexes); target >= 0.5x"))
            finally:
                await store.close()
    return out


if __name__ == "__main__":
    sys.exit(main(run))
