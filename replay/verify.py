"""`replay verify`: the ledger is intact and every view equals a fresh replay.

Checks, in one read snapshot of the live database:

- positions run 1..head without a gap;
- the hash chain, recomputed from `GENESIS` with `chain_link`, equals the stored links
  (an envelope edited in place, or an event deleted, breaks it at that position);
- every present payload hashes to its `content_digest` and agrees with its envelope;
  an absent payload belongs to a suppressed or redacted event that a tombstone covers;
- the `tombstones` table holds exactly what the forget and purge events say;
- every view table equals what a fresh replay of the same ledger into a scratch SQLite
  database gives, each projection replayed up to its own checkpoint.

`verify_forgotten` (`replay verify --forgotten`) proves, tombstone by tombstone, that no
view, index or ledger payload still holds covered content, that every register entry
is in the ledger, and on SQLite that the WAL no longer holds old pages. It checks
structure (covered content is NULL or absent): it cannot keep the forgotten text to
search for it.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.errors import RegisterError
from ledger.events import digest
from ledger.store import (
    GENESIS,
    Store,
    Tombstone,
    chain_link,
    event_from_wire,
    tombstone_from_row,
    tombstone_of,
)
from projections.runner import BulkLoadable, Runner, dead_letter_covered, write_bulk_state
from replay.rebuild import REBUILD_BATCH, register_events, register_problems
from replay.rows import FORGETS, by_tenant, covering, row_dict, stream_rows

MAX_PROBLEMS: Final = 50
#: View columns that may differ between two correct replays. None so far: views hold
#: ledger positions, but a fresh replay of the same ledger has the same positions.
VOLATILE: Final[dict[str, frozenset[str]]] = {}
#: Float columns stored as bytes: equal within rounding (numpy may sum in another order
#: when it embeds a different batch of texts).
FLOAT_BLOBS: Final = {("vectors", "vector")}


class Report:
    """Problems found so far (the first `limit` kept, all counted)."""

    def __init__(self, limit: int = MAX_PROBLEMS) -> None:
        self.limit = limit
        self.problems: list[dict[str, Any]] = []
        self.count = 0

    def add(self, check: str, **detail: Any) -> None:
        """Record one problem."""
        self.count += 1
        if len(self.problems) < self.limit:
            self.problems.append({"check": check, **detail})

    def result(self, **counts: Any) -> dict[str, Any]:
        """The command's output object."""
        if self.count:
            return {"ok": False, "problem_count": self.count, "problems": self.problems,
                    **counts}
        return {"ok": True, **counts}


async def _snapshot_settings(conn: AsyncConnection, dialect: str) -> None:
    if dialect == "postgresql":
        # The snapshot stays open while the scratch replay runs: do not let the server's
        # idle-in-transaction timeout end it.
        await conn.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))


def _envelope_disagreement(row: dict[str, Any], wire: dict[str, Any]) -> list[str]:
    src = wire.get("source") or {}
    pairs = {
        "type": wire.get("type"), "tenant": wire.get("tenant"),
        "idempotency_key": wire.get("idempotency_key"), "actor": wire.get("actor"),
        "source_kind": src.get("kind"), "source_id": src.get("id"),
        "source_at": src.get("at"), "source_seq": src.get("seq"),
        "source_event_id": src.get("event_id"),
    }
    return [k for k, v in pairs.items() if row[k] != v]


