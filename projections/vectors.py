"""The vector index: one embedding per active memory and per open task summary.

The `vectors` view holds, for every memory whose status is `active` in `mem_versions`
(expiry is a read-time fact and is re-checked by recall) and every open, unpurged task,
one float32 vector with the embedder's model name and width beside it. A superseded,
candidate or forgotten memory and a closed, purged or forgotten task have no entry
(R14, R20).

Entries are computed from the *current* rows of `mem_versions` and `tasks_view` for
the items a batch touches, never from the events alone: the active-memory rules live
in one place (`projections.memory`). So the result does not depend on whether this
projection runs ahead of or behind the views it reads; when it runs ahead, the range
it could not settle is remembered (`meta` row `vectors.pending_after`) and re-read with
the next batch, so the index converges once the other views catch up.

The embedder is the ledger's recorded one (`meta` row `config.embedder`, set by
`memledger config set embedder NAME`), else `MEMLEDGER_EMBEDDER`, else the model the
ledger's stored vectors carry (a ledger built before the default changed keeps its
model; the index records it then), else the default, `hashgram-v2-512`
(`resolve_embedder`). Changing it re-embeds everything through a rebuild of this
projection (`config set` runs it); until then recall ignores entries of another model.

A model embedder (`embedding.is_cached`) is slow, so its vectors are computed before
the batch's write transaction (`VectorProjection.prepare`, called by the runner) and
kept by content digest (`projections.embed_cache`); the transaction only reads them.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Final

import numpy as np
import orjson
import structlog
from numpy.typing import NDArray
from sqlalchemy import and_, bindparam, case, delete, false, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import False_

from ledger import schema as t
from ledger.events import MEMORY_WRITES, TASK_TYPES
from ledger.forgets import Tombstone, covers_sql
from ledger.records import StoredEvent
from ledger.store import Store
from projections import bulk, embed_cache, matrix_snapshot, rounds, shards
from projections.embedding import (
    DEFAULT_EMBEDDER,
    EMBEDDER_NAMES,
    Embedder,
    canonical_name,
    get_embedder,
    is_cached,
)
from projections.protocol import finished, progressed
from projections.reads import not_forgotten, task_not_forgotten
from projections.slots import covered_slots
from projections.sql import (
    batches,
    bulk_sql_possible,
    in_list,
    insert_ignore,
    insert_rows,
    page_after,
    pairs_of,
    prepared,
    tenant_part_where,
    tenant_parts,
)

log = structlog.get_logger("memledger.vectors")

EMBEDDER_ENV: Final = "MEMLEDGER_EMBEDDER"
#: `meta` row: events after this position may have been indexed from views that lagged.
PENDING_META: Final = "vectors.pending_after"
#: The views the index is computed from.
SOURCE_VIEWS: Final = ("memories", "tasks")
TASK_PREFIX: Final = "task:"
_FORGETS: Final = ("memory.forgotten", "task.purged")
_MARKS: Final = ("memory.superseded", "memory.confirmed")


_FACTORIES: dict[str, Callable[[], Embedder]] = {}


def register_embedder(name: str, factory: Callable[[], Embedder]) -> None:
    """Make `MEMLEDGER_EMBEDDER=name` build the embedder with `factory` (a plug-in).

    Register it in every process that indexes or recalls (workers, CLI, the app), before
    the first use; the vectors it writes carry `Embedder.name`, so give each model (and
    each version of it) a name of its own.
    """
    _FACTORIES[name.strip().lower()] = factory
    _embedder.cache_clear()


@lru_cache(maxsize=8)
def _embedder(name: str) -> Embedder:
    factory = _FACTORIES.get(name.lower())
    return factory() if factory is not None else get_embedder(name or None)


def current_embedder() -> Embedder:
    """The process's default embedder (`MEMLEDGER_EMBEDDER`), for a ledger that has
    none recorded (`store_embedder` gives a store's)."""
    return _embedder(os.environ.get(EMBEDDER_ENV, "").strip())


#: `meta` row: the ledger's embedder, by name (`memledger config set embedder NAME`).
EMBEDDER_META: Final = "config.embedder"
#: How long a process trusts the recorded name it read (recall reads it at most this
#: often per store; the index reads it in every batch's transaction).
RECORDED_TTL_S: Final = 2.0
_RECORDED: dict[str, tuple[float, str | None]] = {}


def embedder_named(name: str | None) -> Embedder:
    """The embedder of a resolved name (None: the process's default)."""
    return _embedder(name.strip()) if name else current_embedder()


async def recorded_embedder(conn: AsyncConnection) -> str | None:
    """The ledger's recorded embedder name, or None when none was recorded."""
    q = prepared("vectors.recorded_embedder", lambda: select(t.meta.c.value).where(
        t.meta.c.name == EMBEDDER_META))
    row = (await conn.execute(q)).first()
    return None if row is None else str(row[0])


async def record_embedder(conn: AsyncConnection, name: str | None) -> None:
    """Record (None: forget) the ledger's embedder name, in `conn`'s transaction."""
    await conn.execute(delete(t.meta).where(t.meta.c.name == EMBEDDER_META))
    if name:
        await conn.execute(t.meta.insert().values(name=EMBEDDER_META, value=name))
    _RECORDED.clear()


#: The bare family name of the hashed embedders: the version the ledger holds.
HASHGRAM: Final = "hashgram"


async def stored_model(conn: AsyncConnection, family: str | None = None) -> str | None:
    """A model name the ledger's stored vectors carry (the index's, else the stored
    history's), of the `family` (a name prefix) when given; None when there are none.
    One row of each table is read: a ledger's vectors are of one model, except while a
    change of embedder is being rebuilt, and then the new one is recorded. The rows are
    read in primary-key order, so the first one comes off the key's index (a plain
    `LIMIT 1` may plan a sequential scan on PostgreSQL, tests/projections/test_pg_plans.py)."""
    for table in (t.vectors, t.mem_history):
        model = table.c.model
        if family is None:  # what every round asks: the statement built once
            q = prepared(("vectors.stored_model", table.name), functools.partial(
                _first_model, table))
        else:
            q = select(model).where(model.is_not(None),
                                    model.startswith(family + "-", autoescape=True)
                                    ).order_by(*table.primary_key.columns).limit(1)
        row = (await conn.execute(q)).first()
        if row is not None:
            return str(row[0])
    return None


def _first_model(table: Any) -> Any:
    """SELECT the first non-null `model` of `table` in primary-key order."""
    return select(table.c.model).where(table.c.model.is_not(None)).order_by(
        *table.primary_key.columns).limit(1)


def _known(name: str) -> bool:
    """Whether a name is a registered plug-in's or a built-in embedder's (of any extra)."""
    key = name.strip().lower()
    if key in _FACTORIES:
        return True
    canonical = canonical_name(key)
    return canonical.startswith(HASHGRAM + "-v") or any(
        canonical in names for names in EMBEDDER_NAMES.values())


def given_name(name: str) -> str:
    """The name recorded for a name given to `config set embedder`: a registered
    plug-in's as given, a built-in's as its vectors carry it (the bare `hashgram`: the
    default, hashgram-v2-512; `embedding.canonical_name`)."""
    key = name.strip().lower()
    return key if key in _FACTORIES else canonical_name(key)


async def resolve_name(conn: AsyncConnection, name: str) -> str:
    """The embedder to use for a recorded or `MEMLEDGER_EMBEDDER` name in this ledger:
    `given_name`'s, except that the bare `hashgram` means the hashed version the
    ledger's vectors carry (a ledger that recorded `hashgram`, or ran with it in the
    environment, when it meant hashgram-v1 keeps v1), else the default."""
    key = name.strip().lower()
    if key != HASHGRAM:
        return given_name(key)
    held = await stored_model(conn, HASHGRAM)
    if held is not None and _known(held):
        return canonical_name(held)
    return DEFAULT_EMBEDDER


async def resolve_embedder(conn: AsyncConnection) -> tuple[str, str]:
    """The ledger's embedder name and where it comes from: `recorded` (`config set`),
    `MEMLEDGER_EMBEDDER` (the process's default for a ledger with none recorded),
    `vectors` (none of those: the model the ledger's stored vectors carry, so a ledger
    built before the default changed keeps the model it was built with), `default`
    (none of those: `DEFAULT_EMBEDDER`). Inside a projection round it is read once
    per round (`projections.rounds`: no one else writes `meta` in its transaction, and
    `settle_embedder` drops the memo when it records the name)."""
    facts = rounds.current()
    if facts is not None and "embedder" in facts.memo:
        got: tuple[str, str] = facts.memo["embedder"]
        return got
    got = await _resolve_embedder(conn)
    if facts is not None:
        facts.memo["embedder"] = got
    return got


async def _resolve_embedder(conn: AsyncConnection) -> tuple[str, str]:
    recorded = await recorded_embedder(conn)
    if recorded:
        return await resolve_name(conn, recorded), "recorded"
    env = os.environ.get(EMBEDDER_ENV, "").strip()
    if env:
        return await resolve_name(conn, env), EMBEDDER_ENV
    held = await stored_model(conn)
    if held is not None and _known(held):
        name = await resolve_name(conn, held)
        return name, "default" if name == DEFAULT_EMBEDDER else "vectors"
    if held is not None:
        log.warning("embedder_unknown", stored=held, using=DEFAULT_EMBEDDER,
                    hint="memledger config set embedder NAME")
    return DEFAULT_EMBEDDER, "default"


async def settle_embedder(store: Store, conn: AsyncConnection) -> str:
    """`resolve_embedder`'s name, recorded when it was read from the stored vectors or
    from a bare recorded `hashgram` (in `conn`, a write transaction of the index or
    the history view): a rebuild, which empties those tables first, then keeps the
    model, and `replay verify` replays with it."""
    name, source = await resolve_embedder(conn)
    recorded = None if source != "recorded" else await recorded_embedder(conn)
    if source == "vectors" or (recorded is not None and recorded != name
                               and recorded.strip().lower() == HASHGRAM):
        if recorded is not None:
            await conn.execute(update(t.meta).where(t.meta.c.name == EMBEDDER_META)
                               .values(value=name))
        else:
            await conn.execute(insert_ignore(store, t.meta),
                               [{"name": EMBEDDER_META, "value": name}])
        _RECORDED.clear()
        facts = rounds.current()
        if facts is not None:  # read again next time (a savepoint may undo the record)
            facts.memo.pop("embedder", None)
        log.info("embedder_recorded", embedder=name, source=source)
    return name


async def store_embedder(store: Store) -> Embedder:
    """The embedder a store's recalls query with (`resolve_embedder`). The name is
    re-read at most every `RECORDED_TTL_S` seconds; a change is followed by a rebuild
    of the index, and until then recall compares the query only with entries of its
    own model, so a stale read never mixes models."""
    now = time.monotonic()
    hit = _RECORDED.get(store.url)
    if hit is None or now - hit[0] > RECORDED_TTL_S:
        async with store.read_once() as conn:
            hit = (now, (await resolve_embedder(conn))[0])
        _RECORDED[store.url] = hit
    return embedder_named(hit[1])


def to_blob(vec: NDArray[np.float32]) -> bytes:
    """A vector as stored: little-endian float32 bytes."""
    return np.asarray(vec, dtype="<f4").tobytes()


def from_blobs(blobs: Sequence[bytes], dim: int) -> NDArray[np.float32]:
    """Stored vectors as one `(n, dim)` float32 matrix."""
    if not blobs:
        return np.zeros((0, dim), dtype=np.float32)
    return np.frombuffer(b"".join(blobs), dtype="<f4").reshape(len(blobs), dim).astype(
        np.float32, copy=False)


def columns_from_blobs(blobs: Sequence[bytes], dim: int, block: int = 1024,
                       capacity: int = 0) -> NDArray[np.float32]:
    """Stored vectors as one transposed `(dim, max(n, capacity))` matrix (columns past n
    are zero), built a block at a time: a blocked transpose is about three times faster
    than transposing 100k rows at once."""
    out = np.zeros((dim, max(len(blobs), capacity)), dtype=np.float32)
    for i in range(0, len(blobs), block):
        part = from_blobs(blobs[i:i + block], dim)
        out[:, i:i + len(part)] = part.T
    return out


def memory_text(key: str, value: bytes | None, text: str | None) -> str:
    """What a memory is indexed by: its `text` (validation defaults it to "key: value")."""
    if text:
        return text
    shown = "" if value is None else orjson.loads(value)
    return f"{key}: {shown if isinstance(shown, str) else orjson.dumps(shown).decode()}"


#: Every task's indexed text starts with this: users ask after "that ticket", "my order's
#: issue" or "那个工单" without naming it, and a task is exactly such a thing (R1, R4).
TASK_LABEL: Final = "open task, ticket, issue / 任务 工单"
#: The label's nouns: a query holding one asks after a task without naming it (R4).
TASK_NOUNS: Final = "task ticket issue 任务 工单"


def task_text(task_key: str, summary: dict[str, Any]) -> str:
    """What a task is indexed by: label, key, title, refs, reports, todos, system status."""
    parts = [TASK_LABEL, task_key, summary.get("title") or ""]
    for name, ref in (summary.get("refs") or {}).items():
        parts.append(f"{name} {ref}")
    parts.extend(r.get("text", "") for r in summary.get("reports") or [])
    parts.extend(c.get("text", "") for c in summary.get("corrections") or [])
    parts.extend(td.get("text", "") for td in summary.get("todos") or [] if not td.get("done"))
    system = summary.get("system") or {}
    if system.get("status"):
        parts.append(str(system["status"]))
    if system.get("text"):
        parts.append(str(system["text"]))
    return "\n".join(p for p in parts if p)


@dataclass
class Touched:
    """What a run of events can change in the index: memory ids, slots, tasks, forgets."""

    mem_ids: set[tuple[str, str]] = field(default_factory=set)
    slots: set[str] = field(default_factory=set)
    tasks: set[tuple[str, str]] = field(default_factory=set)
    forgets: set[int] = field(default_factory=set)  # positions of forgets and purges
    forget_tenants: set[str] = field(default_factory=set)

    async def tombstones(self, store: Store, conn: AsyncConnection, upto: int
                         ) -> list[Tombstone]:
        """The tombstones of the touched forgets and purges."""
        if not self.forgets:
            return []
        return [ts for ts in await store.tombstones(conn, self.forget_tenants, upto=upto)
                if ts.position in self.forgets]


def touched(events: Iterable[StoredEvent]) -> Touched:
    """The memory ids, slots, tasks and forgets a run of events touches."""
    out = Touched()
    for se in events:
        if se.type in MEMORY_WRITES and se.slot:
            out.slots.add(se.slot)
        if se.memory_id and (se.type in MEMORY_WRITES or se.type in _MARKS
                             or se.type == "memory.forgotten"):
            out.mem_ids.add((se.tenant, se.memory_id))
        if se.event is not None and (se.type in MEMORY_WRITES or se.type in _MARKS):
            for ref in ("supersedes", "superseded_by"):
                other = se.event.data.get(ref)
                if other:
                    out.mem_ids.add((se.tenant, str(other)))
        if se.type in TASK_TYPES and se.task_key:
            out.tasks.add((se.tenant, se.task_key))
        if se.type in _FORGETS:
            out.forgets.add(se.position)
            out.forget_tenants.add(se.tenant)
    return out


async def slots_of(conn: AsyncConnection, mem_ids: set[tuple[str, str]], slots: set[str],
                   tombs: Sequence[Tombstone]) -> set[str]:
    """Every slot whose entries those ids, slots and tombstones can change.

    The slots of the ids, those the tombstones cover, and one hop further: a confirmed
    candidate's `supersedes` reaches into another slot. Inside a fused round the answer
    for the same ids, slots and tombstones is read once (`projections.rounds`: the
    index and the lexical index ask alike, after the memories view has applied and
    before anything else writes it).
    """
    facts = rounds.current()
    key = ("slots_of", frozenset(mem_ids), frozenset(slots),
           tuple(sorted(ts.position for ts in tombs)))
    if facts is not None and key in facts.views:
        return set(facts.views[key])
    out = await _slots_of(conn, mem_ids, slots, tombs)
    if facts is not None:
        facts.views[key] = frozenset(out)
    return out


async def _slots_of(conn: AsyncConnection, mem_ids: set[tuple[str, str]], slots: set[str],
                    tombs: Sequence[Tombstone]) -> set[str]:
    mv = t.mem_versions.c
    out = set(slots)
    for ts in tombs:
        out.update(await covered_slots(conn, ts))
    dialect = conn.dialect.name
    by_id = prepared(("vectors.slots_of_ids", dialect), lambda: select(mv.slot).where(
        mv.tenant == bindparam("tenant"), in_list(conn, mv.memory_id, "ids")))
    out.update(await _slots_of_ids(conn, by_id, mem_ids))
    hop: set[tuple[str, str]] = set()
    refs = prepared(("vectors.slot_refs", dialect), lambda: select(
        mv.tenant, mv.supersedes, mv.superseded_by).where(in_list(conn, mv.slot, "slots")))
    for chunk in batches(conn, sorted(out)):
        for r in (await conn.execute(refs, {"slots": list(chunk)})).all():
            hop.update((r.tenant, x) for x in (r.supersedes, r.superseded_by) if x)
    out.update(await _slots_of_ids(conn, by_id, hop - mem_ids))
    return out


async def _slots_of_ids(conn: AsyncConnection, by_id: Any, ids: set[tuple[str, str]]
                        ) -> set[str]:
    """The slots of these (tenant, memory id)s: per tenant by `by_id` (`tenant = ? AND
    memory_id IN (...)`, the primary key) in chunks; on PostgreSQL one statement for
    them all over arrays (`by_id` for one tenant, else `pairs_of`)."""
    out: set[str] = set()
    mv = t.mem_versions.c
    for tenant, part in tenant_parts(conn, ids):
        q = (by_id if tenant is not None else
             select(mv.slot).where(pairs_of(conn, mv.tenant, mv.memory_id, part)))
        params = {"tenant": tenant, "ids": part} if tenant is not None else {}
        out.update(r[0] for r in (await conn.execute(q, params)).all())
    return out


async def memory_ids_of_slots(conn: AsyncConnection, slots: Iterable[str]
                              ) -> set[tuple[str, str]]:
    """(tenant, memory_id) of every version in those slots."""
    out: set[tuple[str, str]] = set()
    for chunk in batches(conn, sorted(set(slots))):
        out.update((r[0], r[1]) for r in (await conn.execute(_ids_of_slots(conn),
                                                             {"slots": list(chunk)})).all())
    return out


def _ids_of_slots(conn: AsyncConnection) -> Any:
    """(tenant, memory_id) of the `mem_versions` rows of the slots `:slots` (built once)."""
    mv = t.mem_versions.c
    return prepared(("vectors.ids_of_slots", conn.dialect.name), lambda: select(
        mv.tenant, mv.memory_id).where(in_list(conn, mv.slot, "slots")))


def _slot_rows_query(conn: AsyncConnection) -> Any:
    """Every `mem_versions` row of the slots `:slots` with the indexes' columns
    (`_MEMORY_COLUMNS`) and, last, `indexed`: 1 where an index holds it (active, not
    forgotten), else 0 (built once)."""
    mv = t.mem_versions.c

    def build() -> Any:
        keep = and_(mv.status == "active", not_forgotten())
        return select(*(getattr(mv, c) for c in _MEMORY_COLUMNS),
                      case((keep, 1), else_=0).label("indexed")).where(
            in_list(conn, mv.slot, "slots"))
    return prepared(("vectors.slot_rows", conn.dialect.name), build)


async def slot_rows(conn: AsyncConnection, slots: Iterable[str]) -> list[Any]:
    """Every `mem_versions` row of these slots (`_slot_rows_query`: the index's columns
    and `indexed`), what this index and the lexical one both read of a batch's slots.
    Inside a fused round the rows of the same slots are read once (`projections.rounds`:
    after the memories view has applied, before anything else writes it)."""
    wanted = frozenset(slots)
    facts = rounds.current()
    key = ("slot_rows", wanted)
    if facts is not None and key in facts.views:
        return list(facts.views[key])
    rows: list[Any] = []
    for chunk in batches(conn, sorted(wanted)):
        rows.extend((await conn.execute(_slot_rows_query(conn),
                                        {"slots": list(chunk)})).all())
    if facts is not None:
        facts.views[key] = tuple(rows)
    return rows


_MEMORY_COLUMNS: Final = ("tenant", "memory_id", "ns_path", "mkey", "layer", "task_key",
                           "session_id", "value", "text")


def _memory_rows_query() -> Any:
    mv = t.mem_versions.c
    return select(*(getattr(mv, c) for c in _MEMORY_COLUMNS))


def _task_rows_query() -> Any:
    tv = t.tasks_view.c
    return select(tv.tenant, tv.task_key, tv.ns_path, tv.summary).where(
        tv.status == "open", tv.purged.is_(False), tv.ns_path.is_not(None),
        task_not_forgotten())


class VectorProjection:
    """Keeps `vectors` equal to {active memories} + {open tasks}, embedded."""

    name = "vectors"
    tables = (t.vectors,)
    types: tuple[str, ...] | None = None  # every event: any may touch an indexed item
    depends_on: tuple[str, ...] = SOURCE_VIEWS

    def __init__(self, embedder: Embedder | None = None) -> None:
        self._fixed = embedder
        #: Vectors `prepare` computed for the next batch, outside its transaction.
        self._ready: embed_cache.Ready = {}
        #: Until then (monotonic seconds) `prepare` does not look: the ledger's
        #: embedder was found not to be a cached model.
        self._plain_until = 0.0

    @property
    def embedder(self) -> Embedder:
        """The embedder of this projection (fixed at construction, else the env's)."""
        return self._fixed or current_embedder()

    async def embedder_in(self, conn: AsyncConnection, store: Store | None = None
                          ) -> Embedder:
        """The embedder of this projection for a ledger: fixed at construction, else the
        ledger's (`resolve_embedder`, read in `conn`; with `store`, `conn` is the
        batch's write transaction and a name read from stored vectors is recorded)."""
        if self._fixed is not None:
            return self._fixed
        if store is not None:
            return embedder_named(await settle_embedder(store, conn))
        return embedder_named((await resolve_embedder(conn))[0])

    async def prepare(self, store: Store, size: int, owned: frozenset[int] | None = None
                      ) -> int:
        """Embed, before the write transaction, the texts the next batch (or bulk-load
        step) of at most `size` positions will index and the cache lacks; the batch then
        takes them from memory (`embed_cache.embed_items`). Only for a cached (model)
        embedder; anything this misses (another runner moved first, an index behind
        its views) is embedded inside the transaction as before. Returns how many texts
        it embedded."""
        self._ready.clear()
        # Most embedders are not cached models (the hashed default): then there is
        # nothing to embed ahead, and once that is seen no read transaction is opened
        # for RECORDED_TTL_S. A change to a model seen late only means its first
        # batches embed inside their transaction, as anything `prepare` misses.
        if self._fixed is not None and not is_cached(self._fixed):
            return 0
        if time.monotonic() < self._plain_until:
            return 0
        async with store.read() as conn:
            emb = await self.embedder_in(conn)
            if not is_cached(emb):
                self._plain_until = time.monotonic() + RECORDED_TTL_S
                return 0
            texts = await self._next_texts(store, conn, size, owned)
            if not texts:
                return 0
            _found, todo = await embed_cache.lookup(conn, emb, {x: x for x in texts})
        # The embedding itself runs with no connection held (a model takes seconds).
        return embed_cache.embed_into(emb, todo.values(), self._ready)

    async def _next_texts(self, store: Store, conn: AsyncConnection, size: int,
                          owned: frozenset[int] | None) -> list[str]:
        """The texts the next step will embed, read without a lock (a guess: the step
        re-reads everything in its transaction)."""
        cp = t.checkpoints.c
        row = (await conn.execute(select(cp.position).where(cp.name == self.name))).first()
        position = 0 if row is None else int(row[0])
        mv, tv = t.mem_versions.c, t.tasks_view.c
        if position == 0:
            state = await conn.execute(select(t.meta.c.value).where(
                t.meta.c.name == self.name + ".bulk"))
            found = state.first()
            if found is not None:
                bulk = orjson.loads(found[0])
                after = bulk.get("after")
                if bulk.get("phase", "memories") == "memories":
                    rows = await page_after(conn, _memory_rows_query().where(
                        mv.status == "active", not_forgotten()),
                        (mv.tenant, mv.memory_id), after, size)
                    return [memory_text(r.mkey, r.value, r.text) for r in rows]
                rows = await page_after(conn, _task_rows_query(), (tv.tenant, tv.task_key),
                                        after, size)
                return [task_text(r.task_key, orjson.loads(r.summary)) for r in rows]
        events = await store.read_events(conn, position, size, position + size)
        if owned is not None:
            count = await shards.shard_count(conn)
            events = [se for se in events if shards.shard_of(se.tenant, count) in owned]
        touch = touched(events)
        tombs = await touch.tombstones(store, conn, position + size)
        _every, wanted = await _memory_rows(conn, touch.mem_ids, touch.slots, tombs)
        tasks = await _task_rows(conn, touch.tasks, tombs)
        return ([memory_text(r.mkey, r.value, r.text) for r in wanted]
                + [task_text(r.task_key, orjson.loads(r.summary)) for r in tasks])

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: dict[str, Any],
                        size: int) -> tuple[dict[str, Any] | None, int]:
        """One step of a bulk load (`projections.bulk`): index the views as they are.

        The first step fixes the load's head at the position both source views have
        reached (the entries are read from the views, which may by then hold later
        events too: those events are indexed again, by the ordinary projection, after
        the load). Phases: `memories` (active rows, by primary key), then `tasks`.
        """
        if "phase" not in state:
            state.update(head=min(int(state["head"]), await _source_views_position(conn)),
                         phase="memories", after=None)
            if bulk_sql_possible(store):  # SQLite: the index by namespace is built last
                await bulk.drop_indexes(conn, t.vectors)
        mv, tv = t.mem_versions.c, t.tasks_view.c
        emb = await self.embedder_in(conn, store)
        if state["phase"] == "memories":
            rows = await page_after(conn, _memory_rows_query().where(
                mv.status == "active", not_forgotten()),
                (mv.tenant, mv.memory_id), state["after"], size)
            await insert_rows(store, conn, t.vectors,
                              await self._memory_entries(store, conn, emb, rows))
            if len(rows) == size:
                state["after"] = [rows[-1].tenant, rows[-1].memory_id]
            else:
                state.update(phase="tasks", after=None)
            return progressed(state, len(rows))
        rows = await page_after(conn, _task_rows_query(), (tv.tenant, tv.task_key),
                                state["after"], size)
        await insert_rows(store, conn, t.vectors,
                          await self._task_entries(store, conn, emb, rows))
        if len(rows) < size:
            if bulk_sql_possible(store):
                await bulk.create_indexes(conn, t.vectors)
            return finished(state)
        state["after"] = [rows[-1].tenant, rows[-1].task_key]
        return progressed(state, len(rows))

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        """Recompute the entries of every memory slot and task the batch touches."""
        await apply_settling(store, conn, batch, self._sync, PENDING_META, SOURCE_VIEWS)

    async def _sync(self, store: Store, conn: AsyncConnection,
                    events: Sequence[StoredEvent], upto: int) -> None:
        touch = touched(events)
        tombs = await touch.tombstones(store, conn, upto)
        emb = await self.embedder_in(conn, store)
        await self._sync_memories(store, conn, emb, touch.mem_ids, touch.slots, tombs)
        await self._sync_tasks(store, conn, emb, touch.tasks, tombs)

    async def _sync_memories(self, store: Store, conn: AsyncConnection, emb: Embedder,
                             mem_ids: set[tuple[str, str]], slots: set[str],
                             tombs: Sequence[Tombstone]) -> None:
        vc = t.vectors.c
        for ts in tombs:
            # The cached vectors of every version the forget reaches (their texts have
            # left the views already; `embedding_refs` still names their digests).
            covered = await memory_ids_of_slots(conn, await covered_slots(conn, ts))
            covered.update((ts.tenant, r[0]) for r in (await conn.execute(
                select(vc.item_id).where(vc.tenant == ts.tenant, vc.kind == "memory",
                                         _covered_entries(ts)))).all())
            await embed_cache.erase_items(conn, covered)
            # And every recall snapshot file holding one of them (R20).
            matrix_snapshot.erase(store.url, ts.tenant, (m for _, m in covered),
                                  ns_prefix=ts.ns_path if ts.kind == "prefix" else None)
            # Drop every entry the forget covers, stale ones included; what the slot
            # still holds (a write said again after the forget) is re-added below.
            await conn.execute(delete(t.vectors).where(vc.tenant == ts.tenant,
                                                       _covered_entries(ts)))
        every, wanted = await _memory_rows(conn, mem_ids, slots, tombs)
        if not every:
            return
        gone = prepared(("vectors.delete_memories", conn.dialect.name), lambda: delete(
            t.vectors).where(vc.tenant == bindparam("tenant"),
                             in_list(conn, vc.item_id, "ids"), vc.kind == "memory"))
        # Per tenant on SQLite (the primary key); on PostgreSQL one statement over
        # arrays for every tenant of the batch (`tenant_parts`).
        for tenant, part in tenant_parts(conn, every):
            if tenant is not None:
                await conn.execute(gone, {"tenant": tenant, "ids": part})
            else:
                await conn.execute(delete(t.vectors).where(
                    pairs_of(conn, vc.tenant, vc.item_id, part), vc.kind == "memory"))
        if not wanted:
            return
        await insert_rows(store, conn, t.vectors,
                          await self._memory_entries(store, conn, emb, wanted))

    async def _sync_tasks(self, store: Store, conn: AsyncConnection, emb: Embedder,
                          tasks: set[tuple[str, str]], tombs: Sequence[Tombstone]) -> None:
        vc = t.vectors.c
        tasks = set(tasks)
        tasks.update(await _covered_tasks(conn, tombs))
        if not tasks:
            return
        if tombs:
            # A purge or forget of a task erases the cached vectors of all its summaries.
            gone = await _covered_tasks(conn, tombs) | {
                (tenant, key) for tenant, key in tasks
                if await _task_purged_or_gone(conn, tenant, key)}
            await embed_cache.erase_items(conn, {(a, TASK_PREFIX + k) for a, k in gone})
            for tenant in {a for a, _ in gone}:
                matrix_snapshot.erase(store.url, tenant,
                                      task_keys=[k for a, k in gone if a == tenant])
        for owner, part in tenant_parts(conn, {(a, TASK_PREFIX + k) for a, k in tasks}):
            await conn.execute(delete(t.vectors).where(
                tenant_part_where(conn, vc.tenant, vc.item_id, owner, part),
                vc.kind == "task"))
        wanted = await _task_rows(conn, tasks, ())
        if not wanted:
            return
        await insert_rows(store, conn, t.vectors,
                          await self._task_entries(store, conn, emb, wanted))

    async def _memory_entries(self, store: Store, conn: AsyncConnection, emb: Embedder,
                              rows: Sequence[Any]) -> list[dict[str, Any]]:
        if not is_cached(emb):
            return memory_entries(emb, rows)
        matrix = await embed_cache.embed_items(
            store, conn, emb, [(r.tenant, r.memory_id) for r in rows],
            [memory_text(r.mkey, r.value, r.text) for r in rows], self._ready)
        return memory_entries(emb, rows, matrix)

    async def _task_entries(self, store: Store, conn: AsyncConnection, emb: Embedder,
                            rows: Sequence[Any]) -> list[dict[str, Any]]:
        if not is_cached(emb):
            return task_entries(emb, rows)
        matrix = await embed_cache.embed_items(
            store, conn, emb, [(r.tenant, TASK_PREFIX + r.task_key) for r in rows],
            [task_text(r.task_key, orjson.loads(r.summary)) for r in rows], self._ready)
        return task_entries(emb, rows, matrix)


