"""The projections' set-based look-ups on PostgreSQL (issue 20): `any_of` (`= ANY` of one
array) and `pairs_of` (a semi-join on `unnest` of two arrays), each one statement for
a whole batch, select exactly the rows of the IN lists they replace (`col IN (...)`,
`ledger.recorder.pairs_in`) for any values, present, absent or in another tenant."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from bench.common import mixed_events
from ledger import schema as t
from ledger.recorder import pairs_in
from ledger.store import Store
from projections.runner import Runner
from projections.sql import any_of, batches, pairs_of

pytestmark = pytest.mark.postgres

EVENTS = mixed_events(500, seed=5, tenants=3)
_TENANTS = [*sorted({e.tenant for e in EVENTS}), "shop-none"]
_MIDS = [*sorted({str(e.memory_id) for e in EVENTS if e.memory_id})[:50], "m_missing", ""]


async def _projected(pg_url: str, tmp_path: Path) -> Store:
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    if await store.head() == 0:
        await store.append(EVENTS)
        await Runner(store).catch_up()
    return store


@given(pairs=st.lists(st.tuples(st.sampled_from(_TENANTS), st.sampled_from(_MIDS)),
                      max_size=60, unique=True).map(sorted))
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_set_lookups_select_the_rows_of_the_in_lists(
        pg_url: str, tmp_path: Path, pairs: list[tuple[str, str]]) -> None:
    """For any (tenant, memory id) pairs and any slots, the array forms return the rows
    the IN-list forms return, and `batches` hands them over in one statement."""
    store = await _projected(pg_url, tmp_path)
    mv = t.mem_versions.c
    try:
        async with store.read() as conn:
            assert list(batches(conn, pairs)) == ([pairs] if pairs else [])
            want = sorted((await conn.execute(select(mv.tenant, mv.memory_id, mv.slot).where(
                pairs_in(mv.tenant, mv.memory_id, pairs)))).all()) if pairs else []
            got = sorted((await conn.execute(select(mv.tenant, mv.memory_id, mv.slot).where(
                pairs_of(conn, mv.tenant, mv.memory_id, pairs)))).all())
            assert got == want
            slots = sorted({r[2] for r in want} | {"no-such-slot"})
            want_s = sorted((await conn.execute(select(mv.memory_id).where(
                mv.slot.in_(slots)))).all())
            got_s = sorted((await conn.execute(select(mv.memory_id).where(
                any_of(conn, mv.slot, slots)))).all())
            assert got_s == want_s
    finally:
        await store.close()
