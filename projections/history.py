"""The history projection: every state each memory version held, with the ledger
positions it held for (`mem_history`), so an as-of read is a lookup, not a replay.

A row of `mem_history` is a `mem_versions` row as the memories view would have held it
with the ledger holding exactly the events at positions 1..P, for every P with
`valid_from` <= P < `valid_to` (`valid_to` NULL: still so). Intervals are exact to the
position, not to the batch: for every slot a batch reaches, the slot is resolved again
after *each* of the batch's events that can change it (a write into it, a mark aimed at
one of its memories or confirming a candidate whose `supersedes` aims into it, a forget
that reaches it), by the live projection's own pure function
(`projections.memory.resolve_slot`) over the facts recorded up to that position. A
memory whose state changed gets its open row closed at that position and a new one
opened. So the table does not depend on batching, shards or redelivery, and `replay
verify` compares it with a fresh replay like every other view.

Facts: the writes of the slot from the ledger, with `suppressed` as the event's own flag
(an erased payload is content removed since, not a suppression then); the marks from the
memories view's `mem_marks` up to its checkpoint and from the ledger after it (so this
view is right whether or not the memories view has caught up); the tombstones.

Forgotten content stays forgotten in the past: a row whose write a forget covers, in any
interval, holds no value, text, scope, expiry, session or vector (`redacted`): rows
written after the forget are written so, rows written before it are cleared when the
forget is applied. Active, unredacted rows carry the embedding of their text by the
ledger's recorded embedder (as the vector index's; model name beside it), computed once
per memory or, for a model, taken from the digest-keyed cache the index filled, so an
as-of recall scores without embedding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any, Final

from sqlalchemy import and_, bindparam, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import MEMORY_WRITES
from ledger.forgets import Coordinates, Tombstone, covers, covers_sql
from ledger.recorder import STORED_COLUMNS
from ledger.records import StoredEvent, stored_from_row
from ledger.store import Store
from ledger.vault import keyed
from projections import bulk, rounds
from projections.embed_cache import embed_items, lookup
from projections.embedding import is_cached
from projections.memory import WRITE_COLUMNS, Mark, WriteFact, marks_of, resolve_slot
from projections.memory import write_fact_of_row as _write_fact_of_row
from projections.protocol import finished, progressed
from projections.sql import (
    any_of,
    batches,
    bulk_sql_possible,
    close_history_rows,
    fetch,
    in_list,
    insert_rows,
    one_tenant,
    pairs_of,
    prepared,
)
from projections.vectors import embedder_named, memory_text, resolve_embedder, to_blob

FORGETS: Final = ("memory.forgotten", "task.purged")
#: Event types that set marks on a memory (`projections.memory.marks_of`).
MARK_TYPES: Final = ("memory.superseded", "memory.confirmed")
#: The projection that keeps `mem_marks`.
MEMORIES: Final = "memories"
#: This projection's name (its checkpoint says how far `mem_history` is complete).
HISTORY: Final = "history"
#: What decides whether a memory's row changed (its content is fixed by its write and
#: leaves only when it is forgotten, which changes its status).
_STATE: Final = ("version", "status", "superseded_by", "candidate")
#: Content a redaction removes from a row.
CONTENT: Final = ("value", "text", "scope", "expires_at", "expires_us", "session_id")


def fact_of_row(r: Sequence[Any]) -> tuple[WriteFact, bool]:
    """The write fact of an `events` row of `WRITE_COLUMNS` and whether its content was
    erased since it was recorded: `suppressed` is the event's own flag (a write erased
    after it was recorded was not suppressed then)."""
    fact = _write_fact_of_row(r)
    erased = fact.suppressed and not bool(r[WRITE_COLUMNS.index("suppressed")])
    return (dataclasses.replace(fact, suppressed=False) if erased else fact), erased


async def marks_upto(conn: AsyncConnection, tenant: str, ids: Iterable[str], upto: int,
                     done: int, ids_sql: Any = None) -> list[Mark]:
    """The marks aimed at `ids` set by events at positions up to `upto`: from
    `mem_marks` up to `done` (the memories view's checkpoint), from the ledger after it.
    `ids_sql`, a SELECT of those ids, saves sending many of them as parameters."""
    wanted = sorted(set(ids))
    if not wanted:
        return []
    mk = t.mem_marks.c
    out: list[Mark] = []
    parts = ([mk.target.in_(ids_sql)] if ids_sql is not None and len(wanted) > MANY
             else [any_of(conn, mk.target, chunk) for chunk in batches(conn, wanted)])
    for aimed in parts:
        q = select(t.mem_marks).where(mk.tenant == tenant, aimed,
                                      mk.position <= min(upto, done))
        out.extend(_mark_of_row(r) for r in (await conn.execute(q)).all())
    if upto > done:  # positions the view has not applied yet: from the ledger itself
        keep = {(tenant, mid) for mid in wanted}
        out += await _ledger_marks(conn, [tenant], done, upto, keep)
    return out


def _mark_of_row(r: Any) -> Mark:
    """A `mem_marks` row as a `Mark`."""
    return Mark(r.position, r.tenant, r.target, r.kind, bytes(r.order_key), r.by_id,
                r.via_candidate, r.owner)


async def _ledger_marks(conn: AsyncConnection, tenants: Sequence[str], done: int, upto: int,
                        keep: set[tuple[str, str]]) -> list[Mark]:
    """The marks set by the ledger's events after `done` up to `upto` (positions the
    memories view has not applied yet) aimed at the (tenant, memory id)s of `keep`."""
    ev = t.events.c
    tenant = ev.tenant == tenants[0] if len(tenants) == 1 else ev.tenant.in_(tenants)
    q = select(*STORED_COLUMNS).where(
        ev.position > done, ev.position <= upto, tenant,
        or_(ev.type.in_(MARK_TYPES),
            and_(ev.type.in_(sorted(MEMORY_WRITES)), ev.supersedes.is_not(None))))
    return [m for r in (await conn.execute(q)).all() for m in marks_of(stored_from_row(r))
            if (m.tenant, m.target) in keep]


#: More ids than this are matched by a subquery rather than sent as parameters.
MANY: Final = 400


class Reach:
    """The tombstones that can reach a slot, found by kind instead of by trying each
    (resolving many slots against many tombstones)."""

    def __init__(self, tombs: Sequence[Tombstone]) -> None:
        self.by_id: dict[str, list[Tombstone]] = {}
        self.by_key: dict[tuple[str | None, str | None], list[Tombstone]] = {}
        self.by_task: dict[str | None, list[Tombstone]] = {}
        self.prefixes: list[Tombstone] = []
        for ts in tombs:
            if ts.kind == "memory_id":
                self.by_id.setdefault(ts.memory_id or "", []).append(ts)
            elif ts.kind == "key":
                self.by_key.setdefault((ts.ns_path, ts.mkey), []).append(ts)
            elif ts.kind == "task":
                self.by_task.setdefault(ts.task_key, []).append(ts)
            else:
                self.prefixes.append(ts)

    def slot(self, ws: Sequence[WriteFact]) -> list[Tombstone]:
        """Every tombstone that may cover a write of this slot (the rule then decides)."""
        w = ws[0]
        out = [ts for x in ws for ts in self.by_id.get(x.memory_id, ())]
        out += self.by_key.get((w.ns_path, w.key), [])
        if w.task_key is not None:
            out += self.by_task.get(w.task_key, [])
        out += [ts for ts in self.prefixes if w.ns_path.startswith(ts.ns_path or "\x00")]
        return out


def coordinates(row: Any) -> Coordinates:
    """The forget rule's view of a row (a `resolve_slot` dict or a table row)."""
    d: dict[str, Any] = row if isinstance(row, dict) else vars(row)
    return Coordinates(d["tenant"], bytes(d["order_key"]), d["memory_id"], d["ns_path"],
                       d["mkey"], d["task_key"])


