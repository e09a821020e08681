"""The projection runner: reads the ledger after a checkpoint and updates the views.

The view change and the new checkpoint commit in one transaction, so a batch is
applied exactly once however often a runner is woken or restarted. The checkpoint row
is locked for the whole transaction (SQLite: BEGIN IMMEDIATE; PostgreSQL: SELECT ...
FOR UPDATE), so a second runner of the same projection waits instead of applying the
batch twice, and a killed holder's lock dies with its connection.

Sharded (`projections.shards`): a runner that owns some shards (`Runner.owned`) steps
only those, holding the checkpoint row in share mode and its shards' rows exclusively,
so runners of other shards run beside it; a runner that owns none steps every shard at
once under the exclusive lock, as before (`memledger project`, the SDK, SQLite workers).

An event the projection cannot apply does not stop it: the batch is applied in a
savepoint, and if that fails with an error the events cause (`projections.quarantine`)
the batch is bisected, each part in its own savepoint, down to the events that fail
alone. Those are quarantined for this projection only, in the transaction that applies
the rest and moves the checkpoint (docs/projections.md#quarantine).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import orjson
import structlog
from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.records import StoredEvent
from ledger.store import Store
from projections import index_cache, quarantine, rounds, shards
from projections.bulk import clear_table, restore_shape
from projections.erasure import FORGETS
from projections.protocol import BulkLoadable, Projection
from projections.quarantine import Failure, is_poison
from projections.registry import default_projections
from projections.sql import (
    catch_up_batch,
    for_share,
    for_update,
    insert_ignore,
    prepared,
    step_facts,
)

log = structlog.get_logger("memledger.projections")

#: `meta` row of a bulk load in progress: `<projection name>` + this (`projections.bulk`).
BULK_SUFFIX: Final = ".bulk"
#: Projections whose batches with forgets overwrite content (the ledger's payloads; the
#: stored history's rows): old copies are reclaimed after such a batch commits.
ERASING: Final = ("erasure", "history")
#: A step of a projection that names its event types reads up to `batch_size` of them
#: within this many times `batch_size` positions (`Runner._step_all`).
SPARSE_SPAN: Final = 32
#: Events per batch (per transaction) when the runner is given no `batch_size`.
DEFAULT_BATCH: Final = 1000
#: `meta` rows marking a rebuild in progress: `rebuild:<projection name>` (`replay
#: rebuild` sets them; a bulk load's last step removes its projection's).
REBUILD_MARKER: Final = "rebuild:"


@contextlib.contextmanager
def no_gc_pauses() -> Iterator[None]:
    """Hold CPython's cyclic garbage collector off for the duration of one batch.

    A batch allocates thousands of containers (decoded events, facts, rows) that live
    until it ends; the collections their allocation triggers walk them all again, and
    in a process with a large heap a full collection lands in the middle of a batch.
    Measured on a bulk load, decoding a 465-byte payload cost 7.9 us with the
    collector on and 2.4 us with it off. Reference counting still frees everything at
    the end of the batch; cycles, if any, wait for the next collection.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def read_bulk_state(conn: AsyncConnection, projection: str) -> dict[str, Any] | None:
    """The bulk-load state of a projection, or None when none is in progress."""
    row = (await conn.execute(select(t.meta.c.value).where(
        t.meta.c.name == projection + BULK_SUFFIX))).first()
    if row is None:
        return None
    state: dict[str, Any] = orjson.loads(row[0])
    return state


async def write_bulk_state(conn: AsyncConnection, projection: str,
                           state: dict[str, Any] | None) -> None:
    """Record (or, with None, end) a projection's bulk load, inside `conn`'s transaction.

    A load starts with the checkpoint at 0 (`replay.rebuild.reset_projection`) and its
    last step moves it to the load's head, so a checkpoint above 0 means no load runs.
    Ending it also ends the rebuild it belongs to: the view is complete at its head.
    """
    m = t.meta.c
    await conn.execute(t.meta.delete().where(m.name == projection + BULK_SUFFIX))
    if state is None:
        await conn.execute(t.meta.delete().where(m.name == REBUILD_MARKER + projection))
    else:
        await conn.execute(t.meta.insert().values(name=projection + BULK_SUFFIX,
                                                  value=orjson.dumps(state).decode()))


