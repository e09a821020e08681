"""Warm recall latency on a ledger built once, for same-run A/B comparisons between
two checkouts (or between the lexical arm's two rankings, `MEMLEDGER_LEXICAL_IN_PROCESS`).

    python -m bench.recall_ab build LEDGER          # 100k memories of one user (bench.recall)
    python -m bench.recall_ab run LEDGER [N] [inline] [mixed]  # N warm recalls, JSON on stdout

`run` opens the ledger, recalls once to map the principal's index (from the snapshot
the build's projection wrote), then asks every fixture query once (timed apart as
`first_ms`: each query's first time in the process, what a recall pays after a write
to the index empties the caches of term counts and row sizes), then makes `N` recalls
(default 500) with the fixture's queries drawn as `bench.recall` draws them, and prints
the wall and CPU milliseconds of each. Run it alternately from each checkout against the same file,
so both see the same load. `inline`: the store's write transactions (the recall's audit)
on its inline thread (`Store.use_inline`), as `MemoryLedger` opens a SQLite file; without
it the audit goes through the async driver, as in `bench.recall`. `mixed`: no query is
asked before the `N` recalls, so each query's first recall is among them (`first` marks
which), as in `bench.recall`'s warm recalls after its restarts. `gc` lists the garbage
collector's runs during the `N` recalls: (recall number, generation, milliseconds).
The script only uses
what both checkouts have, so `python bench/recall_ab.py` of one checkout can run with the
other's code on the import path (`PYTHONPATH`).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import orjson

from bench import recall as br
from bench.common import sqlite_url
from ledger.store import Store
from projections import matrix_snapshot
from projections.recall import recall


async def build(path: Path) -> None:
    store, secs = await br.build(path, br.memories(100_000, 1, seed=1))
    await matrix_snapshot.settled()
    await store.close()
    print(orjson.dumps({"built": str(path), "project_secs": secs}).decode())


async def run(path: Path, n: int, inline: bool = False, mixed: bool = False) -> None:
    store = Store(sqlite_url(path))
    await store.open()
    if inline:
        store.use_inline()
    try:
        asks = br._asks(random.Random(1), n, 1)
        await recall(store, f"{br.TENANT}/u0", query="reply language", session=None,
                     task=None, budget=None, limit=5, now_us=br.NOW_US)
        first: list[float] = []
        for query in () if mixed else dict.fromkeys(q["query"] for q in br.fixture()["queries"]):
            t0 = time.perf_counter()
            await recall(store, f"{br.TENANT}/u0", query=query, session=None,
                         task=None, budget=None, limit=5, now_us=br.NOW_US)
            first.append((time.perf_counter() - t0) * 1000)
        wall: list[float] = []
        cpu: list[float] = []
        firsts: list[bool] = []
        seen: set[str] = set()
        collections: list[tuple[int, int, float]] = []
        with br.gc_pauses() as pauses:
            for user, query in asks:
                c0, t0 = time.process_time(), time.perf_counter()
                await recall(store, f"{br.TENANT}/{user}", query=query, session=None,
                             task=None, budget=None, limit=5, now_us=br.NOW_US)
                wall.append((time.perf_counter() - t0) * 1000)
                cpu.append((time.process_time() - c0) * 1000)
                firsts.append(mixed and query not in seen)
                seen.add(query)
                collections.extend((len(wall) - 1, gen, ms) for gen, ms in pauses)
                pauses.clear()
    finally:
        await store.close()
    print(orjson.dumps({"wall_ms": wall, "cpu_ms": cpu, "first_ms": first, "first": firsts,
                        "gc": collections}).decode())


if __name__ == "__main__":
    what, where = sys.argv[1], Path(sys.argv[2])
    if what == "build":
        asyncio.run(build(where))
    else:
        asyncio.run(run(where, int(sys.argv[3]) if len(sys.argv) > 3 else 500,
                        "inline" in sys.argv[4:], "mixed" in sys.argv[4:]))