def redact(row: dict[str, Any]) -> None:
    """Remove a row's content (in place): what a forget erased stays erased in the past."""
    row.update(dict.fromkeys(CONTENT), redacted=True, model=None, vector=None)


async def checkpoint(conn: AsyncConnection, name: str) -> int:
    """A projection's checkpoint position (0 when it has none)."""
    cp = t.checkpoints.c
    row = (await conn.execute(select(cp.position).where(cp.name == name))).first()
    return int(row[0]) if row is not None else 0


@dataclasses.dataclass(slots=True)
class _Open:
    """A memory's open row: where it starts, its state, and the new row if unsaved."""

    valid_from: int
    state: tuple[Any, ...]
    new: dict[str, Any] | None = None


class _Changes:
    """The rows a batch closes and opens."""

    def __init__(self) -> None:
        self.open: dict[tuple[str, str], _Open] = {}
        self.closed: list[dict[str, Any]] = []  # open rows in the table to close
        self.rows: list[dict[str, Any]] = []  # new rows

    def state(self, row: dict[str, Any], p: int, redacted: bool) -> None:
        """The memory's state after position `p`: opens a row if it changed."""
        key = (row["tenant"], row["memory_id"])
        st = tuple(row[c] for c in _STATE)
        cur = self.open.get(key)
        if cur is not None and cur.state == st:
            return
        if cur is not None:
            if cur.new is not None:
                cur.new["valid_to"] = p
            else:
                self.closed.append({"k_tenant": key[0], "k_memory_id": key[1],
                                    "k_valid_from": cur.valid_from, "k_valid_to": p})
        new = {**row, "valid_from": p, "valid_to": None, "redacted": False, "model": None,
               "vector": None}
        if redacted:
            redact(new)
        self.rows.append(new)
        self.open[key] = _Open(p, st, new)


