"""No answer of the append path tells a user what other users hold, or echoes the
namespace parts of what it refuses (issue 15, finding 6; R24: access filtering in the
data access layer, on both backends).

Explicit memory ids and task keys are unique in a tenant (the views key rows by them),
so a taken one is refused whoever took it: the answer is the same for the user's own
earlier use and for another user's, and names neither the other owner nor a namespace.
A change to, or a note on, another user's memory or task is answered exactly as one
on a memory or task that does not exist.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledger.errors import ConcurrencyConflict, MemledgerError, ValidationError
from ledger.store import Store
from ledger.validation import parse_event
from tests.factories import event, src, write

SOR = src("system_of_record", "aftersales")
#: What no refusal below may contain: the other owner, tenant and namespace parts.
OTHERS = ("u7", "shop-a", "preferences", "tickets", "returns-desk", "another owner",
          "another write")


async def _refusal(store: Store, wire: dict[str, Any]) -> str:
    with pytest.raises(MemledgerError) as info:
        await store.append_one(parse_event(wire))
    return str(info.value)


def _reveals_nothing(msg: str) -> None:
    for part in OTHERS:
        assert part not in msg, (part, msg)


async def test_a_taken_memory_id_gets_one_answer_whoever_took_it(store: Store) -> None:
    """u8 reusing u7's explicit id hears what u7 hears reusing its own."""
    await store.append_one(parse_event(write("a", 1, memory_id="M18")))
    own = await _refusal(store, write("a", 2, memory_id="M18"))
    theirs = await _refusal(store, write("b", 3, user="u8", memory_id="M18"))
    assert own == theirs
    assert theirs.startswith("data.memory_id: memory_id 'M18' is already used")
    _reveals_nothing(theirs)


async def test_a_taken_task_key_gets_one_answer_whoever_took_it(store: Store) -> None:
    """Opening u7's task key as u8 is answered as opening it under another namespace of
    u7's own: not "already open under another owner"."""
    await store.append_one(parse_event(event("task.opened", {
        "task_key": "T900", "namespace": ["shop-a", "u7", "tickets"]},
        source=SOR, actor="aftersales")))
    own = await _refusal(store, event("task.opened", {
        "task_key": "T900", "namespace": ["shop-a", "u7", "returns-desk"]},
        source=SOR, actor="aftersales"))
    theirs = await _refusal(store, event("task.opened", {
        "task_key": "T900", "namespace": ["shop-a", "u8", "tickets"]}, actor="u8"))
    assert own.replace("'T900'", "K") == theirs.replace("'T900'", "K")
    _reveals_nothing(theirs)


async def test_another_users_memory_or_task_is_answered_as_a_missing_one(store: Store
                                                                         ) -> None:
    """Superseding u7's memory or noting on u7's task, as u8, reads exactly like the
    same request on an id or key that exists nowhere, and names no tenant."""
    await store.append_one(parse_event(write("lang", "zh", memory_id="L7")))
    await store.append_one(parse_event(event("task.opened", {
        "task_key": "T900", "namespace": ["shop-a", "u7", "tickets"]},
        source=SOR, actor="aftersales")))
    for body, absent in (({"memory_id": "L7"}, {"memory_id": "L0"}),):
        theirs = await _refusal(store, event("memory.superseded", body, actor="u8"))
        missing = await _refusal(store, event("memory.superseded", absent, actor="u8"))
        assert theirs.replace("L7", "X") == missing.replace("L0", "X")
        assert "'u8'" in theirs  # the requester's own actor only
        _reveals_nothing(theirs)
    note = {"kind": "user_report", "text": "left earbud crackles"}
    theirs = await _refusal(store, event("task.noted", {"task_key": "T900", **note},
                                         actor="u8"))
    missing = await _refusal(store, event("task.noted", {"task_key": "T999", **note},
                                          actor="u8"))
    assert theirs.replace("T900", "X") == missing.replace("T999", "X")
    _reveals_nothing(theirs)


async def test_a_version_conflict_names_the_key_not_the_namespace(store: Store) -> None:
    """The expected-version refusal says which key, never the namespace parts."""
    await store.append_one(parse_event(write("lang", "zh")))
    with pytest.raises(ConcurrencyConflict) as info:
        await store.append_one(parse_event({**write("lang", "en"), "expected_version": 0}))
    msg = str(info.value)
    assert msg.startswith("expected version 0 of slot 'lang' but it is at 1")
    _reveals_nothing(msg)
    assert not isinstance(info.value, ValidationError)


@pytest.mark.parametrize(("ns", "hidden"), [
    (["acct-4111", "u7", "p"], "acct-4111"),        # part 0 is not the tenant
    (["shop-a", "u8-private", "p"], "u8-private"),  # part 1 is not the actor
])
def test_validation_messages_do_not_echo_namespace_parts(ns: list[str], hidden: str) -> None:
    """Refusals name the field and the rule, never the namespace part the user sent
    (issue 15, finding 6: parts may hold what the user typed)."""
    with pytest.raises(ValidationError) as err:
        parse_event(write("k", 1, ns=ns))
    assert err.value.field.startswith("data.namespace[")
    assert hidden not in str(err.value)


def test_ref_keys_are_not_echoed() -> None:
    """A ref whose key or value breaks the length rule is refused without echoing it."""
    ev = event("task.opened", {"task_key": "T1", "namespace": ["shop-a", "u7"],
                               "refs": {"k" * 300: "A1"}})
    with pytest.raises(ValidationError) as err:
        parse_event(ev)
    assert err.value.field == "data.refs" and "kkkk" not in str(err.value)
