"""`memledger worker`: the worker daemon's processes, their lifecycle and signals.

Each worker process runs dramatiq's `Worker` in-process (consumer threads, `threads`
worker threads) around one asyncio loop thread that holds the process's store and
projector, plus a housekeeping thread (broker heartbeat, scheduled maintenance,
status record) and, in the first process of a daemon that projects, the sweep.
With `--processes 1` that is the daemon itself; with more, the daemon is a small
supervisor of that many spawned processes and, like the `dramatiq` command, stops
them all and exits 1 as soon as one dies, leaving the restart to systemd or
supervisord (see docs/workers.md).

SIGTERM or SIGINT stops a process gracefully: no new message is taken, the messages
in hand finish (they are bounded by the actors' time limits), prefetched ones are
given back to the broker, the projector's open batch (if any) rolls back, and the
store closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Final

import orjson
import redis
import structlog
from dramatiq import Worker
from dramatiq.asyncio import EventLoopThread, set_event_loop_thread

from ledger.logs import configure
from workers import actors
from workers.broker import (
    HEARTBEAT_INTERVAL_S,
    INGEST_QUEUE,
    PROJECT_QUEUE,
    PROJECT_THREADS,
    QUEUES,
    WORKER_TIMEOUT_MS,
    LedgerBroker,
    daemon_key,
    host_name,
    publish_status,
    safe_url,
)
from workers.runtime import Runtime, Settings, describe

log = structlog.get_logger("memledger.workers")

#: How long a stopping process waits for the messages in hand (ms).
STOP_TIMEOUT_MS: Final = 30_000


# -- logging ------------------------------------------------------------------------------

class _RedactMessages(logging.Filter):
    """dramatiq logs whole messages (`actor(args...)`) in some lines; events are memory
    content, which never goes into a log line: keep the actor name and message id."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(_is_message(a) for a in record.args):
            record.args = tuple(_redact(a) for a in record.args)
        return True


def _is_message(obj: Any) -> bool:
    return hasattr(obj, "actor_name") and hasattr(obj, "message_id") and hasattr(obj, "args")


def _redact(obj: Any) -> Any:
    if not _is_message(obj):
        return obj
    return f"{obj.actor_name}(<{len(obj.args)} args withheld>)#{obj.message_id}"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "event": record.getMessage(), "logger": record.name,
            "level": record.levelname.lower(),
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