class HistoryProjection:
    """Validity intervals of the memories view's rows (the as-of reads' stored past)."""

    name = HISTORY
    tables = (t.mem_history,)
    types: tuple[str, ...] | None = (*MEMORY_WRITES, *MARK_TYPES, *FORGETS)
    #: Reads `mem_marks` (up to the memories view's checkpoint; the rest from the ledger).
    depends_on: tuple[str, ...] = (MEMORIES,)

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: dict[str, Any],
                        size: int) -> tuple[dict[str, Any] | None, int]:
        """One step of a bulk load into the emptied view (`replay rebuild`): the whole
        history of about `size` slots, in slot order, up to the load's head.

        The first step fixes the head at the memories view's checkpoint when that is
        lower (the marks come from `mem_marks` up to there, as a batch reads them; the
        slots are paged from the ledger's writes). Each slot is resolved at
        every position where one of its facts was recorded (`_resolve`), as the
        event-by-event projection resolves it at those of a batch, so the rows are the
        same; rows are written closed where they end, and redacted where any forget up
        to the head covers them (what the forget's own batch does to them). On SQLite
        the view's secondary indexes are dropped for the load and built at its end, and
        phases `reach` and `plain` write the plain slots by SQL first
        (`projections.bulk.history_plain_step`); `slots` then resolves the rest."""
        ev = t.events.c
        if "after" not in state:
            done = await checkpoint(conn, MEMORIES)
            state.update(head=min(int(state["head"]), done), after="", done=done)
            if bulk_sql_possible(store):  # SQLite: the indexes are built at the end
                await bulk.drop_indexes(conn, t.mem_history)
                if int(state["head"]) > 0 and await bulk.history_sql_start(conn):
                    state.update(phase="reach", after=0, sql=True)
        head, done = int(state["head"]), int(state["done"])
        phase = state.get("phase", "slots")
        if phase == "reach":  # the writes tombstones may reach: left to Python
            last = await bulk.history_reach_step(conn, head, int(state["after"]), size)
            if last is not None:
                state["after"] = last
                return progressed(state, 1)
            state.update(phase="plain", after=0)
            return progressed(state, 1)
        if phase == "plain":
            # The ledger's embedder, as `_embed` names the vectors it takes.
            model = embedder_named((await resolve_embedder(conn))[0]).name
            hi, n = await bulk.history_plain_step(conn, head, int(state["after"]), size,
                                                  model)
            if hi < head:
                state["after"] = hi
            else:
                state.update(phase="slots", after="")
            return progressed(state, n)
        if state.get("sql"):  # the slots the SQL path left
            slots, more = await bulk.history_rest_slots(conn, str(state["after"]), size)
        else:
            # From the ledger, not from `mem_versions`: a write the memories view
            # quarantined has no row there, and this view applies it all the same.
            slots = [r[0] for r in (await conn.execute(
                select(ev.slot).where(ev.slot > str(state["after"]),
                                      ev.type.in_(sorted(MEMORY_WRITES)), ev.position <= head)
                .distinct().order_by(ev.slot).limit(size))).all()] if head > 0 else []
            more = len(slots) == size
        if slots:
            changes = _Changes()
            await _resolve(conn, slots, None, None, None, head, done, changes, store)
            await _embed(store, conn, changes.rows)
            await insert_rows(store, conn, t.mem_history, changes.rows)
        if more:
            state["after"] = slots[-1]
            return progressed(state, len(slots))
        await bulk.create_indexes(conn, t.mem_history)
        if state.get("sql"):
            await bulk.history_sql_end(conn)
        return finished(state)

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        """Record every change the batch makes to the rows of the slots it reaches, at
        the position of the event that makes it; clear what its forgets cover.

        Every tenant of the batch at once: each statement covers the whole batch (a
        few per batch, not a few per tenant), and reads each row it needs once."""
        if not batch:
            return
        # In a fused round every checkpoint has been moved already (`projections.rounds`).
        facts = rounds.current()
        known = facts.position(MEMORIES) if facts is not None else None
        done = known if known is not None else await checkpoint(conn, MEMORIES)
        changes = _Changes()
        forgets = await _batch(store, conn, batch, done, changes)
        if changes.closed:
            await close_history_rows(conn, changes.closed)
        await _embed(store, conn, changes.rows)
        await insert_rows(store, conn, t.mem_history, changes.rows)
        mh = t.mem_history.c
        for ts in forgets:
            # Sought by `ix_memh_key` (a prefix forget by its range, `PrefixSeek`).
            await conn.execute(update(t.mem_history).where(
                covers_sql(ts, mh), mh.redacted.is_(False)).values(
                **dict.fromkeys(CONTENT), redacted=True, model=None, vector=None))


