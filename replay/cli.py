"""The `memledger` command line (CONTRACT.md section 2).

Every command prints JSON on stdout (one object, or one per line where it says
lines), human messages on stderr, and exits 0 on success, 1 on rejected input or a
failed check, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, BinaryIO

import orjson

from ledger.errors import MemledgerError, ValidationError
from ledger.logs import configure
from ledger.store import Store
from ledger.validation import decode_event

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
_COMMANDS: dict[str, Handler] = {}


def out(obj: Any) -> None:
    """Print one JSON object on stdout."""
    sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
    sys.stdout.flush()


def say(msg: str) -> None:
    """Print a human message on stderr."""
    print(msg, file=sys.stderr, flush=True)


def command(name: str) -> Callable[[Handler], Handler]:
    """Register a subcommand handler."""
    def deco(fn: Handler) -> Handler:
        _COMMANDS[name] = fn
        return fn
    return deco


def open_store(args: argparse.Namespace) -> Store:
    """The store named by --db / MEMLEDGER_DB_URL, with its forget register."""
    return Store(args.db, register_path=getattr(args, "forget_register", None))


def now_us() -> int:
    """Microseconds since the epoch."""
    return time.time_ns() // 1000


def read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for every non-blank line of a file or stdin."""
    stream: BinaryIO = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    try:
        for n, line in enumerate(stream, start=1):
            if line.strip():
                yield n, line
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


@command("append")
async def cmd_append(args: argparse.Namespace) -> int:
    """Append events from JSON Lines; one result line per input line."""
    store = open_store(args)
    rejected = 0
    try:
        await store.open()
        pending: list[tuple[int, Any]] = []

        async def flush() -> None:
            nonlocal rejected
            results = await asyncio.gather(*(store.append([ev]) for _, ev in pending),
                                           return_exceptions=True)
            for (n, _), res in zip(pending, results, strict=True):
                if isinstance(res, BaseException):
                    if not isinstance(res, MemledgerError):
                        raise res
                    rejected += 1
                    out({"line": n, "status": "rejected", "position": None, "error": str(res)})
                else:
                    r = res[0]
                    line: dict[str, Any] = {"line": n, "status": r.status, "position": r.position}
                    if r.suppressed:
                        line["suppressed"] = True
                    out(line)
            pending.clear()

        for n, raw in read_lines(args.file):
            try:
                ev = decode_event(raw)
            except ValidationError as e:
                await flush()
                rejected += 1
                out({"line": n, "status": "rejected", "position": None, "error": str(e)})
                continue
            pending.append((n, ev))
            if len(pending) >= 500:
                await flush()
        await flush()
    finally:
        await store.close()
    if rejected:
        say(f"{rejected} line(s) rejected")
    return 1 if rejected else 0


@command("project")
async def cmd_project(args: argparse.Namespace) -> int:
    """Run every projection in this process until caught up."""
    from projections.runner import Runner

    store = open_store(args)
    try:
        runner = Runner(store, batch_size=args.batch_size)
        applied = await runner.catch_up()
        out({"applied": applied, "positions": await runner.positions(),
             "head": await store.head()})
    finally:
        await store.close()
    return 0


@command("sweep")
async def cmd_sweep(args: argparse.Namespace) -> int:
    """Purge closed tasks past their retention, then project."""
    from projections.retention import sweep_retention
    from projections.runner import Runner

    store = open_store(args)
    try:
        purged = await sweep_retention(store)
        await Runner(store).catch_up()
        out({"purged": [{"tenant": a, "task_key": b} for a, b in purged]})
    finally:
        await store.close()
    return 0


async def status_report(store: Store) -> dict[str, Any]:
    """Head, per-projection position and lag, and what else the ledger knows."""
    from sqlalchemy import func, select

    from ledger import schema as t
    from projections.runner import BULK_SUFFIX, REBUILD_MARKER, Runner

    runner = Runner(store)
    head = await store.head()
    positions = await runner.positions()
    async with store.read() as conn:
        dead = int((await conn.execute(select(func.count()).select_from(t.dead_letters)))
                   .scalar() or 0)
        forgets = int((await conn.execute(select(func.count()).select_from(t.tombstones)))
                      .scalar() or 0)
        m = t.meta.c
        meta = {r[0]: r[1] for r in (await conn.execute(select(m.name, m.value).where(
            m.name.startswith(REBUILD_MARKER, autoescape=True)
            | m.name.endswith(BULK_SUFFIX, autoescape=True)))).all()}
    projections: dict[str, Any] = {}
    for n, p in positions.items():
        projections[n] = {"position": p, "lag": head - p}
        if REBUILD_MARKER + n in meta:
            projections[n]["rebuilding_since"] = meta[REBUILD_MARKER + n]
        if n + BULK_SUFFIX in meta:
            load = orjson.loads(meta[n + BULK_SUFFIX])
            projections[n]["bulk_load"] = {"head": load.get("head"),
                                           "phase": load.get("phase")}
    report: dict[str, Any] = {
        "head": head,
        "projections": projections,
        "backend": store.dialect,
        "tombstones": forgets,
        "dead_letters": dead,
        "forget_register": str(store.register.path),
    }
    try:
        health = importlib.import_module("workers.health")
    except ImportError:
        return report
    report.update(await health.broker_report())
    return report