async def _check_ledger(conn: AsyncConnection, store: Store, rep: Report
                        ) -> dict[str, Any]:
    tomb_rows = {int(r.position): tombstone_from_row(r)
                 for r in (await conn.execute(select(t.tombstones))).all()}
    tombs = by_tenant(tomb_rows.values())
    expected_tombs: dict[int, Tombstone | None] = {}
    prev = GENESIS
    expected = 1
    n = redacted = suppressed = 0
    ev = t.events.c
    async for part in stream_rows(conn, t.events, store.dialect, batch=2000):
        for r in part:
            row = row_dict(r)
            pos = int(row["position"])
            n += 1
            if pos != expected:
                rep.add("positions", position=pos,
                        detail=f"expected position {expected}, found {pos}: "
                               f"{pos - expected} event(s) missing" if pos > expected
                        else f"position {pos} out of order")
            expected = pos + 1
            if chain_link(prev, row) != row["chain"]:
                rep.add("chain", position=pos,
                        detail="hash chain broken: the envelope of this event or of the one "
                               "before it was changed, or an event is missing")
            prev = row["chain"]
            payload = row["payload"]
            if row["suppressed"]:
                suppressed += 1
            if row["redacted"]:
                redacted += 1
            if payload is not None:
                if digest(payload) != row["content_digest"]:
                    rep.add("digest", position=pos,
                            detail="payload does not match its content digest")
                if row["suppressed"] or row["redacted"]:
                    rep.add("redaction", position=pos,
                            detail="event marked suppressed/redacted still has a payload")
                try:
                    wire = orjson.loads(payload)
                    bad = _envelope_disagreement(row, wire)
                except (orjson.JSONDecodeError, AttributeError, TypeError):
                    wire, bad = None, ["payload is not a JSON event"]
                if bad:
                    rep.add("envelope", position=pos,
                            detail=f"payload disagrees with envelope on {', '.join(bad)}")
                if row["type"] in FORGETS and wire is not None and not bad:
                    try:
                        expected_tombs[pos] = tombstone_of(event_from_wire(wire), pos)
                    except (KeyError, TypeError, ValueError):
                        rep.add("envelope", position=pos, detail="forget payload unreadable")
            else:
                if not (row["suppressed"] or row["redacted"]):
                    rep.add("redaction", position=pos,
                            detail="payload missing on an event neither suppressed nor "
                                   "redacted")
                elif covering(tombs, row) is None:
                    rep.add("redaction", position=pos,
                            detail="content removed but no tombstone covers this event")
                if row["type"] in FORGETS:
                    expected_tombs[pos] = tomb_rows.get(pos)  # cannot re-derive: accept
                    rep.add("redaction", position=pos, detail="forget event without content")
    for pos, want in expected_tombs.items():
        have = tomb_rows.get(pos)
        if have is None:
            rep.add("tombstones", position=pos, detail="forget event has no tombstone")
        elif want is not None and have != want:
            rep.add("tombstones", position=pos,
                    detail="tombstone differs from what its forget event says")
    for pos in sorted(set(tomb_rows) - set(expected_tombs)):
        rep.add("tombstones", position=pos,
                detail="tombstone without a forget or purge event at that position")
    head = int((await conn.execute(select(func.max(ev.position)))).scalar() or 0)
    return {"head": head, "events": n, "redacted": redacted, "suppressed": suppressed,
            "tombstones": len(tomb_rows)}


# -- views against a fresh replay --------------------------------------------------------

async def _copy_ledger(conn: AsyncConnection, store: Store, scratch: Store) -> None:
    for table in (t.events, t.tombstones, t.task_owners):
        async for part in stream_rows(conn, table, store.dialect, batch=2000):
            async with scratch.write() as dst:
                await dst.execute(table.insert(), [row_dict(r) for r in part])


async def _rows(conn: AsyncConnection, table: Any, dialect: str
                ) -> AsyncIterator[dict[str, Any]]:
    async for part in stream_rows(conn, table, dialect, batch=2000):
        for r in part:
            yield row_dict(r)


def _key(table: Any, row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row[c.name] for c in (table.primary_key.columns or table.columns))


def _same(table: str, col: str, a: Any, b: Any) -> bool:
    if a == b:
        return True
    if (table, col) in FLOAT_BLOBS and isinstance(a, bytes) and isinstance(b, bytes) \
            and len(a) == len(b) and len(a) % 4 == 0:
        va = np.frombuffer(a, dtype="<f4")
        vb = np.frombuffer(b, dtype="<f4")
        return bool(np.allclose(va, vb, rtol=1e-5, atol=1e-6))
    return False


def _sort_key(table: Any, key: tuple[Any, ...]) -> tuple[Any, ...]:
    # Python's order of str is by code point, which for UTF-8 equals byte order: the
    # order both databases return rows in (see `order_columns`).
    return tuple((0, b"") if v is None else (1, v) for v in key)


