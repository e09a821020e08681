"""Shard leases: which worker process projects which shards (PostgreSQL).

A lease is a PostgreSQL advisory lock `(SHARD_LEASE_LOCK, shard)` held by a session of
the worker process, on one connection it keeps open for that purpose (autocommit, so
the server's idle-in-transaction timeout never ends it). Why advisory locks and not
lease rows with a heartbeat: the lock ends exactly when its holder's session ends, so
there is no expiry to tune against pauses, no clock, no renewal write per shard per
second; and correctness never rests on the lease anyway: every batch locks its shard
checkpoint rows (`projections.runner.Runner._step_shards`), so two processes that both
believed they own a shard would still apply each event once.

Every process that projects also holds a *member* lock `(WORKER_MEMBER_LOCK, id)`. Each
`REBALANCE_S` it counts the members (`pg_locks`), and aims at its fair share of the S
shards, `ceil(S / members)`: it gives back shards above that and takes free ones up to
it. So a process that joins gets shards within a tick or two, without restarts.

Takeover bound: a killed process's session ends when the server sees its socket close
(at once when the process dies and its host lives: the kernel closes the socket), and
the survivors take its shards on their next tick: within `REBALANCE_S` (1 s), plus a
batch in flight. A host that vanishes (power, network) is detected by TCP keepalives set
on the lease session (idle 5 s, then 3 probes 1 s apart, `tcp_user_timeout` 8 s): its
shards move within about 10 s. A graceful stop unlocks everything at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import socket
from collections.abc import Callable
from typing import Any, Final

import structlog
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.backends.postgres import SHARD_LEASE_LOCK, WORKER_MEMBER_LOCK
from ledger.store import Store
from projections.runner import Runner
from projections.shards import shard_count

log = structlog.get_logger("memledger.workers")

#: Seconds between two looks at the members and the free shards.
REBALANCE_S: Final = 1.0
#: The lease session notices a vanished peer host within about this many seconds.
KEEPALIVE_SETTINGS: Final = {"tcp_keepalives_idle": "5", "tcp_keepalives_interval": "1",
                             "tcp_keepalives_count": "3", "tcp_user_timeout": "8000"}


def fair_share(shards: int, members: int) -> int:
    """The most shards one of `members` live processes should own."""
    return math.ceil(shards / max(1, members))


def plan(owned: set[int], free: list[int], shards: int, members: int
         ) -> tuple[list[int], list[int]]:
    """What to give back and what to try to take, towards the fair share (pure)."""
    fair = fair_share(shards, members)
    mine = sorted(k for k in owned if k < shards)
    give = sorted(k for k in owned if k >= shards) + mine[fair:]
    keep = len(mine) - len(mine[fair:])
    take = [k for k in free if k not in owned][:max(0, fair - keep)]
    return give, take


class ShardLeases:
    """Holds this process's shard leases and keeps `runner.owned` equal to them."""

    def __init__(self, store: Store, runner: Runner, *, on_gain: Callable[[], None],
                 interval: float = REBALANCE_S, label: str | None = None) -> None:
        self.store = store
        self.runner = runner
        self.on_gain = on_gain
        self.interval = interval
        self.label = label or f"memledger worker {socket.gethostname()}:{os.getpid()}"
        self.member = random.randrange(1, 2**31 - 1)
        self.owned: set[int] = set()
        self._conn: AsyncConnection | None = None
        runner.owned = frozenset()

    async def _connect(self) -> AsyncConnection:
        await self.store.open()
        conn = await (await self.store.engine.connect()).execution_options(
            isolation_level="AUTOCOMMIT")
        try:
            await conn.execute(text("SELECT set_config('application_name', :v, false)"),
                               {"v": self.label[:63]})
            for name, value in KEEPALIVE_SETTINGS.items():
                await conn.execute(text("SELECT set_config(:n, :v, false)"),
                                   {"n": name, "v": value})
            while not (await conn.execute(text("SELECT pg_try_advisory_lock(:c, :m)"),
                                          {"c": WORKER_MEMBER_LOCK, "m": self.member})
                       ).scalar():
                self.member = random.randrange(1, 2**31 - 1)
        except BaseException:
            await conn.invalidate()
            raise
        return conn

    async def tick(self) -> None:
        """Look at the members and the free shards once; give back, take, and tell the
        runner."""
        if self._conn is None:
            self._conn = await self._connect()
        conn = self._conn
        count = await shard_count(conn)
        members = len(await self.store.recorder.lease_holders(conn, WORKER_MEMBER_LOCK))
        held = await self.store.recorder.lease_holders(conn, SHARD_LEASE_LOCK)
        start = self.member % count
        free = [k % count for k in range(start, start + count) if k % count not in held]
        give, take = plan(self.owned, free, count, members)
        for k in give:
            await conn.execute(text("SELECT pg_advisory_unlock(:c, :k)"),
                               {"c": SHARD_LEASE_LOCK, "k": k})
            self.owned.discard(k)
        gained = []
        for k in take:
            if (await conn.execute(text("SELECT pg_try_advisory_lock(:c, :k)"),
                                   {"c": SHARD_LEASE_LOCK, "k": k})).scalar():
                self.owned.add(k)
                gained.append(k)
        self.runner.owned = frozenset(self.owned)
        if give or gained:
            log.info("shard_leases", owned=sorted(self.owned), gave=give, took=gained,
                     members=members, shards=count)
        if gained:
            self.on_gain()

    async def run(self) -> None:
        """Tick every `interval` until cancelled; a lost session drops every lease (the
        server has released them) and reconnects on the next tick."""
        failing = False
        while True:
            try:
                await self.tick()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the leases must outlive any failure
                if not failing:
                    log.warning("shard_leases_failed", error=str(e)[:300] or type(e).__name__)
                failing = True
                await self._drop()
            await asyncio.sleep(self.interval)

    async def _drop(self) -> None:
        self.owned.clear()
        self.runner.owned = frozenset()
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.invalidate()

    async def close(self) -> None:
        """Give every shard back at once (graceful stop) and close the lease session."""
        self.runner.owned = frozenset()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.execute(text("SELECT pg_advisory_unlock_all()"))
        if self.owned:
            log.info("shard_leases_released", shards=sorted(self.owned))
        await self._drop()

    def report(self) -> dict[str, Any]:
        """This process's part of its status record."""
        return {"member": self.member, "shards": sorted(self.owned)}
