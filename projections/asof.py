"""As-of reads: what the system believed at a past instant (docs/projections.md#as-of).

An instant is a ledger *position*: the answer is the view as it would have been with the
ledger holding exactly the events at positions 1..P. `position:N` names it directly; an
RFC 3339 time T names the last position of the longest prefix of events recorded at or
before T (`events.recorded_at`, the ledger's clock when the event was appended).

Recording time, not source time, is the axis: "what did the system believe on 21
September" is about what the ledger held then. Source time says when something happened
at the source, and an event can arrive long after it (a late extraction, a backfill, a
system of record replaying its log): by source time such an event would change the past
answer after the fact, and two reads of "the same past" a day apart would disagree.
By recording time the past is fixed once recorded. Inside the prefix, which version wins
is still decided by source order (R17), exactly as the live views decide it.

How: `get` and `recall` read the stored history (`projections.history`, table
`mem_history`: each memory version's states with the positions they held for, and the
embeddings of active rows) when its checkpoint has reached the instant; otherwise, and
for `history`, `tasks` and the audit, the answer is replayed on demand, per principal,
from the ledger: the principal's slots' writes up to P, the marks aimed at them, and
the tombstones, resolved by the live projection's own pure functions
(`projections.memory.resolve_slot`, `projections.tasks.summarize`) and the one forget
rule (`ledger.forgets.covers`). Marks come from the memories view's `mem_marks`
(complete up to its checkpoint; the positions after it are read from the ledger).

Forgotten content stays forgotten in the past: a forget recorded up to P makes its
items forgotten then, as the live view would have; a forget recorded *after* P does not
change what was believed, but the item is returned redacted (`"redacted": true`: its
id, version, status and source, never its value, scope or expiry) and a task's covered
notes are withheld. Expiry is judged at the instant (T, or the recording time of
position N). Principal scoping is the same as for every read (R24).
"""

from __future__ import annotations

import re
from collections import namedtuple
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, Final

import numpy as np
import orjson
from sqlalchemy import and_, bindparam, exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.events import MEMORY_WRITES, encode_json, ns_path, parse_rfc3339, slot_id, to_us
from ledger.forgets import Coordinates, Tombstone, covers, covers_sql
from ledger.recorder import STORED_COLUMNS
from ledger.records import stored_from_row
from ledger.store import Store
from projections import reads
from projections.budget import fit
from projections.candidates import KEY_NAMED, MIN_RELEVANCE, Candidate
from projections.embedding import Embedder, embed_queries
from projections.history import CONTENT, HISTORY, Reach, coordinates, marks_upto
from projections.memory import (
    WRITE_COLUMNS,
    Mark,
    WriteFact,
    resolve_slot,
    write_fact_of_row,
)
from projections.principal_index import PrincipalIndex, norm_key
from projections.ranking import rank, relevant_tasks
from projections.recall_audit import write_audit
from projections.sql import PointQuery, chunks, point_rows, prefix_match, prefix_range_of
from projections.tasks import Note, note_body, summarize
from projections.vectors import from_blobs, memory_text, store_embedder

POSITION_PREFIX: Final = "position:"
_POSITION = re.compile(r"position:(0|[1-9][0-9]{0,17})")
#: Event types that set marks on a memory (`projections.memory.marks_of`).
_MARK_TYPES: Final = ("memory.superseded", "memory.confirmed")
#: The live projection that keeps `mem_marks`.
_MEMORIES: Final = "memories"
#: Fields of a memory a redaction hides: its content, never its envelope.
REDACTED_FIELDS: Final = ("value", "scope", "expires_at", "session_id")


@dataclass(frozen=True, slots=True)
class Instant:
    """A past moment of the ledger: it held exactly positions 1..`position`."""

    position: int
    #: Expiry is judged at this time (microseconds since the epoch).
    now_us: int
    #: What was asked: an RFC 3339 time or `position:N`.
    asked: str
    #: The position the memories view (`mem_marks`) had applied in the same snapshot.
    views_at: int = 0
    #: The position the history view (`mem_history`) had applied in the same snapshot:
    #: an instant up to it is read from the stored history, a later one replayed.
    history_at: int = 0

    @property
    def stored(self) -> bool:
        """Is the instant's memory read from `mem_history` (rather than replayed)?"""
        return self.position <= self.history_at

    def wire(self) -> dict[str, Any]:
        """What an answer reports of its instant."""
        return {"as_of": self.asked, "position": self.position}


