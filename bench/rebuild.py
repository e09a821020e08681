"""Rebuild throughput and peak memory on SQLite (`memledger replay rebuild`).

For a ledger of 100k and of 1M events (`bench.common.mixed_events`: new memories,
corrections, task events; appended through `Store.append` in batches), each size:

- `replay.rebuild.rebuild` resets every view (memories, tasks, erasure, vectors,
  lexical, history) and replays it (reapplying the forget
  register first) in a child process, which reports its wall time, per-projection
  times and its own peak RSS (`VmHWM`): measured apart from the parent, which holds the
  generated events. The ledger is not projected beforehand (projecting 1M events
  once more would double the run): the rebuild does the same replay either way, only
  the DELETE of existing view rows is left out;
- the baseline, in the same run on the same file: raw `sqlite3` scanning the same
  event rows in position order (`fetchmany(1000)`) and decoding every payload with
  orjson, the floor any replay pays (target: rebuild >= 0.3x), once, before the
  rebuild, while the freshly written file is in the OS cache;
- the vector index apart: most of its time is the embedder's, which a raw scan does
  not do. Its baseline, in the same run on the same file: raw `sqlite3` reading the
  active memories the rebuild indexed, embedding their texts with the same embedder in
  batches of the same size, and inserting the vectors into a copy of the table; a
  rate, so above `RAW_EMBED_ROWS` active memories every k-th row stands for the rest;
- peak RSS at 1M beside peak RSS at 100k: a streaming rebuild keeps it flat (ratio ~1).

`replay rebuild` refills emptied views by bulk loads (`projections.bulk`); the child
passes `--batch-size` as the CLI does by default (`replay.rebuild.REBUILD_BATCH`).

`--quick` uses 3k and 10k events.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import subprocess
import sys
import time
from collections.abc import Callable
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
    vault_off,
    workdir,
)
from ledger import schema as t
from replay.rebuild import REBUILD_BATCH

CHILD_FLAG = "--child"
RAW_FLAG = "--raw"


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


def raw_view(db: Path) -> tuple[int, float]:
    """Raw sqlite3 writing the active-memory view: the same work without the rules.

    Reads every write up to the head in slot order, decodes it, builds its
    `mem_versions` row (each write taken as the one version of its slot: no ranking,
    marks or tombstones) and inserts the rows into a copy of the table in transactions
    of `REBUILD_BATCH`, building the secondary indexes at the end as the bulk load does.
    """
    cols = [c.name for c in t.mem_versions.columns]
    with contextlib.closing(raw_connect(db)) as conn:
        conn.execute("DROP TABLE IF EXISTS raw_mem")
        conn.execute("CREATE TABLE raw_mem AS SELECT * FROM mem_versions WHERE 0")
        conn.execute("CREATE UNIQUE INDEX raw_mem_pk ON raw_mem (tenant, memory_id)")
        conn.commit()
        insert = (f"INSERT INTO raw_mem ({', '.join(cols)}) "
                  f"VALUES ({', '.join('?' for _ in cols)})")
        n = 0
        with Clock() as c:
            cur = conn.execute(
                "SELECT position, tenant, actor, source_kind, source_id, source_at, "
                "order_key, slot, memory_id, ns_path, mkey, layer, task_key, supersedes, "
                "payload FROM events WHERE slot > '' "
                "AND type IN ('memory.written', 'memory.corrected')")
            while True:
                rows = cur.fetchmany(REBUILD_BATCH)
                if not rows:
                    break
                out = []
                for r in rows:
                    d = orjson.loads(r[14])["data"] if r[14] is not None else {}
                    source = orjson.dumps({"kind": r[3], "id": r[4], "at": r[5],
                                           "actor": r[2]}, option=orjson.OPT_SORT_KEYS)
                    value = orjson.dumps(d.get("value"), option=orjson.OPT_SORT_KEYS)
                    out.append((r[1], r[8], r[7], r[9], r[10], r[11] or "long", r[12],
                                d.get("session_id"), r[0], r[6], 1, "active", False, value,
                                d.get("text"), d.get("scope"), r[13], None,
                                d.get("expires_at"), None, r[2], source))
                conn.execute("BEGIN")
                conn.executemany(insert, out)
                conn.commit()
                n += len(out)
            for ix in t.mem_versions.indexes:
                conn.execute(f"CREATE INDEX raw_{ix.name} ON raw_mem "
                             f"({', '.join(c.name for c in ix.columns)})")
            conn.commit()
        conn.execute("DROP TABLE raw_mem")
        conn.commit()
    return n, c.seconds


#: The raw embedder's baseline is a rate (entries/s), nearly all of it the embedder's
#: per-text work: at most this many active memories are embedded for it, every k-th
#: row of the view in row order (at 1M, 1 in 8: about 100 s of a `make bench` less).
RAW_EMBED_ROWS = 100_000


def raw_embed(db: Path) -> tuple[int, float]:
    """Raw sqlite3 + the embedder: index the active memories (every k-th row once there
    are more than `RAW_EMBED_ROWS`) into a scratch table."""
    from projections.embedding import clear_caches
    from projections.vectors import current_embedder, memory_text, to_blob

    clear_caches()  # as cold as the rebuild's child process starts
    emb = current_embedder()
    with contextlib.closing(raw_connect(db)) as conn:
        active = int(conn.execute("SELECT count(*) FROM mem_versions "
                                  "WHERE status = 'active'").fetchone()[0])
        every = max(1, -(-active // RAW_EMBED_ROWS))
        conn.execute("DROP TABLE IF EXISTS raw_vectors")
        conn.execute("CREATE TABLE raw_vectors (tenant TEXT, item_id TEXT, model TEXT, "
                      "dim INTEGER, vector BLOB, PRIMARY KEY (tenant, item_id))")
        cur = conn.execute("SELECT tenant, memory_id, mkey, value, text FROM mem_versions "
                           "WHERE status = 'active' AND rowid % ? = 0", (every,))
        n = 0
        with Clock() as c:
            while True:
                rows = cur.fetchmany(REBUILD_BATCH)
                if not rows:
                    break
                matrix = emb.embed([memory_text(r[2], r[3], r[4]) for r in rows])
                conn.executemany("INSERT INTO raw_vectors VALUES (?, ?, ?, ?, ?)", [
                    (r[0], r[1], emb.name, emb.dim, to_blob(matrix[i]))
                    for i, r in enumerate(rows)])
                n += len(rows)
            conn.commit()
        conn.execute("DROP TABLE raw_vectors")
        conn.commit()
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

    The views are rebuilt in two calls (memories, tasks and erasure; then the views
    read from them: vectors, lexical, history) so the peak of the first part is known
    apart from the embedder's caches, which are bounded (LRU) but take a few tens of
    MB once the vocabulary is large.
    """
    from sqlalchemy import func, select

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
        res2 = await rebuild(store, ["vectors", "lexical", "history"], progress=False)
        per.update({k: v["seconds"] for k, v in res2["projections"].items()})
        seconds = time.perf_counter() - started
        async with store.read() as conn:
            indexed = int((await conn.execute(select(func.count()).select_from(t.vectors))
                           ).scalar_one())
    finally:
        await store.close()
    return {"seconds": seconds, "head": res["head"], "projections": per, "indexed": indexed,
            "start_rss_kb": start_rss, "core_rss_kb": core_rss, "peak_rss_kb": peak_rss_kb()}


