"""The one forget rule: which versions a tombstone covers (docs/forgetting.md; R20, R22).

A tombstone is what a `memory.forgotten` or `task.purged` event records. It covers an
item by the item's *coordinates* alone (tenant, memory id, namespace path, key, task
key, source order), never by its content, so coverage can still be decided after the
content is erased:

- same tenant, always;
- by memory id: that memory, whatever its order (an id is never said again);
- otherwise only what was said at or before the forget (`order_key <=` the
  tombstone's; a key said again later is a new memory), and then
  - by key: same namespace path and key;
  - by namespace prefix: every namespace path starting with the prefix (memories, and
    tasks by their owner's path);
  - by task: everything carrying that task key (its notes and its task-layer memories:
    validation lets only task-layer writes carry a task key).

An item without an order (`order_key` None: a task summary, a vector entry, a dead
letter) is judged "whatever its order": the cautious reading.

`covers` is the rule as a pure function; `covers_sql` is the same rule as a SQL
expression over any table's columns, against one tombstone or against the
`tombstones` table. tests/ledger/test_forgets.py checks that both give the same answer
for any tombstone and any item, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import String, and_, bindparam, false, func, or_
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ColumnElement
from sqlalchemy.sql.visitors import InternalTraversal
from sqlalchemy.types import Boolean

from ledger.events import Event, ns_path

#: The kinds of tombstone, as the `tombstones.kind` column stores them.
KINDS = ("memory_id", "key", "prefix", "task")
#: The coordinate names `covers_sql` looks up among a table's columns.
COORDINATES = ("tenant", "order_key", "memory_id", "ns_path", "mkey", "task_key")


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A forget (or task purge) as the read and write paths apply it."""

    position: int
    tenant: str
    kind: str  # memory_id | key | prefix | task
    order_key: bytes
    memory_id: str | None = None
    ns_path: str | None = None
    mkey: str | None = None
    task_key: str | None = None


@dataclass(frozen=True, slots=True)
class Coordinates:
    """What the rule looks at in a memory version or a task event (None: it has none).

    For a task event `ns_path` is its task owner's namespace path; `order_key` None
    means the item is judged whatever its order.
    """

    tenant: str
    order_key: bytes | None = None
    memory_id: str | None = None
    ns_path: str | None = None
    mkey: str | None = None
    task_key: str | None = None


def covers(ts: Tombstone, v: Coordinates) -> bool:
    """Does this tombstone cover an item with these coordinates? (the rule, in Python)"""
    if v.tenant != ts.tenant:
        return False
    if ts.kind == "memory_id":
        return v.memory_id is not None and v.memory_id == ts.memory_id
    if v.order_key is not None and v.order_key > ts.order_key:
        return False  # said again after the forget: a new memory
    if ts.kind == "key":
        return v.ns_path is not None and v.mkey is not None and (
            v.ns_path == ts.ns_path and v.mkey == ts.mkey)
    if ts.kind == "prefix":
        return v.ns_path is not None and ts.ns_path is not None and v.ns_path.startswith(
            ts.ns_path)
    if ts.kind == "task":
        return v.task_key is not None and v.task_key == ts.task_key
    return False


def covers_sql(ts: Tombstone | Any, target: Any = None, **columns: Any) -> Any:
    """The rule as SQL: the row of `target` is covered by `ts`.

    `target` is a table's columns (`table.c`): those named as in `COORDINATES` are
    used, a missing one counts as "the item has none"; `columns` add or replace
    columns (any SQL expression) by name, and `order_key=None` judges whatever the
    order. `ts` is a `Tombstone` (the expression then holds its values) or the
    `tombstones` table's columns (for `EXISTS` over every tombstone).
    """
    c = {name: columns[name] if name in columns else _column(target, name)
         for name in COORDINATES}
    if c["tenant"] is None:
        raise ValueError("covers_sql needs a tenant column")
    concrete = isinstance(ts, Tombstone)

    def val(name: str) -> Any:
        return getattr(ts, name)  # a value of the tombstone, or a `tombstones` column

    def eq(name: str) -> Any:
        if c[name] is None or val(name) is None:
            return None  # never equal: the item or the tombstone has no such coordinate
        return c[name] == val(name)

    def in_order(cond: Any) -> Any:
        if cond is None or c["order_key"] is None:
            return cond
        return and_(cond, c["order_key"] <= val("order_key"))

    def prefix() -> Any:
        p = val("ns_path")
        if c["ns_path"] is None or p is None:
            return None
        # substr, not LIKE: no escaping and no collation; lengths count characters.
        match = func.substr(c["ns_path"], 1, len(p) if concrete else func.length(p)) == p
        if concrete and p:
            return and_(PrefixSeek(c["ns_path"], p), match)
        return match

    branches: list[tuple[str, Any]] = []
    for kind in KINDS:
        if concrete and kind != ts.kind:
            continue  # a concrete tombstone needs only its own kind's condition
        if kind == "memory_id":
            cond = eq("memory_id")
        elif kind == "key":
            k, n = eq("ns_path"), eq("mkey")
            cond = None if k is None or n is None else in_order(and_(k, n))
        elif kind == "prefix":
            cond = in_order(prefix())
        else:
            cond = in_order(eq("task_key"))
        if cond is not None:
            branches.append((kind, cond))
    if not branches:
        return false()
    tenant: Any = c["tenant"] == val("tenant")
    if concrete:
        return and_(tenant, branches[0][1])
    kinds: Any = ts.kind
    return and_(tenant, or_(*[and_(kinds == kind, cond) for kind, cond in branches]))


