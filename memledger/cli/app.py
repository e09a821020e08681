"""The app commands: what an agent app calls (append, publish, get, recall, history, tasks).

`get`, `recall`, `history` and `tasks` are principal-scoped (`--as TENANT/USER`, and
`--as-of` to read the past); `append` and
`publish` take events in the wire format, one JSON object per line.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ledger.errors import MemledgerError, ValidationError
from ledger.events import Event
from ledger.records import AppendResult
from ledger.store import Store
from ledger.validation import decode_event
from memledger.cli.common import (
    REDIS_HELP,
    Audience,
    open_ledger,
    open_store,
    out,
    read_lines,
    say,
)

TITLE = "app commands (what agent apps call)"

#: The principal's flag, for errors about the principal.
AS_FLAG = {"principal": "--as", "as_of": "--as-of"}

#: Lines appended together (one shared transaction) before their results are printed.
APPEND_CHUNK = 1000
#: Lines validated between two chances for the chunk being committed to move on.
_YIELD_EVERY = 64

#: One line's outcome: the event, or why it was rejected.
_Line = tuple[int, Event | MemledgerError]


async def _commit_chunk(store: Store, chunk: list[_Line]) -> list[dict[str, Any]]:
    """Append a chunk's valid events and return one result line per input line.

    The chunk goes in as one request (one transaction); only if that is refused is each
    line appended as a request of its own (still grouped into shared transactions), so
    a rejected line never blocks the others and every line gets its own answer.
    """
    events = [x for _, x in chunk if isinstance(x, Event)]
    results: list[AppendResult | BaseException] = []
    if events:
        try:
            results = list(await store.append(events))
        except MemledgerError:
            results = await asyncio.gather(*(store.append_one(ev) for ev in events),
                                           return_exceptions=True)
    lines: list[dict[str, Any]] = []
    got = iter(results)
    for n, x in chunk:
        res: AppendResult | BaseException = next(got) if isinstance(x, Event) else x
        if isinstance(res, BaseException):
            if not isinstance(res, MemledgerError):
                raise res
            lines.append({"line": n, "status": "rejected", "position": None,
                          "error": str(res)})
            continue
        line: dict[str, Any] = {"line": n, "status": res.status, "position": res.position}
        if res.suppressed:
            line["suppressed"] = True
        lines.append(line)
    return lines


async def cmd_append(args: argparse.Namespace) -> int:
    """Append events from JSON Lines; one result line per input line.

    Lines are validated while the previous chunk commits (validation, secret scanning
    included, is most of the work), and a chunk's lines share one transaction."""
    store = open_store(args)
    rejected = 0
    try:
        await store.open()
        chunk: list[_Line] = []
        inflight: asyncio.Task[list[dict[str, Any]]] | None = None

        async def report(task: asyncio.Task[list[dict[str, Any]]] | None) -> None:
            nonlocal rejected
            if task is None:
                return
            for line in await task:
                rejected += line["status"] == "rejected"
                out(line)

        for n, raw in read_lines(args.file):
            try:
                chunk.append((n, decode_event(raw)))
            except ValidationError as e:
                chunk.append((n, e))
            if len(chunk) >= APPEND_CHUNK:
                await report(inflight)
                inflight = asyncio.ensure_future(_commit_chunk(store, chunk))
                chunk = []
            elif inflight is not None and len(chunk) % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
        await report(inflight)
        await report(asyncio.ensure_future(_commit_chunk(store, chunk)))
    finally:
        await store.close()
    if rejected:
        say(f"{rejected} line(s) rejected")
    return 1 if rejected else 0


async def cmd_publish(args: argparse.Namespace) -> int:
    """Validate and publish events; one result line per input line."""
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


async def cmd_get(args: argparse.Namespace) -> int:
    """The active value of a key for a principal."""
    async with open_ledger(args) as ml:
        who = ml.principal(args.as_)
        ns = args.namespace.split("/")
        m = None
        if ns[:2] == [who.tenant, who.user]:  # another user's namespace: nothing to say
            m = await who.get(ns[2:], args.key, task=args.task, session=args.session,
                              as_of=args.as_of)
        out(m.to_dict() if m is not None else {"found": False})
    return 0


async def cmd_history(args: argparse.Namespace) -> int:
    """Every version of a key the principal owns, oldest first."""
    async with open_ledger(args) as ml:
        who = ml.principal(args.as_)
        ns = args.namespace.split("/")
        versions = []
        if ns[:2] == [who.tenant, who.user]:
            versions = await who.history(ns[2:], args.key, as_of=args.as_of)
        out({"versions": [v.to_dict() for v in versions]})
    return 0


async def cmd_tasks(args: argparse.Namespace) -> int:
    """The principal's task summaries."""
    async with open_ledger(args) as ml:
        tasks = await ml.principal(args.as_).tasks(include_closed=args.all, as_of=args.as_of)
        out({"tasks": [x.to_dict() for x in tasks]})
    return 0


async def cmd_recall(args: argparse.Namespace) -> int:
    """Memories and tasks to put before a model turn."""
    if args.limit < 1:
        raise ValidationError("--limit", "must be at least 1")
    if args.budget is not None and args.budget < 0:
        raise ValidationError("--budget", "must be >= 0")
    async with open_ledger(args) as ml:
        got = await ml.principal(args.as_).recall(args.query, session=args.session,
                                                  task=args.task, budget=args.budget,
                                                  limit=args.limit, as_of=args.as_of)
        out(got.to_dict())
    return 0


def _principal(p: argparse.ArgumentParser) -> None:
    p.add_argument("--as", dest="as_", required=True, metavar="TENANT/USER",
                   help="the authenticated principal")
    p.add_argument("--as-of", metavar="TIME|position:N",
                   help="read as the ledger held it then: an RFC 3339 time (by recording "
                        "time) or a ledger position (docs/projections.md#as-of)")


def add_commands(aud: Audience) -> None:
    """Add the app commands."""
    a = aud.command("append", "append events from a JSON Lines file or - (stdin)", cmd_append)
    a.add_argument("file")

    p = aud.command("publish", "send events (JSON Lines file or -) to the workers", cmd_publish)
    p.add_argument("file")
    p.add_argument("--redis", default=None, help=REDIS_HELP)
    p.add_argument("--batch", type=int, default=100, help="events per broker message")

    g = aud.command("get", "the active value of a key for a principal", cmd_get, flags=AS_FLAG)
    _principal(g)
    g.add_argument("--namespace", required=True, help="a/b/c")
    g.add_argument("--key", required=True)
    g.add_argument("--task")
    g.add_argument("--session")

    r = aud.command("recall", "memories and tasks to put before a model turn", cmd_recall,
                    flags=AS_FLAG)
    _principal(r)
    r.add_argument("--session")
    r.add_argument("--task")
    r.add_argument("--query")
    r.add_argument("--budget", type=int)
    r.add_argument("--limit", type=int, default=20)

    h = aud.command("history", "every version of a key, oldest first; forgotten ones "
                               "redacted", cmd_history, flags=AS_FLAG)
    _principal(h)
    h.add_argument("--namespace", required=True, help="a/b/c")
    h.add_argument("--key", required=True)

    tk = aud.command("tasks", "the principal's task summaries", cmd_tasks, flags=AS_FLAG)
    _principal(tk)
    tk.add_argument("--all", action="store_true", help="include closed tasks")