async def _memory_rows(conn: AsyncConnection, mem_ids: set[tuple[str, str]], slots: set[str],
                       tombs: Sequence[Tombstone]) -> tuple[list[tuple[str, str]], list[Any]]:
    """Every (tenant, memory id) whose entry a batch may change, and the active rows of
    those the index must hold (read only: `prepare` reads them outside the transaction)."""
    slots = await slots_of(conn, mem_ids, slots, tombs)
    if not slots:
        return [], []
    rows = await slot_rows(conn, slots)
    every: list[tuple[str, str]] = [(r.tenant, r.memory_id) for r in rows]
    wanted: list[Any] = [r for r in rows if r.indexed]
    # Also whatever the index holds for the touched ids (stale rows from any source).
    every.extend(mem_ids)
    return every, wanted


async def _covered_tasks(conn: AsyncConnection, tombs: Sequence[Tombstone]
                         ) -> set[tuple[str, str]]:
    """The tasks the forgets reach as a whole (a purge's own task is touched anyway)."""
    tv = t.tasks_view.c
    out: set[tuple[str, str]] = set()
    for ts in tombs:
        q = select(tv.tenant, tv.task_key).where(covers_sql(ts, tv, order_key=None))
        out.update((r[0], r[1]) for r in (await conn.execute(q)).all())
    return out


