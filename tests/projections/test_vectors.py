"""The vector index projection: one entry per active memory and open task, on both backends.

R14 (derived index kept from the primary record), R20 (forgotten entries removed), and
the convergence of the index whichever order the projections run in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from sqlalchemy import select

from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections.embedding import HashedNgramEmbedder
from projections.erasure import ErasureProjection
from projections.recall import recall
from projections.runner import Runner
from projections.vectors import (
    EMBEDDER_ENV,
    PENDING_META,
    VectorProjection,
    current_embedder,
    from_blobs,
    register_embedder,
)
from projections.views import MemoryProjection, TaskProjection
from replay.rebuild import rebuild
from tests.factories import event, src, write

NS = ["shop-a", "u7", "preferences"]
NOW = 1_800_000_000_000_000


def at(minute: int) -> str:
    """A source time on the running example's first day."""
    return f"2026-09-20T10:{minute:02d}:00+08:00"


async def append(store: Store, *events: dict[str, Any]) -> None:
    """Append wire events in one call."""
    await store.append([parse_event(e) for e in events])


async def entries(store: Store) -> dict[str, Any]:
    """The index as {item_id: row}."""
    async with store.read() as conn:
        return {r.item_id: r for r in (await conn.execute(select(t.vectors))).all()}


async def test_one_entry_per_active_memory_with_model(store: Store) -> None:
    """Only a slot's active version is indexed, with model, width and float32 bytes (R12, R14)."""
    await append(store,
                 write("code_language", "Java", memory_id="M18", source=src(at=at(1))),
                 write("code_language", "Python", memory_id="M31", supersedes="M18",
                       etype="memory.corrected", source=src(at=at(5))),
                 write("reply_style", "brief", memory_id="M40", source=src(at=at(2))))
    await Runner(store).catch_up()
    got = await entries(store)
    assert set(got) == {"M31", "M40"}
    emb = current_embedder()
    row = got["M31"]
    assert (row.kind, row.layer, row.model, row.dim) == ("memory", "long", emb.name, emb.dim)
    assert row.ns_path == "shop-a\x1fu7\x1fpreferences\x1f"
    vec = from_blobs([bytes(row.vector)], row.dim)[0]
    assert len(bytes(row.vector)) == 4 * emb.dim
    assert np.allclose(vec, emb.embed(["code_language: Python"])[0])


