"""PostgreSQL's append path (issue 20: append batched >= 0.5x raw asyncpg): event rows
go by `COPY` on the write transaction's own driver connection and the look-ups are one
`unnest` join each. These tests hold them to what the SQLAlchemy statements they
replace gave: the same rows, the same answers for any set of pairs, the same errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from bench.common import mixed_events
from ledger import schema as t
from ledger.chain import ChainCheck
from ledger.recorder import Recorder
from ledger.store import Store

pytestmark = pytest.mark.postgres

#: The appended ledger: 4 tenants, writes, corrections and task events.
EVENTS = mixed_events(600, seed=11, tenants=4)
_TENANTS = [*sorted({e.tenant for e in EVENTS}), "shop-none"]
_KEYS = [*sorted({e.idempotency_key for e in EVENTS})[:60], "e-missing", "e"]
_MIDS = [*sorted({str(e.memory_id) for e in EVENTS if e.memory_id})[:60], "m_missing"]
_TASKS = [*sorted({str(e.task_key) for e in EVENTS if e.task_key})[:30], "T-missing"]


async def _ledger(pg_url: str, tmp_path: Path) -> Store:
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    if await store.head() == 0:
        for i in range(0, len(EVENTS), 250):
            await store.append(EVENTS[i:i + 250])
    return store


def _pairs(values: list[str]) -> st.SearchStrategy[list[tuple[str, str]]]:
    return st.lists(st.tuples(st.sampled_from(_TENANTS), st.sampled_from(values)),
                    max_size=40, unique=True).map(sorted)


@given(keys=_pairs(_KEYS), mids=_pairs(_MIDS), tasks=_pairs(_TASKS))
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_lookups_answer_as_the_sqlalchemy_statements(
        pg_url: str, tmp_path: Path, keys: list[tuple[str, str]],
        mids: list[tuple[str, str]], tasks: list[tuple[str, str]]) -> None:
    """For any pairs (present, absent, in another tenant), the `unnest` look-ups return
    exactly the rows of the generic statements (`tenant = x AND col IN (...)`)."""
    store = await _ledger(pg_url, tmp_path)
    rec = store.recorder
    try:
        async with store.write() as conn:
            assert sorted(await rec.known_keys(conn, keys)) == sorted(
                await Recorder.known_keys(rec, conn, keys))
            assert sorted(await rec.memory_writers(conn, mids)) == sorted(
                await Recorder.memory_writers(rec, conn, mids))
            assert sorted(await rec.task_owner_paths(conn, tasks)) == sorted(
                await Recorder.task_owner_paths(rec, conn, tasks))
    finally:
        await store.close()


async def test_copied_rows_hold_the_chain_and_the_content(pg_url: str,
                                                          tmp_path: Path) -> None:
    """Rows written by COPY read back as appended: positions 1..n, every link holds,
    each event's content decodes to what was appended; duplicates are found again."""
    store = await _ledger(pg_url, tmp_path)
    try:
        async with store.read() as conn:
            rows = [dict(r._mapping) for r in (await conn.execute(
                select(t.events).order_by(t.events.c.position))).all()]
            back = await store.read_events(conn, 0, len(EVENTS) + 1)
        assert [r["position"] for r in rows] == list(range(1, len(EVENTS) + 1))
        check = ChainCheck()
        assert all(check.holds(r) for r in rows)
        assert [(se.idempotency_key, se.event.data if se.event else None) for se in back] \
            == [(e.idempotency_key, e.data) for e in EVENTS]
        again = await store.append(EVENTS[:5])
        assert [(r.status, r.position) for r in again] == [
            ("duplicate", i + 1) for i in range(5)]
    finally:
        await store.close()


async def test_a_taken_key_in_copy_is_an_integrity_error(pg_url: str,
                                                         tmp_path: Path) -> None:
    """A row whose key is taken fails the COPY as an INSERT would fail (SQLAlchemy's
    IntegrityError), and the transaction writes nothing."""
    store = await _ledger(pg_url, tmp_path)
    rec = store.recorder
    try:
        async with store.read() as conn:
            row = dict((await conn.execute(
                select(t.events).where(t.events.c.position == 1))).one()._mapping)
        row["position"] = len(EVENTS) + 1
        with pytest.raises(IntegrityError):
            async with store.write() as conn:
                await rec.insert_events(conn, [row])
        assert await store.head() == len(EVENTS)
    finally:
        await store.close()