def _by_slot(rows: Iterable[Any], tenant_of: dict[str, str]) -> Iterable[Any]:
    """The rows whose tenant is their slot's (a slot id is a hash of its tenant among
    the rest: the check costs nothing and keeps the statements free of a tenant
    condition, which SQLite would otherwise serve from a tenant index)."""
    return (r for r in rows if tenant_of.get(r.slot) == r.tenant)


async def _batch(store: Store, conn: AsyncConnection, batch: Sequence[StoredEvent],
                 done: int, changes: _Changes) -> list[Tombstone]:
    """The batch's changes to `changes` (every tenant at once); returns the batch's
    tombstones (whose content the caller clears)."""
    ev = t.events.c
    writes_t = sorted(MEMORY_WRITES)
    lo, hi = batch[0].position, batch[-1].position
    tenants = sorted({se.tenant for se in batch})
    at: dict[str, set[int]] = {}  # slot -> positions of the batch that may change it
    tenant_of: dict[str, str] = {}  # slot -> its tenant
    for se in batch:
        if se.type in MEMORY_WRITES and se.slot:
            at.setdefault(se.slot, set()).add(se.position)
            tenant_of[se.slot] = se.tenant
    # (tenant, memory id) -> positions of marks that may change it
    aims: dict[tuple[str, str], set[int]] = {}
    confirms: dict[tuple[str, str], set[int]] = {}
    for m in (m for se in batch for m in marks_of(se)):
        aims.setdefault((m.tenant, m.target), set()).add(m.position)
        if m.kind == "confirmed":
            confirms.setdefault((m.tenant, m.target), set()).add(m.position)
    # A confirmed candidate's `supersedes` starts to count: its target's slot changes.
    for chunk in batches(conn, sorted(confirms)):
        q = select(ev.tenant, ev.memory_id, ev.supersedes).where(
            pairs_of(conn, ev.tenant, ev.memory_id, chunk), ev.type.in_(writes_t),
            ev.supersedes.is_not(None), ev.position <= hi)
        for tenant, mid, sup in (await conn.execute(q)).all():
            aims.setdefault((tenant, sup), set()).update(confirms[(tenant, mid)])
    for chunk in batches(conn, sorted(aims)):
        q = select(ev.tenant, ev.memory_id, ev.slot).where(
            pairs_of(conn, ev.tenant, ev.memory_id, chunk), ev.type.in_(writes_t),
            ev.position <= hi)
        for tenant, mid, slot in (await conn.execute(q)).all():
            at.setdefault(slot, set()).update(aims[(tenant, mid)])
            tenant_of[slot] = tenant
    tombs = await rounds.tombstones(store, conn, tenants, hi)
    forgets = [ts for ts in tombs if ts.position >= lo]
    for ts in forgets:
        q = select(ev.slot).where(ev.type.in_(writes_t), ev.position <= hi,
                                  covers_sql(ts, ev, order_key=None)).distinct()
        for r in (await conn.execute(q)).all():
            at.setdefault(r[0], set()).add(ts.position)
            tenant_of[r[0]] = ts.tenant
    if not at:
        return forgets
    await _resolve(conn, sorted(at), at, tenant_of, tombs, hi, done, changes, store)
    return forgets


