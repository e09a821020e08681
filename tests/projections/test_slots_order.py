"""The memories view's rows of a round come in path order (`projections.slots.path_order`):
where they lie changes, which rows the view holds does not (docs/benchmarks.md, "LangGraph
store: a round's rows in path order, the batch put's floor (issue 16)")."""

from __future__ import annotations

import itertools
import random
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete

from ledger import schema as t
from ledger.events import ns_path, slot_id
from ledger.store import Store
from ledger.validation import parse_event
from projections.memory import WriteFact, resolve_slot
from projections.runner import Runner
from projections.slots import path_order, resolve_slots
from tests.factories import event, src, write
from tests.helpers import dump_views, fresh_replay

_SETTINGS = settings(max_examples=15, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
_ids = itertools.count(1)

_fact = st.tuples(st.sampled_from(("shop-a", "shop-b")), st.sampled_from(("u1", "u2", "u3")),
                  st.sampled_from(("prefs", "notes")), st.sampled_from(("k0", "k1", "k2")),
                  st.sampled_from(("long", "session")), st.integers(0, 50), st.booleans())


def _write_fact(tenant: str, user: str, area: str, key: str, layer: str, at: int,
                candidate: bool) -> WriteFact:
    path = ns_path([tenant, user, area])
    scope = "C1" if layer == "session" else ""
    n = next(_ids)
    return WriteFact(tenant=tenant, memory_id=f"M{n}",
                     slot=slot_id(tenant, path, key, layer, scope), ns_path=path, key=key,
                     layer=layer, task_key=None, session_id=scope or None, position=n,
                     order=at.to_bytes(4, "big") + n.to_bytes(4, "big"),
                     candidate=candidate and layer == "long", actor=user, source=b"{}",
                     value=b'"v%d"' % n, text=f"v{n}")


@given(facts=st.lists(_fact, min_size=1, max_size=30))
@_SETTINGS
async def test_resolve_slots_gives_each_slots_rows_in_path_order(store: Store,
                                                                facts: Any) -> None:
    """For any writes of mixed tenants, namespaces, keys and layers, `resolve_slots`
    gives exactly the rows `resolve_slot` gives each slot, each slot's rows together and
    in its order, the slots sorted by tenant, namespace path and key (property, both
    backends)."""
    async with store.view_write() as conn:
        await conn.execute(delete(t.mem_marks))
    slots: dict[str, list[WriteFact]] = {}
    for f in facts:
        w = _write_fact(*f)
        slots.setdefault(w.slot, []).append(w)
    async with store.read() as conn:
        got = await resolve_slots(conn, slots, [])
    want = {s: resolve_slot(ws, [], set(), []) for s, ws in slots.items()}
    order = sorted(slots, key=lambda s: path_order(s, slots[s]))
    assert got == [r for s in order for r in want[s]]
    assert [(r["tenant"], r["ns_path"], r["mkey"]) for r in got] == sorted(
        (r["tenant"], r["ns_path"], r["mkey"]) for r in got)
    # The same rows as slot order (the order before) gave.
    assert sorted(got, key=repr) == sorted((r for s in sorted(slots) for r in want[s]),
                                           key=repr)


def _events(rng: random.Random, n: int, tag: str) -> list[dict[str, Any]]:
    """Writes over several users, namespaces and keys (some written again, some
    superseding another), confirmations and forgets, in one random order."""
    evs: list[dict[str, Any]] = []
    ids: list[str] = []
    for i in range(n):
        user, area = rng.choice(("u1", "u2", "u3", "u4")), rng.choice(("prefs", "notes"))
        ns = ["shop-a", user, area]
        s = src(rng.choice(["explicit_user_request", "model_inference"]), "C17",
                f"2026-09-20T10:{rng.randrange(30):02d}:00+08:00")
        roll = rng.random()
        if roll < 0.75 or not ids:
            mid = f"M{tag}-{i}"
            extra: dict[str, Any] = {}
            if ids and rng.random() < 0.2:
                extra["supersedes"] = rng.choice(ids)
            ids.append(mid)
            evs.append(write(rng.choice(("k0", "k1", "k2", "k3")), f"v{i}", user=user, ns=ns,
                             memory_id=mid, source=s, idem=f"{tag}-{i}", **extra))
        elif roll < 0.88:
            evs.append(event("memory.confirmed", {"memory_id": rng.choice(ids)}, actor="ops",
                             source=src("operator", "ops", s["at"]), idem=f"{tag}-{i}"))
        else:
            evs.append(event("memory.forgotten", {"namespace": ns, "key": "k1"}, actor="ops",
                             source=src("operator", "ops", s["at"]), idem=f"{tag}-{i}"))
    return evs


async def _rowids(store: Store) -> dict[tuple[str, str], tuple[int, Any]]:
    """SQLite: each `mem_versions` row's rowid and its place in `path_order`."""
    async with store.read() as conn:
        rows = (await conn.exec_driver_sql(
            "SELECT rowid, tenant, memory_id, ns_path, mkey, layer, slot "
            "FROM mem_versions")).all()
    return {(r[1], r[2]): (r[0], (r[1], r[3], r[4], r[5], r[6])) for r in rows}


@given(seed=st.integers(0, 10**6), n=st.integers(2, 30))
@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_a_rounds_rows_lie_in_path_order_and_the_view_is_unchanged(
        store: Store, tmp_path: Path, seed: int, n: int) -> None:
    """A round whose events reach many namespaces in a random order inserts its rows in
    path order (SQLite: their rowids), and the view holds exactly what projecting the
    same ledger one event a round gives (property, both backends)."""
    rng = random.Random(seed)
    tag = f"{next(_ids)}-{seed}"  # a repeated example appends anew (idempotency keys)
    for e in _events(rng, 3, tag + "a"):  # the view past 0: what follows is a live round
        await store.append_one(parse_event(e))
    await Runner(store).catch_up()
    sqlite = store.dialect == "sqlite"
    before = await _rowids(store) if sqlite else {}
    await store.append([parse_event(e) for e in _events(rng, n, tag + "b")])
    await Runner(store, batch_size=1000).catch_up()
    if sqlite:
        # The round's rows: new ones and those it deleted and inserted again (a rowid
        # SQLite gave again to the same row would only leave that row out).
        after = await _rowids(store)
        keys = [k for _, k in sorted(rk for i, rk in after.items()
                                     if i not in before or before[i][0] != rk[0])]
        assert keys and keys == sorted(keys)
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    fresh = await fresh_replay(store, d, batch_size=1)
    try:
        tables = (t.mem_versions, t.mem_marks)
        assert await dump_views(store, tables) == await dump_views(fresh, tables)
    finally:
        await fresh.close()
