"""The views check of `replay verify`: every view table equals what a fresh replay of
the same ledger into a scratch SQLite database gives, each projection replayed up to
its own checkpoint, skipping the events quarantined for it."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.recorder import Recorder
from ledger.store import Store
from projections import quarantine
from projections.protocol import BulkLoadable
from projections.runner import Runner, write_bulk_state
from projections.vectors import record_embedder, resolve_embedder
from replay.rebuild import REBUILD_BATCH
from replay.rows import row_dict, stream_rows
from replay.verify.report import Report

#: View columns that may differ between two correct replays. None so far: views hold
#: ledger positions, but a fresh replay of the same ledger has the same positions.
VOLATILE: Final[dict[str, frozenset[str]]] = {}
#: Float columns stored as bytes: equal within rounding (numpy may sum in another order
#: when it embeds a different batch of texts).
FLOAT_BLOBS: Final = {("vectors", "vector"), ("mem_history", "vector")}


async def _copy_ledger(conn: AsyncConnection, store: Store, scratch: Store) -> None:
    # The quarantine too: the fresh replay skips what the live views skipped, so a
    # quarantined event is reported as such (`verify`'s `quarantined`), not as a
    # difference in every view row it would have changed.
    for table in (t.events, t.tombstones, t.task_owners, t.quarantine):
        async for part in stream_rows(conn, table, store.recorder, batch=2000):
            async with scratch.write() as dst:
                await scratch.recorder.import_rows(dst, table, [row_dict(r) for r in part])
    # The ledger's embedder (`config set embedder`, or the model its vectors carried):
    # the fresh index and history are embedded with it, as the live ones were.
    name, source = await resolve_embedder(conn)
    if source in ("recorded", "vectors"):
        async with scratch.view_write() as dst:
            await record_embedder(dst, name)


async def _rows(conn: AsyncConnection, table: Any, recorder: Recorder
                ) -> AsyncIterator[dict[str, Any]]:
    async for part in stream_rows(conn, table, recorder, batch=2000):
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


async def _compare_table(live: AsyncConnection, live_recorder: Recorder,
                         fresh: AsyncConnection, fresh_recorder: Recorder, table: Any,
                         rep: Report) -> int:
    skip = VOLATILE.get(table.name, frozenset())
    a_it = _rows(live, table, live_recorder).__aiter__()
    b_it = _rows(fresh, table, fresh_recorder).__aiter__()

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


async def compare_views(conn: AsyncConnection, store: Store, rep: Report,
                        positions: dict[str, int]) -> dict[str, int]:
    """Compare every view table in `conn`'s snapshot with a fresh replay of the same
    ledger into a scratch SQLite database, each projection up to `positions`."""
    with tempfile.TemporaryDirectory(prefix="memledger-verify-") as d:
        scratch = Store(f"sqlite+aiosqlite:///{Path(d) / 'replay.db'}",
                        register_path=str(Path(d) / "replay.forgets"))
        try:
            await scratch.open()
            await _copy_ledger(conn, store, scratch)
            runner = Runner(scratch, batch_size=REBUILD_BATCH, retry_upgraded=False)
            async with scratch.read() as c:
                held = await quarantine.summary(c)
            for proj in runner.projections:
                upto = positions.get(proj.name, 0)
                if upto <= 0:
                    continue
                # A bulk load cannot skip single events: a view with quarantined
                # events is replayed event by event.
                if isinstance(proj, BulkLoadable) and proj.name not in held:
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
                    counts[str(table.name)] = await _compare_table(
                        conn, store.recorder, fresh, scratch.recorder, table, rep)
            return counts
        finally:
            await scratch.close()