@command("status")
async def cmd_status(args: argparse.Namespace) -> int:
    """Print the head position and each projection's position and lag."""
    store = open_store(args)
    try:
        await store.open()
        out(await status_report(store))
    finally:
        await store.close()
    return 0


def open_ledger(args: argparse.Namespace) -> Any:
    """The SDK facade on the store named by the arguments (principal-scoped reads)."""
    from memledger import MemoryLedger

    return MemoryLedger(args.db, register_path=getattr(args, "forget_register", None))


@command("get")
async def cmd_get(args: argparse.Namespace) -> int:
    """The active value of a key for a principal."""
    async with open_ledger(args) as ml:
        who = ml.principal(args.as_)
        ns = args.namespace.split("/")
        m = None
        if ns[:2] == [who.tenant, who.user]:  # another user's namespace: nothing to say
            m = await who.get(ns[2:], args.key, task=args.task, session=args.session)
        out(m.to_dict() if m is not None else {"found": False})
    return 0


@command("tasks")
async def cmd_tasks(args: argparse.Namespace) -> int:
    """The principal's task summaries."""
    async with open_ledger(args) as ml:
        tasks = await ml.principal(args.as_).tasks(include_closed=args.all)
        out({"tasks": [x.to_dict() for x in tasks]})
    return 0


@command("recall")
async def cmd_recall(args: argparse.Namespace) -> int:
    """Memories and tasks to put before a model turn."""
    from projections.recall import recall

    if args.limit < 1:
        raise ValidationError("--limit", "must be at least 1")
    if args.budget is not None and args.budget < 0:
        raise ValidationError("--budget", "must be >= 0")
    store = open_store(args)
    try:
        out(await recall(store, args.as_, query=args.query, session=args.session,
                         task=args.task, budget=args.budget, limit=args.limit,
                         now_us=now_us()))
    finally:
        await store.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="memledger", description=__doc__.split("\n")[0])
    p.add_argument("--db", default=os.environ.get("MEMLEDGER_DB_URL"),
                   help="database URL (default $MEMLEDGER_DB_URL or "
                        "sqlite+aiosqlite:///./memledger.db)")
    p.add_argument("--forget-register", default=None,
                   help="forget register file (default $MEMLEDGER_FORGET_REGISTER or "
                        "<sqlite path>.forgets)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    a = sub.add_parser("append", help="append events from a JSON Lines file or - (stdin)")
    a.add_argument("file")
    pj = sub.add_parser("project", help="run every projection in this process until caught up")
    pj.add_argument("--batch-size", type=int, default=1000, help="events per transaction")
    sub.add_parser("status", help="head position, projection lag, broker health")
    sub.add_parser("sweep", help="purge closed tasks past retain_until (R6, R28), then project")

    def principal(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--as", dest="as_", required=True, metavar="TENANT/USER",
                        help="the authenticated principal")

    g = sub.add_parser("get", help="the active value of a key for a principal")
    principal(g)
    g.add_argument("--namespace", required=True, help="a/b/c")
    g.add_argument("--key", required=True)
    g.add_argument("--task")
    g.add_argument("--session")
    r = sub.add_parser("recall", help="memories and tasks to put before a model turn")
    principal(r)
    r.add_argument("--session")
    r.add_argument("--task")
    r.add_argument("--query")
    r.add_argument("--budget", type=int)
    r.add_argument("--limit", type=int, default=20)
    tk = sub.add_parser("tasks", help="the principal's task summaries")
    principal(tk)
    tk.add_argument("--all", action="store_true", help="include closed tasks")
    for extra in _EXTENSIONS:
        extra(sub)
    return p


_EXTENSIONS: list[Callable[[Any], None]] = []


def _load_extensions() -> None:
    """Subcommands that live with their packages (replay, workers)."""
    for mod in ("replay.commands", "workers.commands"):
        try:
            m = __import__(mod, fromlist=["register"])
        except ImportError as e:
            if e.name != mod:
                raise
            continue
        m.register(_EXTENSIONS, command)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `memledger` console script."""
    _load_extensions()
    configure()
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = _COMMANDS[args.command if args.command != "replay" else f"replay {args.action}"]
    try:
        return asyncio.run(handler(args))
    except ValidationError as e:
        say(f"error: {e}")
        out({"error": str(e)})
        return 1
    except MemledgerError as e:
        say(f"error: {e}")
        out({"error": str(e)})
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
