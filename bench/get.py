"""`get` latency, in-process, with 100k active memories, beside LangGraph's SqliteStore.

100k long-term memories (1,000 users x 100 keys, one tenant) are appended through
`Store.append` and projected by the memories projection; LangGraph's `SqliteStore`
(WAL) is loaded with the same items under the same namespaces and keys. Then random
(user, key) lookups are timed one by one (p50/p99 over the sample, after a warm-up),
in rounds: each round runs every contender of its phase on the same 250 keys in turn,
so a change in the shared machine's load falls on all of them alike.

- `MemoryLedger.get`: the SDK call as an application makes it
  (`ml.principal(t, u).get(ns, key)`): on a SQLite file a point read on the calling
  thread (`ledger.backends.sqlite.PointReads`), principal check, layer rules, expiry
  and the tombstone `NOT EXISTS` in its SQL, then the value opened by the vault;
- `reads.get` inside an open `store.read()` transaction: the same statement through
  SQLAlchemy async and aiosqlite, the path PostgreSQL (and a busy SQLite file) takes;
- baseline: LangGraph `SqliteStore.get`. It keeps no history, no versions and no
  forget records, and encrypts nothing, so it is the floor of a key-value lookup from
  Python, not a peer in features. Raw sqlite3 doing the same indexed SELECT is given in
  the note.

The ledger runs with its vault on (the default): each memory's content is sealed under
a data key of its own, and the first read of a memory in a process looks that key up
in the key store and builds its cipher (`ledger.vault`, some 20-40 us); the vault
keeps the cipher, so a later read of the same memory skips both. Three phases, each
printed:

1. first reads: every contender on lookups this process has not read before (the
   warm-up's keys aside): `MemoryLedger.get` pays the key look-up on nearly every call;
2. the same lookups again, `MemoryLedger.get` and `SqliteStore.get` only: the
   memories' ciphers are cached, as in a process that reads the same users' memories
   again and again;
3. 1,000 forgets appended to the tenant (keys no lookup reads), then the same
   lookups a third time, the same two contenders: every read tests the ledger's
   tombstones, and only the ones that could cover its row should cost it anything
   (compare with phase 2, where the ciphers were cached too).

Target (issue 20): p50 and p99 within 2x of `SqliteStore.get`.
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
from ledger.builders import Source, forget_key
from ledger.events import Event
from ledger.store import Store
from memledger import MemoryLedger
from projections import reads
from projections.runner import Runner
from projections.views import MemoryProjection

TENANT = "shop-a"
USERS = 1000
#: Forgets appended to the tenant for the second timing.
TOMBSTONES = 1000
WARMUP = 500

Lookup = tuple[str, str]  # user, key


def _us(ns: int) -> float:
    return ns / 1000


def stats(samples: Sequence[float]) -> tuple[float, float]:
    """p50 and p99 of microsecond samples."""
    return percentile(samples, 50), percentile(samples, 99)


ROUND = 250


def rounds(lookups: Sequence[Lookup]) -> list[Sequence[Lookup]]:
    """The timed lookups in rounds of `ROUND`: every contender runs each round in turn,
    so a change of the machine's load (shared, 2 cores) falls on all of them alike."""
    timed = lookups[WARMUP:]
    return [timed[i:i + ROUND] for i in range(0, len(timed), ROUND)]


async def time_reads_get(store: Store, lookups: Sequence[Lookup], out: list[float]) -> None:
    """Microseconds per `reads.get` (the async path PostgreSQL takes), all inside one
    open read transaction."""
    now_us = time.time_ns() // 1000
    async with store.read() as conn:
        for user, key in lookups:
            who = reads.Principal(TENANT, user)
            t0 = time.perf_counter_ns()
            res = await reads.get(conn, who, [TENANT, user, "preferences"], key, now_us=now_us)
            out.append(_us(time.perf_counter_ns() - t0))
            assert res["found"], (user, key)


async def time_ledger_get(ml: MemoryLedger, lookups: Sequence[Lookup], out: list[float]
                          ) -> None:
    """Microseconds per `Principal.get` call, as an application makes it."""
    for user, key in lookups:
        t0 = time.perf_counter_ns()
        res = await ml.principal(TENANT, user).get(["preferences"], key)
        out.append(_us(time.perf_counter_ns() - t0))
        assert res is not None, (user, key)


def langgraph_store(path: Path, events: Sequence[Event]) -> tuple[Any, sqlite3.Connection]:
    """LangGraph's SqliteStore (WAL) holding the same items under the same keys."""
    from langgraph.store.base import PutOp
    from langgraph.store.sqlite import SqliteStore  # type: ignore[import-untyped]

    conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    store = SqliteStore(conn)
    store.setup()
    ops = [PutOp(tuple(ev.data["namespace"]), ev.data["key"], dict(ev.data["value"]))
           for ev in events]
    for i in range(0, len(ops), 1000):
        store.batch(ops[i:i + 1000])
    return store, conn


def time_langgraph(store: Any, lookups: Sequence[Lookup], out: list[float]) -> None:
    """Microseconds per LangGraph `SqliteStore.get`."""
    for user, key in lookups:
        t0 = time.perf_counter_ns()
        item = store.get((TENANT, user, "preferences"), key)
        out.append(_us(time.perf_counter_ns() - t0))
        assert item is not None, (user, key)


_RAW = ("SELECT * FROM mem_versions WHERE tenant = ? AND ns_path = ? AND mkey = ? "
        "AND status = 'active'")