async def _task_purged_or_gone(conn: AsyncConnection, tenant: str, key: str) -> bool:
    """A task whose summary is gone from the view or purged (its cached vectors go)."""
    tv = t.tasks_view.c
    row = (await conn.execute(select(tv.purged).where(tv.tenant == tenant,
                                                      tv.task_key == key))).first()
    return row is None or bool(row[0])


async def _task_rows(conn: AsyncConnection, tasks: set[tuple[str, str]],
                     tombs: Sequence[Tombstone]) -> list[Any]:
    """The open, unpurged, unforgotten rows of these tasks (and of those `tombs` reach)."""
    tv = t.tasks_view.c
    tasks = set(tasks) | await _covered_tasks(conn, tombs)
    wanted: list[Any] = []
    for tenant, part in tenant_parts(conn, tasks):
        q = _task_rows_query().where(
            tenant_part_where(conn, tv.tenant, tv.task_key, tenant, part))
        wanted.extend((await conn.execute(q)).all())
    return wanted


def memory_entries(emb: Embedder, rows: Sequence[Any],
                   matrix: NDArray[np.float32] | None = None) -> list[dict[str, Any]]:
    """The index entries of active `mem_versions` rows (tenant, memory_id, ns_path, mkey,
    layer, task_key, session_id, value, text), embedded in one batch (or given)."""
    if not rows:
        return []
    if matrix is None:
        matrix = emb.embed([memory_text(r.mkey, r.value, r.text) for r in rows])
    return [{"tenant": r.tenant, "item_id": r.memory_id, "kind": "memory",
             "ns_path": r.ns_path, "layer": r.layer, "task_key": r.task_key,
             "session_id": r.session_id, "model": emb.name, "dim": emb.dim,
             "vector": to_blob(matrix[i])} for i, r in enumerate(rows)]