async def _resolve(conn: AsyncConnection, slots: Sequence[str],
                   at: dict[str, set[int]] | None, tenant_of: dict[str, str] | None,
                   tombs: Sequence[Tombstone] | None, hi: int, done: int,
                   changes: _Changes, store: Store) -> None:
    """Resolve each of `slots` again at each position of `at[slot]` (the positions that
    may change it), from its facts up to `hi`, into `changes`; the open rows of those
    slots are read first (their state decides whether a row changes).

    `at` None (a bulk load into an empty view: no open rows, nothing read of the
    view): every position where a fact of the slot was recorded, which holds every
    position where its rows can change (one where none does opens no row). Rows are
    checked against `tenant_of` (slot -> tenant) where given. `tombs` None: the
    tombstones up to `hi` of the tenants whose writes were read."""
    ev, mh = t.events.c, t.mem_history.c
    writes_t = sorted(MEMORY_WRITES)
    facts: dict[str, list[WriteFact]] = {}
    erased: set[tuple[str, str]] = set()
    dialect = conn.dialect.name
    q = prepared(("history.slot_writes", dialect), lambda: select(
        *[keyed(ev[c]) if c == "payload" else ev[c] for c in WRITE_COLUMNS]).where(
        in_list(conn, ev.slot, "slots"), ev.type.in_(writes_t),
        ev.position <= bindparam("hi")))
    q2 = prepared(("history.open_rows", dialect), lambda: select(
        mh.tenant, mh.slot, mh.memory_id, mh.valid_from, *[mh[c] for c in _STATE]).where(
        in_list(conn, mh.slot, "slots"), mh.valid_to.is_(None)))
    for part in batches(conn, slots):
        chunk = list(part)
        got = (await conn.execute(q, {"slots": chunk, "hi": hi})).all()
        for r in (got if tenant_of is None else _by_slot(got, tenant_of)):
            f, gone = fact_of_row(r)
            facts.setdefault(f.slot, []).append(f)
            if gone:
                erased.add((f.tenant, f.memory_id))
        if at is None or tenant_of is None:
            continue
        for r in _by_slot((await conn.execute(q2, {"slots": chunk})).all(), tenant_of):
            changes.open[(r[0], r[2])] = _Open(int(r[3]), tuple(r[4:]))
    ids = {(f.tenant, f.memory_id) for fs in facts.values() for f in fs}
    if tombs is None:
        tombs = await store.tombstones(conn, sorted({k[0] for k in ids}), upto=hi) \
            if ids else []
    marks = await _marks(conn, ids, hi, done)
    vias = {(m.tenant, m.via_candidate) for m in marks if m.via_candidate}
    confirmed_at: dict[str, dict[str, int]] = {}  # tenant -> candidate -> position
    for m in await _marks(conn, vias, hi, done):
        if m.kind == "confirmed":
            mine = confirmed_at.setdefault(m.tenant, {})
            mine[m.target] = min(m.position, mine.get(m.target, m.position))
    by_target: dict[tuple[str, str], list[Mark]] = {}
    for m in marks:
        by_target.setdefault((m.tenant, m.target), []).append(m)
    reach: dict[str, Reach] = {}
    tombs_of: dict[str, list[Tombstone]] = {}
    for ts in tombs:
        tombs_of.setdefault(ts.tenant, []).append(ts)
    for slot in slots:
        ws_all = sorted(facts.get(slot, ()), key=lambda w: w.position)
        if not ws_all:
            continue
        tenant = ws_all[0].tenant
        if tenant not in reach:
            reach[tenant] = Reach(tombs_of.get(tenant, ()))
        ms_all = [m for w in ws_all for m in by_target.get((tenant, w.memory_id), ())]
        ts_all = reach[tenant].slot(ws_all)
        confirmed = confirmed_at.get(tenant, {})
        if at is not None:
            points = at[slot]
        else:
            points = {w.position for w in ws_all} | {m.position for m in ms_all} | {
                ts.position for ts in ts_all} | {
                confirmed[m.via_candidate] for m in ms_all
                if m.via_candidate and m.via_candidate in confirmed}
        for p in sorted(points):
            ws = [w for w in ws_all if w.position <= p]
            if not ws:
                continue
            ms = [m for m in ms_all if m.position <= p]
            conf = {c for c, cp in confirmed.items() if cp <= p}
            past = [ts for ts in ts_all if ts.position <= p]
            for row in resolve_slot(ws, ms, conf, past):
                hidden = (tenant, row["memory_id"]) in erased or any(
                    covers(ts, coordinates(row)) for ts in ts_all)
                changes.state(row, p, hidden)


