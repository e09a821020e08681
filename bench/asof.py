"""As-of reads (`projections.asof`): a `get` and a `recall` of one user's memory as it was
at a past instant, beside the same reads of the present in the same run.

The ledger: user u7 with 10,000 events in its history (500 keys, each written once and
corrected 19 times, source times spread over the history, then 25 of the keys forgotten,
so redaction runs too), among 10,000 writes of 100 other users of the same tenant. All
projected, the history view (`mem_history`) included. Then, one by one, at random
instants (a random `position:N`, or a random recording time: one in three):

- `Principal.get(key, as_of=...)` of a random key: one statement over `mem_history`
  (the instant, the key's rows valid then, forgets not applied yet);
- `Principal.recall(query, as_of=...)`: the user's rows valid at the instant with their
  stored embeddings, ranked and fitted (and the as-of tasks, and the audit record);
- baselines in the same run: the live `Principal.get` / `Principal.recall` of the same
  key / query; the same as-of reads *replayed* from the ledger (what every as-of read
  did before the history view, and still does past the view's checkpoint), on fewer
  calls; and raw sqlite3 reading the key's write events up to the position.

Targets: as-of get p99 < 20 ms; as-of recall p99 < 200 ms.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bench.common import (
    at,
    load_ledger,
    main,
    memory_write,
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
from ledger import builders
from ledger.builders import Source
from ledger.events import Event, derive_memory_id, ns_path, slot_id
from ledger.store import Store
from memledger import MemoryLedger
from projections import asof, reads
from projections.runner import Runner

TENANT = "shop-a"
USER = "u7"
KEYS = 500
FORGOTTEN = 25


def history(n: int, seed: int = 23) -> list[Event]:
    """u7's `n` events: `KEYS` keys, each written then corrected, in source order per key
    but interleaved across keys; then forgets of `FORGOTTEN` keys."""
    rng = random.Random(seed)
    per_key = max(1, n // KEYS)
    out: list[Event] = []
    last: dict[str, str] = {}
    for i in range(per_key * KEYS):
        k = f"pref{i % KEYS}"
        idem = f"h{i}"
        value = {"choice": rng.choice(["java", "python", "go", "rust"]), "n": i}
        out.append(memory_write(TENANT, USER, k, value, idem=idem, when=100_000 + i,
                                source_id="C7", supersedes=last.get(k)))
        last[k] = derive_memory_id(TENANT, idem)
    for j in range(FORGOTTEN):
        out.append(builders.forget_key(
            tenant=TENANT, actor=USER, namespace=[TENANT, USER, "preferences"],
            key=f"pref{j * (KEYS // FORGOTTEN)}", idempotency_key=f"f{j}",
            source=Source("explicit_user_request", "C7", at(200_000 + j))))
    return out


async def time_calls(ml: MemoryLedger, calls: Sequence[tuple[str, str | None]], kind: str
                     ) -> list[float]:
    """Milliseconds per SDK call: (key or query, as_of or None for the present)."""
    who = ml.principal(TENANT, USER)
    out: list[float] = []
    for arg, as_of in calls:
        t0 = time.perf_counter_ns()
        if kind == "get":
            await who.get(["preferences"], arg, as_of=as_of)
        else:
            await who.recall(arg, as_of=as_of, limit=10)
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


async def time_replayed(ml: MemoryLedger, calls: Sequence[tuple[str, str]], kind: str
                        ) -> list[float]:
    """Milliseconds per as-of read replayed from the ledger (the stored history not
    used): the baseline the history view replaces."""
    who = reads.Principal(TENANT, USER)
    store = ml.store
    out: list[float] = []
    for arg, as_of in calls:
        t0 = time.perf_counter_ns()
        if kind == "get":
            async with store.read() as conn:
                instant = replace(await asof.resolve(conn, as_of), history_at=0)
                await asof.get(conn, who, [TENANT, USER, "preferences"], arg,
                               instant=instant)
        else:
            await asof.recall(store, f"{TENANT}/{USER}", as_of=as_of, query=arg,
                              session=None, task=None, budget=None, limit=10, now_us=0,
                              stored=False)
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def _clear(payload: Any) -> bool:
    """Whether a stored payload is JSON in clear (not sealed by the vault)."""
    return isinstance(payload, (str, bytes)) and payload[:1] in ("{", b"{")


def time_raw(db: Any, calls: Sequence[tuple[str, int]]) -> list[float]:
    """Raw sqlite3: the key's write events up to the position, payloads decoded where
    they are in clear (a ledger with the vault holds them sealed: raw sqlite3 has no
    key to open them, so it only reads them; the as-of get opens what it returns)."""
    import orjson

    sql = ("SELECT position, order_key, memory_id, supersedes, suppressed, payload "
           "FROM events WHERE slot = ? AND position <= ?")
    out: list[float] = []
    nsp = ns_path([TENANT, USER, "preferences"])
    with contextlib.closing(raw_connect(db)) as conn:
        for key, position in calls:
            t0 = time.perf_counter_ns()
            rows = conn.execute(sql, (slot_id(TENANT, nsp, key, "long", ""), position)
                                ).fetchall()
            _ = [orjson.loads(r[5]) for r in rows if _clear(r[5])]
            out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


async def run() -> list[dict[str, Any]]:
    """p50/p99 of as-of get and recall beside the live reads and raw sqlite3."""
    n = size(10_000, 1_000)
    gets = size(1_000, 100)
    recalls = size(60, 15)
    rng = random.Random(9)
    with no_gc():
        mine = history(n)
        others = simple_writes(n, users=100, tenant=TENANT, seed=4)
    # Interleave the other users' writes with u7's, so u7's history spans the ledger.
    events: list[Event] = [e for pair in zip(mine, others, strict=False) for e in pair]
    events += mine[len(others):] + others[len(mine):]
    out: list[dict[str, Any]] = []
    with workdir("asof") as d:
        db = d / "ledger.db"
        say(f"appending {len(events):,} events ({len(mine):,} in u7's history)")
        await load_ledger(db, events, batch=500)
        store = Store(sqlite_url(db))
        try:
            await Runner(store).catch_up()
            async with store.read() as conn:
                head = await store.head(conn)
                times = [r[0] for r in (await conn.exec_driver_sql(
                    "SELECT recorded_at FROM events ORDER BY position")).all()]
        finally:
            await store.close()

        def instant() -> tuple[str, int]:
            p = rng.randrange(head // 10, head + 1)
            if rng.random() < 1 / 3:
                return times[p - 1], p  # by recording time (a group shares one time)
            return f"position:{p}", p

        keyed = [(f"pref{rng.randrange(KEYS)}", *instant()) for _ in range(gets)]
        queries = [(rng.choice(["pref12", "java", "which language do I prefer",
                                "pref 3 choice"]), instant()[0]) for _ in range(recalls)]
        settle()
        async with MemoryLedger(sqlite_url(db)) as ml:
            say(f"timing {gets:,} as-of gets and {recalls} as-of recalls")
            g_then = await time_calls(ml, [(k, a) for k, a, _ in keyed], "get")
            g_now = await time_calls(ml, [(k, None) for k, _, _ in keyed], "get")
            r_then = await time_calls(ml, queries, "recall")
            r_now = await time_calls(ml, [(q, None) for q, _ in queries], "recall")
            say("timing the same reads replayed from the ledger (fewer calls)")
            g_replay = await time_replayed(ml, [(k, a) for k, a, _ in keyed[:gets // 5]],
                                           "get")
            r_replay = await time_replayed(ml, queries[:max(5, recalls // 6)], "recall")
        raw = time_raw(db, [(k, p) for k, _, p in keyed])

    size_note = f"{len(mine) // 1000}k events in u7's history, {len(events) // 1000}k in all"
    for label, xs, base, replayed, target in (("get", g_then, g_now, g_replay, 20.0),
                                              ("recall", r_then, r_now, r_replay, 200.0)):
        p50, p99 = percentile(xs, 50), percentile(xs, 99)
        out.append(result(f"as-of {label} p50 ({size_note})", p50, "ms",
                          percentile(base, 50), "ms", f"baseline: live {label} p50; "
                          f"replayed p50 {percentile(replayed, 50):.2f} ms "
                          f"({len(replayed)} calls)"
                          + (f"; raw sqlite3 slot read p50 {percentile(raw, 50):.2f} ms"
                             if label == "get" else "")))
        out.append(result(f"as-of {label} p99 ({size_note})", p99, "ms",
                          percentile(base, 99), "ms", f"baseline: live {label} p99; "
                          f"replayed p99 {percentile(replayed, 99):.2f} ms; "
                          f"target p99 < {target:.0f} ms: "
                          f"{'met' if p99 < target else 'MISSED'}"))
    return out


if __name__ == "__main__":
    sys.exit(main(run))
