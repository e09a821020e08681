"""Forgetting that holds: unreadable at once, erased everywhere, never resurrected.

R20 (unreadable, then erased from every copy), R22 (replays and late re-extractions do
not recreate), R21 (register), R28 (retention purge), R24 (boundaries).
"""

from __future__ import annotations

import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections import matrix_snapshot, reads
from projections.recall import recall
from projections.retention import sweep_retention
from projections.runner import Runner
from tests.factories import event, src, write
from tests.helpers import dump_views, fresh_replay

NS = ["shop-a", "u7", "preferences"]
U7 = reads.Principal("shop-a", "u7")
NOW = 1_900_000_000_000_000


def at(minute: int) -> str:
    return f"2026-09-20T10:{minute:02d}:00+08:00"


def forget(minute: int, **target: Any) -> dict[str, Any]:
    return event("memory.forgotten", target, source=src(at=at(minute)))


async def read_all(store: Store, who: reads.Principal = U7) -> str:
    """Everything the principal can read on every path, as one string."""
    async with store.read() as conn:
        got = [await reads.get(conn, who, NS, k, now_us=NOW, task="T900", session="C17")
               for k in ("lang", "style", "addr", "k")]
        tasks = await reads.tasks(conn, who, include_closed=True)
    rec = await recall(store, f"{who.tenant}/{who.user}", query="lang style addr",
                       session="C17", task="T900", budget=None, limit=50, now_us=NOW)
    return repr((got, tasks, rec["items"], rec["tasks"]))


async def test_unreadable_before_any_projection(store: Store) -> None:
    """The forget takes effect when its append returns, before a worker ran (R20)."""
    await store.append_one(parse_event(write("lang", "ZEBRA-zh", source=src(at=at(1)))))
    await Runner(store).catch_up()
    assert "ZEBRA-zh" in await read_all(store)
    await store.append_one(parse_event(forget(2, namespace=NS, key="lang")))
    assert "ZEBRA-zh" not in await read_all(store)


async def test_erased_from_views_and_ledger_payloads(store: Store) -> None:
    """Once projected, the content is gone from views, index and ledger payloads (R20)."""
    res = await store.append_one(parse_event(write("lang", "ZEBRA-zh", source=src(at=at(1)))))
    await Runner(store).catch_up()
    await store.append_one(parse_event(forget(2, namespace=NS, key="lang")))
    await Runner(store).catch_up()
    async with store.read() as conn:
        ev = (await conn.execute(select(t.events).where(
            t.events.c.position == res.position))).one()
        mv = (await conn.execute(select(t.mem_versions))).one()
        vec = (await conn.execute(select(t.vectors))).all()
    assert ev.payload is None
    assert ev.redacted is True
    assert ev.content_digest  # the envelope and digest stay
    assert (mv.status, mv.value, mv.text) == ("forgotten", None, None)
    assert vec == []


async def test_erased_from_the_stored_past(store: Store) -> None:
    """The history of as-of reads (`mem_history`) held the value while it was active;
    once a forget is projected no interval of it keeps its value, text, scope, expiry
    or embedding, and `replay verify --forgotten` checks exactly that (R20)."""
    from sqlalchemy import update

    from replay.verify.forgotten import verify_forgotten

    await store.append_one(parse_event(write("lang", "ZEBRA-zh", source=src(at=at(1)),
                                             expires_at="2027-01-01T00:00:00Z")))
    await store.append_one(parse_event(write("lang", "ZEBRA-en", source=src(at=at(2)))))
    await Runner(store).catch_up()
    mh = t.mem_history.c
    async with store.read() as conn:
        before = (await conn.execute(select(t.mem_history).order_by(
            mh.valid_from, mh.status.desc()))).all()
    # The first version: active from its write, superseded from the second's; both held.
    assert [(r.status, r.value is not None, r.vector is not None) for r in before] == [
        ("active", True, True), ("superseded", True, False), ("active", True, True)]
    await store.append_one(parse_event(forget(3, namespace=NS, key="lang")))
    await Runner(store).catch_up()
    async with store.read() as conn:
        after = (await conn.execute(select(t.mem_history))).all()
    assert after and all(r.redacted for r in after)
    assert all((r.value, r.text, r.scope, r.expires_at, r.expires_us, r.vector) ==
               (None,) * 6 for r in after)
    assert (await verify_forgotten(store))["ok"] is True
    # A copy put back by hand is found.
    async with store.view_write() as conn:
        await conn.execute(update(t.mem_history).where(mh.valid_from == before[0].valid_from)
                           .values(text="ZEBRA-zh", redacted=False))
    report = await verify_forgotten(store)
    assert report["ok"] is False
    assert {p["place"] for p in report["problems"]} == {"mem_history"}


