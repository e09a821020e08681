"""Recall latency and embedder throughput, beside raw sqlite3 + numpy in the same run.

Two SQLite ledgers of 100k long-term memories (bilingual texts from the recall fixture,
each made unique): one spread over 1,000 users of a tenant, one all of a single user.
Each is appended, projected (the vectors projection embeds every memory) and then
queried with the fixture's queries through the whole pipeline: `recall()` in process,
with its principal-scoped matrix cache warm, the re-check against the active view, the
ranking, the task look-up and the audit record it writes.

Baseline: raw `sqlite3` + numpy doing the same filtered brute-force search per query
(embed the query, select the principal's vectors by tenant and namespace range, one
matrix product, top 5, fetch those rows' values), with no cache, as a script would.
Targets: warm p99 < 30 ms (issue 18) and < 15 ms (issue 20) for 100k memories of one
user; the first recall of that user in a
process that never loaded it p50 < 100 ms (issue 20), measured three ways
(`projections.matrix_snapshot`): after `project` (a new process; the snapshot the
projection side wrote after its catch-up, `index_cache.write_snapshots`: the normal
case), with no snapshot file at all (deleted, snapshots off: the vectors read from the
database), and after a restart with the snapshot a recall wrote.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import sqlite3
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    BASE_US,
    Clock,
    at,
    env_set,
    main,
    no_gc,
    percentile,
    result,
    say,
    size,
    sqlite_url,
    workdir,
)
from ledger.events import Event, Source, derive_memory_id, ns_path
from ledger.store import Store
from ledger.validation import parse_event
from projections import matrix_snapshot
from projections.embedding import Embedder
from projections.index_cache import CACHE
from projections.recall import recall
from projections.runner import Runner
from projections.vectors import current_embedder

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "recall_fixture.json"
TENANT = "shop-a"
NOW_US = BASE_US + 400 * 86_400 * 1_000_000


@cache
def fixture() -> dict[str, Any]:
    """The bilingual recall fixture: memory texts and user queries."""
    with FIXTURE.open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def memories(n: int, users: int, seed: int) -> list[Event]:
    """`n` explicit long-term memories over `users` users, texts from the fixture."""
    rng = random.Random(seed)
    base = fixture()["memories"]
    out: list[Event] = []
    for i in range(n):
        m = base[rng.randrange(len(base))]
        user = f"u{i % users}"
        idem = f"r{i}"
        text = f"{m['text']} #{i}"
        data = {"namespace": [TENANT, user, "preferences"], "key": f"{m['key']}_{i}",
                "value": m["value"], "layer": "long",
                "memory_id": derive_memory_id(TENANT, idem), "text": text}
        ev = Event("memory.written", idem, TENANT, user,
                   Source("explicit_user_request", f"C{user}", at(i), None, None,
                          BASE_US + i * 1_000_000), data)
        if i % 500 == 0 and parse_event(ev.to_wire()) != ev:
            raise AssertionError(f"bench event {idem} differs from its validated form")
        out.append(ev)
    return out


async def build(path: Path, events: Sequence[Event]) -> tuple[Store, float]:
    """Append the events, then project every view; returns the store and projection
    secs (the snapshot files the catch-up writes in the background not included: see
    `snapshots_written`)."""
    store = Store(sqlite_url(path))
    await store.open()
    for i in range(0, len(events), 1000):
        await store.append(events[i:i + 1000])
    with Clock() as c:
        await Runner(store).catch_up()
    return store, c.seconds


async def snapshots_written(store: Store) -> tuple[float, int]:
    """Wait for the snapshots the projection's catch-up writes in the background:
    (seconds waited, files present)."""
    with Clock() as c:
        await matrix_snapshot.settled()
    return c.seconds, len(matrix_snapshot.all_files(matrix_snapshot.directory(store.url)))


async def restarted_recalls(store: Store, path: Path, asks: Sequence[tuple[str, str]],
                            repeat: int) -> tuple[Store, list[float]]:
    """`repeat` times: a new Store and an empty cache, then the first recall of each
    user. Returns the store now open and the latencies."""
    out: list[float] = []
    for _ in range(repeat):
        await store.close()
        store = Store(sqlite_url(path))
        await store.open()
        CACHE.clear()
        out.extend(await pipeline_latencies(store, asks))
    return store, out


def snapshots_off() -> contextlib.AbstractContextManager[None]:
    """Recall without reading or writing snapshot files (`MEMLEDGER_RECALL_SNAPSHOTS`)."""
    return env_set(matrix_snapshot.ENV, "0")


async def pipeline_latencies(store: Store, asks: Sequence[tuple[str, str]],
                             cpu: list[float] | None = None) -> list[float]:
    """Milliseconds of each `recall()` call, in order; with `cpu`, each call's CPU
    milliseconds (`process_time`: every thread of the process) are appended to it. CPU
    moves much less than wall time with the load of other processes."""
    out = []
    for user, query in asks:
        c0, t0 = time.process_time(), time.perf_counter()
        await recall(store, f"{TENANT}/{user}", query=query, session=None, task=None,
                     budget=None, limit=5, now_us=NOW_US)
        out.append((time.perf_counter() - t0) * 1000)
        if cpu is not None:
            cpu.append((time.process_time() - c0) * 1000)
    return out


def raw_latencies(path: Path, emb: Embedder, asks: Sequence[tuple[str, str]]
                  ) -> tuple[list[float], list[float]]:
    """Raw sqlite3 + numpy per query: (total ms, of which the matrix product + top 5 ms)."""
    total: list[float] = []
    product: list[float] = []
    with contextlib.closing(sqlite3.connect(str(path))) as conn:
        for user, query in asks:
            t0 = time.perf_counter()
            q = emb.embed([query])[0]
            prefix = ns_path([TENANT, user])
            rows = conn.execute(
                "SELECT item_id, vector FROM vectors WHERE tenant = ? AND ns_path >= ? "
                "AND ns_path < ? AND kind = 'memory' AND layer = 'long' AND model = ?",
                (TENANT, prefix, prefix[:-1] + "\x20", emb.name)).fetchall()
            matrix = np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(
                len(rows), emb.dim)
            t1 = time.perf_counter()
            scores = matrix @ q
            k = min(5, len(rows))
            top = np.argpartition(-scores, k - 1)[:k]
            top = top[np.argsort(-scores[top])]
            product.append((time.perf_counter() - t1) * 1000)
            ids = [rows[int(i)][0] for i in top]
            conn.execute(
                f"SELECT memory_id, value FROM mem_versions WHERE tenant = ? AND status = "
                f"'active' AND memory_id IN ({', '.join('?' for _ in ids)})",
                (TENANT, *ids)).fetchall()
            total.append((time.perf_counter() - t0) * 1000)
    return total, product


async def cold_recalls(store: Store, path: Path, asks: Sequence[tuple[str, str]], label: str
                       ) -> tuple[Store, dict[str, list[float]], int]:
    """First recalls of users no cache holds, after a restart each time: with the
    snapshots `project` wrote, with no snapshot file at all (deleted, snapshots off, so
    none is written meanwhile: their vectors read from the database), and with the
    snapshots a recall wrote. One user: five samples of each. Returns the store now
    open, the latency lists by case and the snapshots mapped in the first and last."""
    repeat = 5 if len(asks) == 1 else 1
    mapped = CACHE.snapshot_loads
    say(f"{label}: restart, first recall of {len(asks)} user(s) after project, "
        f"{repeat} time(s)")
    store, after_project = await restarted_recalls(store, path, asks, repeat)
    matrix_snapshot.drop_all(store.url)
    cold: list[float] = []
    with snapshots_off():
        store, cold = await restarted_recalls(store, path, asks, repeat)
    CACHE.clear()
    await pipeline_latencies(store, asks)  # loads again, writes the snapshots
    await matrix_snapshot.settled()
    say(f"{label}: restart, first recall of {len(asks)} user(s) from the snapshot a "
        f"recall wrote, {repeat} time(s)")
    store, restarted = await restarted_recalls(store, path, asks, repeat)
    return store, {"after_project": after_project, "cold": cold, "restarted": restarted}, \
        CACHE.snapshot_loads - mapped


@contextlib.contextmanager
def gc_pauses() -> Iterator[list[tuple[int, float]]]:
    """The garbage collector's runs during the block: (generation, milliseconds) each
    (`gc.callbacks`), to tell its pauses apart from recall's own work in the tail."""
    out: list[tuple[int, float]] = []
    started = [0.0]

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            out.append((int(info["generation"]), (time.perf_counter() - started[0]) * 1000))

    gc.callbacks.append(seen)
    try:
        yield out
    finally:
        gc.callbacks.remove(seen)


