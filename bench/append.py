"""Append throughput on SQLite: batched appends and 64-way concurrent single appends.

Each figure is printed beside raw `sqlite3` (WAL, synchronous=NORMAL) inserting the
very same rows (read back from the ledger after the run) into a table with the same
columns, keys and indexes as `events`, in the same run:

- batched: `Store.append` with 1,000 events per call vs `executemany` of 1,000 rows per
  transaction (target >= 0.7x), and beside the same without SQLite's automatic
  checkpoints in its commits (`raw_batched(checkpoints=False)`);
- concurrent: 64 asyncio tasks each calling `Store.append_one` in a loop (group commit)
  vs raw sqlite3 committing one row per transaction (targets >= 0.8x and >= 5,000
  events/s);
- the CLI pair: `memledger append FILE` then `memledger project` (two processes, every
  view) vs raw sqlite3 parsing the same lines and writing the same event rows and
  active rows, 1,000 per transaction (target >= 0.5x).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.common import (
    Clock,
    create_like,
    main,
    mixed_events,
    no_gc,
    raw_connect,
    result,
    say,
    settle,
    size,
    sqlite_url,
    workdir,
)
from ledger import schema as t
from ledger.events import Event
from ledger.store import Store
from ledger.validation import decode_event

BATCH = 1000
TASKS = 64
COLUMNS = [c.name for c in t.events.columns]
INSERT = (f"INSERT INTO events ({', '.join(COLUMNS)}) "
          f"VALUES ({', '.join('?' for _ in COLUMNS)})")


def stored_rows(db: Path) -> list[tuple[Any, ...]]:
    """Every row the ledger wrote, in position order, as insertable tuples."""
    with contextlib.closing(sqlite3.connect(str(db))) as conn:
        return conn.execute(f"SELECT {', '.join(COLUMNS)} FROM events "
                            "ORDER BY position").fetchall()


def raw_batched(path: Path, rows: Sequence[tuple[Any, ...]], batch: int, *,
                checkpoints: bool = True) -> float:
    """Seconds for raw sqlite3 to insert `rows`, `batch` rows per transaction.

    `checkpoints=False`: without SQLite's automatic WAL checkpoints, which otherwise run
    inside a COMMIT every 1,000 pages, with their fsyncs (the ledger runs its own on
    another thread, `ledger.inline`): the raw figure without the disk's latency, the
    stricter baseline on a machine whose fsyncs are slow."""
    with contextlib.closing(raw_connect(path)) as conn:
        if not checkpoints:
            conn.execute("PRAGMA wal_autocheckpoint=0")
        create_like(conn, t.events)
        with Clock() as c:
            for i in range(0, len(rows), batch):
                conn.execute("BEGIN")
                conn.executemany(INSERT, rows[i:i + batch])
                conn.execute("COMMIT")
    return c.seconds


async def ledger_batched(path: Path, events: Sequence[Event]) -> float:
    """Seconds for `Store.append` to take `events`, `BATCH` per call."""
    store = Store(sqlite_url(path))
    await store.open()
    try:
        with Clock() as c:
            for i in range(0, len(events), BATCH):
                res = await store.append(events[i:i + BATCH])
                assert res[-1].status == "appended"
    finally:
        await store.close()
    return c.seconds


async def ledger_concurrent(path: Path, events: Sequence[Event]) -> float:
    """Seconds for `TASKS` tasks, each appending its share one event per call."""
    store = Store(sqlite_url(path))
    await store.open()
    shares = [events[k::TASKS] for k in range(TASKS)]

    async def worker(mine: Sequence[Event]) -> None:
        for ev in mine:
            await store.append_one(ev)

    try:
        with Clock() as c:
            await asyncio.gather(*(worker(s) for s in shares))
    finally:
        await store.close()
    return c.seconds


def decode_rate(lines: Sequence[bytes]) -> dict[str, Any]:
    """`decode_event` (JSON, every contract rule, the secret scan) over the lines the CLI
    reads, beside `orjson.loads` of the same lines (best of three passes each, CPU time,
    so the load of a shared machine moves it less)."""
    def best(f: Any) -> float:
        times = []
        for _ in range(3):
            t0 = time.process_time()
            for line in lines:
                f(line)
            times.append(time.process_time() - t0)
        return min(times)

    ours, raw = best(decode_event), best(orjson.loads)
    return result(f"decode_event ({len(lines) // 1000}k lines)", len(lines) / ours, "events/s",
                  len(lines) / raw, "lines/s",
                  "validation + secret scan (R23) of what `memledger append` reads; raw: "
                  "orjson.loads of the same lines; CPU time, best of 3")


async def cli_pair(d: Path, n: int, out: list[dict[str, Any]]) -> dict[str, Any]:
    """`memledger append FILE` + `memledger project` of `n` events vs raw sqlite3 parsing
    the lines and writing the event and active rows, 1,000 per transaction."""
    with no_gc():
        events = mixed_events(n, seed=4)
    path = d / "events.jsonl"
    path.write_bytes(b"".join(orjson.dumps(ev.to_wire()) + b"\n" for ev in events))
    db = d / "cli.db"
    env = {**os.environ, "MEMLEDGER_DB_URL": sqlite_url(db)}
    out.append(decode_rate(path.read_bytes().splitlines()))
    settle()
    phases: list[float] = []
    with Clock() as c:
        for args in (["--help"], ["append", str(path)], ["project"]):
            started = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "memledger", *args, env=env,
                stdout=subprocess.DEVNULL)
            assert await proc.wait() == 0, f"memledger {args[0]} failed"
            phases.append(time.perf_counter() - started)
    # `--help` measures the interpreter and import start-up each command pays once; it
    # is not part of the pair.
    pair = c.seconds - phases[0]
    rows = stored_rows(db)
    with contextlib.closing(sqlite3.connect(str(db))) as conn:
        cols = ", ".join(col.name for col in t.mem_versions.c)
        active = conn.execute(f"SELECT {cols} FROM mem_versions WHERE status = 'active'"
                              ).fetchall()
    settle()
    with contextlib.closing(raw_connect(d / "raw-cli.db")) as conn:
        create_like(conn, t.events, t.mem_versions)
        mv = (f"INSERT INTO mem_versions ({cols}) "
              f"VALUES ({', '.join('?' for _ in t.mem_versions.c)})")
        with Clock() as r:
            lines = path.read_bytes().splitlines()
            for i in range(0, len(lines), BATCH):
                for line in lines[i:i + BATCH]:
                    orjson.loads(line)
                conn.execute("BEGIN")
                conn.executemany(INSERT, rows[i:i + BATCH])
                conn.executemany(mv, active[i:i + BATCH])
                conn.execute("COMMIT")
    return result(f"CLI append + project ({n // 1000}k events, every view)", n / pair,
                  "events/s", n / r.seconds, "events/s",
                  f"append {phases[1]:.1f} s + project {phases[2]:.1f} s, each including "
                  f"a start-up of {phases[0]:.1f} s (`memledger --help`); raw: sqlite3 "
                  "parsing the lines and writing event and active rows, 1,000/commit; "
                  "target >= 0.5x")


async def run() -> list[dict[str, Any]]:
    """Batched and concurrent append, each beside raw sqlite3 on the same rows."""
    n_batched = size(100_000, 3_000)
    n_single = size(TASKS * 300, TASKS * 20)
    say(f"building {n_batched + n_single:,} events")
    with no_gc():
        batched_events = mixed_events(n_batched, seed=1)
        single_events = mixed_events(n_single, seed=2)
    out: list[dict[str, Any]] = []
    with workdir("append") as d:
        say(f"Store.append: {n_batched:,} events, {BATCH} per call")
        settle()
        secs = await ledger_batched(d / "batched.db", batched_events)
        rows = stored_rows(d / "batched.db")
        assert len(rows) == n_batched
        settle()
        raw = raw_batched(d / "raw-batched.db", rows, BATCH)
        settle()
        quiet = raw_batched(d / "raw-batched-nockpt.db", rows, BATCH, checkpoints=False)
        out.append(result(
            f"append batched ({BATCH}/call, {n_batched // 1000}k events)",
            n_batched / secs, "events/s", len(rows) / raw, "rows/s",
            "raw: sqlite3 executemany, same rows and indexes, 1,000/commit (without "
            f"checkpoints in its commits: {len(rows) / quiet:,.0f} rows/s, "
            f"{quiet / secs:.2f}x); target >= 0.7x"))

        say(f"append_one: {TASKS} tasks, {n_single:,} events")
        settle()
        secs = await ledger_concurrent(d / "single.db", single_events)
        rows = stored_rows(d / "single.db")
        assert len(rows) == n_single
        settle()
        raw = raw_batched(d / "raw-single.db", rows, 1)
        settle()
        # With 64 callers a group commit holds at most 64 events: the raw floor of that.
        raw64 = raw_batched(d / "raw-64.db", rows, TASKS)
        rate = n_single / secs
        out.append(result(
            f"append_one x{TASKS} concurrent ({n_single:,} events)",
            rate, "events/s", len(rows) / raw, "rows/s",
            f"raw: sqlite3 one row per commit (at {TASKS} rows per commit: "
            f"{len(rows) / raw64:,.0f} rows/s); targets >= 0.8x and >= 5,000 events/s: "
            f"{'met' if rate >= 5000 else 'MISSED'}"))
        say("memledger append FILE + memledger project")
        out.append(await cli_pair(d, size(40_000, 1_000), out))
    return out


if __name__ == "__main__":
    sys.exit(main(run))
