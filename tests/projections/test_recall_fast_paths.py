"""Recall's fast paths answer exactly as the plain ones (R14, R15, R20, R24, R2).

- the lexical arm leaves the principal's scope term out of the full-text match when the
  principal is most of the index (`projections.sql.lexical_hits`): the same entries;
- the term document counts are cached while the index is unchanged, and follow it when
  it changes;
- the re-check on the calling thread (SQLite point reads) returns the same rows as the
  statement on the read connection: tombstones, expiry, layers and scope included;
- recall's re-check leaves sealed content sealed (vault on) and opens only the rows it
  returns: the opened rows are the plain path's, and a memory forgotten between the
  re-check and the opening opens as nothing (R20);
- the lexical arm's match on a worker thread, beside the vector scan, gives the same
  answer as the plain sequential search.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event as sa_event
from sqlalchemy import text

from ledger.store import Store
from ledger.validation import parse_event
from projections import lexical, reads
from projections.candidates import SealedVersionRow, opened, recheck
from projections.lexical import frequent_terms, search
from projections.recall import recall
from projections.runner import Runner
from projections.views import MemoryProjection, TaskProjection
from tests.factories import event, src, write

U7 = reads.Principal("shop-a", "u7")
U8 = reads.Principal("shop-a", "u8")
NOW = 1_900_000_000_000_000
WORDS = ["kiwi", "mango", "refund", "earbud", "ticket", "python", "java", "order", "reply",
         "language", "coffee", "tea", "walk", "train", "gift", "budget"]


def at(minute: int) -> str:
    return f"2026-09-20T10:{minute:02d}:00+08:00"


async def append(store: Store, *events: dict[str, Any]) -> None:
    await store.append([parse_event(e) for e in events])


async def ranked(store: Store, who: reads.Principal, query: str, k: int,
                 unscoped_from: float, monkeypatch: pytest.MonkeyPatch
                 ) -> list[tuple[str, float]]:
    monkeypatch.setattr(lexical, "UNSCOPED_FROM", unscoped_from)
    async with store.read() as conn:
        got = await search(conn, store, who, query, task=None, session=None, k=k)
    return [(m, round(s, 9)) for m, s in got]


async def corpus(store: Store, rng: random.Random, mine: int, theirs: int) -> None:
    """`mine` memories of u7 and `theirs` of u8, each a few random words."""
    events = [write(f"k{i}", " ".join(rng.sample(WORDS, rng.randint(1, 5))),
                    memory_id=f"M{i}", source=src(at=at(1))) for i in range(mine)]
    events += [write(f"k{i}", " ".join(rng.sample(WORDS, rng.randint(1, 5))), user="u8",
                     memory_id=f"O{i}", source=src(at=at(1))) for i in range(theirs)]
    await append(store, *events)
    await Runner(store).catch_up()


@pytest.mark.parametrize(("mine", "theirs"), [(90, 10), (60, 60), (10, 90)])
async def test_unscoped_match_finds_the_same_entries(store: Store, mine: int, theirs: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the principal's share of the index, leaving its scope term out of the
    match (forced here with a threshold of 0) gives the scoped match's entries, in the
    same order; when another principal's entries crowd the unscoped page, the scoped
    match runs instead. Never an entry of another user (R24)."""
    rng = random.Random(mine * 1000 + theirs)
    await corpus(store, rng, mine, theirs)
    for _ in range(12):
        query = " ".join(rng.sample(WORDS, rng.randint(1, 4)))
        for k in (1, 3, 10):
            scoped = await ranked(store, U7, query, k, 2.0, monkeypatch)
            unscoped = await ranked(store, U7, query, k, 0.0, monkeypatch)
            assert unscoped == scoped, (query, k)
            assert all(m.startswith("M") for m, _ in unscoped)
            assert all(m.startswith("O") for m, _ in
                       await ranked(store, U8, query, k, 0.0, monkeypatch))