def check_as_of(text: str) -> str:
    """Validate an `as_of` value (RFC 3339 with an offset, or `position:N`)."""
    if _POSITION.fullmatch(text):
        return text
    try:
        parse_rfc3339(text)
    except ValueError:
        raise ValidationError("as_of", "give an RFC 3339 time with an offset "
                              "(2026-09-21T00:00:00Z) or position:N") from None
    return text


def _utc_text(us: int) -> str:
    """A time in `recorded_at`'s own form, so the two compare as text."""
    return datetime.fromtimestamp(us / 1e6, UTC).replace(
        microsecond=us % 1_000_000).isoformat(timespec="microseconds")


def _instant_position(by_time: bool) -> Any:
    """The instant's position as a SQL expression: by time (`:at`), the longest prefix
    recorded by then, which the first event recorded later ends; by position (`:n`), the
    last event at or before N (N itself, or the head when N is past it). 0: none."""
    ev = t.events.c
    if by_time:
        # `position + 0`: SQLite would otherwise walk the primary key for the minimum
        # instead of reading the recording-time index's range, which holds the position.
        later = select(func.min(ev.position + 0)).where(
            ev.recorded_at > bindparam("at")).scalar_subquery()
        return func.coalesce(later - 1, select(func.max(ev.position)).scalar_subquery(), 0)
    return func.coalesce(select(func.max(ev.position)).where(
        ev.position <= bindparam("n")).scalar_subquery(), 0)


def _resolve_statement(by_time: bool) -> Any:
    """The instant in one statement: its position (`:n`, or the time `:at` in
    `recorded_at`'s form), the position's recording time, and how far the memories
    and history views have come."""
    ev, cp = t.events.c, t.checkpoints.c
    views_at = select(cp.position).where(cp.name == _MEMORIES).scalar_subquery()
    history_at = select(cp.position).where(cp.name == HISTORY).scalar_subquery()
    p = _instant_position(by_time)
    inst = select(p.label("p")).subquery("inst")
    recorded = select(ev.recorded_at).where(ev.position == inst.c.p).scalar_subquery()
    return select(inst.c.p, recorded, views_at, history_at).select_from(inst)


_RESOLVE = {by_time: PointQuery(_resolve_statement(by_time)) for by_time in (False, True)}


def _resolve_values(as_of: str) -> dict[str, Any]:
    check_as_of(as_of)
    if as_of.startswith(POSITION_PREFIX):
        return {"n": int(as_of[len(POSITION_PREFIX):]), "at": None}
    return {"n": None, "at": _utc_text(to_us(parse_rfc3339(as_of)))}


def _instant(as_of: str, row: Sequence[Any]) -> Instant:
    at = row[1]
    if as_of.startswith(POSITION_PREFIX):
        now_us = to_us(parse_rfc3339(at)) if at else 0
    else:
        now_us = to_us(parse_rfc3339(as_of))  # expiry is judged at T itself
    return Instant(int(row[0] or 0), now_us, as_of, int(row[2] or 0), int(row[3] or 0))


async def resolve(conn: AsyncConnection, as_of: str) -> Instant:
    """The instant an `as_of` value names, in `conn`'s snapshot of the ledger (one
    statement: the position, its time, and how far the memories and history views
    have come)."""
    values = _resolve_values(as_of)
    q = _RESOLVE[not as_of.startswith(POSITION_PREFIX)]
    return _instant(as_of, (await conn.execute(q.stmt, values)).one())


async def resolve_now(store: Store, as_of: str) -> Instant:
    """`resolve` in a statement of its own: on a SQLite file on the calling thread."""
    values = _resolve_values(as_of)
    q = _RESOLVE[not as_of.startswith(POSITION_PREFIX)]
    rows = point_rows(store, q, values)
    if rows is None:
        async with store.read_once() as conn:
            return await resolve(conn, as_of)
    return _instant(as_of, rows[0])


# -- memories ---------------------------------------------------------------------------

async def _marks(conn: AsyncConnection, tenant: str, ids: Iterable[str], instant: Instant,
                 ids_sql: Any = None) -> list[Mark]:
    """The marks aimed at `ids` set by events at positions up to the instant."""
    return await marks_upto(conn, tenant, ids, instant.position, instant.views_at, ids_sql)


#: What `write_fact_of_row` reads as the payload while a slot is resolved: the envelope
#: decides versions and statuses; the content is read afterwards, for the rows shown
#: (`fill`), so a user's long history is not decoded on every as-of read.
_ENVELOPE_ONLY: Final = b'{"data":{}}'


