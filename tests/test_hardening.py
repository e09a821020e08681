"""Hostile input never stops the ledger (issue 15, findings 1 (validation), 3 and 4).

Validation refuses what a view cannot hold (out-of-range timestamps, NUL, integers
beyond 64 bits: R20), every string of an event is scanned for secrets (R23), and bad
lines given to `memledger append` or `publish` are rejected one by one with a message,
never a traceback, while the other lines go on; `project` and `replay verify` then pass.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.errors import ValidationError
from ledger.secrets import find_secret_in_text
from ledger.validation import decode_event, parse_event
from tests.cli import Cli
from tests.factories import event, src, write

CARD = "4111 1111 1111 1111"


def reject(obj: Any) -> ValidationError:
    with pytest.raises(ValidationError) as e:
        parse_event(obj)
    return e.value


def reject_line(line: bytes) -> ValidationError:
    with pytest.raises(ValidationError) as e:
        decode_event(line)
    return e.value


# -- finding 1: what a view cannot hold --------------------------------------------------

OVERFLOWING = ["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59",
               "9999-12-31T23:30:00-01:00"]


def _with_timestamp(where: str, at: str) -> dict[str, Any]:
    if where == "source.at":
        return write("k", 1, source=src(at=at))
    if where == "data.expires_at":
        return write("k", 1, expires_at=at)
    return event("task.closed", {"task_key": "T1", "retain_until": at}, actor="ops",
                 source=src("operator", "ops"))


@pytest.mark.parametrize("at", OVERFLOWING)
@pytest.mark.parametrize("where", ["source.at", "data.expires_at", "data.retain_until"])
def test_timestamps_outside_the_representable_range_are_refused(where: str, at: str) -> None:
    """Finding 1 (R20): a timestamp whose UTC value leaves year 1..9999 is refused, the
    message naming the field (before: accepted, then every projection failed with
    OverflowError, and `source.at` gave a traceback)."""
    err = reject(_with_timestamp(where, at))
    assert err.field == where and "outside" in err.message


@pytest.mark.parametrize("at", ["9999-12-31T23:59:59Z", "0001-01-01T00:00:00Z",
                                "9999-12-31T23:59:59+23:59", "0001-01-01T00:00:00-23:59"])
def test_timestamps_at_the_ends_of_the_range_are_kept(at: str) -> None:
    """Finding 1: the extreme values that stay inside the range once in UTC are valid."""
    assert parse_event(_with_timestamp("data.expires_at", at)).data["expires_at"] == at


NUL_PLACES: list[tuple[str, Any]] = [
    ("data.value", write("k", "a\x00b")),
    ("data.value", write("k", {"nested": ["x\x00"]})),
    ("data.value", write("k", {"key\x00": 1})),
    ("data.text", write("k", 1, text="line\x00")),
    ("data.title", event("task.opened", {"task_key": "T1", "namespace": ["shop-a", "u7", "t"],
                                         "title": "t\x00"})),
    ("data.refs", event("task.opened", {"task_key": "T1", "namespace": ["shop-a", "u7", "t"],
                                        "refs": {"o\x00": "A1"}})),
    ("data.reason", event("task.purged", {"task_key": "T1", "reason": "r\x00"}, actor="ops",
                          source=src("operator", "ops"))),
]


@pytest.mark.parametrize(("field", "obj"), NUL_PLACES)
def test_nul_is_refused_in_every_string_and_key(field: str, obj: dict[str, Any]) -> None:
    """Finding 1 (R20): NUL in any string of an event, object keys included, is refused
    on both backends alike, naming the field (before: accepted, then PostgreSQL's
    projection failed for ever on `invalid byte sequence 0x00`)."""
    err = reject(obj)
    assert err.field == field and "NUL" in err.message


def test_out_of_range_and_nul_lines_never_stop_the_cli(db_url: str, tmp_path: Any) -> None:
    """Findings 1 and 4: `memledger append` rejects an overflowing `source.at`, an
    overflowing `expires_at`, NUL, a duplicate key and a 2**64 integer line by line,
    appends the rest, and `project` and `replay verify` pass on both backends (before:
    a traceback stopped the file at the first, or the views failed for ever)."""
    cli = Cli(db_url, str(tmp_path / "l.forgets"))
    good = [write(f"k{i}", f"v{i}", idem=f"ok-{i}") for i in range(3)]
    bad = [orjson.dumps(write("a", 1, source=src(at=OVERFLOWING[0]))),
           orjson.dumps(write("b", 1, expires_at=OVERFLOWING[1])),
           orjson.dumps(write("c", "x\x00y")),
           orjson.dumps(write("d", 1, idem="dup")).replace(
               b'"idempotency_key":"dup"', b'"idempotency_key":"dup","idempotency_key":"d2"'),
           orjson.dumps(write("e", 1)).replace(b'"value":1', b'"value":18446744073709551616')]
    lines = [orjson.dumps(good[0]), *bad[:3], orjson.dumps(good[1]), *bad[3:],
             orjson.dumps(good[2])]
    proc = cli.run("append", "-", stdin=b"\n".join(lines) + b"\n", check=1)
    assert b"Traceback" not in proc.stderr
    out = [orjson.loads(x) for x in proc.stdout.splitlines()]
    assert [o["status"] for o in out] == ["appended", *["rejected"] * 3, "appended",
                                          *["rejected"] * 2, "appended"]
    assert all(o["error"] for o in out if o["status"] == "rejected")
    cli.run("project")
    assert cli.json("replay", "verify")["ok"]
    assert cli.json("get", "--as", "shop-a/u7", "--namespace", "shop-a/u7/preferences",
                    "--key", "k2")["value"] == "v2"


# -- finding 4: duplicate keys, big integers ---------------------------------------------

def test_duplicate_keys_are_refused_at_any_depth() -> None:
    """Finding 4: a key repeated in one object (the idempotency key, or deep in a value)
    is refused instead of the last one silently winning."""
    line = orjson.dumps(write("k", {"a": 1}, idem="k1"))
    top = line.replace(b'"idempotency_key":"k1"', b'"idempotency_key":"k1","idempotency_key":"k2"')
    assert "duplicate key: 'idempotency_key'" in str(reject_line(top))
    deep = line.replace(b'{"a":1}', b'{"a":1,"a":2}')
    err = str(reject_line(deep))
    assert "duplicate key" in err and "'a'" not in err  # an unknown key is not echoed
    # A `":` inside a string is not a key: the exact check runs and finds none.
    assert decode_event(line.replace(b'{"a":1}', b'"he said \\": yes"')).data["value"] == \
        'he said ": yes'


@pytest.mark.parametrize("number", [2**64, 2**64 + 1, 10**30, -(2**63) - 1])
def test_integers_beyond_64_bits_are_refused(number: int) -> None:
    """Finding 4: integers outside -2**63..2**64-1 are refused, as text (orjson would read
    2**64 as a rounded float) and as Python values, never stored changed."""
    line = orjson.dumps(write("k", 1)).replace(b'"value":1', f'"value":{number}'.encode())
    assert "integers must be within" in str(reject_line(line))
    assert "integers must be within" in str(reject(write("k", number)))


@pytest.mark.parametrize("number", [2**64 - 1, 2**63, -(2**63), 1234567890123456789])
def test_integers_within_64_bits_are_kept_exactly(number: int) -> None:
    """Finding 4: the largest and smallest 64-bit integers round-trip exactly."""
    line = orjson.dumps(write("k", number))
    assert decode_event(line).data["value"] == number


# -- finding 3: secrets in every field, the formats missed -------------------------------

def _places() -> list[tuple[str, dict[str, Any]]]:
    def w(**kw: Any) -> dict[str, Any]:
        return write("k", 1, **kw)

    opened = {"task_key": "T1", "namespace": ["shop-a", "u7", "tickets"]}
    out: list[tuple[str, dict[str, Any]]] = [
        ("data.namespace[2]", write("k", 1, ns=["shop-a", "u7", CARD])),
        ("data.scope", w(scope=CARD)),
        ("data.session_id", write("k", 1, layer="session", session_id=CARD)),
        ("data.task_key", write("k", 1, layer="task", task_key=CARD)),
        ("data.memory_id", w(memory_id=CARD)),
        ("idempotency_key", write("k", 1, idem=CARD)),
        ("source.id", write("k", 1, source=src(sid=CARD))),
        ("source.event_id", write("k", 1, source={**src(), "event_id": CARD})),
        ("data.supersedes", write("k", 1, etype="memory.corrected", supersedes=CARD)),
        ("actor", write("k", 1, actor=CARD)),
        ("data.reason", event("task.purged", {"task_key": "T1", "reason": CARD},
                              actor="ops", source=src("operator", "ops"))),
        ("data.refs.order", event("task.opened", {**opened, "refs": {"order": CARD}})),
        ("data.fields.note", event("task.noted", {"task_key": "T1", "kind": "todo",
                                                  "text": "x", "fields": {"note": CARD}})),
        ("data.title", event("task.opened", {**opened, "title": CARD})),
        ("source.seq", write("k", 1, source=src(seq=4111111111111111))),
    ]
    return out


@pytest.mark.parametrize(("field", "obj"), _places(), ids=[p for p, _ in _places()])
def test_every_string_field_is_scanned_for_secrets(field: str, obj: dict[str, Any]) -> None:
    """Finding 3 (R23): a card number in any identifier or text of an event (they
    survive a forget) is refused, naming the field and never the value (before: only
    value, key, text, titles, reasons, refs and fields were scanned)."""
    err = reject(obj)
    assert err.field == field and "R23" in err.message
    assert "4111" not in str(err)


MISSED = [
    ("card 4111.1111.1111.1111", "payment_card"),
    ("card 4111_1111_1111_1111", "payment_card"),
    ("card 4111/1111/1111/1111", "payment_card"),
    ("card 4111,1111,1111,1111", "payment_card"),
    ("card 4111  1111  1111  1111", "payment_card"),
    ("card 4111\u200b1111\u200b1111\u200b1111", "payment_card"),
    ("card \u0664\u0661\u0661\u0661\u0661\u0661\u0661\u0661\u0661\u0661\u0661\u0661"
     "\u0661\u0661\u0661\u0661", "payment_card"),
    ("card \u096a\u0967\u0967\u0967 \u0967\u0967\u0967\u0967 \u0967\u0967\u0967\u0967 "
     "\u0967\u0967\u0967\u0967", "payment_card"),
    ("aws_secret_access_key=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "api_key"),
    ("pw: Hunter2!", "password"),
    ("db is postgres://admin:S3cret@db.internal:5432/app", "password"),
    ("482193 is your login code", "one_time_code"),
    ("G-482193 is your Google verification code", "one_time_code"),
]


@pytest.mark.parametrize(("text", "kind"), MISSED)
def test_formats_missed_before_are_caught(text: str, kind: str) -> None:
    """Finding 3 (R23): separators other than space and dash, double and zero-width
    spaces, Arabic-Indic and Devanagari digits, AWS secret keys, `pw:`, passwords in
    URLs and code-first one-time-code messages are refused."""
    err = reject(write("k", text))
    assert err.field == "data.value" and "R23" in err.message
    assert find_secret_in_text(text) == kind


def test_secret_named_keys_and_key_value_pairs_are_caught() -> None:
    """Finding 3 (R23): a key like `user_pass` holding a value, and a memory whose key
    and value read together state a password, are refused."""
    assert reject(write("k", {"user_pass": "x1"})).field == "data.value.user_pass"
    assert reject(write("pw", "Hunter2!")).field == "data.value"


ORDINARY = ["order A123 shipped", "ticket T-4411", "2026.09.20", "2026/09/20 10:30",
            "version 1.2.3.4", "pi is 3.14159265358979", "1,000,000 users",
            "482193 is your booking code", "see https://docs.example.com/a:b",
            "postgres://db.internal:5432/app", "call 138 0013 8000",
            "passport renewal due", "bypass the cache"]


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_identifiers_stay_quiet(text: str) -> None:
    """Finding 3 (R23): order numbers, ticket ids, dates with dots or slashes, versions,
    decimals, URLs without a password and booking codes are not secrets."""
    ev = parse_event(write("note", text, idem="o1", source=src(sid="T-4411")))
    assert ev.data["value"] == text


# -- arbitrary lines: never a traceback ---------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
    st.sampled_from(["\x00", "a\x00b", "9999-12-31T23:59:59-23:59", CARD,
                     "0001-01-01T00:00:00+23:59", "2026-09-20T10:00:00+08:00"]))
_json = st.recursive(_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=20)


def _dumps(obj: Any) -> bytes:
    """JSON of any value (integers of any size too, which orjson cannot write)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _deep(n: int) -> bytes:
    return b'{"a":' * n + b"1" + b"}" * n