def task_entries(emb: Embedder, rows: Sequence[Any],
                 matrix: NDArray[np.float32] | None = None) -> list[dict[str, Any]]:
    """The index entries of open `tasks_view` rows (tenant, task_key, ns_path, summary)."""
    if not rows:
        return []
    if matrix is None:
        matrix = emb.embed([task_text(r.task_key, orjson.loads(r.summary)) for r in rows])
    return [{"tenant": r.tenant, "item_id": TASK_PREFIX + r.task_key, "kind": "task",
             "ns_path": r.ns_path, "layer": "task", "task_key": r.task_key,
             "session_id": None, "model": emb.name, "dim": emb.dim,
             "vector": to_blob(matrix[i])} for i, r in enumerate(rows)]


def _covered_entries(ts: Tombstone) -> Any:
    """SQL over `vectors`: entries a tombstone reaches, whatever their order (the index
    keeps no order; what the slot still holds is re-added). A memory entry's key is its
    `mem_versions` row's (the index has no key column).

    Only the kinds of entry the tombstone can reach are named: an `OR` with a branch
    that is never true (a key forget reaches no task entry) would leave SQLite only the
    tenant to seek `ix_vectors_ns` by, and each forget would read every entry of its
    tenant (`tests/projections/test_forget_seek.py`)."""
    vc, mv = t.vectors.c, t.mem_versions.c
    mkey = select(mv.mkey).where(mv.tenant == vc.tenant, mv.memory_id == vc.item_id
                                 ).scalar_subquery()
    branches = [and_(vc.kind == kind, cond) for kind, cond in (
        ("memory", covers_sql(ts, vc, memory_id=vc.item_id, mkey=mkey)),
        ("task", covers_sql(ts, vc))) if not isinstance(cond, False_)]
    return or_(*branches) if branches else false()


