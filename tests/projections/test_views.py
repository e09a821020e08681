"""Projections: source order decides, not arrival; exactly-once; resolution rules.

R1, R2, R8, R10-R13, R17, R27 on the active-memory view; R3-R6, R30 on task summaries.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import update

from ledger import schema as t
from ledger.events import Event
from ledger.store import Store
from ledger.validation import parse_event
from memledger import MemoryLedger
from projections.runner import Runner
from tests.factories import event, src, write
from tests.helpers import dump_views, fresh_replay

NS = ["shop-a", "u7", "preferences"]


def at(minute: int) -> str:
    return f"2026-09-20T10:{minute:02d}:00+08:00"


async def project(store: Store) -> None:
    await Runner(store).catch_up()


async def get(store: Store, key: str, who: str = "shop-a/u7", **kw: Any) -> dict[str, Any]:
    from projections import reads

    async with store.read() as conn:
        return await reads.get(conn, reads.Principal.parse(who), NS, key,
                               now_us=1_900_000_000_000_000, **kw)


async def test_correction_supersedes_and_versions(store: Store) -> None:
    """M31 (Python) supersedes M18 (Java): version 2 active, readers never see both (R12)."""
    await store.append([
        parse_event(write("code_language", "Java", memory_id="M18", source=src(at=at(1)))),
        parse_event(write("code_language", "Python", memory_id="M31", supersedes="M18",
                          etype="memory.corrected", source=src(at=at(5)))),
    ])
    await project(store)
    got = await get(store, "code_language")
    assert (got["value"], got["version"], got["memory_id"]) == ("Python", 2, "M31")


async def test_late_old_event_does_not_win(store: Store) -> None:
    """A background extraction that arrives after a newer correction loses (R17)."""
    await store.append_one(parse_event(write("code_language", "Python", source=src(at=at(9)))))
    await store.append_one(parse_event(write("code_language", "Java", source=src(at=at(1)))))
    await project(store)
    got = await get(store, "code_language")
    assert got["value"] == "Python"
    assert got["version"] == 2  # rank in source order, not arrival


async def test_candidate_never_active_until_confirmed(store: Store) -> None:
    """A model's inference is a candidate: inactive, never overriding, until confirmed (R10)."""
    await store.append_one(parse_event(write("reply_style", "brief", source=src(at=at(1)))))
    res = await store.append_one(parse_event(write(
        "reply_style", "urgent refunds always", source=src("model_inference", at=at(5)))))
    await project(store)
    assert (await get(store, "reply_style"))["value"] == "brief"
    async with store.read() as conn:
        from sqlalchemy import select
        mid = (await conn.execute(select(t.events.c.memory_id).where(
            t.events.c.position == res.position))).scalar()
    await store.append_one(parse_event(event("memory.confirmed", {"memory_id": mid},
                                             source=src(at=at(7)))))
    await project(store)
    assert (await get(store, "reply_style"))["value"] == "urgent refunds always"


async def test_task_exception_leaves_default(store: Store) -> None:
    """'Use Java this time' lives in its task; the long-term default stays Python (R8, R27)."""
    await store.append([
        parse_event(write("code_language", "Python", source=src(at=at(1)))),
        parse_event(write("code_language", "Java", layer="task", task_key="Q7",
                          source=src(at=at(3)))),
    ])
    await project(store)
    assert (await get(store, "code_language"))["value"] == "Python"
    assert (await get(store, "code_language", task="Q7"))["value"] == "Java"
    assert (await get(store, "code_language", task="Q8"))["value"] == "Python"


async def test_session_memory_stays_in_session(store: Store) -> None:
    """A session memory is read only in its own session: layers are scopes of reuse (R1, R2)."""
    await store.append_one(parse_event(write("order", "A123", layer="session",
                                             session_id="C17")))
    await project(store)
    assert (await get(store, "order", session="C17"))["value"] == "A123"
    assert (await get(store, "order", session="C18"))["found"] is False
    assert (await get(store, "order"))["found"] is False


async def test_other_principals_read_nothing(store: Store) -> None:
    """Another user or tenant gets `found: false`, the same as for a missing key (R15, R24)."""
    await store.append_one(parse_event(write("reply_language", "zh")))
    await project(store)
    assert (await get(store, "reply_language", who="shop-a/u8")) == {"found": False}
    assert (await get(store, "reply_language", who="shop-b/u7")) == {"found": False}


async def test_expired_memory_not_returned(store: Store) -> None:
    """A memory past expires_at is not active at read time (R28)."""
    await store.append_one(parse_event(write("promo", "10% off",
                                             expires_at="2026-09-21T00:00:00Z")))
    await project(store)
    from projections import reads
    async with store.read() as conn:
        before = await reads.get(conn, reads.Principal("shop-a", "u7"), NS, "promo",
                                 now_us=1_789_000_000_000_000)
        after = await reads.get(conn, reads.Principal("shop-a", "u7"), NS, "promo",
                                now_us=1_800_000_000_000_000)
    assert before["found"] is True
    assert after["found"] is False


