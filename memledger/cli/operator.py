"""The operator commands: status, project, sweep, replay rebuild|retry-quarantined|audit|verify,
db upgrade|current|check|downgrade, shards show|set, config show|get|set, backup, restore,
vault status|encrypt.

Whoever runs them holds the database credentials, so they take no `--as` (some take
`--tenant` to narrow). Each opens the store, calls one function of `projections` or
`replay`, prints its result as one JSON object and returns the exit code; progress goes
to stderr (docs/operations.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledger.errors import ValidationError
from ledger.register import DAMAGED_POLICIES
from memledger.cli.common import Audience, error_message, handles, open_store, out, progress_of, say

TITLE = "operator commands (whoever holds the database credentials)"


async def cmd_status(args: argparse.Namespace) -> int:
    """Print the head position, each projection's position and lag, and broker health."""
    from replay.status import status_report
    from workers.health import broker_report

    store = open_store(args)
    try:
        await store.open()
        report = await status_report(store)
    finally:
        await store.close()
    report.update(await broker_report())
    out(report)
    return 0


async def cmd_project(args: argparse.Namespace) -> int:
    """Run every projection in this process until caught up."""
    from projections import matrix_snapshot
    from projections.runner import Runner

    if args.batch_size is not None and args.batch_size < 1:
        say("error: --batch-size must be at least 1")
        return 2
    store = open_store(args)
    try:
        runner = Runner(store, batch_size=args.batch_size)
        applied = await runner.catch_up()
        out({"applied": applied, "positions": await runner.positions(),
             "head": await store.head()})
    finally:
        await matrix_snapshot.settled()  # recall's snapshot files the catch-up writes
        await store.close()
    return 0


async def cmd_sweep(args: argparse.Namespace) -> int:
    """Purge closed tasks past their retention, then project."""
    from projections import matrix_snapshot
    from projections.retention import sweep_retention
    from projections.runner import Runner

    store = open_store(args)
    try:
        purged = await sweep_retention(store)
        await Runner(store).catch_up()
        out({"purged": [{"tenant": a, "task_key": b} for a, b in purged]})
    finally:
        await matrix_snapshot.settled()
        await store.close()
    return 0


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
                                batch_size=args.batch_size, progress=progress_of(args),
                                bulk=not args.event_by_event)
        except ValidationError as e:
            if e.field != "projection":
                raise
            say(f"error: {error_message(e, args)}")  # a name not on the list: usage
            return 2
        out(res)
    finally:
        await store.close()
    return 0


async def cmd_retry_quarantined(args: argparse.Namespace) -> int:
    """Apply the events a projection quarantined again; print what cleared."""
    from replay.rebuild import retry_quarantined

    store = open_store(args)
    try:
        try:
            res = await retry_quarantined(store, args.projection)
        except ValidationError as e:
            if e.field != "projection":
                raise
            say(f"error: {error_message(e, args)}")  # a name not on the list: usage
            return 2
        out(res)
    finally:
        await store.close()
    return 0


async def cmd_audit(args: argparse.Namespace) -> int:
    """Print the history of one subject, or one recall audit record."""
    from replay.audit import audit, audit_as_of, audit_record

    if (args.namespace is None) != (args.key is None):
        say("error: --namespace and --key go together")
        return 2
    if args.as_of is not None and args.memory_id is None:
        say("error: --as-of goes with --memory-id")
        return 2
    store = open_store(args)
    try:
        if args.as_of is not None:
            out(await audit_as_of(store, args.memory_id, args.as_of, tenant=args.tenant))
        elif args.audit_id is not None:
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
        res = await backup(store, args.path, force=args.force, progress=progress_of(args))
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
                            without_register=args.without_register,
                            register_damaged=args.register_damaged,
                            envelopes_only=args.envelopes_only,
                            progress=progress_of(args))
        out(res)
    finally:
        await store.close()
    re = res["reapplied"]
    say(f"restored position {res['restored']['position']}; forget register: "
        f"{re['entries']} entries, {len(re['appended'])} appended, "
        f"{re['payloads_erased']} payloads erased; views rebuilt to {res['head']}")
    v = res["vault"]
    if v["envelopes_only"]:
        say(f"envelopes only: the key store is not here, {v['unreadable_no_key']} "
            "encrypted payloads were restored sealed and cannot be read")
    elif v["redacted_key_destroyed"]:
        say(f"{v['redacted_key_destroyed']} payloads restored redacted: their keys were "
            "destroyed by a forget")
    return 0