def _fact(r: Sequence[Any]) -> WriteFact:
    """A write fact from a row of `WRITE_COLUMNS` less the payload: the envelope, and
    `suppressed` as the event's own flag (an erased payload is content withheld now,
    not a suppression then)."""
    return write_fact_of_row((*r, _ENVELOPE_ONLY))


async def fill(conn: AsyncConnection, rows: Sequence[SimpleNamespace]) -> None:
    """Read the content of rows that show it (not forgotten, not redacted) from their
    events' payloads: value, text, scope, expiry and session, as the view holds them."""
    want = {r.position: r for r in rows if r.status != "forgotten" and not r.redacted}
    ev = t.events.c
    for chunk in chunks(sorted(want)):
        q = select(ev.position, ev.payload).where(ev.position.in_(chunk))
        for position, payload in (await conn.execute(q)).all():
            if payload is None:
                continue
            d = orjson.loads(payload)["data"]
            r = want[int(position)]
            r.value = encode_json(d["value"]) if "value" in d else None
            r.text, r.scope, r.session_id = d.get("text"), d.get("scope"), d.get("session_id")
            r.expires_at = d.get("expires_at")
            r.expires_us = to_us(parse_rfc3339(r.expires_at)) if r.expires_at else None


async def _tombstones(conn: AsyncConnection, tenant: str, after: int = 0) -> list[Tombstone]:
    """The tenant's tombstones (those after position `after`)."""
    ts = t.tombstones.c
    rows = (await conn.execute(select(t.tombstones).where(
        ts.tenant == tenant, ts.position > after).order_by(ts.position))).all()
    return [Tombstone(r.position, r.tenant, r.kind, bytes(r.order_key), r.memory_id,
                      r.ns_path, r.mkey, r.task_key) for r in rows]


async def memory_rows(conn: AsyncConnection, who: reads.Principal, instant: Instant,
                      *conds: Any) -> list[SimpleNamespace]:
    """Every version, as of the instant, of the principal's slots whose writes match
    `conds` (SQL on `events`), resolved as the memories view resolves them; each row
    has the `mem_versions` columns plus `redacted`. Content columns are empty until
    `fill` reads them for the rows a caller shows."""
    ev = t.events.c
    where = (ev.tenant == who.tenant, ev.type.in_(sorted(MEMORY_WRITES)),
             ev.position <= instant.position, prefix_match(ev.ns_path, who.prefix),
             *prefix_range_of(conn, ev.ns_path, who.prefix), *conds)
    q = select(*[ev[c] for c in WRITE_COLUMNS[:-1]], ev.payload.is_(None)).where(*where)
    rows = (await conn.execute(q)).all()
    if not rows:
        return []
    facts = [_fact(r[:-1]) for r in rows]
    erased = {f.memory_id for f, r in zip(facts, rows, strict=True) if r[-1]}
    marks = await _marks(conn, who.tenant, (f.memory_id for f in facts), instant,
                         select(ev.memory_id).where(*where))
    vias = {m.via_candidate for m in marks if m.via_candidate}
    confirmed = {m.target for m in await _marks(conn, who.tenant, vias, instant)
                 if m.kind == "confirmed"}
    reach = Reach(await _tombstones(conn, who.tenant))
    by_slot: dict[str, list[WriteFact]] = {}
    for f in facts:
        by_slot.setdefault(f.slot, []).append(f)
    by_target: dict[str, list[Mark]] = {}
    for m in marks:
        by_target.setdefault(m.target, []).append(m)
    out: list[SimpleNamespace] = []
    for slot in sorted(by_slot):
        ws = by_slot[slot]
        ms = [m for w in ws for m in by_target.get(w.memory_id, ())]
        tombs = reach.slot(ws)
        past = [ts for ts in tombs if ts.position <= instant.position]
        for row in resolve_slot(ws, ms, confirmed, past):
            coords = Coordinates(row["tenant"], row["order_key"], row["memory_id"],
                                 row["ns_path"], row["mkey"], row["task_key"])
            hidden = row["memory_id"] in erased or any(covers(ts, coords) for ts in tombs)
            if hidden:
                row.update(dict.fromkeys(REDACTED_FIELDS), text=None, expires_us=None)
            out.append(SimpleNamespace(**row, redacted=hidden))
    return out


#: What a stored as-of read selects of `mem_history`: the row less its interval.
_STORED_COLUMNS: Final = tuple(c for c in t.mem_history.c
                               if c.name not in ("valid_from", "valid_to"))