class PrefixSeek(ColumnElement[bool]):
    """`col` within the range of the paths that start with `prefix` (a stored namespace
    path, so it ends in the separator), as SQLite can seek an index on `col` by; TRUE
    elsewhere. `covers_sql` puts it beside its `substr` test of a prefix forget, which
    alone decides: SQLite compares TEXT bytewise, so there the range holds exactly
    those paths, and without it a forget of a prefix read every row of its tenant.
    PostgreSQL compares text by its collation, where the range is not the prefix, so
    it gets no range (and its indexes would not serve one)."""

    inherit_cache = True
    type = Boolean()
    _traverse_internals = [("col", InternalTraversal.dp_clauseelement),  # noqa: RUF012
                           ("lo", InternalTraversal.dp_clauseelement),
                           ("hi", InternalTraversal.dp_clauseelement)]

    def __init__(self, col: Any, prefix: str) -> None:
        self.col = col
        self.lo = bindparam(None, prefix, type_=String())
        self.hi = bindparam(None, prefix[:-1] + chr(ord(prefix[-1]) + 1), type_=String())


@compiles(PrefixSeek)
def _no_prefix_seek(element: PrefixSeek, compiler: SQLCompiler, **kw: Any) -> str:
    return "1 = 1"


@compiles(PrefixSeek, "sqlite")
def _sqlite_prefix_seek(element: PrefixSeek, compiler: SQLCompiler, **kw: Any) -> str:
    return str(compiler.process(and_(element.col >= element.lo, element.col < element.hi),
                                **kw))


def _column(target: Any, name: str) -> Any:
    return None if target is None else target.get(name)


def tombstone_of(ev: Event, position: int) -> Tombstone | None:
    """The tombstone a forget or purge event records, or None for other events."""
    d = ev.data
    if ev.type == "memory.forgotten":
        if "memory_id" in d:
            return Tombstone(position, ev.tenant, "memory_id", ev.order, memory_id=d["memory_id"])
        if "namespace_prefix" in d:
            return Tombstone(position, ev.tenant, "prefix", ev.order,
                             ns_path=ns_path(d["namespace_prefix"]))
        return Tombstone(position, ev.tenant, "key", ev.order, ns_path=ns_path(d["namespace"]),
                         mkey=d["key"])
    if ev.type == "task.purged":
        return Tombstone(position, ev.tenant, "task", ev.order, task_key=d["task_key"])
    return None


def tombstone_from_row(r: Any) -> Tombstone:
    """Build a `Tombstone` from a `tombstones` row."""
    return Tombstone(r.position, r.tenant, r.kind, bytes(r.order_key), r.memory_id, r.ns_path,
                     r.mkey, r.task_key)


def tombstone_row(ts: Tombstone) -> dict[str, Any]:
    """The `tombstones` row of a tombstone."""
    return {"position": ts.position, "tenant": ts.tenant, "kind": ts.kind,
            "memory_id": ts.memory_id, "ns_path": ts.ns_path, "mkey": ts.mkey,
            "task_key": ts.task_key, "order_key": ts.order_key}


def register_entry(ev: Event, position: int) -> dict[str, Any]:
    """What the forget register keeps of a forget or purge: the event without reason."""
    wire = ev.to_wire()
    wire["data"] = {k: v for k, v in wire["data"].items() if k != "reason"}
    return {"position": position, "event": wire}
