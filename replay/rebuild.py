"""Rebuild views from the ledger, after reapplying the forget register (R21, R22).

`reapply_register` is the one place where the register is turned back into ledger
state: every forget or purge it holds whose idempotency key is missing from the ledger
is appended (it keeps its original source order, so it covers exactly what it
covered), missing tombstones are inserted, and every payload a tombstone covers is
erased. `restore` and `rebuild` both call it before any view is rebuilt, so a read
never sees content a recorded forget covers.

`rebuild` then drops each projection's view rows and resets its checkpoint in one
transaction, and runs the ordinary projection runner: batch by batch, each batch
committed with its checkpoint, so memory stays flat whatever the ledger size and an
interrupted rebuild resumes where it stopped (a `meta` row `rebuild:<name>` marks a
rebuild in progress, so running the command again continues instead of starting over).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

import structlog
from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.appender import record_unchecked
from ledger.errors import IdempotencyConflict, RegisterError, ValidationError
from ledger.events import Event
from ledger.forgets import register_entry, tombstone_from_row, tombstone_of, tombstone_row
from ledger.recorder import STORED_COLUMNS, ledger_id
from ledger.records import StoredEvent, now_iso, stored_from_row
from ledger.register import Scan
from ledger.store import Store
from ledger.validation import parse_event
from projections import index_cache, matrix_snapshot, quarantine, shards
from projections.bulk import clear_table, restore_shape
from projections.erasure import erase_payloads
from projections.protocol import BulkLoadable, Projection
from projections.runner import REBUILD_MARKER, Runner, write_bulk_state
from replay.progress import Progress, ProgressCallback

log = structlog.get_logger("memledger.replay")

#: Events per transaction in a rebuild. Larger than the runner's live default: a batch's
#: fixed cost (its slot and task queries) is spread over more events, which doubles the
#: memories projection's rate on SQLite; memory stays bounded by the batch.
REBUILD_BATCH: Final = 4000
FORGET_TYPES: Final = ("memory.forgotten", "task.purged")


# -- the forget register ------------------------------------------------------------------

def register_events(store: Store) -> list[Event]:
    """The register's forgets and purges as events, first occurrence of each key only.

    Raises `RegisterError` if an entry is damaged or is not a valid forget or purge.
    """
    seen: set[tuple[str, str]] = set()
    out: list[Event] = []
    for n, entry in enumerate(store.register.entries(), start=1):
        try:
            ev = parse_event(entry["event"])
        except (KeyError, TypeError, ValidationError) as e:
            raise RegisterError(f"forget register {store.register.path} entry {n} is not a "
                                f"valid event: {e}") from e
        if ev.type not in FORGET_TYPES:
            raise RegisterError(f"forget register {store.register.path} entry {n} is a "
                                f"{ev.type!r}, not a forget or purge")
        k = (ev.tenant, ev.idempotency_key)
        if k not in seen:
            seen.add(k)
            out.append(ev)
    return out


async def _positions_of(conn: AsyncConnection, events: Sequence[Event]
                        ) -> dict[tuple[str, str], tuple[int, str]]:
    """(tenant, idempotency key) -> (position, type) for the keys already in the ledger."""
    ev = t.events.c
    by_tenant: dict[str, list[str]] = {}
    for e in events:
        by_tenant.setdefault(e.tenant, []).append(e.idempotency_key)
    found: dict[tuple[str, str], tuple[int, str]] = {}
    for tenant, keys in by_tenant.items():
        for i in range(0, len(keys), 500):
            # One tenant per query: SQLite uses the unique index for `a = ? AND b IN (..)`,
            # but scans the table for a multi-row `(a, b) IN (VALUES ..)`.
            q = select(ev.idempotency_key, ev.position, ev.type).where(
                ev.tenant == tenant, ev.idempotency_key.in_(keys[i:i + 500]))
            for r in (await conn.execute(q)).all():
                found[(tenant, r[0])] = (int(r[1]), r[2])
    return found


async def _record_forget(store: Store, ev: Event) -> int:
    """Record a register forget the append path refused because its target is absent.

    The append path accepts a user's forget by `memory_id` only while that memory is in
    the ledger. A forget in the register was accepted when it was first appended; after
    a restore from an older backup its memory may not be there yet, and the forget must
    still be recorded, or a late replay of that memory's write would bring it back.
    """
    e = t.events.c
    async with store.write() as conn:
        row0 = (await conn.execute(select(e.position).where(
            e.tenant == ev.tenant, e.idempotency_key == ev.idempotency_key))).first()
        if row0 is not None:
            return int(row0[0])
        return await record_unchecked(store, conn, ev)


async def ledger_forgets(conn: AsyncConnection) -> list[StoredEvent]:
    """Every forget and purge the ledger applied (not suppressed), in position order."""
    e = t.events.c
    rows = (await conn.execute(select(*STORED_COLUMNS).where(
        e.type.in_(FORGET_TYPES), e.suppressed.is_(False)).order_by(e.position))).all()
    return [stored_from_row(r) for r in rows]


async def register_problems(conn: AsyncConnection, scan: Scan) -> list[str]:
    """Why the register `scan` read cannot be trusted for the ledger behind `conn`:
    missing while the ledger holds forgets, damaged, torn, empty, foreign, or lacking a
    forget the ledger holds (sentences naming lines and counts, never content)."""
    forgets = [(s.tenant, s.idempotency_key) for s in await ledger_forgets(conn)]
    if not scan.exists:
        return [f"forget register {scan.path} not found, but the ledger holds "
                f"{len(forgets)} forget(s)"] if forgets else []
    return scan.problems(ledger=await ledger_id(conn), expected=forgets)


async def _complete_register(store: Store) -> int:
    """Append to the register each forget the ledger holds and it lacks (a restore without
    the register, a register repaired or replaced); returns how many."""
    # The write lock keeps appends of other processes (and their register lines) out.
    async with store.write() as conn:
        have = store.register.scan().keys
        lid = await ledger_id(conn)
        lacking = [register_entry(s.event, s.position) for s in await ledger_forgets(conn)
                   if s.event is not None and (s.tenant, s.idempotency_key) not in have]
        store.register.append(lacking, ledger=lid)
    return len(lacking)


async def reapply_register(store: Store) -> dict[str, Any]:
    """Make the ledger hold every forget and purge of the register, and erase what they
    cover; returns what was done (keys and positions, never content)."""
    await store.open()
    events = register_events(store)
    completed = await _complete_register(store)
    async with store.read() as conn:
        present = await _positions_of(conn, events)
    appended: list[dict[str, Any]] = []
    conflicts: list[dict[str, Any]] = []
    for ev in events:
        k = (ev.tenant, ev.idempotency_key)
        if k in present:
            if present[k][1] != ev.type:
                conflicts.append({"tenant": ev.tenant, "idempotency_key": ev.idempotency_key,
                                  "position": present[k][0], "ledger_type": present[k][1]})
            continue
        how = "appended"
        try:
            position = (await store.append([ev]))[0].position
        except IdempotencyConflict:
            continue  # appended meanwhile by someone else: it is there now
        except ValidationError as e:
            log.info("register_forget_recorded_directly", tenant=ev.tenant, reason=e.field)
            position = await _record_forget(store, ev)
            how = "recorded"
        present[k] = (position, ev.type)
        appended.append({"tenant": ev.tenant, "idempotency_key": ev.idempotency_key,
                         "type": ev.type, "position": position, "how": how})
    inserted = 0
    erased = 0
    async with store.view_write() as conn:
        have = {int(r[0]) for r in (await conn.execute(select(t.tombstones.c.position))).all()}
        for ev in events:
            k = (ev.tenant, ev.idempotency_key)
            pos, typ = present.get(k, (0, ""))
            if pos and typ == ev.type and pos not in have:
                ts = tombstone_of(ev, pos)
                if ts is not None:
                    await store.recorder.insert_tombstones(conn, [tombstone_row(ts)])
                    have.add(pos)
                    inserted += 1
        for r in (await conn.execute(select(t.tombstones).order_by(t.tombstones.c.position))
                  ).all():
            erased += await erase_payloads(conn, tombstone_from_row(r))
    if erased:
        await store.reclaim()
    return {"register": str(store.register.path), "register_exists": store.register.exists(),
            "entries": len(events), "already_in_ledger": len(events) - len(appended),
            "added_to_register": completed,
            "appended": appended, "tombstones_inserted": inserted, "payloads_erased": erased,
            "conflicts": conflicts}


# -- rebuild ------------------------------------------------------------------------------

async def _lock_checkpoint(conn: AsyncConnection, store: Store, name: str) -> None:
    """Create the checkpoint row if needed and lock it for this transaction."""
    await conn.execute(store.recorder.insert_ignore(t.checkpoints)
                       .values(name=name, position=0))
    await conn.execute(store.recorder.for_update(
        select(t.checkpoints.c.position).where(t.checkpoints.c.name == name)))


async def reset_projection(store: Store, proj: Projection, *, bulk: bool = True) -> None:
    """Drop a projection's view rows and set its checkpoint to 0, in one transaction.

    The checkpoint row is locked first, so a runner in another process finishes its
    batch before the reset, and its next batch starts from position 0. With `bulk` (and
    a projection that supports it), the view is then refilled by a bulk load up to the
    head read here (`projections.bulk`), instead of event by event.
    """
    m = t.meta.c
    # Recall's snapshot files describe the view dropped here: deleted before and after
    # (a load that read the old rows in between does not write them back).
    resets_vectors = t.vectors in proj.tables
    if resets_vectors:
        matrix_snapshot.drop_all(store.url)
    async with store.view_write() as conn:
        await _lock_checkpoint(conn, store, proj.name)
        for table in proj.tables:
            await clear_table(store, conn, table)
        # Indexes a cut-off bulk load dropped (SQLite loads only; elsewhere a no-op).
        await conn.run_sync(restore_shape, proj.name, proj.tables)
        # A projection's own bookkeeping rows are named `<name>.<what>` (for example
        # `vectors.pending_after`): they describe the rows just dropped.
        await conn.execute(delete(t.meta).where(m.name.startswith(f"{proj.name}.",
                                                                   autoescape=True)))
        # Its quarantine describes the view just dropped: the rebuild applies every
        # event again, and quarantines anew what still fails.
        await conn.execute(delete(t.quarantine).where(t.quarantine.c.projection == proj.name))
        await conn.execute(update(t.checkpoints).where(t.checkpoints.c.name == proj.name)
                           .values(position=0, updated_at=time.time()))
        # The rebuild runs unsharded (one bulk load over every tenant); every shard is
        # then at the projection's checkpoint, the load's head (`projections.shards`).
        await conn.execute(delete(t.shard_checkpoints).where(
            t.shard_checkpoints.c.projection == proj.name))
        await conn.execute(delete(t.meta).where(m.name == REBUILD_MARKER + proj.name))
        await conn.execute(t.meta.insert().values(name=REBUILD_MARKER + proj.name,
                                                  value=now_iso()))
        if bulk and isinstance(proj, BulkLoadable):
            await write_bulk_state(conn, proj.name, {"head": await store.head(conn)})
    if resets_vectors:
        matrix_snapshot.drop_all(store.url)


async def _clear_marker(store: Store, name: str) -> None:
    async with store.view_write() as conn:
        await conn.execute(delete(t.meta).where(t.meta.c.name == REBUILD_MARKER + name))


async def in_progress(store: Store) -> set[str]:
    """Names of projections whose rebuild was started and has not finished."""
    m = t.meta.c
    async with store.read() as conn:
        rows = (await conn.execute(select(m.name).where(
            m.name.startswith(REBUILD_MARKER, autoescape=True)))).all()
    return {r[0][len(REBUILD_MARKER):] for r in rows}


def select_projections(runner: Runner, names: Sequence[str] | None) -> list[Projection]:
    """The runner's projections named in `names` (all when None), in run order."""
    if not names:
        return list(runner.projections)
    known = {p.name for p in runner.projections}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValidationError("projection", f"unknown projection {unknown[0]!r}; one of "
                              f"{', '.join(sorted(known))}")
    return [p for p in runner.projections if p.name in names]


