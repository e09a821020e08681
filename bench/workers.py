"""Worker daemon benchmarks: end-to-end lag under offered load, sustained ingest.

One `memledger worker --processes 2` daemon (one process projects, one ingests; SQLite)
and a Redis of the bench's own (a `redis-server` on a free port, else `MEMLEDGER_REDIS_URL`).

- lag: events offered at a fixed rate (500/s, 2,000/s) by one publisher that sends,
  every 10 ms, the events due by then in one message (what an app process publishing
  for many users does); lag = publish -> the memory is visible in `mem_versions`,
  observed by a raw sqlite3 poller every 5 ms. Target (issue 6): p99 < 250 ms at 500/s.
  Baseline: raw sqlite3 inserting the same event rows one per commit (per-row latency).
  The note splits it: publish -> appended (the poller also watches `events`), and how
  long after the last publish every projection (the vector index too) had caught up.
- throughput: a backlog published in messages of 100 events; ingest rate (published
  -> appended) and end-to-end rate (published -> every projection caught up).
  Baseline: raw sqlite3 inserting the same event rows, 100 per transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from bench.common import (
    create_like,
    insert_sql,
    main,
    percentile,
    raw_connect,
    result,
    say,
    size,
    sqlite_url,
    workdir,
)
from ledger import schema as t
from ledger.events import derive_memory_id
from workers.publish import Publisher

TARGET_P99_MS = 250.0
#: One daemon of two processes: one projects, one ingests (`workers.daemon.roles`).
DAEMON_ARGS = ("--processes", "2")
#: The publisher sends what is due every tick, in one message (an app's linger).
TICK_S = 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _redis(tmp: Path) -> Iterator[str]:
    """A Redis of the bench's own, or the configured one (flushed db 15) without it."""
    exe = shutil.which("redis-server")
    if exe is None:
        url = os.environ.get("MEMLEDGER_REDIS_URL", "redis://127.0.0.1:6379") .rsplit("/", 1)[0]
        url = f"{url}/15"
        redis.Redis.from_url(url).flushdb()
        yield url
        return
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--save", "", "--appendonly", "no",
                             "--bind", "127.0.0.1", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(200):
            with contextlib.suppress(redis.RedisError):
                if redis.Redis.from_url(url).ping():
                    break
            time.sleep(0.02)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _event(run: str, i: int) -> dict[str, Any]:
    user = f"u{i % 200}"
    return {"type": "memory.written", "idempotency_key": f"{run}-{i}", "tenant": "shop-b",
            "actor": user,
            "source": {"kind": "explicit_user_request", "id": f"C{user}",
                       "at": "2026-09-20T10:00:00+08:00", "seq": i},
            "data": {"namespace": ["shop-b", user, "preferences"], "key": f"{run}-k{i}",
                     "value": {"choice": "window seat", "rank": i % 7}}}


class _Watcher(threading.Thread):
    """Polls `mem_versions` and `events` with raw sqlite3 and notes when each memory
    becomes visible and when each event was appended."""

    def __init__(self, db: Path) -> None:
        super().__init__(daemon=True)
        self.db = db
        self.seen: dict[str, float] = {}
        self.appended: dict[str, float] = {}  # idempotency key -> first seen in `events`
        self.stop = threading.Event()

    def run(self) -> None:
        conn = sqlite3.connect(str(self.db), isolation_level=None)
        last = last_pos = 0
        while not self.stop.is_set():
            with contextlib.suppress(sqlite3.OperationalError):
                rows = conn.execute("SELECT rowid, memory_id FROM mem_versions WHERE rowid > ?"
                                    " ORDER BY rowid", (last,)).fetchall()
                now = time.perf_counter()
                for rowid, mid in rows:
                    self.seen.setdefault(mid, now)
                    last = max(last, rowid)
                evs = conn.execute("SELECT position, idempotency_key FROM events "
                                   "WHERE position > ? ORDER BY position",
                                   (last_pos,)).fetchall()
                now = time.perf_counter()
                for pos, key in evs:
                    self.appended.setdefault(key, now)
                    last_pos = max(last_pos, pos)
            time.sleep(0.005)
        conn.close()