def _asks(rng: random.Random, n: int, users: int) -> list[tuple[str, str]]:
    queries = [q["query"] for q in fixture()["queries"]]
    return [(f"u{rng.randrange(users)}", rng.choice(queries)) for _ in range(n)]


async def scenario(d: Path, label: str, n: int, users: int, asks_n: int, raw_n: int
                   ) -> tuple[list[dict[str, Any]], float, int]:
    """Build one ledger, measure the pipeline and the raw baseline on it."""
    emb = current_embedder()
    rng = random.Random(users)
    say(f"{label}: building {n:,} memories over {users:,} user(s)")
    with no_gc():
        events = memories(n, users, seed=users)
    path = d / f"recall-{users}.db"
    store, project_secs = await build(path, events)
    snap_secs, snap_files = await snapshots_written(store)
    out: list[dict[str, Any]] = []
    try:
        cold_users = sorted({f"u{i}" for i in range(min(users, 200))})
        cold_asks = [(u, "reply language") for u in cold_users]
        store, firsts, mapped = await cold_recalls(store, path, cold_asks, label)
        after_project, cold, restarted = (firsts["after_project"], firsts["cold"],
                                          firsts["restarted"])
        loads = CACHE.loads
        if users > len(cold_users):  # warm the remaining users' matrices
            await pipeline_latencies(store, [(f"u{i}", "reply language")
                                             for i in range(len(cold_users), users)])
        asks = _asks(rng, asks_n, users)
        say(f"{label}: {asks_n:,} recalls, warm")
        warm_cpu: list[float] = []
        with gc_pauses() as pauses:
            warm = await pipeline_latencies(store, asks, warm_cpu)
        reloads = CACHE.loads - loads
        say(f"{label}: 20 x (own write, project, recall)")
        patched = []
        for i in range(20):
            ev = memories(1, 1, seed=i)[0]
            data = {**ev.data, "namespace": [TENANT, "u0", "preferences"],
                    "memory_id": derive_memory_id(TENANT, f"p{i}")}
            await store.append_one(replace(ev, idempotency_key=f"p{i}", actor="u0",
                                           data=data))
            await Runner(store).catch_up()
            patched.extend(await pipeline_latencies(store, [("u0", "reply language")]))
    finally:
        await store.close()
    say(f"{label}: raw sqlite3 + numpy, {raw_n} queries")
    raw, product = raw_latencies(path, emb, asks[:raw_n])
    load = os.getloadavg()[0]
    p99 = percentile(warm, 99)
    target = (f"; target p99 < 30 ms: {'met' if p99 < 30 else 'MISSED'}, "
              f"< 15 ms (issue 20): {'met' if p99 < 15 else 'MISSED'}") if users == 1 else ""
    out.append(result(f"recall p50, {n // 1000}k memories / {users:,} user(s)",
                      percentile(warm, 50), "ms", percentile(raw, 50), "ms",
                      f"pipeline incl. re-check + audit write; raw: sqlite3 select + numpy "
                      f"top-5, no cache (its matrix product alone: "
                      f"{percentile(product, 50):.2f} ms)"))
    # A query's first recall in this store reads its lexical matches' row sizes and
    # term counts (cached per store while the index is unchanged): split out, so the
    # two costs are seen apart (they are both in p99).
    seen: set[str] = set()
    is_first: list[bool] = []
    for _, q in asks:
        is_first.append(q not in seen)
        seen.add(q)
    first_ms = [w for w, f in zip(warm, is_first, strict=True) if f]
    again_ms = [w for w, f in zip(warm, is_first, strict=True) if not f]
    first_cpu = [c for c, f in zip(warm_cpu, is_first, strict=True) if f]
    again_cpu = [c for c, f in zip(warm_cpu, is_first, strict=True) if not f]
    split = (f"; {len(first_ms)} of them a query's first in this store: p50 "
             f"{percentile(first_ms, 50):.1f} / p99 {percentile(first_ms, 99):.1f} ms "
             f"(CPU {percentile(first_cpu, 50):.1f} / {percentile(first_cpu, 99):.1f}), the "
             f"other {len(again_ms)}: p50 {percentile(again_ms, 50):.1f} / p99 "
             f"{percentile(again_ms, 99):.1f} ms (CPU {percentile(again_cpu, 50):.1f} / "
             f"{percentile(again_cpu, 99):.1f})" if users == 1 and first_ms and again_ms
             else "")
    full = [ms for gen, ms in pauses if gen == 2]
    collected = (f"; collector during them: {len(pauses)} collections, {len(full)} full"
                 + (f" (longest {max(full):.1f} ms)" if full else ""))
    out.append(result(f"recall p99, {n // 1000}k memories / {users:,} user(s)", p99, "ms",
                      percentile(raw, 99), "ms",
                      f"{len(warm):,} warm recalls{target}; CPU per recall p50 "
                      f"{percentile(warm_cpu, 50):.1f} ms, p99 "
                      f"{percentile(warm_cpu, 99):.1f} ms{split}{collected}; load average "
                      f"{load:.1f} on {os.cpu_count()} CPUs"))
    def cold_target(samples: list[float]) -> str:
        met = "met" if percentile(samples, 50) < 100 else "MISSED"
        return f"; target p50 < 100 ms: {met}" if users == 1 else ""

    out.append(result(f"first recall after project, {users:,} user(s)",
                      percentile(after_project, 50), "ms", percentile(raw, 50), "ms",
                      f"p50 over {len(after_project)} (max {max(after_project):.1f} ms); "
                      f"a new Store and an empty cache; project wrote {snap_files} "
                      f"snapshot(s) in the background in {snap_secs:.1f} s after its "
                      f"catch-up of {project_secs:.1f} s{cold_target(after_project)}"))
    out.append(result(f"first recall of a user, no snapshot file, {users:,} user(s)",
                      percentile(cold, 50), "ms", percentile(raw, 50), "ms",
                      f"p50 over {len(cold)}; files deleted, snapshots off: loads the "
                      f"principal's vectors from the database; load average {load:.1f}"
                      + ("; the case snapshots exist to avoid (the target is for the "
                         "two beside it)" if users == 1 else "")))
    out.append(result(f"first recall after restart (snapshot a recall wrote), "
                      f"{users:,} user(s)",
                      percentile(restarted, 50), "ms", percentile(raw, 50), "ms",
                      f"p50 over {len(restarted)} (max {max(restarted):.1f} ms); a new "
                      f"Store and an empty cache, {mapped} snapshot(s) mapped in all, "
                      f"{reloads} loads after the restarts{cold_target(restarted)}"))
    out.append(result(f"recall after the user's own write, {users:,} user(s)",
                      percentile(patched, 50), "ms", percentile(raw, 50), "ms",
                      f"p50 over 20; the cached matrix is patched, not reloaded "
                      f"(max {max(patched):.1f} ms)"))
    return out, project_secs, n