async def test_term_counts_follow_the_index(store: Store) -> None:
    """The frequent-term look-up is cached while the index is unchanged; a change to the
    index (here: many new entries holding a once rare word) is seen at once."""
    n = 2 * lexical.MIN_DF_DOCS
    await append(store, *(write(f"note_{i}", f"order note {i}" + (" earbud" if i == 0 else ""),
                                memory_id=f"N{i}") for i in range(n)))
    await Runner(store).catch_up()

    async def frequent() -> set[str]:
        if store.dialect != "sqlite":
            async with store.write() as conn:
                await conn.execute(text("ANALYZE lexical_docs"))
        async with store.read() as conn:
            return await frequent_terms(conn, store, ["order", "earbud"],
                                        lexical.scope_term(U7.tenant, U7.user))

    assert await frequent() == {"order"}
    assert await frequent() == {"order"}  # from the cache on SQLite: the same answer
    await append(store, *(write(f"bud_{i}", f"earbud {i}", memory_id=f"B{i}")
                          for i in range(n)))
    await Runner(store).catch_up()
    assert await frequent() == {"order", "earbud"}


async def valid_rows(store: Store, ids: list[str], *, task: str | None,
                     session: str | None, point: bool) -> list[tuple[Any, ...]]:
    async with store.read() as conn:
        rows = await recheck(conn, U7, ids, now_us=NOW, task=task, session=session,
                             store=store if point else None)
    return sorted((r.memory_id, r.layer, r.version, r.mkey, r.ns_path) for r in rows)


async def test_point_recheck_matches_the_read_connection(store: Store) -> None:
    """Active, unexpired, unforgotten rows of the principal in the layer filter only,
    the same on both paths: a forgotten, an expired, a superseded, another user's and
    another session's or task's memory are dropped by both (R14, R15, R20, R2)."""
    await append(
        store,
        write("a", "kept", memory_id="A", source=src(at=at(1))),
        write("b", "forgotten", memory_id="B", source=src(at=at(1))),
        write("c", "expired", memory_id="C", expires_at="2026-10-01T00:00:00Z",
              source=src(at=at(1))),
        write("d", "old", memory_id="D1", source=src(at=at(1))),
        write("d", "new", memory_id="D2", source=src(at=at(2))),
        write("e", "theirs", user="u8", memory_id="E", source=src(at=at(1))),
        write("f", "task fact", memory_id="F", layer="task", task_key="T1",
              source=src(at=at(1))),
        write("g", "session fact", memory_id="G", layer="session", session_id="C18",
              source=src(sid="C18", at=at(1))),
        event("memory.forgotten", {"memory_id": "B"}, source=src(at=at(3))))
    await Runner(store).catch_up()
    ids = ["A", "B", "C", "D1", "D2", "E", "F", "G", "missing"]
    for task, session in [(None, None), ("T1", None), (None, "C18"), ("T1", "C18"),
                          ("T2", "C19")]:
        plain = await valid_rows(store, ids, task=task, session=session, point=False)
        point = await valid_rows(store, ids, task=task, session=session, point=True)
        assert point == plain
        want = {"A", "D2"} | ({"F"} if task == "T1" else set()) \
            | ({"G"} if session == "C18" else set())
        assert {r[0] for r in point} == want


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["A", "B", "C", "D1", "D2", "E", "x", "A"]), max_size=12))
async def test_point_recheck_any_id_list(store: Store, ids: list[str]) -> None:
    """For any list of ids (repeats, unknown ids, none), both paths agree."""
    # The same idempotency keys every example: appended once, then a no-op.
    await append(store, write("a", "kept", memory_id="A", idem="h-a", source=src(at=at(1))),
                 write("b", "gone", memory_id="B", idem="h-b", source=src(at=at(1))),
                 write("e", "theirs", user="u8", memory_id="E", idem="h-e",
                       source=src(at=at(1))),
                 event("memory.forgotten", {"memory_id": "B"}, idem="h-f",
                       source=src(at=at(3))))
    await Runner(store).catch_up()
    plain = await valid_rows(store, ids, task=None, session=None, point=False)
    assert await valid_rows(store, ids, task=None, session=None, point=True) == plain
    assert {r[0] for r in plain} == {"A"} & set(ids)



