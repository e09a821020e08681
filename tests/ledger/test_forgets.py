"""The one forget rule: the pure function and the SQL expression agree (R20, R22).

For any tombstone and any items, `covers` (Python) and `covers_sql` (SQL, against one
tombstone and against the `tombstones` table, with and without an order, and over a
table that lacks some coordinates) pick the same items, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import (
    Column,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    delete,
    exists,
    select,
)
from sqlalchemy.ext.asyncio import create_async_engine

from ledger import schema as t
from ledger.forgets import KINDS, Coordinates, Tombstone, covers, covers_sql, tombstone_row

_meta = MetaData()
items = Table(
    "forget_probe", _meta,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("tenant", String(16), nullable=False),
    Column("order_key", LargeBinary, nullable=False),
    Column("memory_id", String(16), nullable=True),
    Column("ns_path", Text, nullable=True),
    Column("mkey", String(16), nullable=True),
    Column("task_key", String(16), nullable=True),
)

# Few distinct values, so that tombstones and items often meet.
_tenant = st.sampled_from(["a", "b"])
_path = st.text(st.sampled_from(["a", "\x1f", "é", "中"]), max_size=4)
_order = st.binary(max_size=3)
_opt = st.none().__or__


def _id(*names: str) -> st.SearchStrategy[str]:
    return st.sampled_from(names)


_coordinates = st.builds(
    # A row of a table with an order column has an order; "no order" is `order_key=None`
    # given to `covers_sql`, checked below.
    Coordinates, tenant=_tenant, order_key=_order, memory_id=_opt(_id("m1", "m2")),
    ns_path=_opt(_path), mkey=_opt(_id("k", "kk")), task_key=_opt(_id("t1", "t2")))
_tombstone = st.builds(
    Tombstone, position=st.just(0), tenant=_tenant,
    kind=st.sampled_from([*KINDS, "other"]), order_key=_order,
    memory_id=_opt(_id("m1", "m2")), ns_path=_opt(_path), mkey=_opt(_id("k", "kk")),
    task_key=_opt(_id("t1", "t2")))


@given(tombs=st.lists(_tombstone, min_size=1, max_size=4),
       versions=st.lists(_coordinates, min_size=1, max_size=12))
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_sql_rule_equals_python_rule(db_url: str, tombs: list[Tombstone],
                                           versions: list[Coordinates]) -> None:
    """Every form of `covers_sql` selects exactly the items `covers` says are covered."""
    tombs = [dataclasses.replace(ts, position=i + 1) for i, ts in enumerate(tombs)]
    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_meta.create_all)
            await conn.run_sync(t.tombstones.create, checkfirst=True)
            await conn.execute(delete(items))
            await conn.execute(delete(t.tombstones))
            await conn.execute(items.insert(), [
                {"id": i, **dataclasses.asdict(v)} for i, v in enumerate(versions)])
            await conn.execute(t.tombstones.insert(), [tombstone_row(ts) for ts in tombs])

            async def ids(cond: object) -> set[int]:
                return {r[0] for r in (await conn.execute(select(items.c.id).where(cond)))}

            c = items.c
            for ts in tombs:
                assert await ids(covers_sql(ts, c)) == {
                    i for i, v in enumerate(versions) if covers(ts, v)}
                assert await ids(covers_sql(ts, c, order_key=None)) == {
                    i for i, v in enumerate(versions)
                    if covers(ts, dataclasses.replace(v, order_key=None))}
                # A table with only some coordinates (like `tasks_view`).
                assert await ids(covers_sql(ts, None, tenant=c.tenant, ns_path=c.ns_path,
                                            task_key=c.task_key)) == {
                    i for i, v in enumerate(versions) if covers(ts, Coordinates(
                        v.tenant, ns_path=v.ns_path, task_key=v.task_key))}
            any_ts = exists().where(covers_sql(t.tombstones.c, c))
            assert await ids(any_ts) == {
                i for i, v in enumerate(versions) if any(covers(ts, v) for ts in tombs)}
            assert await ids(~any_ts) == {
                i for i, v in enumerate(versions) if not any(covers(ts, v) for ts in tombs)}
            unordered = exists().where(covers_sql(t.tombstones.c, c, order_key=None))
            assert await ids(unordered) == {
                i for i, v in enumerate(versions)
                if any(covers(ts, dataclasses.replace(v, order_key=None)) for ts in tombs)}
    finally:
        await engine.dispose()


def test_rule_by_example() -> None:
    """The rule as docs/forgetting.md states it, one case per kind."""
    key = Tombstone(1, "a", "key", b"\x05", ns_path="a\x1fu\x1f", mkey="k")
    assert covers(key, Coordinates("a", b"\x05", "m1", "a\x1fu\x1f", "k"))
    assert not covers(key, Coordinates("a", b"\x06", "m1", "a\x1fu\x1f", "k"))  # said later
    assert not covers(key, Coordinates("b", b"\x01", "m1", "a\x1fu\x1f", "k"))  # other tenant
    by_id = Tombstone(2, "a", "memory_id", b"\x01", memory_id="m1")
    assert covers(by_id, Coordinates("a", b"\x09", "m1"))  # whatever its order
    prefix = Tombstone(3, "a", "prefix", b"\x05", ns_path="a\x1fu\x1f")
    assert covers(prefix, Coordinates("a", b"\x05", ns_path="a\x1fu\x1fprefs\x1f", mkey="k"))
    assert covers(prefix, Coordinates("a", None, ns_path="a\x1fu\x1f", task_key="t1"))
    assert not covers(prefix, Coordinates("a", b"\x05", ns_path="a\x1fv\x1f"))
    task = Tombstone(4, "a", "task", b"\x05", task_key="t1")
    assert covers(task, Coordinates("a", b"\x04", "m3", "a\x1fu\x1f", "k", "t1"))
    assert not covers(task, Coordinates("a", b"\x04", "m3", "a\x1fu\x1f", "k", None))
