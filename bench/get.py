"""`get` latency, in-process, with 100k active memories, beside LangGraph's SqliteStore.

100k long-term memories (1,000 users x 100 keys, one tenant) are appended through
`Store.append` and projected by the memories projection. Then random (user, key)
lookups are timed one by one (p50/p99 over the sample, after a warm-up):

- `projections.reads.get` inside an open `store.read()` transaction: the query itself,
  principal check, layer rules, expiry and the tombstone `NOT EXISTS` included;
- `MemoryLedger.get`: the SDK call, which also opens a read transaction per call;
- baseline: LangGraph `SqliteStore.get` (WAL) holding the same 100k items under the
  same namespaces and keys, in the same run. It keeps no history, no versions and no
  forget records, so it is the floor of a key-value lookup from Python, not a peer in
  features. Raw sqlite3 doing the same indexed SELECT is given in the note.

Target: p99 < 1 ms.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    load_ledger,
    main,
    no_gc,
    percentile,
    raw_connect,
    result,
    say,
    settle,
    simple_writes,
    size,
    sqlite_url,
    workdir,
)
from ledger.events import Event
from ledger.store import Store
from memledger import MemoryLedger
from projections import reads
from projections.runner import Runner
from projections.views import MemoryProjection

TENANT = "shop-a"
USERS = 1000
WARMUP = 500

Lookup = tuple[str, str]  # user, key


def _us(ns: int) -> float:
    return ns / 1000


def stats(samples: Sequence[float]) -> tuple[float, float]:
    """p50 and p99 of microsecond samples."""
    return percentile(samples, 50), percentile(samples, 99)


async def time_reads_get(store: Store, lookups: Sequence[Lookup]) -> list[float]:
    """Microseconds per `reads.get`, all inside one open read transaction."""
    out: list[float] = []
    now_us = time.time_ns() // 1000
    async with store.read() as conn:
        for i, (user, key) in enumerate(lookups):
            who = reads.Principal(TENANT, user)
            t0 = time.perf_counter_ns()
            res = await reads.get(conn, who, [TENANT, user, "preferences"], key, now_us=now_us)
            dt = time.perf_counter_ns() - t0
            assert res is not None, (user, key)
            if i >= WARMUP:
                out.append(_us(dt))
    return out


async def time_ledger_get(ml: MemoryLedger, lookups: Sequence[Lookup]) -> list[float]:
    """Microseconds per `Principal.get` call (a read transaction each)."""
    out: list[float] = []
    for i, (user, key) in enumerate(lookups):
        t0 = time.perf_counter_ns()
        res = await ml.principal(TENANT, user).get(["preferences"], key)
        dt = time.perf_counter_ns() - t0
        assert res is not None, (user, key)
        if i >= WARMUP:
            out.append(_us(dt))
    return out


def time_langgraph(path: Path, events: Sequence[Event], lookups: Sequence[Lookup]
                   ) -> list[float]:
    """Load the same items into LangGraph's SqliteStore and time `get`, in microseconds."""
    from langgraph.store.base import PutOp
    from langgraph.store.sqlite import SqliteStore  # type: ignore[import-untyped]

    conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    try:
        store = SqliteStore(conn)
        store.setup()
        ops = [PutOp(tuple(ev.data["namespace"]), ev.data["key"], dict(ev.data["value"]))
               for ev in events]
        for i in range(0, len(ops), 1000):
            store.batch(ops[i:i + 1000])
        out: list[float] = []
        for i, (user, key) in enumerate(lookups):
            t0 = time.perf_counter_ns()
            item = store.get((TENANT, user, "preferences"), key)
            dt = time.perf_counter_ns() - t0
            assert item is not None, (user, key)
            if i >= WARMUP:
                out.append(_us(dt))
        return out
    finally:
        conn.close()


def time_raw(path: Path, lookups: Sequence[Lookup]) -> list[float]:
    """Raw sqlite3: the same indexed SELECT of the active row, in microseconds."""
    sql = ("SELECT * FROM mem_versions WHERE tenant = ? AND ns_path = ? AND mkey = ? "
           "AND status = 'active'")
    out: list[float] = []
    with contextlib.closing(raw_connect(path)) as conn:
        for i, (user, key) in enumerate(lookups):
            nsp = f"{TENANT}\x1f{user}\x1fpreferences\x1f"
            t0 = time.perf_counter_ns()
            row = conn.execute(sql, (TENANT, nsp, key)).fetchone()
            dt = time.perf_counter_ns() - t0
            assert row is not None
            if i >= WARMUP:
                out.append(_us(dt))
    return out


async def run() -> list[dict[str, Any]]:
    """p50/p99 of reads.get and MemoryLedger.get beside LangGraph SqliteStore.get."""
    n = size(100_000, 10_000)
    samples = size(5_000, 2_000)
    rng = random.Random(5)
    with no_gc():
        events = simple_writes(n, users=USERS, tenant=TENANT)
    per_user = n // USERS
    lookups = [(f"u{rng.randrange(USERS)}", f"k{rng.randrange(per_user)}")
               for _ in range(samples + WARMUP)]
    out: list[dict[str, Any]] = []
    with workdir("get") as d:
        db = d / "ledger.db"
        say(f"appending {n:,} memories through Store.append (set-up)")
        await load_ledger(db, events)
        store = Store(sqlite_url(db))
        await store.open()
        try:
            say("projecting them (memories projection)")
            await Runner(store, [MemoryProjection()]).catch_up()
            async with store.read() as conn:
                active = await conn.exec_driver_sql(
                    "SELECT count(*) FROM mem_versions WHERE status = 'active'")
                n_active = int(active.scalar() or 0)
            assert n_active == n, n_active
            say(f"timing {samples:,} gets of each kind")
            settle()
            rg = await time_reads_get(store, lookups)
        finally:
            await store.close()
        async with MemoryLedger(sqlite_url(db)) as ml:
            mg = await time_ledger_get(ml, lookups)
        raw = time_raw(db, lookups)
        lg = time_langgraph(d / "langgraph.db", events, lookups)

    lg50, lg99 = stats(lg)
    raw50, raw99 = stats(raw)
    for label, xs in (("reads.get in store.read()", rg), ("MemoryLedger.get", mg)):
        p50, p99 = stats(xs)
        out.append(result(f"get p50, {label} ({n // 1000}k active)", p50, "us", lg50, "us",
                          f"baseline: LangGraph SqliteStore.get p50; raw sqlite3 SELECT "
                          f"p50 {raw50:.0f} us"))
        out.append(result(f"get p99, {label} ({n // 1000}k active)", p99, "us", lg99, "us",
                          f"baseline: LangGraph p99; raw sqlite3 p99 {raw99:.0f} us; "
                          f"target p99 < 1 ms: {'met' if p99 < 1000 else 'MISSED'}"))
    return out


if __name__ == "__main__":
    sys.exit(main(run))