async def _marks(conn: AsyncConnection, ids: Iterable[tuple[str, str]], upto: int,
                 done: int) -> list[Mark]:
    """The marks aimed at these (tenant, memory id)s set by events at positions up to
    `upto`, every tenant at once (`marks_upto`'s rule: from `mem_marks` up to `done`,
    the memories view's checkpoint; from the ledger after it)."""
    wanted = sorted(set(ids))
    if not wanted:
        return []
    mk = t.mem_marks.c
    out: list[Mark] = []
    one = prepared(("history.marks", conn.dialect.name), lambda: select(t.mem_marks).where(
        mk.tenant == bindparam("tenant"), in_list(conn, mk.target, "ids"),
        mk.position <= bindparam("upto")))
    for chunk in batches(conn, wanted):
        alone = one_tenant(chunk)
        if alone is not None:  # one tenant: the statement built once
            rows = (await conn.execute(one, {"tenant": alone[0], "ids": alone[1],
                                             "upto": min(upto, done)})).all()
        else:
            rows = (await conn.execute(select(t.mem_marks).where(
                pairs_of(conn, mk.tenant, mk.target, chunk),
                mk.position <= min(upto, done)))).all()
        out.extend(_mark_of_row(r) for r in rows)
    if upto > done:  # positions the view has not applied yet: from the ledger itself
        tenants = sorted({tenant for tenant, _ in wanted})
        out += await _ledger_marks(conn, tenants, done, upto, set(wanted))
    return out


