"""Parse wire objects into `Event` values, enforcing every rule of the contract.

Every rejection raises `ValidationError` naming the field and the rule, so an app
(or an operator reading `memledger append` output) knows what to change. Secrets
are reported by kind and place, never echoed (R23).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Final

import orjson

from ledger.errors import ValidationError
from ledger.events import (
    CANDIDATE_KINDS,
    EVENT_TYPES,
    LAYERS,
    MEMORY_WRITES,
    NOTE_KINDS,
    SOURCE_KINDS,
    UNTRUSTED_KINDS,
    USER_KINDS,
    Event,
    Source,
    derive_memory_id,
    encode_json,
    parse_rfc3339,
    to_us,
)
from ledger.secrets import (
    SecretFinding,
    find_secret_in_text,
    find_secrets,
    may_hold_secret,
    secret_key_kind,
)

#: Derived memory ids (`derive_memory_id`) have this form and no explicit id may take it,
#: so a derived id is unique exactly when its idempotency key is.
DERIVED_ID: Final = re.compile(r"^m_[0-9a-f]{24}$")
MAX_VALUE_BYTES: Final = 16 * 1024
MAX_TEXT_CHARS: Final = 16 * 1024
MAX_ID_CHARS: Final = 256
MAX_NS_PART_CHARS: Final = 128
MAX_REFS: Final = 32
MAX_SEQ: Final = (1 << 63) - 1
#: Integers anywhere in an event must lie in -2**63..2**64-1, what orjson reads and
#: writes exactly: it reads larger ones as floats (silently rounded).
MIN_INT: Final = -(1 << 63)
MAX_INT: Final = (1 << 64) - 1
#: Nesting depth of a whole event (orjson cannot encode deeper than 254 levels).
MAX_DEPTH: Final = 64
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
_RFC3339_SHAPE: Final = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$")

_ENVELOPE_KEYS: Final = frozenset(
    {"type", "idempotency_key", "tenant", "actor", "source", "data", "expected_version"}
)
_SOURCE_KEYS: Final = frozenset({"kind", "id", "at", "seq", "event_id"})
_DATA_KEYS: Final[dict[str, frozenset[str]]] = {
    "memory.written": frozenset(
        {"namespace", "key", "value", "layer", "task_key", "session_id", "memory_id",
         "scope", "supersedes", "expires_at", "text"}
    ),
    "memory.superseded": frozenset({"memory_id", "superseded_by"}),
    "memory.confirmed": frozenset({"memory_id"}),
    "memory.forgotten": frozenset({"memory_id", "namespace", "key", "namespace_prefix", "reason"}),
    "task.opened": frozenset({"task_key", "namespace", "refs", "title"}),
    "task.noted": frozenset({"task_key", "kind", "text", "fields"}),
    "task.closed": frozenset({"task_key", "resolution", "retain_until"}),
    "task.purged": frozenset({"task_key", "reason"}),
}
_DATA_KEYS["memory.corrected"] = _DATA_KEYS["memory.written"]

#: Who may forget: the user (explicitly or by saying so), an operator, the system of
#: record. A model's inference or text inside tool output never deletes (R9).
_FORGET_KINDS: Final = frozenset(
    {"explicit_user_request", "user_statement", "operator", "system_of_record"}
)
_PURGE_KINDS: Final = frozenset({"operator", "system_of_record"})


def _fail(field: str, rule: str) -> ValidationError:
    return ValidationError(field, rule)


def _identifier(obj: dict[str, Any], key: str, where: str, *, required: bool = True,
                max_chars: int = MAX_ID_CHARS) -> str | None:
    """A non-empty string without control characters."""
    v = obj.get(key)
    if type(v) is str and v and len(v) <= max_chars and _CONTROL.search(v) is None:
        return v  # the common cases: no field name to build
    if v is None and not required:
        return None
    field = f"{where}.{key}" if where else key
    if v is None:
        raise _fail(field, "is required")
    if not isinstance(v, str):
        raise _fail(field, f"must be a string, got {type(v).__name__}")
    if not v:
        raise _fail(field, "must not be empty")
    if len(v) > max_chars:
        raise _fail(field, f"must be at most {max_chars} characters, got {len(v)}")
    if _CONTROL.search(v):
        raise _fail(field, "must not contain control characters")
    return v


def _text(obj: dict[str, Any], key: str, where: str, *, required: bool,
          max_chars: int = MAX_TEXT_CHARS) -> str | None:
    field = f"{where}.{key}"
    if key not in obj or obj[key] is None:
        if required:
            raise _fail(field, "is required")
        return None
    v = obj[key]
    if not isinstance(v, str):
        raise _fail(field, f"must be a string, got {type(v).__name__}")
    if required and not v.strip():
        raise _fail(field, "must not be empty")
    if len(v) > max_chars:
        raise _fail(field, f"must be at most {max_chars} characters, got {len(v)}")
    return v


def _timestamp(obj: dict[str, Any], key: str, where: str, *, required: bool) -> str | None:
    got = _moment(obj, key, where, required=required)
    return None if got is None else got[0]


def _moment(obj: dict[str, Any], key: str, where: str, *, required: bool
            ) -> tuple[str, datetime] | None:
    """`_timestamp`'s checks; the text and the moment it names (parsed once)."""
    field = f"{where}.{key}"
    if key not in obj or obj[key] is None:
        if required:
            raise _fail(field, "is required")
        return None
    v = obj[key]
    if not isinstance(v, str):
        raise _fail(field, "must be an RFC 3339 timestamp string with offset")
    if not _RFC3339_SHAPE.match(v):
        raise _fail(
            field, "is not an RFC 3339 timestamp with offset "
            "(e.g. 2026-09-20T10:00:00+08:00)"
        )
    try:
        return v, parse_rfc3339(v)
    except ValueError as e:
        raise _fail(field, f"is not a valid timestamp: {e}") from None


