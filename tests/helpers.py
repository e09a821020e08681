"""Test helpers: dump views comparably, replay a ledger into a fresh database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import LargeBinary, select, type_coerce

from ledger import schema as t
from ledger.store import Store
from ledger.vault import is_sealed, sealed_key_id
from projections.runner import Runner

#: Columns that cite ledger positions: they depend on arrival order by nature.
ARRIVAL_COLUMNS = {"position"}


async def dump_views(store: Store, tables: tuple[Any, ...] = (t.mem_versions, t.tasks_view)
                     ) -> dict[str, list[tuple[Any, ...]]]:
    """Every view row, minus arrival-dependent columns, sorted."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    async with store.read() as conn:
        for table in tables:
            cols = [c for c in table.c if c.name not in ARRIVAL_COLUMNS]
            rows = (await conn.execute(select(*cols))).all()
            out[table.name] = sorted(
                (tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in rows),
                key=repr)
    return out


async def fresh_replay(store: Store, tmp_path: Path, name: str = "fresh", *,
                       batch_size: int = 1000) -> Store:
    """Copy the ledger tables into a new SQLite database and project from scratch (in
    batches of `batch_size` positions: a large ledger replays faster in fewer batches)."""
    fresh = Store(f"sqlite+aiosqlite:///{tmp_path / (name + '.db')}",
                  register_path=str(tmp_path / (name + ".forgets")))
    await fresh.open()
    async with store.read() as src, fresh.write() as dst:
        for table in (t.events, t.tombstones, t.task_owners):
            rows = [dict(r._mapping) for r in (await src.execute(select(table))).all()]
            if rows:
                await dst.execute(table.insert(), rows)
    await Runner(fresh, batch_size=batch_size).catch_up()
    return fresh


#: The views a write touches: what `assert_views_replay` compares by default.
WRITE_VIEWS: tuple[Any, ...] = (t.mem_versions, t.tasks_view, t.mem_history, t.lexical_docs)


async def assert_views_replay(store: Store, tmp_path: Path,
                              tables: tuple[Any, ...] = WRITE_VIEWS) -> None:
    """Every view of `tables` equals a fresh replay of the store's ledger (R14)."""
    fresh = await fresh_replay(store, tmp_path)
    try:
        assert await dump_views(store, tables) == await dump_views(fresh, tables)
    finally:
        await fresh.close()


async def sealed_key_ids(store: Store) -> dict[str, str]:
    """Idempotency key -> the key id its sealed payload names (a pool key, or the
    derived id of a ledger sealed before the pool)."""
    e = t.events.c
    async with store.read() as conn:
        rows = (await conn.execute(select(e.idempotency_key, type_coerce(
            e.payload, LargeBinary)))).all()
    return {r[0]: sealed_key_id(bytes(r[1])) for r in rows
            if r[1] is not None and is_sealed(bytes(r[1]))}
