"""The vault's cost: append, projection and `get` with content sealed, beside the same
work without the vault, in the same run (ledger/vault.py, docs/forgetting.md).

One event stream (`bench.common.mixed_events`: ~80% new memories, ~10% corrections,
~10% task events) is appended to two fresh SQLite ledgers through `Store.append`, one
with the vault on (a key store file beside the database, one key per content event,
taken from the vault's key pool: one fsynced key-store append per pool of 64, 128,
... 4,096 keys, not per group commit) and one without; the modes alternate
over the rounds and the median is kept. Then:

- append, in calls of 1,000 events and of 10 events;
- projection: `Runner.catch_up()` of the memories and tasks projections over each
  ledger (with the vault: payloads opened, view values sealed);
- `get`: random (user, key) lookups through `projections.reads.get` in one read
  transaction, p50 and p99, on each projected ledger (with the vault: the value opened
  at the row boundary); and the same lookups as `Ledger.get` makes them, a point read
  on the calling thread (`reads.get_now`; with the vault its sealed columns are opened
  in Python, `ledger.vault.open_columns`).

Append and projection are also given as this process's CPU time per event (both
threads: the event loop and the SQLite driver's), which the machine's load disturbs
far less than the wall clock.

The baseline of each figure is the same work without the vault. Target: append and
projection >= 0.8x; `get` not measurably slower.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Clock,
    main,
    mixed_events,
    percentile,
    result,
    say,
    settle,
    size,
    sqlite_url,
    workdir,
)
from ledger.events import Event
from ledger.store import Store
from ledger.vault import FileKeyStore
from projections import reads
from projections.runner import Runner
from projections.views import MemoryProjection, TaskProjection

ROUNDS = 3


def _store(path: Path, on: bool) -> Store:
    return Store(sqlite_url(path), register_path=str(path) + ".forgets",
                 vault=FileKeyStore(str(path) + ".vault") if on else False)


async def _append(path: Path, events: list[Event], on: bool, batch: int
                  ) -> tuple[float, float]:
    """Events per second (wall clock) and this process's CPU microseconds per event."""
    store = _store(path, on)
    await store.open()
    try:
        cpu = time.process_time()
        with Clock() as c:
            for i in range(0, len(events), batch):
                await store.append(events[i:i + batch])
        cpu = time.process_time() - cpu
    finally:
        await store.close()
    return len(events) / c.seconds, cpu * 1e6 / len(events)


async def _project(path: Path, on: bool) -> tuple[float, float]:
    """Events per second (wall clock) and CPU microseconds per event."""
    store = _store(path, on)
    try:
        n = await store.head()
        cpu = time.process_time()
        with Clock() as c:
            await Runner(store, [MemoryProjection(), TaskProjection()]).catch_up()
        cpu = time.process_time() - cpu
    finally:
        await store.close()
    return n / c.seconds, cpu * 1e6 / n


async def _gets(path: Path, on: bool, keys: list[tuple[str, str, list[str], str]],
                sdk: bool) -> list[float]:
    store = _store(path, on)
    now = int(time.time() * 1e6)
    samples: list[float] = []
    try:
        async with store.read() as conn:
            for tenant, user, ns, key in keys[:200]:  # warm-up
                await reads.get(conn, reads.Principal(tenant, user), ns, key, now_us=now)
            for tenant, user, ns, key in keys:
                who = reads.Principal(tenant, user)
                t0 = time.perf_counter()
                if sdk:  # as `Ledger.get` does: a point read where it can
                    got = reads.get_now(store, who, ns, key, now_us=now) or \
                        await reads.get(conn, who, ns, key, now_us=now)
                else:
                    got = await reads.get(conn, who, ns, key, now_us=now)
                samples.append((time.perf_counter() - t0) * 1e6)
                assert got["found"], "bench get missed"
    finally:
        await store.close()
    return samples


async def run() -> list[dict[str, Any]]:
    """The vault's figures beside the same work without it."""
    n = size(20_000, 2_000)
    events = mixed_events(n)
    small = events[: size(4_000, 500)]
    rates: dict[str, dict[bool, list[float]]] = {
        k: {True: [], False: []} for k in ("append1000", "append10", "projection",
                                          "cpu_append1000", "cpu_projection")}
    gets: dict[bool, list[float]] = {True: [], False: []}
    point_gets: dict[bool, list[float]] = {True: [], False: []}
    writes = [e for e in events if e.type == "memory.written"]
    rng = random.Random(5)
    picks = [(e.tenant, e.data["namespace"][1], list(e.data["namespace"]), e.data["key"])
             for e in rng.sample(writes, min(len(writes), size(5_000, 500)))]
    with workdir("vault") as d:
        for r in range(ROUNDS):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                tag = f"{'v' if on else 'p'}{r}"
                say(f"round {r + 1}/{ROUNDS}, vault {'on' if on else 'off'}")
                settle()
                rate, cpu = await _append(d / f"{tag}.db", events, on, 1000)
                rates["append1000"][on].append(rate)
                rates["cpu_append1000"][on].append(cpu)
                settle()
                rates["append10"][on].append((await _append(d / f"{tag}s.db", small, on,
                                                            10))[0])
                settle()
                rate, cpu = await _project(d / f"{tag}.db", on)
                rates["projection"][on].append(rate)
                rates["cpu_projection"][on].append(cpu)
                gets[on].extend(await _gets(d / f"{tag}.db", on, picks, sdk=False))
                point_gets[on].extend(await _gets(d / f"{tag}.db", on, picks, sdk=True))
    med = {k: {on: statistics.median(v[on]) for on in (True, False)}
           for k, v in rates.items()}
    out = [
        result("vault append, calls of 1,000", med["append1000"][True], "events/s",
               med["append1000"][False],
               note=f"{n:,} mixed events; baseline: the same appends without the vault; "
                    f"median of {ROUNDS}; target >= 0.8x"),
        result("vault append, calls of 10", med["append10"][True], "events/s",
               med["append10"][False],
               note=f"{len(small):,} events; keys from the pool (one key-store fsync "
                    "per pool, not per group commit); target >= 0.8x"),
        result("vault projection (memories + tasks)", med["projection"][True], "events/s",
               med["projection"][False],
               note="Runner.catch_up(); baseline without the vault; target >= 0.8x"),
    ]
    out += [
        result("vault append CPU, calls of 1,000", med["cpu_append1000"][True], "us/event",
               med["cpu_append1000"][False],
               note="this process's CPU time (both threads) per event: less noisy than "
                    "the rate under load; baseline without the vault"),
        result("vault projection CPU", med["cpu_projection"][True], "us/event",
               med["cpu_projection"][False], note="CPU time per event; baseline without "
                                                  "the vault"),
    ]
    for label, samples in (("get", gets), ("SDK get (point read)", point_gets)):
        for p in (50, 99):
            out.append(result(f"vault {label} p{p}", percentile(samples[True], p), "us",
                              percentile(samples[False], p),
                              note=f"{len(samples[True]):,} lookups; baseline without the "
                                   "vault"))
    return out


if __name__ == "__main__":
    sys.exit(main(run))