def _namespace(obj: dict[str, Any], key: str, tenant: str, *, min_len: int = 2) -> list[str]:
    field = f"data.{key}"
    v = obj.get(key)
    if not isinstance(v, list):
        raise _fail(field, f"must be an array of {min_len}..8 non-empty strings")
    if not min_len <= len(v) <= 8:
        raise _fail(field, f"must have {min_len}..8 parts, got {len(v)}")
    for i, part in enumerate(v):
        if not isinstance(part, str) or not part:
            raise _fail(f"{field}[{i}]", "must be a non-empty string")
        if len(part) > MAX_NS_PART_CHARS:
            raise _fail(f"{field}[{i}]", f"must be at most {MAX_NS_PART_CHARS} characters")
        if "/" in part or _CONTROL.search(part):
            raise _fail(f"{field}[{i}]", "must not contain '/' or control characters")
    if v[0] != tenant:
        # The part itself is not echoed: namespace parts may hold what the user typed.
        raise _fail(f"{field}[0]", f"must equal the event's tenant {tenant!r}")
    return list(v)


def _no_secrets(value: Any, path: str) -> None:
    findings = find_secrets(value, path)
    if findings:
        raise _fail(findings[0].path, findings[0].describe())


def _check_keys(obj: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    if allowed.issuperset(obj):
        return
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise _fail(f"{where}.{unknown[0]}" if where else unknown[0],
                    f"unknown field; allowed: {', '.join(sorted(allowed))}")


def _owner_check(kind: str, actor: str, ns: list[str], field: str) -> None:
    if kind in USER_KINDS and ns[1] != actor:
        raise _fail(
            f"{field}[1]",
            f"must equal actor {actor!r}: a {kind} event writes only the "
            "actor's own namespace (operator and system_of_record may write on a "
            "user's behalf)",
        )


#: Field names that a message may repeat (any other key could hold anything, a secret
#: included, so it is never echoed).
_KNOWN_NAMES: Final = frozenset().union(_ENVELOPE_KEYS, _SOURCE_KEYS, *_DATA_KEYS.values())


def _field_path(path: tuple[str, ...]) -> str:
    """A message's name for a place in an event: known field names, at most two deep."""
    out = ""
    for depth, part in enumerate(path[:2]):
        name = part if part in _KNOWN_NAMES else "<field>"
        out = f"{out}.{name}" if depth else name
        if name == "<field>":
            break
    return out


def _check_json(obj: object) -> None:
    """Refuse what no backend stores as given (R20): NUL and lone surrogates in any string
    (object keys included), integers outside 64 bits, non-finite floats, non-JSON types
    and nesting deeper than `MAX_DEPTH`.

    PostgreSQL text cannot hold NUL and SQLite's `->>` stops at it, so NUL is refused on
    both backends alike rather than stored on one and cut on the other.
    """
    stack: list[tuple[object, tuple[str, ...]]] = [(obj, ())]
    while stack:
        v, path = stack.pop()
        kind = type(v)
        if kind not in _JSON_TYPES:  # a subclass (an IntEnum, an OrderedDict, a tuple)
            kind = next((c for c in _JSON_TYPES if isinstance(v, c)), kind)
        if kind is str:
            _check_string(v, path, "a string")  # type: ignore[arg-type]
        elif kind is dict:
            if len(path) >= MAX_DEPTH:
                raise _fail(_field_path(path), f"nests deeper than {MAX_DEPTH} levels")
            for k, child in v.items():  # type: ignore[attr-defined]
                if type(k) is not str:
                    raise _fail(_field_path(path), "object keys must be strings")
                _check_string(k, path, "an object key")
                stack.append((child, (*path, k)))
        elif kind is list or kind is tuple:
            if len(path) >= MAX_DEPTH:
                raise _fail(_field_path(path), f"nests deeper than {MAX_DEPTH} levels")
            stack.extend((child, (*path, "[]")) for child in v)  # type: ignore[attr-defined]
        elif kind is bool or v is None:
            continue
        elif kind is int:
            if not MIN_INT <= v <= MAX_INT:  # type: ignore[operator]
                raise _fail(_field_path(path), "integers must be within -2**63..2**64-1; "
                            "send a larger number as a string")
        elif kind is float:
            if v != v or v in (float("inf"), float("-inf")):
                raise _fail(_field_path(path), "numbers must be finite")
        else:
            raise _fail(_field_path(path), f"{kind.__name__} is not a JSON value")


def _check_string(v: str, path: tuple[str, ...], what: str) -> None:
    if "\x00" in v:
        raise _fail(_field_path(path), f"{what} contains NUL (\\u0000), which no backend "
                    "stores; remove it")
    if not v.isascii() and _SURROGATE.search(v):
        raise _fail(_field_path(path), f"{what} contains a lone UTF-16 surrogate, which is "
                    "not valid Unicode text")


_JSON_TYPES: Final = (bool, str, dict, list, tuple, int, float)
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


#: Values from the contract's fixed lists (types, kinds, layers): never a secret.
_VOCABULARY: Final = frozenset((*EVENT_TYPES, *SOURCE_KINDS, *LAYERS, *NOTE_KINDS))


def _scan_secrets(obj: dict[str, Any]) -> None:
    """Scan every string and number of an event for secrets (R23), envelope, source and
    data alike, before any rule that might repeat a value in its message: identifiers
    survive a forget, so a card number in a `task_key` would stay on disk.

    A known field's name is not scanned (it is the contract's), an unknown one is.
    """
    for k, v in obj.items():
        if k in ("source", "data") and isinstance(v, dict):
            for k2, v2 in v.items():
                _scan_member(k2, v2, k)
        else:
            _scan_member(k, v, "")


def _scan_member(key: str, value: Any, where: str) -> None:
    if key not in _KNOWN_NAMES:
        _no_secrets({key: value}, where)
    elif not (isinstance(value, str) and (
            value in _VOCABULARY or (key in _TIMESTAMP_KEYS and _RFC3339_SHAPE.match(value)))):
        _no_secrets(value, f"{where}.{key}" if where else key)


_TIMESTAMP_KEYS: Final = frozenset({"at", "expires_at", "retain_until"})
#: Integers below this magnitude are never card numbers (`_scalar_kind` looks at 13..19
#: digits) and lie within 64 bits.
_SMALL_INT: Final = 10**12
_INFINITIES: Final = (float("inf"), float("-inf"))
#: Field names and the contract's fixed values: none holds a secret, NUL or a surrogate
#: (`tests/ledger/test_secrets.py` checks), so `_plainly_clean` need not search them.
_PLAIN_WORDS: Final = _KNOWN_NAMES | _VOCABULARY


def _plainly_clean(obj: dict[str, Any]) -> bool:
    """True when one walk and one regex pass show that `_check_json` and `_scan_secrets`
    would both accept `obj`; False means "not shown": they run and decide (and word the
    error). What makes it False: anything `_check_json` refuses, a type other than the
    plain JSON ones, an integer of 13+ digits, a key that names a secret, or any string
    (keys included) in which `may_hold_secret` sees a possible secret. Every string of
    the event is searched but field names and fixed values (`_PLAIN_WORDS`), a superset
    of what `_scan_secrets` scans, so a secret is never skipped (R23).
    """
    return _walk(obj) >= 0


def _walk(obj: dict[str, Any]) -> int:
    """`_plainly_clean`'s walk; returns the number of object members at every depth
    (what `decode_event` compares with the keys in the text), or -1 when not clean."""
    strings: list[str] = []
    try:
        members = _collect(obj, 0, strings.append)
    except _NotPlain:
        return -1
    joined = "".join(strings)
    if "\x00" in joined or (not joined.isascii() and _SURROGATE.search(joined)):
        return -1
    return -1 if may_hold_secret(strings) else members


class _NotPlain(Exception):
    """`_collect` met something only the full checks may judge."""


def _collect(v: dict[str, Any] | list[Any], depth: int, add: Callable[[str], None]) -> int:
    """Add the strings of a container to `add` (but `_PLAIN_WORDS`) and count its object
    members; raise `_NotPlain` at whatever `_plainly_clean` leaves to the full checks.
    Recursion is bounded: deeper than `MAX_DEPTH` is not plain."""
    if depth >= MAX_DEPTH:
        raise _NotPlain
    members = 0
    children: Iterable[Any]
    child: Any
    if type(v) is dict:
        members = len(v)
        for k in v:
            # a field name names no secret (`_PLAIN_WORDS`, checked by a test)
            if k in _PLAIN_WORDS and type(k) is str:
                continue
            if type(k) is not str or secret_key_kind(k) is not None:
                raise _NotPlain
            add(k)
        children = v.values()
    else:
        children = v
    for child in children:
        kind = type(child)
        if kind is str:
            if child not in _PLAIN_WORDS:
                add(child)
        elif kind is dict or kind is list:
            members += _collect(child, depth + 1, add)
        elif kind is int:
            if not -_SMALL_INT < child < _SMALL_INT:
                raise _NotPlain
        elif kind is float:
            if child != child or child in _INFINITIES:
                raise _NotPlain
        elif not (child is None or kind is bool):
            raise _NotPlain
    return members


def parse_event(obj: object) -> Event:
    """Validate a decoded wire object and return the normalised `Event`."""
    if not isinstance(obj, dict):
        raise _fail("", f"an event must be a JSON object, got {type(obj).__name__}")
    if not _plainly_clean(obj):
        _check_json(obj)
        _scan_secrets(obj)
    return _parse_checked(obj)


def _parse_checked(obj: dict[str, Any]) -> Event:
    """`parse_event` after `_check_json` and `_scan_secrets` (or `_plainly_clean`)."""
    _check_keys(obj, _ENVELOPE_KEYS, "")
    etype = obj.get("type")
    if etype not in EVENT_TYPES:
        raise _fail("type", f"must be one of {', '.join(EVENT_TYPES)}, got {str(etype)[:40]!r}")
    key = _identifier(obj, "idempotency_key", "")
    tenant = _identifier(obj, "tenant", "", max_chars=MAX_NS_PART_CHARS)
    actor = _identifier(obj, "actor", "")
    assert key is not None and tenant is not None and actor is not None
    if "/" in tenant:
        raise _fail("tenant", "must not contain '/'")
    expected = obj.get("expected_version")
    if expected is not None and (
        isinstance(expected, bool) or not isinstance(expected, int)
        or not 0 <= expected <= MAX_SEQ
    ):
        raise _fail("expected_version", "must be an integer >= 0")
    source = _parse_source(obj.get("source"))
    data_obj = obj.get("data")
    if not isinstance(data_obj, dict):
        raise _fail("data", "must be a JSON object")
    _check_keys(data_obj, _DATA_KEYS[etype], "data")
    data = _PARSERS[etype](dict(data_obj), tenant, actor, source, key)
    ev = Event(etype, key, tenant, actor, source, data, expected)
    if etype in MEMORY_WRITES and data_obj.get("memory_id") is None:
        # derived here: the appender need not hash it again to know (`derived_id`)
        ev._memo["derived"] = data["memory_id"]
    return ev


def _parse_source(src: object) -> Source:
    if not isinstance(src, dict):
        raise _fail("source", "must be an object with kind, id and at")
    _check_keys(src, _SOURCE_KEYS, "source")
    kind = src.get("kind")
    if kind not in SOURCE_KINDS:
        raise _fail("source.kind", f"must be one of {', '.join(SOURCE_KINDS)}")
    sid = _identifier(src, "id", "source")
    got = _moment(src, "at", "source", required=True)
    assert sid is not None and got is not None
    at, moment = got
    seq = src.get("seq")
    if seq is not None and (
        isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ
    ):
        raise _fail("source.seq", "must be an integer >= 0")
    event_id = _identifier(src, "event_id", "source", required=False)
    return Source(str(kind), sid, at, seq, event_id, to_us(moment))


def _default_text(key: str, value: Any) -> str:
    shown = value if isinstance(value, str) else encode_json(value).decode()
    return f"{key}: {shown}"


def _memory_write(d: dict[str, Any], tenant: str, actor: str, source: Source,
                  idem: str, *, corrected: bool) -> dict[str, Any]:
    ns = _namespace(d, "namespace", tenant)
    key = _identifier(d, "key", "data")
    assert key is not None
    if "value" not in d:
        raise _fail("data.value", "is required (any JSON value)")
    value = d["value"]
    size = len(encode_json(value))
    if size > MAX_VALUE_BYTES:
        raise _fail("data.value", f"must be at most {MAX_VALUE_BYTES} bytes encoded, got {size}")
    layer = d.get("layer", "long")
    if layer not in LAYERS:
        raise _fail("data.layer", f"must be one of {', '.join(LAYERS)}")
    task_key = _identifier(d, "task_key", "data", required=layer == "task")
    session_id = _identifier(d, "session_id", "data", required=layer == "session")
    if layer != "task" and task_key is not None:
        raise _fail("data.task_key", "is allowed only with layer 'task'")
    if layer != "session" and session_id is not None:
        raise _fail("data.session_id", "is allowed only with layer 'session'")
    if source.kind in UNTRUSTED_KINDS and layer != "session":
        raise _fail(
            "source.kind",
            f"{source.kind} may not write {layer}-layer memories: text inside tool output "
            "or retrieved documents never authorises a memory write (R9)",
        )
    _owner_check(source.kind, actor, ns, "data.namespace")
    memory_id = _identifier(d, "memory_id", "data", required=False)
    if memory_id is not None and DERIVED_ID.match(memory_id) and \
            memory_id != derive_memory_id(tenant, idem):
        raise _fail("data.memory_id", "ids of the form m_ + 24 hex digits are reserved for "
                    "derived ids; omit memory_id or choose another form")
    scope = _identifier(d, "scope", "data", required=False)
    supersedes = _identifier(d, "supersedes", "data", required=corrected)
    expires_at = _timestamp(d, "expires_at", "data", required=False)
    text = _text(d, "text", "data", required=False)
    out: dict[str, Any] = {
        "namespace": ns,
        "key": key,
        "value": value,
        "layer": layer,
        "memory_id": memory_id or derive_memory_id(tenant, idem),
        "text": text if text is not None else _default_text(key, value),
    }
    # The default text is stored with the event: scanned as it reads, whatever the
    # value (a list or object too: ["密码：", "x"] reads `密码：","x"]`, which a
    # later decode of the stored event would refuse).
    kind = find_secret_in_text(out["text"]) if text is None else None
    if kind is not None:
        # Key and value read together, as the default text shows them: {"key": "pw",
        # "value": "Hunter2!"} is "pw: Hunter2!".
        raise _fail("data.value", SecretFinding(kind, "data.key with data.value").describe())
    for name, v in (("task_key", task_key), ("session_id", session_id), ("scope", scope),
                    ("supersedes", supersedes), ("expires_at", expires_at)):
        if v is not None:
            out[name] = v
    if memory_id is not None and memory_id == supersedes:
        raise _fail("data.supersedes", "a memory cannot supersede itself")
    return out


def _written(d: dict[str, Any], tenant: str, actor: str, source: Source,
             idem: str) -> dict[str, Any]:
    return _memory_write(d, tenant, actor, source, idem, corrected=False)


def _corrected(d: dict[str, Any], tenant: str, actor: str, source: Source,
               idem: str) -> dict[str, Any]:
    return _memory_write(d, tenant, actor, source, idem, corrected=True)


def _untrusted(source: Source, what: str) -> None:
    if source.kind in UNTRUSTED_KINDS:
        raise _fail("source.kind", f"{source.kind} may not {what} (R9)")


def _superseded(d: dict[str, Any], tenant: str, actor: str, source: Source,
                idem: str) -> dict[str, Any]:
    _untrusted(source, "supersede a memory")
    if source.kind in CANDIDATE_KINDS:
        raise _fail("source.kind", f"{source.kind} may not supersede a memory; "
                    "use explicit_user_request or operator (R13)")
    mid = _identifier(d, "memory_id", "data")
    by = _identifier(d, "superseded_by", "data", required=False)
    out: dict[str, Any] = {"memory_id": mid}
    if by is not None:
        out["superseded_by"] = by
    return out


def _confirmed(d: dict[str, Any], tenant: str, actor: str, source: Source,
               idem: str) -> dict[str, Any]:
    if source.kind not in ("explicit_user_request", "operator"):
        raise _fail("source.kind", "memory.confirmed needs explicit_user_request or operator; "
                    f"got {source.kind} (R10)")
    return {"memory_id": _identifier(d, "memory_id", "data")}


def _forgotten(d: dict[str, Any], tenant: str, actor: str, source: Source,
               idem: str) -> dict[str, Any]:
    if source.kind not in _FORGET_KINDS:
        raise _fail("source.kind", f"{source.kind} may not forget memories; "
                    f"allowed: {', '.join(sorted(_FORGET_KINDS))}")
    targets = [t for t in ("memory_id", "namespace", "namespace_prefix") if d.get(t) is not None]
    if len(targets) != 1:
        raise _fail("data", "needs exactly one target: memory_id, or namespace + key, "
                    "or namespace_prefix")
    out: dict[str, Any] = {}
    reason = _text(d, "reason", "data", required=False, max_chars=1024)
    if reason is not None:
        out["reason"] = reason
    target = targets[0]
    if target == "memory_id":
        if d.get("key") is not None:
            raise _fail("data.key", "goes with namespace, not with memory_id")
        out["memory_id"] = _identifier(d, "memory_id", "data")
    elif target == "namespace":
        ns = _namespace(d, "namespace", tenant)
        _owner_check(source.kind, actor, ns, "data.namespace")
        key = _identifier(d, "key", "data")
        out.update(namespace=ns, key=key)
    else:
        if d.get("key") is not None:
            raise _fail("data.key", "goes with namespace, not with namespace_prefix")
        prefix = _namespace(d, "namespace_prefix", tenant, min_len=1)
        if source.kind in USER_KINDS:
            if len(prefix) < 2:
                raise _fail("data.namespace_prefix", "a user may forget only under "
                            f"[{tenant!r}, {actor!r}]: give at least two parts")
            _owner_check(source.kind, actor, prefix, "data.namespace_prefix")
        out["namespace_prefix"] = prefix
    return out


def _refs(d: dict[str, Any]) -> dict[str, str] | None:
    refs = d.get("refs")
    if refs is None:
        return None
    if not isinstance(refs, dict) or len(refs) > MAX_REFS:
        raise _fail("data.refs", f"must be an object of at most {MAX_REFS} strings")
    for k, v in refs.items():
        if not isinstance(v, str) or len(v) > MAX_ID_CHARS or len(k) > MAX_ID_CHARS:
            # Neither the ref's key nor its value is echoed: either may hold a secret.
            raise _fail("data.refs", f"each key and value must be a string of at most "
                        f"{MAX_ID_CHARS} chars")
    return dict(refs)


def _task_opened(d: dict[str, Any], tenant: str, actor: str, source: Source,
                 idem: str) -> dict[str, Any]:
    _untrusted(source, "open tasks")
    task_key = _identifier(d, "task_key", "data")
    ns = _namespace(d, "namespace", tenant)
    _owner_check(source.kind, actor, ns, "data.namespace")
    out: dict[str, Any] = {"task_key": task_key, "namespace": ns}
    refs = _refs(d)
    if refs is not None:
        out["refs"] = refs
    title = _text(d, "title", "data", required=False, max_chars=1024)
    if title is not None:
        out["title"] = title
    return out


def _task_noted(d: dict[str, Any], tenant: str, actor: str, source: Source,
                idem: str) -> dict[str, Any]:
    _untrusted(source, "write task facts")
    task_key = _identifier(d, "task_key", "data")
    kind = d.get("kind")
    if kind not in NOTE_KINDS:
        raise _fail("data.kind", f"must be one of {', '.join(NOTE_KINDS)}")
    if kind == "system_status" and source.kind != "system_of_record":
        raise _fail("data.kind", f"system_status notes need source kind system_of_record, "
                    f"got {source.kind}: only the system of record states task facts (R3)")
    text = _text(d, "text", "data", required=True)
    out: dict[str, Any] = {"task_key": task_key, "kind": kind, "text": text}
    fields = d.get("fields")
    if fields is not None:
        if not isinstance(fields, dict):
            raise _fail("data.fields", "must be an object")
        if len(encode_json(fields)) > MAX_VALUE_BYTES:
            raise _fail("data.fields", f"must be at most {MAX_VALUE_BYTES} bytes encoded")
        out["fields"] = fields
    return out


def _task_closed(d: dict[str, Any], tenant: str, actor: str, source: Source,
                 idem: str) -> dict[str, Any]:
    _untrusted(source, "close tasks")
    out: dict[str, Any] = {"task_key": _identifier(d, "task_key", "data")}
    resolution = _text(d, "resolution", "data", required=False, max_chars=1024)
    if resolution is not None:
        out["resolution"] = resolution
    retain = _timestamp(d, "retain_until", "data", required=False)
    if retain is not None:
        out["retain_until"] = retain
    return out


def _task_purged(d: dict[str, Any], tenant: str, actor: str, source: Source,
                 idem: str) -> dict[str, Any]:
    if source.kind not in _PURGE_KINDS:
        raise _fail("source.kind", "task.purged needs source kind operator or system_of_record")
    out: dict[str, Any] = {"task_key": _identifier(d, "task_key", "data")}
    reason = _text(d, "reason", "data", required=False, max_chars=1024)
    if reason is not None:
        out["reason"] = reason
    return out


_PARSERS = {
    "memory.written": _written,
    "memory.corrected": _corrected,
    "memory.superseded": _superseded,
    "memory.confirmed": _confirmed,
    "memory.forgotten": _forgotten,
    "task.opened": _task_opened,
    "task.noted": _task_noted,
    "task.closed": _task_closed,
    "task.purged": _task_purged,
}


#: Where a member's key ends, or (inside strings only) a `"` then `:`, with the run of
#: backslashes before the quote (`_keys_in_text` drops escaped quotes).
_KEY_END: Final = re.compile(rb'\\*"[ \t\r\n]*:')
#: A run of digits that may be too long for a 64-bit integer (orjson would read it as
#: a float).
_LONG_DIGITS: Final = re.compile(rb"[0-9]{19}")


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _members(obj: object) -> int:
    """How many object members a decoded value holds, at every depth."""
    n = 0
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            n += len(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return n


def decode_json(line: bytes | str) -> Any:
    """Decode one JSON text strictly: malformed JSON, a key repeated in one object, or an
    integer beyond 64 bits is a `ValidationError` (orjson alone keeps the last of
    repeated keys and reads big integers as rounded floats).

    orjson decodes; the exact check (the standard library's parser) runs only when a
    cheap count says a key may repeat or a digit run is long enough to overflow.
    """
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise ValidationError("", f"malformed JSON: {e.msg} at position {e.pos}") from None
    raw = line if isinstance(line, bytes) else line.encode()
    if _keys_in_text(raw) == _members(obj) and not _LONG_DIGITS.search(raw):
        return obj
    return _decode_exact(raw, obj)


def _keys_in_text(raw: bytes) -> int:
    """An upper bound of the keys in a JSON text: each `"` then `:` that is not an
    escaped quote (a quote after an odd run of backslashes), so escaped JSON inside a
    string (`"pref: {\\"a\\":1}"`) is not counted."""
    found = _KEY_END.findall(raw)
    if b"\\" not in raw:
        return len(found)
    plain, escaped = found.count(b'":'), found.count(b'\\":')
    if plain + escaped == len(found):  # compact JSON (what orjson and json.dumps write)
        return plain
    return sum(1 for m in found if (len(m) - len(m.lstrip(b"\\"))) % 2 == 0)


def _decode_exact(raw: bytes, obj: Any) -> Any:
    """The exact check of `decode_json` (a repeated key, an integer beyond 64 bits)."""
    try:
        exact = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        name = repr(e.key) if e.key in _KNOWN_NAMES else "a key"
        raise ValidationError("", f"duplicate key: {name} appears twice in one object; "
                              "send each key once") from None
    except (ValueError, RecursionError):
        return obj  # orjson read it: its verdict stands (the checks below still run)
    _check_json(exact)
    return obj


def decode_event(line: bytes | str) -> Event:
    """Decode one JSON line and validate it; malformed JSON is a `ValidationError`.

    The same checks as `parse_event(decode_json(line))`, with one walk of the decoded
    object for the common case: `_walk` shows it clean and counts its members, which
    the keys in the text must equal (no key repeated)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise ValidationError("", f"malformed JSON: {e.msg} at position {e.pos}") from None
    raw = line if isinstance(line, bytes) else line.encode()
    if type(obj) is dict and not _LONG_DIGITS.search(raw):
        members = _walk(obj)
        if members >= 0 and _keys_in_text(raw) == members:
            return _parse_checked(obj)
    return parse_event(decode_json(raw))
