"""LangGraph's `BaseStore` over a memledger ledger: `MemledgerStore` (docs/langgraph.md).

`MemledgerStore()` is a drop-in for `InMemoryStore()` (a private temporary SQLite
ledger, removed on close), `MemledgerStore.from_conn_string(url)` for `SqliteStore`,
`AsyncMemledgerStore.from_conn_string(url)` for `AsyncSqliteStore`. Each put is a
`memory.written` event (operator source naming the store, source time now with a
sequence), each delete a `memory.forgotten` (erased as every forget is, R20), so the
store keeps history (`history()`) and forgets that hold. Install with the extra
`memledger[langgraph]`; the core does not import LangGraph.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import numpy as np
import orjson
from langgraph.store.base import (
    BaseStore,
    GetOp,
    IndexConfig,
    InvalidNamespaceError,
    Item,
    ListNamespacesOp,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
    ensure_embeddings,
    get_text_at_path,
    tokenize_path,
    validate_op_namespace,
)
from langgraph.store.memory import _compare_values, _does_match

from ledger import builders
from ledger.builders import Source
from ledger.errors import AccessDenied
from ledger.events import NS_SEP, Event, ns_path
from ledger.validation import MAX_ID_CHARS, MAX_NS_PART_CHARS, MAX_TEXT_CHARS
from memledger._ledger import MemoryLedger
from memledger.results import MemoryVersion
from projections import reads, store_reads
from projections.runner import Runner

T = TypeVar("T")

#: memledger namespaces have at most 8 parts; the first is the tenant.
MAX_LABELS = 7
_ESC = "~"


# -- the reversible mapping ----------------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _safe(text: str, max_chars: int) -> bool:
    return (bool(text) and len(text) <= max_chars and "/" not in text
            and not text.startswith(_ESC) and _CONTROL.search(text) is None)


def encode_label(label: str, max_chars: int = MAX_NS_PART_CHARS) -> str:
    """A LangGraph label as a memledger namespace part: as it is where memledger accepts
    it, else `~` and its percent-encoding (so `/`, control characters and a leading `~`
    round-trip)."""
    if _safe(label, max_chars):
        return label
    out = _ESC + quote(label, safe="")
    if len(out) > max_chars:
        raise InvalidNamespaceError(
            f"label {label[:40]!r} is longer than memledger's {max_chars}-character limit "
            "once encoded")
    return out


def decode_label(part: str) -> str:
    """The inverse of `encode_label`."""
    return unquote(part[1:]) if part.startswith(_ESC) else part


def encode_key(key: str) -> str:
    """A LangGraph key as a memledger key (the same encoding as a label)."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a string, got {type(key).__name__}")
    if _safe(key, MAX_ID_CHARS):
        return key
    out = _ESC + quote(key, safe="")
    if len(out) > MAX_ID_CHARS:
        raise ValueError(f"key {key[:40]!r} is longer than {MAX_ID_CHARS} characters encoded")
    return out


def _at_us(order_key: bytes) -> int:
    return int.from_bytes(order_key[:8], "big") - (1 << 63)


def _at(order_key: bytes) -> datetime:
    return datetime.fromtimestamp(_at_us(order_key) / 1e6, UTC)


def _lookup(value: dict[str, Any], key: str) -> Any:
    """A filter key's value: the top-level key, else a dotted path into nested objects."""
    if key in value or "." not in key:
        return value.get(key)
    cur: Any = value
    for part in key.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _rfc3339(us: int) -> str:
    return datetime.fromtimestamp(us / 1e6, UTC).isoformat(timespec="microseconds")


