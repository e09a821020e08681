"""The projection step's statements on PostgreSQL, second pass (issue 20): what a step
reads once it holds the checkpoint row, in one statement (`projections.sql.step_facts`), is
what the four statements it replaces read; the lexical index's look-up of its entries
(one statement over arrays on PostgreSQL) reads what `pairs_in` reads, on both
backends; and the statistics refresh, one round trip, leaves the pooled connection's
`lock_timeout` as it was whether its ANALYZE runs or times out (R14: the views keep up
with the ledger at any size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import bindparam, delete, select, text

from bench.common import mixed_events
from ledger import schema as t
from ledger.recorder import pairs_in
from ledger.store import Store
from projections import lexical, quarantine, shards
from projections.sql import in_list, lexical_insert, step_facts

_SETTINGS = settings(max_examples=25, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
NAMES = ("memories", "vectors", "history")
EVENTS = mixed_events(60, seed=3, tenants=2)


def _quarantine_row(name: str, position: int) -> dict[str, Any]:
    return {"projection": name, "position": position, "tenant": "shop-0", "type": "x",
            "error": "E", "message": "m", "code_version": "v", "recorded_at": "t",
            "attempts": 1, "last_tried_at": "t"}


@pytest.mark.postgres
@given(ahead=st.dictionaries(st.sampled_from(NAMES), st.dictionaries(
           st.integers(0, 20), st.integers(0, 80), max_size=6), max_size=3),
       held=st.sets(st.tuples(st.sampled_from(NAMES), st.integers(1, 80)), max_size=20),
       count=st.none() | st.integers(1, 32), name=st.sampled_from(NAMES),
       position=st.integers(0, 70), size=st.integers(1, 30))
@_SETTINGS
async def test_step_facts_read_what_the_four_statements_read(
        pg_url: str, tmp_path: Path, ahead: dict[str, dict[int, int]],
        held: set[tuple[str, int]], count: int | None, name: str, position: int,
        size: int) -> None:
    """For any shard checkpoints, quarantine entries and shard count (recorded or not),
    the one statement gives the head, the projection's shard rows, the shard count and
    its quarantined positions in (position, position + size] that `Store.head`, a
    SELECT of the shard rows, `shards.shard_count` and `quarantine.held_positions` give
    (property)."""
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    try:
        if await store.head() == 0:
            await store.append(EVENTS)
        sc = t.shard_checkpoints.c
        async with store.view_write() as conn:
            await conn.execute(delete(t.shard_checkpoints))
            await conn.execute(delete(t.quarantine))
            await conn.execute(delete(t.meta).where(t.meta.c.name == shards.SHARDS_META))
            rows = [{"projection": n, "shard": k, "position": p, "updated_at": None}
                    for n, at in ahead.items() for k, p in at.items()]
            if rows:
                await conn.execute(t.shard_checkpoints.insert(), rows)
            if held:
                await conn.execute(t.quarantine.insert(),
                                   [_quarantine_row(n, p) for n, p in sorted(held)])
            if count is not None:
                await conn.execute(t.meta.insert().values(name=shards.SHARDS_META,
                                                          value=str(count)))
        async with store.view_write() as conn:
            got = await step_facts(store, conn, name, position, size,
                                  shards_meta=shards.SHARDS_META,
                                  default_shards=shards.DEFAULT_SHARDS)
            want = (await store.head(conn),
                    {int(r[0]): int(r[1]) for r in (await conn.execute(select(
                        sc.shard, sc.position).where(sc.projection == name))).all()},
                    await shards.shard_count(conn),
                    await quarantine.held_positions(conn, name, position, position + size))
        assert got == want
        assert got[0] == len(EVENTS)
        assert got[2] == (count if count is not None else shards.DEFAULT_SHARDS)
    finally:
        await store.close()


_TENANTS = ("shop-a", "shop-b", "shop-c")
_ITEMS = ("m1", "m2", "m3", "m4", "m5")


def _doc(tenant: str, item: str) -> dict[str, Any]:
    return {"tenant": tenant, "item_id": item, "docid": lexical.docid(tenant, item),
            "ns_path": f"{tenant}\x1fu1\x1fprefs\x1f", "layer": "long", "task_key": None,
            "session_id": None, "scope": lexical.scope_term(tenant, "u1"),
            "terms": f"term {item}"}


@given(docs=st.sets(st.tuples(st.sampled_from(_TENANTS), st.sampled_from(_ITEMS)),
                    max_size=12),
       pairs=st.sets(st.tuples(st.sampled_from(_TENANTS), st.sampled_from(_ITEMS)),
                     max_size=10))
@_SETTINGS
async def test_lexical_entries_read_what_pairs_in_reads(
        store: Store, docs: set[tuple[str, str]], pairs: set[tuple[str, str]]) -> None:
    """For any entries and any (tenant, item id)s, of one tenant or several, the
    entries the lexical projection reads are those `pairs_in` reads, every column
    (property, both backends)."""
    ld = t.lexical_docs.c
    async with store.view_write() as conn:
        await conn.execute(delete(t.lexical_docs))
        await lexical_insert(store, conn, [_doc(a, m) for a, m in sorted(docs)])
    async with store.read() as conn:
        got = sorted(tuple(r) for r in await lexical._entries(conn, pairs))
        want = sorted(tuple(r) for r in (await conn.execute(select(t.lexical_docs).where(
            pairs_in(ld.tenant, ld.item_id, sorted(pairs))))).all()) if pairs else []
    assert got == want
    assert sorted((r[0], r[1]) for r in got) == sorted(docs & pairs)


async def _pooled_lock_timeout(store: Store) -> str:
    async with store.engine.connect() as conn:
        return str((await conn.execute(text("SHOW lock_timeout"))).scalar_one())


async def _reltuples(store: Store, table: str) -> float:
    async with store.engine.connect() as conn:
        return float((await conn.execute(text(
            "SELECT reltuples FROM pg_class WHERE relname = :n"), {"n": table})).scalar_one())


@pytest.mark.postgres
async def test_statistics_refresh_keeps_the_connections_lock_timeout(
        pg_url: str, tmp_path: Path) -> None:
    """A statistics refresh that times out on a held lock gathers nothing, is logged
    and retried with the next growth; whether it ran or not, the pooled connection it
    used has the `lock_timeout` it had before (its SET is undone with a failed ANALYZE,
    RESET after one that ran)."""
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False,
                  pool_size=1)
    await store.open()
    dsn = pg_url.replace("postgresql+asyncpg", "postgresql")
    holder = await asyncpg.connect(dsn)
    try:
        before = await _pooled_lock_timeout(store)
        assert await _reltuples(store, "mem_marks") < 0  # never analyzed
        tx = holder.transaction()
        await tx.start()
        await holder.execute("LOCK TABLE mem_marks IN SHARE UPDATE EXCLUSIVE MODE")
        await store.recorder.note_growth(["mem_marks"], 1_000_000)  # times out: logged
        await tx.rollback()
        assert store.engine.pool.checkedin() == 1  # type: ignore[attr-defined]
        assert await _pooled_lock_timeout(store) == before
        assert await _reltuples(store, "mem_marks") < 0  # nothing gathered
        await store.recorder.note_growth(["mem_marks"], 1)  # still due: runs now
        assert await _reltuples(store, "mem_marks") == 0  # analyzed (an empty table)
        assert await _pooled_lock_timeout(store) == before
    finally:
        await holder.close()
        await store.close()


async def test_slots_of_ids_read_what_pairs_in_reads(store: Store) -> None:
    """The slots of any (tenant, memory id)s, of one tenant or several, present or not,
    are those `pairs_in` finds in `mem_versions` (both backends; the one statement over
    arrays on PostgreSQL, per tenant elsewhere)."""
    from projections.runner import Runner
    from projections.vectors import _slots_of_ids
    await store.append(EVENTS)
    await Runner(store).catch_up()
    mv = t.mem_versions.c
    async with store.read() as conn:
        every = sorted((r[0], r[1]) for r in (await conn.execute(
            select(mv.tenant, mv.memory_id))).all())
        by_id = select(mv.slot).where(mv.tenant == bindparam("tenant"),
                                      in_list(conn, mv.memory_id, "ids"))
        one = [p for p in every if p[0] == every[0][0]][:5]
        for pairs in (set(every), set(every[::3]), set(one), {("shop-x", "m")}, set()):
            want = {r[0] for r in (await conn.execute(select(mv.slot).where(
                pairs_in(mv.tenant, mv.memory_id, sorted(pairs))))).all()} if pairs else set()
            assert await _slots_of_ids(conn, by_id, pairs) == want
    assert len({p[0] for p in every}) > 1 and one


async def _analyses(dsn: str, table: str) -> int:
    """The server's count of ANALYZEs of `table` (pg_stat_user_tables)."""
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(
            "SELECT analyze_count + autoanalyze_count FROM pg_stat_user_tables "
            "WHERE relname = $1", table))
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_statistics_refresh_skips_what_another_process_gathered(
        pg_url: str, tmp_path: Path) -> None:
    """A table this process counts as grown enough is not analyzed again when another
    process (another runner, an operator, autovacuum) gathered its statistics since on
    a table grown without this process: the server's size then decides. When nobody
    else did, the refresh runs, as before."""
    store = Store(pg_url, register_path=str(tmp_path / "f.forgets"), vault=False)
    await store.open()
    dsn = pg_url.replace("postgresql+asyncpg", "postgresql")
    other = await asyncpg.connect(dsn)
    try:
        await other.execute("INSERT INTO meta (name, value) SELECT 'g' || i, 'v' "
                            "FROM generate_series(1, 2000) AS i")
        await store.recorder.note_growth(["meta"], 2000)  # first sight: analyzed now
        assert 2000 <= await _reltuples(store, "meta") < 2100
        before = await _analyses(dsn, "meta")
        # Another process grows the table far past this one's count and analyzes it.
        await other.execute("INSERT INTO meta (name, value) SELECT 'h' || i, 'v' "
                            "FROM generate_series(1, 50000) AS i")
        await other.execute("ANALYZE meta")
        assert await _analyses(dsn, "meta") == before + 1
        # This process writes 3,000 rows more: due by its own count (3,000 rows at
        # 2,000), not by the server's (3,000 rows changed at 52,000).
        await other.execute("INSERT INTO meta (name, value) SELECT 'k' || i, 'v' "
                            "FROM generate_series(1, 3000) AS i")
        await store.recorder.note_growth(["meta"], 3000)
        assert await _analyses(dsn, "meta") == before + 1  # not analyzed again
        assert 52000 <= await _reltuples(store, "meta") < 52100  # the other's
        # Growth past the server's size (by this process's count from then on) is due.
        await other.execute("INSERT INTO meta (name, value) SELECT 'm' || i, 'v' "
                            "FROM generate_series(1, 60000) AS i")
        await store.recorder.note_growth(["meta"], 60000)
        assert await _analyses(dsn, "meta") == before + 2
        assert await _reltuples(store, "meta") >= 100_000
    finally:
        await other.close()
        await store.close()
