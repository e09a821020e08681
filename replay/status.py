"""What the ledger database says about itself: head, projection lag (per shard too, with
each shard's lease holder), rebuilds under way, events a projection quarantined (per
projection: count and oldest position).

`memledger status` prints this report with the broker's side merged in
(`workers.health.broker_report`).
"""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import func, select

from ledger import schema as t
from ledger.backends.postgres import SHARD_LEASE_LOCK
from ledger.store import Store
from projections import quarantine, shards
from projections.runner import BULK_SUFFIX, REBUILD_MARKER, Runner
from replay.config import embedder_report


async def shard_table(store: Store, names: list[str]
                      ) -> tuple[int, dict[str, dict[int, int]], dict[int, str]]:
    """S, where each shard of the named projections stands, and who holds each shard's
    lease (PostgreSQL workers, `workers.leases`; none on SQLite)."""
    async with store.read() as conn:
        count = await shards.shard_count(conn)
        per_shard = await shards.shard_positions(conn, names, count)
    # Outside the snapshot: the lease holders are live state.
    async with store.read_once() as conn:
        owners = await store.recorder.lease_holders(conn, SHARD_LEASE_LOCK)
    return count, per_shard, owners


async def status_report(store: Store) -> dict[str, Any]:
    """Head, per-projection position and lag, and what else the ledger knows."""
    runner = Runner(store)
    head = await store.head()
    positions = await runner.positions()
    count, per_shard, owners = await shard_table(store, [p.name for p in runner.projections])
    async with store.read() as conn:
        dead = int((await conn.execute(select(func.count()).select_from(t.dead_letters)))
                   .scalar() or 0)
        forgets = int((await conn.execute(select(func.count()).select_from(t.tombstones)))
                      .scalar() or 0)
        m = t.meta.c
        meta = {r[0]: r[1] for r in (await conn.execute(select(m.name, m.value).where(
            m.name.startswith(REBUILD_MARKER, autoescape=True)
            | m.name.endswith(BULK_SUFFIX, autoescape=True)))).all()}
        held = await quarantine.summary(conn)
    projections: dict[str, Any] = {}
    for n, p in positions.items():
        projections[n] = {"position": p, "lag": head - p, "slowest_shard_lag": head - p,
                          "shards": [{"shard": k, "owner": owners.get(k), "position": at,
                                      "lag": head - at}
                                     for k, at in sorted(per_shard[n].items())]}
        if REBUILD_MARKER + n in meta:
            projections[n]["rebuilding_since"] = meta[REBUILD_MARKER + n]
        if n + BULK_SUFFIX in meta:
            load = orjson.loads(meta[n + BULK_SUFFIX])
            projections[n]["bulk_load"] = {"head": load.get("head"),
                                           "phase": load.get("phase")}
        if n in held:
            # Events this view skipped (docs/projections.md#quarantine).
            projections[n]["quarantined"] = held[n]
    return {
        "head": head,
        "projections": projections,
        # The ledger's embedder (`memledger config set embedder NAME`) and the models
        # its vector index holds.
        "embedder": await embedder_report(store, load=False),
        "backend": store.dialect,
        # S, and the lease holder of each shard (None: no worker holds it; SQLite
        # workers and `memledger project` step every shard without leases).
        "shards": {"count": count, "owners": {str(k): owners.get(k) for k in range(count)}},
        "tombstones": forgets,
        "dead_letters": dead,
        "quarantined": sum(q["count"] for q in held.values()),
        "forget_register": str(store.register.path),
    }
