"""Event model and validation: every rule of docs/events.md (R7, R9, R10, R13, R23)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ledger.errors import ValidationError
from ledger.events import derive_memory_id, encode_json
from ledger.secrets import find_secret_in_text
from ledger.validation import _default_text, decode_event, parse_event
from tests.factories import event, src, write


def reject(obj: Any) -> str:
    with pytest.raises(ValidationError) as e:
        parse_event(obj)
    return str(e.value)


def test_valid_write_is_normalised() -> None:
    """A write gets layer 'long', a derived memory_id and a default text (R7)."""
    ev = parse_event(write("reply_language", "Simplified Chinese", idem="k1"))
    assert ev.data["layer"] == "long"
    assert ev.data["memory_id"] == derive_memory_id("shop-a", "k1")
    assert ev.data["text"] == "reply_language: Simplified Chinese"


def test_namespace_must_start_with_tenant() -> None:
    """namespace[0] must equal the tenant; the message names the tenant, not the part."""
    msg = reject(write("k", 1, ns=["other-tenant", "u7", "p"]))
    assert "data.namespace[0]" in msg
    assert "data.namespace[0]: must equal the event's tenant 'shop-a'" in msg
    assert "other-tenant" not in msg  # namespace parts are never echoed (issue 15, 6)


@pytest.mark.parametrize("kind", ["tool_output", "retrieved_document"])
@pytest.mark.parametrize("layer", ["long", "task"])
def test_untrusted_sources_cannot_write_memories(kind: str, layer: str) -> None:
    """Tool output and retrieved documents never authorise a task or long-term write (R9)."""
    extra = {"task_key": "T900"} if layer == "task" else {}
    msg = reject(write("cmd", "rm -rf", source=src(kind), layer=layer, **extra))
    assert "source.kind" in msg
    assert "R9" in msg


def test_untrusted_source_may_write_session_memory() -> None:
    """A tool result may be kept in the current session only."""
    ev = parse_event(write("receipt", "T900", source=src("tool_output"), layer="session",
                           session_id="C17"))
    assert ev.data["layer"] == "session"


def test_user_kinds_must_own_namespace() -> None:
    """A user-sourced event may write only the actor's own namespace (R24)."""
    msg = reject(write("k", 1, actor="u8"))
    assert "data.namespace[1]" in msg
    assert "must equal actor 'u8'" in msg


def test_operator_may_write_on_users_behalf() -> None:
    """Operators and the system of record write on a user's behalf."""
    parse_event(write("k", 1, actor="ops", source=src("operator")))
    parse_event(write("k", 1, actor="aftersales", source=src("system_of_record")))


def test_system_status_needs_system_of_record() -> None:
    """Only the system of record states task facts (R3, R29)."""
    msg = reject(event("task.noted", {"task_key": "T900", "kind": "system_status",
                                      "text": "inspection confirmed the fault"},
                       source=src("model_inference")))
    assert "system_of_record" in msg


def test_confirm_needs_explicit_user_or_operator() -> None:
    """A model cannot confirm its own candidate (R10)."""
    msg = reject(event("memory.confirmed", {"memory_id": "m1"},
                       source=src("model_inference")))
    assert "R10" in msg


@pytest.mark.parametrize(("value", "where"), [
    ("4111 1111 1111 1111", "data.value"),
    ({"card": "4111-1111-1111-1111"}, "data.value.card"),
    ("my password is hunter2!", "data.value"),
    ("验证码是 482913", "data.value"),
    ("sk-abcDEF1234567890abcdef1234", "data.value"),
])
def test_secrets_rejected_without_echo(value: Any, where: str) -> None:
    """Secrets are rejected with the place named and the secret not echoed (R23)."""
    msg = reject(write("k", value))
    assert where in msg
    assert "R23" in msg
    for part in ("4111", "hunter2", "482913", "abcDEF"):
        assert part not in msg


def test_value_size_limit() -> None:
    """A value above 16 KiB encoded is rejected with its size."""
    msg = reject(write("k", "x" * 17000))
    assert "at most 16384 bytes" in msg


