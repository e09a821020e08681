"""`Runner.catch_up` of several projections goes in fused windows (issue 20): each
transaction reads a window of events once and hands it to every projection behind its
end, and moves their checkpoints together. The views must not depend on it: any
window size, with the projections staggered at any positions beforehand, gives the
rows that each projection stepped alone, one event at a time, gives."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from bench.common import mixed_events
from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections.registry import default_projections
from projections.runner import Runner
from replay.rebuild import reset_projection
from tests.helpers import dump_views
from tests.projections.test_views import gen_events


async def _step_alone(store: Store, names: tuple[str, ...] | None = None) -> None:
    """Each projection (of `names`, default all) stepped on its own, one position per
    step, to the head: the reference."""
    runner = Runner(store, batch_size=1)
    head = await store.head()
    for proj in runner.projections:
        if names is None or proj.name in names:
            while await runner.step(proj, head, 1):
                pass


async def _checkpoints(store: Store) -> dict[str, int]:
    cp = t.checkpoints.c
    async with store.read() as conn:
        return {str(r[0]): int(r[1])
                for r in (await conn.execute(select(cp.name, cp.position))).all()}


class _Reads:
    """Counts the event reads of a store (`Store.read_events`)."""

    def __init__(self, store: Store) -> None:
        self.calls = 0
        inner = store.read_events

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return await inner(*args, **kwargs)
        store.read_events = counted  # type: ignore[method-assign]


@given(seed=st.integers(0, 10**6), n=st.integers(5, 70), only=st.sampled_from(
    [None, ("memories", "lexical", "history"), ("memories", "vectors", "history")]))
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_windows_give_the_views_of_each_projection_alone(
        tmp_path: Path, seed: int, n: int, only: tuple[str, ...] | None) -> None:
    """For any mix of writes, corrections, marks, forgets and task notes, appended in
    random parts with a `catch_up` of random window size after each, a view fed by the
    ledger alone stepped ahead on its own first, the views equal each projection stepped alone one
    event at a time (property); also for runners of a few of the views."""
    rng = random.Random(seed)
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    events = [parse_event(e) for e in gen_events(rng, n)]
    names = only
    views = []
    for name in ("alone", "windows"):
        store = Store(f"sqlite+aiosqlite:///{d / name}.db",
                      register_path=str(d / f"{name}.forgets"))
        await store.open()
        try:
            if name == "alone":
                for ev in events:
                    await store.append_one(ev)
                await _step_alone(store, names)
            else:
                projs = [p for p in default_projections() if names is None or p.name in names]
                i = 0
                while i < len(events):
                    j = i + rng.randint(1, max(1, len(events) // 3))
                    await store.append(events[i:j])
                    i = j
                    # A view that reads others (`depends_on`) stepped ahead of them
                    # stays unsettled until its next event, whatever runs next: only
                    # views fed by the ledger alone are stepped ahead.
                    lone = rng.choice([p for p in projs if not p.depends_on])
                    await Runner(store, [lone], batch_size=rng.randint(1, 5)).step(lone)
                    await Runner(store, projs, batch_size=rng.randint(1, 9)).catch_up()
                head = await store.head()
                assert set((await _checkpoints(store)).values()) == {head}
            views.append(await dump_views(store, t.VIEW_TABLES))
        finally:
            await store.close()
    assert views[0] == views[1]


def test_groups_put_readers_after_their_views_and_sparse_views_alone(
        sqlite_url: str) -> None:
    """The registry's views catch up in this order: tasks and erasure alone (sparse),
    memories, then the views that read views (vectors, lexical, history) together."""
    runner = Runner(Store(sqlite_url))
    assert [[p.name for p in g] for g in runner.groups()] == [
        ["tasks"], ["erasure"], ["memories"], ["vectors", "lexical", "history"]]


async def test_a_window_reads_once_for_every_projection(sqlite_url: str,
                                                       register_path: str) -> None:
    """A catch-up of the views that read views reads the ledger once per window, not
    once per projection: 600 events in windows of 100 positions are six reads."""
    store = Store(sqlite_url, register_path=register_path, vault=False)
    await store.open()
    try:
        await store.append(mixed_events(600, seed=5, tenants=3))
        projs = default_projections()
        sources = [p for p in projs if not p.depends_on]
        readers = [p for p in projs if p.depends_on]
        await Runner(store, sources, batch_size=100).catch_up()
        reads = _Reads(store)
        applied = await Runner(store, readers, batch_size=100).catch_up()
        assert applied == {p.name: 600 for p in readers}
        assert reads.calls == 6
        assert set((await _checkpoints(store)).values()) == {600}
    finally:
        await store.close()


async def test_a_bulk_load_in_progress_is_stepped_not_fused(sqlite_url: str,
                                                           register_path: str) -> None:
    """A view emptied for a bulk load (`reset_projection`) is refilled by its load,
    not by fused windows, and the views end as a full replay gives them."""
    store = Store(sqlite_url, register_path=register_path, vault=False)
    await store.open()
    try:
        await store.append(mixed_events(300, seed=9, tenants=2))
        await Runner(store, batch_size=50).catch_up()
        want = await dump_views(store, t.VIEW_TABLES)
        memories = next(p for p in default_projections() if p.name == "memories")
        await reset_projection(store, memories, bulk=True)
        async with store.read() as conn:
            assert (await conn.execute(select(t.meta.c.name).where(
                t.meta.c.name == "memories.bulk"))).first() is not None
        await Runner(store, batch_size=50).catch_up()
        async with store.read() as conn:
            assert (await conn.execute(select(t.meta.c.name).where(
                t.meta.c.name == "memories.bulk"))).first() is None
        assert await dump_views(store, t.VIEW_TABLES) == want
    finally:
        await store.close()


@pytest.mark.postgres
async def test_windows_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    """On PostgreSQL: a catch-up in windows, after some views were stepped ahead on
    their own, gives the views of each projection stepped alone."""
    events = mixed_events(300, seed=4, tenants=3)
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    try:
        await store.append(events[:200])
        projs = default_projections()
        for p in projs[::2]:
            await Runner(store, [p], batch_size=37).step(p)
        await Runner(store, batch_size=40).catch_up()
        await store.append(events[200:])
        await Runner(store, batch_size=40).catch_up()
        assert set((await _checkpoints(store)).values()) == {300}
        windows = await dump_views(store, t.VIEW_TABLES)
        for p in projs:
            await reset_projection(store, p, bulk=False)
        await _step_alone(store)
        assert await dump_views(store, t.VIEW_TABLES) == windows
    finally:
        await store.close()