def sqlite_files(url: str) -> bytes:
    """The bytes of a SQLite ledger's files: database, WAL and shared memory."""
    db = Path(url.split(":///", 1)[1])
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))


async def test_bytes_gone_from_sqlite_files(sqlite_url: str, register_path: str) -> None:
    """The forgotten value's bytes are absent from the SQLite files on disk (R20),
    including its casefolded terms in the lexical index (FTS5 shadow tables too), and
    recall's snapshot of the principal's vectors beside the database is deleted."""
    from replay.verify.forgotten import verify_forgotten

    store = Store(sqlite_url, register_path=register_path)
    secret_ish = "QUOKKA-unique-preference-7731"
    snapshots = matrix_snapshot.directory(sqlite_url)
    try:
        await store.append_one(parse_event(write("lang", secret_ish, source=src(at=at(1)))))
        await store.append_one(parse_event(event("task.opened", {
            "task_key": "T900", "namespace": ["shop-a", "u7", "tickets"],
            "title": "QUOKKA-title-9931"}, source=src(at=at(1)))))
        await Runner(store).catch_up()
        await read_all(store)  # recall writes the principal's snapshot beside the file
        await matrix_snapshot.settled()
        assert matrix_snapshot.all_files(snapshots)
        await store.append_one(parse_event(forget(2, namespace_prefix=["shop-a", "u7"])))
        await Runner(store).catch_up()
        # The forget deleted it (and `verify --forgotten` checks the files).
        assert matrix_snapshot.all_files(snapshots) == []
        assert (await verify_forgotten(store))["ok"] is True
    finally:
        await store.close()
    assert b"QUOKKA" not in sqlite_files(sqlite_url)  # mem_history's intervals too
    assert b"quokka" not in sqlite_files(sqlite_url)  # lexical terms are casefolded
    assert b"QUOKKA" not in Path(register_path).read_bytes()  # noqa: ASYNC240


