"""Rebuild throughput and peak memory on SQLite (`memledger replay rebuild`).

For a ledger of 100k and of 1M events (`bench.common.mixed_events`: new memories,
corrections, task events; appended through `Store.append` in batches), each size:

- `replay.rebuild.rebuild` resets every view and replays it (reapplying the forget
  register first) in a child process, which reports its wall time, per-projection
  times and its own peak RSS (`VmHWM`): measured apart from the parent, which holds the
  generated events. The ledger is not projected beforehand (projecting 1M events
  once more would double the run): the rebuild does the same replay either way, only
  the DELETE of existing view rows is left out;
- the baseline, in the same run on the same file: raw `sqlite3` scanning the same
  event rows in position order (`fetchmany(1000)`) and decoding every payload with
  orjson, the floor any replay pays (target: rebuild >= 0.3x);
- peak RSS at 1M beside peak RSS at 100k: a streaming rebuild keeps it flat (ratio ~1).

`--quick` uses 10k and 30k events.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from bench.common import (
    Clock,
    main,
    mixed_ledger,
    raw_connect,
    result,
    say,
    size,
    sqlite_url,
    workdir,
)

CHILD_FLAG = "--child"


def raw_scan(db: Path) -> tuple[int, float]:
    """Raw sqlite3: every event row in position order, payloads decoded; (rows, s)."""
    with contextlib.closing(raw_connect(db)) as conn:
        cur = conn.execute(
            "SELECT position, tenant, idempotency_key, type, actor, source_kind, source_id, "
            "source_at, source_seq, source_event_id, order_key, slot, memory_id, ns_path, "
            "mkey, layer, task_key, supersedes, payload, content_digest, chain, recorded_at, "
            "suppressed, redacted FROM events ORDER BY position")
        n = 0
        with Clock() as c:
            while True:
                rows = cur.fetchmany(1000)
                if not rows:
                    break
                for r in rows:
                    if r[18] is not None:
                        orjson.loads(r[18])
                n += len(rows)
    return n, c.seconds


def peak_rss_kb() -> int:
    """This process's peak resident set (VmHWM), in KiB.

    Not `ru_maxrss`: Linux carries that over from the parent across fork and exec, so a
    child started by a big parent would report the parent's peak.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


async def _child(db: Path) -> dict[str, Any]:
    """Run in the child process: rebuild every view, report times and peak RSS.

    The views are rebuilt in two calls (memories, tasks and erasure; then vectors) so
    the peak of the first part is known apart from the embedder's caches, which are
    bounded (LRU) but take a few tens of MB once the vocabulary is large.
    """
    from ledger.logs import configure
    from ledger.store import Store
    from replay.rebuild import rebuild

    configure()
    start_rss = peak_rss_kb()
    store = Store(sqlite_url(db))
    per: dict[str, float] = {}
    try:
        started = time.perf_counter()
        res = await rebuild(store, ["memories", "tasks", "erasure"], progress=False)
        per.update({k: v["seconds"] for k, v in res["projections"].items()})
        core_rss = peak_rss_kb()
        res2 = await rebuild(store, ["vectors"], progress=False)
        per.update({k: v["seconds"] for k, v in res2["projections"].items()})
        seconds = time.perf_counter() - started
    finally:
        await store.close()
    return {"seconds": seconds, "head": res["head"], "projections": per,
            "start_rss_kb": start_rss, "core_rss_kb": core_rss, "peak_rss_kb": peak_rss_kb()}


def rebuild_in_child(db: Path) -> dict[str, Any]:
    """Rebuild in a fresh interpreter; returns what the child measured."""
    env = {**os.environ, "MEMLEDGER_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-m", "bench.rebuild", CHILD_FLAG, str(db)],
                          capture_output=True, env=env, check=False, timeout=6 * 3600)
    if proc.returncode != 0:
        raise RuntimeError(f"rebuild child failed: {proc.stderr.decode()[-2000:]}")
    out: dict[str, Any] = orjson.loads(proc.stdout.splitlines()[-1])
    return out


async def run() -> list[dict[str, Any]]:
    """Rebuild throughput beside a raw scan, and peak RSS, at two ledger sizes."""
    sizes = (size(100_000, 10_000), size(1_000_000, 30_000))
    results: list[dict[str, Any]] = []
    peaks: dict[int, tuple[float, float]] = {}
    for n in sizes:
        with workdir("rebuild") as d:
            db = d / "ledger.db"
            started = time.perf_counter()
            await mixed_ledger(db, n)
            say(f"{n:,} events ready in {time.perf_counter() - started:.0f} s; "
                "raw scan, then rebuild in a child process")
            rows, raw_s = raw_scan(db)
            child = rebuild_in_child(db)
            rows2, raw_s2 = raw_scan(db)  # once more after, against a warm or cold cache
            raw_rate = max(rows / raw_s, rows2 / raw_s2)
        rate = child["head"] / child["seconds"]
        per = ", ".join(f"{k} {child['head'] / s:,.0f}/s" for k, s in
                        child["projections"].items() if s > 0)
        results.append(result(f"rebuild {n:,} events (all views)", rate, "events/s",
                              raw_rate, "rows/s",
                              note=f"raw = sqlite3 scan + orjson decode; per view: {per}"))
        peaks[n] = (child["core_rss_kb"] / 1024, child["peak_rss_kb"] / 1024)
        say(f"{n:,}: rebuild {child['seconds']:.1f} s, peak RSS {peaks[n][1]:.0f} MB "
            f"({peaks[n][0]:.0f} MB before vectors, {child['start_rss_kb'] / 1024:.0f} MB "
            "at start)")
    small, large = sizes
    for i, what in enumerate(("memories, tasks, erasure", "all views")):
        results.append(result(f"rebuild peak RSS at {small:,} events ({what})",
                              peaks[small][i], "MB", None, note="child process VmHWM"))
        results.append(result(f"rebuild peak RSS at {large:,} events ({what})",
                              peaks[large][i], "MB", peaks[small][i],
                              note=f"baseline = peak at {small:,}; ratio ~1 = flat"))
    return results


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == CHILD_FLAG:
        print(orjson.dumps(asyncio.run(_child(Path(sys.argv[2])))).decode())
        sys.exit(0)
    sys.exit(main(run))