async def _compare_table(live: AsyncConnection, live_dialect: str, fresh: AsyncConnection,
                         table: Any, rep: Report) -> int:
    skip = VOLATILE.get(table.name, frozenset())
    a_it = _rows(live, table, live_dialect).__aiter__()
    b_it = _rows(fresh, table, "sqlite").__aiter__()

    async def nxt(it: AsyncIterator[dict[str, Any]]) -> dict[str, Any] | None:
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            return None

    a, b = await nxt(a_it), await nxt(b_it)
    n = 0
    pk = [str(c.name) for c in (table.primary_key.columns or table.columns)]
    while a is not None or b is not None:
        ka = _sort_key(table, _key(table, a)) if a is not None else None
        kb = _sort_key(table, _key(table, b)) if b is not None else None
        if b is None or (ka is not None and kb is not None and ka < kb):
            assert a is not None
            rep.add("view", table=table.name, key=_show_key(pk, a),
                    detail="row in the view but not in a fresh replay")
            a = await nxt(a_it)
            n += 1
        elif a is None or (kb is not None and ka is not None and kb < ka):
            rep.add("view", table=table.name, key=_show_key(pk, b),
                    detail="row missing from the view (a fresh replay has it)")
            b = await nxt(b_it)
        else:
            cols = [c for c in a if c not in skip and not _same(table.name, c, a[c], b.get(c))]
            if cols:
                # Column names only: a view row may hold a memory's value.
                rep.add("view", table=table.name, key=_show_key(pk, a), columns=cols,
                        detail="view row differs from a fresh replay")
            a, b = await nxt(a_it), await nxt(b_it)
            n += 1
    return n


def _show_key(pk: Sequence[str], row: dict[str, Any]) -> dict[str, Any]:
    return {c: (row[c].hex() if isinstance(row[c], bytes) else row[c]) for c in pk}


async def _compare_views(conn: AsyncConnection, store: Store, rep: Report,
                         positions: dict[str, int]) -> dict[str, int]:
    with tempfile.TemporaryDirectory(prefix="memledger-verify-") as d:
        scratch = Store(f"sqlite+aiosqlite:///{Path(d) / 'replay.db'}",
                        register_path=str(Path(d) / "replay.forgets"))
        try:
            await scratch.open()
            await _copy_ledger(conn, store, scratch)
            runner = Runner(scratch, batch_size=REBUILD_BATCH)
            for proj in runner.projections:
                upto = positions.get(proj.name, 0)
                if upto <= 0:
                    continue
                if isinstance(proj, BulkLoadable):
                    # The scratch views are empty: bulk load them up to the live position.
                    async with scratch.view_write() as c:
                        await write_bulk_state(c, proj.name, {"head": upto})
                while await runner.step(proj, upto):
                    pass
            tables: list[Any] = []
            for proj in runner.projections:
                tables.extend(tb for tb in proj.tables if tb not in tables)
            counts: dict[str, int] = {}
            async with scratch.read() as fresh:
                for table in tables:
                    counts[str(table.name)] = await _compare_table(conn, store.dialect, fresh,
                                                              table, rep)
            return counts
        finally:
            await scratch.close()


async def verify(store: Store, *, catch_up: bool = True, views: bool = True,
                 limit: int = MAX_PROBLEMS) -> dict[str, Any]:
    """Run every integrity check; returns `{"ok": ...}` with counts or problems."""
    await store.open()
    runner = Runner(store)
    if catch_up:
        await runner.catch_up()
    rep = Report(limit)
    cp = t.checkpoints.c
    async with store.read() as conn:
        await _snapshot_settings(conn, store.dialect)
        stored = {r[0]: int(r[1]) for r in
                  (await conn.execute(select(cp.name, cp.position))).all()}
        positions = {p.name: stored.get(p.name, 0) for p in runner.projections}
        counts = await _check_ledger(conn, store, rep)
        if views:
            counts["views"] = await _compare_views(conn, store, rep, positions)
    counts["projections"] = positions
    return rep.result(**counts)


# -- erasure check ------------------------------------------------------------------------

def _tomb_sql(ts: Tombstone, cols: Any) -> Any:
    """A broad SQL pre-filter on a view for rows a tombstone may cover (refined in Python)."""
    if ts.kind == "memory_id":
        return cols.memory_id == ts.memory_id
    if ts.kind == "key":
        return (cols.ns_path == ts.ns_path) & (cols.mkey == ts.mkey)
    if ts.kind == "prefix":
        prefix = ts.ns_path or "\x00"
        return func.substr(cols.ns_path, 1, len(prefix)) == prefix
    return cols.task_key == ts.task_key