async def stored_rows(conn: AsyncConnection, who: reads.Principal, instant: Instant,
                      *conds: Any) -> list[SimpleNamespace]:
    """The principal's memories that were active at the instant, from the stored
    history (`instant.stored` must hold), matching `conds` (SQL on `mem_history`): the
    rows valid at the instant's position, each with `redacted` (content removed by a
    forget: by one the history has applied, or by a later one checked here)."""
    mh = t.mem_history.c
    p = instant.position
    q = select(*_STORED_COLUMNS).where(
        mh.tenant == who.tenant, mh.status == "active",
        prefix_match(mh.ns_path, who.prefix), *prefix_range_of(conn, mh.ns_path, who.prefix),
        mh.valid_from <= p, or_(mh.valid_to.is_(None), mh.valid_to > p), *conds)
    rows = [SimpleNamespace(**r._mapping) for r in (await conn.execute(q)).all()]
    # Forgets recorded after the history's checkpoint: not applied to its rows yet.
    late = await _tombstones(conn, who.tenant, after=instant.history_at) if rows else []
    for r in rows:
        if late and not r.redacted and any(covers(ts, coordinates(r)) for ts in late):
            r.__dict__.update(dict.fromkeys(CONTENT), redacted=True, model=None, vector=None)
    return rows


def _stored_point_statement() -> Any:
    """`stored_rows` for point reads on SQLite (`stored_now`): bound prefix and range,
    and whether a forget after the history's checkpoint (`:h`) covers each row."""
    mh, ts = t.mem_history.c, t.tombstones.c
    prefix: Any = bindparam("prefix")
    p: Any = bindparam("p")
    late = exists().where(ts.position > bindparam("h"), covers_sql(t.tombstones.c, mh))
    return select(*_STORED_COLUMNS, late).where(
        mh.tenant == bindparam("tenant"), mh.status == "active",
        func.substr(mh.ns_path, 1, func.length(prefix)) == prefix,
        mh.ns_path >= prefix, mh.ns_path < bindparam("prefix_end"),
        mh.valid_from <= p, or_(mh.valid_to.is_(None), mh.valid_to > p))


_STORED_POINT = PointQuery(_stored_point_statement())
#: Does the principal own any task (ever)? None of them: no task summary to replay.
_OWNS_TASKS = PointQuery(select(t.task_owners.c.task_key).where(
    t.task_owners.c.tenant == bindparam("tenant"),
    func.substr(t.task_owners.c.ns_path, 1, func.length(bindparam("prefix")))
    == bindparam("prefix")).limit(1))
_STORED_NAMES: Final = tuple(c.name for c in _STORED_COLUMNS)


def stored_now(store: Store, who: reads.Principal, instant: Instant
               ) -> list[SimpleNamespace] | None:
    """`stored_rows` (no further conditions) read on the calling thread; None where
    point reads cannot run (the caller then awaits `stored_rows`)."""
    raw = point_rows(store, _STORED_POINT, {
        "tenant": who.tenant, "prefix": who.prefix, "prefix_end": who.prefix[:-1] + "\x20",
        "p": instant.position, "h": instant.history_at})
    if raw is None:
        return None
    rows = []
    for r in raw:
        row = SimpleNamespace(**dict(zip(_STORED_NAMES, r, strict=False)))
        if r[-1] and not row.redacted:
            row.__dict__.update(dict.fromkeys(CONTENT), redacted=True, model=None, vector=None)
        rows.append(row)
    return rows


def _live(r: SimpleNamespace, now_us: int) -> bool:
    return r.status == "active" and (r.expires_us is None or r.expires_us > now_us)


def _item(r: SimpleNamespace) -> dict[str, Any]:
    item = reads.memory_item(r)
    if r.redacted:
        item["redacted"] = True
    return item


def _get_statement(by_time: bool) -> Any:
    """An as-of get in one statement: the instant's position (as `resolve` finds it),
    its recording time and the history's checkpoint, outer-joined with the rows of up
    to three slots that were active then, each with whether a forget the history has
    not applied yet covers it. Always at least one row (the instant's)."""
    ev, cp, mh, ts = t.events.c, t.checkpoints.c, t.mem_history.c, t.tombstones.c
    p = _instant_position(by_time)
    h = func.coalesce(select(cp.position).where(cp.name == HISTORY).scalar_subquery(), 0)
    inst = select(p.label("p"), h.label("h")).subquery("inst")
    late = exists().where(ts.position > inst.c.h, covers_sql(t.tombstones.c, mh))
    # By slot and interval only, so the slot index serves it (with the tenant and the
    # status here SQLite would walk the tenant's active rows); both are checked after.
    on = and_(mh.slot.in_([bindparam("s1"), bindparam("s2"), bindparam("s3")]),
              mh.valid_from <= inst.c.p, or_(mh.valid_to.is_(None), mh.valid_to > inst.c.p))
    recorded = select(ev.recorded_at).where(ev.position == inst.c.p).scalar_subquery()
    return select(inst.c.p, inst.c.h, recorded, late, *_STORED_COLUMNS).select_from(
        inst.outerjoin(t.mem_history, on))