async def test_sealed_recheck_opens_like_the_plain_path(store: Store) -> None:
    """Rows re-checked with `sealed=True` open (`opened`) to exactly the rows of the
    plain path; on SQLite with the vault on they are read sealed (R14, R15, R25)."""
    await append(store, write("lang", "reply in Chinese", memory_id="A", source=src(at=at(1))),
                 write("drink", "tea, no sugar", memory_id="B", source=src(at=at(1))),
                 write("plan", "weekly walk", memory_id="C", layer="session",
                       session_id="C18", source=src(sid="C18", at=at(1))))
    await Runner(store).catch_up()
    async with store.read() as conn:
        plain = await recheck(conn, U7, ["A", "B", "C"], now_us=NOW, task=None,
                              session="C18")
        lazy = await recheck(conn, U7, ["A", "B", "C"], now_us=NOW, task=None,
                             session="C18", store=store, sealed=True)
    point = store.dialect == "sqlite"
    assert all(isinstance(r, SealedVersionRow) for r in lazy) == point
    if point and store.vault is not None:
        assert all(r.value != p.value for r, p in zip(sorted(lazy), sorted(plain),
                                                       strict=True))
    assert sorted(tuple(opened(store, r)) for r in lazy) == sorted(tuple(r) for r in plain)
    assert {reads.memory_item(opened(store, r))["value"] for r in lazy} == \
        {"reply in Chinese", "tea, no sugar", "weekly walk"}


async def test_forget_between_recheck_and_opening(store: Store) -> None:
    """A memory forgotten after the re-check read it and before it is opened reads as
    nothing: its key is erased, so its sealed value opens as None (R20)."""
    await append(store, write("lang", "reply in Chinese", memory_id="A", source=src(at=at(1))))
    await Runner(store).catch_up()
    async with store.read() as conn:
        rows = await recheck(conn, U7, ["A"], now_us=NOW, task=None, session=None,
                             store=store, sealed=True)
    assert len(rows) == 1
    await append(store, event("memory.forgotten", {"memory_id": "A"}, source=src(at=at(3))))
    await Runner(store).catch_up()
    if isinstance(rows[0], SealedVersionRow) and store.vault is not None:
        assert opened(store, rows[0]).value is None
    got = await recall(store, "shop-a/u7", query="reply language", session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    assert got["items"] == []


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4))
async def test_recall_lexical_beside_matches_sequential(store: Store, words: list[str]
                                                       ) -> None:
    """For any query, the lexical arm run beside the vector scan (inside `recall`) finds
    what `search` finds alone, in the same order and with the same scores."""
    if not await store.head():
        await corpus(store, random.Random(3), 60, 20)
    query = " ".join(words)
    async with store.read() as conn:
        alone = await search(conn, store, U7, query, task=None, session=None, k=68)
    got = await recall(store, "shop-a/u7", query=query, session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    lexical_ids = [m for m, _ in alone]
    for item in got["items"]:
        if "lexical" in item["reason"]:
            assert item["memory_id"] in lexical_ids
    assert all(m.startswith("M") for m in lexical_ids)  # u7's own memories only (R24)


async def test_warm_recall_begins_its_read_only_when_needed(store: Store) -> None:
    """On a SQLite file a warm recall reads on the calling thread only (positions,
    re-check, lexical match): it begins no read transaction of the pool (each costs
    thread hand-offs). A recall that needs one (a write the index has not caught up
    with) begins it and still finds the write (R14). On PostgreSQL every recall reads
    on its connection."""
    await corpus(store, random.Random(5), 30, 5)
    store.use_inline()  # the audit on the inline thread, as `MemoryLedger` opens files
    begun: list[int] = []
    sa_event.listen(store.engine.sync_engine, "begin", lambda conn: begun.append(1))
    ask = {"session": None, "task": None, "budget": None, "limit": 5, "now_us": NOW}
    first = await recall(store, "shop-a/u7", query="kiwi mango", **ask)
    begun.clear()
    again = await recall(store, "shop-a/u7", query="kiwi mango", **ask)
    assert [i["memory_id"] for i in again["items"]] == [i["memory_id"] for i in first["items"]]
    point = store.recorder.point_reads() is not None
    assert not begun if point else begun  # PostgreSQL: the read, and the audit's write
    # A write not projected yet: the index lags, the recall reads the ledger for it.
    await append(store, write("fruit", "durian kiwi", memory_id="NEW", source=src(at=at(3))))
    await Runner(store, [MemoryProjection(), TaskProjection()]).catch_up()
    begun.clear()
    lagging = await recall(store, "shop-a/u7", query="durian", **ask)
    assert begun
    assert "NEW" in [i["memory_id"] for i in lagging["items"]]
