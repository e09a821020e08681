"""Operator subcommands: `replay rebuild|audit|verify`, `backup`, `restore` (CONTRACT.md 2).

Loaded by `replay.cli` through `register`. Each handler opens the store, calls one
function of `replay.rebuild`, `replay.audit`, `replay.verify` or `replay.backup`, prints
one JSON object on stdout and returns the exit code; progress goes to stderr.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ledger.errors import ValidationError
from replay.cli import Handler, open_store, out, say


def _add_parsers(sub: Any) -> None:
    rp = sub.add_parser("replay", help="rebuild views, audit history, verify integrity")
    actions = rp.add_subparsers(dest="action", required=True, metavar="ACTION")

    rb = actions.add_parser("rebuild", help="drop and rebuild views from the ledger, after "
                                            "reapplying the forget register")
    rb.add_argument("--projection", action="append", metavar="NAME",
                    help="rebuild only this projection (repeatable; default: all)")
    rb.add_argument("--restart", action="store_true",
                    help="start over even if an interrupted rebuild could be resumed")
    rb.add_argument("--batch-size", type=int, default=4000,
                    help="events, slots, tasks or entries per transaction (default 4000)")
    rb.add_argument("--event-by-event", action="store_true",
                    help="replay each view as the live projections do instead of bulk "
                         "loading it (slower; the same rows)")
    rb.add_argument("--quiet", action="store_true", help="no progress on stderr")

    au = actions.add_parser("audit", help="the history of a memory, key or task, and the "
                                          "recalls that used it")
    target = au.add_mutually_exclusive_group(required=True)
    target.add_argument("--memory-id")
    target.add_argument("--namespace", help="a/b/c (with --key)")
    target.add_argument("--task", help="a task key")
    target.add_argument("--audit-id", help="show one recall audit record")
    au.add_argument("--key", help="the key within --namespace")
    au.add_argument("--tenant", help="only this tenant")

    ve = actions.add_parser("verify", help="hash chain, digests, positions, tombstones, and "
                                           "views against a fresh replay")
    ve.add_argument("--forgotten", action="store_true",
                    help="instead prove that no view, index or payload holds content a "
                         "tombstone covers")
    ve.add_argument("--no-catch-up", action="store_true",
                    help="check the views as they are (default: project to the head first)")
    ve.add_argument("--no-views", action="store_true",
                    help="check the ledger only, not the views")
    ve.add_argument("--limit", type=int, default=50, help="problems to list (all are counted)")

    bk = sub.add_parser("backup", help="one consistent, portable, checksummed backup file, "
                                       "taken online (.gz: compressed)")
    bk.add_argument("path")
    bk.add_argument("--quiet", action="store_true", help="no progress on stderr")

    rs = sub.add_parser("restore", help="restore a backup, reapply the forget register, "
                                        "rebuild the views")
    rs.add_argument("path")
    rs.add_argument("--force", action="store_true",
                    help="replace the contents of a non-empty database")
    rs.add_argument("--without-register", action="store_true",
                    help="go on even though the forget register is missing (forgets "
                         "recorded after the backup are then not reapplied)")
    rs.add_argument("--quiet", action="store_true", help="no progress on stderr")


async def cmd_rebuild(args: argparse.Namespace) -> int:
    """Reapply the forget register, drop the views, replay them with progress."""
    from replay.rebuild import rebuild

    if args.batch_size < 1:
        say("error: --batch-size must be at least 1")
        return 2
    store = open_store(args)
    try:
        try:
            res = await rebuild(store, args.projection, restart=args.restart,
                                batch_size=args.batch_size, progress=not args.quiet,
                                bulk=not args.event_by_event)
        except ValidationError as e:
            if e.field != "--projection":
                raise
            say(f"error: {e}")
            return 2
        out(res)
    finally:
        await store.close()
    return 0


async def cmd_audit(args: argparse.Namespace) -> int:
    """Print the history of one subject, or one recall audit record."""
    from replay.audit import audit, audit_record

    if (args.namespace is None) != (args.key is None):
        say("error: --namespace and --key go together")
        return 2
    store = open_store(args)
    try:
        if args.audit_id is not None:
            out(await audit_record(store, args.audit_id))
        else:
            ns = args.namespace.split("/") if args.namespace else None
            out(await audit(store, memory_id=args.memory_id, namespace=ns, key=args.key,
                            task=args.task, tenant=args.tenant))
    finally:
        await store.close()
    return 0


async def cmd_verify(args: argparse.Namespace) -> int:
    """Check integrity (or erasure with --forgotten); exit 1 on any problem."""
    from replay.verify import verify
    from replay.verify.forgotten import verify_forgotten

    store = open_store(args)
    try:
        if args.forgotten:
            res = await verify_forgotten(store, catch_up=not args.no_catch_up,
                                         limit=args.limit)
        else:
            res = await verify(store, catch_up=not args.no_catch_up, views=not args.no_views,
                               limit=args.limit)
        out(res)
    finally:
        await store.close()
    if not res["ok"]:
        say(f"verify failed: {res['problem_count']} problem(s)")
        return 1
    return 0


async def cmd_backup(args: argparse.Namespace) -> int:
    """Write a backup file while the ledger stays online."""
    from replay.backup import backup

    store = open_store(args)
    try:
        res = await backup(store, args.path, progress=not args.quiet)
        out(res)
    finally:
        await store.close()
    say(f"backup of {sum(res['counts'].values()):,} rows at position {res['position']} "
        f"written to {res['path']}")
    return 0


async def cmd_restore(args: argparse.Namespace) -> int:
    """Restore a backup into the configured database."""
    from replay.backup import restore

    store = open_store(args)
    try:
        res = await restore(store, args.path, force=args.force,
                            without_register=args.without_register, progress=not args.quiet)
        out(res)
    finally:
        await store.close()
    re = res["reapplied"]
    say(f"restored position {res['restored']['position']}; forget register: "
        f"{re['entries']} entries, {len(re['appended'])} appended, "
        f"{re['payloads_erased']} payloads erased; views rebuilt to {res['head']}")
    return 0


def register(extensions: list[Callable[[Any], None]],
             command: Callable[[str], Callable[[Handler], Handler]]) -> None:
    """Add the subparsers and handlers of this package to the `memledger` CLI."""
    extensions.append(_add_parsers)
    command("replay rebuild")(cmd_rebuild)
    command("replay audit")(cmd_audit)
    command("replay verify")(cmd_verify)
    command("backup")(cmd_backup)
    command("restore")(cmd_restore)
