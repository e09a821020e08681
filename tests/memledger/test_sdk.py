"""The public SDK: typed calls over the core, builders validated as the wire path is."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memledger
from ledger import builders
from ledger.validation import parse_event
from memledger import Source
from memledger._ledger import _checked_principal
from projections import reads
from tests.cli import Cli

AT = "2026-09-20T10:00:00+08:00"
KINDS = ["explicit_user_request", "user_statement", "system_of_record", "operator",
         "model_inference", "tool_output", "retrieved_document", "bogus"]
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
maybe = st.none() | text
INTS = st.integers(-(2**63), 2**63 - 1)


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except memledger.ValidationError as e:
        return "rejected", str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), tenant=st.sampled_from(["shop-a", "shop-b", ""]),
       actor=st.sampled_from(["u7", "u8", "ops"]), ns_tail=st.lists(text, max_size=7),
       key=text, value=st.none() | INTS | text | st.lists(INTS, max_size=3),
       task=maybe, session=maybe, supersedes=maybe, memory_id=maybe,
       seq=st.none() | st.integers(-2, 10**6), etype=st.sampled_from(
           ["memory.written", "memory.corrected"]))
def test_write_builder_validates_exactly_as_the_wire_path(
        kind: str, tenant: str, actor: str, ns_tail: list[str], key: str, value: Any,
        task: str | None, session: str | None, supersedes: str | None,
        memory_id: str | None, seq: int | None, etype: str) -> None:
    """For any arguments, a builder gives the event `parse_event` gives for the same wire
    object, or the same rejection: builders add no rule and skip none (R9, R10, R23)."""
    source = Source(kind, "C17", AT, seq)
    kw: dict[str, Any] = {
        "tenant": tenant, "actor": actor, "namespace": ["shop-a", "u7", *ns_tail], "key": key,
        "value": value, "source": source, "task": task, "session": session,
        "supersedes": supersedes, "memory_id": memory_id, "idempotency_key": "k1",
        "etype": etype}
    built = _outcome(lambda: builders.write(**kw))
    layer = "session" if session is not None else "task" if task is not None else None
    data = {"namespace": kw["namespace"], "key": key, "value": value, "layer": layer,
            "task_key": task, "session_id": session, "memory_id": memory_id,
            "supersedes": supersedes}
    data = {k: v for k, v in data.items() if v is not None or k == "value"}
    wired = _outcome(lambda: parse_event(builders.wire(
        etype, data, tenant=tenant, actor=actor, source=source, idempotency_key="k1")))
    assert built == wired


@pytest.mark.parametrize(("build", "etype"), [
    (lambda s: builders.supersede(tenant="shop-a", actor="u7", memory_id="m1", source=s),
     "memory.superseded"),
    (lambda s: builders.confirm(tenant="shop-a", actor="u7", memory_id="m1", source=s),
     "memory.confirmed"),
    (lambda s: builders.forget_memory(tenant="shop-a", actor="u7", memory_id="m1", source=s),
     "memory.forgotten"),
    (lambda s: builders.forget_key(tenant="shop-a", actor="u7", source=s, key="k",
                                   namespace=["shop-a", "u7", "p"]), "memory.forgotten"),
    (lambda s: builders.forget_prefix(tenant="shop-a", actor="u7", source=s,
                                      namespace_prefix=["shop-a", "u7"]), "memory.forgotten"),
    (lambda s: builders.open_task(tenant="shop-a", actor="u7", task_key="T1", source=s,
                                  namespace=["shop-a", "u7"], refs={"order": "A1"}),
     "task.opened"),
    (lambda s: builders.note_task(tenant="shop-a", actor="u7", task_key="T1", source=s,
                                  kind="user_report", text="it crackles"), "task.noted"),
    (lambda s: builders.close_task(tenant="shop-a", actor="u7", task_key="T1", source=s),
     "task.closed"),
])
def test_every_event_type_has_a_validating_builder(build: Any, etype: str) -> None:
    """Each builder yields its type, equal to the validated wire form of itself, and a
    source kind the type does not admit is rejected by the builder as on the wire (R9)."""
    ev = build(Source.user_request("C17", seq=1, at=AT))
    assert ev.type == etype
    assert parse_event(ev.to_wire()) == ev
    with pytest.raises(memledger.ValidationError):
        build(Source("no_such_kind", "C17", AT))


def test_purge_builder_needs_an_operator_or_system_source() -> None:
    """task.purged is built for operators and systems only, as the wire path requires."""
    ev = builders.purge_task(tenant="shop-a", actor="ops", task_key="T1",
                             source=Source.operator("retention", at=AT))
    assert ev.type == "task.purged"
    with pytest.raises(memledger.ValidationError):
        builders.purge_task(tenant="shop-a", actor="u7", task_key="T1",
                            source=Source.user_request("C17", at=AT))


def test_default_idempotency_key_is_stable_per_source_and_target() -> None:
    """The derived key is the same for a retry, differs per target and per source
    position, and stays within the 256-character limit (R11)."""
    s = Source.user_request("C17", seq=2, at=AT)
    ns = ["shop-a", "u7", "preferences"]
    a = builders.write(tenant="shop-a", actor="u7", namespace=ns, key="lang", value="zh",
                       source=s)
    again = builders.write(tenant="shop-a", actor="u7", namespace=ns, key="lang", value="zh",
                           source=s)
    other_key = builders.write(tenant="shop-a", actor="u7", namespace=ns, key="tone",
                               value="warm", source=s)
    later = builders.write(tenant="shop-a", actor="u7", namespace=ns, key="lang", value="zh",
                           source=Source.user_request("C17", seq=3, at=AT))
    by_event = builders.write(tenant="shop-a", actor="u7", namespace=ns, key="lang",
                              value="zh", source=Source.user_request("C17", event_id="U31",
                                                                     at=AT))
    assert a.idempotency_key == again.idempotency_key
    assert len({a.idempotency_key, other_key.idempotency_key, later.idempotency_key,
                by_event.idempotency_key}) == 4
    long_id = builders.write(tenant="shop-a", actor="u7", namespace=ns, key="lang",
                             value="zh", source=Source.user_request("C" * 256, seq=10**12, at=AT))
    assert len(long_id.idempotency_key) <= 256
    explicit = builders.write(tenant="shop-a", actor="u7", namespace=ns, key="lang",
                              value="zh", source=s, idempotency_key="mine")
    assert explicit.idempotency_key == "mine"


async def test_principal_remember_get_recall_forget(db_url: str, register_path: str) -> None:
    """The typed calls: a retried remember is a duplicate, reads return typed values
    scoped to the principal, and a forget makes the value unreadable (R11, R16, R20, R24)."""
    async with memledger.MemoryLedger(db_url, register_path=register_path) as ml:
        u7, u8 = ml.principal("shop-a", "u7"), ml.principal("shop-a/u8")
        s = Source.user_request("C17", seq=2, at=AT)
        first = await u7.remember(["preferences"], "reply_language", "Simplified Chinese",
                                  source=s)
        retry = await u7.remember(["preferences"], "reply_language", "Simplified Chinese",
                                  source=s)
        assert isinstance(first, memledger.AppendResult)
        assert (first.status, retry.status) == ("appended", "duplicate")
        m = await u7.get(["preferences"], "reply_language")
        assert isinstance(m, memledger.Memory)
        assert (m.value, m.version, m.layer, m.namespace) == (
            "Simplified Chinese", 1, "long", ("shop-a", "u7", "preferences"))
        assert await u8.get(["preferences"], "reply_language") is None
        ctx = await u7.recall("which language do I want replies in?")
        assert [i.key for i in ctx.items] == ["reply_language"]
        assert ctx.audit_id and ctx.items[0].score > 0 and ctx.items[0].reason
        assert (await u8.recall("which language do I want replies in?")).items == ()
        await u7.forget(["preferences"], "reply_language",
                        source=Source.user_request("C17", seq=3, at=AT))
        assert await u7.get(["preferences"], "reply_language") is None
        hist = await u7.history(["preferences"], "reply_language")
        assert [(h.status, h.redacted, h.value) for h in hist] == [("forgotten", True, None)]


async def test_principal_tasks_and_layers(sqlite_url: str, register_path: str) -> None:
    """Task writes through a principal: a system of record states status, the task
    layer overrides long-term inside its task only (R3, R8, R27)."""
    async with memledger.MemoryLedger(sqlite_url, register_path=register_path) as ml:
        u7 = ml.principal("shop-a", "u7")
        await u7.open_task("T900", refs={"order": "A123"}, title="earbud",
                           source=Source.user_request("C17", seq=1, at=AT))
        await u7.note_task("T900", "system_status", "inspecting", actor="aftersales",
                           fields={"status": "inspecting"},
                           source=Source.system("aftersales", seq=1, at=AT))
        with pytest.raises(memledger.ValidationError):
            await u7.note_task("T900", "system_status", "done",
                               source=Source.model("C17", seq=2, at=AT))
        (t900,) = await u7.tasks()
        assert (t900.task_key, t900.status, t900.refs, t900.system["status"]) == (
            "T900", "open", {"order": "A123"}, "inspecting")
        await u7.remember(["preferences"], "code_language", "Python",
                          source=Source.user_request("C1", seq=1, at=AT))
        await u7.remember(["preferences"], "code_language", "Java", task="T900",
                          source=Source.user_request("C1", seq=2, at=AT))
        default = await u7.get(["preferences"], "code_language")
        inside = await u7.get(["preferences"], "code_language", task="T900")
        assert default is not None and inside is not None
        assert (default.value, inside.value, inside.layer) == ("Python", "Java", "task")
        await u7.close_task("T900", resolution="replaced",
                            source=Source.user_request("C17", seq=9, at=AT))
        assert await u7.tasks() == []
        assert [x.status for x in await u7.tasks(include_closed=True)] == ["closed"]


async def test_typed_results_print_as_the_cli_prints(sqlite_url: str,
                                                     register_path: str) -> None:
    """`to_dict()` of a typed result is exactly the JSON the command line prints."""
    async with memledger.MemoryLedger(sqlite_url, register_path=register_path) as ml:
        u7 = ml.principal("shop-a", "u7")
        await u7.remember(["preferences"], "reply_language", "English",
                          source=Source.user_request("C17", seq=1, at=AT))
        await u7.open_task("T1", source=Source.user_request("C17", seq=2, at=AT))
        m = await u7.get(["preferences"], "reply_language")
        tasks = await u7.tasks()
    cli = Cli(sqlite_url, register_path)
    assert m is not None
    assert cli.json("get", "--as", "shop-a/u7", "--namespace", "shop-a/u7/preferences",
                    "--key", "reply_language") == m.to_dict()
    assert cli.json("tasks", "--as", "shop-a/u7") == {"tasks": [x.to_dict() for x in tasks]}


async def test_wait_false_without_a_broker_appends_and_projects_later(
        sqlite_url: str, register_path: str) -> None:
    """`wait=False` with no broker: durable at once, projected by the next runner; the
    tombstone check still hides a forgotten key before that (R16, R20)."""
    async with memledger.MemoryLedger(sqlite_url, register_path=register_path) as ml:
        u7 = ml.principal("shop-a", "u7")
        res = await u7.remember(["preferences"], "tone", "warm", wait=False,
                                source=Source.user_request("C17", seq=1, at=AT))
        assert isinstance(res, memledger.AppendResult) and res.status == "appended"
        assert await u7.get(["preferences"], "tone") is None  # not projected yet
        await ml.project()
        got = await u7.get(["preferences"], "tone")
        assert got is not None and got.value == "warm"
        with pytest.raises(memledger.ValidationError, match="broker"):
            await ml.publish([])


@pytest.mark.redis
async def test_wait_false_with_a_broker_publishes(sqlite_url: str, register_path: str,
                                                  redis_db: str) -> None:
    """`wait=False` with a broker hands the event to the ingest queue, nothing appended
    here; the workers append it (docs/workers.md)."""
    redis.Redis.from_url(redis_db).flushdb()
    async with memledger.MemoryLedger(sqlite_url, register_path=register_path,
                                      broker=redis_db) as ml:
        u7 = ml.principal("shop-a", "u7")
        res = await u7.remember(["preferences"], "tone", "warm", wait=False,
                                source=Source.user_request("C17", seq=1, at=AT))
        assert isinstance(res, memledger.PublishResult) and res.status == "published"
        async with ml.store.read() as conn:
            assert await ml.store.head(conn) == 0
        assert ml._publisher is not None and ml._publisher.backlog() == 1
    redis.Redis.from_url(redis_db).flushdb()


async def test_principal_names_and_namespaces_are_checked(sqlite_url: str,
                                                          register_path: str) -> None:
    """A principal is TENANT/USER without '/', and namespaces are lists of parts."""
    async with memledger.MemoryLedger(sqlite_url, register_path=register_path) as ml:
        with pytest.raises(memledger.ValidationError):
            ml.principal("shop-a/u7/x")
        with pytest.raises(memledger.ValidationError):
            ml.principal("shop-a", "u7/x")
        with pytest.raises(memledger.ValidationError):
            ml.principal("shop-a", "u7").namespace("preferences")  # type: ignore[arg-type]


def _principal_as_parsed(tenant: str, user: str) -> tuple[str, str]:
    """What `ml.principal(tenant, user)` accepted before its check took a short cut:
    `TENANT/USER` parsed, and the parts must come back as given."""
    who = reads.Principal.parse(f"{tenant}/{user}")
    if (who.tenant, who.user) != (tenant, user):
        raise memledger.ValidationError("principal", "tenant and user must not contain '/'")
    return who.tenant, who.user


NAME_CHARS = st.text(st.sampled_from(["a", "u", "7", "/", "-", " ", "\x00", "\x1f", "\n",
                                      "\x7f", "é", "中"]), max_size=5)


@settings(max_examples=500, deadline=None)
@given(tenant=NAME_CHARS | text, user=NAME_CHARS | text)
def test_principal_check_accepts_and_refuses_as_parsing_does(tenant: str, user: str) -> None:
    """For any tenant and user, `ml.principal(tenant, user)`'s check gives the pair
    parsing `TENANT/USER` gives, or the same refusal (R24: no name it refused is let
    through, none it took is refused)."""
    assert _outcome(lambda: _checked_principal(tenant, user)) == \
        _outcome(lambda: _principal_as_parsed(tenant, user))


async def test_get_results_share_nothing_with_their_dict(db_url: str,
                                                         register_path: str) -> None:
    """A `Memory` from `get` and its `to_dict()` share no mutable value: changing the
    attributes' value or source, or a dict `to_dict` returned, changes neither the
    memory nor the next `to_dict()` (both backends' read paths)."""
    async with memledger.MemoryLedger(db_url, register_path=register_path) as ml:
        u7 = ml.principal("shop-a", "u7")
        await u7.remember(["preferences"], "seat", {"side": "window", "rows": [3, 4]},
                          source=Source.user_request("C17", seq=1, at=AT))
        m = await u7.get(["preferences"], "seat")
        fresh = await u7.get(["preferences"], "seat")
    assert m is not None and fresh is not None and m == fresh
    first = m.to_dict()
    assert first["value"] == {"side": "window", "rows": [3, 4]}
    assert first["namespace"] == ["shop-a", "u7", "preferences"]
    m.value["side"] = "aisle"
    m.value["rows"].append(5)
    m.source["kind"] = "changed"  # type: ignore[index]
    assert m.to_dict() == first == fresh.to_dict()
    first["value"]["rows"].clear()
    first["namespace"].append("x")
    first["source"]["id"] = "changed"
    again = m.to_dict()
    assert again == fresh.to_dict()
    assert again["value"] == {"side": "window", "rows": [3, 4]}
    assert m.value == {"side": "aisle", "rows": [3, 4, 5]}
    assert m.namespace == ("shop-a", "u7", "preferences")


def test_public_names() -> None:
    """`import memledger` exports the SDK, results, builders and the error tree."""
    for name in ("MemoryLedger", "Principal", "Source", "Memory", "Recall", "RecallItem",
                 "TaskSummary", "AppendResult", "MemledgerError", "ValidationError", "events"):
        assert hasattr(memledger, name), name
    assert issubclass(memledger.ValidationError, memledger.MemledgerError)
    assert callable(memledger.events.write) and callable(memledger.events.open_task)


async def test_sdk_sets_and_reads_the_embedder(db_url: str, register_path: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`MemoryLedger.embedder()` / `set_embedder()` (issue 18): a new ledger uses the
    default, hashgram-v2-512; an unknown name is refused and records nothing; a known one
    is recorded and the index is rebuilt with it before the call returns, and recall
    then scores with it (R14: never against another model's vectors)."""
    monkeypatch.delenv("MEMLEDGER_EMBEDDER", raising=False)
    async with memledger.MemoryLedger(db_url, register_path=register_path) as ml:
        u7 = ml.principal("shop-a", "u7")
        await u7.remember(["preferences"], "reply_language", "Simplified Chinese",
                          source=Source.user_request("C17", seq=2, at=AT))
        now = await ml.embedder()
        assert isinstance(now, memledger.EmbedderSetting)
        assert (now.name, now.source, now.recorded, now.dim, now.index_current) == (
            "hashgram-v2-512", "default", None, 512, True)
        with pytest.raises(memledger.ValidationError, match="unknown embedder"):
            await ml.set_embedder("no-such-model")
        assert (await ml.embedder()).recorded is None
        v1 = await ml.set_embedder("hashgram-v1-512")
        assert (v1.name, v1.source, v1.recorded, v1.index_models, v1.index_current) == (
            "hashgram-v1-512", "recorded", "hashgram-v1-512", {"hashgram-v1-512": 1}, True)
        ctx = await u7.recall("which language do I want replies in?")
        assert [i.key for i in ctx.items] == ["reply_language"]
        assert "semantic" in ctx.items[0].reason
        later = await ml.set_embedder("hashgram", rebuild=False)
        assert (later.name, later.recorded, later.index_current) == (
            "hashgram-v2-512", "hashgram-v2-512", False)


@pytest.mark.parametrize("inline", [True, False], ids=["default", "inline_writes=False"])
async def test_sdk_writes_in_one_hand_off_and_audits_before_returning(
        db_url: str, register_path: str, tmp_path: Any, inline: bool) -> None:
    """`MemoryLedger` on a SQLite file runs its write transactions on the inline thread
    by default (`ledger.inline`): a `wait=True` remember (the append and the round) and
    a recall's audit run no statement on the async engine, the audit row is committed
    when `recall` returns (R25), and the views equal a fresh replay's (R14); with
    `inline_writes=False`, and on PostgreSQL, the same calls go through the async
    driver with the same results."""
    from sqlalchemy import event as sa_event
    from sqlalchemy import select

    from ledger import schema as t
    from tests.helpers import assert_views_replay

    async with memledger.MemoryLedger(db_url, register_path=register_path,
                                      inline_writes=inline) as ml:
        store = ml.store
        assert (store.inline is not None) == (inline and store.dialect == "sqlite")
        u7 = ml.principal("shop-a", "u7")
        await u7.remember(["preferences"], "reply_language", "Simplified Chinese",
                          source=Source.user_request("C17", seq=1, at=AT))
        on_driver: list[str] = []

        def counted(_c: Any, _cur: Any, statement: str, *_a: Any) -> None:
            on_driver.append(statement)

        sa_event.listen(store.engine.sync_engine, "before_cursor_execute", counted)
        try:
            await u7.remember(["preferences"], "code_language", "Python",
                              source=Source.user_request("C17", seq=2, at=AT))
            await u7.correct(["preferences"], "reply_language", "English",
                             supersedes=(await u7.get(["preferences"], "reply_language"))
                             .memory_id, source=Source.user_request("C17", seq=3, at=AT))
            ctx = await u7.recall("which language do I want replies in?")
        finally:
            sa_event.remove(store.engine.sync_engine, "before_cursor_execute", counted)
        writes = [s for s in on_driver if s.lstrip().upper().startswith(
            ("INSERT", "UPDATE", "DELETE"))]
        assert (writes == []) == (store.inline is not None)
        assert [i.memory.value for i in ctx.items][:1] == ["English"]
        async with store.read() as conn:
            audited = (await conn.execute(select(t.recall_audit_items.c.memory_id).where(
                t.recall_audit_items.c.audit_id == ctx.audit_id))).all()
        assert sorted(r[0] for r in audited) == sorted(i.memory.memory_id for i in ctx.items)
        await assert_views_replay(store, tmp_path)