async def rebuild(store: Store, names: Sequence[str] | None = None, *, restart: bool = False,
                  batch_size: int = REBUILD_BATCH, progress: ProgressCallback | None = None,
                  runner: Runner | None = None, bulk: bool = True) -> dict[str, Any]:
    """Reapply the register, then drop and rebuild the named views (all by default).

    A rebuild left unfinished (interrupted, killed) is resumed from its checkpoint
    unless `restart` asks to drop the views again. `bulk=False` replays event by event,
    as the live projections do, instead of bulk loading (`projections.bulk`).
    `progress` is told of every step (`replay.progress`).
    """
    await store.open()
    runner = runner or Runner(store, batch_size=batch_size)
    projs = select_projections(runner, names)
    reapplied = await reapply_register(store)
    pending = await in_progress(store)
    resumed: list[str] = []
    for p in projs:
        if p.name in pending and not restart:
            resumed.append(p.name)
        else:
            await reset_projection(store, p, bulk=bulk)
    head = await store.head()
    positions = await runner.positions()
    total = sum(max(0, head - positions[p.name]) for p in projs)
    bar = Progress("rebuild", total, report=progress)
    done: dict[str, Any] = {}
    for p in projs:
        started = time.monotonic()
        start_at = positions[p.name]
        while True:
            got = await runner.step(p, head)
            if not got:
                break
            bar.advance(got)  # a bulk step reports its progress in positions, roughly
        n = (await runner.positions())[p.name] - start_at
        seconds = time.monotonic() - started
        await _clear_marker(store, p.name)
        done[p.name] = {"from": start_at, "events": n, "seconds": round(seconds, 3),
                        "events_per_s": round(n / seconds) if seconds > 0 else None}
        log.info("projection_rebuilt", projection=p.name, events=n, head=head)
    bar.finish()
    await store.reclaim()
    async with store.read() as conn:
        held = await quarantine.summary(conn)
    for name, q in held.items():
        if name in done:
            done[name]["quarantined"] = q["count"]
    out = {"head": head, "projections": done, "resumed": resumed, "reapplied": reapplied}
    if "vectors" in done:
        # The view was dropped with every snapshot: write those of the principals the
        # rebuilt range calls for, so their first recall maps a file (SQLite files).
        out["recall_snapshots"] = len(await index_cache.write_snapshots(
            store, done["vectors"]["from"], head))
    return out


