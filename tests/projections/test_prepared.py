"""Statements built once (`projections.sql.prepared`) read what the statements built per
call read: the one-tenant fast paths against `pairs_in` over every tenant, on both
backends (property tests), and the round's memo of tombstones (docs/benchmarks.md,
"LangGraph store writes (issue 16)")."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select

from ledger import schema as t
from ledger.recorder import pairs_in
from ledger.store import Store
from projections import history, rounds
from projections.slots import marks_aimed
from projections.sql import one_tenant, prepared

TENANTS = ("shop-a", "shop-b", "shop-c")
TARGETS = ("m1", "m2", "m3", "m4")

_rows = st.lists(st.tuples(st.integers(1, 40), st.sampled_from(TENANTS),
                           st.sampled_from(TARGETS), st.sampled_from(("superseded",
                                                                      "confirmed"))),
                 max_size=25, unique_by=lambda r: (r[0], r[2], r[3]))
_pairs = st.lists(st.tuples(st.sampled_from(TENANTS), st.sampled_from(TARGETS)),
                  min_size=1, max_size=8)
_SETTINGS = settings(max_examples=25, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


async def _fill(store: Store, rows: list[tuple[int, str, str, str]]) -> None:
    async with store.view_write() as conn:
        await conn.execute(delete(t.mem_marks))
        if rows:
            await conn.execute(t.mem_marks.insert(), [
                {"position": p, "tenant": a, "target": m, "kind": k,
                 "order_key": p.to_bytes(8, "big"), "by_id": None, "via_candidate": None,
                 "owner": None} for p, a, m, k in rows])


def _key(r: Any) -> tuple[Any, ...]:
    return (int(r.position), r.tenant, r.target, r.kind)


@given(rows=_rows, pairs=_pairs)
@_SETTINGS
async def test_marks_aimed_reads_what_pairs_in_reads(store: Store, rows: Any,
                                                     pairs: Any) -> None:
    """For any marks and any (tenant, memory id)s, of one tenant or several, the marks
    read are those `pairs_in` reads and those the pairs name (property, both backends)."""
    await _fill(store, rows)
    mk = t.mem_marks.c
    async with store.read() as conn:
        got = sorted(_key(r) for r in await marks_aimed(conn, pairs))
        fresh = sorted(_key(r) for r in (await conn.execute(select(t.mem_marks).where(
            pairs_in(mk.tenant, mk.target, pairs)))).all())
    wanted = set(pairs)
    assert got == fresh == sorted((p, a, m, k) for p, a, m, k in rows if (a, m) in wanted)


@given(rows=_rows, pairs=_pairs, upto=st.integers(0, 45), done=st.integers(0, 45))
@_SETTINGS
async def test_history_marks_read_what_pairs_in_reads(store: Store, rows: Any, pairs: Any,
                                                      upto: int, done: int) -> None:
    """The stored history's marks up to a position (the one-tenant statement built once,
    or `pairs_in` for several tenants) are those the view holds up to `min(upto, done)`
    (property, both backends; `done >= upto`: no mark is read from the ledger)."""
    done = max(done, upto)
    await _fill(store, rows)
    async with store.read() as conn:
        got = sorted((m.position, m.tenant, m.target, m.kind)
                     for m in await history._marks(conn, pairs, upto, done))
    wanted = set(pairs)
    assert got == sorted((p, a, m, k) for p, a, m, k in rows
                         if (a, m) in wanted and p <= upto)


@given(pairs=st.lists(st.tuples(st.sampled_from(TENANTS), st.sampled_from(TARGETS))))
def test_one_tenant_is_the_pairs_of_one_tenant(pairs: list[tuple[str, str]]) -> None:
    """`one_tenant` gives (tenant, values in order) exactly when every pair has that one
    tenant (property)."""
    got = one_tenant(pairs)
    if len({a for a, _ in pairs}) == 1:
        assert got == (pairs[0][0], [m for _, m in pairs])
    else:
        assert got is None


def test_prepared_builds_once_per_key() -> None:
    built: list[int] = []

    def build() -> Any:
        built.append(1)
        return select(t.meta.c.value)
    first = prepared(("test_prepared", 1), build)
    assert prepared(("test_prepared", 1), build) is first
    assert prepared(("test_prepared", 2), build) is not first
    assert len(built) == 2


async def test_round_tombstones_are_the_stores_and_read_once(store: Store) -> None:
    """Inside a round, `rounds.tombstones` answers as `Store.tombstones` for the same
    tenants and position, reading them once; outside, every call reads."""
    from ledger.builders import Source, forget_key
    ev = forget_key(tenant="shop-a", actor="u1", namespace=["shop-a", "u1", "prefs"],
                    key="k", source=Source.user_request("C1", seq=1))
    await store.append([ev])
    async with store.read() as conn:
        expect = await store.tombstones(conn, ["shop-a"], upto=1)
        assert [ts.position for ts in expect] == [1]
        assert await rounds.tombstones(store, conn, ["shop-a"], 1) == expect
        facts = rounds.RoundFacts({})
        with rounds.applying(facts):
            first = await rounds.tombstones(store, conn, ["shop-a"], 1)
            assert first == expect
            assert len([k for k in facts.memo if k[0] == "tombstones"]) == 1
            first.clear()  # a caller's list is its own
            assert await rounds.tombstones(store, conn, {"shop-a"}, 1) == expect
            assert await rounds.tombstones(store, conn, ["shop-a"], 0) == []
            assert len([k for k in facts.memo if k[0] == "tombstones"]) == 2