async def cmd_vault_status(args: argparse.Namespace) -> int:
    """Say whether content is sealed, where the key store is, and what is still in clear."""
    from replay.encrypt import count_in_clear

    store = open_store(args)
    try:
        await store.open()
        v = store.vault
        report: dict[str, Any] = {"vault": v is not None,
                                  "in_clear": await count_in_clear(store)}
        if v is not None:
            report.update({"key_store": v.keys.kind, "where": v.keys.where(),
                           "exists": v.keys.exists(), "wrapping": v.keys.wrapper.name})
    finally:
        await store.close()
    out(report)
    return 0


async def cmd_vault_encrypt(args: argparse.Namespace) -> int:
    """Seal every content payload still in clear, rebuild the views, compact the files."""
    from replay.encrypt import encrypt_ledger

    store = open_store(args)
    try:
        res = await encrypt_ledger(store, batch=args.batch_size, compact=not args.no_compact,
                                   progress=progress_of(args))
    finally:
        await store.close()
    out(res)
    say(f"{res['sealed']:,} payloads sealed, {res['erased']:,} erased (key destroyed); "
        f"{res['in_clear_left']:,} left in clear")
    return 0


async def cmd_shards_show(args: argparse.Namespace) -> int:
    """Print S, each shard's lease holder, and where each projection's shards stand."""
    from replay.status import status_report

    store = open_store(args)
    try:
        await store.open()
        report = await status_report(store)
    finally:
        await store.close()
    out({"shards": report["shards"], "head": report["head"],
         "projections": {n: {"slowest_shard_lag": p["slowest_shard_lag"],
                             "shards": p["shards"]}
                         for n, p in report["projections"].items()}})
    return 0


async def cmd_shards_set(args: argparse.Namespace) -> int:
    """Record a new number of shards per projection and rebuild every view."""
    from replay.rebuild import set_shards

    store = open_store(args)
    try:
        try:
            res = await set_shards(store, args.count, progress=progress_of(args))
        except ValidationError as e:
            if e.field != "shards":
                raise
            say(f"error: {error_message(e, args)}")
            return 2
        out(res)
    finally:
        await store.close()
    return 0


async def cmd_config(args: argparse.Namespace) -> int:
    """The ledger's recorded settings: show them all, get one, or set one."""
    from replay import config

    store = open_store(args)
    try:
        if args.action == "show":
            out(await config.show(store))
            return 0
        if args.setting not in config.SETTINGS:
            say(f"error: unknown setting {args.setting!r}: use one of "
                f"{', '.join(config.SETTINGS)}")
            return 2
        if args.action == "get":
            out(await config.embedder_report(store))
            return 0
        try:
            res = await config.set_embedder(store, args.value,
                                            rebuild_index=not args.no_rebuild,
                                            progress=progress_of(args))
        except ValidationError as e:
            if e.field != "embedder":
                raise
            say(f"error: {error_message(e, args)}")
            return 1
        out(res)
        if res.get("next"):
            say(f"embedder recorded; re-embed the index with: {res['next']}")
    finally:
        await store.close()
    return 0