def _vectors_of(conn: AsyncConnection, table: Any, ident: Any, extra: Sequence[Any]) -> Any:
    """SELECT (tenant, id, vector) of `table` for the tenant `:tenant`, the ids `:ids`
    and the model `:model` (`_embed`'s one-tenant statement; `in_list`: build it once per
    dialect)."""
    return select(table.c.tenant, ident, table.c.vector).where(
        table.c.tenant == bindparam("tenant"), in_list(conn, ident, "ids"),
        table.c.model == bindparam("model"), *extra)


async def _embed(store: Store, conn: AsyncConnection, rows: Sequence[dict[str, Any]]
                 ) -> None:
    """Give active, unredacted new rows their text's embedding, computed only when no
    copy made by the same model is at hand: the vector index's entry of the memory (it
    runs before this view, so it normally has every active memory of the batch), an
    earlier row of the memory, a model's digest-keyed cache; else embedded (all at
    once). A memory's text is fixed by its write, so any of these is its embedding."""
    want = [r for r in rows if r["status"] == "active" and not r["redacted"]]
    if not want:
        return
    # The ledger's embedder (`memledger config set embedder`, ...), as the index's.
    emb = embedder_named((await resolve_embedder(conn))[0])
    known: dict[tuple[str, str], bytes] = {}
    pairs = sorted({(r["tenant"], r["memory_id"]) for r in want})
    vc, mh = t.vectors.c, t.mem_history.c
    for table, ident, extra in ((t.vectors, vc.item_id, (vc.kind == "memory",)),
                                (t.mem_history, mh.memory_id, (mh.vector.is_not(None),))):
        for chunk in batches(conn, [k for k in pairs if k not in known]):
            alone = one_tenant(chunk)
            if alone is not None:  # one tenant: a statement built once per table
                q = prepared(("history.vectors_of", table.name, conn.dialect.name),
                             functools.partial(_vectors_of, conn, table, ident, extra))
                got: Iterable[Any] = (await conn.execute(q, {
                    "tenant": alone[0], "ids": alone[1], "model": emb.name})).all()
            else:
                got = await fetch(store, conn, select(table.c.tenant, ident, table.c.vector)
                                  .where(pairs_of(conn, table.c.tenant, ident, chunk),
                                         table.c.model == emb.name, *extra))
            for tenant, mid, vec in got:
                known[(tenant, mid)] = bytes(vec)
    todo: dict[tuple[str, str], str] = {}
    for r in want:
        k = (r["tenant"], r["memory_id"])
        if k not in known:
            todo[k] = memory_text(r["mkey"], r["value"], r["text"])
    if todo and is_cached(emb):
        hits, todo = await lookup(conn, emb, todo)
        known.update((k, to_blob(v)) for k, v in hits.items())
        # A model's vector is kept by digest, as the index keeps its own (a rebuild
        # then embeds no text again: the index never held a version superseded before
        # it ran), referenced by the memory, so a forget of it erases it
        # (`embed_cache.erase_items`). Not one a forget recorded by now covers: the
        # index may have applied that forget already.
        tombs = await store.tombstones(conn, sorted({k[0] for k in todo})) if todo else []
        of = {(r["tenant"], r["memory_id"]): r for r in want}
        keep = {k: x for k, x in todo.items()
                if not any(covers(ts, coordinates(of[k])) for ts in tombs)}
        if keep:
            vecs = await embed_items(store, conn, emb, list(keep), list(keep.values()))
            known.update({k: to_blob(v) for k, v in zip(keep, vecs, strict=True)})
            todo = {k: x for k, x in todo.items() if k not in keep}
    if todo:
        vecs = emb.embed(list(todo.values()))
        known.update({k: to_blob(v) for k, v in zip(todo, vecs, strict=True)})
    for r in want:
        r["model"], r["vector"] = emb.name, known[(r["tenant"], r["memory_id"])]
