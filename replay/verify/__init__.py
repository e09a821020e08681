"""`replay verify`: the ledger is intact and every view equals a fresh replay.

First the backend's own integrity check of its files (`Recorder.integrity_check`:
SQLite `integrity_check`, PostgreSQL amcheck where this role may run it); if it finds
damage, the other checks are not run (they would read damaged pages) and verify fails
naming it. Then three checks, one module each:

- `replay.verify.chain`: positions, the hash chain, digests, redactions, tombstones;
- `replay.verify.views`: every view table against a fresh replay into a scratch
  SQLite database (both in one read snapshot of the live database, by `verify`);
- `replay.verify.forgotten` (`replay verify --forgotten`): tombstone by tombstone, no
  view, index or ledger payload still holds covered content, every register entry is
  in the ledger, and the backend keeps no old copies (`Recorder.erasure_leftovers`).

Each reports into a `replay.verify.report.Report`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from ledger import schema as t
from ledger.errors import DatabaseCorrupt
from ledger.recorder import IntegrityReport
from ledger.store import Store
from projections import quarantine
from projections.runner import Runner
from replay.verify.chain import check_ledger
from replay.verify.report import MAX_PROBLEMS, Report
from replay.verify.views import compare_views


async def verify(store: Store, *, catch_up: bool = True, views: bool = True,
                 limit: int = MAX_PROBLEMS) -> dict[str, Any]:
    """Run every integrity check; returns `{"ok": ...}` with counts or problems."""
    rep = Report(limit)
    try:
        integrity = await store.recorder.integrity_check(limit)
    except DatabaseCorrupt as e:  # too damaged for the check itself to read it
        integrity = IntegrityReport(store.recorder.integrity_check_name,
                                    problems=[e.cause])
    for problem in integrity.problems:
        rep.add("integrity", detail=f"{integrity.check}: {problem}")
    if integrity.problems:
        return rep.result(integrity=integrity.to_dict(),
                          skipped="the ledger and view checks: the database is damaged; "
                                  "restore a backup (docs/operations.md)")
    await store.open()
    runner = Runner(store)
    if catch_up:
        await runner.catch_up()
    cp = t.checkpoints.c
    async with store.read() as conn:
        await store.recorder.keep_transaction_open(conn)
        stored = {r[0]: int(r[1]) for r in
                  (await conn.execute(select(cp.name, cp.position))).all()}
        positions = {p.name: stored.get(p.name, 0) for p in runner.projections}
        counts = await check_ledger(conn, store, rep)
        if views:
            counts["views"] = await compare_views(conn, store, rep, positions)
        # Not a problem of integrity: events a view skipped, as `status` shows them.
        held = await quarantine.summary(conn)
    counts["projections"] = positions
    counts["quarantined"] = {n: q["count"] for n, q in held.items()}
    counts["integrity"] = integrity.to_dict()
    return rep.result(**counts)