def _add_config(aud: Audience) -> None:
    cf = aud.command("config", "the ledger's recorded settings (the embedder): show, get, "
                               "set (docs/recall.md#embedders)")
    actions = cf.add_subparsers(dest="action", required=True, metavar="ACTION")
    handles(actions.add_parser("show", help="every setting, where it comes from, and what "
                                            "the vector index holds"), cmd_config)
    gt = handles(actions.add_parser("get", help="one setting"), cmd_config)
    gt.add_argument("setting", help="embedder")
    st = handles(actions.add_parser(
        "set", help="record a setting; `set embedder NAME` (hashgram = hashgram-v2-512, "
                    "the default; hashgram-v1-512, with the bilingual concept list; minilm, "
                    "e5-small) then rebuilds the vector index with it"), cmd_config)
    st.add_argument("setting", help="embedder")
    st.add_argument("value", help="the embedder's name")
    st.add_argument("--no-rebuild", action="store_true",
                    help="record only; print the rebuild command to run later (recall "
                         "skips vectors of the old model meanwhile)")
    st.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _add_shards(aud: Audience) -> None:
    sh = aud.command("shards", "projection shards: show them, or set their number (with a "
                               "rebuild)")
    actions = sh.add_subparsers(dest="action", required=True, metavar="ACTION")
    handles(actions.add_parser("show", help="S, each shard's lease holder, position and "
                                            "lag per projection"), cmd_shards_show)
    st = handles(actions.add_parser(
        "set", help="split every projection into COUNT shards from now on, then rebuild "
                    "every view (docs/workers.md#shards)"), cmd_shards_set)
    st.add_argument("count", type=int, help="shards per projection (1 to 1024; default 16)")
    st.add_argument("--quiet", action="store_true", help="no progress on stderr")
async def cmd_db(args: argparse.Namespace) -> int:
    """Schema migrations: upgrade [--sql], current, check, downgrade."""
    from memledger import migrations

    url = args.db
    if args.action == "upgrade" and args.sql:
        # The script itself on stdout (to read, or to pipe into psql), not JSON.
        sys.stdout.write(migrations.upgrade_sql(url, args.revision, args.start))
        return 0
    if args.action == "current":
        out(await migrations.current(url))
        return 0
    if args.action == "check":
        res = await migrations.check(url)
        out(res)
        if not res["ok"]:
            say(f"db check failed: {len(res['differences'])} difference(s) between the "
                "models and the database")
            return 1
        return 0
    if args.action == "upgrade":
        res = await migrations.upgrade(url, args.revision)
    else:
        res = await migrations.downgrade(url, args.revision)
    out(res)
    say(f"database at revision {res['to']} ({len(res['steps'])} step(s) applied)")
    return 0


def _add_db(aud: Audience) -> None:
    db = aud.command("db", "schema migrations: upgrade, current, check, downgrade "
                           "(docs/operations.md#upgrading-schema-migrations)")
    actions = db.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = handles(actions.add_parser(
        "upgrade", help="upgrade the database to the head revision (or --revision); a "
                        "database made before migrations is recognised and stamped"), cmd_db)
    up.add_argument("--revision", default="head", help="target revision (default head)")
    up.add_argument("--sql", action="store_true",
                    help="print the SQL script for the database's dialect instead of running "
                         "it (from an empty database, or from --from)")
    up.add_argument("--from", dest="start", metavar="REVISION",
                    help="with --sql: the revision the database is at")
    handles(actions.add_parser("current", help="the database's revision and the head"), cmd_db)
    handles(actions.add_parser(
        "check", help="do the models and the database agree? exit 1 on any difference"), cmd_db)
    dn = handles(actions.add_parser(
        "downgrade", help="step back to --revision (default: one step), where each step "
                          "can go back"), cmd_db)
    dn.add_argument("--revision", default="-1", help="target revision (default -1: one step)")