async def test_task_summary_keeps_sources_apart(store: Store) -> None:
    """User reports, corrections and system facts stay apart; corrections pend (R3, R5, R30)."""
    aftersales = src("system_of_record", "aftersales", at(2))
    evs = [
        event("task.opened", {"task_key": "T900", "namespace": ["shop-a", "u7", "tickets"],
                              "refs": {"order": "A123"}}, actor="aftersales", source=aftersales),
        event("task.noted", {"task_key": "T900", "kind": "user_report",
                             "text": "left earbud crackles"}, source=src(at=at(1))),
        event("task.noted", {"task_key": "T900", "kind": "system_status",
                             "text": "awaiting inspection",
                             "fields": {"status": "awaiting inspection"}},
              actor="aftersales", source=aftersales),
        event("task.noted", {"task_key": "T900", "kind": "correction",
                             "text": "it is the right earbud", "fields": {"side": "right"}},
              source=src(sid="C18", at="2026-09-22T09:00:00+08:00")),
        event("task.noted", {"task_key": "T900", "kind": "user_report",
                             "text": "inspection confirmed the fault",
                             "fields": {"status": "fault confirmed"}},
              source=src("user_statement", "C18", "2026-09-22T09:01:00+08:00")),
    ]
    await store.append([parse_event(e) for e in evs])
    await project(store)
    from projections import reads
    async with store.read() as conn:
        tasks = await reads.tasks(conn, reads.Principal("shop-a", "u7"))
    (task,) = tasks
    assert task["system"]["status"] == "awaiting inspection"
    assert task["system"]["as_of"] == at(2)
    assert [c["text"] for c in task["corrections"]] == ["it is the right earbud"]
    assert task["corrections"][0]["pending"] is True
    assert task["conflicts"][0]["field"] == "status"
    assert task["conflicts"][0]["claimed"] == "fault confirmed"


async def test_closed_task_not_open(store: Store) -> None:
    """A closed task is never listed as open (R6)."""
    sor = src("system_of_record", "aftersales", at(1))
    await store.append([parse_event(e) for e in (
        event("task.opened", {"task_key": "T1", "namespace": ["shop-a", "u7", "t"]},
              actor="as", source=sor),
        event("task.closed", {"task_key": "T1", "resolution": "refunded"}, actor="as",
              source=src("system_of_record", "aftersales", at(9))))])
    await project(store)
    from projections import reads
    async with store.read() as conn:
        who = reads.Principal("shop-a", "u7")
        assert await reads.tasks(conn, who) == []
        assert [x["status"] for x in await reads.tasks(conn, who, include_closed=True)] == [
            "closed"]


async def test_redelivered_batch_changes_nothing(store: Store) -> None:
    """Re-applying any prefix of the ledger (redelivery) leaves the views unchanged."""
    await store.append([parse_event(write(f"k{i % 5}", i, source=src(at=at(i))))
                        for i in range(30)])
    await project(store)
    before = await dump_views(store)
    async with store.view_write() as conn:
        await conn.execute(update(t.checkpoints).values(position=7))
    await project(store)
    assert await dump_views(store) == before


async def test_remember_wait_returns_projected(db_url: str, register_path: str) -> None:
    """remember(wait=True) returns once the write is durable and readable (R16)."""
    async with MemoryLedger(db_url, register_path=register_path) as ml:
        await ml.append(write("reply_language", "Simplified Chinese"), wait=True)
        m = await ml.principal("shop-a/u7").get(NS[2:], "reply_language")
        got = m.to_dict() if m is not None else {"found": False}
        assert got["value"] == "Simplified Chinese"


# -- order independence (property) --------------------------------------------------------