_GET_AT_TIME = PointQuery(_get_statement(True))
_GET_AT_POSITION = PointQuery(_get_statement(False))
#: A `mem_history` row of `_get_statement` (after its four leading columns).
_HistRow = namedtuple("_HistRow", [c.name for c in _STORED_COLUMNS])  # type: ignore[misc]


async def read_get(store: Store, who: reads.Principal, namespace: list[str], key: str, *,
                   as_of: str, task: str | None = None, session: str | None = None
                   ) -> dict[str, Any]:
    """`get` as of `as_of` with the instant in the answer (`as_of`, `position`): one
    statement over the stored history (on a SQLite file, run on the calling thread),
    or, when the history has not reached the instant, a replay (`get`)."""
    check_as_of(as_of)
    if not who.owns(namespace):
        return {"found": False}
    nsp = ns_path(namespace)
    slots = [slot_id(who.tenant, nsp, key, "long", ""),
             slot_id(who.tenant, nsp, key, "task", task) if task is not None else None,
             slot_id(who.tenant, nsp, key, "session", session) if session is not None
             else None]
    by_position = as_of.startswith(POSITION_PREFIX)
    q = _GET_AT_POSITION if by_position else _GET_AT_TIME
    values = {"s1": slots[0], "s2": slots[1], "s3": slots[2],
              "n": int(as_of[len(POSITION_PREFIX):]) if by_position else None,
              "at": None if by_position else _utc_text(to_us(parse_rfc3339(as_of)))}
    await store.open()
    raw = point_rows(store, q, values)
    if raw is None:
        async with store.read_once() as conn:
            raw = [tuple(r) for r in (await conn.execute(q.stmt, values)).all()]
    position, history_at, recorded = int(raw[0][0]), int(raw[0][1]), raw[0][2]
    if position > history_at:  # the history has not reached the instant: replay
        async with store.read() as conn:
            instant = await resolve(conn, as_of)
            then = await get(conn, who, namespace, key, instant=instant, task=task,
                             session=session)
        return {**then, **instant.wire()} if then.get("found") else then
    now_us = (to_us(parse_rfc3339(recorded)) if recorded else 0) if by_position else \
        to_us(parse_rfc3339(as_of))
    rows = []
    for r in raw:
        if r[4] is None:
            continue  # the instant's row alone: no slot was active then
        row = SimpleNamespace(**_HistRow._make(r[4:])._asdict())
        if row.status != "active" or row.tenant != who.tenant:
            continue
        if r[3] and not row.redacted:
            row.__dict__.update(dict.fromkeys(CONTENT), redacted=True)
        if _live(row, now_us):
            rows.append(row)
    if not rows:
        return {"found": False}
    best = min(rows, key=lambda r: reads.LAYER_RANK[r.layer])
    return {"found": True, **_item(best), "as_of": as_of, "position": position}


async def get(conn: AsyncConnection, who: reads.Principal, namespace: list[str], key: str, *,
              instant: Instant, task: str | None = None, session: str | None = None
              ) -> dict[str, Any]:
    """`reads.get` as of the instant: session beats task beats long-term."""
    if not who.owns(namespace):
        return {"found": False}
    nsp = ns_path(namespace)
    slots = [slot_id(who.tenant, nsp, key, "long", "")]
    if task is not None:
        slots.append(slot_id(who.tenant, nsp, key, "task", task))
    if session is not None:
        slots.append(slot_id(who.tenant, nsp, key, "session", session))
    if instant.stored:
        rows = await stored_rows(conn, who, instant, t.mem_history.c.slot.in_(slots))
    else:
        rows = [r for r in await memory_rows(conn, who, instant,
                                             t.events.c.slot.in_(slots))
                if r.status == "active"]
        await fill(conn, rows)
    rows = [r for r in rows if _live(r, instant.now_us)]
    if not rows:
        return {"found": False}
    best = min(rows, key=lambda r: reads.LAYER_RANK[r.layer])
    return {"found": True, **_item(best)}


