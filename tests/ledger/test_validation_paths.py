"""Validation's cheaper checks decide exactly as the plain ones (issue 20, R20, R23).

`_identifier` returns early for a plain present string and for an absent optional
field, `_check_keys` asks `issuperset` before it lists unknown fields, `_collect`
skips the secret-name test for field names, and the source time is parsed once: each
must give the same value or the same error (field and message) as the rules written
out plainly, for any input, secrets embedded anywhere included.
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.errors import ValidationError
from ledger.validation import _check_keys, _identifier, parse_event
from tests.ledger.test_secret_prefilter import _exact, _outcome, _texts

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _identifier_plain(obj: dict[str, Any], key: str, where: str, *, required: bool = True,
                      max_chars: int = 256) -> str | None:
    """`_identifier` as it was written before its early returns."""
    field = f"{where}.{key}" if where else key
    if key not in obj or obj[key] is None:
        if required:
            raise ValidationError(field, "is required")
        return None
    v = obj[key]
    if not isinstance(v, str):
        raise ValidationError(field, f"must be a string, got {type(v).__name__}")
    if not v:
        raise ValidationError(field, "must not be empty")
    if len(v) > max_chars:
        raise ValidationError(field, f"must be at most {max_chars} characters, got {len(v)}")
    if _CONTROL.search(v):
        raise ValidationError(field, "must not contain control characters")
    return v


class _Str(str):
    """A str subclass (takes the plain route)."""


_ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                 st.text(max_size=300), st.just(""), st.text(max_size=4).map(_Str),
                 st.lists(st.integers(), max_size=2), _texts)


def _result(f: Any, *args: Any, **kw: Any) -> Any:
    try:
        return ("ok", f(*args, **kw))
    except ValidationError as e:
        return ("error", e.field, str(e))


@settings(max_examples=800, deadline=None)
@given(obj=st.dictionaries(st.sampled_from(["id", "key", "x"]), _ANY, max_size=3),
       key=st.sampled_from(["id", "key", "x"]), where=st.sampled_from(["", "data", "source"]),
       required=st.booleans(), max_chars=st.sampled_from([1, 12, 128, 256]))
def test_identifier_equals_the_plain_rules(obj: dict[str, Any], key: str, where: str,
                                           required: bool, max_chars: int) -> None:
    """Any value (absent, None, another type, a str subclass, empty, too long, control
    characters): the same identifier or the same error."""
    assert _result(_identifier, obj, key, where, required=required, max_chars=max_chars) \
        == _result(_identifier_plain, obj, key, where, required=required,
                   max_chars=max_chars)


@settings(max_examples=300, deadline=None)
@given(keys=st.sets(st.sampled_from(["a", "b", "c", "d", "zz", "é"])),
       allowed=st.frozensets(st.sampled_from(["a", "b", "c"])))
def test_check_keys_equals_the_plain_rule(keys: set[str], allowed: frozenset[str]) -> None:
    """Unknown fields are refused, the first of them (sorted) named, as before."""
    obj = dict.fromkeys(keys, 1)
    unknown = sorted(set(obj) - allowed)
    got = _result(_check_keys, obj, allowed, "data")
    if unknown:
        assert got == ("error", f"data.{unknown[0]}", str(ValidationError(
            f"data.{unknown[0]}", f"unknown field; allowed: {', '.join(sorted(allowed))}")))
    else:
        assert got == ("ok", None)


_PLACES = ("tenant", "actor", "idempotency_key", "source.id", "source.event_id",
           "ns.1", "ns.2", "key", "memory_id", "scope", "session_id", "expires_at",
           "source.at", "value.key")


def _event_with(place: str, text: str) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "type": "memory.written", "idempotency_key": "e1", "tenant": "t", "actor": "u",
        "source": {"kind": "explicit_user_request", "id": "c1",
                   "at": "2026-09-01T00:00:00+00:00", "seq": 3},
        "data": {"namespace": ["t", "u", "prefs"], "key": "k", "value": {"v": 1},
                 "layer": "session", "session_id": "s1", "text": "a note"}}
    d = obj["data"]
    if place in ("tenant", "actor", "idempotency_key"):
        obj[place] = text
    elif place.startswith("source."):
        obj["source"][place[7:]] = text
    elif place.startswith("ns."):
        d["namespace"][int(place[3:])] = text
    elif place == "value.key":
        d["value"] = {text: "x"}
    else:
        d[place] = text
    return obj


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(place=st.sampled_from(_PLACES), text=_texts | st.text(max_size=20))
def test_parse_event_equals_the_full_checks_anywhere(place: str, text: str) -> None:
    """R23: a secret (or any text) in any identifier, the source, a namespace part, a
    value's key or a timestamp: `parse_event` gives the event or the error that the
    full checks give (`_check_json`, `_scan_secrets`, then the contract rules)."""
    obj = _event_with(place, text)
    assert _outcome(parse_event, obj) == _outcome(_exact, obj)