def _cosine(q: np.ndarray[Any, Any], m: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    qn = float(np.linalg.norm(q))
    mn = np.linalg.norm(m, axis=1)
    out = np.zeros(len(m))
    ok = (mn != 0) & (qn != 0)
    out[ok] = (m[ok] @ q) / (mn[ok] * qn)
    return out


def _rows(vectors: Sequence[Sequence[float]]) -> np.ndarray[Any, Any]:
    """An item's field vectors as one float array (one row each; none: no rows). Kept
    so in the store's cache: an array is one object the garbage collector never
    walks, where a list of lists of floats is several per item."""
    got = np.asarray(vectors, dtype=float)
    return got if got.ndim == 2 else got.reshape(len(vectors), 0)


def _ranked(q: np.ndarray[Any, Any], vecs: Sequence[np.ndarray[Any, Any]], offset: int,
            limit: int) -> list[tuple[int, float | None]]:
    """A ranked page: (candidate number, score) by score (the best of a candidate's
    field vectors), ties in candidate order, then candidates without vectors (score
    None) in order while the page has room. One matrix product for all candidates, and
    the order by one stable sort in numpy (score descending, then candidate number)."""
    lens = np.fromiter((len(v) for v in vecs), dtype=np.int64, count=len(vecs))
    who = np.flatnonzero(lens)
    page: list[tuple[int, float | None]] = []
    if len(who):
        cos = _cosine(q, np.concatenate([vecs[int(n)] for n in who]))
        starts = np.concatenate(([0], np.cumsum(lens[who])[:-1]))
        best = np.maximum.reduceat(cos, starts)
        order = np.lexsort((who, -best))[offset:offset + limit]
        page = [(int(who[i]), float(best[i])) for i in order]
    if len(page) < limit:
        page += [(int(n), None) for n in np.flatnonzero(lens == 0)[:limit - len(page)]]
    return page


#: The views a store's rounds keep: its items (`memories`, which get, search,
#: list_namespaces and history read) and the erasure of a delete's content from the
#: ledger's payloads. memledger's other views (tasks, recall's vectors and lexical
#: index, the stored history of as-of reads) serve readers a LangGraph store does not
#: have; they are kept by whoever keeps them (`memledger worker`, `memledger project`,
#: a `MemoryLedger` on the same ledger), and by the store too once any process has
#: (`_Rounds.choose`; docs/langgraph.md, "Writes").
STORE_VIEWS = frozenset({"memories", "erasure"})

#: How long a put's projection round waits for the puts that follow it, to share it:
#: while only writes arrive, the views trail this store's appends by at most this plus
#: a round. A read through the store, a delete, `close()` and the TTL sweep start the
#: round at once and wait for it.
ROUND_DELAY_S = 0.02
#: A round starts at once when this many positions are appended and not yet projected
#: (a batch put of 1,000 items does not wait `ROUND_DELAY_S`); below the runner's
#: batch, so a round over them stays one view transaction (`Runner.round`).
ROUND_MAX_PENDING = 256


def _retrieved(task: asyncio.Task[None]) -> None:
    """Mark a round's exception as seen by asyncio (`_Rounds.failed` keeps it for the
    store's next caller)."""
    if not task.cancelled():
        task.exception()


class _Rounds:
    """A store's projection rounds, run on its loop (docs/langgraph.md, "Writes").

    A put returns once its append has committed (durable, R14/R16); `wrote` then
    schedules a round, shared by the puts that follow within `ROUND_DELAY_S`. `reach`
    waits until every view has reached a position, starting a round at once if none
    is running (one runs at a time and catches every view up to the head it reads at
    its start, so writers and readers waiting together share it). An error a round
    raises reaches its waiters; raised where nobody waited, it is kept in `failed`
    until the store's next caller (`raise_failed`) or `close()` is given it."""

    def __init__(self, ml: MemoryLedger) -> None:
        self.ml = ml
        #: the runner of the views this store keeps (`choose`); every view until then
        self.runner: Runner = ml.runner
        #: the highest position this store has appended (committed)
        self.appended = 0
        #: the position every view has reached through this store's rounds
        self.projected = 0
        self.count = 0  # rounds run
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.Handle | None = None
        self._failed: BaseException | None = None
        self._lock = threading.Lock()  # `failed` is read by callers' threads

    def behind(self, upto: int | None = None) -> bool:
        """Whether the views are behind `upto` (default: every append of this store)."""
        return self.projected < (self.appended if upto is None else upto)

    def _running(self) -> bool:
        return self._task is not None and not self._task.done()

    def wrote(self, position: int) -> None:
        """An append up to `position` has committed: a round is due (on the loop)."""
        self.appended = max(self.appended, position)
        if self.behind() and not self._running():
            if self.appended - self.projected >= ROUND_MAX_PENDING:
                self._start()
            elif self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(
                    ROUND_DELAY_S, self._due)

    def _due(self) -> None:
        self._timer = None
        if self.behind() and not self._running():
            self._start()

    def _start(self) -> asyncio.Task[None]:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = self._task = asyncio.get_running_loop().create_task(self._one())
        task.add_done_callback(_retrieved)
        return task

    async def _one(self) -> None:
        self.count += 1
        try:
            # the head is read inside the round's one view transaction (`Runner.round`)
            runner = self.runner
            head = await runner.round()
        except Exception as exc:
            with self._lock:
                self._failed = exc
            raise
        if runner is self.runner:  # else `choose` added views this round did not run
            self.projected = max(self.projected, head)
        if self.behind() and self._timer is None:
            # appended after the round read its head: the next round is due (once
            # this one is done; a waiter may start it sooner)
            loop = asyncio.get_running_loop()
            self._timer = (loop.call_soon(self._due)
                           if self.appended - self.projected >= ROUND_MAX_PENDING
                           else loop.call_later(ROUND_DELAY_S, self._due))

    async def choose(self) -> None:
        """Keep the views the store reads (`STORE_VIEWS`) and every other view that
        some process keeps (its position past 0), with the views each reads: a delete
        then erases its copies in all of them before it returns. Run at open and
        before each round a delete or the TTL sweep waits for. A view this adds is
        behind, so the next `reach` runs a round for it."""
        full = self.ml.runner
        at = await full.positions()
        kept = set(STORE_VIEWS) | {name for name, position in at.items() if position > 0}
        for proj in reversed(full.projections):  # each after the views it reads
            if proj.name in kept:
                kept.update(proj.depends_on)
        before = {p.name for p in self.runner.projections}
        if kept == before:
            return
        if kept >= {p.name for p in full.projections}:
            self.runner = full
        else:
            self.runner = Runner(full.store, [p for p in full.projections if p.name in kept],
                                 full.batch_size)
        added = kept - before
        if added:
            self.projected = min([self.projected, *(at.get(name, 0) for name in added)])

    async def reach(self, upto: int | None = None) -> None:
        """Return once every view has reached `upto` (default: every append of this
        store so far). Raises what the round it waited for raised."""
        target = self.appended if upto is None else upto
        while self.projected < target:
            task = self._task if self._running() else self._start()
            assert task is not None
            try:
                await asyncio.shield(task)
            except Exception as exc:
                with self._lock:
                    if self._failed is exc:  # given to this caller: not kept
                        self._failed = None
                raise

    def raise_failed(self) -> None:
        """Raise (once) what a round nobody waited for raised."""
        with self._lock:
            exc, self._failed = self._failed, None
        if exc is not None:
            raise exc


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread,
              ml: MemoryLedger, rounds: _Rounds, tmpdir: str | None) -> None:
    if loop.is_running():
        with contextlib.suppress(Exception):  # `close()` settled and raised already
            asyncio.run_coroutine_threadsafe(rounds.reach(), loop).result(timeout=300)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(ml.close(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(timeout=30)
    if not loop.is_running():
        loop.close()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


class MemledgerStore(BaseStore):
    """A LangGraph store whose items are memledger memories (docs/langgraph.md).

    `url=None` opens a private temporary SQLite ledger removed on `close()` (or when
    the store is garbage-collected); `url=` any memledger URL (SQLite or PostgreSQL).
    Namespaces `(a, b, ...)` are stored as `[tenant, a, b, ...]`. `principal=
    "TENANT/USER"` scopes the store to the namespaces whose first label is USER, in
    the SQL of every read. `register_path`: the ledger's forget register, when not the
    default place (docs/forgetting.md).
    """

    supports_ttl: bool = True

    def __init__(self, *, index: IndexConfig | None = None, ttl: TTLConfig | None = None,
                 url: str | None = None, tenant: str = "langgraph",
                 principal: str | None = None, name: str = "MemledgerStore",
                 register_path: str | None = None) -> None:
        self._tmpdir: str | None = None
        if url is None:
            self._tmpdir = tempfile.mkdtemp(prefix="memledger-langgraph-")
            url = f"sqlite+aiosqlite:///{self._tmpdir}/store.db"
        self.url = url
        self.tenant = tenant
        self.ttl_config = ttl
        self._owner: str | None = None
        if principal is not None:
            who = reads.Principal.parse(principal)
            if who.tenant != tenant:
                raise AccessDenied(f"principal {principal!r} is not of tenant {tenant!r}")
            self._owner = ns_path([tenant, encode_label(who.user)])
        self.index_config: dict[str, Any] | None = None
        self.embeddings: Any = None
        if index:
            self.index_config = dict(index)
            self.embeddings = ensure_embeddings(index.get("embed"))
            fields: Any = index.get("fields") or index.get("text_fields") or ["$"]
            if isinstance(fields, str):
                fields = [fields]
            self.index_config["__tokenized_fields"] = [
                (p, tokenize_path(p)) if p != "$" else (p, p) for p in fields]
        self.source_id = f"langgraph:{name}:{uuid.uuid4().hex[:12]}"
        self._seq = itertools.count(1)
        self._last_us = 0
        #: LangGraph namespace -> its memledger namespace (`_ns`)
        self._encoded: dict[tuple[str, ...], tuple[str, ...]] = {}
        #: memory_id -> its field vectors (`_rows`)
        self._vectors: dict[str, np.ndarray[Any, Any]] = {}
        # `inline_writes` (MemoryLedger's default, said here because a put depends on it):
        # a put's append and projection round each in one hand-off to a thread of their
        # own, not a hand-off per statement to the driver's (SQLite files, `ledger.inline`).
        self._ml = MemoryLedger(url, register_path=register_path, inline_writes=True)
        self._opened = False
        self._gate: asyncio.Semaphore | None = None
        #: Projection rounds: run after a put returns, shared, waited for by reads
        self._rounds = _Rounds(self._ml)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="memledger-langgraph")
        self._thread.start()
        self._sweeper: threading.Thread | None = None
        self._sweep_stop = threading.Event()
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread,
                                           self._ml, self._rounds, self._tmpdir)

    # -- life cycle --------------------------------------------------------------------
    @classmethod
    @contextlib.contextmanager
    def from_conn_string(cls, conn_string: str, *, index: IndexConfig | None = None,
                         ttl: TTLConfig | None = None, **kwargs: Any
                         ) -> Iterator[MemledgerStore]:
        """A store over `conn_string` (a memledger URL, a SQLite file path, or
        `:memory:` for a private temporary ledger), closed on exit."""
        store = cls(index=index, ttl=ttl, url=_url(conn_string), **kwargs)
        try:
            yield store
        finally:
            store.close()

    def setup(self) -> None:
        """Open the ledger (creating the schema of a new one)."""
        self._call(self._open())

    def close(self) -> None:
        """Stop the sweeper, wait for the projection round of the last puts, release
        the ledger, remove a private temporary ledger. Raises what a round raised
        that no caller was given (after releasing everything)."""
        self._stop_sweeper()
        try:
            if self._finalizer.alive and self._opened and self._loop.is_running():
                self._call(self._rounds.reach())
                self._rounds.raise_failed()
        finally:
            self._finalizer()

    def flush(self) -> None:
        """Return once every view shows every write this store has returned: the
        projection round a put leaves to the background has run (another store or
        process on the same ledger then reads them; this store's own reads wait for it
        anyway). Raises what a round raised that no caller was given."""
        self._rounds.raise_failed()
        self._call(self._rounds.reach())

    async def aflush(self) -> None:
        """`flush`, awaitable."""
        self._rounds.raise_failed()
        await self._acall(self._rounds.reach())

    @property
    def rounds(self) -> int:
        """Projection rounds run by this store."""
        return self._rounds.count

    async def _open(self) -> None:
        if not self._opened:
            await self._ml.open()
            await self._rounds.choose()
            self._opened = True

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("MemledgerStore: a sync call from inside its own loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _acall(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    # -- BaseStore ---------------------------------------------------------------------
    def batch(self, ops: Iterable[Op]) -> list[Result]:
        ops = list(ops)
        self._rounds.raise_failed()
        upto = self._rounds.appended  # read-your-writes: every put returned before now
        if self._rounds.behind(upto) and not all(isinstance(op, PutOp) for op in ops):
            self._call(self._rounds.reach(upto))
        got = self._read_now(ops, embeds=self._embeds_sync, upto=upto)
        return got if got is not None else self._call(self._batch(ops))

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        ops = list(ops)
        self._rounds.raise_failed()
        # no query embedding here: a sync embedder would block the caller's event loop;
        # behind this store's puts, `_batch` waits for their round on the loop
        got = self._read_now(ops, embeds=False, upto=self._rounds.appended)
        return got if got is not None else await self._acall(self._batch(ops))

    @property
    def _embeds_sync(self) -> bool:
        """Can the calling thread embed a query (not an async-only embed function)?"""
        return (self.embeddings is not None
                and not (getattr(self.embeddings, "afunc", None) is not None
                         and getattr(self.embeddings, "func", None) is None))

    # -- the mapping -------------------------------------------------------------------
    def _ns(self, namespace: Sequence[str]) -> list[str]:
        key = tuple(namespace)
        got = self._encoded.get(key)
        if got is None:
            if len(namespace) > MAX_LABELS:
                raise InvalidNamespaceError(f"memledger stores at most {MAX_LABELS} "
                                            f"namespace labels, got {namespace}")
            if len(self._encoded) >= 4096:  # a bounded memo: batches reuse few namespaces
                self._encoded.clear()
            got = self._encoded[key] = (self.tenant, *(encode_label(x) for x in namespace))
        return list(got)

    def _prefix(self, namespace: Sequence[str]) -> str:
        return ns_path(self._ns(namespace[:MAX_LABELS]))

    def _item(self, row: Any, cls: type[Item] = Item, **extra: Any) -> Any:
        parts = row.ns_path.split(NS_SEP)[1:-1]
        return cls(namespace=tuple(decode_label(p) for p in parts),
                   key=decode_label(row.mkey), value=orjson.loads(row.value),
                   created_at=_at(row.created_key or row.order_key),
                   updated_at=_at(row.order_key), **extra)

    def _source(self) -> Source:
        now = max(time.time_ns() // 1000, self._last_us)
        self._last_us = now
        return Source.operator(self.source_id, seq=next(self._seq), at=_rfc3339(now))

    def _owned(self, namespace: Sequence[str]) -> bool:
        return self._owner is None or self._prefix(namespace[:1]) == self._owner

    @property
    def _refreshes(self) -> bool:
        """Reads refresh TTLs only when TTLConfig says `refresh_on_read` (as SqliteStore)."""
        return bool((self.ttl_config or {}).get("refresh_on_read", False))

    # -- the batch ---------------------------------------------------------------------
    async def _batch(self, ops: list[Op]) -> list[Result]:
        """The reads of a batch (at most 4 batches at once: fewer than the ledger's
        connection pool), then its writes, outside the gate: they hold no connection of
        their own (the ledger's append queue and the shared projection round write)."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(4)
        if not all(isinstance(op, PutOp) for op in ops):
            await self._rounds.reach()  # the views show every put this store returned
        async with self._gate:
            results, puts, refresh = await self._batch_reads(ops)
        await self._write(puts, refresh)
        return results

    @staticmethod
    def _validate(ops: list[Op]) -> None:
        for op in ops:
            if not isinstance(op, GetOp | PutOp | SearchOp | ListNamespacesOp):
                raise ValueError(f"Unknown operation type: {type(op)}")
            validate_op_namespace(op)

    def _read_now(self, ops: list[Op], *, embeds: bool, upto: int | None = None
                  ) -> list[Result] | None:
        """A batch of reads answered on the calling thread with point reads (a SQLite
        file: no hop to the store's loop thread, none to the driver's); None when the
        batch writes, ranks by a query, refreshes TTLs, the ledger is not open yet, the
        views have not reached `upto` (default: every append of this store; the
        caller passes what it had appended when the call began; the loop path waits
        for their round) or the backend has no point reads, and
        `_batch` answers it on the loop.

        The SQL is the loop path's: the tenant, the principal's prefix, active,
        unexpired and covered by no tombstone, checked by SQLite on every call. A search
        with a query is answered here when the vectors of every candidate are in the
        process's cache (`_ranked_now`) and `embeds` (a sync call whose embedder is
        sync) lets the calling thread embed the query."""
        if not self._opened or self._refreshes or not ops or self._rounds.behind(upto):
            return None
        for op in ops:
            if isinstance(op, PutOp) or (isinstance(op, SearchOp) and op.query
                                         and self.embeddings and not embeds):
                return None
        self._validate(ops)
        store = self._ml.store
        now_us = time.time_ns() // 1000
        results: list[Result] = []
        for op in ops:
            if isinstance(op, GetOp):
                target = (ns_path(self._ns(op.namespace)), encode_key(op.key))
                rows = store_reads.get_now(store, self.tenant, target, now_us=now_us,
                                           owner_prefix=self._owner)
                if rows is None:
                    return None
                # a value that opens as None: its key was destroyed since the read
                # (a forget racing the get), or the ledger's keys are absent
                results.append(self._item(rows[-1]) if rows and rows[-1].value is not None
                               else None)
            elif isinstance(op, SearchOp):
                found = (self._ranked_now(op, now_us) if op.query and self.embeddings
                         else self._search_now(op, now_us))
                if found is None:
                    return None
                results.append(found)
            elif isinstance(op, ListNamespacesOp):
                paths = store_reads.namespaces_now(store, self.tenant, now_us=now_us,
                                                   owner_prefix=self._owner)
                if paths is None:
                    return None
                results.append(self._list_of(paths, op))
            else:
                return None  # a put: the loop path (not reached: puts returned above)
        return results

    def _search_now(self, op: SearchOp, now_us: int) -> list[SearchItem] | None:
        """An unranked search with point reads; None where they are not available.
        Without a filter one statement answers it (`store_reads.page_now`: the page and
        its items' created times). With a filter: the newest `offset + limit` rows
        below the prefix (`store_reads.window_now`: their created times and the
        tombstone test of those rows only, in the same statement), then, if too few
        pass or one is covered, every row (a second statement: SQLite reads and sorts
        the prefix's rows for any LIMIT, so growing windows would each cost about a
        full read) and the created times of the page's items. Values are read as
        stored, each opened and decoded only as the filter reaches it (the page's end
        stops it)."""
        store = self._ml.store
        prefix, plain = self._search_plan(op)
        opener = reads.value_opener(store)
        path = self._prefix(prefix)
        if plain:
            page = store_reads.page_now(
                store, self.tenant, path, now_us=now_us,
                owner_prefix=self._owner, limit=op.limit, offset=op.offset)
            if page is None:
                return None
            out: list[SearchItem] = []
            names: dict[str, tuple[str, ...]] = {}
            for r in page:
                raw = opener(r.value)
                if raw is None:  # its key was destroyed since the read: forgotten
                    continue
                updated = _at(r.order_key)
                first = (updated if not r.created_key or r.created_key == r.order_key
                         else _at(r.created_key))
                out.append(SearchItem(
                    namespace=self._ns_of(r.ns_path, names), key=decode_label(r.mkey),
                    value=orjson.loads(raw), created_at=first, updated_at=updated,
                    score=None))
            return out
        wanted = op.offset + op.limit
        got = store_reads.window_now(store, self.tenant, path, now_us=now_us,
                                     limit=wanted, owner_prefix=self._owner)
        if got is None:
            return None
        window, live = got
        if live:
            found = self._candidates(op, prefix, window, wanted, opener)
            if len(found) >= wanted or len(window) < wanted:
                # the page the window's snapshot gives over every row: its rows are
                # the newest live ones, and those after them come after the page
                return [SearchItem(namespace=ns, key=decode_label(r.mkey), value=value,
                                   created_at=_at(r.created_key or r.order_key),
                                   updated_at=_at(r.order_key), score=None)
                        for r, ns, value in self._decoded(
                            found[op.offset:op.offset + op.limit], opener)]
        rows = store_reads.below_now(store, self.tenant, path, now_us=now_us,
                                     owner_prefix=self._owner, opened=False)
        if rows is None:
            return None
        found = self._candidates(op, prefix, rows, wanted, opener)
        kept = self._decoded(found[op.offset:op.offset + op.limit], opener)
        created = self._created(store, [r for r, _, _ in kept])
        if created is None:
            return None
        return [SearchItem(namespace=ns, key=decode_label(r.mkey), value=value,
                           created_at=_at(created.get(r.slot) or r.order_key),
                           updated_at=_at(r.order_key), score=None)
                for r, ns, value in kept]

    def _created(self, store: Any, rows: Sequence[Any]) -> dict[str, bytes] | None:
        """The created keys of a page's `below_now` rows, by slot: looked up for the
        rows that are not their slot's first version only (`store_reads.first_of`)."""
        known = store_reads.first_of(rows)
        rest = store_reads.created_now(store, self.tenant,
                                       [r.slot for r in rows if r.slot not in known])
        return None if rest is None else known | rest

    @staticmethod
    def _ns_of(path: str, names: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
        """The LangGraph namespace of a namespace path (memo `names`: one search's)."""
        ns = names.get(path)
        if ns is None:
            ns = names[path] = tuple(decode_label(p) for p in path.split(NS_SEP)[1:-1])
        return ns

    @classmethod
    def _candidates(cls, op: SearchOp, prefix: tuple[str, ...], rows: Iterable[Any],
                    wanted: int | None, opener: Callable[[Any], Any]
                    ) -> list[tuple[Any, tuple[str, ...] | None, Any]]:
        """The rows below `prefix` that pass the filter, in row order, with their
        namespaces where known (None: `_decoded` finds it); at most `wanted` (rows come
        in result order: a search stops at its page's end). A filter opens and decodes
        the values it tests (a value whose key was destroyed since the read is a
        forgotten item: left out); without one the value is left as stored (None), for
        `_decoded` to open on the page only. The SQL's prefix is exact up to
        `MAX_LABELS` labels; a longer one is checked here on each row's namespace."""
        exact = len(prefix) <= MAX_LABELS
        if exact and not op.filter:
            rows = list(rows)
            return [(r, None, None) for r in (rows if wanted is None else rows[:wanted])]
        kept: list[tuple[Any, tuple[str, ...] | None, Any]] = []
        names: dict[str, tuple[str, ...]] = {}
        for r in rows:
            ns = cls._ns_of(r.ns_path, names)
            if not exact and ns[:len(prefix)] != prefix:
                continue
            value = None
            if op.filter:
                raw = opener(r.value)
                if raw is None:
                    continue
                value = orjson.loads(raw)
                if not all(_compare_values(_lookup(value, k), v)
                           for k, v in op.filter.items()):
                    continue
            kept.append((r, ns, value))
            if wanted is not None and len(kept) >= wanted:
                break
        return kept

    @classmethod
    def _decoded(cls, kept: Sequence[tuple[Any, tuple[str, ...] | None, Any]],
                 opener: Callable[[Any], Any]) -> list[tuple[Any, tuple[str, ...], Any]]:
        """`kept` with every namespace and value decoded (the values `_candidates`
        left as stored opened now); an item whose key was destroyed since the read (a
        forgotten one) is left out."""
        out = []
        names: dict[str, tuple[str, ...]] = {}
        for r, ns, value in kept:
            if value is None:
                raw = opener(r.value)
                if raw is None:
                    continue
                value = orjson.loads(raw)
            out.append((r, cls._ns_of(r.ns_path, names) if ns is None else ns, value))
        return out

    def _ranked_now(self, op: SearchOp, now_us: int) -> list[SearchItem] | None:
        """A search with a query by point reads on the calling thread: the candidates
        as `_search_now` finds them (no SQL page: all are ranked; values opened only
        where a filter tests them), scored against the cached vectors, the values and
        created times of the page only. None (the loop path) where point reads are not
        available or a candidate's vectors are not cached (another process wrote it:
        the loop path embeds it)."""
        store = self._ml.store
        prefix = tuple(op.namespace_prefix)
        if len(prefix) > MAX_LABELS:
            return None
        rows = store_reads.below_now(store, self.tenant, self._prefix(prefix),
                                     now_us=now_us, owner_prefix=self._owner, opened=False)
        if rows is None:
            return None
        opener = reads.value_opener(store)
        cands = self._candidates(op, prefix, rows, None, opener)
        cached = self._vectors
        vecs = [cached.get(r.memory_id) for r, _, _ in cands]
        if any(v is None for v in vecs):
            return None
        assert op.query is not None
        q = np.asarray(self.embeddings.embed_query(op.query), dtype=float)
        order = _ranked(q, vecs, op.offset, op.limit)  # type: ignore[arg-type]  # no None
        page = [(got[0], score) for n, score in order
                if (got := self._decoded([cands[n]], opener))]
        created = self._created(store, [c[0] for c, _ in page])
        if created is None:
            return None
        return [SearchItem(namespace=ns, key=decode_label(r.mkey), value=value,
                           created_at=_at(created.get(r.slot) or r.order_key),
                           updated_at=_at(r.order_key), score=score)
                for (r, ns, value), score in page]

    def _search_plan(self, op: SearchOp) -> tuple[tuple[str, ...], bool]:
        """The search's prefix, and whether SQL can page it (no filter, no ranking)."""
        prefix = tuple(op.namespace_prefix)
        ranked = bool(op.query and self.embeddings)
        return prefix, not op.filter and not ranked and len(prefix) <= MAX_LABELS

    def _matching(self, op: SearchOp, rows: Sequence[Any]) -> list[tuple[Any, Item]]:
        """The rows below the prefix that pass the filter, as items, in row order."""
        prefix = tuple(op.namespace_prefix)
        items: list[tuple[Any, Item]] = []
        for r in rows:
            if r.value is None:  # its key destroyed since the read: forgotten
                continue
            it = self._item(r)
            if it.namespace[:len(prefix)] != prefix:
                continue
            if op.filter and not all(_compare_values(_lookup(it.value, k), v)
                                     for k, v in op.filter.items()):
                continue
            items.append((r, it))
        return items

    def _page(self, op: SearchOp, rows: Sequence[Any], plain: bool
              ) -> list[tuple[Any, Item]]:
        """An unranked search's page: SQL paged it already when `plain`."""
        items = self._matching(op, rows)
        return items if plain else items[op.offset:op.offset + op.limit]

    async def _batch_reads(self, ops: list[Op]
                           ) -> tuple[list[Result], list[PutOp], dict[tuple[str, str], Any]]:
        """The results of a batch's reads, its puts (the last of each key) and the TTL
        refreshes its reads call for; nothing is written yet."""
        await self._open()
        self._validate(ops)
        results: list[Result] = [None] * len(ops)
        now_us = time.time_ns() // 1000
        refresh: dict[tuple[str, str], Any] = {}
        if not all(isinstance(op, PutOp) for op in ops):  # a put-only batch reads nothing
            async with self._ml.store.read() as conn:
                await self._reads(conn, ops, results, now_us, refresh)
        puts: dict[tuple[tuple[str, ...], str], PutOp] = {}
        for op in ops:
            if isinstance(op, PutOp):
                puts[(tuple(op.namespace), op.key)] = op
        return results, list(puts.values()), refresh

    async def _reads(self, conn: Any, ops: list[Op], results: list[Result], now_us: int,
                     refresh: dict[tuple[str, str], Any]) -> None:
        """Fill `results` with the answers of the batch's reads, in one snapshot."""
        gets = [(i, op) for i, op in enumerate(ops) if isinstance(op, GetOp)]
        if gets:
            targets = [(ns_path(self._ns(op.namespace)), encode_key(op.key))
                       for _, op in gets]
            rows = {(r.ns_path, r.mkey): r for r in await store_reads.get_many(
                conn, self.tenant, list(set(targets)), now_us=now_us,
                owner_prefix=self._owner)}
            for (i, gop), tk in zip(gets, targets, strict=True):
                row = rows.get(tk)
                if row is not None and row.value is not None:  # None: key destroyed
                    results[i] = self._item(row)
                    if gop.refresh_ttl and self._refreshes and row.expires_us is not None:
                        refresh[tk] = row
        for i, op in enumerate(ops):
            if isinstance(op, SearchOp):
                results[i] = await self._search(conn, op, now_us, refresh)
            elif isinstance(op, ListNamespacesOp):
                results[i] = await self._list(conn, op, now_us)

    async def _search(self, conn: Any, op: SearchOp, now_us: int,
                      refresh: dict[tuple[str, str], Any]) -> list[SearchItem]:
        prefix, plain = self._search_plan(op)
        ranked = bool(op.query and self.embeddings)
        rows = await store_reads.below(
            conn, self.tenant, self._prefix(prefix), now_us=now_us, owner_prefix=self._owner,
            limit=op.limit if plain else None, offset=op.offset if plain else 0)
        if ranked:
            items = self._matching(op, rows)
            assert op.query is not None
            q = np.asarray(await self.embeddings.aembed_query(op.query), dtype=float)
            vecs = [await self._vectors_of(r.memory_id, it.value) for r, it in items]
            kept: list[tuple[float | None, Any, Item]] = [
                (score, *items[n]) for n, score in _ranked(q, vecs, op.offset, op.limit)]
        else:
            kept = [(None, r, it) for r, it in self._page(op, rows, plain)]
        if op.refresh_ttl and self._refreshes:
            for _, r, _it in kept:
                if r.expires_us is not None:
                    refresh[(r.ns_path, r.mkey)] = r
        return [SearchItem(namespace=it.namespace, key=it.key, value=it.value,
                           created_at=it.created_at, updated_at=it.updated_at, score=s)
                for s, _, it in kept]

    async def _list(self, conn: Any, op: ListNamespacesOp, now_us: int
                    ) -> list[tuple[str, ...]]:
        paths = await store_reads.namespaces(conn, self.tenant, now_us=now_us,
                                             owner_prefix=self._owner)
        return self._list_of(paths, op)

    @staticmethod
    def _list_of(paths: Sequence[str], op: ListNamespacesOp) -> list[tuple[str, ...]]:
        """`list_namespaces`' answer from the namespace paths that hold live items."""
        nss = [tuple(decode_label(p) for p in path.split(NS_SEP)[1:-1]) for path in paths]
        if op.match_conditions:
            nss = [ns for ns in nss if all(_does_match(c, ns) for c in op.match_conditions)]
        if op.max_depth is not None:
            nss = sorted({ns[:op.max_depth] for ns in nss})
        else:
            nss = sorted(set(nss))
        return nss[op.offset:op.offset + op.limit]

    # -- vectors -----------------------------------------------------------------------
    def _texts(self, value: dict[str, Any], index: Any) -> list[str]:
        if self.index_config is None or index is False:
            return []
        paths = (self.index_config["__tokenized_fields"] if index is None
                 else [(p, tokenize_path(p)) for p in index])
        out: list[str] = []
        for _path, field in paths:
            out.extend(get_text_at_path(value, field))
        return out

    async def _vectors_of(self, memory_id: str, value: dict[str, Any]
                          ) -> np.ndarray[Any, Any]:
        got = self._vectors.get(memory_id)
        if got is None:
            texts = self._texts(value, None)
            got = _rows(list(await self.embeddings.aembed_documents(texts)) if texts else [])
            self._vectors[memory_id] = got
        return got

    # -- writes ------------------------------------------------------------------------
    def _expires(self, ttl_minutes: float | None) -> str | None:
        if ttl_minutes is None:
            return None
        return (datetime.now(UTC) + timedelta(minutes=ttl_minutes)).isoformat(
            timespec="microseconds")

    def _write_event(self, namespace: Sequence[str], key: str, value: dict[str, Any],
                     expires_at: str | None, texts: list[str]) -> Event:
        text = "\n".join(texts) if texts else key
        return builders.write(
            tenant=self.tenant, actor=self.source_id, namespace=self._ns(namespace),
            key=encode_key(key), value=value, source=self._source(),
            expires_at=expires_at, text=text[:MAX_TEXT_CHARS])

    async def _write(self, puts: list[PutOp], refresh: dict[tuple[str, str], Any]) -> None:
        events: list[Event] = []
        embed: list[tuple[int, list[str]]] = []
        dropped: set[tuple[str, str]] = set()
        for op in puts:
            if not self._owned(op.namespace):
                raise AccessDenied(f"namespace {op.namespace} is outside this store's "
                                   "principal")
            target = (ns_path(self._ns(op.namespace)), encode_key(op.key))
            dropped.add(target)
            if op.value is None:
                events.append(builders.forget_key(
                    tenant=self.tenant, actor=self.source_id, namespace=self._ns(op.namespace),
                    key=encode_key(op.key), source=self._source(),
                    reason="deleted through the LangGraph store"))
                continue
            ttl = op.ttl
            texts = self._texts(dict(op.value), op.index)
            events.append(self._write_event(op.namespace, op.key, dict(op.value),
                                            self._expires(ttl), texts))
            if self.embeddings is not None:
                if texts:
                    embed.append((len(events) - 1, texts))
                else:
                    self._vectors[events[-1].data["memory_id"]] = _rows([])
        for target, row in refresh.items():
            if target in dropped:
                continue
            # the item's own TTL: its expiry minus the time it was written
            ttl_minutes = (row.expires_us - _at_us(row.order_key)) / 60e6
            parts = row.ns_path.split(NS_SEP)[1:-1]
            ns = tuple(decode_label(p) for p in parts)
            value = orjson.loads(row.value)
            cached = self._vectors.get(row.memory_id)
            events.append(self._write_event(ns, decode_label(row.mkey), value,
                                            self._expires(ttl_minutes),
                                            self._texts(value, None)))
            if cached is not None:
                self._vectors[events[-1].data["memory_id"]] = cached
        if not events:
            return
        forgets = any(op.value is None for op in puts)
        if embed:
            flat = [t for _, texts in embed for t in texts]
            vecs = list(await self.embeddings.aembed_documents(flat))
            n = 0
            for i, texts in embed:
                self._vectors[events[i].data["memory_id"]] = _rows(vecs[n:n + len(texts)])
                n += len(texts)
        await self._append(events, wait=forgets)

    async def _append(self, events: list[Event], *, wait: bool) -> None:
        """Append `events` (one request: all or none). It returns once they are
        durable in the ledger; the views apply them in a projection round that the
        store's next read waits for (`_Rounds`). With `wait` (a batch that deletes,
        the TTL sweep) it returns only once that round has run: a returned delete has
        been erased from every view, vector and ledger payload (R20).

        Concurrent writers share projection rounds: one round runs at a time and
        catches every view up to the head it read at its start, so N writers cost one
        or two rounds, not N (each round is a write transaction, the write lock's turn
        each time: N of them starved `test_large_batches_async`'s 6,000 calls)."""
        got = await self._ml.append(events, wait=False)
        upto = max(r.position for r in got)
        self._rounds.wrote(upto)
        if wait:
            await self._rounds.choose()  # a view some process began to keep since
            await self._rounds.reach(upto)

    # -- TTL ---------------------------------------------------------------------------
    async def _sweep(self) -> int:
        await self._open()
        await self._rounds.reach()
        now_us = time.time_ns() // 1000
        async with self._ml.store.read() as conn:
            due = await store_reads.expired(conn, self.tenant, now_us=now_us)
        if not due:
            return 0
        events = [builders.forget_key(
            tenant=self.tenant, actor=self.source_id, namespace=path.split(NS_SEP)[:-1],
            key=key, source=self._source(), reason="ttl expired") for path, key in due]
        await self._append(events, wait=True)
        return len(due)

    def sweep_ttl(self) -> int:
        """Forget every expired item (each one a `memory.forgotten`); returns how many."""
        self._rounds.raise_failed()
        return self._call(self._sweep())

    def start_ttl_sweeper(self, sweep_interval_minutes: float | None = None) -> None:
        """Sweep every `sweep_interval_minutes` (TTLConfig's, default 5) in a thread."""
        if self._sweeper is not None:
            return
        minutes = sweep_interval_minutes or (self.ttl_config or {}).get(
            "sweep_interval_minutes") or 5
        self._sweep_stop.clear()

        def run() -> None:
            while not self._sweep_stop.wait(minutes * 60):
                with contextlib.suppress(Exception):
                    self._call(self._sweep())

        self._sweeper = threading.Thread(target=run, daemon=True, name="memledger-ttl")
        self._sweeper.start()

    def stop_ttl_sweeper(self, timeout: float | None = None) -> bool:
        """Stop the sweeper thread; True when it has stopped."""
        return self._stop_sweeper(timeout)

    def _stop_sweeper(self, timeout: float | None = None) -> bool:
        if self._sweeper is None:
            return True
        self._sweep_stop.set()
        self._sweeper.join(timeout)
        stopped = not self._sweeper.is_alive()
        if stopped:
            self._sweeper = None
        return stopped

    # -- beyond LangGraph --------------------------------------------------------------
    async def _history(self, namespace: tuple[str, ...], key: str) -> list[MemoryVersion]:
        await self._open()
        await self._rounds.reach()  # the stored history shows every put of this store
        ns = self._ns(namespace)
        if not self._owned(namespace):
            return []
        who = reads.Principal(self.tenant, ns[1])
        async with self._ml.store.read() as conn:
            rows = await reads.history(conn, who, ns, encode_key(key))
        return [MemoryVersion.from_dict(r) for r in rows]

    def history(self, namespace: tuple[str, ...], key: str) -> list[MemoryVersion]:
        """Every version of an item, oldest first, with its source; forgotten ones
        redacted (memledger's `Principal.history`)."""
        self._rounds.raise_failed()
        return self._call(self._history(tuple(namespace), key))

    async def ahistory(self, namespace: tuple[str, ...], key: str) -> list[MemoryVersion]:
        """`history`, awaitable."""
        self._rounds.raise_failed()
        return await self._acall(self._history(tuple(namespace), key))


class AsyncMemledgerStore(MemledgerStore):
    """`MemledgerStore` with `AsyncSqliteStore`'s surface: an async `from_conn_string`,
    `setup`, `sweep_ttl` and sweeper; sync calls from the event loop raise
    `asyncio.InvalidStateError`, as there."""

    @classmethod
    @contextlib.asynccontextmanager
    async def from_conn_string(cls, conn_string: str, *,  # type: ignore[override]
                               index: IndexConfig | None = None,
                               ttl: TTLConfig | None = None, **kwargs: Any
                               ) -> AsyncIterator[AsyncMemledgerStore]:
        store = cls(index=index, ttl=ttl, url=_url(conn_string), **kwargs)
        try:
            yield store
        finally:
            await asyncio.to_thread(store.close)

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return super().batch(ops)
        raise asyncio.InvalidStateError(
            "synchronous calls to AsyncMemledgerStore from the event loop thread would "
            "block it; use the a* methods")

    async def setup(self) -> None:  # type: ignore[override]
        await self._acall(self._open())

    async def sweep_ttl(self) -> int:  # type: ignore[override]
        self._rounds.raise_failed()
        return await self._acall(self._sweep())

    async def start_ttl_sweeper(  # type: ignore[override]
            self, sweep_interval_minutes: float | None = None) -> None:
        MemledgerStore.start_ttl_sweeper(self, sweep_interval_minutes)

    async def stop_ttl_sweeper(  # type: ignore[override]
            self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 (AsyncSqliteStore)
        return await asyncio.to_thread(self._stop_sweeper, timeout)


def _url(conn_string: str) -> str | None:
    if conn_string == ":memory:":
        return None
    if "://" in conn_string:
        return conn_string
    return f"sqlite+aiosqlite:///{os.path.abspath(conn_string)}"


__all__ = ["AsyncMemledgerStore", "MemledgerStore", "decode_label", "encode_key",
           "encode_label"]