async def set_shards(store: Store, count: int, *, progress: ProgressCallback | None = None,
                     runner: Runner | None = None) -> dict[str, Any]:
    """Split every projection into `count` shards from now on, then rebuild every view.

    S and the shard checkpoints change in one transaction that holds every projection's
    checkpoint row exclusively, so no shard batch of a running worker straddles the
    change (each reads S inside its own transaction, after its share lock). The rebuild
    then drops the views and loads them again, unsharded, up to the head; every shard
    starts from there.
    """
    if not 1 <= count <= shards.MAX_SHARDS:
        raise ValidationError("shards", f"shard count {count} out of range: use 1 to "
                              f"{shards.MAX_SHARDS}")
    await store.open()
    runner = runner or Runner(store)
    async with store.view_write() as conn:
        for p in runner.projections:
            await _lock_checkpoint(conn, store, p.name)
        before = await shards.shard_count(conn)
        await shards.write_shard_count(conn, count)
    log.info("shards_set", shards=count, was=before)
    rebuilt = await rebuild(store, restart=True, progress=progress, runner=runner)
    return {"shards": count, "was": before, "rebuild": rebuilt}


async def retry_quarantined(store: Store, names: Sequence[str] | None = None, *,
                            runner: Runner | None = None) -> dict[str, Any]:
    """Apply the quarantined events of the named projections (all by default) again;
    what applies now leaves the quarantine (docs/projections.md#quarantine)."""
    await store.open()
    runner = runner or Runner(store)
    projs = select_projections(runner, names)
    res = await runner.retry_quarantined([p.name for p in projs])
    async with store.read() as conn:
        left = await quarantine.summary(conn)
    return {"projections": {p.name: res.get(p.name, {"retried": 0, "cleared": [],
                                                     "still_quarantined": []})
                            for p in projs},
            "quarantined": {n: q for n, q in left.items() if n in {p.name for p in projs}}}
