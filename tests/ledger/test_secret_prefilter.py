"""The fast paths of validation (issue 20) decide exactly as the full rules do (R23, R20).

`find_secret_in_text` skips its rules when a loose regex (`_MAY_HOLD_SECRET`, and for
ASCII text `_ROUGH_ASCII` first) finds nothing; `decode_event` skips `_check_json` and
`_scan_secrets` when one walk shows the event plainly clean. Each skip must never
change a verdict: these tests compare the fast path with the full rules on generated
texts and events built from the secret shapes of `test_secrets.py` cut into pieces,
glued to ordinary words, folded characters and JSON escapes.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.errors import ValidationError
from ledger.events import Event
from ledger.secrets import (
    _fold,
    _secret_kind_of_folded,
    find_secret_in_text,
    may_hold_secret,
    secret_key_kind,
)
from ledger.validation import (
    _PLAIN_WORDS,
    _check_json,
    _parse_checked,
    _plainly_clean,
    _scan_secrets,
    decode_event,
    decode_json,
)
from tests.ledger.test_secrets import _ALL_POSITIVE, ORDINARY_TEXTS

_SECRETS = [text for text, _ in _ALL_POSITIVE]
#: Pieces that the rules look for, and characters that folding changes.
_PIECES = [
    "password", "pass", "pw", "pwd", "PIN", "pin", " is ", ": ", "=", "code", "Code is ",
    "verification code ", "OTP", "2fa", "MFA", "token", "Token: ", "api key", "secret ",
    "Bearer ", "sk-", "sk_live_", "AKIA", "ASIA", "AIza", "ghp_", "github_pat_", "xoxb-",
    "eyJ", ".eyJ", "-----BEGIN ", "PRIVATE KEY-----", "://", "user:", "@host", "cvv ",
    "安全码", "密码是", "口令：", "验证码", "密钥：", "令牌：", "4111", "1111", "4111 1111",
    "4111-1111-1111-1111", "4111111111111111", "5500005555555559", "123", "123456",
    "2026-09-01T00:00:00+00:00", "  ", "\t", "-", ".", "/", ",", "_", "４１１１",
    "\u0664\u0661\u0661\u0661", "\u200b", "\u00ad", "\u017fecret", "\u212aey", "Ｐａｓｓｗｏｒｄ",
    "AbCdEf0123456789XyZ", "Hunter2!", "hunter2", "Qm9vZ2llV29vZ2llMTIzNDU2", "shipping",
    "passport", "barcode", "monkey",
]  # fmt: skip
_piece = st.one_of(
    st.sampled_from(_PIECES),
    st.sampled_from(_SECRETS + ORDINARY_TEXTS).flatmap(
        lambda t: st.tuples(st.integers(0, len(t)), st.integers(0, len(t))).map(
            lambda ij: t[min(ij):max(ij)])),
    st.text(max_size=6),
)
_texts = st.lists(_piece, max_size=8).map("".join).filter(lambda t: "\x00" not in t)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_texts)
def test_prefilter_never_hides_a_rule_match(text: str) -> None:
    """R23: where the prefilter skips the rules, the rules would have found nothing."""
    assert find_secret_in_text(text) == _secret_kind_of_folded(_fold(text))


@settings(max_examples=500, deadline=None)
@given(texts=st.lists(_texts, max_size=6))
def test_one_pass_over_joined_strings_misses_none(texts: list[str]) -> None:
    """R23: one regex pass over several strings is "maybe" whenever any string holds a
    secret by the full rules."""
    if any(_secret_kind_of_folded(_fold(t)) is not None for t in texts):
        assert may_hold_secret(texts)


@pytest.mark.parametrize(("text", "kind"), _ALL_POSITIVE)
def test_every_known_secret_passes_the_prefilter(text: str, kind: str) -> None:
    """R23: every secret shape of the positive cases reaches the rules."""
    assert may_hold_secret([text])
    assert may_hold_secret(["ordinary words", text, "more"])


def test_field_names_and_fixed_values_hold_nothing() -> None:
    """The words `_plainly_clean` does not search are secret-free, NUL-free ASCII."""
    for word in _PLAIN_WORDS:
        assert word.isascii() and "\x00" not in word
        assert find_secret_in_text(word) is None
        assert _secret_kind_of_folded(_fold(word)) is None
        assert secret_key_kind(word) is None


def _valid_event(text: str, key_text: str, value: object) -> dict[str, object]:
    return {
        "type": "memory.written", "idempotency_key": "e1", "tenant": "t", "actor": "u",
        "source": {"kind": "explicit_user_request", "id": "c1",
                   "at": "2026-09-01T00:00:00+00:00"},
        "data": {"namespace": ["t", "u", "prefs"], "key": "k", "text": text,
                 "value": {key_text: value, "note": text}},
    }  # fmt: skip


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 64), 1 << 64), st.floats(), _texts)
_values = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_texts, kids, max_size=3),
    max_leaves=8,
)


def _outcome(f: object, *args: object) -> str:
    try:
        got = f(*args)  # type: ignore[operator]
    except ValidationError as e:
        return f"error: {e}"
    return repr(got) if not isinstance(got, Event) else repr(got.to_wire())


def _exact(obj: object) -> Event:
    """parse_event without its fast path."""
    assert isinstance(obj, dict)
    _check_json(obj)
    _scan_secrets(obj)
    return _parse_checked(obj)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_texts, key_text=_texts, value=_values)
def test_plainly_clean_means_the_full_checks_pass(text: str, key_text: str,
                                                  value: object) -> None:
    """R20, R23: an event `_plainly_clean` accepts passes `_check_json` and
    `_scan_secrets`, and `decode_event` gives what the full checks give."""
    obj = _valid_event(text, key_text, value)
    if _plainly_clean(obj):
        _check_json(obj)
        _scan_secrets(obj)
    try:
        line = orjson.dumps(obj)
    except (TypeError, orjson.JSONEncodeError):
        return  # not JSON text (a lone surrogate, a 65-bit integer): nothing to decode
    assert _outcome(decode_event, line) == _outcome(lambda b: _exact(decode_json(b)), line)


@pytest.mark.parametrize("line", [
    # escaped JSON inside a string is not a key: the fast route still sees a repeated key
    b'{"type":"memory.written","type":"task.opened","data":{"text":"a \\"b\\": 1"}}',
    b'{"data":{"text":"k\\\\","text":"x"}}',
    b'{"data":{"k\\\\":1,"k\\\\":2}}',
])
def test_repeated_keys_are_refused_beside_escaped_quotes(line: bytes) -> None:
    """R20: a key repeated in one object is refused however its quotes are escaped."""
    with pytest.raises(ValidationError, match="duplicate key"):
        decode_event(line)
