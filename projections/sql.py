"""SQL helpers the projections share, and every view-side difference between backends.

Everything in `projections` that must know whether it runs on SQLite or PostgreSQL
asks here: the insert paths (plain, insert-ignore), the checkpoint row lock, the
raw-driver read, the point reads on the calling thread, the index-friendly prefix
range, and whether the SQLite-only bulk SQL path may run. The rest of the package
writes one statement for both backends.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, String, cast, func, literal, tuple_
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.dialects.postgresql import BIT
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.store import Store
from ledger.vault import seal_columns


def chunks(items: Sequence[Any], n: int = 400) -> Iterable[Sequence[Any]]:
    """`items` in slices of at most `n` (bound parameters per statement stay few)."""
    for i in range(0, len(items), n):
        yield items[i:i + n]


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
    """
    if not rows:
        return
    if store.dialect != "sqlite":
        await conn.execute(insert_ignore(store, table) if ignore else table.insert(), rows)
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
    if store.dialect != "sqlite" or store.vault is not None:
        # With the vault on, sealed columns must pass through their type to be opened.
        return (await conn.execute(stmt)).all()
    sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
    return (await conn.exec_driver_sql(sql)).all()


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

    def parameters(self, values: dict[str, Any]) -> list[Any]:
        """The positional parameters for `values` (by bind name)."""
        d = self.defaults
        return [values[n] if n in values else d[n] for n in self.names]


def point_rows(store: Store, q: PointQuery, values: dict[str, Any]
               ) -> list[tuple[Any, ...]] | None:
    """The rows of `q` read on the calling thread (SQLite files, no thread hop), as
    the driver returns them; None where that cannot be done (PostgreSQL, an in-memory
    database, a busy or missing file): the caller then runs `q.stmt` asynchronously."""
    if store.vault is not None:
        # Sealed view columns are opened by their SQLAlchemy column types, which the
        # driver's raw rows skip: with the vault on, reads take the async path.
        return None
    reader = store.recorder.point_reads()
    if reader is None:
        return None
    return reader.rows(q.sql, q.parameters(values))
