"""Principal-scoped reads: every query narrows by the server-side identity first.

Access is checked here, in the data layer, on every path (R15, R24): a principal
`TENANT/USER` reads only namespaces that start with `[TENANT, USER]` and tasks owned by
such namespaces. Every memory read also filters by the ledger's tombstones, so a
forget is effective the moment it is appended, before any projection ran (R20).
"""

from __future__ import annotations

import functools
import re
from collections import namedtuple
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import and_, bindparam, exists, or_, select, true
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.events import NS_SEP, ns_path
from ledger.forgets import covers_sql
from ledger.store import Store
from ledger.vault import DIALECT_ATTR, MAGIC
from projections.sql import PointQuery, driver_rows, prefix_match

LAYER_RANK = {"session": 0, "task": 1, "long": 2}
_CONTROL = re.compile("[\x00-\x1f]")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is reading: a tenant and an authenticated user (never parsed from chat)."""

    tenant: str
    user: str

    @classmethod
    def parse(cls, text: str) -> Principal:
        """Parse `TENANT/USER`."""
        parts = text.split("/")
        if len(parts) != 2 or not all(parts) or _CONTROL.search(text):
            raise ValidationError("--as", f"{text!r} is not TENANT/USER")
        return cls(parts[0], parts[1])

    @property
    def prefix(self) -> str:
        """The stored namespace path every readable namespace starts with."""
        return ns_path([self.tenant, self.user])

    def owns(self, namespace: tuple[str, ...] | list[str]) -> bool:
        """May this principal read that namespace?"""
        return len(namespace) >= 2 and namespace[0] == self.tenant and namespace[1] == self.user


#: The item's coordinates each kind's branch of the rule compares (`covers_sql`; a
#: prefix forget compares the namespace path alone, by its start).
_NEEDS: dict[str, tuple[str, ...]] = {
    "memory_id": ("memory_id",), "key": ("ns_path", "mkey"), "prefix": ("ns_path",),
    "task": ("task_key",)}
_COORDINATES = ("memory_id", "ns_path", "mkey", "task_key")


def unforgotten(target: Any) -> Any:
    """SQL: the row of `target` (a table's columns) is covered by no tombstone of the
    ledger: the rule (`covers_sql`) tested as one `NOT EXISTS` per kind of tombstone.

    One sub-select over every kind (an OR of the four branches) can only seek the
    tombstones by tenant, so each row tested read every tombstone of its tenant, and
    each delete slowed every later read of the tenant. Here each kind's sub-select is
    the rule with the other kinds' coordinates given as absent, which leaves that
    kind's branch (a key's also keeps the prefix branch, which compares the path too:
    the key sub-select says `kind = 'key'` and the equalities of its branch beside it).
    Each is then an equality seek on the tombstone indexes of `ledger.schema`:
    (tenant, kind, memory id), (tenant, kind, path, key), (tenant, kind, task key);
    prefix forgets are sought by (tenant, kind). The four cover exactly the rows the
    single test covers (tests/projections/test_tombstone_seek.py).
    """
    ts = t.tombstones.c
    have = {name for name in _COORDINATES if target.get(name) is not None}
    tests = []
    for kind, needs in _NEEDS.items():
        if not have.issuperset(needs):
            continue  # the item has no such coordinate: this kind never covers it
        absent = {name: None for name in _COORDINATES if name not in needs}
        seek = [ts.kind == kind, *(ts[n] == target[n] for n in needs)] \
            if kind == "key" else []
        tests.append(~exists().where(*seek, covers_sql(ts, target, **absent)))
    return and_(*tests) if tests else true()


@functools.cache
def not_forgotten() -> Any:
    """SQL: the `mem_versions` row is covered by no tombstone of the ledger (built once:
    it holds no value, and SQLAlchemy's expressions are immutable)."""
    return unforgotten(t.mem_versions.c)


def not_expired(now_us: int) -> Any:
    """SQL: the row has no expiry or it lies in the future."""
    mv = t.mem_versions.c
    return or_(mv.expires_us.is_(None), mv.expires_us > now_us)


def layer_filter(task: str | None, session: str | None) -> Any:
    """SQL: long-term rows, plus rows of the given task and session only (R2)."""
    mv = t.mem_versions.c
    conds = [mv.layer == "long"]
    if task is not None:
        conds.append(and_(mv.layer == "task", mv.task_key == task))
    if session is not None:
        conds.append(and_(mv.layer == "session", mv.session_id == session))
    return or_(*conds)


def memory_item(r: Any) -> dict[str, Any]:
    """The public form of an active view row."""
    src = orjson.loads(r.source)
    return {
        "memory_id": r.memory_id,
        "namespace": r.ns_path.split(NS_SEP)[:-1],
        "key": r.mkey,
        "value": orjson.loads(r.value) if r.value is not None else None,
        "layer": r.layer,
        "task_key": r.task_key,
        "session_id": r.session_id,
        "version": r.version,
        "status": r.status,
        "scope": r.scope,
        "expires_at": r.expires_at,
        "source": src,
    }


#: What `get` returns of a row (`memory_item`), in this order (`_got`): the columns
#: it shows and no others (the text, with the vault on, would be opened for nothing).
_GET_COLUMNS = [t.mem_versions.c[name] for name in (
    "memory_id", "ns_path", "mkey", "value", "layer", "task_key", "session_id", "version",
    "status", "scope", "expires_at", "source")]


def _get_statement() -> Any:
    mv = t.mem_versions.c
    return select(*_GET_COLUMNS).where(
        mv.tenant == bindparam("tenant"), mv.ns_path == bindparam("ns"),
        mv.mkey == bindparam("key"), mv.status == "active",
        or_(mv.layer == "long",
            and_(mv.layer == "task", mv.task_key == bindparam("task")),
            and_(mv.layer == "session", mv.session_id == bindparam("session"))),
        or_(mv.expires_us.is_(None), mv.expires_us > bindparam("now")),
        not_forgotten())


#: Built once: `get` is the hottest read, and building the expression per call cost more
#: than running it. A NULL task or session compares unequal to everything in SQL.
_GET = _get_statement()
#: The same statement for point reads on the calling thread (`get_now`).
_GET_POINT = PointQuery(_GET)
#: A `mem_versions` row as the driver returns it, with the columns as attributes.
MemRow = namedtuple("MemRow", [c.name for c in _GET_COLUMNS])  # type: ignore[misc]
#: A whole `mem_versions` row (text included) as the driver returns it.
MemVersionRow = namedtuple("MemVersionRow", [c.name for c in t.mem_versions.c])  # type: ignore[misc]


def _get_values(who: Principal, namespace: list[str], key: str, now_us: int,
                task: str | None, session: str | None) -> dict[str, Any]:
    return {"tenant": who.tenant, "ns": ns_path(namespace), "key": key, "task": task,
            "session": session, "now": now_us}


#: The values a `get` binds, by name (`_get_values`).
_GET_VARIABLES = ("tenant", "ns", "key", "task", "session", "now")
#: `_GET_POINT.parameters` with the statement's own values (the status, the layers, the
#: tombstone kinds) in place and None where a get's values go, copied per call.
_GET_TEMPLATE: list[Any] = _GET_POINT.parameters(dict.fromkeys(_GET_VARIABLES))
#: Where each of `_GET_VARIABLES` goes in the positional parameters (each binds once).
_GET_SLOTS: tuple[int, ...] = tuple(_GET_POINT.names.index(n) for n in _GET_VARIABLES)
assert all(_GET_POINT.names.count(n) == 1 for n in _GET_VARIABLES), _GET_POINT.names


def _get_parameters(who: Principal, namespace: list[str], key: str, now_us: int,
                    task: str | None, session: str | None) -> list[Any]:
    """`_GET_POINT.parameters(_get_values(...))`, filled into a copy of the template
    instead of looked up name by name (18 parameters, 6 of them the call's)."""
    p = _GET_TEMPLATE.copy()
    tenant, ns, k, tk, sess, now = _GET_SLOTS
    p[tenant], p[ns], p[k], p[tk], p[sess], p[now] = (
        who.tenant, ns_path(namespace), key, task, session, now_us)
    return p


def _best(rows: Iterable[Any]) -> dict[str, Any]:
    best = min(rows, key=lambda r: LAYER_RANK[r.layer], default=None)
    if best is None:
        return {"found": False}
    return {"found": True, **memory_item(best)}


async def get(conn: AsyncConnection, who: Principal, namespace: list[str], key: str, *,
              now_us: int, task: str | None = None, session: str | None = None
              ) -> dict[str, Any]:
    """The active value of a key for the principal: session beats task beats long-term."""
    if not who.owns(namespace):
        return {"found": False}  # says nothing about whether it exists
    return _best((await conn.execute(
        _GET, _get_values(who, namespace, key, now_us, task, session))).all())


def get_now(store: Store, who: Principal, namespace: list[str], key: str, *, now_us: int,
            task: str | None = None, session: str | None = None) -> dict[str, Any] | None:
    """`get` run on the calling thread where the backend can (a point read on a SQLite
    file: the same statement, the same filters, no hop to the driver's thread); None
    where it cannot, and the caller awaits `get` instead."""
    if not who.owns(namespace):
        return {"found": False}
    # `point_rows(store, _GET_POINT, ..., opened=False)`, its parameters from the template
    reader = store.recorder.point_reads()
    if reader is None:
        return None
    rows = reader.rows(_GET_POINT.sql, _get_parameters(who, namespace, key, now_us, task,
                                                       session))
    if rows is None:
        return None
    if not rows:
        return {"found": False}
    # The one row of a key's long-term layer, or the best layer of a task's or a
    # session's: only its value is opened (`value_opener`), and the item is built
    # from the driver's tuple as `memory_item` builds it from a row.
    r = rows[0] if len(rows) == 1 else min(rows, key=lambda r: LAYER_RANK[r[4]])
    return _got(r, value_opener(store)(r[3]))


def _got(r: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """`{"found": True, **memory_item(row)}` of a `_GET_COLUMNS` tuple, its value opened."""
    return {"found": True, "memory_id": r[0], "namespace": r[1].split(NS_SEP)[:-1],
            "key": r[2], "value": orjson.loads(value) if value is not None else None,
            "layer": r[4], "task_key": r[5], "session_id": r[6], "version": r[7],
            "status": r[8], "scope": r[9], "expires_at": r[10],
            "source": orjson.loads(r[11])}


def value_opener(store: Store) -> Callable[[Any], Any]:
    """Opens a `value` read as stored (`point_rows(opened=False)`) as `point_rows`
    would have: the plaintext, or None once its key is destroyed (the item was
    forgotten since the read)."""
    # `SealedView.process_result_value` with its vault looked up once, not per value
    # (no vault: a sealed value reads as None, as the column's type reads it)
    vault = getattr(store.engine.sync_engine.dialect, DIALECT_ATTR, None)
    head = MAGIC[:1]

    def opened(v: Any) -> Any:
        if v is None or bytes(v[:1]) != head:
            return v
        return None if vault is None else vault.open(bytes(v))
    return opened


async def get_driver(store: Store, who: Principal, namespace: list[str], key: str, *,
                     now_us: int, task: str | None = None, session: str | None = None
                     ) -> dict[str, Any] | None:
    """`get` awaited on the driver's own connection where the backend offers it
    (PostgreSQL: the same statement and filters, prepared once by asyncpg, no
    SQLAlchemy per call); None where it cannot, and the caller awaits `get` instead."""
    if not who.owns(namespace):
        return {"found": False}
    rows = await driver_rows(store, _GET_POINT, _get_values(who, namespace, key, now_us,
                                                            task, session))
    if rows is None:
        return None
    return _best(MemRow._make(r) for r in rows)


async def active_memories(conn: AsyncConnection, who: Principal, *, now_us: int,
                          task: str | None = None, session: str | None = None,
                          memory_ids: list[str] | None = None) -> list[Any]:
    """Every active, unexpired, unforgotten row the principal may read in scope."""
    mv = t.mem_versions.c
    q = select(t.mem_versions).where(
        mv.tenant == who.tenant, prefix_match(mv.ns_path, who.prefix), mv.status == "active",
        layer_filter(task, session), not_expired(now_us), not_forgotten())
    if memory_ids is not None:
        q = q.where(mv.memory_id.in_(memory_ids))
    return list((await conn.execute(q)).all())


def task_not_forgotten() -> Any:
    """SQL: the `tasks_view` row is covered by no task purge or prefix forget (the task
    as a whole: the view keeps no order)."""
    return unforgotten(t.tasks_view.c)


async def tasks(conn: AsyncConnection, who: Principal, *, include_closed: bool = False
                ) -> list[dict[str, Any]]:
    """The principal's task summaries: open ones, or all with `include_closed`."""
    tv = t.tasks_view.c
    q = select(t.tasks_view).where(
        tv.tenant == who.tenant, prefix_match(tv.ns_path, who.prefix), tv.purged.is_(False),
        task_not_forgotten())
    if not include_closed:
        q = q.where(tv.status == "open")
    rows = (await conn.execute(q.order_by(tv.task_key))).all()
    return [orjson.loads(r.summary) for r in rows]


_WORD = re.compile(r"[\w\u4e00-\u9fff]+", re.UNICODE)


def keyword_score(query: str, text: str) -> float:
    """Share of the query's terms (CJK characters count one by one) found in `text`."""
    def terms(s: str) -> set[str]:
        out: set[str] = set()
        for w in _WORD.findall(s.casefold()):
            if any("\u4e00" <= c <= "\u9fff" for c in w):
                out.update(c for c in w if "\u4e00" <= c <= "\u9fff")
            else:
                out.add(w)
        return out
    q = terms(query)
    if not q:
        return 0.0
    return len(q & terms(text)) / len(q)


async def history(conn: AsyncConnection, who: Principal, namespace: list[str], key: str
                  ) -> list[dict[str, Any]]:
    """Every version of a key the principal owns, in every layer, oldest first.

    Superseded and candidate versions keep their values (the user may see what they
    said); forgotten ones appear as `{"status": "forgotten", "redacted": true}` only.
    """
    if not who.owns(namespace):
        return []
    mv = t.mem_versions.c
    rows = (await conn.execute(select(t.mem_versions).where(
        mv.tenant == who.tenant, mv.ns_path == ns_path(namespace), mv.mkey == key)
        .order_by(mv.layer, mv.task_key, mv.session_id, mv.version))).all()
    covered = {r.memory_id for r in (await conn.execute(select(mv.memory_id).where(
        mv.tenant == who.tenant, mv.ns_path == ns_path(namespace), mv.mkey == key,
        ~not_forgotten()))).all()}
    out: list[dict[str, Any]] = []
    for r in rows:
        item = memory_item(r)
        if r.status == "forgotten" or r.memory_id in covered:
            item.update(status="forgotten", value=None, redacted=True)
        item["superseded_by"] = r.superseded_by
        out.append(item)
    return out


async def get_by_id(conn: AsyncConnection, who: Principal, memory_id: str, *, now_us: int
                    ) -> dict[str, Any]:
    """One memory version by its id, if the principal may read it.

    The same filters as `get` (the principal's prefix in the SQL, unexpired, covered by
    no tombstone), but any status but forgotten: an active, candidate or superseded
    version. Another user's id and an unknown id both give `{"found": False}`.
    """
    mv = t.mem_versions.c
    row = (await conn.execute(select(t.mem_versions).where(
        mv.tenant == who.tenant, prefix_match(mv.ns_path, who.prefix),
        mv.memory_id == memory_id, mv.status != "forgotten", not_expired(now_us),
        not_forgotten()))).first()
    if row is None:
        return {"found": False}
    return {"found": True, **memory_item(row), "superseded_by": row.superseded_by}


async def covered_by(conn: AsyncConnection, who: Principal, position: int) -> list[str]:
    """The ids of the principal's memory versions that the forget at `position` covers
    (by the one forget rule), sorted; empty if no forget is at that position."""
    mv, ts = t.mem_versions.c, t.tombstones.c
    rows = (await conn.execute(select(mv.memory_id).where(
        ts.position == position, mv.tenant == who.tenant,
        prefix_match(mv.ns_path, who.prefix), covers_sql(ts, mv))
        .order_by(mv.memory_id))).all()
    return [r[0] for r in rows]