async def history(conn: AsyncConnection, who: reads.Principal, namespace: list[str], key: str,
                  *, instant: Instant) -> list[dict[str, Any]]:
    """`reads.history` as of the instant: every version then, oldest first; forgotten
    ones (then) as `{"status": "forgotten", "redacted": true}`, ones forgotten since
    redacted with the status they had."""
    if not who.owns(namespace):
        return []
    ev = t.events.c
    rows = await memory_rows(conn, who, instant, ev.ns_path == ns_path(namespace),
                             ev.mkey == key)
    await fill(conn, rows)
    rows.sort(key=lambda r: (r.layer, r.task_key or "", r.session_id or "", r.version))
    out: list[dict[str, Any]] = []
    for r in rows:
        item = _item(r)
        if r.status == "forgotten":
            item.update(status="forgotten", value=None, redacted=True)
        item["superseded_by"] = r.superseded_by
        out.append(item)
    return out


async def active_memories(conn: AsyncConnection, who: reads.Principal, *, instant: Instant,
                          task: str | None = None, session: str | None = None
                          ) -> list[SimpleNamespace]:
    """`reads.active_memories` as of the instant (long-term, the task's, the session's);
    rows read from the stored history carry their text's embedding (`model`, `vector`)."""
    if instant.stored:
        rows = await stored_rows(conn, who, instant)
    else:
        rows = [r for r in await memory_rows(conn, who, instant) if r.status == "active"]
        await fill(conn, rows)
    return _in_scope(rows, instant, task, session)


def _in_scope(rows: Iterable[SimpleNamespace], instant: Instant, task: str | None,
              session: str | None) -> list[SimpleNamespace]:
    """The rows live at the instant in recall's layers: long-term, the task's, the
    session's."""
    return [r for r in rows if _live(r, instant.now_us) and (
        r.layer == "long" or (r.layer == "task" and r.task_key == task and task is not None)
        or (r.layer == "session" and session is not None and r.session_id == session))]


# -- tasks ------------------------------------------------------------------------------

async def tasks(conn: AsyncConnection, who: reads.Principal, *, instant: Instant,
                include_closed: bool = False) -> list[dict[str, Any]]:
    """`reads.tasks` as of the instant: the principal's tasks opened by then, each
    summarised from its notes recorded by then. Notes covered by a later forget are
    withheld (`"redacted": true` on the summary); a task covered as a whole by a later
    forget shows only its key and status."""
    ev, to = t.events.c, t.task_owners.c
    # The principal's tasks by their owner (the ledger's `task_owners`, a few rows per
    # principal, not the principal's whole history); those not opened by the instant
    # have no `task.opened` among the events read, and are left out below.
    owned = select(to.task_key).where(to.tenant == who.tenant,
                                      prefix_match(to.ns_path, who.prefix))
    q = select(*STORED_COLUMNS).where(
        ev.tenant == who.tenant, ev.position <= instant.position,
        ev.type.in_(("task.opened", "task.noted", "task.closed", "task.purged")),
        ev.task_key.in_(owned)).order_by(ev.position)
    by_task: dict[str, list[Any]] = {}
    for r in (await conn.execute(q)).all():
        se = stored_from_row(r)
        assert se.task_key is not None
        by_task.setdefault(se.task_key, []).append(se)
    tombs = await _tombstones(conn, who.tenant)
    past = [ts for ts in tombs if ts.position <= instant.position]
    out: list[dict[str, Any]] = []
    for task_key in sorted(by_task):
        events = by_task[task_key]
        owner = next((se.ns_path for se in events if se.type == "task.opened"), None)
        if owner is None:
            continue  # not opened by the instant
        withheld = 0
        notes: list[Note] = []
        for se in events:
            body = note_body(se)
            coords = Coordinates(se.tenant, se.order_key, ns_path=owner, task_key=task_key)
            if any(covers(ts, coords) for ts in past):
                pass  # forgotten by then: `summarize` leaves it out, as the view did
            elif body is None and se.suppressed:
                pass  # recorded without content: never part of the summary
            elif body is None or any(covers(ts, coords) for ts in tombs):
                withheld += 1  # forgotten or erased since: not shown, not undone
                body = None
            notes.append(Note(se.position, se.tenant, task_key, se.type, se.order_key, body))
        # The task as a whole, whatever the order: what `reads.tasks` hides.
        whole = Coordinates(who.tenant, ns_path=owner, task_key=task_key)
        if any(covers(ts, whole) for ts in past):
            continue  # forgotten or purged by then: gone then too
        row = summarize(who.tenant, task_key, owner, notes, past)
        if row["purged"] or (not include_closed and row["status"] != "open"):
            continue
        summary: dict[str, Any] = orjson.loads(row["summary"])
        if any(covers(ts, whole) for ts in tombs):
            summary = {"task_key": task_key, "status": row["status"], "redacted": True}
        elif withheld:
            summary["redacted"] = True
        out.append(summary)
    return out


