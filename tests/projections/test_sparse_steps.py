"""Steps of a projection that names its event types (issue 20): a step applies up to
`size` of ITS events within `SPARSE_SPAN * size` positions, instead of `size` positions
whatever they hold. The views must not depend on it: any step sizes, in any mix, give
the rows that one event at a time gives, and no step passes an event of its types it
did not apply (the checkpoint stops at its `size`-th event)."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from bench.common import mixed_events
from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections.registry import default_projections
from projections.runner import SPARSE_SPAN, Runner
from replay.rebuild import rebuild, reset_projection
from tests.helpers import dump_views
from tests.projections.test_views import gen_events


async def _types_between(store: Store, types: tuple[str, ...], lo: int, hi: int) -> int:
    """How many events of `types` lie in (`lo`, `hi`]."""
    async with store.read() as conn:
        return len((await conn.execute(select(t.events.c.position).where(
            t.events.c.position > lo, t.events.c.position <= hi,
            t.events.c.type.in_(types)))).all())


async def _step_everything(store: Store, rng: random.Random, head: int,
                           largest: int = 6) -> None:
    """Every projection, in the registry's order, stepped by random sizes to `head`,
    each step checked against the rule of its reach."""
    runner = Runner(store)
    for proj in runner.projections:
        while True:
            async with store.read() as conn:
                before = int((await conn.execute(select(t.checkpoints.c.position).where(
                    t.checkpoints.c.name == proj.name))).scalar() or 0)
            if before >= head:
                break
            size = rng.randint(1, largest)
            moved = await runner.step(proj, head, size)
            assert moved > 0
            after = before + moved
            assert after <= head
            if proj.types is None:
                assert moved == min(size, head - before)
                continue
            assert moved <= SPARSE_SPAN * size
            mine = await _types_between(store, proj.types, before, after)
            assert mine <= size
            # Short of its span and of the head only where its `size`-th event is.
            if after < min(before + SPARSE_SPAN * size, head):
                assert mine == size
                assert await _types_between(store, proj.types, after - 1, after) == 1


@given(seed=st.integers(0, 10**6), n=st.integers(5, 70))
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_any_step_sizes_give_the_event_by_event_views(tmp_path: Path, seed: int,
                                                           n: int) -> None:
    """For any mix of writes, corrections, marks, forgets and task notes, stepping every
    projection by random sizes gives every view row for row as one event per batch
    (property), and each step of a typed projection reaches exactly as far as its rule
    says."""
    rng = random.Random(seed)
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    events = [parse_event(e) for e in gen_events(rng, n)]
    views = []
    for name in ("one", "random"):
        store = Store(f"sqlite+aiosqlite:///{d / name}.db",
                      register_path=str(d / f"{name}.forgets"))
        await store.open()
        try:
            for ev in events:
                await store.append_one(ev)
            head = await store.head()
            if name == "one":
                await Runner(store, batch_size=1).catch_up()
            else:
                await _step_everything(store, rng, head)
            views.append(await dump_views(store, t.VIEW_TABLES))
        finally:
            await store.close()
    assert views[0] == views[1]


@pytest.mark.postgres
async def test_sparse_steps_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    """On PostgreSQL (where a step reads its facts in one statement): a ledger with
    task events among many memory writes, stepped by random sizes, has the views an
    event-by-event rebuild in large batches gives, and the tasks view catches up in
    about one step per `batch_size` of its own events, not of all positions."""
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    try:
        await store.append(mixed_events(400, seed=3, tenants=3))
        head = await store.head()
        await _step_everything(store, random.Random(11), head, largest=80)
        stepped = await dump_views(store, t.VIEW_TABLES)
        await rebuild(store, bulk=False, progress=False, batch_size=1000)
        assert await dump_views(store, t.VIEW_TABLES) == stepped
        tasks = next(p for p in default_projections() if p.name == "tasks")
        await reset_projection(store, tasks, bulk=False)
        steps, runner = 0, Runner(store, [tasks], batch_size=40)
        while await runner.step(tasks, head):
            steps += 1
        n_tasks = await _types_between(store, tuple(tasks.types or ()), 0, head)
        assert n_tasks > 0
        assert steps <= n_tasks // 40 + 1 < head // 40
        assert await dump_views(store, t.VIEW_TABLES) == stepped
    finally:
        await store.close()