@pytest.mark.parametrize("at", ["2026-09-20", "2026-09-20T10:00:00", "yesterday",
                                "2026-09-20T10:00:00+0800"])
def test_timestamps_need_rfc3339_with_offset(at: str) -> None:
    """source.at must be RFC 3339 with an offset."""
    assert "source.at" in reject(write("k", 1, source=src(at=at)))


def test_unknown_fields_rejected() -> None:
    """Unknown fields are rejected at every level, naming the field."""
    obj = write("k", 1)
    obj["data"]["colour"] = "red"
    assert "data.colour" in reject(obj)
    obj = write("k", 1)
    obj["extra"] = 1
    assert "extra" in reject(obj)


def test_layer_needs_its_scope_key() -> None:
    """task_key is required iff layer is task; session_id iff layer is session."""
    assert "data.task_key" in reject(write("k", 1, layer="task"))
    assert "data.session_id" in reject(write("k", 1, layer="session"))
    assert "data.task_key" in reject(write("k", 1, task_key="T1"))


def test_corrected_requires_supersedes() -> None:
    """memory.corrected must name what it supersedes (R12)."""
    assert "data.supersedes" in reject(write("k", 1, etype="memory.corrected"))


def test_forget_needs_exactly_one_target() -> None:
    """A forget names one target: memory_id, namespace + key, or namespace_prefix."""
    msg = reject(event("memory.forgotten", {"memory_id": "m1",
                                            "namespace_prefix": ["shop-a", "u7"]}))
    assert "exactly one target" in msg
    msg = reject(event("memory.forgotten", {"namespace_prefix": ["shop-a"]}))
    assert "at least two parts" in msg


def test_malformed_json_is_a_validation_error() -> None:
    """Malformed JSON is a rejected event, never a crash."""
    with pytest.raises(ValidationError, match="malformed JSON"):
        decode_event(b"{not json")


# -- properties ---------------------------------------------------------------------------

ident = st.text(st.characters(min_codepoint=33, max_codepoint=0x9FFF,
                              exclude_categories=("Cc", "Cs"), exclude_characters="/"),
                min_size=1, max_size=12)
json_leaf = st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(
    st.sampled_from("abc xyz 中文偏好"), max_size=20)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(st.sampled_from("abcdef"), min_size=1, max_size=5), inner, max_size=3), max_leaves=8)


@st.composite
def valid_writes(draw: st.DrawFn) -> dict[str, Any]:
    tenant, user = draw(ident), draw(ident)
    layer = draw(st.sampled_from(["long", "task", "session"]))
    data: dict[str, Any] = {
        "namespace": [tenant, user, *draw(st.lists(ident, max_size=3))],
        "key": draw(ident), "value": draw(json_value), "layer": layer}
    if layer == "task":
        data["task_key"] = draw(ident)
    if layer == "session":
        data["session_id"] = draw(ident)
    return {"type": "memory.written", "idempotency_key": draw(ident), "tenant": tenant,
            "actor": user, "source": {
                "kind": draw(st.sampled_from(["explicit_user_request", "operator"])),
                "id": draw(ident), "at": "2026-09-20T10:00:00.123456+08:00",
                "seq": draw(st.integers(0, 2**40))},
            "data": data}


@given(valid_writes())
@settings(max_examples=200)
def test_round_trip(obj: dict[str, Any]) -> None:
    """Any valid event survives encode/decode unchanged (property)."""
    # A key and value whose default text reads as a secret (`口令` with a list value
    # reads `口令: [...]`) are refused: the text would be stored with the event.
    data = obj["data"]
    assume(find_secret_in_text(_default_text(data["key"], data["value"])) is None)
    ev = parse_event(obj)
    again = decode_event(ev.encode())
    assert again == ev
    assert again.encode() == ev.encode()
    assert again.order == ev.order


