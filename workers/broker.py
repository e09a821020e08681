"""The Redis broker as memledger configures it: names, timeouts, heartbeats, maintenance.

dramatiq's RedisBroker gives a killed worker's messages back only when a *maintenance
pass* finds the worker's heartbeat older than `heartbeat_timeout`; by default the
timeout is 60 s and maintenance runs by chance on 0.1% of broker commands, so a
killed worker's messages could wait minutes. Here every live daemon process
refreshes its own heartbeat and runs maintenance on each queue on a fixed schedule
(`LedgerBroker.housekeep`), so they come back within `HEARTBEAT_TIMEOUT_MS` plus one
`MAINTENANCE_INTERVAL_S` once any daemon is running.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import orjson
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import dq_name
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from workers.names import DEFAULT_THREADS as DEFAULT_THREADS
from workers.names import INGEST_QUEUE as INGEST_QUEUE
from workers.names import PROJECT_QUEUE as PROJECT_QUEUE
from workers.names import QUEUES as QUEUES

DEFAULT_REDIS_URL: Final = "redis://127.0.0.1:6379/0"
#: Prefix of every Redis key memledger's broker uses (dramatiq's own default is "dramatiq").
NAMESPACE: Final = "memledger"

INGEST_ACTOR: Final = "memledger_ingest"
WAKE_ACTOR: Final = "memledger_wake"

#: A process whose heartbeat is older than this is dead: its unacked messages go back.
HEARTBEAT_TIMEOUT_MS: Final = 15_000
#: How often a daemon process refreshes its heartbeat (well under the timeout, so a
#: process busy on long messages, which then fetches nothing, never looks dead).
HEARTBEAT_INTERVAL_S: Final = 2.0
#: How often each daemon process runs maintenance on every queue it knows.
MAINTENANCE_INTERVAL_S: Final = 5.0
#: How long dramatiq keeps a failed message in its own dead-letter set. Ingest never
#: ends there for an invalid event (those go to the `dead_letters` table, content
#: withheld for secrets); only a message whose transient failures outlasted every
#: retry lands here, and its content must not linger in Redis for days.
DEAD_MESSAGE_TTL_MS: Final = 3_600_000
#: How long an idle consumer waits between polls (dramatiq's default is 1 s; the lag
#: of the first message after a quiet spell is bounded by it).
WORKER_TIMEOUT_MS: Final = 100
#: A process that only projects needs few: its messages are wake-ups.
PROJECT_THREADS: Final = 8
#: Daemon status records expire when a daemon stops refreshing them.
DAEMON_TTL_S: Final = 30


def redis_url(url: str | None = None) -> str:
    """The broker URL: the argument, else `MEMLEDGER_REDIS_URL`, else the local default."""
    return url or os.environ.get("MEMLEDGER_REDIS_URL") or DEFAULT_REDIS_URL


def safe_url(url: str) -> str:
    """The URL without its password, fit for logs and status output."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redis_client(url: str, *, retries: int = 1) -> Any:
    """A Redis client that fails fast: a down broker must be reported, not waited on."""
    return redis.Redis.from_url(
        url, socket_connect_timeout=2, socket_timeout=10, health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries))


def daemon_key(daemon_id: str) -> str:
    """The Redis key of one daemon process's status record."""
    return f"{NAMESPACE}:daemon:{daemon_id}"


LAST_SWEEP_KEY: Final = f"{NAMESPACE}:last_sweep"


class LedgerBroker(RedisBroker):
    """RedisBroker with scheduled heartbeats and maintenance instead of chance ones."""

    def __init__(self, url: str, *, middleware: list[Any] | None = None) -> None:
        super().__init__(  # type: ignore[no-untyped-call]  # RedisBroker is untyped
            client=redis_client(url), middleware=middleware or [], namespace=NAMESPACE,
            heartbeat_timeout=HEARTBEAT_TIMEOUT_MS, dead_message_ttl=DEAD_MESSAGE_TTL_MS,
            # Scheduled by `housekeep`: maintenance runs KEYS, too costly to leave to
            # chance on every command of every app process that publishes.
            maintenance_chance=0)
        self.url = url
        self._forced = threading.local()
        self._last_maintenance = 0.0

    def _should_do_maintenance(self, command: str) -> int:
        return int(getattr(self._forced, "on", False))

    def housekeep(self, queues: tuple[str, ...] = QUEUES, *, force: bool = False) -> None:
        """Refresh this process's heartbeat; every `MAINTENANCE_INTERVAL_S`, also requeue
        the messages of dead processes and expire old dead letters, on every queue.

        Raises `redis.RedisError` when the broker is unreachable.
        """
        now = time.monotonic()
        due = force or now - self._last_maintenance >= MAINTENANCE_INTERVAL_S
        if not due:
            # Any broker command records the heartbeat; qsize is the cheapest.
            self.do_qsize(queues[0])
            return
        self._forced.on = True
        try:
            for q in queues:
                self.do_qsize(q)
                self.do_qsize(dq_name(q))
        finally:
            self._forced.on = False
        self._last_maintenance = now


def queue_depths(client: Any, queues: tuple[str, ...] = QUEUES) -> dict[str, dict[str, int]]:
    """Per queue: ready, unacked (ready plus in flight), delayed and dead messages."""
    pipe = client.pipeline(transaction=False)
    for q in queues:
        full = f"{NAMESPACE}:{q}"
        pipe.llen(full)
        pipe.hlen(f"{full}.msgs")
        pipe.hlen(f"{NAMESPACE}:{dq_name(q)}.msgs")
        pipe.zcard(f"{full}.XQ")
    res = pipe.execute()
    out: dict[str, dict[str, int]] = {}
    for i, q in enumerate(queues):
        ready, unacked, delayed, dead = res[i * 4:i * 4 + 4]
        out[q] = {"ready": int(ready), "unacked": int(unacked), "delayed": int(delayed),
                  "dead": int(dead)}
    return out


def daemon_records(client: Any) -> list[dict[str, Any]]:
    """The status records of the daemon processes alive now (expired ones are gone)."""
    keys = sorted(client.scan_iter(match=f"{NAMESPACE}:daemon:*", count=200))
    if not keys:
        return []
    return [orjson.loads(v) for v in client.mget(keys) if v is not None]


def publish_status(broker: LedgerBroker, daemon_id: str, record: dict[str, Any]) -> None:
    """Write one daemon process's status record (expires unless refreshed)."""
    pipe = broker.client.pipeline(transaction=False)
    pipe.set(daemon_key(daemon_id), orjson.dumps(record), ex=DAEMON_TTL_S)
    if record.get("last_sweep"):
        pipe.set(LAST_SWEEP_KEY, orjson.dumps(record["last_sweep"]))
    pipe.execute()


def host_name() -> str:
    """This machine's name, for daemon status records."""
    return socket.gethostname()
