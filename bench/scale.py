"""Projection scale-out on PostgreSQL: the same backlog projected by 1, 2 and 4 worker
processes sharing the shards (`workers.leases`), beside one unsharded process.

Set-up: a backlog of `mixed_events` over 64 tenants appended once into a template
database; each run gets a fresh copy (`CREATE DATABASE ... TEMPLATE`). The processes are
started and held at a lock until their leases have settled (each at its fair share of
the 16 shards), so process start-up is not timed; then the clock runs until every shard
of every projection is at the head (polled every 50 ms).

- baseline: one `memledger project` process (no leases: every shard in one batch)
- `memledger worker --queues project` x 1, 2, 4 (each its own process group and session;
  Redis for wake-ups; the sweep brings them to the head)
- 4 workers on two simulated hosts: two network namespaces, each joined to this host by
  a veth pair, 2 workers in each, reaching PostgreSQL and Redis through a `socat`
  forwarder on the host side (needs root, `ip` and `socat`; skipped otherwise)

Targets on 2 cores (issue 21): 2 processes >= 1.7x one; 4 no slower than 2. Skipped
without PostgreSQL (`MEMLEDGER_BENCH_PG`, default postgresql+asyncpg://postgres@127.0.0.1:5432)
or Redis (`MEMLEDGER_BENCH_REDIS`, default redis://127.0.0.1:6379/15).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import main, mixed_events, result, say, size
from ledger.backends.postgres import SHARD_LEASE_LOCK, advisory_holders
from ledger.store import Store
from projections.runner import Runner
from projections.shards import DEFAULT_SHARDS

PG = os.environ.get("MEMLEDGER_BENCH_PG", "postgresql+asyncpg://postgres@127.0.0.1:5432")
REDIS = os.environ.get("MEMLEDGER_BENCH_REDIS", "redis://127.0.0.1:6379/15")
MEMLEDGER = str(Path(sys.executable).parent / "memledger")
TEMPLATE = f"memledger_bench_scale_tpl_{os.getpid()}"


async def _admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG.replace("postgresql+asyncpg", "postgresql") + "/postgres",
                                 timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _url(name: str) -> str:
    return f"{PG}/{name}"


async def _build_template(n: int) -> None:
    await _admin(f'CREATE DATABASE "{TEMPLATE}"')
    store = Store(_url(TEMPLATE))
    await store.open()
    try:
        events = mixed_events(n, tenants=64, seed=21)
        for i in range(0, n, 2000):
            await store.append(events[i:i + 2000])
    finally:
        await store.close()


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """One `memledger` process in a process group and session of its own; `args` may
    start with `netns:NAME` to run it in that network namespace, reaching PostgreSQL and
    Redis through `env` overrides of the host (`HOSTS`)."""
    cmd = [MEMLEDGER, *args]
    if args and args[0].startswith("netns:"):
        ns = args[0].split(":", 1)[1]
        gw = HOSTS[ns]
        env = {**env, "MEMLEDGER_DB_URL": env["MEMLEDGER_DB_URL"].replace("127.0.0.1", gw),
               "MEMLEDGER_REDIS_URL": env["MEMLEDGER_REDIS_URL"].replace("127.0.0.1", gw)}
        cmd = ["ip", "netns", "exec", ns, MEMLEDGER, *args[1:]]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


#: Simulated hosts: network namespace -> the address of the host side of its veth pair,
#: where a forwarder (socat) passes PostgreSQL and Redis on to the loopback services.
HOSTS: dict[str, str] = {}


def _hosts_up(count: int) -> list[subprocess.Popen[bytes]] | None:
    """Create `count` network namespaces, each joined to this host by a veth pair, and
    forwarders for PostgreSQL and Redis; None when that is not possible here (not root,
    no `ip` or `socat`), after undoing any part done."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("socat") \
            or "127.0.0.1" not in PG or "127.0.0.1" not in REDIS:
        return None
    tag = os.getpid() % 200
    forwarders: list[subprocess.Popen[bytes]] = []
    pg_port = PG.rsplit(":", 1)[1].split("/")[0]
    redis_port = REDIS.rsplit(":", 1)[1].split("/")[0]
    try:
        for i in range(count):
            ns, a, b = f"mlb{tag}h{i}", f"mlb{tag}h{i}a", f"mlb{tag}h{i}b"
            host, guest = f"10.{77 + i}.{tag}.1", f"10.{77 + i}.{tag}.2"
            for cmd in (["ip", "netns", "add", ns],
                        ["ip", "link", "add", a, "type", "veth", "peer", "name", b],
                        ["ip", "link", "set", b, "netns", ns],
                        ["ip", "addr", "add", f"{host}/24", "dev", a],
                        ["ip", "link", "set", a, "up"],
                        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{guest}/24",
                         "dev", b],
                        ["ip", "netns", "exec", ns, "ip", "link", "set", b, "up"],
                        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]):
                subprocess.run(cmd, check=True, capture_output=True)
            HOSTS[ns] = host
            for port in (pg_port, redis_port):
                forwarders.append(subprocess.Popen(
                    ["socat", f"TCP-LISTEN:{port},bind={host},fork,reuseaddr",
                     f"TCP:127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL))
        time.sleep(0.3)
        return forwarders
    except (subprocess.CalledProcessError, OSError) as e:
        say(f"scale: simulated hosts not possible here ({e}): skipped")
        _hosts_down(forwarders)
        return None


def _hosts_down(forwarders: list[subprocess.Popen[bytes]]) -> None:
    for f in forwarders:
        f.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            f.wait(5)
    for ns in list(HOSTS):
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", ns + "a"], check=False, capture_output=True)
        del HOSTS[ns]


def _cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds each process has used so far (Linux `/proc`; a process
    gone meanwhile is left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def _family(pids: list[int]) -> list[int]:
    """The processes and their children (a forwarder forks one per connection)."""
    out = list(pids)
    for pid in pids:
        with contextlib.suppress(OSError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return out


def _used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two readings (a process new since `before`: all of it)."""
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


async def _backends(store: Store, db: str) -> list[int]:
    """The PostgreSQL server processes serving database `db` (the workers' sessions)."""
    async with store.read_once() as conn:
        rows = (await conn.exec_driver_sql(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            (db,))).all()
    return [int(r[0]) for r in rows]


#: Per configuration: CPU seconds of the projecting processes and of their PostgreSQL
#: server processes during the timed window (how much CPU the run got, beside its wall
#: time: on a shared machine the two tell load from scaling).
CPU: dict[str, tuple[float, float, float]] = {}


async def _run(label: str, db: str, argv: list[list[str]], leases: int,
               helpers: list[int] | None = None) -> float:
    """Start the processes held at a lock, release them, time the catch-up (seconds).
    `helpers`: processes whose CPU is counted apart (the simulated hosts' forwarders)."""
    await _admin(f'CREATE DATABASE "{db}" TEMPLATE "{TEMPLATE}"')
    env = {**os.environ, "MEMLEDGER_DB_URL": _url(db), "MEMLEDGER_REDIS_URL": REDIS,
           "MEMLEDGER_FORGET_REGISTER": f"/tmp/{db}.forgets", "MEMLEDGER_LOG_LEVEL": "WARNING"}
    store = Store(_url(db))
    await store.open()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        head = await store.head()
        runner = Runner(store)
        await runner.positions()
        own = set(await _backends(store, db))  # this bench's sessions: not counted
        # Hold every projection step (and checkpoint read) until the processes are ready.
        async with store.engine.connect() as gate:
            await gate.exec_driver_sql("BEGIN")
            await gate.exec_driver_sql("LOCK TABLE checkpoints IN ACCESS EXCLUSIVE MODE")
            procs.extend(_spawn(args, env) for args in argv)
            deadline = time.monotonic() + 40
            while leases and time.monotonic() < deadline:
                async with store.read_once() as conn:
                    held = await advisory_holders(conn, SHARD_LEASE_LOCK)
                per: dict[str, int] = {}
                for owner in held.values():
                    per[owner] = per.get(owner, 0) + 1
                if len(held) == DEFAULT_SHARDS and len(per) == leases \
                        and max(per.values()) - min(per.values()) <= 1:
                    break
                await asyncio.sleep(0.05)
            else:
                if leases:
                    raise RuntimeError(f"{label}: leases did not settle")
            await asyncio.sleep(0.5 if not leases else 0)  # `project` reaches its first step
            # The projecting processes (under `ip netns exec`, the process it execs is the
            # same pid) and their server processes (the gate's own excluded).
            pids = [p.pid for p in procs]
            own.add(await _pid(gate))
            servers = [b for b in await _backends(store, db) if b not in own]
            groups = [pids, servers, _family(helpers or [])]
            cpu0 = [_cpu_seconds(g) for g in groups]
            await gate.exec_driver_sql("COMMIT")
            started = time.perf_counter()
        # CPU is read on every poll and the last reading of each process kept, so one that
        # exits (`memledger project` when done, its server process) is still counted.
        last: list[dict[int, float]] = [dict(c) for c in cpu0]
        polls = 0
        while True:
            if polls % 10 == 0:  # server processes and forwarders opened since the release
                servers += [b for b in await _backends(store, db)
                            if b not in own and b not in servers]
                groups[2] = sorted(set(groups[2]) | set(_family(helpers or [])))
            polls += 1
            for seen, g in zip(last, groups, strict=True):
                seen.update(_cpu_seconds(g))
            if min((await runner.positions()).values()) >= head:
                break
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"{label}: a process died")
            await asyncio.sleep(0.05)
        seconds = time.perf_counter() - started
        for seen, g in zip(last, groups, strict=True):
            seen.update(_cpu_seconds(g))
        w, pg, fwd = (_used(c0, seen) for c0, seen in zip(cpu0, last, strict=True))
        cpu = (w, pg, fwd)
        CPU[label] = cpu
        say(f"{label}: {head:,} events in {seconds:.2f} s; CPU {cpu[0]:.1f} s in the "
            f"projecting processes, {cpu[1]:.1f} s in their PostgreSQL server processes"
            + (f", {cpu[2]:.1f} s in the forwarders" if helpers else "")
            + f" ({sum(cpu) / seconds:.2f} cores on average)")
        return seconds
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60)
        await store.close()
        await _admin(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


async def _pid(conn: Any) -> int:
    return int((await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar())


async def run() -> list[dict[str, Any]]:
    """The scaling curve, beside one unsharded process."""
    n = size(6000, 500)
    try:
        await _admin("SELECT 1")
    except Exception as e:  # noqa: BLE001 - no server: skip, say why
        say(f"scale: PostgreSQL not reachable ({type(e).__name__}): skipped")
        return []
    import redis

    try:
        redis.Redis.from_url(REDIS, socket_connect_timeout=2).ping()
    except Exception as e:  # noqa: BLE001
        say(f"scale: Redis not reachable ({type(e).__name__}): skipped")
        return []
    say(f"scale: appending {n:,} mixed events over 64 tenants into a template database")
    await _build_template(n)
    worker = ["worker", "--queues", "project", "--threads", "4", "--sweep-interval", "0.2"]
    two_hosts: float | None = None
    try:
        base = await _run("unsharded (memledger project)", f"{TEMPLATE}_u",
                          [["project"]], 0)
        secs = {}
        for k in (1, 2, 4):
            secs[k] = await _run(f"{k} worker process(es)", f"{TEMPLATE}_{k}",
                                 [worker] * k, k)
        forwarders = await asyncio.to_thread(_hosts_up, 2)
        if forwarders is not None:
            try:
                hosts = [[f"netns:{ns}", *worker] for ns in HOSTS for _ in range(2)]
                two_hosts = await _run("4 worker processes on 2 simulated hosts",
                                       f"{TEMPLATE}_h", hosts, 4,
                                       helpers=[f.pid for f in forwarders])
            finally:
                await asyncio.to_thread(_hosts_down, forwarders)
    finally:
        await _admin(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')
    rate = {k: n / s for k, s in secs.items()}
    base_rate = n / base

    def cpu(label: str, seconds: float) -> str:
        w, pg, fwd = CPU[label]
        return (f"; CPU {w:.1f} s workers + {pg:.1f} s PostgreSQL"
                + (f" + {fwd:.1f} s forwarders" if fwd else "")
                + f" = {(w + pg + fwd) / seconds:.2f} cores, "
                f"{n / max(w + pg + fwd, 1e-9):.0f} events per CPU-second")

    out = [result("scale: 1 unsharded process (memledger project)", base_rate, "events/s",
                  base_rate, note=f"{n:,} events, every view, PostgreSQL; the baseline"
                  + cpu("unsharded (memledger project)", base))]
    for k in (1, 2, 4):
        note = f"{k} x `memledger worker --queues project`, {DEFAULT_SHARDS} shards"
        if k == 2:
            note += f"; {rate[2] / rate[1]:.2f}x one worker (target >= 1.7x)"
        if k == 4:
            note += f"; {rate[4] / rate[2]:.2f}x two workers (target >= 1.0x)"
        out.append(result(f"scale: {k} sharded worker process{'es' if k > 1 else ''}",
                          rate[k], "events/s", base_rate,
                          note=note + cpu(f"{k} worker process(es)", secs[k])))
    if two_hosts is not None:
        out.append(result("scale: 4 workers on 2 simulated hosts", n / two_hosts,
                          "events/s", base_rate,
                          note=f"2 network namespaces x 2 workers, PostgreSQL and Redis over "
                               f"veth + socat; {rate[4] and (n / two_hosts) / rate[4]:.2f}x "
                               "4 workers on one host"
                               + cpu("4 worker processes on 2 simulated hosts", two_hosts)))
    return out


if __name__ == "__main__":
    sys.exit(main(run))