def configure_logging() -> None:
    """structlog as the CLI sets it up (INFO by default for a daemon), and dramatiq's
    stdlib logging as JSON lines on stderr with message contents withheld."""
    level = (os.environ.get("MEMLEDGER_LOG_LEVEL") or "INFO").upper()
    configure(level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    handler.addFilter(_RedactMessages())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    numeric = logging.getLevelNamesMapping().get(level, logging.INFO)
    # Never DEBUG for dramatiq: its debug lines are per message and carry contents.
    logging.getLogger("dramatiq").setLevel(max(numeric, logging.INFO))


# -- one worker process -------------------------------------------------------------------

class WorkerProcess:
    """dramatiq's Worker, the loop thread, the runtime and housekeeping of one process."""

    def __init__(self, settings: Settings, index: int = 0) -> None:
        self.settings = settings
        self.index = index
        self.daemon_id = f"{host_name()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.broker = LedgerBroker(settings.redis_url, middleware=actors.middleware())
        actors.declare(self.broker)
        self.loop_thread = EventLoopThread(logging.getLogger("memledger.workers.loop"))
        self.runtime = Runtime(settings, self.broker, sweep=index == 0)
        self.worker: Worker | None = None
        self._stop = threading.Event()
        self._housekeeper = threading.Thread(target=self._housekeep, daemon=True,
                                             name="memledger-housekeeper")
        self.started_at = time.time()

    def start(self) -> None:
        """Start the loop, the runtime, dramatiq's worker and housekeeping."""
        self.loop_thread.start(timeout=10)
        set_event_loop_thread(self.loop_thread)
        actors.install(self.runtime)
        self.loop_thread.run_coroutine(self.runtime.start())
        # The dramatiq command emits process_boot itself; TimeLimit starts on it.
        self.broker.emit_after("process_boot")
        self.worker = Worker(self.broker, queues=set(self.settings.queues),
                             worker_threads=self.settings.threads,
                             worker_timeout=WORKER_TIMEOUT_MS)
        self.worker.start()
        self._housekeeper.start()
        log.info("worker_started", daemon=self.daemon_id, queues=list(self.settings.queues),
                 threads=self.settings.threads, broker=safe_url(self.settings.redis_url),
                 sweep=self.runtime.sweeps)

    def stop(self) -> None:
        """Finish the messages in hand, give back the prefetched ones, close everything."""
        log.info("worker_stopping", daemon=self.daemon_id)
        self._stop.set()
        if self.worker is not None:
            self.worker.stop(timeout=STOP_TIMEOUT_MS)
        with contextlib.suppress(Exception):
            self.loop_thread.run_coroutine(self.runtime.close())
        self.loop_thread.stop()  # type: ignore[no-untyped-call]
        set_event_loop_thread(None)
        actors.install(None)
        self._housekeeper.join(timeout=5)
        with contextlib.suppress(Exception):
            self.broker.client.delete(daemon_key(self.daemon_id))
        self.broker.close()
        log.info("worker_stopped", daemon=self.daemon_id)

    def status(self) -> dict[str, Any]:
        """This process's status record, as `memledger status` shows it."""
        rec = describe(self.settings, self.daemon_id)
        proj = self.runtime.projector
        sweep = self.runtime.last_sweep
        rec.update({
            "host": host_name(), "index": self.index,
            "started_at": _iso(self.started_at), "last_seen": _iso(time.time()),
            "last_sweep": _iso(sweep) if sweep else None,
            "projected_head": proj.reached if proj is not None else None,
            "wake_failures": self.runtime.wakes.failures,
        })
        if self.runtime.leases is not None:
            rec["shard_leases"] = self.runtime.leases.report()
        return rec

    def _housekeep(self) -> None:
        down = False
        while not self._stop.is_set():
            try:
                # Every queue, consumed here or not: a dead process's messages come
                # back whichever daemons are left.
                self.broker.housekeep(QUEUES)
                publish_status(self.broker, self.daemon_id, self.status())
                if down:
                    log.info("broker_reachable", broker=safe_url(self.settings.redis_url))
                down = False
            except (redis.RedisError, OSError) as e:
                if not down:
                    log.warning("broker_unreachable", broker=safe_url(self.settings.redis_url),
                                error=str(e)[:200],
                                note="ingest paused; projections go on by sweep")
                down = True
            except Exception:
                log.exception("housekeeping_failed")
            self._stop.wait(HEARTBEAT_INTERVAL_S)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


# -- running and supervising --------------------------------------------------------------

def _install_stop(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def serve(settings: Settings, index: int = 0) -> int:
    """Run one worker process until SIGTERM/SIGINT; returns the exit status."""
    stop = asyncio.Event()
    _install_stop(asyncio.get_running_loop(), stop)
    proc = WorkerProcess(settings, index)
    await asyncio.to_thread(proc.start)
    await stop.wait()
    await asyncio.to_thread(proc.stop)
    return 0


def _child_main(settings: Settings, index: int, parent: int) -> None:
    """Entry point of a spawned worker process."""
    with contextlib.suppress(OSError, AttributeError):
        # Linux: be told (SIGTERM) when the supervisor dies, even by SIGKILL.
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != parent:
        return
    configure_logging()
    asyncio.run(serve(settings, index))  # serve returns 0: a normal return is exit 0


def roles(settings: Settings) -> list[Settings]:
    """The settings of each worker process of a daemon.

    With both queues and several processes, the first process projects (project queue
    and sweep, at most `PROJECT_THREADS` threads: its messages are only wake-ups) and
    the others ingest: the two jobs then use separate cores instead of taking turns on
    one process's loop. Otherwise every process does what was asked.
    """
    one = replace(settings, processes=1)
    n = settings.processes
    if n == 1 or not (settings.projects and settings.ingests):
        return [one] * n
    project = replace(one, queues=(PROJECT_QUEUE,), threads=min(one.threads, PROJECT_THREADS))
    return [project] + [replace(one, queues=(INGEST_QUEUE,))] * (n - 1)


async def supervise(settings: Settings) -> int:
    """Run `settings.processes` worker processes; exit 1 when one dies (supervisor restarts)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_child_main, args=(s, i, os.getpid()),
                         name=f"memledger-worker-{i}") for i, s in enumerate(roles(settings))]
    stop = asyncio.Event()
    _install_stop(asyncio.get_running_loop(), stop)
    for p in procs:
        p.start()
    log.info("supervisor_started", processes=[p.pid for p in procs])
    status = 0
    while not stop.is_set():
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            log.error("worker_process_died", pids=[p.pid for p in dead],
                      exit_codes=[p.exitcode for p in dead],
                      note="stopping the others; let the service manager restart the daemon")
            status = 1
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    for p in procs:
        if p.is_alive():
            p.terminate()  # SIGTERM: graceful
    for p in procs:
        await asyncio.to_thread(p.join, STOP_TIMEOUT_MS / 1000 + 10)
        if p.is_alive():
            p.kill()
    return status


async def run(settings: Settings) -> int:
    """`memledger worker`: one process in place, or a supervisor of several."""
    configure_logging()
    if settings.processes == 1:
        return await serve(settings)
    return await supervise(settings)