def _head_and_lag(db: Path) -> tuple[int, int]:
    conn = sqlite3.connect(str(db))
    try:
        head = conn.execute("SELECT coalesce(max(position), 0) FROM events").fetchone()[0]
        rows = conn.execute("SELECT position FROM checkpoints").fetchall()
        low = min((r[0] for r in rows), default=0)
        return int(head), int(head - low)
    except sqlite3.OperationalError:
        return 0, 0
    finally:
        conn.close()


def _wait(db: Path, head: int, within: float, *, projected: bool) -> float | None:
    started = time.perf_counter()
    while time.perf_counter() - started < within:
        h, lag = _head_and_lag(db)
        if h >= head and (not projected or lag == 0):
            return time.perf_counter()
        time.sleep(0.01)
    return None


def _offered(url: str, watcher: _Watcher, run: str, rate: int, seconds: float
             ) -> tuple[list[float], list[float], int, float]:
    """Offer `rate` events/s for `seconds`; returns lags to visible and to appended (ms),
    how many never showed, and when the last event was published (perf_counter)."""
    n = int(rate * seconds)
    events = [_event(run, i) for i in range(n)]
    sent: dict[str, float] = {}
    keys: dict[str, str] = {}
    with Publisher(url) as pub:
        start = time.perf_counter()
        i = 0
        while i < n:
            due = min(n, int((time.perf_counter() - start) * rate) + 1)
            if due > i:
                batch = events[i:due]
                now = time.perf_counter()
                res = pub.publish(batch)
                assert {r.status for r in res} == {"published"}, res[0]
                for ev in batch:
                    mid = derive_memory_id("shop-b", ev["idempotency_key"])
                    sent[mid] = now
                    keys[mid] = ev["idempotency_key"]
                i = due
            else:
                time.sleep(TICK_S)
    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline and any(m not in watcher.seen for m in sent):
        time.sleep(0.05)
    last = max(sent.values())
    lags = [(watcher.seen[m] - at) * 1000 for m, at in sent.items() if m in watcher.seen]
    appended = [(watcher.appended[keys[m]] - at) * 1000 for m, at in sent.items()
                if keys[m] in watcher.appended]
    return lags, appended, n - len(lags), last


def _raw_rows(db: Path, like: str) -> list[dict[str, Any]]:
    conn = sqlite3.connect(str(db))
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute("SELECT * FROM events WHERE idempotency_key LIKE ? "
                            "ORDER BY position", (like,)).fetchall()
        return [dict(r) for r in rows]
    finally:
        conn.close()


def _raw_insert(tmp: Path, rows: list[dict[str, Any]], per_tx: int) -> list[float]:
    """Insert `rows` into a fresh raw sqlite3 `events`; seconds of each transaction."""
    path = tmp / f"raw-{per_tx}-{time.monotonic_ns()}.db"
    conn = raw_connect(path)
    create_like(conn, t.events)
    sql = insert_sql(t.events)
    times = []
    for i in range(0, len(rows), per_tx):
        t0 = time.perf_counter()
        conn.execute("BEGIN")
        conn.executemany(sql, rows[i:i + per_tx])
        conn.execute("COMMIT")
        times.append(time.perf_counter() - t0)
    conn.close()
    return times


def _stop(daemon: subprocess.Popen[bytes]) -> None:
    daemon.terminate()
    try:
        daemon.wait(60)
    except subprocess.TimeoutExpired:
        daemon.kill()


async def run() -> list[dict[str, Any]]:
    """Lag at 500 and 2,000 events/s, sustained ingest: one daemon, SQLite."""
    return await asyncio.to_thread(_run)


