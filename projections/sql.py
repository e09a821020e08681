"""SQL helpers the projections share, and every view-side difference between backends.

Everything in `projections` that must know whether it runs on SQLite or PostgreSQL
asks here: the insert paths (plain, insert-ignore), the checkpoint row lock, the
raw-driver read, the point reads on the calling thread, the index-friendly prefix
range, and whether the SQLite-only bulk SQL path may run. The rest of the package
writes one statement for both backends.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import operator
import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import numpy as np
import orjson
from numpy.typing import NDArray
from sqlalchemy import (
    ARRAY,
    BigInteger,
    ColumnElement,
    String,
    all_,
    and_,
    any_,
    bindparam,
    cast,
    func,
    literal,
    literal_column,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.dialects.postgresql import BIT
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.recorder import pairs_in
from ledger.store import Store
from ledger.vault import open_columns, seal_columns, sealed_columns

_PREPARED: dict[Hashable, Any] = {}


def prepared(key: Hashable, build: Callable[[], Any]) -> Any:
    """The statement `build()` returns, built once per `key` (the caller's name for it,
    with whatever the statement's text depends on: the dialect, a list of names).

    Its values are `bindparam`s given at each execution (a list: `expanding=True`).
    SQLAlchemy keeps a statement's cache key on the statement object, so a statement
    built once skips both the expression's construction and its key: a one-row
    SELECT by `IN` cost about 180 us of Python built per call on SQLite, 65 us
    prepared (docs/benchmarks.md, "LangGraph store writes"). The statement is the
    same SQL either way; its result columns keep their types (the vault's included).
    """
    got = _PREPARED.get(key)
    if got is None:
        got = _PREPARED[key] = build()
    return got


def one_tenant(pairs: Iterable[tuple[str, Any]]) -> tuple[str, list[Any]] | None:
    """(tenant, its values) when every pair of `pairs` has one tenant, else None (the
    caller's `pairs_in` statement then covers every tenant at once)."""
    tenant: str | None = None
    values: list[Any] = []
    for x, y in pairs:
        if tenant is None:
            tenant = x
        elif x != tenant:
            return None
        values.append(y)
    return None if tenant is None else (tenant, values)


def chunks(items: Sequence[Any], n: int = 400) -> Iterable[Sequence[Any]]:
    """`items` in slices of at most `n` (bound parameters per statement stay few)."""
    for i in range(0, len(items), n):
        yield items[i:i + n]


def batches(conn: AsyncConnection, items: Sequence[Any], n: int = 400
            ) -> Iterable[Sequence[Any]]:
    """`items` in the slices one statement of `any_of` / `pairs_of` takes: all at once on
    PostgreSQL (one array parameter per column, whatever their number), else `chunks`."""
    if conn.dialect.name == "postgresql":
        return [items] if items else []
    return chunks(items, n)


def any_of(conn: AsyncConnection, col: Any, values: Sequence[Any]) -> Any:
    """SQL: `col` is one of `values` (as `col.in_(values)`).

    PostgreSQL: `col = ANY($1::type[])`, one array parameter. An IN list is rendered
    again at every execution, one cast parameter per value: for the projections' lists
    of hundreds of slots that rendering cost more than the statement on the server.
    """
    if conn.dialect.name == "postgresql":
        return col == any_(bindparam(None, list(values), type_=ARRAY(col.type)))
    return col.in_(values)


def none_of_array(conn: AsyncConnection, col: Any, values: Sequence[int]) -> Any | None:
    """PostgreSQL: `col <> ALL($1::bigint[])`, `col` is none of `values`, one array
    parameter; None elsewhere, where the caller reads every row instead
    (`projections.task_rows.summarize_tasks`: a batch's own notes are not read back)."""
    if conn.dialect.name != "postgresql" or not values:
        return None
    return col != all_(bindparam(None, list(values), type_=ARRAY(BigInteger)))


def in_list(conn: AsyncConnection, col: Any, name: str) -> Any:
    """SQL: `col` is one of the values of the parameter `name`, for a statement built
    once (`prepared`, keyed with the dialect's name): on PostgreSQL `col = ANY(:name)`,
    one array parameter (as `any_of`), elsewhere an expanding `IN`. Give it a list."""
    if conn.dialect.name == "postgresql":
        return col == any_(bindparam(name, type_=ARRAY(col.type)))
    return col.in_(bindparam(name, expanding=True))


def tenant_parts(conn: AsyncConnection, pairs: Iterable[tuple[str, Any]], n: int = 400
                 ) -> list[tuple[str | None, list[Any]]]:
    """How a look-up by (tenant, id) pairs is split into statements: (tenant, its ids)
    for a statement `tenant = ? AND id IN (...)` (`in_list`), or (None, the pairs) for
    one `pairs_of` statement. SQLite: per tenant, `n` ids at a time (the primary key
    serves it; a row-value IN would scan the table). PostgreSQL: one part for them all
    over arrays, by tenant when they have one."""
    ordered = sorted(set(pairs))
    if conn.dialect.name != "postgresql":
        grouped: dict[str, list[Any]] = {}
        for tenant, item in ordered:
            grouped.setdefault(tenant, []).append(item)
        return [(tenant, list(part)) for tenant, items in grouped.items()
                for part in chunks(items, n)]
    out: list[tuple[str | None, list[Any]]] = []
    for part in batches(conn, ordered):
        alone = one_tenant(part)
        out.append((alone[0], list(alone[1])) if alone is not None else (None, list(part)))
    return out


def tenant_part_where(conn: AsyncConnection, tenant_col: Any, id_col: Any,
                      tenant: str | None, part: Sequence[Any]) -> Any:
    """SQL matching one part of `tenant_parts`: `tenant_col = tenant AND id_col` among
    its ids (`any_of`), or, for a part of pairs (`tenant` None), `pairs_of`."""
    if tenant is None:
        return pairs_of(conn, tenant_col, id_col, part)
    return and_(tenant_col == tenant, any_of(conn, id_col, part))


def pairs_of(conn: AsyncConnection, a: Any, b: Any, pairs: Sequence[tuple[Any, Any]]) -> Any:
    """SQL: `(a, b)` is one of `pairs` (as `ledger.recorder.pairs_in`).

    PostgreSQL: `(a, b) IN (SELECT * FROM unnest($1::type[], $2::type[]))`, two array
    parameters, which the planner serves from the index on `(a, b)` by a semi-join;
    elsewhere `pairs_in` (`a = x AND b IN (...)` per distinct `x`, for SQLite's planner).
    """
    if conn.dialect.name != "postgresql":
        return pairs_in(a, b, pairs)
    xs = bindparam(None, [p[0] for p in pairs], type_=ARRAY(a.type))
    ys = bindparam(None, [p[1] for p in pairs], type_=ARRAY(b.type))
    pairs_table = func.unnest(xs, ys).table_valued("x", "y").render_derived()
    return tuple_(a, b).in_(select(pairs_table.c.x, pairs_table.c.y))


def prefix_match(col: Any, prefix: str) -> Any:
    """SQL: `col` starts with `prefix` (no LIKE, so no escaping and no collation)."""
    return func.substr(col, 1, len(prefix)) == prefix


def prefix_range(store: Store, col: Any, prefix: str) -> list[Any]:
    """Extra SQL conditions equal to `prefix_match` for a namespace path prefix (ends in
    the separator) that let an index on `col` serve it: on SQLite, which compares TEXT
    bytewise, a range; none elsewhere."""
    if store.dialect != "sqlite":
        return []
    return [col >= prefix, col < prefix[:-1] + "\x20"]


async def page_after(conn: AsyncConnection, q: Any, key: Sequence[Any],
                     after: Sequence[Any] | None, size: int) -> Sequence[Any]:
    """The next `size` rows of `q` in `key` order after the key values `after` (None:
    from the start): keyset paging, so each step reads only its own rows."""
    if after is not None:
        q = q.where(tuple_(*key) > tuple_(*after))
    return (await conn.execute(q.order_by(*key).limit(size))).all()


def insert_ignore(store: Store, table: Any) -> Any:
    """INSERT that skips rows already there: re-applying a batch changes nothing."""
    ins = pg_insert if store.dialect == "postgresql" else sqlite_insert
    return ins(table).on_conflict_do_nothing()


_INSERTS: dict[tuple[str, bool], tuple[str, Callable[[dict[str, Any]], tuple[Any, ...]]]] = {}


async def insert_rows(store: Store, conn: AsyncConnection, table: Any,
                      rows: Sequence[dict[str, Any]], *, ignore: bool = False) -> None:
    """Insert view rows (dicts with every column), skipping existing keys if `ignore`.

    On SQLite the rows go to the driver as plain tuples in column order: SQLAlchemy's
    per-row parameter processing costs about 10 us a row, more than the insert itself.
    Elsewhere the recorder writes them (`Recorder.write_rows`; PostgreSQL: one COPY or
    one INSERT over arrays per call).
    """
    if not rows:
        return
    if store.dialect != "sqlite":
        await store.recorder.write_rows(conn, table, rows, ignore=ignore)
        return
    if store.vault is not None:
        # The driver gets plain tuples: seal the content columns as their types would.
        rows = seal_columns(table, rows, conn.dialect)
    key = (table.name, ignore)
    got = _INSERTS.get(key)
    if got is None:
        cols = [c.name for c in table.c]
        got = _INSERTS[key] = (f"INSERT INTO {table.name} ({', '.join(cols)}) "
                               f"VALUES ({', '.join('?' for _ in cols)})"
                               + (" ON CONFLICT DO NOTHING" if ignore else ""),
                               operator.itemgetter(*cols))
    sql, values = got
    await conn.exec_driver_sql(sql, [values(r) for r in rows])


def for_share(store: Store, q: Any) -> Any:
    """The SELECT `q` holding its rows in share mode to the end of the transaction
    (PostgreSQL `FOR SHARE`; SQLite's view transactions are serialised anyway)."""
    return q.with_for_update(read=True) if store.dialect == "postgresql" else q


def shard_filter(store: Store, tenant: Any, count: int, shards: Sequence[int]
                 ) -> ColumnElement[bool] | None:
    """SQL keeping the rows whose tenant is in one of `shards` of `count`
    (`projections.shards.shard_of`), or None where the caller filters in Python (SQLite,
    whose write lock is global: its shards take turns anyway).

    PostgreSQL: the first four bytes of `md5(tenant)` as an unsigned integer, mod count.
    """
    if store.dialect != "postgresql":
        return None
    hexed = literal("x", String).concat(func.substr(func.md5(tenant), 1, 8))
    return (cast(cast(hexed, BIT(32)), BigInteger) % count).in_(list(shards))


def for_update(store: Store, q: Any) -> Any:
    """The SELECT `q` locking its rows to the end of the transaction. SQLite needs no
    row lock: a view transaction starts with BEGIN IMMEDIATE (`Store.view_write`)."""
    return q.with_for_update() if store.dialect == "postgresql" else q


async def fetch(store: Store, conn: AsyncConnection, stmt: Any) -> Sequence[Sequence[Any]]:
    """The rows of a query as the driver returns them.

    On SQLite this skips SQLAlchemy's result processing (a few microseconds a row, as
    much as the read itself); the statement is rendered with its values inline, which
    SQLAlchemy quotes and escapes. Columns come back as the driver's types (0/1 for
    booleans on SQLite).
    """
    if store.dialect != "sqlite":
        return (await conn.execute(stmt)).all()
    sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
    rows = (await conn.exec_driver_sql(sql)).all()
    if store.vault is not None and rows:
        # Sealed columns are opened as their types would (`ledger.vault`).
        sealed = sealed_columns(stmt)
        if sealed:
            return open_columns(rows, sealed, conn.dialect)
    return rows


def bulk_sql_possible(store: Store) -> bool:
    """May a bulk load use the SQLite-only SQL path (`projections.bulk`)? Only on SQLite,
    and only where `bulk.sql_rows_supported` then confirms the JSON functions agree."""
    return store.dialect == "sqlite"


class PointQuery:
    """A SELECT built once with SQLAlchemy (the same statement the async path runs)
    and compiled once to SQLite's SQL, for `point_rows`.

    Its bound values are plain strings, integers, bytes or None (no type conversion
    is applied); the SQL's own literals keep the values they were built with.
    """

    def __init__(self, stmt: Any) -> None:
        self.stmt = stmt
        compiled = stmt.compile(dialect=sqlite_dialect.dialect())
        self.sql = str(compiled)
        names = compiled.positiontup
        assert names is not None, "a point query needs positional parameters"
        self.names: tuple[str, ...] = tuple(names)
        self.defaults: dict[str, Any] = dict(compiled.params)
        #: The selected columns that hold sealed content (`ledger.vault`), by index,
        #: with their types: the driver's raw rows skip the types that open them.
        self.sealed: tuple[tuple[int, Any], ...] = sealed_columns(stmt)
        self._pg: tuple[str, tuple[str, ...], dict[str, Any]] | None = None

    def parameters(self, values: dict[str, Any]) -> list[Any]:
        """The positional parameters for `values` (by bind name)."""
        d = self.defaults
        return [values[n] if n in values else d[n] for n in self.names]

    @property
    def pg(self) -> tuple[str, tuple[str, ...], dict[str, Any]]:
        """The statement compiled once to PostgreSQL's SQL for asyncpg (`$n`
        parameters, each bound value cast to its column's type as SQLAlchemy sends it),
        the bind name of each `$n` and the statement's own values, for `driver_rows`."""
        got = self._pg
        if got is None:
            compiled = self.stmt.compile(
                dialect=pg_dialect.asyncpg.dialect())  # type: ignore[no-untyped-call]
            names = compiled.positiontup
            assert names is not None, "a point query needs positional parameters"
            got = self._pg = (str(compiled), tuple(names), dict(compiled.params))
        return got

    def pg_parameters(self, values: dict[str, Any]) -> list[Any]:
        """The positional parameters of `pg` for `values` (by bind name)."""
        _, names, d = self.pg
        return [values[n] if n in values else d[n] for n in names]


def point_json_values(name: str) -> Any:
    """For a `PointQuery` (SQLite): the values of a JSON array bound as `name`, as a
    scalar subquery (`json_each`), so one compiled statement serves any number of
    values (`IN (...)` would change with the list's length)."""
    return select(func.json_each(bindparam(name)).table_valued("value").c.value
                  ).scalar_subquery()


def point_rows(store: Store, q: PointQuery, values: dict[str, Any], *, opened: bool = True
               ) -> list[tuple[Any, ...]] | None:
    """The rows of `q` read on the calling thread (SQLite files, no thread hop), as
    the driver returns them; None where that cannot be done (PostgreSQL, an in-memory
    database, a busy or missing file): the caller then runs `q.stmt` asynchronously.
    Sealed columns are opened unless `opened` is False (the caller opens the few rows
    it keeps, `open_columns` with `q.sealed`)."""
    reader = store.recorder.point_reads()
    if reader is None:
        return None
    rows = reader.rows(q.sql, q.parameters(values))
    # Opened also without a vault: a sealed value then reads as None, as the column's
    # type reads it (a ledger whose keys are absent: restored envelopes only).
    if rows is None or not opened or not q.sealed or not rows:
        return rows
    return open_columns(rows, q.sealed, store.engine.sync_engine.dialect)


async def driver_rows(store: Store, q: PointQuery, values: dict[str, Any]
                      ) -> list[tuple[Any, ...]] | None:
    """The rows of `q` awaited straight on the driver's own connection (PostgreSQL:
    a statement asyncpg prepared once, no SQLAlchemy per call), as the driver returns
    them; None where that cannot be done (SQLite, every point-read connection busy, an
    error the `read_once` path should report): the caller then runs `q.stmt` there."""
    reader = store.recorder.driver_reads()
    if reader is None:
        return None
    rows = await reader.rows(q.pg[0], q.pg_parameters(values))
    if rows is None or not q.sealed or not rows:  # opened without a vault too (point_rows)
        return rows
    return open_columns(rows, q.sealed, store.engine.sync_engine.dialect)


#: Worker threads for `read_sql(beside=True)`, per process (a forked child makes its
#: own): few and long-lived, so their point-read connections stay warm (page cache,
#: FTS5 structure) instead of one per thread of the loop's default executor.
_BESIDE: dict[int, ThreadPoolExecutor] = {}


def _beside_pool() -> ThreadPoolExecutor:
    pid = os.getpid()
    pool = _BESIDE.get(pid)
    if pool is None:
        _BESIDE.clear()
        pool = _BESIDE[pid] = ThreadPoolExecutor(2, thread_name_prefix="memledger-match")
    return pool


async def read_sql(store: Store, conn: AsyncConnection, sql: str, params: Sequence[Any],
                   *, beside: bool = False) -> Sequence[Sequence[Any]]:
    """The rows of one SQLite SELECT (`?` parameters) of the lexical index (no sealed
    column: the vault changes nothing here): on the calling thread where the store can
    (`point_rows`' reader: no hop to the driver's thread, a fresh autocommit read), else
    on `conn`.

    `beside`: the point read runs on a worker thread of the event loop (its own
    `query_only` connection) while the caller goes on: SQLite releases the GIL while it
    works, so a long statement (the full-text match) overlaps the caller's own work
    (recall's vector scan, which numpy runs without the GIL) on a second core."""
    reader = store.recorder.point_reads()
    if reader is not None:
        if beside:
            rows = await asyncio.get_running_loop().run_in_executor(
                _beside_pool(), reader.rows, sql, params)
        else:
            rows = reader.rows(sql, params)
        if rows is not None:
            return rows
    return (await conn.exec_driver_sql(sql, tuple(params))).all()


# -- a runner step's reads (`projections.runner`) -----------------------------------

#: PostgreSQL: a catch-up step's batch, in multiples of the runner's default batch.
PG_CATCH_UP_FACTOR: Final = 4


def catch_up_batch(store: Store, default: int) -> int:
    """The batch of a `Runner.catch_up` step when the runner was given no batch size:
    `default` on SQLite (its write lock is the whole database's: a longer transaction
    holds every writer off longer), `PG_CATCH_UP_FACTOR` times it on PostgreSQL, where
    a step's statements each take the whole batch at once (arrays, one COPY) and the
    per-step costs (the checkpoint lock, the step's reads, savepoint, commit) are paid
    a quarter as often (docs/benchmarks.md, "PostgreSQL projection vs raw asyncpg")."""
    return default * PG_CATCH_UP_FACTOR if store.dialect == "postgresql" else default


#: PostgreSQL: what a runner's step reads once it holds the checkpoint row (`step_facts`).
_STEP_FACTS: Final = text(
    "SELECT (SELECT max(position) FROM events), "
    "(SELECT value FROM meta WHERE name = :shards_meta), "
    "(SELECT array_agg(shard ORDER BY shard) FROM shard_checkpoints "
    "WHERE projection = :name), "
    "(SELECT array_agg(position ORDER BY shard) FROM shard_checkpoints "
    "WHERE projection = :name), "
    "(SELECT array_agg(position ORDER BY position) FROM quarantine "
    "WHERE projection = :name AND position > :after AND position <= :upto)")


async def step_facts(store: Store, conn: AsyncConnection, name: str, position: int,
                     size: int, *, shards_meta: str, default_shards: int
                     ) -> tuple[int, dict[int, int], int, set[int]] | None:
    """None except on PostgreSQL (`projections.runner` then reads the four apart).
    PostgreSQL, in a runner step's transaction after the checkpoint row is locked: the
    ledger's head, the projection's shard checkpoints (`{shard: position}`), the shard
    count and its quarantined positions in (`position`, `position + size`], in ONE
    statement instead of four (`Store.head`, the shard rows, `shards.shard_count`,
    `quarantine.held_positions`). It must be a statement of its own after the locking
    SELECT (under READ COMMITTED a statement sees the rows committed before it
    started; the locking one may have waited). Each of these rows changes only under
    the checkpoint row's lock (shard runners hold it in share mode, `shards set` and
    the quarantine's writers exclusively) or, the head, only grows: the same values
    the four statements read."""
    if store.dialect != "postgresql":
        return None
    row = (await conn.execute(_STEP_FACTS, {
        "shards_meta": shards_meta, "name": name, "after": position,
        "upto": position + size})).one()
    head, count, ks, ps, held = row
    return (int(head or 0), dict(zip(map(int, ks or ()), map(int, ps or ()), strict=True)),
            int(count) if count is not None else default_shards,
            set(map(int, held or ())))



# -- the history view's closes and the as-of reads' prefix ranges (issue 20: moved here
#    from projections/history.py and projections/asof.py, the branches with the rest) --

async def close_history_rows(conn: AsyncConnection, closed: Sequence[dict[str, Any]]
                             ) -> None:
    """Close open `mem_history` rows (by primary key: `k_tenant`, `k_memory_id`,
    `k_valid_from`) at `k_valid_to`.

    PostgreSQL: one `UPDATE ... FROM unnest(...)` of one array per key column (a
    statement built once): an executemany costs SQLAlchemy's parameter processing per
    row and the server one execution per row. Elsewhere an executemany by key."""
    mh = t.mem_history.c
    if conn.dialect.name == "postgresql":
        await conn.execute(prepared("history.close.pg", _close_history_pg), {
            "tenants": [r["k_tenant"] for r in closed],
            "ids": [r["k_memory_id"] for r in closed],
            "froms": [r["k_valid_from"] for r in closed],
            "tos": [r["k_valid_to"] for r in closed]})
        return
    await conn.execute(update(t.mem_history).where(
        mh.tenant == bindparam("k_tenant"), mh.memory_id == bindparam("k_memory_id"),
        mh.valid_from == bindparam("k_valid_from")).values(
        valid_to=bindparam("k_valid_to")), closed)


def _close_history_pg() -> Any:
    """PostgreSQL: UPDATE `mem_history` rows by primary key (`:tenants`, `:ids`,
    `:froms`, arrays of one row each) setting `valid_to` from `:tos`."""
    mh = t.mem_history.c
    keys = func.unnest(bindparam("tenants", type_=ARRAY(String)),
                       bindparam("ids", type_=ARRAY(String)),
                       bindparam("froms", type_=ARRAY(BigInteger)),
                       bindparam("tos", type_=ARRAY(BigInteger))).table_valued(
        "tenant", "memory_id", "valid_from", "valid_to").render_derived()
    return update(t.mem_history).where(
        mh.tenant == keys.c.tenant, mh.memory_id == keys.c.memory_id,
        mh.valid_from == keys.c.valid_from).values(valid_to=keys.c.valid_to)


def prefix_range_of(conn: AsyncConnection, col: Any, prefix: str) -> list[Any]:
    """`prefix_range` for a connection: on SQLite (bytewise TEXT) a range an index on
    `(tenant, ns_path, ...)` serves; nothing elsewhere."""
    if conn.dialect.name != "sqlite":
        return []
    return [col >= prefix, col < prefix[:-1] + "\x20"]


# -- the lexical index's full-text engine (`projections.lexical`) ------------------------

#: Entries per INSERT of `lexical_insert` on SQLite (9 bound values each: within the
#: 999 variables of any SQLite build).
LEXICAL_INSERT_ROWS = 100


async def lexical_insert(store: Store, conn: AsyncConnection,
                         rows: Sequence[dict[str, Any]]) -> None:
    """Insert `lexical_docs` entries (dicts with every column).

    SQLite: in full-text row id (`docid`) order, many rows per INSERT ... SELECT. FTS5
    appends an entry to its in-memory pending terms only while row ids grow, and
    writes them out as a new index segment at every statement with a trigger (the
    index's trigger makes each statement one) and at every row id lower than the last:
    rows sent one per statement, in any order, gave one segment per entry, which its
    merges then paid for (about 10x the cost of the entries themselves). Sorted and
    grouped, a batch makes a few segments. PostgreSQL: `insert_rows` (one COPY)."""
    if not rows:
        return
    if store.dialect != "sqlite":
        await insert_rows(store, conn, t.lexical_docs, rows)
        return
    if store.vault is not None:
        rows = seal_columns(t.lexical_docs, rows, conn.dialect)
    cols = [c.name for c in t.lexical_docs.c]
    values = operator.itemgetter(*cols)
    ordered = sorted(rows, key=operator.itemgetter("docid"))
    one = "(" + ", ".join("?" for _ in cols) + ")"
    names = ", ".join(f"column{i + 1}" for i in range(len(cols)))
    for part in chunks(ordered, LEXICAL_INSERT_ROWS):
        # SELECT ... ORDER BY keeps the VALUES' order (docid, column 3) explicit.
        sql = (f"INSERT INTO {t.lexical_docs.name} ({', '.join(cols)}) SELECT {names} "
               f"FROM (VALUES {', '.join(one for _ in part)}) "
               f"ORDER BY column{cols.index('docid') + 1}")
        await conn.exec_driver_sql(sql, tuple(v for r in part for v in values(r)))


async def lexical_delete(store: Store, conn: AsyncConnection, docids: Iterable[int]) -> None:
    """Delete `lexical_docs` entries by full-text row id (their FTS5 entries go with
    them, by trigger), in row id order and many per statement (`lexical_insert`);
    PostgreSQL: one statement over an array (`any_of`)."""
    ordered = sorted(set(docids))
    ld = t.lexical_docs.c
    for part in batches(conn, ordered, 400):
        await conn.execute(t.lexical_docs.delete().where(any_of(conn, ld.docid, part)))


async def lexical_merge(store: Store, conn: AsyncConnection) -> None:
    """After entries were deleted for a forget: SQLite merges the contentless FTS5
    index (a delete there only records the deletion; merging drops the forgotten terms
    from the index's own pages, R20). PostgreSQL needs nothing: a GIN index loses a
    row's entries with the row (VACUUM reclaims them)."""
    if store.dialect == "sqlite":
        await conn.exec_driver_sql(
            f"INSERT INTO {t.LEXICAL_FTS}({t.LEXICAL_FTS}) VALUES ('optimize')")


def _averages_rows(block: bytes) -> int:
    """The row count at the start of FTS5's "averages" record (a SQLite varint)."""
    n = 0
    for i, b in enumerate(block[:9]):
        if i == 8:
            return (n << 8) | b
        n = (n << 7) | (b & 0x7F)
        if b < 0x80:
            return n
    return n


async def lexical_term_shares(store: Store, conn: AsyncConnection, terms: Sequence[str], *,
                              vocab: str, min_docs: int, scope_term: str | None = None
                              ) -> tuple[dict[str, float], float | None]:
    """The share of the index's entries holding each of `terms` (those known; none
    while the index has fewer than `min_docs` entries, or has no statistics yet), and
    the share of entries carrying `scope_term` in their scope column (None where not
    known: PostgreSQL, or no statistics).

    SQLite, one statement: the entry count from FTS5's own "averages" record (what
    `bm25` reads) and each term's document count from an `fts5vocab` view of the index
    (`vocab`: a per-connection TEMP table, created on first use, no schema object):
    look-ups, not a scan of the matches. PostgreSQL: the planner's statistics of the
    GIN expression (`pg_stats` of `ix_lexical_tsv`: most common elements and their
    frequencies, kept by ANALYZE)."""
    if store.dialect != "sqlite":
        row = (await conn.execute(text(
            "SELECT most_common_elems::text::text[], most_common_elem_freqs FROM pg_stats "
            "WHERE schemaname = current_schema() AND tablename = 'ix_lexical_tsv' LIMIT 1"
        ))).first()
        if row is None or row[0] is None or row[1] is None:
            return {}, None
        freq = dict(zip(row[0], row[1], strict=False))
        return {x: float(freq[x]) for x in terms if x in freq}, None
    head = await read_sql(store, conn, f"SELECT id, block FROM {t.LEXICAL_FTS}_data "
                          "WHERE id IN (1, 10)", [])
    blocks = {int(r[0]): bytes(r[1]) for r in head if r[1] is not None}
    if not blocks.get(1):
        return {}, None
    total = _averages_rows(blocks[1])
    if total <= 0:
        return {}, None
    # Document counts are cached per store while FTS5's structure record (id 10,
    # rewritten by every change to the index) stays the same: each fts5vocab look-up
    # seeks the term in every segment (~0.5 ms a term on the loaded machine).
    key = (store.url, id(store))
    cache = _DF_CACHE.get(key)
    if cache is None or cache[0] != blocks.get(10):
        cache = _DF_CACHE[key] = (blocks.get(10), {})
    known = cache[1]
    want = [("terms", x) for x in terms if ("terms", x) not in known]
    if scope_term is not None and ("scope", scope_term) not in known:
        want.append(("scope", scope_term))
    if want:
        # One SELECT per term joined by UNION ALL: fts5vocab serves a term constraint
        # only as `term = ?` (under an OR it was silently ignored; IN costs a scan).
        sql = " UNION ALL ".join(f"SELECT col, term, doc FROM temp.{vocab} "
                                 "WHERE col = ? AND term = ?" for _ in want)
        params = [v for pair in want for v in pair]
        try:
            rows = await read_sql(store, conn, sql, params)
        except OperationalError as e:
            if f"no such table: temp.{vocab}" not in str(e):
                raise
            await conn.exec_driver_sql(t.LEXICAL_VOCAB_DDL)
            rows = await read_sql(store, conn, sql, params)
        if len(_DF_CACHE) > 64:
            _DF_CACHE.clear()
        if len(known) > 100_000:
            known.clear()
        known.update(dict.fromkeys(want, 0))
        known.update({(str(r[0]), str(r[1])): int(r[2]) for r in rows})
    own = (known[("scope", scope_term)] / total if scope_term is not None else None)
    if total < min_docs:
        return {}, own
    return {x: known[("terms", x)] / total for x in terms
            if known.get(("terms", x))}, own


#: Per store (URL and object): (FTS5 structure record, {(column, term): document count}).
_DF_CACHE: dict[tuple[str, int], tuple[bytes | None, dict[tuple[str, str], int]]] = {}


async def lexical_hits(store: Store, conn: AsyncConnection, scope_term: str,
                       terms: Sequence[str], *, tenant: str, prefix: str,
                       task: str | None, session: str | None, scope: Sequence[Any],
                       k: int, fts_k: int, pg_cap: int, scope_share: float | None = None,
                       unscoped_from: float = 1.0) -> list[tuple[str, Any]]:
    """The item ids of `lexical_docs` matching any of `terms` inside one principal's
    scope, with their score (higher is better), best first, at most `k`.

    SQLite: FTS5's best `fts_k` by bm25 (the scope column weighted 0), the principal's
    hashed `scope_term` required in the match itself, taken in a subquery with its own
    LIMIT (never flattened into the join); only those are joined to their rows and
    checked again for tenant, namespace prefix and layer; CROSS JOIN keeps SQLite from
    starting at `lexical_docs`.

    When the principal's entries are at least `unscoped_from` of the index
    (`scope_share`, from `lexical_term_shares`), the scope term is left out of the
    match: intersecting with a doclist that covers most of the index costs more than
    the few other entries it removes (one user with 100k memories: about half of the
    query). The subquery then takes FTS5's best `fts_k / scope_share` of the whole
    index; the join checks each row's scope as before. If at least `k` of them are the
    principal's, they are exactly its best `k` (the scores are the same either way:
    the scope column has weight 0 and the statistics are the index's); if the
    subquery was cut by its LIMIT before `k` were found, the scoped match runs instead.
    Equal scores are ordered by row id in both queries, so ties resolve the same way.

    PostgreSQL: the rows of `scope` (the same conditions as SQLAlchemy clauses)
    matching the terms, at most `pg_cap` of them, ranked by `ts_rank`."""
    if store.dialect == "sqlite":
        words = "terms : (" + " OR ".join(f'"{x}"' for x in terms) + ")"
        layers = ["d.layer = 'long'"]
        if task is not None:
            layers.append("(d.layer = 'task' AND d.task_key = ?)")
        if session is not None:
            layers.append("(d.layer = 'session' AND d.session_id = ?)")
        sql = (
            "SELECT d.item_id, f.s, (d.tenant = ? AND substr(d.ns_path, 1, ?) = ? "
            f"AND ({' OR '.join(layers)})) FROM ("
            f"SELECT rowid AS rid, -bm25({t.LEXICAL_FTS}, 0.0, 1.0) AS s "
            f"FROM {t.LEXICAL_FTS} WHERE {t.LEXICAL_FTS} MATCH ? "
            "ORDER BY s DESC, rowid LIMIT ?) AS f "
            "CROSS JOIN lexical_docs AS d ON d.docid = f.rid ORDER BY f.s DESC, f.rid")
        head = [tenant, len(prefix), prefix, *([task] if task is not None else []),
                *([session] if session is not None else [])]

        async def best(match: str, fk: int) -> tuple[list[tuple[str, Any]], bool]:
            rows = await read_sql(store, conn, sql, [*head, match, fk], beside=True)
            return [(r[0], r[1]) for r in rows if r[2]][:k], len(rows) >= fk

        if scope_share and scope_share >= unscoped_from:
            fk = min(math.ceil(fts_k / scope_share), 4 * fts_k)
            found, cut = await best(words, fk)
            if len(found) >= k or not cut:
                return found
        return (await best(f'scope : "{scope_term}" AND {words}', fts_k))[0]
    ld = t.lexical_docs.c
    cfg: Any = literal_column("'simple'::regconfig")
    tsv = func.to_tsvector(cfg, ld.terms)
    tsq = func.to_tsquery(cfg, " | ".join(f"'{x}'" for x in terms))
    hits = (select(ld.item_id.label("item_id"), ld.terms.label("terms"))
            .where(tsv.op("@@")(tsq), *scope).limit(pg_cap).subquery())
    rank = func.ts_rank(func.to_tsvector(cfg, hits.c.terms), tsq)
    pq = select(hits.c.item_id, rank).order_by(rank.desc(), hits.c.item_id).limit(k)
    return [(r[0], r[1]) for r in (await conn.execute(pq)).all()]



# -- recall's lexical arm scored in process (`projections.lexical.search`) --------------
#
# SQLite only. FTS5 computes `bm25` for every match, and about half of that is a look-up
# of the row's size in `lexical_fts_docsize`; reading a term's matching row ids alone is
# over ten times cheaper. So the lexical arm reads the row ids matching each query term
# (one `group_concat` per term, all in one statement), takes the rows' sizes from a
# cache kept per store while FTS5's structure record is byte for byte the same (never
# stale: any change to the index empties it, as `_DF_CACHE`; filled by id, or with every
# row's size at once when many were needed, `lexical_sizes`), and scores them with
# FTS5's own formula (`projections.lexical.bm25_scores`).


class LexicalPostings:
    """What `lexical_postings` read in one statement (one snapshot of the index)."""

    __slots__ = ("docids", "n_hit", "n_row", "n_token", "structure")

    def __init__(self, structure: bytes | None, n_row: int, n_token: int,
                 docids: list[NDArray[np.int64]], n_hit: list[int]) -> None:
        #: FTS5's structure record: the key of the size cache.
        self.structure = structure
        #: FTS5's row count and token total over every column (its "averages" record).
        self.n_row = n_row
        self.n_token = n_token
        #: Per query term, the row ids matching it (inside the scope term when scoped).
        self.docids = docids
        #: Per query term, the rows of the whole index holding it (`bm25`'s `nHit`).
        self.n_hit = n_hit


def _varints(block: bytes) -> list[int]:
    """The SQLite varints packed one after another in `block`."""
    out: list[int] = []
    n, used = 0, 0
    for b in block:
        if used == 8:  # the ninth byte of a varint holds 8 bits
            out.append((n << 8) | b)
            n, used = 0, 0
            continue
        n = (n << 7) | (b & 0x7F)
        used += 1
        if b < 0x80:
            out.append(n)
            n, used = 0, 0
    return out


def _phrase(scope_term: str | None, term: str) -> str:
    words = f'terms : "{term}"'
    return words if scope_term is None else f'scope : "{scope_term}" AND {words}'


class _Sizes:
    """Per store, while FTS5's structure record is `structure`: each term's count of
    rows (`n_hit`), the row sizes read so far (sorted row ids, sizes), how many sizes
    were read one by one (`read`), and whether `ids` is every row of the index
    (`whole`: read in slices of many rows a statement, `_whole_sizes`)."""

    __slots__ = ("ids", "n_hit", "read", "sizes", "structure", "whole")

    def __init__(self, structure: bytes | None) -> None:
        self.structure = structure
        self.n_hit: dict[str, int] = {}
        self.ids: NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self.sizes: NDArray[np.float64] = np.zeros(0, dtype=np.float64)
        self.read = 0
        self.whole = False


_SIZES: dict[tuple[str, int], _Sizes] = {}


def _sizes(store: Store, structure: bytes | None) -> _Sizes:
    key = (store.url, id(store))
    got = _SIZES.get(key)
    if got is None or got.structure != structure:
        if len(_SIZES) > 64:
            _SIZES.clear()
        got = _SIZES[key] = _Sizes(structure)
    return got


def _rowid_list(text: str) -> NDArray[np.int64]:
    """The row ids of a `group_concat(rowid)`, parsed by numpy (a twentieth of the time
    of `int` per id in Python: 5,000 matches of a term took ~3 ms that way)."""
    ids = np.fromstring(text, dtype=np.int64, sep=",")
    if len(ids) != text.count(",") + 1:  # not a plain list of integers: parse it strictly
        ids = np.asarray(list(map(int, text.split(","))), dtype=np.int64)
    return ids


async def lexical_postings(store: Store, conn: AsyncConnection, terms: Sequence[str], *,
                           scope_term: str | None) -> LexicalPostings | None:
    """SQLite: FTS5's row count and token total (its "averages" record, what `bm25`
    reads), its structure record, and per term the matching row ids (inside the
    principal's hashed `scope_term` when given) and the whole index's count of rows
    holding it, in one statement (one snapshot). None elsewhere (PostgreSQL ranks with
    `ts_rank`) and while the index is empty."""
    if store.dialect != "sqlite" or not terms:
        return None
    fts = t.LEXICAL_FTS
    parts = [f"SELECT -id, block FROM {fts}_data WHERE id IN (1, 10)"]
    params: list[Any] = []
    for i, x in enumerate(terms):
        parts.append(f"SELECT {i}, (SELECT group_concat(rowid) FROM {fts} WHERE {fts} "
                     "MATCH ?)")
        params.append(_phrase(scope_term, x))
    key = (store.url, id(store))
    known = _SIZES[key].n_hit if key in _SIZES else {}
    if scope_term is not None:  # the whole index's counts of the terms not known yet
        for i, x in enumerate(terms):
            if x not in known:
                parts.append(f"SELECT {len(terms) + i}, (SELECT count(*) FROM {fts} "
                             f"WHERE {fts} MATCH ?)")
                params.append(_phrase(None, x))
    rows = await read_sql(store, conn, " UNION ALL ".join(parts), params, beside=True)
    blocks: dict[int, bytes] = {}
    docids: list[NDArray[np.int64]] = [np.zeros(0, dtype=np.int64) for _ in terms]
    counts: dict[int, int] = {}
    for a, b in rows:
        a = int(a)
        if a < 0:
            if b is not None:
                blocks[-a] = bytes(b)
        elif a < len(terms):
            if b is not None:
                docids[a] = _rowid_list(str(b))
        else:
            counts[a - len(terms)] = int(b)
    averages = _varints(blocks.get(1, b""))
    if len(averages) < 2 or averages[0] <= 0:
        return None
    sizes = _sizes(store, blocks.get(10))
    n_hit = []
    for i, x in enumerate(terms):
        n = len(docids[i]) if scope_term is None else counts.get(i, sizes.n_hit.get(x))
        if n is None:  # the index changed since `known`: count it now
            got = await read_sql(store, conn, f"SELECT count(*) FROM {fts} WHERE {fts} "
                                 "MATCH ?", [_phrase(None, x)])
            n = int(got[0][0])
        n_hit.append(n)
    if sizes.structure == blocks.get(10):
        sizes.n_hit.update(zip(terms, n_hit, strict=True))
    return LexicalPostings(blocks.get(10), averages[0], sum(averages[1:]), docids, n_hit)


async def lexical_sizes(store: Store, conn: AsyncConnection, docids: NDArray[np.int64],
                        structure: bytes | None, index_rows: int = 0) -> NDArray[np.float64]:
    """SQLite: the size in tokens (every column: what `bm25` takes as the row's length)
    of each of these FTS5 rows (sorted, distinct), from the cache while the index's
    structure record is still `structure`, else read from `lexical_fts_docsize` (and
    cached when that statement saw the same structure record).

    Sizes not cached are read by row id, unless the sizes read that way before under
    this structure record reach `SIZE_BULK_SHARE` of the index's `index_rows` (FTS5's
    row count, at most `SIZE_CACHE_ROWS`), or these alone reach twice that share: then
    every row's size is read in a few statements (`_whole_sizes`) and cached, so that no
    later recall reads a size until the index changes. A single recall after a change
    to the index thus pays no more than its look-ups would have cost."""
    sizes = _sizes(store, structure)
    out = np.zeros(len(docids), dtype=np.float64)
    ids = sizes.ids
    j = np.searchsorted(ids, docids)
    hit = j < len(ids)
    hit[hit] = ids[j[hit]] == docids[hit]
    out[hit] = sizes.sizes[j[hit]]
    if hit.all() or sizes.whole:  # whole: a row id not in it has no row (as below: 0)
        return out
    missing = docids[~hit]
    if 0 < index_rows <= SIZE_CACHE_ROWS and (
            sizes.read >= SIZE_BULK_SHARE * index_rows
            or len(missing) >= 2 * SIZE_BULK_SHARE * index_rows):
        all_ids, all_sizes, seen = await _whole_sizes(store, conn, index_rows)
        if seen is not None and seen == structure:
            sizes.ids, sizes.sizes, sizes.whole = all_ids, all_sizes, True
        out[~hit] = _sizes_of(all_ids, all_sizes, missing)
        return out
    sizes.read += len(missing)
    fts = t.LEXICAL_FTS
    rows = await read_sql(
        store, conn, f"SELECT id, sz FROM {fts}_docsize WHERE id IN (SELECT value FROM "
        f"json_each(?)) UNION ALL SELECT -1, block FROM {fts}_data WHERE id = 10",
        [orjson.dumps(missing.tolist()).decode()])
    seen, rows = _structure_last(rows)
    new_ids, new_sizes = _docsizes(rows)
    if len(new_ids):
        order = np.argsort(new_ids)
        new_ids, new_sizes = new_ids[order], new_sizes[order]
    out[~hit] = _sizes_of(new_ids, new_sizes, missing)
    if seen == structure and len(new_ids) and len(ids) + len(new_ids) <= SIZE_CACHE_ROWS:
        # Merged into the sorted cache in one pass (the new ids are not in it).
        at = np.searchsorted(ids, new_ids)
        sizes.ids = np.insert(ids, at, new_ids)
        sizes.sizes = np.insert(sizes.sizes, at, new_sizes)
    return out


def _sizes_of(ids: NDArray[np.int64], sizes: NDArray[np.float64],
              want: NDArray[np.int64]) -> NDArray[np.float64]:
    """The sizes of the row ids `want` from sorted `ids` and their `sizes` (0 for an id
    not there: a row deleted since its match was read)."""
    if not len(ids):
        return np.zeros(len(want), dtype=np.float64)
    j = np.minimum(np.searchsorted(ids, want), len(ids) - 1)
    return np.where(ids[j] == want, sizes[j], 0.0)


def _structure_last(rows: Sequence[Sequence[Any]]
                    ) -> tuple[bytes | None, Sequence[Sequence[Any]]]:
    """(The structure record, the other rows) of a statement whose rows are
    `lexical_fts_docsize` rows (id, sz) followed by (-1, the structure record)."""
    if rows and int(rows[-1][0]) == -1:  # the structure record comes last (UNION ALL)
        last = rows[-1][1]
        return (bytes(last) if last is not None else None), rows[:-1]
    seen: bytes | None = None
    for d, sz in rows:
        if int(d) == -1:
            seen = bytes(sz) if sz is not None else None
    return seen, [r for r in rows if int(r[0]) != -1]


async def _whole_sizes(store: Store, conn: AsyncConnection, index_rows: int = 0
                       ) -> tuple[NDArray[np.int64], NDArray[np.float64], bytes | None]:
    """SQLite: (every row id of the index, sorted; its size; the structure record the
    statements saw, None unless they all saw the same one). An index of more than
    `SIZE_BULK_SLICE` rows (`index_rows`, FTS5's count) is read in as many ranges of row
    ids of equal width (the ids are hashes: about as many rows in each), so each
    statement's strings stay a few MB.

    Each statement's row ids as one `group_concat` (parsed by numpy) and its size
    records joined into one blob in the same scan: about 0.3 us a row, against 1.7-3
    for look-ups by id (docs/benchmarks.md, "a query's first warm recall reads no
    row size"). FTS5 writes one varint per column in each size record, so the
    blob splits into rows by count (`_varint_array`); if it does not (another layout, a
    database in UTF-16), that range's rows are read one by one."""
    fts = t.LEXICAL_FTS
    ranges: list[tuple[str, list[int]]] = [("", [])]
    if index_rows > SIZE_BULK_SLICE:
        got = await read_sql(store, conn, f"SELECT min(id), max(id) FROM {fts}_docsize", [])
        if got and got[0][0] is not None:
            lo, hi = int(got[0][0]), int(got[0][1])
            k = -(-index_rows // SIZE_BULK_SLICE)
            width = (hi - lo) // k + 1
            cuts = [lo + i * width for i in range(1, k)]
            if cuts:
                ranges = [("WHERE id < ? ", [cuts[0]]),
                          *(("WHERE id >= ? AND id < ? ", [x, y])
                            for x, y in itertools.pairwise(cuts)),
                          ("WHERE id >= ? ", [cuts[-1]])]
    id_parts: list[NDArray[np.int64]] = []
    size_parts: list[NDArray[np.float64]] = []
    seen: set[bytes | None] = set()
    for where, params in ranges:
        head = await read_sql(
            store, conn, f"SELECT group_concat(id), CAST(group_concat(sz, '') AS BLOB), "
            f"count(*), (SELECT block FROM {fts}_data WHERE id = 10), "
            f"(SELECT encoding FROM pragma_encoding) FROM {fts}_docsize {where}", params)
        id_text, blob, n, block, encoding = head[0]
        n = int(n)
        seen.add(bytes(block) if block is not None else None)
        if not n:
            continue
        # A blob passes through group_concat byte for byte (NULs too) in a UTF-8
        # database; in a UTF-16 one it would be converted as text.
        values = (_varint_array(bytes(blob)) if blob is not None and encoding == "UTF-8"
                  else None)
        ids = _rowid_list(str(id_text))
        if values is not None and len(values) == _FTS_COLUMNS * n and len(ids) == n:
            sizes = values.reshape(n, _FTS_COLUMNS).sum(axis=1).astype(np.float64)
        else:
            rows = await read_sql(store, conn, f"SELECT id, sz FROM {fts}_docsize {where}"
                                  f"UNION ALL SELECT -1, block FROM {fts}_data WHERE id = 10",
                                  params)
            block, rows = _structure_last(rows)
            seen.add(block)
            ids, sizes = _docsizes(rows)
        id_parts.append(ids)
        size_parts.append(sizes)
    one = seen.pop() if len(seen) == 1 else None
    if not id_parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64), one
    all_ids, all_sizes = np.concatenate(id_parts), np.concatenate(size_parts)
    if len(all_ids) > 1 and not bool(np.all(all_ids[1:] > all_ids[:-1])):
        order = np.argsort(all_ids, kind="stable")
        all_ids, all_sizes = all_ids[order], all_sizes[order]
    return all_ids, all_sizes, one


def _varint_array(buf: bytes) -> NDArray[np.int64] | None:
    """The SQLite varints packed one after another in `buf`, decoded by numpy; None
    where one is longer than 8 bytes (a value of 2**56 or more, never a size) or the
    last is cut off."""
    b = np.frombuffer(buf, dtype=np.uint8)
    if not len(b):
        return np.zeros(0, dtype=np.int64)
    last = b < 0x80  # the last byte of each varint
    if not last[-1]:
        return None
    if last.all():
        return b.astype(np.int64)
    ends = np.flatnonzero(last)
    starts = np.concatenate(([0], ends[:-1] + 1))
    which: NDArray[np.int64] = np.cumsum(last, dtype=np.int64) - last  # each byte's varint
    shift = ends[which] - np.arange(len(b))  # 7-bit groups after this byte in its varint
    if int(shift.max()) >= 8:
        return None
    parts = (b & 0x7F).astype(np.int64) << (7 * shift)
    return np.add.reduceat(parts, starts)


def _docsizes(rows: Sequence[Sequence[Any]]) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """(row ids, sizes) of `lexical_fts_docsize` rows (id, sz): each `sz` is a SQLite
    varint per column, and the row's size their sum. Where every byte is below 0x80
    (a varint of one byte: columns under 128 tokens, the usual case) the sums are taken
    by numpy; the rows with a longer varint are decoded one by one (`_varints`)."""
    n = len(rows)
    ids = np.fromiter((int(r[0]) for r in rows), dtype=np.int64, count=n)
    blobs = [bytes(r[1]) for r in rows]
    lens = np.fromiter(map(len, blobs), dtype=np.int64, count=n)
    buf = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    if not n or not len(buf):
        return ids, np.zeros(n, dtype=np.float64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    nonempty = lens > 0
    out = np.zeros(n, dtype=np.float64)
    out[nonempty] = np.add.reduceat(buf.astype(np.int64), starts[nonempty])
    high = buf >= 0x80  # a byte of a longer varint
    if high.any():
        long_rows = np.flatnonzero(np.add.reduceat(high.astype(np.int64),
                                                   starts[nonempty]) > 0)
        rows_nonempty = np.flatnonzero(nonempty)
        for i in rows_nonempty[long_rows]:
            out[i] = sum(_varints(blobs[i]))
    return ids, out


#: Row sizes cached per store at most (16 bytes each: an int64 id, a float64 size).
SIZE_CACHE_ROWS: Final = 2_000_000
#: Every row's size is read at once (`_whole_sizes`) when the sizes read by row id under
#: one structure record reach this share of the index's rows, or one recall needs twice
#: this share (`lexical_sizes`). Reading every row costs about what looking up a tenth
#: to a sixth of them by id does (docs/benchmarks.md, "a query's first warm recall
#: reads no row size"): after an eighth read one by one a process has paid about what
#: the whole read costs (so at most about twice the look-ups it saves), and no query's
#: first recall reads a size again until the index changes; a quarter at once is
#: cheaper whole.
SIZE_BULK_SHARE: Final = 0.125
#: `_whole_sizes` reads an index of up to this many rows in one statement, a larger one
#: in ranges of row ids of about this many rows each.
SIZE_BULK_SLICE: Final = 131_072
#: Columns of the FTS5 table (scope, terms: `ledger.schema`), one varint each in a row's
#: size record.
_FTS_COLUMNS: Final = 2


async def lexical_rows(store: Store, conn: AsyncConnection, docids: Sequence[int], *,
                       tenant: str, prefix: str, task: str | None, session: str | None
                       ) -> dict[int, tuple[str, bool]]:
    """SQLite: {FTS5 row id: (item id, whether it is in the principal's scope: tenant,
    namespace prefix, layer)} of these `lexical_docs` entries (the check
    `lexical_hits` makes on its joined rows)."""
    layers = ["layer = 'long'"]
    if task is not None:
        layers.append("(layer = 'task' AND task_key = ?)")
    if session is not None:
        layers.append("(layer = 'session' AND session_id = ?)")
    rows = await read_sql(
        store, conn, "SELECT docid, item_id, (tenant = ? AND substr(ns_path, 1, ?) = ? "
        f"AND ({' OR '.join(layers)})) FROM lexical_docs WHERE docid IN "
        "(SELECT value FROM json_each(?))",
        [tenant, len(prefix), prefix, *([task] if task is not None else []),
         *([session] if session is not None else []), orjson.dumps(list(docids)).decode()])
    return {int(r[0]): (str(r[1]), bool(r[2])) for r in rows}
