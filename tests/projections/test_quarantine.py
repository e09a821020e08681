"""Quarantine: an event one projection cannot apply is skipped by that view only,
recorded, shown by `status` and `replay audit`, and applied once it can be; every other
event keeps flowing, exactly once (docs/projections.md#quarantine, R17, R19).

Validation now refuses the values that broke projections, so the failure is injected by
a test-only wrapper (`Poisoned`) around one real projection, keyed on an event's
idempotency key: it applies the batch, then fails if the batch holds that event, so
the runner must also undo the half-done work.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.errors import StoreUnavailable
from ledger.records import StoredEvent
from ledger.store import Store
from ledger.validation import parse_event
from projections import quarantine, reads
from projections.protocol import Projection, State
from projections.quarantine import is_poison, safe_message
from projections.registry import default_projections
from projections.runner import Runner
from replay.audit import audit
from replay.rebuild import rebuild, retry_quarantined
from replay.status import status_report
from replay.verify import verify
from tests.cli import Cli
from tests.factories import src, write
from tests.helpers import dump_views, fresh_replay
from workers.projector import Projector

SECRET = "4111-secret-value"
POISON = "w-poison"
NS = ["shop-a", "u7", "preferences"]
U7 = reads.Principal("shop-a", "u7")
NOW = 1_900_000_000_000_000


class Poisoned:
    """A real projection that fails on any batch holding the event `key`, after
    applying it (`how`: a Python error quoting a value, or a database error)."""

    def __init__(self, inner: Projection, key: str, how: str = "python") -> None:
        self.inner, self.key, self.how = inner, key, how
        self.name, self.types = inner.name, inner.types
        self.tables, self.depends_on = inner.tables, inner.depends_on

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        await self.inner.apply(store, conn, batch)
        if any(se.idempotency_key == self.key for se in batch):
            await self.fail(conn)

    async def fail(self, conn: AsyncConnection) -> None:
        if self.how == "python":
            raise OverflowError(f"date value out of range: {SECRET!r}")
        for _ in range(2):  # a duplicate key: the transaction is aborted on PostgreSQL
            await conn.execute(t.meta.insert().values(name="poison", value=SECRET))


class PoisonedBulk(Poisoned):
    """`Poisoned`, with a bulk load that fails while the event is below its head."""

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: State,
                        size: int) -> tuple[State | None, int]:
        got = await self.inner.bulk_step(store, conn, state, size)  # type: ignore[attr-defined]
        pos = (await conn.execute(select(t.events.c.position).where(
            t.events.c.idempotency_key == self.key))).scalar()
        if pos is not None and pos <= int(state["head"]):
            await self.fail(conn)
        return got  # type: ignore[no-any-return]


def runner_with(store: Store, name: str, how: str = "python", *, bulk: bool = False,
                batch_size: int = 100) -> Runner:
    """The default projections, the one named `name` poisoned on `POISON`."""
    wrap = PoisonedBulk if bulk else Poisoned
    projs: list[Projection] = [wrap(p, POISON, how) if p.name == name else p
                               for p in default_projections()]
    return Runner(store, projs, batch_size=batch_size)


def story() -> list[dict[str, Any]]:
    """shop-a: keys a, poison b, c written twice (the first write is later poisoned in
    another test); shop-b: key x. Source order is the order of the list."""
    at = "2026-09-20T10:00:{:02d}+08:00"
    return [write("a", "alpha", idem="w-a", source=src(at=at.format(1))),
            write("b", "bravo", idem=POISON, source=src(at=at.format(2))),
            write("c", "charlie-1", idem="w-c1", source=src(at=at.format(3))),
            write("x", "xray", tenant="shop-b", user="u1", idem="w-x",
                  source=src(at=at.format(4))),
            write("c", "charlie-2", idem="w-c2", source=src(at=at.format(5)))]


async def append(store: Store, events: list[dict[str, Any]]) -> dict[str, int]:
    res = await store.append([parse_event(e) for e in events])
    return {e["idempotency_key"]: r.position for e, r in zip(events, res, strict=True)}


async def value(store: Store, key: str, who: reads.Principal = U7,
                ns: list[str] | None = None) -> Any:
    async with store.read() as conn:
        got = await reads.get(conn, who, ns or NS, key, now_us=NOW)
    return got.get("value")


async def vector_ids(store: Store) -> set[str]:
    async with store.read() as conn:
        return {r[0] for r in (await conn.execute(select(t.vectors.c.item_id))).all()}


async def memory_id(store: Store, idem: str) -> str:
    async with store.read() as conn:
        return str((await conn.execute(select(t.events.c.memory_id).where(
            t.events.c.idempotency_key == idem))).scalar_one())


@pytest.mark.parametrize(("name", "how"), [("memories", "python"), ("memories", "database"),
                                           ("vectors", "python")])
async def test_poison_event_is_quarantined_for_its_view_only(
        store: Store, db_url: str, register_path: str, tmp_path: Path, name: str,
        how: str) -> None:
    """One event of a batch fails in one projection: every other event is projected on
    every view, the other views project that event too, `status`, `replay audit` and
    `replay verify` report it, and `replay retry-quarantined` applies it once it can."""
    at = await append(store, story())
    runner = runner_with(store, name, how)
    await runner.catch_up()
    head = await store.head()
    assert set((await runner.positions()).values()) == {head}
    # Every other event, every tenant.
    assert await value(store, "a") == "alpha"
    assert await value(store, "c") == "charlie-2"
    assert await value(store, "x", reads.Principal("shop-b", "u1"),
                       ["shop-b", "u1", "preferences"]) == "xray"
    poison_mid = await memory_id(store, POISON)
    if name == "memories":
        assert await value(store, "b") is None
        assert poison_mid not in await vector_ids(store)
    else:  # the memories view projected it; only the vectors view skipped it
        assert await value(store, "b") == "bravo"
        assert poison_mid not in await vector_ids(store)
        assert await memory_id(store, "w-a") in await vector_ids(store)
    # Recorded once, for that view only, without the value.
    async with store.read() as conn:
        rows = [dict(r._mapping) for r in (await conn.execute(select(t.quarantine))).all()]
    assert [(r["projection"], r["position"], r["tenant"]) for r in rows] == [
        (name, at[POISON], "shop-a")]
    assert rows[0]["error"] == ("OverflowError" if how == "python" else "IntegrityError")
    assert rows[0]["code_version"] == quarantine.code_version()
    assert SECRET not in repr(rows)
    # Visible.
    status = await status_report(store)
    assert status["quarantined"] == 1
    assert status["projections"][name]["quarantined"] == {"count": 1,
                                                          "oldest_position": at[POISON]}
    assert all("quarantined" not in p for n, p in status["projections"].items() if n != name)
    story_of = await audit(store, memory_id=poison_mid)
    (item,) = [e for e in story_of["events"] if e["position"] == at[POISON]]
    assert [q["projection"] for q in item["quarantined"]] == [name]
    assert SECRET not in orjson.dumps(item["quarantined"]).decode()
    # Exactly once: more passes change nothing, and record no second entry.
    before = await dump_views(store, t.VIEW_TABLES)
    await runner.catch_up()
    assert await dump_views(store, t.VIEW_TABLES) == before
    # verify: the ledger is intact and the views equal a replay without that event.
    res = await verify(store)
    assert res["ok"], res
    assert res["quarantined"] == {name: 1}
    # The CLI (the real projections, no hook) shows it and retries it.
    cli = Cli(db_url, register_path)
    assert cli.json("status")["projections"][name]["quarantined"]["count"] == 1
    done = cli.json("replay", "retry-quarantined")
    assert done["projections"][name]["cleared"] == [at[POISON]]
    assert done["quarantined"] == {}
    assert "quarantined" not in cli.json("status")["projections"][name]
    assert await value(store, "b") == "bravo"
    assert poison_mid in await vector_ids(store)
    fresh = await fresh_replay(store, tmp_path)
    assert await dump_views(store, t.VIEW_TABLES) == await dump_views(fresh, t.VIEW_TABLES)
    await fresh.close()
    assert (await verify(store))["quarantined"] == {}


async def test_a_skipped_write_leaves_its_slot_as_if_absent_until_retried(
        store: Store) -> None:
    """The first write of a slot is quarantined: the later one is version 1 and active
    meanwhile; once retried, both are resolved from the whole set (versions 1 and 2)."""
    evs = story()
    evs[1] = write("b", "bravo", idem="w-b", source=evs[1]["source"])
    evs[2]["idempotency_key"] = POISON
    await append(store, evs)
    await runner_with(store, "memories").catch_up()
    mv = t.mem_versions.c
    q = select(mv.version, mv.status).where(mv.mkey == "c").order_by(mv.version)
    async with store.read() as conn:
        assert [tuple(r) for r in (await conn.execute(q)).all()] == [(1, "active")]
    res = await retry_quarantined(store)
    assert len(res["projections"]["memories"]["cleared"]) == 1
    async with store.read() as conn:
        assert [tuple(r) for r in (await conn.execute(q)).all()] == [(1, "superseded"),
                                                                   (2, "active")]
    assert await value(store, "c") == "charlie-2"


async def test_retry_while_it_still_fails_keeps_it_and_counts(store: Store) -> None:
    """A retry of an event that still fails leaves it quarantined, attempt counted."""
    at = await append(store, story())
    runner = runner_with(store, "memories")
    await runner.catch_up()
    res = await runner.retry_quarantined()
    assert res["memories"] == {"retried": 1, "cleared": [],
                               "still_quarantined": [at[POISON]]}
    async with store.read() as conn:
        (row,) = (await conn.execute(select(t.quarantine))).all()
    assert row.attempts == 2


async def test_a_runner_of_another_code_version_retries_on_start(store: Store) -> None:
    """Quarantined by an older version, the event is applied by the first step of a
    runner of this version (an upgrade), without an operator."""
    await append(store, story())
    await runner_with(store, "memories").catch_up()
    async with store.view_write() as conn:
        await conn.execute(update(t.quarantine).values(code_version="0.0.1+p0"))
    assert await value(store, "b") is None
    await Runner(store).catch_up()
    assert await value(store, "b") == "bravo"
    async with store.read() as conn:
        assert (await conn.execute(select(t.quarantine))).all() == []


async def test_same_code_version_does_not_retry_on_its_own(store: Store) -> None:
    """A new runner of the same version leaves the quarantine alone (no retry loop)."""
    await append(store, story())
    await runner_with(store, "memories").catch_up()
    await Runner(store).catch_up()
    assert await value(store, "b") is None


async def test_rebuild_bulk_load_falls_back_and_quarantines(store: Store) -> None:
    """A bulk load that fails on what it reads is abandoned for an event-by-event
    replay, which quarantines the one event; the rebuild completes."""
    at = await append(store, story())
    await Runner(store).catch_up()
    runner = runner_with(store, "memories", bulk=True)
    res = await rebuild(store, runner=runner, progress=None)
    assert res["projections"]["memories"]["quarantined"] == 1
    status = await status_report(store)
    shown = status["projections"]["memories"]
    assert shown["quarantined"] == {"count": 1, "oldest_position": at[POISON]}
    assert "rebuilding_since" not in shown and "bulk_load" not in shown
    assert await value(store, "c") == "charlie-2" and await value(store, "b") is None
    # A rebuild with working code applies it: the quarantine described the old view.
    await rebuild(store, progress=None)
    assert await value(store, "b") == "bravo"
    assert (await status_report(store))["quarantined"] == 0


async def test_worker_projector_keeps_running_past_a_poison_event(store: Store) -> None:
    """The worker daemon's projector passes the poison event and keeps projecting other
    tenants' later writes."""
    await append(store, story())
    proj = Projector(store, runner_with(store, "memories"), min_interval=0)
    try:
        await proj.request()
        await append(store, [write("y", "yankee", tenant="shop-b", user="u1", idem="w-y")])
        await proj.request()
        assert await value(store, "y", reads.Principal("shop-b", "u1"),
                           ["shop-b", "u1", "preferences"]) == "yankee"
        assert (await status_report(store))["projections"]["memories"]["lag"] == 0
    finally:
        await proj.close()


def test_only_failures_of_the_events_quarantine() -> None:
    """Transient and infrastructure failures stop the batch for a retry; the events'
    own failures quarantine; messages lose what they quote."""
    assert not is_poison(StoreUnavailable("down"))
    assert not is_poison(OperationalError("SELECT 1", {}, Exception("database is locked")))
    assert not is_poison(MemoryError())
    assert is_poison(OverflowError("date value out of range"))
    assert is_poison(ValueError("bad"))
    assert safe_message(ValueError(f"invalid literal {SECRET!r}\nmore")) == \
        "invalid literal '…'"