async def test_cached_model_vectors_gone_from_sqlite_files(
        sqlite_url: str, register_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a model embedder, the forgotten texts' cached vectors and their digests
    (`embedding_cache`, `embedding_refs`: every version, the task summaries too) are
    absent from the SQLite files on disk, while another user's stay (R20)."""
    from projections.embed_cache import digest
    from projections.embedding import CallableEmbedder, HashedNgramEmbedder
    from projections.vectors import EMBEDDER_ENV, register_embedder, to_blob

    hashed = HashedNgramEmbedder(40)
    register_embedder("forget-model-v1",
                      lambda: CallableEmbedder("forget-model-v1", hashed.embed, 40))
    monkeypatch.setenv(EMBEDDER_ENV, "forget-model-v1")
    store = Store(sqlite_url, register_path=register_path)
    texts = ["lang: QUOKKA-one-7731", "lang: QUOKKA-two-7731"]
    try:
        await store.append_one(parse_event(write("lang", "QUOKKA-one-7731", memory_id="Q1",
                                                 source=src(at=at(1)))))
        await store.append_one(parse_event(write("keep", "WOMBAT-other-user", user="u8",
                                                 source=src(at=at(1)))))
        await store.append_one(parse_event(event("task.opened", {
            "task_key": "T900", "namespace": ["shop-a", "u7", "tickets"],
            "title": "QUOKKA-title-9931"}, source=src(at=at(1)))))
        await Runner(store).catch_up()
        await store.append_one(parse_event(write(
            "lang", "QUOKKA-two-7731", memory_id="Q2", supersedes="Q1",
            etype="memory.corrected", source=src(at=at(2)))))
        await Runner(store).catch_up()
        async with store.read() as conn:
            cached = {bytes(r.digest): bytes(r.vector)
                      for r in (await conn.execute(select(t.embedding_cache))).all()}
        assert {digest(x) for x in texts} <= set(cached)
        assert digest("keep: WOMBAT-other-user") in cached
        task_digests = set(cached) - {digest(x) for x in texts} - {
            digest("keep: WOMBAT-other-user")}
        assert task_digests  # the task summary's
        await store.append_one(parse_event(forget(3, namespace_prefix=["shop-a", "u7"])))
        await Runner(store).catch_up()
    finally:
        await store.close()
    on_disk = sqlite_files(sqlite_url)
    for x in texts:
        assert digest(x) not in on_disk
        assert to_blob(hashed.embed([x])[0]) not in on_disk
    for d in task_digests:
        assert d not in on_disk
        assert cached[d] not in on_disk
    assert digest("keep: WOMBAT-other-user") in on_disk  # another user's cache stays


async def test_replays_and_late_extractions_do_not_resurrect(store: Store) -> None:
    """Duplicates and late re-extractions after a forget stay suppressed (R22)."""
    original = write("lang", "ZEBRA-zh", idem="u31", source=src(at=at(1)))
    await store.append_one(parse_event(original))
    await store.append_one(parse_event(forget(2, namespace=NS, key="lang")))
    again = await store.append_one(parse_event(original))
    assert again.status == "duplicate"
    late = await store.append_one(parse_event(write(
        "lang", "ZEBRA-zh", idem="reextract-1", source=src("user_statement", at=at(1)))))
    assert late.suppressed is True
    await Runner(store).catch_up()
    assert "ZEBRA" not in await read_all(store)
    async with store.read() as conn:
        payload = (await conn.execute(select(t.events.c.payload).where(
            t.events.c.position == late.position))).scalar()
    assert payload is None


async def test_said_again_after_forget_is_new_memory(store: Store) -> None:
    """A write with source order after the forget is a new memory."""
    await store.append_one(parse_event(write("lang", "zh", source=src(at=at(1)))))
    await store.append_one(parse_event(forget(2, namespace=NS, key="lang")))
    await store.append_one(parse_event(write("lang", "en", source=src(at=at(3)))))
    await Runner(store).catch_up()
    async with store.read() as conn:
        got = await reads.get(conn, U7, NS, "lang", now_us=NOW)
    assert (got["value"], got["version"]) == ("en", 2)


async def test_prefix_forget_removes_user_data_only(store: Store) -> None:
    """Forgetting [shop-a, u7] removes u7's memories and tasks and nothing of u8's."""
    for user in ("u7", "u8"):
        await store.append([parse_event(e) for e in (
            write("lang", f"lang-{user}", user=user, source=src(at=at(1))),
            event("task.opened", {"task_key": f"T-{user}", "namespace": ["shop-a", user, "t"],
                                  "title": f"title-{user}"}, actor=user, source=src(at=at(1))),
        )])
    await Runner(store).catch_up()
    await store.append_one(parse_event(forget(5, namespace_prefix=["shop-a", "u7"])))
    assert "u7" not in (await read_all(store)).replace("'u7'", "")
    await Runner(store).catch_up()
    u8 = reads.Principal("shop-a", "u8")
    async with store.read() as conn:
        assert (await reads.get(conn, u8, ["shop-a", "u8", "preferences"], "lang",
                                now_us=NOW))["value"] == "lang-u8"
        assert [x["task_key"] for x in await reads.tasks(conn, u8)] == ["T-u8"]
        assert await reads.tasks(conn, U7, include_closed=True) == []
        bodies = (await conn.execute(select(t.task_notes.c.body).where(
            t.task_notes.c.task_key == "T-u7"))).scalars().all()
    assert bodies == [None]


async def test_other_users_forget_is_rejected(store: Store) -> None:
    """A user cannot forget another user's namespace (R24)."""
    import pytest

    from ledger.errors import ValidationError
    with pytest.raises(ValidationError, match="must equal actor"):
        await store.append_one(parse_event(event(
            "memory.forgotten", {"namespace_prefix": ["shop-a", "u8"]}, actor="u7")))


async def test_retention_sweep_purges_closed_task(store: Store) -> None:
    """A closed task past retain_until is purged by the sweep, as its own event (R6, R28)."""
    sor = src("system_of_record", "aftersales", at(1))
    await store.append([parse_event(e) for e in (
        event("task.opened", {"task_key": "T900", "namespace": ["shop-a", "u7", "tickets"],
                              "refs": {"order": "A123"}}, actor="as", source=sor),
        event("task.noted", {"task_key": "T900", "kind": "user_report",
                             "text": "left earbud crackles"}, source=src(at=at(2))),
        event("task.closed", {"task_key": "T900", "retain_until": "2026-10-01T00:00:00Z"},
              actor="as", source=src("system_of_record", "aftersales", at(3))),
    )])
    await Runner(store).catch_up()
    assert await sweep_retention(store, datetime(2026, 9, 25, tzinfo=UTC)) == []
    assert await sweep_retention(store, datetime(2026, 10, 2, tzinfo=UTC)) == [
        ("shop-a", "T900")]
    await Runner(store).catch_up()
    assert "crackles" not in await read_all(store)
    async with store.read() as conn:
        payloads = (await conn.execute(select(t.events.c.payload).where(
            t.events.c.task_key == "T900", t.events.c.type != "task.purged"))).scalars().all()
    assert payloads == [None, None, None]
    entries = [e["event"]["type"] for e in store.register.entries()]
    assert entries == ["task.purged"]


# -- property: no interleaving resurrects ---------------------------------------------------

def covered(w: dict[str, Any], forgets: list[dict[str, Any]]) -> bool:
    """The contract's coverage rule, stated independently of the implementation."""
    def order(e: dict[str, Any]) -> tuple[Any, ...]:
        s = e["source"]
        return (datetime.fromisoformat(s["at"]), s.get("seq") or 0, s["id"],
                e["idempotency_key"])
    d = w["data"]
    for f in forgets:
        fd = f["data"]
        if "memory_id" in fd:
            if d.get("memory_id") == fd["memory_id"]:
                return True
            continue
        if order(w) > order(f):
            continue
        if "namespace_prefix" in fd and d["namespace"][:len(fd["namespace_prefix"])] == \
                fd["namespace_prefix"]:
            return True
        if fd.get("namespace") == d["namespace"] and fd.get("key") == d["key"]:
            return True
    return False


@given(seed=st.integers(0, 10**6))
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_no_interleaving_returns_forgotten_content(tmp_path: Path, seed: int) -> None:
    """Random writes, corrections and forgets in any arrival order never return covered
    content from any read path, and rebuild equals incremental (R20, R22, property)."""
    import tempfile
    rng = random.Random(seed)
    evs: list[dict[str, Any]] = []
    for i in range(rng.randint(6, 25)):
        minute = rng.randrange(30)
        if rng.random() < 0.7:
            evs.append(write(rng.choice(["lang", "style"]), f"VAL{i}X", memory_id=f"M{i}",
                             idem=f"w{i}", source=src(at=at(minute))))
        else:
            target = rng.choice([{"namespace": NS, "key": rng.choice(["lang", "style"])},
                                 {"namespace_prefix": ["shop-a", "u7"]},
                                 {"memory_id": f"M{rng.randrange(i + 1)}"}])
            f = forget(minute, **target) | {"idempotency_key": f"f{i}"}
            if "memory_id" in target:
                # A user may only forget a memory id the ledger already shows is theirs;
                # an operator may name one that has not arrived yet.
                f |= {"actor": "ops", "source": src("operator", "ops", at(minute))}
            evs.append(f)
    rng.shuffle(evs)
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    store = Store(f"sqlite+aiosqlite:///{d / 'l.db'}", register_path=str(d / "l.f"))
    await store.open()
    try:
        for e in evs:
            await store.append_one(parse_event(e))
            if rng.random() < 0.4:
                await Runner(store, batch_size=rng.randint(1, 5)).catch_up()
            seen = await read_all(store)
            forgets_so_far = [f for f in evs[:evs.index(e) + 1]
                              if f["type"] == "memory.forgotten"]
            for w in evs:
                if w["type"] == "memory.written" and covered(w, forgets_so_far):
                    assert repr(w["data"]["value"]) not in seen
        await Runner(store).catch_up()
        fresh = await fresh_replay(store, d)
        try:
            assert await dump_views(store) == await dump_views(fresh)
        finally:
            await fresh.close()
    finally:
        await store.close()


async def test_forget_reaches_dead_letters(store: Store) -> None:
    """A rejected event kept as a dead letter loses its content when a forget covers what
    it names, whether the forget came before or after it (R20)."""
    from ledger.errors import ValidationError
    from workers.ingest import record_dead_letters
    bad = write("lang", "KIWI-before", source=src(at=at(1)))
    bad["data"]["colour"] = "red"
    await record_dead_letters(store, [(bad, ValidationError("data.colour", "unknown"))])
    await store.append_one(parse_event(forget(2, namespace=NS, key="lang")))
    await Runner(store).catch_up()
    late = write("lang", "KIWI-after", source=src(at=at(3)))
    late["data"]["colour"] = "blue"
    await record_dead_letters(store, [(late, ValidationError("data.colour", "unknown"))])
    other = write("style", "KIWI-kept", source=src(at=at(3)))
    other["data"]["colour"] = "green"
    await record_dead_letters(store, [(other, ValidationError("data.colour", "unknown"))])
    async with store.read() as conn:
        payloads = (await conn.execute(select(t.dead_letters.c.payload).order_by(
            t.dead_letters.c.id))).scalars().all()
    assert payloads[0] is None
    assert payloads[1] is None
    assert b"KIWI-kept" in bytes(payloads[2])


async def test_verify_forgotten_checks_dead_letters(store: Store) -> None:
    """`replay verify --forgotten` reports a dead letter still holding covered content."""
    from sqlalchemy import update

    from replay.verify.forgotten import verify_forgotten

    bad = write("lang", "KIWI", source=src(at=at(1)))
    await store.append_one(parse_event(forget(2, namespace=NS, key="lang")))
    await Runner(store).catch_up()
    assert (await verify_forgotten(store))["ok"] is True
    async with store.view_write() as conn:
        import orjson
        await conn.execute(t.dead_letters.insert().values(
            received_at="2026-12-01T00:00:00Z", tenant="shop-a", idempotency_key="x",
            error="put back by hand", payload=orjson.dumps(bad)))
    report = await verify_forgotten(store)
    assert report["ok"] is False
    assert report["problems"][0]["place"] == "dead_letters.payload"
    async with store.view_write() as conn:
        await conn.execute(update(t.dead_letters).values(payload=None))
    assert (await verify_forgotten(store))["ok"] is True
