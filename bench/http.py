"""The HTTP API on loopback beside the in-process SDK doing the same calls, same run.

A SQLite ledger of 20k long-term memories (200 users x 100 keys, one tenant; `--quick`
2k) is appended and projected, and a principal's key is made for each of 50 users.
Then the same calls run twice, each with `CONCURRENCY` callers at once and a bounded
number of requests:

- `GET /v1/memories?namespace=preferences&key=K` (4,000 requests; `--quick` 800) and
  `POST /v1/recall` with a short query (800; `--quick` 200), sent with `httpx` async
  clients (keep-alive, one bearer key per user) to a real `memledger serve` process on a
  free loopback port, started here with the rate limit off;
- baseline: `Principal.get` and `Principal.recall` through `MemoryLedger` in this
  process, the same users, keys and queries in the same order, with as many asyncio
  tasks at once.

Each side reports its throughput (requests/s over the whole batch) and its latency
p50/p99 per call. The HTTP figures include what the SDK does plus the server's edge
(key check against the database, rate-limit bucket, validation, JSON, metrics) and
the loopback round trip; the load generator shares the machine's cores with the server,
as a co-located agent would.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from bench.common import (
    load_ledger,
    main,
    percentile,
    result,
    say,
    simple_writes,
    size,
    sqlite_url,
    workdir,
)
from ledger import keys
from ledger.store import Store
from memledger import MemoryLedger

TENANT = "shop-a"
USERS = 200
KEYED_USERS = 50
CONCURRENCY = 8
QUERIES = ("which language do I prefer", "option note said in conversation", "choice rank",
           "what did I say about replies", "preferences for the ticket")

Call = tuple[str, str]  # user, key or query


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _drive(calls: Sequence[Call], one: Callable[[Call], Awaitable[None]]
                 ) -> tuple[float, list[float]]:
    """Run `calls` with `CONCURRENCY` workers; (calls per second, latencies in ms)."""
    queue = list(reversed(calls))
    lat: list[float] = []

    async def worker() -> None:
        while queue:
            c = queue.pop()
            t0 = time.perf_counter()
            await one(c)
            lat.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return len(calls) / (time.perf_counter() - t0), lat


class Served:
    """`memledger serve` on a free loopback port (this module's own, ended by `stop`)."""

    def __init__(self, db_url: str, register: str) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "memledger", "--db", db_url, "--forget-register",
             register, "serve", "--port", port, "--rate-limit", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    async def ready(self) -> None:
        """Wait until `/healthz` answers (one minute at most)."""
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient() as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"memledger serve exited: {self.proc.stderr!r}")
                try:
                    if (await c.get(self.url + "/healthz", timeout=1)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("memledger serve did not come up")
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _sdk(db_url: str, register: str, gets: Sequence[Call], recalls: Sequence[Call]
               ) -> dict[str, tuple[float, list[float]]]:
    async with MemoryLedger(db_url, register_path=register) as ml:
        async def get(c: Call) -> None:
            got = await ml.principal(TENANT, c[0]).get(["preferences"], c[1])
            assert got is not None, c

        async def recall(c: Call) -> None:
            await ml.principal(TENANT, c[0]).recall(c[1], limit=5)

        await _drive(gets[:200], get)  # warm-up
        await _drive(recalls[:40], recall)
        return {"get": await _drive(gets, get), "recall": await _drive(recalls, recall)}


async def _http(url: str, tokens: dict[str, str], gets: Sequence[Call],
                recalls: Sequence[Call]) -> dict[str, tuple[float, list[float]]]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as c:
        async def get(call: Call) -> None:
            r = await c.get("/v1/memories", params={"namespace": "preferences", "key": call[1]},
                            headers={"Authorization": f"Bearer {tokens[call[0]]}"})
            assert r.status_code == 200, r.text

        async def recall(call: Call) -> None:
            r = await c.post("/v1/recall", json={"query": call[1], "limit": 5},
                             headers={"Authorization": f"Bearer {tokens[call[0]]}"})
            assert r.status_code == 200, r.text

        await _drive(gets[:200], get)  # warm-up: connections, caches
        await _drive(recalls[:40], recall)
        return {"get": await _drive(gets, get), "recall": await _drive(recalls, recall)}


async def run() -> list[dict[str, Any]]:
    """Throughput and p50/p99 of GET /v1/memories and POST /v1/recall, beside the SDK."""
    n = size(20_000, 1_000)
    per_user = n // USERS
    rng = random.Random(17)
    users = [f"u{i}" for i in range(KEYED_USERS)]
    gets = [(rng.choice(users), f"k{rng.randrange(per_user)}")
            for _ in range(size(4_000, 400))]
    recalls = [(rng.choice(users), rng.choice(QUERIES)) for _ in range(size(800, 100))]
    with workdir("http") as d:
        db, register = d / "http.db", str(d / "http.forgets")
        db_url = sqlite_url(db)
        say(f"appending {n:,} memories of {USERS} users, projecting (set-up)")
        await load_ledger(db, simple_writes(n, users=USERS, tenant=TENANT))
        async with MemoryLedger(db_url, register_path=register) as ml:
            await ml.project()
        store = Store(db_url, register_path=register)
        try:
            tokens = {u: (await keys.create_key(store, "principal", tenant=TENANT,
                                                user=u))[0] for u in users}
        finally:
            await store.close()
        say(f"in-process SDK: {len(gets)} gets, {len(recalls)} recalls, "
            f"{CONCURRENCY} at once")
        base = await _sdk(db_url, register, gets, recalls)
        say("memledger serve on loopback: the same calls over HTTP")
        srv = Served(db_url, register)
        try:
            await srv.ready()
            ours = await _http(srv.url, tokens, gets, recalls)
        finally:
            srv.stop()
    out: list[dict[str, Any]] = []
    for what, label in (("get", "GET /v1/memories"), ("recall", "POST /v1/recall")):
        (rate, lat), (brate, blat) = ours[what], base[what]
        out += [
            result(f"http {label}", rate, "req/s", brate, "calls/s",
                   note=f"{CONCURRENCY} concurrent; baseline: the SDK in process"),
            result(f"http {label} p50", percentile(lat, 50), "ms", percentile(blat, 50)),
            result(f"http {label} p99", percentile(lat, 99), "ms", percentile(blat, 99)),
        ]
    return out


if __name__ == "__main__":
    os.environ.setdefault("MEMLEDGER_LOG_LEVEL", "WARNING")
    sys.exit(main(run))