def gen_events(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """A random mix of writes, corrections, candidates, confirmations, supersessions,
    task notes and forgets over a few slots, with colliding source times."""
    evs: list[dict[str, Any]] = []
    ids: list[str] = []
    users = ["u7", "u8"]
    for i in range(n):
        user = rng.choice(users)
        ns = ["shop-a", user, "preferences"]
        minute = rng.randrange(20)
        s = src(rng.choice(["explicit_user_request", "user_statement", "model_inference"]),
                rng.choice(["C17", "C18"]), at(minute), seq=rng.randrange(3))
        roll = rng.random()
        if roll < 0.45 or not ids:
            layer = rng.choice(["long", "long", "task", "session"])
            extra: dict[str, Any] = {}
            if layer == "task":
                extra["task_key"] = "T1"
            if layer == "session":
                extra["session_id"] = "C17"
            mid = f"M{i}"
            if ids and rng.random() < 0.3:
                extra["supersedes"] = rng.choice(ids)
            ids.append(mid)
            evs.append(write(rng.choice(["lang", "style"]), f"v{i}", user=user, ns=ns,
                             memory_id=mid, layer=layer, source=s, idem=f"i{i}", **extra))
        elif roll < 0.6:
            evs.append(event("memory.confirmed", {"memory_id": rng.choice(ids)},
                             actor="ops", source=src("operator", "ops", at(minute)),
                             idem=f"i{i}"))
        elif roll < 0.7:
            evs.append(event("memory.superseded", {"memory_id": rng.choice(ids)},
                             actor="ops", source=src("operator", "ops", at(minute)),
                             idem=f"i{i}"))
        elif roll < 0.8:
            evs.append(event("memory.forgotten", {"namespace": ns, "key": "lang"},
                             actor="ops", source=src("operator", "ops", at(minute)),
                             idem=f"i{i}"))
        else:
            kind = rng.choice(["user_report", "correction", "todo", "system_status"])
            sk = "system_of_record" if kind == "system_status" else "operator"
            evs.append(event("task.noted", {"task_key": "T1", "kind": kind, "text": f"n{i}",
                                            "fields": {"status": f"s{i % 3}"}},
                             actor="ops", source=src(sk, "aftersales", at(minute)),
                             idem=f"i{i}"))
    evs.insert(0, event("task.opened", {"task_key": "T1", "namespace": ["shop-a", "u7", "t"]},
                        actor="ops", source=src("operator", "ops", at(0)), idem="open"))
    return evs


async def views_for(tmp: Path, name: str, evs: list[Event], batches: list[int]) -> Any:
    store = Store(f"sqlite+aiosqlite:///{tmp / name}.db", register_path=str(tmp / f"{name}.f"))
    await store.open()
    try:
        i = 0
        for size in batches:
            for e in evs[i:i + size]:
                await store.append_one(e)
            i += size
            await Runner(store, batch_size=max(1, size // 2 or 1)).catch_up()
        for e in evs[i:]:
            await store.append_one(e)
        await Runner(store).catch_up()
        return await dump_views(store)
    finally:
        await store.close()


@given(seed=st.integers(0, 10**6), n=st.integers(5, 40))
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_any_arrival_order_gives_same_views(tmp_path: Path, seed: int, n: int) -> None:
    """Any permutation and any split into batches gives identical views (R17, property)."""
    rng = random.Random(seed)
    evs = [parse_event(e) for e in gen_events(rng, n)]
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    reference = await views_for(d, "ref", evs, [len(evs)])
    for k in range(2):
        perm = evs[:]
        rng.shuffle(perm)
        cuts = [rng.randint(1, max(1, len(perm) // 3)) for _ in range(3)]
        assert await views_for(d, f"p{k}", perm, cuts) == reference


async def test_rebuild_equals_incremental(store: Store, tmp_path: Path) -> None:
    """Projecting after every append equals one rebuild from scratch."""
    rng = random.Random(7)
    for e in gen_events(rng, 60):
        await store.append_one(parse_event(e))
        await project(store)
    fresh = await fresh_replay(store, tmp_path)
    try:
        assert await dump_views(store) == await dump_views(fresh)
    finally:
        await fresh.close()


async def test_history_shows_versions_and_redacts_forgotten(db_url: str,
                                                            register_path: str) -> None:
    """history lists every version of the principal's key; forgotten ones are redacted,
    and another user gets nothing (R7, R12, R20, R24)."""
    async with MemoryLedger(db_url, register_path=register_path) as ml:
        await ml.append([write("lang", "zh", memory_id="A", source=src(at=at(1))),
                         write("lang", "en", memory_id="B", source=src(at=at(2)))])
        await ml.append(event("memory.forgotten", {"memory_id": "B"}, source=src(at=at(3))),
                        wait=True)
        hist = [h.to_dict() for h in await ml.principal("shop-a/u7").history(NS[2:], "lang")]
        assert [(h["memory_id"], h["version"], h["status"], h["value"]) for h in hist] == [
            ("A", 1, "superseded", "zh"), ("B", 2, "forgotten", None)]
        assert await ml.principal("shop-a/u8").history(NS[2:], "lang") == []


async def test_two_runners_never_double_apply(db_url: str, register_path: str,
                                              tmp_path: Path) -> None:
    """Two runners (two stores, as two processes would) on one database: the checkpoint
    lock serialises them, and the views equal a fresh replay."""
    a = Store(db_url, register_path=register_path)
    b = Store(db_url, register_path=register_path)
    try:
        rng = random.Random(3)
        await a.append([parse_event(e) for e in gen_events(rng, 120)])
        await asyncio.gather(Runner(a, batch_size=7).catch_up(),
                             Runner(b, batch_size=11).catch_up())
        fresh = await fresh_replay(a, tmp_path)
        try:
            assert await dump_views(a) == await dump_views(fresh)
        finally:
            await fresh.close()
    finally:
        await a.close()
        await b.close()


async def test_user_supersedes_cannot_reach_another_users_memory(store: Store) -> None:
    """A user's `supersedes` naming another user's memory id does nothing to it (R24)."""
    await store.append_one(parse_event(write("lang", "zh", memory_id="M31",
                                             source=src(at=at(1)))))
    await store.append_one(parse_event(write(
        "lang", "en", user="u8", memory_id="X1", supersedes="M31",
        source=src(at=at(2)))))
    await project(store)
    got = await get(store, "lang")
    assert (got["memory_id"], got["status"]) == ("M31", "active")