@st.composite
def _lines(draw: st.DrawFn) -> bytes:
    base = write(f"k{draw(st.integers(0, 5))}", draw(_json),
                 idem=f"h-{draw(st.integers(0, 10**6))}")
    how = draw(st.sampled_from(["valid", "mutate", "raw", "dup", "number", "deep",
                                "surrogate", "timestamp"]))
    if how == "valid":
        base["data"]["value"] = draw(st.text(alphabet="abc xyz", max_size=12))
        return _dumps(base)
    if how == "mutate":
        obj = copy.deepcopy(base)
        where = draw(st.sampled_from(["source", "data", ""]))
        target = obj if not where else obj[where]
        target[draw(st.sampled_from(["at", "kind", "seq", "namespace", "value", "type",
                                     "expires_at", "tenant", "key", "x"]))] = draw(_json)
        return _dumps(obj)
    if how == "raw":
        return b"x" + draw(st.binary(max_size=60)).replace(b"\n", b" ").replace(b"\r", b" ")
    if how == "dup":
        return _dumps(base).replace(b'"key":', b'"key":"x","key":', 1)
    if how == "number":
        num = draw(st.sampled_from([b"1e400", b"-0", b"18446744073709551616", b"1e-400",
                                    b"9223372036854775808", b"123456789012345678901234"]))
        return _dumps(write("n", 1)).replace(b'"value":1', b'"value":' + num)
    if how == "deep":
        return _dumps(write("d", 1)).replace(
            b'"value":1', b'"value":' + _deep(draw(st.integers(60, 300))))
    if how == "surrogate":
        return _dumps(write("s", 1)).replace(b'"value":1', b'"value":"\\ud800x"')
    at = draw(st.sampled_from(["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59",
                               "2026-02-30T00:00:00Z", "2026-01-01T25:00:00Z",
                               "2026-01-01T00:00:00+24:00", "2026-01-01T00:00:00.1234567891Z"]))
    return _dumps(write("t", 1, source=src(at=at)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_lines())
def test_any_line_is_an_event_or_a_validation_error(line: bytes) -> None:
    """Findings 1 and 4: whatever a line holds (deep, huge, odd numbers, odd timestamps,
    NUL, surrogates, duplicate keys), decoding gives an event or a `ValidationError`,
    and an accepted event encodes and decodes back to itself."""
    try:
        ev = decode_event(line)
    except ValidationError as e:
        message = str(e)
    else:
        assert decode_event(ev.encode()).encode() == ev.encode()
        return
    assert message


@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(_lines(), min_size=5, max_size=25))
def test_cli_append_and_publish_take_any_lines(db_url: str, tmp_path: Any, redis_db: str,
                                               lines: list[bytes]) -> None:
    """Findings 1 and 4: `memledger append` and `memledger publish` answer each of any
    lines with appended/published or rejected plus a message, never a traceback; then
    `project` and `replay verify` succeed."""
    cli = Cli(db_url, str(tmp_path / "h.forgets"), env={"MEMLEDGER_REDIS_URL": redis_db})
    data = b"\n".join([*lines, orjson.dumps(write("z", "ok", idem="always-valid"))]) + b"\n"
    for command in ("append", "publish"):
        proc = cli.run(command, "-", stdin=data, check=None)
        assert proc.returncode in (0, 1) and b"Traceback" not in proc.stderr, proc.stderr
        out = [orjson.loads(x) for x in proc.stdout.splitlines()]
        assert len(out) == len(lines) + 1
        for o in out:
            assert o["status"] != "rejected" or o["error"]
    cli.run("project")
    assert cli.json("replay", "verify")["ok"]