class Runner:
    """Runs projections: one batch per call of `step`, or until caught up."""

    def __init__(self, store: Store, projections: Sequence[Projection] | None = None,
                 batch_size: int | None = None, *, retry_upgraded: bool = True) -> None:
        self.store = store
        self.projections = list(projections or default_projections())
        self.batch_size = batch_size or DEFAULT_BATCH
        #: The steps of `catch_up` (a backlog): `batch_size` when given, else the
        #: backend's (`projections.sql.catch_up_batch`).
        self.catch_up_size = batch_size or catch_up_batch(store, DEFAULT_BATCH)
        #: Retry, on a projection's first step, what another code version quarantined.
        self.retry_upgraded = retry_upgraded
        self._checked: set[str] = set()  # projections whose quarantine was looked at
        self._stale: set[str] = set()  # ... and found to hold another version's entries
        #: The shards this runner steps: None steps every shard at once (holding each
        #: projection's checkpoint row exclusively); a set steps only those shards,
        #: beside runners of other shards (`workers.leases` keeps it to the leases held).
        self.owned: frozenset[int] | None = None
        self._reclaim = False  # an erasure batch ran: reclaim after its commit
        #: Inside `catch_up`'s steps: the statistics refresh left running beside the
        #: next step (`_note_growth`), if any; outside them it is awaited.
        self._beside = False
        self._growth: asyncio.Future[None] | None = None
        #: The checkpoint a projection's last `step` left, where that step read it
        #: (`_step_all`): `catch_up` stops there without a step that moves nothing.
        self._left: dict[str, int] = {}

    async def step(self, proj: Projection, upto: int | None = None,
                   size: int | None = None) -> int:
        """Apply one batch of at most `size` positions (default: `batch_size`) to one
        projection, or, for a projection that names its `types` and steps every shard,
        of at most `size` of its events within `SPARSE_SPAN * size` positions; returns
        how many positions it moved."""
        self._left.pop(proj.name, None)
        prepare = getattr(proj, "prepare", None)
        if prepare is not None:
            # Slow work a projection can do before its write transaction (a model
            # embedding the batch's texts: `VectorProjection.prepare`), holding no lock.
            await prepare(self.store, size or self.batch_size, self.owned)
        with no_gc_pauses():
            moved = await self._step(proj, upto, size or self.batch_size)
        if self._reclaim:
            self._reclaim = False
            await self.store.reclaim()
        if moved:
            # Counted as events applied (about a row each): the planner's statistics of a
            # fast-growing view are refreshed before its IN-list lookups turn into scans.
            await self._note_growth([tb.name for tb in proj.tables], moved)
        if proj.name in self._stale:
            self._stale.discard(proj.name)
            await self.retry_quarantined([proj.name], stale_only=True)
        return moved

    async def _note_growth(self, tables: list[str], moved: int) -> None:
        """`note_growth` after a step: awaited, or, inside `catch_up`, run beside the
        next step (a statistics refresh is an ANALYZE on a connection of its own, which
        PostgreSQL runs while the next batch is applied; the next refresh, and the end
        of the catch-up, wait for it first, so refreshes never overlap one another)."""
        if not self._beside:
            await self.store.recorder.note_growth(tables, moved)
            return
        await self._growth_done()
        self._growth = asyncio.ensure_future(self.store.recorder.note_growth(tables, moved))

    async def _growth_done(self) -> None:
        """Wait for the statistics refresh `_note_growth` left running, if any."""
        task, self._growth = self._growth, None
        if task is not None:
            await task

    async def _step(self, proj: Projection, upto: int | None, size: int) -> int:
        if self.owned is not None:
            moved = await self._step_shards(proj, upto, size, self.owned)
            if moved is not None:
                return moved
        return await self._step_all(proj, upto, size)

    async def _step_all(self, proj: Projection, upto: int | None, size: int) -> int:
        """One batch of every shard, holding the projection's checkpoint row exclusively
        (shard batches of other runners wait; see `_step_shards`)."""
        cp = t.checkpoints.c
        async with self.store.view_write() as conn:
            q = for_update(self.store, select(cp.position).where(cp.name == proj.name))
            row = (await conn.execute(q)).first()
            if row is None:
                await _ensure_checkpoint(conn, self.store, proj.name)
                row = (await conn.execute(q)).first()
                assert row is not None
            position = int(row[0])
            await self._check_stale(conn, proj)
            # Only at 0 can a bulk load be running. Its state is read in a statement of
            # its own, after the lock: on PostgreSQL a subquery of the locking SELECT
            # would see the snapshot from before the wait.
            if position == 0 and isinstance(proj, BulkLoadable):
                moved = await self._bulk_step(proj, conn, size, proj.tables)
                if moved is not None:
                    return moved
            sc = t.shard_checkpoints.c
            types = getattr(proj, "types", None)
            # How far this batch may reach: `size` positions, or for a projection that
            # names its event types, up to `size` of ITS events within `SPARSE_SPAN`
            # times as many positions (a sparse view, such as tasks, then applies its
            # events in a few batches instead of one per `size` positions of others').
            span = size if types is None else size * SPARSE_SPAN
            facts = await step_facts(self.store, conn, proj.name, position, span,
                                     shards_meta=shards.SHARDS_META,
                                     default_shards=shards.DEFAULT_SHARDS)
            held: set[int] | None = None
            if facts is not None:
                head, ahead, count, held = facts
                end = upto if upto is not None else head
            else:
                end = upto if upto is not None else await self.store.head(conn)
            if end <= position:
                self._left[proj.name] = position
                return 0
            if facts is None:
                # Shards that moved on their own (`_step_shards`) are past the base:
                # their events up to their row are applied already.
                ahead = {int(r[0]): int(r[1]) for r in (await conn.execute(
                    select(sc.shard, sc.position).where(sc.projection == proj.name))).all()}
                count = await shards.shard_count(conn)
            # Positions are gap-free, so a batch is a range of positions; a projection
            # that names its event types reads only those, and still moves past the rest:
            # to its `size`-th event when the range holds that many, else to its end.
            reach = min(position + span, end)
            batch = await self.store.read_events(conn, position, size, reach, types=types)
            hi = batch[-1].position if types is not None and len(batch) >= size else reach
            if ahead:
                batch = [se for se in batch if se.position > ahead.get(
                    shards.shard_of(se.tenant, count), position)]
            started = time.perf_counter()
            failed = await self._apply_held(proj, conn, batch, position, hi,
                                            shards.Scope(count), held)
            await conn.execute(update(t.checkpoints).where(cp.name == proj.name)
                               .values(position=hi, updated_at=time.time()))
            if ahead:
                await conn.execute(delete(t.shard_checkpoints).where(
                    sc.projection == proj.name, sc.position <= hi))
        self._left[proj.name] = hi
        self._after_batch(proj, position, hi, batch, failed, started)
        return hi - position

    async def _step_shards(self, proj: Projection, upto: int | None, size: int,
                           owned: frozenset[int]) -> int | None:
        """One batch of the owned shards only; None when the projection must be stepped
        as a whole (a bulk load is in progress).

        The projection's checkpoint row is held in share mode (PostgreSQL: FOR SHARE), so
        runners of disjoint shards run side by side while a whole-projection step, a
        rebuild or `shards set` (FOR UPDATE) waits for them and they for it; the owned
        shards' rows are locked FOR UPDATE, in shard order, for the batch. The view
        change and the shard checkpoints commit together: exactly once per shard.
        """
        cp, sc = t.checkpoints.c, t.shard_checkpoints.c
        async with self.store.view_write() as conn:
            await _ensure_checkpoint(conn, self.store, proj.name)
            q = for_share(self.store, select(cp.position).where(cp.name == proj.name))
            base = int((await conn.execute(q)).scalar_one())
            if base == 0 and isinstance(proj, BulkLoadable) \
                    and await read_bulk_state(conn, proj.name) is not None:
                return None
            count = await shards.shard_count(conn)
            mine = sorted(k for k in owned if k < count)
            if not mine:
                return 0
            await self._check_stale(conn, proj)
            await conn.execute(insert_ignore(self.store, t.shard_checkpoints), [
                {"projection": proj.name, "shard": k, "position": base} for k in mine])
            rows = (await conn.execute(for_update(self.store, select(sc.shard, sc.position)
                    .where(sc.projection == proj.name, sc.shard.in_(mine))
                    .order_by(sc.shard)))).all()
            at = {int(r[0]): max(base, int(r[1])) for r in rows}
            low = min(at.values())
            end = upto if upto is not None else await self.store.head(conn)
            if end <= low:
                return 0
            scope = shards.Scope(count, frozenset(mine))
            types = getattr(proj, "types", None)
            batch, reached = await shards.read_events(self.store, conn, low, size, end,
                                                      types, scope)
            batch = [se for se in batch
                     if se.position > at[shards.shard_of(se.tenant, count)]]
            started = time.perf_counter()
            failed = await self._apply_held(proj, conn, batch, low, reached, scope)
            behind = [k for k in mine if at[k] < reached]
            res = await conn.execute(update(t.shard_checkpoints).where(
                sc.projection == proj.name, sc.shard.in_(behind), sc.position < reached)
                .values(position=reached, updated_at=time.time()))
            # Guarded progression: every row moved from where this batch read it.
            if res.rowcount != len(behind):
                raise RuntimeError(f"shard checkpoints of {proj.name!r} moved under a "
                                   "held lock; batch rolled back")
        self._after_batch(proj, low, reached, batch, failed, started,
                          {k: at[k] for k in behind})
        return reached - low

    async def _check_stale(self, conn: AsyncConnection, proj: Projection) -> None:
        if self.retry_upgraded and proj.name not in self._checked:
            self._checked.add(proj.name)
            if await quarantine.entries(conn, proj.name, stale_only=True, limit=1):
                self._stale.add(proj.name)  # retried once this transaction ends

    async def _apply_held(self, proj: Projection, conn: AsyncConnection,
                          batch: list[StoredEvent], after: int, upto: int,
                          scope: shards.Scope, held: set[int] | None = None
                          ) -> list[Failure]:
        """Apply a batch (minus what is quarantined for this view) in the shard scope;
        record what fails alone. Returns the failures. `held`: the view's quarantined
        positions, read already (any superset of those in (`after`, `upto`])."""
        # Events already quarantined for this view (its checkpoint was moved back,
        # or a scratch replay mirrors a live one) stay skipped until retried.
        if held is None:
            held = await quarantine.held_positions(conn, proj.name, after, upto)
        if held:
            batch[:] = [se for se in batch if se.position not in held]
        with shards.in_scope(scope):
            failed = await self._apply_guarded(proj, conn, batch) if batch else []
        if failed:
            await quarantine.record(conn, proj.name, failed)
        return failed

    def _after_batch(self, proj: Projection, after: int, position: int,
                     batch: Sequence[StoredEvent], failed: Sequence[Failure],
                     started: float, moved: dict[int, int] | None = None) -> None:
        """Report a committed batch. `moved`: the shards it moved, each from where
        (None: every shard, from `after`)."""
        _report(proj.name, failed)
        log.debug("projection_batch", projection=proj.name, after=after, position=position,
                  events=len(batch), ms=round((time.perf_counter() - started) * 1000, 1),
                  **({} if moved is None else {"shards": {str(k): p for k, p in moved.items()}}))
        if proj.name in ERASING and any(se.type in FORGETS for se in batch):
            self._reclaim = True

    async def _bulk_step(self, proj: BulkLoadable, conn: AsyncConnection,
                         size: int, tables: Sequence[Any]) -> int | None:
        """Run the next step of the projection's bulk load, if one is in progress.

        Returns the positions of progress it reports (at least 1), or None when there
        is no bulk load. The last step moves the checkpoint to the load's head.
        """
        state = await read_bulk_state(conn, proj.name)
        if state is None:
            return None
        started = time.perf_counter()
        try:
            async with conn.begin_nested():
                new, moved = await proj.bulk_step(self.store, conn, state, size)
        except Exception as e:
            if not is_poison(e):
                raise
            await _abandon_bulk_load(self.store, conn, proj.name, tables)
            log.warning("projection_bulk_load_abandoned", projection=proj.name,
                        phase=state.get("phase"), error=type(e).__name__,
                        message=quarantine.safe_message(e))
            return 1
        await write_bulk_state(conn, proj.name, new)
        if new is None:
            await conn.execute(update(t.checkpoints).where(t.checkpoints.c.name == proj.name)
                               .values(position=int(state["head"]), updated_at=time.time()))
        log.debug("projection_bulk_step", projection=proj.name, phase=state.get("phase"),
                  done=new is None, ms=round((time.perf_counter() - started) * 1000, 1))
        return moved

    async def _apply_guarded(self, proj: Projection, conn: AsyncConnection,
                             batch: Sequence[StoredEvent]) -> list[Failure]:
        """Apply `batch`, each attempt in a savepoint; returns the events that failed
        alone (everything else is applied, in position order).

        A failing batch is split in halves, each applied (or split again) in turn, so
        k poison events among n cost about k * log2(n) extra attempts. Applying the
        halves one after the other is applying the batch: a fold resolves each slot
        and task from its whole set of facts.
        """
        try:
            async with conn.begin_nested():
                await proj.apply(self.store, conn, batch)
            return []
        except Exception as e:
            if not is_poison(e):
                raise
            if len(batch) == 1:
                return [Failure.of(batch[0], e)]
        mid = len(batch) // 2
        return (await self._apply_guarded(proj, conn, batch[:mid])
                + await self._apply_guarded(proj, conn, batch[mid:]))

    async def _reapply(self, proj: Projection, conn: AsyncConnection,
                       events: Sequence[StoredEvent]) -> list[Failure]:
        """Apply events behind the checkpoint again, one at a time, leaving the
        projection's own bookkeeping (`meta` rows `<name>.*`, which describe its state
        at the checkpoint) as it was."""
        m = t.meta.c
        mine = m.name.startswith(f"{proj.name}.", autoescape=True)
        kept = [dict(r._mapping) for r in (await conn.execute(select(t.meta).where(mine))).all()]
        failed: list[Failure] = []
        for se in events:
            failed += await self._apply_guarded(proj, conn, [se])
        await conn.execute(delete(t.meta).where(mine))
        if kept:
            await conn.execute(t.meta.insert(), kept)
        return failed

    async def retry_quarantined(self, names: Sequence[str] | None = None, *,
                                stale_only: bool = False) -> dict[str, dict[str, Any]]:
        """Apply every quarantined event again (of the named projections, default all;
        with `stale_only`, only those another code version quarantined).

        Each projection in one transaction under its checkpoint lock: an event that now
        applies leaves the quarantine, one that still fails stays (its error and code
        version updated). An event a projection now applies is applied again to the
        projections that read its view (`depends_on`), which applied it against a view
        without it. Returns, per projection retried, the positions cleared and kept.
        """
        await self.store.open()
        chosen = [p for p in self.projections if names is None or p.name in names]
        done: dict[str, dict[str, Any]] = {}
        for proj in chosen:
            async with self.store.view_write() as conn:
                await _lock(conn, self.store, proj.name)
                reached = await _reached(conn, proj.name)
                rows = await quarantine.entries(conn, proj.name, stale_only=stale_only)
                rows = [r for r in rows if int(r["position"]) <= reached(str(r["tenant"]))]
                if not rows:
                    continue
                events = await _events_at(self.store, conn, [int(r["position"]) for r in rows])
                failed = await self._reapply(proj, conn, events)
                kept = {f.event.position for f in failed}
                cleared = [se.position for se in events if se.position not in kept]
                for p in cleared:
                    await quarantine.release(conn, proj.name, p)
                await quarantine.record(conn, proj.name, failed)
                # A quarantined position the ledger no longer returns cannot be retried.
                gone = {int(r["position"]) for r in rows} - {se.position for se in events}
                for p in gone:
                    await quarantine.release(conn, proj.name, p)
            done[proj.name] = {"retried": len(rows), "cleared": cleared,
                               "still_quarantined": sorted(kept)}
            log.info("quarantine_retried", projection=proj.name, retried=len(rows),
                     cleared=len(cleared), kept=len(kept))
            if cleared:
                await self._reapply_downstream(proj, cleared)
        return done

    async def _reapply_downstream(self, source: Projection, positions: Sequence[int]) -> None:
        """Apply again, to every projection that reads `source`'s view (directly or
        not) and has passed them, the events `source` has just applied late."""
        readers = {source.name}
        for proj in self.projections:
            if not readers & set(proj.depends_on):
                continue
            readers.add(proj.name)
            async with self.store.view_write() as conn:
                position = await _lock(conn, self.store, proj.name)
                reached = await _reached(conn, proj.name)
                mine = [p for p in positions if p <= max(position, reached(None))]
                held = set()
                if mine:
                    held = await quarantine.held_positions(conn, proj.name, min(mine) - 1,
                                                           max(mine))
                events = [se for se in await _events_at(self.store, conn, mine)
                          if se.position not in held and se.position <= reached(se.tenant)
                          and (proj.types is None or se.type in proj.types)]
                failed = await self._reapply(proj, conn, events) if events else []
                await quarantine.record(conn, proj.name, failed)
            _report(proj.name, failed)

    async def catch_up(self, upto: int | None = None) -> dict[str, int]:
        """Run every projection until it reaches `upto` (default: the head now).

        In groups (`groups`): a view that reads other views catches up after them, as
        one after the other did, so an index fed from the views indexes what they hold
        at the end rather than every state on the way. A group of several projections,
        for a runner that owns no shard, goes in fused windows (`_window`): each
        transaction reads the window's events once, applies them to every projection
        of the group behind its end, in registry order, and moves their checkpoints in
        one statement. Where a window cannot be fused (a bulk load in progress, shard
        checkpoints ahead of a base), the group's rest is stepped projection by
        projection; so is a group of one."""
        await self.store.open()
        head = upto if upto is not None else await self.store.head()
        applied = {p.name: 0 for p in self.projections}
        for group in self.groups():
            if len(group) > 1 and self.owned is None and await self._windows(
                    group, head, applied):
                continue
            for proj in group:
                n = 0
                self._beside = True  # each step's statistics refresh beside the next
                try:
                    while True:
                        got = await self.step(proj, head, self.catch_up_size)
                        n += got
                        # at `head` already: no second transaction to find nothing left
                        if got == 0 or self._left.get(proj.name, -1) >= head:
                            break
                finally:
                    self._beside = False
                    await self._growth_done()
                applied[proj.name] += n
        self._snapshots_after(applied)
        return applied

    def groups(self) -> list[list[Projection]]:
        """The runner's projections in the groups `catch_up` runs one after the other:
        by stage (a projection is one stage after the latest of the views it reads that
        this runner runs, `depends_on`), and in each stage the `sparse` projections
        (events a small share of the ledger: a step of their own reads only theirs,
        `SPARSE_SPAN` batches wide) each alone, then the others together; registry
        order inside a group."""
        stage: dict[str, int] = {}
        for proj in self.projections:
            stage[proj.name] = 1 + max((stage[d] for d in proj.depends_on if d in stage),
                                       default=-1)
        out: list[list[Projection]] = []
        for k in sorted(set(stage.values())):
            mine = [p for p in self.projections if stage[p.name] == k]
            alone = [p for p in mine if getattr(p, "sparse", False)]
            together = [p for p in mine if p not in alone]
            out += [[p] for p in alone] + ([together] if together else [])
        return out

    async def _windows(self, group: Sequence[Projection], head: int,
                       applied: dict[str, int]) -> bool:
        """Fused windows of `group` up to `head`, adding what each moved to `applied`;
        False when a window could not be fused (the rest is then stepped)."""
        while True:
            got = await self._window(group, head)
            if got is None:
                return False
            end, moved = got
            for name, n in moved.items():
                applied[name] += n
            if end >= head or not moved:
                return True

    async def _window(self, group: Sequence[Projection], upto: int
                      ) -> tuple[int, dict[str, int]] | None:
        """One fused window of `catch_up`: the end it reached and the positions each
        projection moved, or None when it cannot be fused (nothing was changed)."""
        for proj in group:
            prepare = getattr(proj, "prepare", None)
            if prepare is not None:
                await prepare(self.store, self.batch_size, self.owned)
        with no_gc_pauses():
            fused, end, at, done = await self.store.transaction(
                lambda conn: self._round_in(conn, upto, group), views=True)
        if not fused:
            return None
        await self._finish_round(at, end, done)
        return end, {proj.name: end - position for proj, position, _b, _f, _s in done}

    def _snapshots_after(self, applied: dict[str, int]) -> None:
        """After a catch-up that moved the `vectors` view far, write recall's snapshot
        files it calls for, in the background (`index_cache.snapshot_soon`): the first
        recall after `memledger project` then maps a file instead of loading the user."""
        moved = applied.get("vectors", 0)
        end = self._left.get("vectors")
        if moved and end is not None:
            index_cache.snapshot_soon(self.store, max(0, end - moved), end)

    async def round(self, upto: int | None = None) -> int:
        """Bring every projection to `upto` (default: the head read inside the round)
        and return the position reached: in ONE view transaction when every projection
        is within one batch of it, else by `catch_up`.

        The single transaction does what a `step` of each projection does, in the same
        order (a projection reads the views of those before it, and their checkpoints,
        as moved already): the checkpoint rows locked (in name order), each
        projection's events (read once for all, filtered by its `types`) minus its
        quarantined positions applied, an event that fails alone quarantined
        (`_apply_plan`), the checkpoints moved. It saves a transaction per projection
        (the write lock's turn, BEGIN and COMMIT) and the statements every step repeats
        (head, shard count, events, quarantine, savepoints, checkpoint updates).
        The ledger's events are committed before (R14); the views change together.

        Falls back to `catch_up` where a step would do more than apply a range: a runner
        owning shards, a projection at 0 (a bulk load may run) or without a checkpoint
        row, shard checkpoints ahead of a base, more than `batch_size` positions."""
        await self.store.open()
        if self.owned is not None:
            end = upto if upto is not None else await self.store.head()
            await self.catch_up(end)
            return end
        for proj in self.projections:
            prepare = getattr(proj, "prepare", None)
            if prepare is not None:
                await prepare(self.store, self.batch_size, self.owned)
        with no_gc_pauses():
            # inline: one hand-off for the whole transaction (`Store.transaction`)
            fused, end, at, done = await self.store.transaction(
                lambda conn: self._round_in(conn, upto), views=True)
        if not fused:
            await self.catch_up(end)
            return end
        await self._finish_round(at, end, done)
        return end

    async def _finish_round(self, at: dict[str, int], end: int, done: list[
            tuple[Projection, int, list[StoredEvent], list[Failure], float]]) -> None:
        """What follows a committed fused round: report each batch, reclaim erased
        content, note the views' growth, retry what another code version quarantined."""
        for name, position in at.items():
            self._left[name] = max(position, end)
        for proj, position, batch, failed, started in done:
            self._after_batch(proj, position, end, batch, failed, started)
        if self._reclaim:
            self._reclaim = False
            await self.store.reclaim()
        for proj, position, _b, _f, _s in done:
            await self.store.recorder.note_growth([tb.name for tb in proj.tables],
                                                  end - position)
            if proj.name in self._stale:
                self._stale.discard(proj.name)
                await self.retry_quarantined([proj.name], stale_only=True)

    async def _round_in(self, conn: AsyncConnection, upto: int | None,
                        window: Sequence[Projection] | None = None) -> tuple[
            bool, int, dict[str, int],
            list[tuple[Projection, int, list[StoredEvent], list[Failure], float]]]:
        """The view transaction of `round`, in `conn`: whether it was fused (else
        nothing was changed and `catch_up` must run), the end position, the checkpoints
        it found and each projection's batch.

        `window` (`catch_up`): these projections only, and however far `upto` is,
        one window of `batch_size` positions from the slowest of their checkpoints;
        checkpoint rows are created if missing, and a projection at 0 is fused unless
        its bulk load is in progress."""
        projs = self.projections if window is None else list(window)
        names = [p.name for p in projs]
        cp, sc, qc = t.checkpoints.c, t.shard_checkpoints.c, t.quarantine.c
        done: list[tuple[Projection, int, list[StoredEvent], list[Failure], float]] = []
        # The round's statements are built once (`prepared`): only their values change.
        dialect = self.store.dialect
        lock = prepared(("runner.round.lock", dialect), lambda: for_update(
            self.store, select(cp.name, cp.position).where(
                cp.name.in_(bindparam("names", expanding=True))).order_by(cp.name)))
        at = {str(r[0]): int(r[1])
              for r in (await conn.execute(lock, {"names": names})).all()}
        if window is not None and len(at) < len(names):
            for name in names:
                if name not in at:
                    await _ensure_checkpoint(conn, self.store, name)
            at = {str(r[0]): int(r[1])
                  for r in (await conn.execute(lock, {"names": names})).all()}
        end = upto if upto is not None else await self.store.head(conn)
        low = min(at.values(), default=0)
        ahead = prepared("runner.round.shards", lambda: select(sc.projection).where(
            sc.projection.in_(bindparam("names", expanding=True))).limit(1))
        if window is None:  # a round: every projection past 0 and within one batch
            ready = low > 0 and end - low <= self.batch_size
        else:  # a window: one batch however far; at 0 unless its bulk load runs
            ready = low > 0 or not await self._loading(conn, projs, at)
        fused = (len(at) == len(names) and ready
                 and (await conn.execute(ahead, {"names": names})).first() is None)
        if not fused or end <= low:
            return fused, end, at, done
        count = await shards.shard_count(conn)
        if window is not None:
            end = min(low + self.batch_size, end)
        events = await self.store.read_events(conn, low, end - low, end)
        held: dict[str, set[int]] = {}
        quarantined = prepared("runner.round.held", lambda: select(
            qc.projection, qc.position).where(
            qc.projection.in_(bindparam("names", expanding=True)),
            qc.position > bindparam("low"), qc.position <= bindparam("end")))
        for name, pos in (await conn.execute(quarantined, {
                "names": names, "low": low, "end": end})).all():
            held.setdefault(str(name), set()).add(int(pos))
        plan: list[tuple[Projection, int, list[StoredEvent]]] = []
        for proj in projs:
            position = at[proj.name]
            if end <= position:
                continue
            await self._check_stale(conn, proj)
            mine = held.get(proj.name, set())
            plan.append((proj, position, [
                se for se in events if se.position > position
                and se.position not in mine
                and (proj.types is None or se.type in proj.types)]))
        # Every checkpoint moves first, in one statement: a projection that reads
        # another's position (history, the indexes) finds it where a step would, as
        # the one before it has applied the same range.
        move = prepared("runner.round.move", lambda: update(t.checkpoints).where(
            cp.name.in_(bindparam("names", expanding=True))).values(
            position=bindparam("end"), updated_at=bindparam("now")))
        await conn.execute(move, {"names": [p.name for p, _, _ in plan], "end": end,
                                  "now": time.time()})
        started = time.perf_counter()
        known = rounds.RoundFacts({name: max(pos, end) for name, pos in at.items()})
        with rounds.applying(known):
            failures = await self._apply_plan(conn, plan, shards.Scope(count))
        for proj, position, batch in plan:
            failed = failures.get(proj.name, [])
            if failed:
                await quarantine.record(conn, proj.name, failed)
            done.append((proj, position, batch, failed, started))
        return fused, end, at, done

    @staticmethod
    async def _loading(conn: AsyncConnection, projs: Sequence[Projection],
                       at: dict[str, int]) -> bool:
        """Whether one of `projs` at 0 in `at` has a bulk load in progress (read after
        the checkpoint locks, as `_step_all` reads it)."""
        m = t.meta.c
        loads = [proj.name + BULK_SUFFIX for proj in projs
                 if at.get(proj.name) == 0 and isinstance(proj, BulkLoadable)]
        if not loads:
            return False
        return (await conn.execute(select(m.name).where(m.name.in_(loads)).limit(1))
                ).first() is not None

    async def _apply_plan(self, conn: AsyncConnection,
                          plan: Sequence[tuple[Projection, int, list[StoredEvent]]],
                          scope: shards.Scope) -> dict[str, list[Failure]]:
        """Apply each projection's batch, in order, in one savepoint; if an event
        fails, that savepoint is rolled back and each batch is applied as a step
        does (`_apply_guarded`: bisected down to the events that fail alone)."""
        with shards.in_scope(scope):
            try:
                async with conn.begin_nested():
                    for proj, _, batch in plan:
                        if batch:
                            await proj.apply(self.store, conn, batch)
                return {}
            except Exception as e:
                if not is_poison(e):
                    raise
            facts = rounds.current()
            if facts is not None:  # read from views the rollback has undone
                facts.views.clear()
            return {proj.name: await self._apply_guarded(proj, conn, batch)
                    for proj, _, batch in plan if batch}

    async def positions(self, conn: AsyncConnection | None = None) -> dict[str, int]:
        """Each projection's position: its slowest shard's, of the owned shards when the
        runner owns some (read in `conn`, if given; no lock). With no shard owned, the
        base position (nothing of this runner's to do)."""
        if conn is None:
            await self.store.open()
            async with self.store.read() as c:
                return await self.positions(c)
        names = [p.name for p in self.projections]
        count = await shards.shard_count(conn)
        owned = None if self.owned is None else [k for k in self.owned if k < count]
        if owned == []:
            return await shards.low_watermarks(conn, names)
        at = await shards.shard_positions(conn, names, count, owned)
        return {n: min(at[n].values()) for n in names}


