"""The worker commands: the worker daemon and the dead letters it leaves (docs/workers.md).

The broker's health is part of `memledger status` (operator); apps publish with
`memledger publish` (app).
"""

from __future__ import annotations

import argparse

from memledger.cli.common import REDIS_HELP, Audience, open_store, out, say
from workers.names import DEFAULT_THREADS, QUEUES

TITLE = "worker commands (the daemons that ingest published events and project)"


async def cmd_worker(args: argparse.Namespace) -> int:
    """Run the worker daemon until SIGTERM."""
    from workers.broker import redis_url
    from workers.daemon import run
    from workers.runtime import Settings

    # The same limits as `Settings`, worded with the flags.
    if args.processes < 1 or args.threads < 1:
        say("error: --processes and --threads must be at least 1")
        return 2
    if args.sweep_interval <= 0:
        say("error: --sweep-interval must be positive")
        return 2
    try:
        settings = Settings(redis_url=redis_url(args.redis), db_url=args.db,
                            register_path=args.forget_register,
                            queues=tuple(dict.fromkeys(args.queues)),
                            processes=args.processes, threads=args.threads,
                            sweep_interval=args.sweep_interval)
    except ValueError as e:
        say(f"error: {e}")
        return 2
    return await run(settings)


async def cmd_dead_letters(args: argparse.Namespace) -> int:
    """List dead letters (events the workers rejected), oldest first."""
    from workers.ingest import list_dead_letters

    store = open_store(args)
    try:
        items = await list_dead_letters(store, tenant=args.tenant, limit=args.limit)
    finally:
        await store.close()
    out({"dead_letters": items, "count": len(items)})
    return 0


def add_commands(aud: Audience) -> None:
    """Add the worker commands."""
    w = aud.command("worker", "run the worker daemon: ingest, projections, sweep", cmd_worker)
    w.add_argument("--processes", type=int, default=1,
                   help="worker processes (default 1; more: this process supervises them)")
    w.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help=f"worker threads per process (default {DEFAULT_THREADS}; each holds "
                   "one message until its events are committed)")
    w.add_argument("--queues", nargs="+", choices=QUEUES, default=list(QUEUES),
                   help="queues to consume (default both: ingest project)")
    w.add_argument("--sweep-interval", type=float, default=2.0,
                   help="seconds between catch-up sweeps of the projections")
    w.add_argument("--redis", default=None, help=REDIS_HELP)

    d = aud.command("dead-letters", "list events the workers rejected", cmd_dead_letters)
    d.add_argument("--tenant")
    d.add_argument("--limit", type=int, default=1000)
