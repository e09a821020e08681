"""A step and a fused window of a catch-up apply with a larger SQLite page cache
(`projections.runner.page_cache`), and the connection gets its own size back after."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from bench.common import mixed_events
from ledger import schema as t
from ledger.records import StoredEvent
from ledger.store import Store
from projections.runner import STEP_PAGE_CACHE_KIB, Runner
from projections.views import MemoryProjection


class _Seen:
    """A projection that records its connection's page cache size in each apply."""

    types = None
    depends_on: tuple[str, ...] = ()
    tables = (t.meta,)

    def __init__(self, name: str) -> None:
        self.name = name
        self.sizes: list[int] = []

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        self.sizes.append(int((await conn.exec_driver_sql("PRAGMA cache_size")).scalar()))


async def _cache_size(store: Store) -> Any:
    async with store.view_write() as conn:
        return (await conn.exec_driver_sql("PRAGMA cache_size")).scalar()


async def test_steps_and_windows_apply_with_the_large_cache(sqlite_url: str,
                                                            register_path: str) -> None:
    store = Store(sqlite_url, register_path=register_path)
    await store.open()
    try:
        await store.append(mixed_events(40))
        before = await _cache_size(store)
        assert before != -STEP_PAGE_CACHE_KIB
        alone, a, b = _Seen("seen_alone"), _Seen("seen_a"), _Seen("seen_b")
        await Runner(store, [alone], batch_size=10).step(alone)
        assert alone.sizes == [-STEP_PAGE_CACHE_KIB]
        assert await _cache_size(store) == before
        # Two projections of one stage go in fused windows.
        await Runner(store, [MemoryProjection(), a, b], batch_size=10).catch_up()
        assert a.sizes and set(a.sizes) == set(b.sizes) == {-STEP_PAGE_CACHE_KIB}
        assert await _cache_size(store) == before
    finally:
        await store.close()