def time_raw(conn: sqlite3.Connection, lookups: Sequence[Lookup], out: list[float]) -> None:
    """Raw sqlite3: the same indexed SELECT of the active row, in microseconds."""
    for user, key in lookups:
        nsp = f"{TENANT}\x1f{user}\x1fpreferences\x1f"
        t0 = time.perf_counter_ns()
        row = conn.execute(_RAW, (TENANT, nsp, key)).fetchone()
        out.append(_us(time.perf_counter_ns() - t0))
        assert row is not None


async def run() -> list[dict[str, Any]]:
    """p50/p99 of MemoryLedger.get and reads.get beside LangGraph SqliteStore.get."""
    n = size(100_000, 5_000)
    samples = size(5_000, 1_000)
    rng = random.Random(5)
    with no_gc():
        events = simple_writes(n, users=USERS, tenant=TENANT)
    per_user = n // USERS
    lookups = [(f"u{rng.randrange(USERS)}", f"k{rng.randrange(per_user)}")
               for _ in range(samples + WARMUP)]
    out: list[dict[str, Any]] = []
    rg: list[float] = []
    mg: list[float] = []
    raw: list[float] = []
    lg: list[float] = []
    mg_w: list[float] = []
    lg_w: list[float] = []
    mg_t: list[float] = []
    lg_t: list[float] = []
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
        finally:
            await store.close()
        say(f"loading the same {n:,} items into LangGraph's SqliteStore")
        lgs, lgc = langgraph_store(d / "langgraph.db", events)
        store = Store(sqlite_url(db))
        ml = MemoryLedger(sqlite_url(db))
        try:
            await store.open()
            await ml.open()
            with contextlib.closing(raw_connect(db)) as rawc:
                say(f"timing {samples:,} gets of each kind, in rounds of {ROUND}")
                warm = lookups[:WARMUP]
                await time_reads_get(store, warm, [])
                await time_ledger_get(ml, warm, [])
                time_raw(rawc, warm, [])
                time_langgraph(lgs, warm, [])
                settle()
                for chunk in rounds(lookups):
                    await time_ledger_get(ml, chunk, mg)
                    time_langgraph(lgs, chunk, lg)
                    time_raw(rawc, chunk, raw)
                    await time_reads_get(store, chunk, rg)
            # The same lookups again: every memory read above has its cipher cached
            # in the vault now (the only cache between these calls and SQLite).
            say("timing the same gets again (their memories' ciphers cached)")
            for chunk in rounds(lookups):
                await time_ledger_get(ml, chunk, mg_w)
                time_langgraph(lgs, chunk, lg_w)
            # Then with 1,000 tombstones in the tenant (forgets of keys of the same
            # users that no lookup reads), the same lookups a third time (ciphers
            # cached, as in the phase before: the tombstones are the one change): a
            # read tests the tombstones that could cover its row, not every tombstone
            # of its tenant. A tombstone is written in the append transaction (readable
            # at once, R20); the projections, which have nothing of these keys to erase,
            # are not run.
            say(f"appending {TOMBSTONES:,} forgets to the tenant; timing again")
            await ml.append([forget_key(
                tenant=TENANT, actor=f"u{i % USERS}", namespace=[TENANT, f"u{i % USERS}",
                                                                  "preferences"],
                key=f"gone{i}", source=Source("explicit_user_request", f"F{i}",
                                              "2026-09-30T10:00:00+00:00"),
                idempotency_key=f"forget-{i}") for i in range(TOMBSTONES)])
            settle()
            for chunk in rounds(lookups):
                await time_ledger_get(ml, chunk, mg_t)
                time_langgraph(lgs, chunk, lg_t)
        finally:
            await ml.close()
            await store.close()
            lgc.close()

    lg50, lg99 = stats(lg)
    raw50, raw99 = stats(raw)
    for label, xs in (("MemoryLedger.get", mg), ("reads.get, async path", rg)):
        p50, p99 = stats(xs)
        out.append(result(f"get p50, {label} ({n // 1000}k active)", p50, "us", lg50, "us",
                          f"first read of each memory in the process; baseline: LangGraph "
                          f"SqliteStore.get p50; raw sqlite3 SELECT p50 {raw50:.0f} us; "
                          f"target within 2x: {'met' if p50 <= 2 * lg50 else 'MISSED'}"))
        out.append(result(f"get p99, {label} ({n // 1000}k active)", p99, "us", lg99, "us",
                          f"baseline: LangGraph p99; raw sqlite3 p99 {raw99:.0f} us; "
                          f"target within 2x: {'met' if p99 <= 2 * lg99 else 'MISSED'}"))
    w50 = stats(mg_w)[0]
    out += _same_rounds(f"MemoryLedger.get, the same keys again ({n // 1000}k active)",
                        mg_w, lg_w, f"ciphers cached; first reads {stats(mg)[0]:.1f} us")
    out += _same_rounds(f"MemoryLedger.get, {TOMBSTONES:,} tombstones in the tenant",
                        mg_t, lg_t, f"the same keys a third time; without the tombstones "
                                    f"(same keys again) {w50:.1f} us")
    return out


def _same_rounds(label: str, ours: list[float], theirs: list[float], note: str
                 ) -> list[dict[str, Any]]:
    """The p50 and p99 rows of a phase that timed `MemoryLedger.get` and LangGraph's
    `SqliteStore.get` in the same rounds."""
    rows = []
    for q, (mine, base) in zip((50, 99), zip(stats(ours), stats(theirs), strict=True),
                               strict=True):
        rows.append(result(f"get p{q}, {label}", mine, "us", base, "us",
                           f"{note + '; ' if q == 50 else ''}baseline: LangGraph "
                           f"SqliteStore.get p{q}, same rounds; target within 2x: "
                           f"{'met' if mine <= 2 * base else 'MISSED'}"))
    return rows


if __name__ == "__main__":
    sys.exit(main(run))
