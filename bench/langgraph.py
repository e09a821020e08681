"""`memledger.langgraph.MemledgerStore` beside LangGraph's `SqliteStore`, same run.

Both stores get the same items (100k with full sizes: 1,000 namespaces `(user, "prefs")`
x 100 keys; `--quick` 1k) loaded by batches of 1,000 puts. Then, in rounds that run each
store in turn on the same keys (so a change in the shared machine's load falls on both
alike): single puts, a batch put of 1,000 items, get p50/p99 over random keys, search
in one namespace without a query (limit 10) and with a filter. Search with a query is
timed beside LangGraph's `InMemoryStore` holding the same items with the same
embedding function: `SqliteStore`'s vector search needs the sqlite-vec extension, which
this machine's Python cannot load.

MemledgerStore writes each put as a `memory.written` event (hash chain, forget
register, projections) and keeps every version; SqliteStore overwrites a row.

Every write figure is billed to the moment the last item written is readable: a
MemledgerStore put returns once its event is durable in the ledger and leaves the
views' projection round to the background (docs/langgraph.md), so each timed phase of
puts, the batch put and the load ends with a `get` of its last item, which waits for
that round; `SqliteStore` gets the same final `get`. The put rate is the puts of a
phase over its wall time, final get included.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from typing import Any

from langgraph.store.base import PutOp
from langgraph.store.memory import InMemoryStore
from langgraph.store.sqlite import SqliteStore

from bench.common import main, percentile, result, say, settle, size, workdir
from memledger.langgraph import MemledgerStore

BATCH = 1000
PER_NS = 100
ROUNDS = 10


def _embed(texts: list[str]) -> list[list[float]]:
    out = []
    for t in texts:
        v = [0.0] * 16
        for i, c in enumerate(t):
            v[(ord(c) + i) % 16] += 1.0
        out.append(v)
    return out


def _timed(fn: Callable[[int], Any], n: int, out: list[float], start: int = 0) -> None:
    for i in range(start, start + n):
        t0 = time.perf_counter_ns()
        fn(i)
        out.append((time.perf_counter_ns() - t0) / 1000)


def _readable(store: Any, namespace: tuple[str, ...], key: str) -> None:
    """The end of a timed write phase: the last item written, read back (a
    MemledgerStore read waits for the projection round its puts left running)."""
    if store.get(namespace, key) is None:
        raise AssertionError(f"{key!r} written but not readable")


def _load(store: Any, n: int) -> float:
    t0 = time.perf_counter()
    for b in range(0, n, BATCH):
        store.batch([PutOp((f"u{i // PER_NS}", "prefs"), f"k{i % PER_NS}",
                           {"i": i, "text": f"v{i}"}) for i in range(b, min(b + BATCH, n))])
    last = n - 1
    _readable(store, (f"u{last // PER_NS}", "prefs"), f"k{last % PER_NS}")
    return n / (time.perf_counter() - t0)


def _puts(store: Any, start: int, n: int) -> float:
    """`n` single puts and the read of the last: their wall time in seconds."""
    t0 = time.perf_counter()
    for i in range(start, start + n):
        store.put(("single", "prefs"), f"p{i}", {"x": i})
    _readable(store, ("single", "prefs"), f"p{start + n - 1}")
    return time.perf_counter() - t0


def _batch_put(store: Any, tag: str) -> float:
    ops = [PutOp((f"b{tag}{j // PER_NS}", "prefs"), f"k{j}", {"j": j}) for j in range(BATCH)]
    t0 = time.perf_counter()
    store.batch(ops)
    _readable(store, ops[-1].namespace, ops[-1].key)
    return BATCH / (time.perf_counter() - t0)


async def run() -> list[dict[str, Any]]:
    """The figures, each beside LangGraph's in the same run."""
    n = size(100_000, 1_000)
    users = n // PER_NS
    gets, searches, puts = size(5_000, 500), size(1_000, 100), size(300, 30)
    rng = random.Random(5)
    keys = [(f"u{rng.randrange(users)}", f"k{rng.randrange(PER_NS)}") for _ in range(gets)]
    spaces = [f"u{rng.randrange(users)}" for _ in range(searches)]
    kinds = ("ml", "lg")
    t: dict[str, dict[str, list[float]]] = {k: {m: [] for m in (
        "get", "search", "filter")} for k in kinds}
    put_s: dict[str, float] = dict.fromkeys(kinds, 0.0)
    with workdir("langgraph") as d:
        lg_cm = SqliteStore.from_conn_string(str(d / "lg.db"))
        lg = lg_cm.__enter__()
        ml = MemledgerStore(url=f"sqlite+aiosqlite:///{d}/ml.db",
                            index={"dims": 16, "embed": _embed, "fields": ["text"]})
        try:
            lg.setup()
            ml.setup()
            say(f"loading {n:,} items into each store")
            load = {"lg": _load(lg, n), "ml": _load(ml, n)}
            stores = {"ml": ml, "lg": lg}
            bput: dict[str, list[float]] = {k: [] for k in kinds}
            settle()
            say(f"timing in {ROUNDS} rounds: puts, batch puts, gets, searches")
            for r in range(ROUNDS):
                for k in kinds:
                    s = stores[k]
                    per = puts // ROUNDS
                    put_s[k] += _puts(s, r * per, per)
                    bput[k].append(_batch_put(s, str(r)))
                    g = gets // ROUNDS
                    _timed(lambda i, s=s: s.get((keys[i][0], "prefs"), keys[i][1]), g,
                           t[k]["get"], r * g)
                    q = searches // ROUNDS
                    _timed(lambda i, s=s: s.search((spaces[i], "prefs"), limit=10), q,
                           t[k]["search"], r * q)
                    _timed(lambda i, s=s: s.search((spaces[i], "prefs"),
                                                   filter={"i": {"$gte": 0}}, limit=10),
                           q, t[k]["filter"], r * q)
            say("search with a query, beside InMemoryStore holding the same items")
            mem = InMemoryStore(index={"dims": 16, "embed": _embed, "fields": ["text"]})
            _load(mem, n)
            query: dict[str, list[float]] = {"ml": [], "mem": []}
            nq = size(200, 50)
            for r in range(ROUNDS):
                for k, s in (("ml", ml), ("mem", mem)):
                    per = nq // ROUNDS
                    _timed(lambda i, s=s: s.search((spaces[i], "prefs"), query="v17",
                                                   limit=10), per, query[k], r * per)
        finally:
            ml.close()
            lg_cm.__exit__(None, None, None)

    def p(k: str, m: str, q: float) -> float:
        return percentile(t[k][m], q)

    def put_rate(k: str) -> float:
        return (puts // ROUNDS) * ROUNDS / put_s[k]

    def within(ours: float, base: float, rate: bool) -> str:
        ok = ours >= base / 2 if rate else ours <= 2 * base
        return f"target within 2x: {'met' if ok else 'MISSED'}"

    batch = {k: sum(bput[k]) / len(bput[k]) for k in kinds}
    rows = [
        result("langgraph load (batches of 1,000)", load["ml"], "items/s", load["lg"]),
        result("langgraph put", put_rate("ml"), "puts/s", put_rate("lg"),
               note=within(put_rate("ml"), put_rate("lg"), True)),
        result("langgraph batch put", batch["ml"], "items/s", batch["lg"],
               note=within(batch["ml"], batch["lg"], True)),
    ]
    for m, label in (("get", "get"), ("search", "search, no query, limit 10"),
                     ("filter", "search, filter, limit 10")):
        for q in (50, 99):
            ours, base = p("ml", m, q), p("lg", m, q)
            rows.append(result(f"langgraph {label} p{q}", ours, "us", base,
                               note=within(ours, base, False)))
    for q in (50, 99):
        ours, base = percentile(query["ml"], q), percentile(query["mem"], q)
        rows.append(result(f"langgraph search, query p{q}", ours, "us", base,
                           note="baseline: LangGraph InMemoryStore (SqliteStore needs "
                                f"sqlite-vec); {within(ours, base, False)}"))
    return rows


if __name__ == "__main__":
    sys.exit(main(run))
