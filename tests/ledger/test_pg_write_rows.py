"""PostgreSQL's view-row writes (issue 20: projection >= 0.5x raw asyncpg): rows go to
the write transaction's own asyncpg connection by COPY, or as one INSERT over one array
per column (to skip existing keys, or for a few rows). These tests hold
`PostgresRecorder.write_rows` to what SQLAlchemy's executemany it replaces gave: the
same rows for any input, existing keys skipped or refused, the same error classes (the
quarantine tells an event's fault from the database's by them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.backends.postgres import COPY_MIN_ROWS
from ledger.recorder import Recorder
from ledger.store import Store
from projections.quarantine import is_poison

pytestmark = pytest.mark.postgres

_TEXT = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
                max_size=12)
#: A `mem_marks` row: integers, text, bytes and NULLs, as a projection writes them.
_MARK = st.fixed_dictionaries({
    "tenant": st.sampled_from(["shop-a", "shop-b", "店"]), "target": _TEXT,
    "kind": st.sampled_from(["superseded", "confirmed"]), "order_key": st.binary(max_size=24),
    "by_id": st.none() | _TEXT, "via_candidate": st.none() | _TEXT,
    "owner": st.none() | _TEXT})
#: Enough rows to take both paths (the INSERT over arrays below COPY_MIN_ROWS, COPY above).
_ROWS = st.lists(_MARK, max_size=2 * COPY_MIN_ROWS + 5).map(
    lambda rows: [{"position": i + 1, **r} for i, r in enumerate(rows)])


async def _begun(conn: AsyncConnection) -> AsyncConnection:
    """`conn` with its transaction begun on the driver, as in a projection step (which
    locks its checkpoint first): `write_rows` then takes the driver's paths."""
    await conn.execute(select(t.checkpoints.c.name).limit(1))
    driver = (await conn.get_raw_connection()).driver_connection
    assert driver is not None and driver.is_in_transaction()
    return conn


def _key(r: Any) -> tuple[Any, ...]:
    return tuple(r[c.name] if isinstance(r, dict) else getattr(r, c.name)
                 for c in t.mem_marks.c)


async def _marks(store: Store) -> list[tuple[Any, ...]]:
    async with store.read() as conn:
        rows = (await conn.execute(select(t.mem_marks))).all()
    return sorted(_key({c.name: (bytes(v) if isinstance(v, memoryview) else v)
                        for c, v in zip(t.mem_marks.c, r, strict=True)}) for r in rows)


@given(rows=_ROWS, present=st.integers(0, 80), ignore=st.booleans())
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_write_rows_stores_exactly_what_sqlalchemy_would(
        pg_url: str, tmp_path: Path, rows: list[dict[str, Any]], present: int,
        ignore: bool) -> None:
    """For any rows (any text, bytes, NULLs, any count across the COPY threshold), with
    some keys already there: `ignore` keeps the rows there and adds the rest, exactly as
    the generic executemany does; without it the new rows are added as given."""
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    try:
        async with store.view_write() as conn:
            await conn.execute(t.mem_marks.delete())
        before = rows[:present]
        changed = [{**r, "owner": "old"} for r in before]  # what is there wins on ignore
        async with store.view_write() as conn:
            await Recorder.write_rows(store.recorder, conn, t.mem_marks, changed)
        new = rows if ignore else rows[present:]
        async with store.view_write() as conn:
            await store.recorder.write_rows(await _begun(conn), t.mem_marks, new,
                                            ignore=ignore)
        assert await _marks(store) == sorted(_key(r) for r in changed + rows[present:])
    finally:
        await store.close()


@pytest.mark.parametrize("count", [3, COPY_MIN_ROWS + 3])
async def test_a_key_written_twice_is_an_integrity_error(pg_url: str, tmp_path: Path,
                                                         count: int) -> None:
    """A duplicate key fails the whole write as SQLAlchemy's IntegrityError (a poison
    error: the event that caused it is quarantined), on both paths; nothing of the
    failed write stays."""
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    rows = [{"position": i, "tenant": "shop-a", "target": f"m{i}", "kind": "superseded",
             "order_key": b"\x01", "by_id": None, "via_candidate": None, "owner": None}
            for i in range(1, count + 1)]
    try:
        async with store.view_write() as conn:
            await store.recorder.write_rows(conn, t.mem_marks, rows[:1])
        with pytest.raises(IntegrityError) as err:
            async with store.view_write() as conn:
                await store.recorder.write_rows(await _begun(conn), t.mem_marks, rows)
        assert is_poison(err.value)
        assert await _marks(store) == [_key(rows[0])]
    finally:
        await store.close()


@pytest.mark.parametrize("count", [1, COPY_MIN_ROWS + 1])
async def test_a_value_the_server_refuses_fails_as_through_the_engine(
        pg_url: str, tmp_path: Path, count: int) -> None:
    """A value PostgreSQL cannot store (a NUL character in text) fails with the error
    class SQLAlchemy's executemany raised for it (DBAPIError, not a poison error: the
    runner stops rather than quarantine), on both paths; nothing is written."""
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    rows = [{"position": i, "tenant": "shop-a", "target": f"m{i}", "kind": "superseded",
             "order_key": b"", "by_id": None, "via_candidate": None, "owner": "a\x00b"}
            for i in range(1, count + 1)]
    try:
        with pytest.raises(DBAPIError) as generic:
            async with store.view_write() as conn:
                await Recorder.write_rows(store.recorder, await _begun(conn), t.mem_marks,
                                          rows)
        with pytest.raises(DBAPIError) as err:
            async with store.view_write() as conn:
                await store.recorder.write_rows(await _begun(conn), t.mem_marks, rows)
        assert type(err.value) is type(generic.value)
        assert is_poison(err.value) is is_poison(generic.value) is False
        assert await _marks(store) == []
    finally:
        await store.close()


@pytest.mark.parametrize("count", [3, COPY_MIN_ROWS + 3])
async def test_a_failed_write_in_a_savepoint_leaves_the_transaction_usable(
        pg_url: str, tmp_path: Path, count: int) -> None:
    """As the runner applies a batch (in a savepoint, bisected when it fails): a write
    that fails inside the savepoint is rolled back with it, and the same transaction
    goes on to write and commit the rest."""
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    rows = [{"position": i, "tenant": "shop-a", "target": f"m{i}", "kind": "superseded",
             "order_key": b"\x02", "by_id": None, "via_candidate": None, "owner": None}
            for i in range(1, count + 1)]
    try:
        async with store.view_write() as conn:
            await _begun(conn)
            with pytest.raises(IntegrityError):
                async with conn.begin_nested():
                    await store.recorder.write_rows(conn, t.mem_marks, rows + rows[:1])
            async with conn.begin_nested():
                await store.recorder.write_rows(conn, t.mem_marks, rows)
        assert await _marks(store) == sorted(_key(r) for r in rows)
    finally:
        await store.close()
