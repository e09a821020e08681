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

The batch put's floors, beside it in the same rounds: raw `sqlite3` writing exactly the
event rows MemledgerStore's batch put of that round wrote (read back from its file: the
same columns, sizes and sealed payloads), by one `executemany` in one transaction (WAL,
synchronous=NORMAL, no automatic checkpoints), into a table holding the load's event
rows: with the position as its only key (the least an event-sourced store that keeps an
immutable event per put must write), and with the ledger's keys and indexes. No
validation, no hash chain, no view rows. If the first is itself below half of
`SqliteStore`'s batch put, "within 2x" cannot be met by such a store.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import sys
import time
from collections.abc import Callable
from typing import Any

from langgraph.store.base import PutOp
from langgraph.store.memory import InMemoryStore
from langgraph.store.sqlite import SqliteStore

from bench.common import (
    create_like,
    main,
    percentile,
    raw_connect,
    result,
    say,
    settle,
    size,
    workdir,
)
from ledger import schema as tables
from memledger.langgraph import MemledgerStore

BATCH = 1000
PER_NS = 100
ROUNDS = 10
#: the batch put's floors: raw sqlite3 writing its event rows to a table keyed by
#: position alone ("bare") and to one with the ledger's keys and indexes ("ix")
FLOORS = ("bare", "ix")
EVENT_COLUMNS = [c.name for c in tables.events.columns]
INSERT_EVENTS = (f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) "
                 f"VALUES ({', '.join('?' for _ in EVENT_COLUMNS)})")


def _embed(texts: list[str]) -> list[list[float]]:
    out = []
    for t in texts:
        v = [0.0] * 16
        for i, c in enumerate(t):
            v[(ord(c) + i) % 16] += 1.0
        out.append(v)
    return out


def _mb(path: Any) -> float:
    """A file's size in MB (0 if it does not exist)."""
    return path.stat().st_size / 1e6 if path.exists() else 0.0


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


def _head(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT coalesce(max(position), 0) FROM events").fetchone()[0])


def _event_rows(conn: sqlite3.Connection, lo: int, hi: int) -> list[tuple[Any, ...]]:
    """The `events` rows the ledger wrote at positions (lo, hi], as insertable tuples."""
    return conn.execute(f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE position > ? "
                        "AND position <= ? ORDER BY position", (lo, hi)).fetchall()


def _floor_table(stack: contextlib.ExitStack, path: Any, rows: list[tuple[Any, ...]], *,
                 indexed: bool) -> sqlite3.Connection:
    """A raw connection to a new `events` table holding `rows`: the ledger's table and
    indexes (`indexed`), or its columns with the position as the only key. SQLite's
    automatic WAL checkpoints are off (the ledger runs its own on another thread, so
    none falls inside its commits either)."""
    conn = stack.enter_context(contextlib.closing(raw_connect(path)))
    conn.execute("PRAGMA wal_autocheckpoint=0")
    if indexed:
        create_like(conn, tables.events)
    else:
        conn.execute(f"CREATE TABLE events ({', '.join(EVENT_COLUMNS)}, "
                     "PRIMARY KEY (position))")
    conn.execute("BEGIN")
    conn.executemany(INSERT_EVENTS, rows)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return conn


def _raw_events(conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> float:
    """The floor of a batch put: `rows` written by one executemany in one transaction
    (items/s)."""
    t0 = time.perf_counter()
    conn.execute("BEGIN")
    conn.executemany(INSERT_EVENTS, rows)
    conn.execute("COMMIT")
    return len(rows) / (time.perf_counter() - t0)


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
    with workdir("langgraph") as d, contextlib.ExitStack() as stack:
        lg_cm = SqliteStore.from_conn_string(str(d / "lg.db"))
        lg = lg_cm.__enter__()
        ml = MemledgerStore(url=f"sqlite+aiosqlite:///{d}/ml.db",
                            index={"dims": 16, "embed": _embed, "fields": ["text"]})
        try:
            lg.setup()
            ml.setup()
            say(f"loading {n:,} items into each store")
            load = {"lg": _load(lg, n), "ml": _load(ml, n)}
            # the files right after the load: how far each WAL grew while it ran
            files = {k: (_mb(d / f"{k}.db-wal"), _mb(d / f"{k}.db")) for k in kinds}
            stores = {"ml": ml, "lg": lg}
            bput: dict[str, list[float]] = {k: [] for k in (*kinds, *FLOORS)}
            # the floor's tables, holding the load's event rows: the `events` columns
            # with the position as the only key, and with the ledger's keys and indexes
            ml_file = stack.enter_context(contextlib.closing(sqlite3.connect(d / "ml.db")))
            loaded = _event_rows(ml_file, 0, _head(ml_file))
            raw = {k: _floor_table(stack, d / f"raw-{k}.db", loaded, indexed=k == "ix")
                   for k in FLOORS}
            settle()
            say(f"timing in {ROUNDS} rounds: puts, batch puts, gets, searches")
            for r in range(ROUNDS):
                for k in kinds:
                    s = stores[k]
                    per = puts // ROUNDS
                    put_s[k] += _puts(s, r * per, per)
                    if k == "ml":
                        before = _head(ml_file)
                    bput[k].append(_batch_put(s, str(r)))
                    if k == "ml":
                        written = _event_rows(ml_file, before, _head(ml_file))
                        assert len(written) == BATCH, len(written)
                    g = gets // ROUNDS
                    _timed(lambda i, s=s: s.get((keys[i][0], "prefs"), keys[i][1]), g,
                           t[k]["get"], r * g)
                    q = searches // ROUNDS
                    _timed(lambda i, s=s: s.search((spaces[i], "prefs"), limit=10), q,
                           t[k]["search"], r * q)
                    _timed(lambda i, s=s: s.search((spaces[i], "prefs"),
                                                   filter={"i": {"$gte": 0}}, limit=10),
                           q, t[k]["filter"], r * q)
                for k in FLOORS:
                    bput[k].append(_raw_events(raw[k], written))
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

    batch = {k: sum(bput[k]) / len(bput[k]) for k in bput}
    floor_ok = batch["bare"] >= batch["lg"] / 2
    rows = [
        result("langgraph load (batches of 1,000)", load["ml"], "items/s", load["lg"]),
        result("langgraph WAL file after the load", files["ml"][0], "MB", files["lg"][0],
               note=f"database files {files['ml'][1]:,.0f} / {files['lg'][1]:,.0f} MB; a "
                    "WAL file keeps the largest size it grew to until it starts over"
                    + ("; SqliteStore keeps a rollback journal, no WAL"
                       if not files["lg"][0] else "")),
        result("langgraph put", put_rate("ml"), "puts/s", put_rate("lg"),
               note=within(put_rate("ml"), put_rate("lg"), True)),
        result("langgraph batch put", batch["ml"], "items/s", batch["lg"],
               note=within(batch["ml"], batch["lg"], True)
               + f"; {batch['ml'] / batch['ix']:.2f}x of the floor with the ledger's "
                 f"indexes, {batch['ml'] / batch['bare']:.2f}x of the bare floor"),
        result("langgraph batch put floor: raw sqlite3, its event rows, position key only",
               batch["bare"], "items/s", batch["lg"],
               note="executemany of the batch's event rows in one transaction, no rules, "
                    "no views; within 2x of SqliteStore for a store writing an event per "
                    "put: " + ("possible" if floor_ok else "NOT possible (this floor is "
                                                           "below 0.5x)")),
        result("langgraph batch put floor: the same, the ledger's keys and indexes",
               batch["ix"], "items/s", batch["lg"],
               note="the events table as memledger's schema declares it"),
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
