"""Subcommands of the workers: `publish`, `worker`, `dead-letters` (CONTRACT.md 2).

Registered into `memledger` by `replay.cli` through `register(extensions, command)`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from workers.broker import DEFAULT_THREADS, QUEUES

REDIS_HELP = "broker URL (default $MEMLEDGER_REDIS_URL or redis://127.0.0.1:6379/0)"


def _parsers(sub: Any) -> None:
    p = sub.add_parser("publish", help="send events (JSON Lines file or -) to the workers")
    p.add_argument("file")
    p.add_argument("--redis", default=None, help=REDIS_HELP)
    p.add_argument("--batch", type=int, default=100, help="events per broker message")

    w = sub.add_parser("worker", help="run the worker daemon: ingest, projections, sweep")
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

    d = sub.add_parser("dead-letters", help="list events the workers rejected")
    d.add_argument("--tenant")
    d.add_argument("--limit", type=int, default=1000)


async def cmd_publish(args: argparse.Namespace) -> int:
    """Validate and publish events; one result line per input line."""
    from replay.cli import out, read_lines, say
    from workers.publish import Publisher

    if args.batch < 1:
        say("error: --batch must be at least 1")
        return 2
    counts = {"published": 0, "rejected": 0, "not_sent": 0}
    with Publisher(args.redis, batch_size=args.batch) as pub:
        for res in pub.publish_numbered(read_lines(args.file)):
            counts[res.status] += 1
            out(res.to_json())
    if counts["rejected"] or counts["not_sent"]:
        say(f"{counts['published']} published, {counts['rejected']} rejected, "
            f"{counts['not_sent']} not sent (broker unavailable)")
        return 1
    return 0


async def cmd_worker(args: argparse.Namespace) -> int:
    """Run the worker daemon until SIGTERM."""
    from replay.cli import say
    from workers.broker import redis_url
    from workers.daemon import run
    from workers.runtime import Settings

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
    from replay.cli import open_store, out
    from workers.ingest import list_dead_letters

    store = open_store(args)
    try:
        items = await list_dead_letters(store, tenant=args.tenant, limit=args.limit)
    finally:
        await store.close()
    out({"dead_letters": items, "count": len(items)})
    return 0


def register(extensions: list[Callable[[Any], None]], command: Any) -> None:
    """Add the workers' subcommands to `memledger`."""
    extensions.append(_parsers)
    command("publish")(cmd_publish)
    command("worker")(cmd_worker)
    command("dead-letters")(cmd_dead_letters)
