"""The broker side of `memledger status`: queue depths, daemons alive, last sweep.

`memledger status` merges `await broker_report()` into the ledger's report
(`replay.status.status_report`). It never raises: an unreachable broker is reported as
such.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import redis

from workers.broker import (
    LAST_SWEEP_KEY,
    QUEUES,
    daemon_records,
    queue_depths,
    redis_client,
    redis_url,
    safe_url,
)


def _report(url: str) -> dict[str, Any]:
    client = redis_client(url, retries=0)
    try:
        queues = queue_depths(client, QUEUES)
        daemons = daemon_records(client)
        raw = client.get(LAST_SWEEP_KEY)
    except (redis.RedisError, OSError) as e:
        return {"url": safe_url(url), "reachable": False, "error": str(e)[:300]}
    finally:
        client.close()
    return {
        "url": safe_url(url), "reachable": True, "queues": queues,
        "broker_dead_letters": sum(q["dead"] for q in queues.values()),
        "daemons": daemons,
        "last_sweep": orjson.loads(raw) if raw is not None else None,
    }


async def broker_report(url: str | None = None) -> dict[str, Any]:
    """{"broker": {reachable, queues: {name: {ready, unacked, delayed, dead}}, daemons,
    last_sweep}} for the broker at `url` (default `MEMLEDGER_REDIS_URL`)."""
    return {"broker": await asyncio.to_thread(_report, redis_url(url))}