async def _source_views_position(conn: AsyncConnection) -> int:
    """How far every view the index reads from has got, in every shard (never run: 0)."""
    return min((await shards.low_watermarks(conn, SOURCE_VIEWS)).values())


async def apply_settling(store: Store, conn: AsyncConnection, batch: Sequence[StoredEvent],
                         sync: Callable[[Store, AsyncConnection, Sequence[StoredEvent], int],
                                        Awaitable[None]],
                         meta: str, views: Sequence[str]) -> None:
    """Apply an index fed from `views` (this one, `projections.lexical`): `sync` the
    batch's items, together with those an earlier batch indexed while the views lagged
    (kept per shard in `meta` rows, re-read now, of this batch's shards only: the
    others' entries are their runners'), then record what is still unsettled."""
    start, end = batch[0].position, batch[-1].position
    scope = shards.current_scope() or shards.Scope(await shards.shard_count(conn))
    events: list[StoredEvent] = list(batch)
    pending = await get_pending(conn, scope, meta)
    after = pending if pending is not None else start - 1
    while after < start - 1:
        more = await store.read_events(conn, after, 2000, upto=start - 1)
        if not more:
            break
        events.extend(se for se in more if scope.covers(se.tenant))
        after = more[-1].position
    await sync(store, conn, events, end)
    lag = await source_shard_positions(conn, scope, views)
    unsettled = {k: p for k, p in lag.items() if p < end}
    if pending is not None or unsettled:  # else no row to delete and none to write
        await set_pending(conn, scope, unsettled, meta)