async def run() -> list[dict[str, Any]]:
    """Recall latency at 1,000 users and at one user, embedder and index throughput."""
    emb = current_embedder()
    n = size(100_000, 2_000)
    out: list[dict[str, Any]] = []
    base = [m["text"] for m in fixture()["memories"]]
    texts = [f"{base[i % len(base)]} #{i}" for i in range(size(20_000, 2_000))]
    emb.embed(texts[:200])
    with Clock() as c:
        emb.embed(texts)
    embed_rate = len(texts) / c.seconds
    out.append(result(f"embed ({emb.name})", embed_rate, "texts/s", None,
                      note=f"{len(texts):,} fixture texts, one batch, one core"))
    with workdir("recall") as d:
        users = size(1000, 50)
        many, secs, count = await scenario(d, f"{users:,} users", n, users,
                                           size(3000, 100), size(300, 30))
        out.extend(many)
        out.append(result("index build (project 100k writes incl. vectors)"
                          if count == 100_000 else f"index build ({count:,} writes)",
                          count / secs, "memories/s", embed_rate, "texts/s",
                          "every projection; baseline: the embedder alone"))
        one, _, _ = await scenario(d, "one user", n, 1, size(500, 60), size(30, 10))
        out.extend(one)
    return out


if __name__ == "__main__":
    sys.exit(main(run))