async def test_candidates_and_supersessions_have_no_entry(store: Store) -> None:
    """A candidate is indexed once confirmed; a supersession removes an entry (R10, R13)."""
    await append(store,
                 write("reply_style", "urgent refunds always", memory_id="C1",
                       source=src("model_inference", at=at(1))),
                 write("timezone", "Asia/Shanghai", memory_id="Z1", source=src(at=at(1))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == {"Z1"}
    await append(store,
                 event("memory.confirmed", {"memory_id": "C1"}, source=src(at=at(3))),
                 event("memory.superseded", {"memory_id": "Z1"}, source=src(at=at(4))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == {"C1"}


async def test_confirmed_candidate_supersedes_across_slots(store: Store) -> None:
    """Confirming a candidate that supersedes a memory of another key drops that entry."""
    await append(store,
                 write("lang", "Java", memory_id="OLD", source=src(at=at(1))),
                 write("code_language", "Python", memory_id="NEW", supersedes="OLD",
                       source=src("user_statement", at=at(2))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == {"OLD"}
    await append(store, event("memory.confirmed", {"memory_id": "NEW"}, source=src(at=at(3))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == {"NEW"}


async def test_forgets_remove_entries_and_later_writes_return(store: Store) -> None:
    """Forget by id, key, prefix removes entries; a write after the forget is indexed (R20)."""
    await append(store,
                 write("lang", "zh", memory_id="A", source=src(at=at(1))),
                 write("style", "brief", memory_id="B", source=src(at=at(1))),
                 write("addr", "Hangzhou", memory_id="C", source=src(at=at(1))),
                 write("lang", "zh", memory_id="U8", user="u8",
                       source=src(at=at(1))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == {"A", "B", "C", "U8"}
    await append(store,
                 event("memory.forgotten", {"memory_id": "B"}, source=src(at=at(2))),
                 event("memory.forgotten", {"namespace": NS, "key": "lang"},
                       source=src(at=at(2))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == {"C", "U8"}
    await append(store, write("lang", "en", memory_id="A2", source=src(at=at(9))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == {"A2", "C", "U8"}
    await append(store, event("memory.forgotten", {"namespace_prefix": ["shop-a", "u7"]},
                              source=src(at=at(10))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == {"U8"}  # the other user's entry stays


async def test_open_tasks_indexed_closed_and_purged_removed(store: Store) -> None:
    """An open task summary has an entry; closing or purging the task removes it (R6)."""
    sor = src("system_of_record", "aftersales", at(1))
    await append(store,
                 event("task.opened", {"task_key": "T900", "namespace": ["shop-a", "u7", "t"],
                                       "refs": {"order": "A123"}, "title": "left earbud"},
                       actor="aftersales", source=sor),
                 event("task.opened", {"task_key": "T901", "namespace": ["shop-a", "u7", "t"],
                                       "title": "refund"}, actor="aftersales", source=sor),
                 write("lang", "en", layer="task", task_key="T901", memory_id="TL",
                       source=src(at=at(2))))
    await Runner(store).catch_up()
    got = await entries(store)
    assert set(got) == {"task:T900", "task:T901", "TL"}
    assert (got["task:T900"].kind, got["task:T900"].task_key) == ("task", "T900")
    assert (got["TL"].layer, got["TL"].task_key) == ("task", "T901")
    await append(store,
                 event("task.closed", {"task_key": "T900"}, actor="aftersales",
                       source=src("system_of_record", "aftersales", at(5))),
                 event("task.purged", {"task_key": "T901"}, actor="aftersales",
                       source=src("operator", "retention", at(6))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == set()


async def test_index_converges_when_it_runs_ahead(store: Store) -> None:
    """Run before the views it reads, the index settles on a later batch (R14)."""
    await append(store, write("lang", "zh", memory_id="A", source=src(at=at(1))),
                 event("task.opened", {"task_key": "T1", "namespace": ["shop-a", "u7", "t"],
                                       "title": "earbuds"}, source=src(at=at(1))))
    await Runner(store, [VectorProjection()]).catch_up()
    assert await entries(store) == {}
    async with store.read() as conn:
        pending = {r[0] for r in (await conn.execute(select(t.meta.c.value).where(
            t.meta.c.name.startswith(PENDING_META)))).all()}
    assert pending == {"0"}  # one row per shard, all unsettled from 0
    await Runner(store, [MemoryProjection(), TaskProjection(), ErasureProjection()]).catch_up()
    # Recall already sees the write the index missed (it re-reads the unsettled range).
    rec = await recall(store, "shop-a/u7", query="lang", session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    assert [i["memory_id"] for i in rec["items"]] == ["A"]
    await append(store, write("style", "brief", user="u8", memory_id="B",
                              source=src(at=at(2))))
    await Runner(store).catch_up()
    assert set(await entries(store)) == {"A", "B", "task:T1"}
    async with store.read() as conn:
        assert (await conn.execute(select(t.meta.c.value).where(
            t.meta.c.name.startswith(PENDING_META)))).first() is None


async def test_rebuild_equals_incremental(store: Store) -> None:
    """Clearing the index and re-projecting from position 0 gives the same entries."""
    for i in range(12):
        await append(store, write(f"k{i % 4}", f"v{i}", source=src(at=at(i))))
        if i % 5 == 0:
            await Runner(store, batch_size=3).catch_up()
    await append(store, event("memory.forgotten", {"namespace": NS, "key": "k1"},
                              source=src(at=at(30))))
    await Runner(store, batch_size=3).catch_up()
    before = {k: (r.model, bytes(r.vector)) for k, r in (await entries(store)).items()}
    assert len(before) == 3
    async with store.view_write() as conn:
        await conn.execute(t.vectors.delete())
        await conn.execute(t.checkpoints.update().where(
            t.checkpoints.c.name == "vectors").values(position=0))
    await Runner(store).catch_up()
    after = {k: (r.model, bytes(r.vector)) for k, r in (await entries(store)).items()}
    assert after == before


async def test_changing_the_model_reembeds_on_rebuild(store: Store,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With MEMLEDGER_EMBEDDER changed, recall skips old entries until `replay rebuild`."""
    await append(store, write("reply_language", "Simplified Chinese", memory_id="A",
                              source=src(at=at(1))))
    await Runner(store).catch_up()
    monkeypatch.setenv(EMBEDDER_ENV, "hashgram-v1-256")
    assert current_embedder().dim == 256
    query = "which language should replies use?"
    stale = await recall(store, "shop-a/u7", query=query, session=None, task=None,
                         budget=None, limit=5, now_us=NOW)
    # Entries of another model are never compared: only the (model-free) lexical arm
    # can still find the memory meanwhile.
    assert all(i["reason"].startswith("lexical match") for i in stale["items"])
    await rebuild(store, ["vectors"], progress=False)  # replay rebuild --projection vectors
    (row,) = (await entries(store)).values()
    assert (row.model, row.dim, len(bytes(row.vector))) == ("hashgram-v1-256", 256, 1024)
    rec = await recall(store, "shop-a/u7", query=query, session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    assert [i["memory_id"] for i in rec["items"]] == ["A"]


def test_fixed_embedder_is_used() -> None:
    """A projection built with an embedder uses it instead of the environment's."""
    emb = HashedNgramEmbedder(64)
    assert VectorProjection(emb).embedder is emb


class TinyEmbedder:
    """A plug-in embedder for the test: hashed n-grams at 32 dimensions, its own name."""

    name = "tiny-test-v1"
    dim = 32

    def embed(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed like the default, narrower."""
        return HashedNgramEmbedder(32).embed(texts)


async def test_registered_embedder_plugs_in(store: Store, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """A registered embedder named in MEMLEDGER_EMBEDDER indexes and answers recall."""
    register_embedder("tiny-test-v1", TinyEmbedder)
    monkeypatch.setenv(EMBEDDER_ENV, "tiny-test-v1")
    await append(store, write("reply_language", "Simplified Chinese", memory_id="A",
                              source=src(at=at(1))))
    await Runner(store).catch_up()
    (row,) = (await entries(store)).values()
    assert (row.model, row.dim) == ("tiny-test-v1", 32)
    rec = await recall(store, "shop-a/u7", query="reply language", session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    assert [i["memory_id"] for i in rec["items"]] == ["A"]
