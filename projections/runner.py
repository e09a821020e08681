"""The projection runner: reads the ledger after a checkpoint and updates the views.

The view change and the new checkpoint commit in one transaction, so a batch is
applied exactly once however often a runner is woken or restarted. The checkpoint row
is locked for the whole transaction (SQLite: BEGIN IMMEDIATE; PostgreSQL: SELECT ...
FOR UPDATE), so a second runner of the same projection waits instead of applying the
batch twice, and a killed holder's lock dies with its connection.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import orjson
import structlog
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.store import Store
from projections.erasure import FORGETS
from projections.protocol import BulkLoadable, Projection
from projections.registry import default_projections
from projections.sql import for_update, insert_ignore

log = structlog.get_logger("memledger.projections")

#: `meta` row of a bulk load in progress: `<projection name>` + this (`projections.bulk`).
BULK_SUFFIX: Final = ".bulk"
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
                 batch_size: int = 1000) -> None:
        self.store = store
        self.projections = list(projections or default_projections())
        self.batch_size = batch_size

    async def step(self, proj: Projection, upto: int | None = None,
                   size: int | None = None) -> int:
        """Apply one batch of at most `size` positions (default: `batch_size`) to one
        projection; returns how many positions it moved."""
        with no_gc_pauses():
            return await self._step(proj, upto, size or self.batch_size)

    async def _step(self, proj: Projection, upto: int | None, size: int) -> int:
        cp = t.checkpoints.c
        async with self.store.view_write() as conn:
            q = for_update(self.store, select(cp.position).where(cp.name == proj.name))
            row = (await conn.execute(q)).first()
            if row is None:
                await _ensure_checkpoint(conn, self.store, proj.name)
                row = (await conn.execute(q)).first()
                assert row is not None
            position = int(row[0])
            # Only at 0 can a bulk load be running. Its state is read in a statement of
            # its own, after the lock: on PostgreSQL a subquery of the locking SELECT
            # would see the snapshot from before the wait.
            if position == 0 and isinstance(proj, BulkLoadable):
                moved = await self._bulk_step(proj, conn, size)
                if moved is not None:
                    return moved
            end = upto if upto is not None else await self.store.head(conn)
            if end <= position:
                return 0
            # Positions are gap-free, so a batch is a range of positions; a projection
            # that names its event types reads only those, and still moves past the rest.
            hi = min(position + size, end)
            types = getattr(proj, "types", None)
            batch = await self.store.read_events(conn, position, size, hi, types=types)
            started = time.perf_counter()
            if batch:
                await proj.apply(self.store, conn, batch)
            await conn.execute(update(t.checkpoints).where(cp.name == proj.name)
                               .values(position=hi, updated_at=time.time()))
        log.debug("projection_batch", projection=proj.name, after=position, position=hi,
                  events=len(batch), ms=round((time.perf_counter() - started) * 1000, 1))
        if proj.name == "erasure" and any(se.type in FORGETS for se in batch):
            await self.store.reclaim()
        return hi - position

    async def _bulk_step(self, proj: BulkLoadable, conn: AsyncConnection,
                         size: int) -> int | None:
        """Run the next step of the projection's bulk load, if one is in progress.

        Returns the positions of progress it reports (at least 1), or None when there
        is no bulk load. The last step moves the checkpoint to the load's head.
        """
        state = await read_bulk_state(conn, proj.name)
        if state is None:
            return None
        started = time.perf_counter()
        new, moved = await proj.bulk_step(self.store, conn, state, size)
        await write_bulk_state(conn, proj.name, new)
        if new is None:
            await conn.execute(update(t.checkpoints).where(t.checkpoints.c.name == proj.name)
                               .values(position=int(state["head"]), updated_at=time.time()))
        log.debug("projection_bulk_step", projection=proj.name, phase=state.get("phase"),
                  done=new is None, ms=round((time.perf_counter() - started) * 1000, 1))
        return moved

    async def catch_up(self, upto: int | None = None) -> dict[str, int]:
        """Run every projection until it reaches `upto` (default: the head now)."""
        await self.store.open()
        head = upto if upto is not None else await self.store.head()
        applied: dict[str, int] = {}
        for proj in self.projections:
            n = 0
            while True:
                got = await self.step(proj, head)
                n += got
                if got == 0:
                    break
            applied[proj.name] = n
        return applied

    async def positions(self, conn: AsyncConnection | None = None) -> dict[str, int]:
        """Each projection's checkpoint position (read in `conn`, if given; no lock)."""
        cp = t.checkpoints.c
        if conn is None:
            await self.store.open()
            async with self.store.read() as c:
                rows = (await c.execute(select(cp.name, cp.position))).all()
        else:
            rows = (await conn.execute(select(cp.name, cp.position))).all()
        found = {r[0]: int(r[1]) for r in rows}
        return {p.name: found.get(p.name, 0) for p in self.projections}


async def _ensure_checkpoint(conn: AsyncConnection, store: Store, name: str) -> None:
    await conn.execute(insert_ignore(store, t.checkpoints).values(name=name, position=0))