async def _check_views_erased(conn: AsyncConnection, tombs: list[Tombstone], rep: Report
                              ) -> dict[str, int]:
    mv, tn, tv, vc = t.mem_versions.c, t.task_notes.c, t.tasks_view.c, t.vectors.c
    covered_ids: set[tuple[str, str]] = set()
    purged_tasks: set[tuple[str, str]] = set()
    owners: dict[tuple[str, str], str] = {
        (r[0], r[1]): r[2] for r in (await conn.execute(
            select(t.task_owners.c.tenant, t.task_owners.c.task_key, t.task_owners.c.ns_path))
        ).all()}
    checked = {"mem_versions": 0, "task_notes": 0, "tasks_view": 0, "vectors": 0}
    for ts in tombs:
        q = select(t.mem_versions).where(mv.tenant == ts.tenant, _tomb_sql(ts, mv))
        for r in (await conn.execute(q)).all():
            if not ts.covers_write(r.tenant, r.memory_id, r.ns_path, r.mkey, r.task_key,
                                   bytes(r.order_key)):
                continue
            checked["mem_versions"] += 1
            covered_ids.add((r.tenant, r.memory_id))
            held = [c for c in ("value", "text", "scope", "session_id")
                    if getattr(r, c) is not None]
            if held or r.status != "forgotten":
                rep.add("forgotten", place="mem_versions", tombstone=ts.position,
                        tenant=r.tenant, memory_id=r.memory_id, columns=held,
                        status=r.status)
        if ts.kind not in ("task", "prefix"):
            continue
        q2 = select(tn.position, tn.tenant, tn.task_key, tn.order_key, tn.body.is_not(None)
                    ).where(tn.tenant == ts.tenant)
        if ts.kind == "task":
            q2 = q2.where(tn.task_key == ts.task_key)
        for r in (await conn.execute(q2)).all():
            owner = owners.get((r[1], r[2]))
            if not ts.covers_task(r[1], r[2], owner, bytes(r[3])):
                continue
            checked["task_notes"] += 1
            if r[4]:
                rep.add("forgotten", place="task_notes", tombstone=ts.position, tenant=r[1],
                        task_key=r[2], position=int(r[0]))
        q3 = select(t.tasks_view).where(tv.tenant == ts.tenant)
        if ts.kind == "task":
            q3 = q3.where(tv.task_key == ts.task_key)
        else:
            prefix = ts.ns_path or "\x00"
            q3 = q3.where(func.substr(tv.ns_path, 1, len(prefix)) == prefix)
        for r in (await conn.execute(q3)).all():
            checked["tasks_view"] += 1
            purged_tasks.add((r.tenant, r.task_key))
            if not r.purged:
                rep.add("forgotten", place="tasks_view", tombstone=ts.position,
                        tenant=r.tenant, task_key=r.task_key,
                        detail="task covered by a purge or prefix forget is not purged")
            if ts.kind == "task":
                summary = orjson.loads(r.summary)
                extra = sorted(set(summary) - {"task_key", "status", "purged"})
                if extra:
                    rep.add("forgotten", place="tasks_view", tombstone=ts.position,
                            tenant=r.tenant, task_key=r.task_key, columns=extra,
                            detail="purged task summary still holds content")
    for tenant, memory_id in sorted(covered_ids):
        checked["vectors"] += 1
        hit = (await conn.execute(select(func.count()).where(
            vc.tenant == tenant, vc.kind == "memory", vc.item_id == memory_id))).scalar()
        if hit:
            rep.add("forgotten", place="vectors", tenant=tenant, memory_id=memory_id)
    for tenant, task_key in sorted(purged_tasks):
        hit = (await conn.execute(select(func.count()).where(
            vc.tenant == tenant, vc.kind == "task", vc.task_key == task_key))).scalar()
        if hit:
            rep.add("forgotten", place="vectors", tenant=tenant, task_key=task_key)
    return checked


async def _check_payloads_erased(conn: AsyncConnection, store: Store,
                                 tombs: list[Tombstone], rep: Report) -> int:
    grouped = by_tenant(tombs)
    ev = t.events.c
    n = 0
    where = ev.payload.is_not(None) & ev.tenant.in_(sorted(grouped) or [""])
    async for part in stream_rows(conn, t.events, store.dialect, where=where, batch=2000):
        for r in part:
            row = row_dict(r)
            ts = covering(grouped, row)
            if ts is not None:
                n += 1
                rep.add("forgotten", place="events.payload", tombstone=ts.position,
                        position=int(row["position"]))
    return n