# -- recall -----------------------------------------------------------------------------

def _relevance(rows: Sequence[SimpleNamespace], query: str | None,
               qvec: Any, texts_vecs: Any) -> dict[str, Candidate]:
    """Recall's candidates over the instant's rows: exact key, a key the query names,
    then cosine similarity of the memory's text (a redacted one: its key alone)."""
    if query is None:
        return {r.memory_id: Candidate(1.0, "in scope") for r in rows}
    words = norm_key(query).split()
    whole = " ".join(words)
    phrases = {" ".join(words[s:s + n]) for n in range(1, min(len(words), 6) + 1)
               for s in range(len(words) - n + 1)}
    phrases = {p for p in phrases if p != whole and (" " in p or len(p) >= 4)}
    sims = texts_vecs @ qvec if len(rows) else np.zeros(0)
    out: dict[str, Candidate] = {}
    for r, sim in zip(rows, sims, strict=True):
        k = norm_key(r.mkey)
        if k == whole:
            out[r.memory_id] = Candidate(1.0, "exact key match")
        elif k in phrases and float(sim) < KEY_NAMED:
            out[r.memory_id] = Candidate(KEY_NAMED, "the query names its key")
        else:
            out[r.memory_id] = Candidate(float(sim), "semantic match")
    return out


async def recall(store: Store, principal: str, *, as_of: str, query: str | None,
                 session: str | None, task: str | None, budget: int | None, limit: int,
                 now_us: int, stored: bool = True) -> dict[str, Any]:
    """`projections.recall.recall` as of the instant: the same ranking, overrides,
    budget and task matching over what the principal's memory held then, scored with
    the embeddings stored with the history's rows (`stored=False`: replayed from the
    ledger and embedded on demand, as when the history has not reached the instant).
    The audit record (R25) is written as for every recall, at `now_us`: ids, versions,
    scores and reasons of what was returned."""
    who = reads.Principal.parse(principal)
    await store.open()
    emb = await store_embedder(store)  # the ledger's recorded embedder, as live recall
    qtext = (query or "").strip() or None
    qvec = embed_queries(emb, [qtext])[0] if qtext else None
    instant = await resolve_now(store, as_of)
    if not stored:
        instant = replace(instant, history_at=0)
    # The stored history's rows at the instant, read on the calling thread where it can.
    found = stored_now(store, who, instant) if instant.stored else None
    if found is not None and point_rows(store, _OWNS_TASKS, {
            "tenant": who.tenant, "prefix": who.prefix}) == []:
        # Everything read on the calling thread, and no task to replay.
        rows, open_tasks = _in_scope(found, instant, task, session), []
    else:
        async with store.read() as conn:
            rows = (_in_scope(found, instant, task, session) if found is not None else
                    await active_memories(conn, who, instant=instant, task=task,
                                          session=session))
            open_tasks = await tasks(conn, who, instant=instant)
    vecs = _vectors(emb, rows) if qvec is not None and rows else None
    cands = _relevance(rows, qtext, qvec, vecs)
    items = rank(_kept(rows, cands) if qtext is not None else rows, cands, qtext is not None)
    chosen = relevant_tasks(open_tasks, _no_index(emb), emb, qtext, qvec, task)
    picked_tasks, picked, used = fit(chosen, items, budget, limit)
    redacted = {r.memory_id for r in rows if r.redacted}
    for item in picked:
        if item["memory_id"] in redacted:
            item["redacted"] = True
    audit_id = await write_audit(store, who, qtext, picked, picked_tasks, now_us)
    return {"items": picked, "tasks": picked_tasks, "audit_id": audit_id, "tokens": used,
            "budget": budget, **instant.wire()}


def _kept(rows: Sequence[SimpleNamespace], cands: dict[str, Candidate]
          ) -> list[SimpleNamespace]:
    """The rows of the keys `rank` keeps when there is a query: it drops a key whose
    rows are all long-term and below `MIN_RELEVANCE` (so ranking the rest alone gives
    the same result, without the cost of the many a long history leaves behind)."""
    keep: set[tuple[str, str]] = set()
    for r in rows:
        if r.layer != "long" or cands[r.memory_id].relevance >= MIN_RELEVANCE:
            keep.add((r.ns_path, r.mkey))
    return [r for r in rows if (r.ns_path, r.mkey) in keep]


