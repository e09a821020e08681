"""The tasks view on PostgreSQL takes a batch's notes from its events instead of reading
them back (`projections.task_rows.summarize_tasks`, issue 20): the summaries must be
those a bulk load gives (which reads every note from `task_notes`), for batches of any
size, and when a runner of some shards has moved ahead of the whole projection (the
whole step then skips that shard's events it has applied, whose notes it must read)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.common import mixed_events
from ledger import schema as t
from ledger.store import Store
from projections import shards
from projections.registry import default_projections
from projections.runner import Runner
from replay.rebuild import rebuild
from tests.helpers import dump_views

pytestmark = pytest.mark.postgres
TABLES = (t.task_notes, t.tasks_view)


@pytest.mark.parametrize("seed", [5, 23])
async def test_batch_notes_give_the_bulk_loaded_summaries(pg_url: str, tmp_path: Path,
                                                          seed: int) -> None:
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    try:
        events = mixed_events(600, seed=seed, tenants=3)
        await store.append(events)
        head = await store.head()
        tasks = next(p for p in default_projections() if p.name == "tasks")
        rng = random.Random(seed)
        # A runner of one tenant's shard goes ahead first...
        ahead = Runner(store, [tasks])
        ahead.owned = frozenset({shards.shard_of(events[0].tenant, shards.DEFAULT_SHARDS)})
        while await ahead.step(tasks, head // 2, rng.randint(10, 40)):
            pass
        # ... then the whole projection, by random sizes, to the head.
        whole = Runner(store, [tasks])
        while await whole.step(tasks, head, rng.randint(1, 150)):
            pass
        stepped = await dump_views(store, TABLES)
        assert stepped["tasks_view"] and stepped["task_notes"]
        await rebuild(store, ["tasks"], progress=None, bulk=True)
        assert await dump_views(store, TABLES) == stepped
        # Event by event, each note read back by the next batches.
        await rebuild(store, ["tasks"], progress=None, bulk=False, batch_size=1)
        assert await dump_views(store, TABLES) == stepped
    finally:
        await store.close()