def _add_replay(aud: Audience) -> None:
    rp = aud.command("replay", "rebuild views, audit history, verify integrity")
    actions = rp.add_subparsers(dest="action", required=True, metavar="ACTION")

    rb = handles(actions.add_parser(
        "rebuild", help="drop and rebuild views from the ledger, after reapplying the "
                        "forget register"), cmd_rebuild, {"projection": "--projection"})
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

    rq = handles(actions.add_parser(
        "retry-quarantined", help="apply again the events a projection could not apply "
                                  "and quarantined (docs/operations.md)"),
        cmd_retry_quarantined, {"projection": "--projection"})
    rq.add_argument("--projection", action="append", metavar="NAME",
                    help="retry only this projection's quarantine (repeatable; default: all)")

    au = handles(actions.add_parser(
        "audit", help="the history of a memory, key or task, and the recalls that used it"),
        cmd_audit, {"namespace": "--namespace", "tenant": "--tenant", "audit_id": "--audit-id",
                    "as_of": "--as-of"})
    target = au.add_mutually_exclusive_group(required=True)
    target.add_argument("--memory-id")
    target.add_argument("--namespace", help="a/b/c (with --key)")
    target.add_argument("--task", help="a task key")
    target.add_argument("--audit-id", help="show one recall audit record")
    au.add_argument("--key", help="the key within --namespace")
    au.add_argument("--tenant", help="only this tenant")
    au.add_argument("--as-of", metavar="TIME|position:N",
                    help="with --memory-id: the history up to that instant, what was active "
                         "then and which event made it so")

    ve = handles(actions.add_parser(
        "verify", help="hash chain, digests, positions, tombstones, and views against a "
                       "fresh replay"), cmd_verify)
    ve.add_argument("--forgotten", action="store_true",
                    help="instead prove that no view, index or payload holds content a "
                         "tombstone covers")
    ve.add_argument("--no-catch-up", action="store_true",
                    help="check the views as they are (default: project to the head first)")
    ve.add_argument("--no-views", action="store_true",
                    help="check the ledger only, not the views")
    ve.add_argument("--limit", type=int, default=50, help="problems to list (all are counted)")


def add_commands(aud: Audience) -> None:
    """Add the operator commands."""
    aud.command("status", "head position, projection lag, broker health", cmd_status)
    pj = aud.command("project", "run every projection in this process until caught up",
                     cmd_project)
    pj.add_argument("--batch-size", type=int, default=None,
                    help="events per transaction (default: the backend's, 1,000 on SQLite "
                         "and 4,000 on PostgreSQL)")
    aud.command("sweep", "purge closed tasks past retain_until (R6, R28), then project",
                cmd_sweep)
    _add_replay(aud)
    _add_shards(aud)
    _add_config(aud)
    _add_db(aud)

    bk = aud.command("backup", "one consistent, portable, checksummed backup file, taken "
                               "online (.gz: compressed)", cmd_backup)
    bk.add_argument("path", help="a new file, in an existing directory (or, with --force, "
                                 "an existing regular file to replace)")
    bk.add_argument("--force", action="store_true",
                    help="replace PATH if it is an existing regular file")
    bk.add_argument("--quiet", action="store_true", help="no progress on stderr")

    rs = aud.command("restore", "restore a backup, reapply the forget register, rebuild the "
                                "views", cmd_restore)
    rs.add_argument("path")
    rs.add_argument("--force", action="store_true",
                    help="replace the contents of a non-empty database")
    rs.add_argument("--without-register", action="store_true",
                    help="go on even though the forget register is missing (forgets "
                         "recorded after the backup are then not reapplied)")
    rs.add_argument("--register-damaged", choices=DAMAGED_POLICIES, default="refuse",
                    help="what to do with a damaged, torn, empty or foreign forget register: "
                         "refuse (default, nothing changes) or repair (keep its intact "
                         "entries, set the old file aside as .damaged)")
    rs.add_argument("--envelopes-only", action="store_true",
                    help="go on although the vault's key store is not here: encrypted "
                         "content is restored sealed and cannot be read (docs/forgetting.md)")
    rs.add_argument("--quiet", action="store_true", help="no progress on stderr")

    va = aud.command("vault", "per-subject encryption of content (docs/forgetting.md)")
    vact = va.add_subparsers(dest="action", required=True, metavar="ACTION")
    handles(vact.add_parser("status", help="is content sealed, where is the key store, "
                                           "what is still in clear"), cmd_vault_status)
    ve = handles(vact.add_parser(
        "encrypt", help="seal every content payload still in clear (resumable), rebuild "
                        "the views, compact the database files"), cmd_vault_encrypt)
    ve.add_argument("--batch-size", type=int, default=2000, help="events per transaction")
    ve.add_argument("--no-compact", action="store_true",
                    help="skip VACUUM (SQLite) / VACUUM FULL (PostgreSQL) at the end")
    ve.add_argument("--quiet", action="store_true", help="no progress on stderr")