MUTATIONS = [
    (lambda o: o.__setitem__("tenant", ""), "tenant"),
    (lambda o: o["data"]["namespace"].__setitem__(0, o["tenant"] + "x"), "data.namespace[0]"),
    (lambda o: o["data"].__setitem__("layer", "forever"), "data.layer"),
    (lambda o: o["source"].__setitem__("kind", "rumour"), "source.kind"),
    (lambda o: o["source"].__setitem__("at", "2026-09-20 10:00"), "source.at"),
    (lambda o: o["source"].__setitem__("seq", -1), "source.seq"),
    (lambda o: o.__setitem__("idempotency_key", "k" * 257), "idempotency_key"),
    (lambda o: o["data"].pop("key"), "data.key"),
    (lambda o: o["data"].__setitem__("bogus", 1), "data.bogus"),
    (lambda o: o.__setitem__("type", "memory.deleted"), "type"),
]


@given(valid_writes(), st.sampled_from(MUTATIONS))
@settings(max_examples=200)
def test_rule_breaking_mutation_names_field(obj: dict[str, Any], mutation: Any) -> None:
    """Any mutation that breaks a rule is rejected with a message naming the field."""
    bad = copy.deepcopy(obj)
    mutate, field = mutation
    mutate(bad)
    with pytest.raises(ValidationError) as e:
        parse_event(bad)
    assert e.value.field == field


@given(json_value)
@settings(max_examples=300)
def test_parser_only_raises_its_own_error(obj: Any) -> None:
    """On arbitrary JSON the parser raises nothing but ValidationError (property)."""
    for candidate in (obj, {"type": "memory.written", "data": obj},
                      {**write("k", 1), "data": obj}):
        with contextlib.suppress(ValidationError):
            parse_event(candidate)
        with contextlib.suppress(ValidationError):
            decode_event(orjson.dumps(candidate))


def test_content_digest_ignores_key_order() -> None:
    """Equal content gives an equal digest whatever the key order on the wire."""
    a = write("k", {"x": 1, "y": 2}, idem="same")
    b = orjson.loads(encode_json(a))
    b["data"]["value"] = {"y": 2, "x": 1}
    assert parse_event(a).content_digest == parse_event(b).content_digest


def test_derived_id_form_is_reserved() -> None:
    """An explicit memory_id may not take the derived form, so derived ids never collide."""
    msg = reject(write("k", 1, memory_id="m_" + "0" * 24))
    assert "reserved for derived ids" in msg
    ev = parse_event(write("k", 1, idem="k9"))
    assert parse_event(ev.to_wire()) == ev  # its own derived id is accepted back


def test_derived_idempotency_key_never_looks_like_a_card() -> None:
    """A derived key whose hash part is all digits and Luhn-valid (about one key in
    40,000) gets another form instead of being rejected as a card number (R23); a key
    that passed before keeps its form, so a retry is still a duplicate (R11)."""
    from ledger import builders
    from ledger.builders import Source, derive_idempotency_key
    from ledger.secrets import find_secret_in_text

    source = Source.operator("langgraph:MemledgerStore:abc", seq=1,
                             at="2026-12-02T00:00:00.000000+00:00")
    # Found by searching key names: its hash part is 5533270371874524, a valid card.
    target = ["slot", ["shop-a", "x"], "k28426", None, None, None]
    key = derive_idempotency_key("memory.written", source, target)
    assert key.endswith(":h5533270371874524")
    assert find_secret_in_text(key.replace(":h", ":")) == "payment_card"
    ev = builders.write(tenant="shop-a", actor="op", namespace=["shop-a", "x"],
                        key="k28426", value=1, source=source)
    assert ev.idempotency_key == key
    # an ordinary key is unchanged: the hash right after the event type
    plain = derive_idempotency_key("memory.written", source, {"key": "k1"})
    assert plain.rsplit(":", 1)[1].isalnum() and ":h" not in plain


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=12)


@given(_JSON)
@settings(max_examples=200, deadline=None)
def test_encode_json_is_orjson_canonical_in_a_buffer_of_its_own_size(obj: Any) -> None:
    """The bytes are orjson's sorted-keys JSON, held in an allocation of about their
    length (not the writer's buffer: 4 KiB each with orjson 3.13, which a bulk load held
    by the thousand)."""
    import tracemalloc

    expected = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
    tracemalloc.start()
    try:
        got = encode_json(obj)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert got == expected
    assert held <= len(got) + 256