def _run() -> list[dict[str, Any]]:
    lag_runs: list[tuple[int, list[float], list[float], int, float, list[dict[str, Any]]]] = []
    with workdir("workers") as tmp, _redis(tmp) as url:
        db = tmp / "ledger.db"
        env = {**os.environ, "MEMLEDGER_DB_URL": sqlite_url(db), "MEMLEDGER_REDIS_URL": url,
               "MEMLEDGER_FORGET_REGISTER": str(tmp / "ledger.forgets"),
               "MEMLEDGER_LOG_LEVEL": "WARNING"}
        with (tmp / "daemon.log").open("wb") as log:
            daemon = subprocess.Popen([sys.executable, "-m", "memledger", "worker",
                                       *DAEMON_ARGS], env=env, stdout=subprocess.DEVNULL,
                                      stderr=log)
            watcher = _Watcher(db)
            try:
                with Publisher(url) as pub:  # warm up: schema made, daemon consuming
                    pub.publish([_event("warm", i) for i in range(20)])
                if _wait(db, 20, 60, projected=True) is None:
                    raise RuntimeError("the worker daemon did not start; see its log")
                watcher.start()
                seconds = size(8, 1)
                for rate in (500, 2000):
                    say(f"offering {rate} events/s for {seconds} s")
                    lags, appended, missing, last = _offered(url, watcher, f"r{rate}", rate,
                                                             seconds)
                    h, _ = _head_and_lag(db)
                    done = _wait(db, h, 120, projected=True)
                    views = (done - last) if done is not None else float("nan")
                    lag_runs.append((rate, lags, appended, missing, views,
                                     _raw_rows(db, f"r{rate}-%")))
                watcher.stop.set()
                n = size(20000, 1000)
                say(f"publishing a backlog of {n} events in messages of 100")
                h0, _ = _head_and_lag(db)
                with Publisher(url, batch_size=100) as pub:
                    t0 = time.perf_counter()
                    res = pub.publish([_event("bulk", i) for i in range(n)])
                assert {r.status for r in res} == {"published"}
                ingested = _wait(db, h0 + n, 300, projected=False)
                projected = _wait(db, h0 + n, 300, projected=True)
                if ingested is None or projected is None:
                    raise RuntimeError("the daemon did not take the backlog within 300 s")
            finally:
                watcher.stop.set()
                _stop(daemon)
        # Baselines once the daemon is gone, so they do not share the CPU with it.
        results: list[dict[str, Any]] = []
        for rate, lags, appended, missing, views, rows in lag_runs:
            base_p99 = percentile(_raw_insert(tmp, rows, 1), 99) * 1000
            note = f"{len(lags)} events, one daemon ({' '.join(DAEMON_ARGS)})"
            if missing:
                note += f", {missing} not visible within 60 s"
            results.append(result(f"lag p50 at {rate}/s", percentile(lags, 50), "ms",
                                  base_p99, "ms",
                                  note + "; baseline: raw sqlite3 row insert+commit p99"))
            target = f"; target p99 < {TARGET_P99_MS:.0f} ms" if rate == 500 else ""
            split = (f"; publish -> appended p50 {percentile(appended, 50):.0f} / p99 "
                     f"{percentile(appended, 99):.0f} ms" if appended else "")
            results.append(result(f"lag p99 at {rate}/s", percentile(lags, 99), "ms",
                                  base_p99, "ms",
                                  note + target + split + f"; every view caught up {views:.1f}"
                                  " s after the last publish"))
        raw = _raw_insert(tmp, _raw_rows(db, "bulk-%"), 100)
        raw_rate = n / sum(raw)
        results.append(result("sustained ingest", n / (ingested - t0), "events/s",
                              raw_rate, "events/s",
                              f"{n} events published in messages of 100 -> appended; "
                              "baseline: raw sqlite3, 100 rows per transaction"))
        results.append(result("ingest + every projection", n / (projected - t0),
                              "events/s", raw_rate, "events/s",
                              "published -> every projection caught up"))
    return results


if __name__ == "__main__":
    raise SystemExit(main(run))