async def _check_dead_letters_erased(conn: AsyncConnection, tombs: list[Tombstone],
                                     rep: Report) -> int:
    """Dead letters that name a covered target must hold no payload."""
    dl = t.dead_letters.c
    grouped = by_tenant(tombs)
    rows = (await conn.execute(select(dl.id, dl.tenant, dl.payload).where(
        dl.payload.is_not(None), dl.tenant.in_(sorted(grouped) or [""])))).all()
    for r in rows:
        try:
            obj = orjson.loads(r.payload)
        except orjson.JSONDecodeError:
            continue
        for ts in grouped.get(r.tenant, []):
            if dead_letter_covered(obj, ts):
                rep.add("forgotten", place="dead_letters.payload", tombstone=ts.position,
                        dead_letter=int(r.id))
                break
    return len(rows)


def _sqlite_files(url: str) -> list[Path]:
    path = url.split(":///", 1)[1].split("?", 1)[0]
    return [Path(path + suffix) for suffix in ("", "-wal")]


async def verify_forgotten(store: Store, *, catch_up: bool = True,
                           limit: int = MAX_PROBLEMS) -> dict[str, Any]:
    """Prove that no copy of covered content is left; see the module docstring."""
    await store.open()
    if catch_up:
        await Runner(store).catch_up()
    rep = Report(limit)
    notes: list[str] = []
    scan = store.register.scan()
    try:
        register = register_events(store)
    except RegisterError:
        register = []  # the damage is reported below, from the scan
    async with store.read() as conn:
        await _snapshot_settings(conn, store.dialect)
        for problem in await register_problems(conn, scan):
            rep.add("forgotten", place="forget_register", detail=problem)
        if scan.format == "legacy":
            notes.append(f"forget register {scan.path} is in the legacy format (no ledger "
                         "id, sequence or chain): the next forget or `memledger replay "
                         "rebuild` rewrites it in format 2")
        tombs = sorted((tombstone_from_row(r) for r in
                        (await conn.execute(select(t.tombstones))).all()),
                       key=lambda x: x.position)
        checked = await _check_views_erased(conn, tombs, rep)
        checked["payloads_still_held"] = await _check_payloads_erased(conn, store, tombs, rep)
        checked["dead_letters"] = await _check_dead_letters_erased(conn, tombs, rep)
        ev = t.events.c
        for e in register:
            row = (await conn.execute(select(ev.position).where(
                ev.tenant == e.tenant, ev.idempotency_key == e.idempotency_key))).first()
            if row is None:
                rep.add("forgotten", place="register",
                        tenant=e.tenant, idempotency_key=e.idempotency_key,
                        detail="forget in the register is missing from the ledger; run "
                               "`memledger replay rebuild` to reapply it")
        stats: dict[str, int] = {}
        if store.dialect == "postgresql":
            names = ["events", "mem_versions", "task_notes", "tasks_view", "vectors"]
            q = text("SELECT relname, n_dead_tup FROM pg_stat_user_tables "
                     "WHERE relname = ANY(:names)")
            stats = {r[0]: int(r[1]) for r in (await conn.execute(q, {"names": names})).all()}
    if store.dialect == "sqlite" and ":memory:" not in store.url:
        await store.sqlite_checkpoint()
        wal = _sqlite_files(store.url)[1]
        if wal.exists() and wal.stat().st_size > 0:
            rep.add("forgotten", place=str(wal),
                    detail="the WAL still holds page images (another connection kept a "
                           "read snapshot open); run again when it is idle")
        async with store.engine.connect() as c:
            sd = (await c.exec_driver_sql("PRAGMA secure_delete")).scalar()
        if not sd:
            rep.add("forgotten", place="sqlite", detail="PRAGMA secure_delete is off")
    if stats and any(stats.values()):
        notes.append("PostgreSQL keeps dead row versions until VACUUM: run `VACUUM events, "
                     "mem_versions, task_notes, tasks_view, vectors` to reclaim them")
    out = rep.result(tombstones=len(tombs), register_entries=len(register), checked=checked)
    if stats:
        out["pg_dead_tuples"] = stats
    if notes:
        out["notes"] = notes
    return out