def _vectors(emb: Embedder, rows: Sequence[SimpleNamespace]) -> Any:
    """The rows' text embeddings: stored with the history's rows when made by this
    embedder; embedded here otherwise (replayed rows, redacted ones: by key alone)."""
    out = np.zeros((len(rows), emb.dim), dtype=np.float32)
    todo = [i for i, r in enumerate(rows)
            if getattr(r, "vector", None) is None or r.model != emb.name]
    skip = set(todo)
    have = [i for i in range(len(rows)) if i not in skip]
    if have:
        out[have] = from_blobs([bytes(rows[i].vector) for i in have], emb.dim)
    if todo:
        out[todo] = emb.embed([memory_text(rows[i].mkey, rows[i].value, rows[i].text)
                               for i in todo])
    return out


def _no_index(emb: Embedder) -> PrincipalIndex:
    """An index that holds nothing: `relevant_tasks` then embeds each task's summary as
    it was at the instant (no vector of the past is kept)."""
    zero = np.zeros((emb.dim, 0), dtype=np.float32)
    return PrincipalIndex(
        position=0, pending=None, model=emb.name, dim=emb.dim, columns=zero, n=0,
        alive=np.zeros(0, dtype=np.bool_), ids=[], keys=[], orders=[], row_of={},
        key_rows={}, groups={}, task_ids=[], task_matrix=np.zeros((0, emb.dim), np.float32))


# -- audit ------------------------------------------------------------------------------

async def explain_memory(conn: AsyncConnection, tenant: str, memory_id: str,
                         instant: Instant) -> dict[str, Any] | None:
    """For `replay audit --as-of` (an operator read): the memory's version and status at
    the instant, the version of its slot that was active then, and the event that made
    each so. None if the memory was not written by then."""
    ev = t.events.c
    first = (await conn.execute(select(ev.ns_path, ev.slot).where(
        ev.tenant == tenant, ev.memory_id == memory_id, ev.type.in_(sorted(MEMORY_WRITES)),
        ev.position <= instant.position).order_by(ev.position).limit(1))).first()
    if first is None or first.ns_path is None:
        return None
    parts = first.ns_path.split("\x1f")
    owner = reads.Principal(parts[0], parts[1])
    rows = await memory_rows(conn, owner, instant, ev.slot == first.slot)
    mine = next(r for r in rows if r.memory_id == memory_id)
    marks = await _marks(conn, tenant, [memory_id], instant)
    tombs = [ts for ts in await _tombstones(conn, tenant) if ts.position <= instant.position]

    def made(r: SimpleNamespace) -> dict[str, Any]:
        """The event that gave the row its status at the instant."""
        if r.status == "forgotten":
            coords = Coordinates(r.tenant, r.order_key, r.memory_id, r.ns_path, r.mkey,
                                 r.task_key)
            hit = [ts.position for ts in tombs if covers(ts, coords)]
            return {"position": min(hit) if hit else r.position,
                    "why": "covered by this forget" if hit else "suppressed when recorded"}
        if r.status == "superseded":
            explicit = [m for m in marks if m.kind == "superseded" and m.target == r.memory_id
                        and m.position <= instant.position]
            if r.superseded_by is not None:
                newer = [x.position for x in rows if x.memory_id == r.superseded_by]
                if newer:
                    return {"position": newer[0], "why": "superseded by this write"}
            if explicit:
                return {"position": min(m.position for m in explicit),
                        "why": "superseded by this event"}
        confirmed = [m.position for m in marks if m.kind == "confirmed"
                     and m.target == r.memory_id and m.position <= instant.position]
        if r.candidate and confirmed and r.status == "active":
            return {"position": min(confirmed), "why": "confirmed by this event"}
        return {"position": r.position, "why": "written by this event"}

    def brief(r: SimpleNamespace) -> dict[str, Any]:
        return {"memory_id": r.memory_id, "version": r.version, "status": r.status,
                "layer": r.layer, "redacted": r.redacted, "made_by": made(r)}

    await fill(conn, [r for r in rows if r.status == "active"])
    active = [r for r in rows if _live(r, instant.now_us)]
    return {"memory": brief(mine), "active": brief(active[0]) if active else None}
