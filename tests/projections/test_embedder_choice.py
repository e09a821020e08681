"""Which embedder a ledger uses (issue 18; docs/recall.md, "Embedders" and "The concept
list"): a new ledger gets the default, hashgram-v2-512 (no concept list), without
recording it; a ledger whose vectors were made by hashgram-v1-512 (the former default)
keeps v1, records it at its next index batch, and keeps it through a rebuild and in
`replay verify`'s fresh replay; a name recorded as the bare `hashgram` when it meant v1
still means v1. Recall never compares a query with vectors of another model (R14).

Both backends (the `store` fixture). Each test writes two or three memories.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections.embedding import DEFAULT_EMBEDDER, canonical_name, get_embedder
from projections.recall import recall
from projections.runner import Runner
from projections.vectors import (
    EMBEDDER_ENV,
    record_embedder,
    recorded_embedder,
    resolve_embedder,
    store_embedder,
)
from replay import config
from replay.rebuild import rebuild
from tests.factories import src, write

NOW = 1_790_000_000_000_000


def at(minute: int) -> str:
    """A source time on the running example's first day."""
    return f"2026-09-20T10:{minute:02d}:00+08:00"


async def put(store: Store, key: str, value: str, mid: str, minute: int) -> None:
    """Append one memory of shop-a/u7 and project it."""
    await store.append([parse_event(write(key, value, memory_id=mid,
                                          source=src(at=at(minute))))])
    await Runner(store).catch_up()


async def models(store: Store) -> dict[str, set[str]]:
    """The model names in the index and in the stored history."""
    async with store.read() as conn:
        vec = {str(r[0]) for r in (await conn.execute(select(t.vectors.c.model))).all()}
        hist = {str(r[0]) for r in (await conn.execute(
            select(t.mem_history.c.model).where(t.mem_history.c.model.is_not(None)))).all()}
    return {"vectors": vec, "history": hist}


async def resolved(store: Store) -> tuple[tuple[str, str], str | None]:
    """The ledger's embedder and its source, and the recorded name."""
    async with store.read() as conn:
        return await resolve_embedder(conn), await recorded_embedder(conn)


async def semantic_hit(store: Store, query: str) -> list[dict[str, Any]]:
    """u7's recall items whose reason names the semantic arm."""
    rec = await recall(store, "shop-a/u7", query=query, session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    return [i for i in rec["items"] if "semantic" in i["reason"]]


async def test_new_ledger_uses_v2_without_recording_it(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new ledger indexes with hashgram-v2-512 and records nothing (a later
    MEMLEDGER_EMBEDDER or `config set` still decides)."""
    monkeypatch.delenv(EMBEDDER_ENV, raising=False)
    await put(store, "reply_language", "Simplified Chinese", "A", 1)
    assert await models(store) == {"vectors": {DEFAULT_EMBEDDER},
                                   "history": {DEFAULT_EMBEDDER}}
    assert await resolved(store) == ((DEFAULT_EMBEDDER, "default"), None)
    report = await config.embedder_report(store)
    assert (report["name"], report["source"], report["index_current"]) == (
        DEFAULT_EMBEDDER, "default", True)
    assert await semantic_hit(store, "which language should replies use")


async def test_ledger_built_with_v1_keeps_v1(store: Store,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger whose vectors are hashgram-v1-512 and that has no recorded embedder (one
    built before the default changed) goes on with v1: recall queries with v1, the next
    index batch records it, and a rebuild of the index keeps it."""
    monkeypatch.setenv(EMBEDDER_ENV, "hashgram-v1-512")  # how the old default wrote it
    await put(store, "reply_language", "Simplified Chinese", "A", 1)
    monkeypatch.delenv(EMBEDDER_ENV)
    assert await resolved(store) == (("hashgram-v1-512", "vectors"), None)
    assert (await store_embedder(store)).name == "hashgram-v1-512"
    assert await semantic_hit(store, "which language should replies use")

    await put(store, "reply_style", "brief answers", "B", 2)
    assert await resolved(store) == (("hashgram-v1-512", "recorded"), "hashgram-v1-512")
    assert await models(store) == {"vectors": {"hashgram-v1-512"},
                                   "history": {"hashgram-v1-512"}}
    await rebuild(store, ["vectors"], restart=True)
    assert (await models(store))["vectors"] == {"hashgram-v1-512"}
    # `replay verify` replays it with v1 too: tests/ledger/test_migrations.py checks that
    # on a real ledger made before the change (d2f33e6, v1 vectors, nothing recorded).


async def test_recorded_bare_hashgram_means_the_version_held(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hashgram` recorded when it meant hashgram-v1 keeps meaning v1 for that ledger
    (settled to the full name at the next batch); `config set embedder hashgram` now
    records the default, v2, and rebuilds the index with it."""
    monkeypatch.setenv(EMBEDDER_ENV, "hashgram-v1-512")
    await put(store, "reply_language", "Simplified Chinese", "A", 1)
    monkeypatch.delenv(EMBEDDER_ENV)
    async with store.view_write() as conn:
        await record_embedder(conn, "hashgram")
    assert await resolved(store) == (("hashgram-v1-512", "recorded"), "hashgram")
    await put(store, "reply_style", "brief answers", "B", 2)
    assert await resolved(store) == (("hashgram-v1-512", "recorded"), "hashgram-v1-512")
    assert (await models(store))["vectors"] == {"hashgram-v1-512"}

    res = await config.set_embedder(store, "hashgram")
    assert (res["embedder"], res["was"], res["changed"]) == (
        DEFAULT_EMBEDDER, "hashgram-v1-512", True)
    assert (await models(store))["vectors"] == {DEFAULT_EMBEDDER}
    assert await semantic_hit(store, "which language should replies use")


@settings(max_examples=40, deadline=None)
@given(version=st.sampled_from(["1", "2"]), dim=st.integers(16, 4096),
       spelling=st.sampled_from(["plain", "upper", "padded"]))
def test_canonical_names_round_trip(version: str, dim: int, spelling: str) -> None:
    """Every hashgram name is its vectors' name after `canonical_name`, in any case or
    padding, and the embedder built from it carries that very name."""
    name = f"hashgram-v{version}-{dim}"
    name = {"plain": name, "upper": name.upper(), "padded": f" {name}\t"}[spelling]
    canonical = canonical_name(name)
    assert canonical == f"hashgram-v{version}-{dim}"
    assert canonical_name(canonical) == canonical
    assert get_embedder(name).name == canonical