RAW: dict[str, Callable[[Path], tuple[int, float]]] = {
    "scan": raw_scan, "view": raw_view, "embed": raw_embed}


def raw_in_child(name: str, db: Path) -> tuple[int, float]:
    """Run a raw baseline in a fresh interpreter, as the rebuild runs: (rows, seconds)."""
    out = _child_run(RAW_FLAG, name, str(db))
    return int(out[0]), float(out[1])


def rebuild_in_child(db: Path) -> dict[str, Any]:
    """Rebuild in a fresh interpreter; returns what the child measured."""
    out: dict[str, Any] = _child_run(CHILD_FLAG, str(db))
    return out


def _child_run(*args: str) -> Any:
    env = {**os.environ, "MEMLEDGER_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-m", "bench.rebuild", *args],
                          capture_output=True, env=env, check=False, timeout=6 * 3600)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed: {proc.stderr.decode()[-2000:]}")
    return orjson.loads(proc.stdout.splitlines()[-1])


async def run() -> list[dict[str, Any]]:
    """Rebuild throughput beside a raw scan, and peak RSS, at two ledger sizes. The
    ledgers have no vault: the raw baseline reads their payloads in clear (`vault_off`)."""
    with vault_off():
        return await _run()


async def _run() -> list[dict[str, Any]]:
    sizes = (size(100_000, 3_000), size(1_000_000, 10_000))
    results: list[dict[str, Any]] = []
    peaks: dict[int, tuple[float, float]] = {}
    for n in sizes:
        with workdir("rebuild") as d:
            db = d / "ledger.db"
            started = time.perf_counter()
            await mixed_ledger(db, n)
            say(f"{n:,} events ready in {time.perf_counter() - started:.0f} s; "
                "raw scan, then rebuild in a child process")
            # Once, right after the file was copied in (its pages are in the OS cache,
            # as warm as the scan gets); a second scan after the rebuild only picked the
            # better of two warm runs (docs/benchmarks.md, "Rebuild of every view at 1M").
            rows, raw_s = raw_in_child("scan", db)
            raw_rate = rows / raw_s
            child = rebuild_in_child(db)
            embedded, embed_s = raw_in_child("embed", db)
            viewed, view_s = raw_in_child("view", db)
        head = child["head"]
        per_s = child["projections"]
        core_s = sum(per_s[k] for k in ("memories", "tasks", "erasure"))
        per = ", ".join(f"{k} {head / v:,.0f}/s" for k, v in per_s.items() if v > 0)
        results.append(result(f"rebuild {n:,} events (memories, tasks, erasure)",
                              head / core_s, "events/s", raw_rate, "rows/s",
                              note=f"raw = sqlite3 scan + orjson decode; per view: {per}"))
        results.append(result(f"rebuild {n:,} events (memories view alone)",
                              head / per_s["memories"], "events/s", head / view_s, "events/s",
                              note=f"raw = sqlite3 writing the {viewed:,} view rows "
                                   "(scan, decode, insert, indexes), no rules"))
        results.append(result(f"rebuild {n:,} events (all views)",
                              head / child["seconds"], "events/s", raw_rate, "rows/s",
                              note="raw = sqlite3 scan + orjson decode"))
        results.append(result(f"rebuild vectors, {n:,} events ({child['indexed']:,} entries)",
                              child["indexed"] / per_s["vectors"], "entries/s",
                              embedded / embed_s, "entries/s",
                              note="raw = sqlite3 read + the same embedder + insert"
                                   f" ({embedded:,} entries: every k-th above "
                                   f"{RAW_EMBED_ROWS:,})"))
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
    if len(sys.argv) == 4 and sys.argv[1] == RAW_FLAG:
        gc.disable()  # as the bulk load holds the collector off during its steps
        print(orjson.dumps(RAW[sys.argv[2]](Path(sys.argv[3]))).decode())
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == CHILD_FLAG:
        print(orjson.dumps(asyncio.run(_child(Path(sys.argv[2])))).decode())
        sys.exit(0)
    sys.exit(main(run))