async def _ensure_checkpoint(conn: AsyncConnection, store: Store, name: str) -> None:
    await conn.execute(insert_ignore(store, t.checkpoints).values(name=name, position=0))


async def _lock(conn: AsyncConnection, store: Store, name: str) -> int:
    """Lock a projection's checkpoint row (creating it) for this transaction; its position."""
    await _ensure_checkpoint(conn, store, name)
    q = for_update(store, select(t.checkpoints.c.position).where(t.checkpoints.c.name == name))
    return int((await conn.execute(q)).scalar_one())


async def _reached(conn: AsyncConnection, name: str) -> Callable[[str | None], int]:
    """How far a projection's shard of a tenant has got (None: the furthest shard)."""
    count = await shards.shard_count(conn)
    at = (await shards.shard_positions(conn, [name], count))[name]

    def reached(tenant: str | None) -> int:
        if tenant is None:
            return max(at.values())
        return at[shards.shard_of(tenant, count)]
    return reached


async def _events_at(store: Store, conn: AsyncConnection,
                     positions: Sequence[int]) -> list[StoredEvent]:
    """The events at these positions, in position order."""
    out: list[StoredEvent] = []
    for p in sorted(set(positions)):
        out += await store.read_events(conn, p - 1, 1, p)
    return out


async def _abandon_bulk_load(store: Store, conn: AsyncConnection, name: str,
                             tables: Sequence[Any]) -> None:
    """End a bulk load that failed on what it read: empty the view again and leave the
    checkpoint at 0, so the projection replays event by event from the start, where an
    event it cannot apply is quarantined alone (the rebuild stays marked in progress)."""
    m = t.meta.c
    for table in tables:
        await clear_table(store, conn, table)
    await conn.run_sync(restore_shape, name, tables)
    await conn.execute(delete(t.meta).where(m.name.startswith(f"{name}.", autoescape=True)))


def _report(projection: str, failed: Sequence[Failure]) -> None:
    """One structured warning per quarantined event: where, what kind of error, no value."""
    for f in failed:
        log.warning("projection_event_quarantined", projection=projection,
                    position=f.event.position, tenant=f.event.tenant, type=f.event.type,
                    error=f.error, message=f.message)
