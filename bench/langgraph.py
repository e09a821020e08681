"""`memledger.langgraph.MemledgerStore` beside LangGraph's `SqliteStore`, same run.

Both stores get the same items (100k with full sizes: 1,000 namespaces `(user, "prefs")`
x 100 keys; `--quick` 2k) loaded by batches of 1,000 puts, then: a batch put, single puts, get
p50/p99 over random keys, search in one namespace without a query (limit 10) and with
a filter. Search with a query is timed on MemledgerStore only: SqliteStore's vector
search needs the sqlite-vec extension, which this machine does not have.
MemledgerStore writes each put as a `memory.written` event (hash chain, forget
register, projections) and keeps every version; SqliteStore overwrites a row.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from typing import Any

from langgraph.store.base import PutOp
from langgraph.store.sqlite import SqliteStore

from bench.common import main, percentile, result, say, size, workdir
from memledger.langgraph import MemledgerStore

BATCH = 1000
PER_NS = 100


def _embed(texts: list[str]) -> list[list[float]]:
    out = []
    for t in texts:
        v = [0.0] * 16
        for i, c in enumerate(t):
            v[(ord(c) + i) % 16] += 1.0
        out.append(v)
    return out


def _timed(fn: Callable[[], Any], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return samples


def _exercise(store: Any, n: int, rng: random.Random) -> dict[str, float]:
    users = n // PER_NS
    t0 = time.perf_counter()
    for b in range(0, n, BATCH):
        store.batch([PutOp((f"u{i // PER_NS}", "prefs"), f"k{i % PER_NS}",
                           {"i": i, "text": f"v{i}"}) for i in range(b, min(b + BATCH, n))])
    load_s = time.perf_counter() - t0
    out: dict[str, float] = {"load_items_s": n / load_s}
    ops = [PutOp((f"b{j // PER_NS}", "prefs"), f"k{j}", {"j": j}) for j in range(BATCH)]
    t0 = time.perf_counter()
    store.batch(ops)
    out["batch_put"] = BATCH / (time.perf_counter() - t0)
    puts = _timed(lambda: store.put(("single", "prefs"), f"p{rng.randrange(10**6)}", {"x": 1}),
                  200)
    out["put"] = 1e6 / (sum(puts) / len(puts))
    gets = _timed(lambda: store.get((f"u{rng.randrange(users)}", "prefs"),
                                    f"k{rng.randrange(PER_NS)}"), 1000)
    out["get_p50"], out["get_p99"] = percentile(gets, 50), percentile(gets, 99)
    srch = _timed(lambda: store.search((f"u{rng.randrange(users)}", "prefs"), limit=10), 200)
    out["search"] = percentile(srch, 50)
    filt = _timed(lambda: store.search((f"u{rng.randrange(users)}", "prefs"),
                                       filter={"i": {"$gte": 0}}, limit=10), 200)
    out["search_filter"] = percentile(filt, 50)
    return out


async def run() -> list[dict[str, Any]]:
    """The figures, each beside SqliteStore's."""
    n = size(100_000, 2_000)
    with workdir("langgraph") as d:
        say(f"SqliteStore: {n} items")
        with SqliteStore.from_conn_string(str(d / "lg.db")) as lg:
            lg.setup()
            base = _exercise(lg, n, random.Random(5))
        say(f"MemledgerStore: {n} items")
        ml = MemledgerStore(url=f"sqlite+aiosqlite:///{d}/ml.db",
                            index={"dims": 16, "embed": _embed, "fields": ["text"]})
        try:
            ours = _exercise(ml, n, random.Random(5))
            q = _timed(lambda: ml.search(("u1", "prefs"), query="v17", limit=10), 50)
        finally:
            ml.close()
    return [
        result("langgraph load (batches of 1,000)", ours["load_items_s"], "items/s",
               base["load_items_s"]),
        result("langgraph put", ours["put"], "puts/s", base["put"]),
        result("langgraph batch put", ours["batch_put"], "items/s", base["batch_put"]),
        result("langgraph get p50", ours["get_p50"], "us", base["get_p50"]),
        result("langgraph get p99", ours["get_p99"], "us", base["get_p99"]),
        result("langgraph search, no query (p50)", ours["search"], "us", base["search"]),
        result("langgraph search, filter (p50)", ours["search_filter"], "us",
               base["search_filter"]),
        result("langgraph search, query (p50)", percentile(q, 50), "us", None,
               note="SqliteStore needs sqlite-vec for this"),
    ]


if __name__ == "__main__":
    sys.exit(main(run))