async def source_shard_positions(conn: AsyncConnection, scope: shards.Scope,
                                 views: Sequence[str]) -> dict[int, int]:
    """Per shard of the scope, how far every one of `views` has got (an index fed
    from views: this one, `projections.lexical`). Inside a fused round the round's
    checkpoints are known (`projections.rounds`: every one moved, no shard rows)."""
    facts = rounds.current()
    if facts is not None:
        known = [facts.position(name) for name in views]
        if all(p is not None for p in known):
            low = min(p for p in known if p is not None)
            return dict.fromkeys(scope.members(), low)
    at = await shards.shard_positions(conn, views, scope.count, scope.members())
    return {k: min(at[name][k] for name in views) for k in scope.members()}


def pending_name(shard: int, meta: str = PENDING_META) -> str:
    """The `meta` row of a shard's unsettled range (`vectors.pending_after.<shard>`)."""
    return f"{meta}.{shard}"


async def get_pending(conn: AsyncConnection, scope: shards.Scope,
                       meta: str = PENDING_META) -> int | None:
    """The earliest unsettled position of the scope's shards (and of the whole index, a
    row written before shards)."""
    names = [meta, *(pending_name(k, meta) for k in scope.members())]
    q = prepared("vectors.pending", lambda: select(t.meta.c.value).where(
        t.meta.c.name.in_(bindparam("names", expanding=True))))
    rows = (await conn.execute(q, {"names": names})).all()
    return min((int(r[0]) for r in rows), default=None)


async def set_pending(conn: AsyncConnection, scope: shards.Scope,
                       pending: dict[int, int], meta: str = PENDING_META) -> None:
    """Record each shard's unsettled range (None settles them all): one row per shard,
    so runners of disjoint shards never write the same `meta` row."""
    names = [pending_name(k, meta) for k in scope.members()]
    if scope.shards is None:
        names.append(meta)
    await conn.execute(delete(t.meta).where(t.meta.c.name.in_(names)))
    if pending:
        await conn.execute(t.meta.insert(), [{"name": pending_name(k, meta), "value": str(p)}
                                             for k, p in sorted(pending.items())])

