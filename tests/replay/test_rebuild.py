"""`replay rebuild`: views dropped and replayed equal the incremental ones, the forget
register is reapplied first, and an interrupted rebuild resumes (R17, R20-R22)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from ledger import schema as t
from ledger.forgets import register_entry
from ledger.store import Store
from ledger.validation import parse_event
from projections import reads
from projections.runner import Runner
from replay.rebuild import in_progress, rebuild, reset_projection
from replay.verify import verify
from replay.verify.forgotten import verify_forgotten
from tests.cli import Cli
from tests.factories import event, src, write
from tests.helpers import dump_views
from tests.replay.test_verify import NS7, SECRET, at, load, story

U7 = reads.Principal("shop-a", "u7")
NOW = 1_900_000_000_000_000


async def test_rebuild_equals_incremental(store: Store) -> None:
    """Views projected a few events at a time equal a full rebuild, row for row."""
    events = story()
    runner = Runner(store, batch_size=2)
    for i in range(0, len(events), 3):
        for e in events[i:i + 3]:
            await store.append_one(parse_event(e))
        await runner.catch_up()
    incremental = await dump_views(store, t.VIEW_TABLES)
    res = await rebuild(store, progress=False)
    assert set(res["projections"]) == {p.name for p in runner.projections}
    assert all(p["events"] == len(events) for p in res["projections"].values())
    assert await dump_views(store, t.VIEW_TABLES) == incremental
    assert (await verify(store))["ok"]


async def test_rebuild_one_projection_leaves_the_others(store: Store) -> None:
    """`--projection tasks` rebuilds the task views only; the memory views are untouched."""
    await load(store)
    before = await dump_views(store, t.VIEW_TABLES)
    res = await rebuild(store, ["tasks"], progress=False)
    assert list(res["projections"]) == ["tasks"]
    assert await dump_views(store, t.VIEW_TABLES) == before


async def test_rebuild_reapplies_a_register_forget_missing_from_the_ledger(
        store: Store) -> None:
    """A forget the register holds but the ledger lacks is appended with its original
    source order, and what it covered is gone before the views are served (R21)."""
    await load(store, story()[:9])
    async with store.read() as conn:
        assert (await reads.get(conn, U7, NS7, "addr", now_us=NOW))["value"] == SECRET
    forget = parse_event(story()[9])
    store.register.append([register_entry(forget, 10)])
    res = await rebuild(store, progress=False)
    [entry] = res["reapplied"]["appended"]
    assert entry["idempotency_key"] == "s10" and entry["how"] == "appended"
    async with store.read() as conn:
        assert (await reads.get(conn, U7, NS7, "addr", now_us=NOW)) == {"found": False}
        order = (await conn.execute(select(t.tombstones.c.order_key))).scalar_one()
    assert bytes(order) == forget.order  # it covers what it covered, not more
    assert (await verify_forgotten(store))["ok"]
    # Said again after the forget (a later source order): a new memory, readable.
    await load(store, [write("addr", "new street", idem="s9b", source=src(at=at(30)))])
    async with store.read() as conn:
        assert (await reads.get(conn, U7, NS7, "addr", now_us=NOW))["value"] == "new street"


async def test_register_forget_of_an_absent_memory_is_still_recorded(store: Store) -> None:
    """A user's forget by memory id whose write is not in this ledger (it came after the
    backup) is recorded anyway, so the write replayed later is suppressed (R21, R22)."""
    await load(store, story()[:3])
    late = write("pin", "QUOKKA-9", idem="late-1", memory_id="M9", source=src(at=at(30)))
    forget = parse_event(event("memory.forgotten", {"memory_id": "M9"}, idem="late-2",
                               source=src(at=at(31))))
    store.register.append([register_entry(forget, 42)])
    res = await rebuild(store, progress=False)
    assert [(a["idempotency_key"], a["how"]) for a in res["reapplied"]["appended"]] == [
        ("late-2", "recorded")]
    [r] = await store.append([parse_event(late)])
    assert r.suppressed
    await Runner(store).catch_up()
    async with store.read() as conn:
        assert (await reads.get(conn, U7, NS7, "pin", now_us=NOW)) == {"found": False}
    assert (await verify(store))["ok"]
    # Reapplying again finds it in the ledger and changes nothing.
    again = await rebuild(store, progress=False)
    assert again["reapplied"]["appended"] == []
    assert again["reapplied"]["already_in_ledger"] == 1


async def test_interrupted_rebuild_resumes(store: Store) -> None:
    """An event-by-event rebuild cut off after one batch is resumed by the next run from
    its checkpoint; `restart` drops the views again instead (a bulk load resuming:
    tests/projections/test_bulk.py)."""
    await load(store)
    expected = await dump_views(store, t.VIEW_TABLES)
    runner = Runner(store, batch_size=4)
    memories = next(p for p in runner.projections if p.name == "memories")
    await reset_projection(store, memories, bulk=False)
    assert await runner.step(memories) == 4  # ... and then the process died
    assert await in_progress(store) == {"memories"}
    res = await rebuild(store, ["memories"], runner=runner, progress=False, bulk=False)
    assert res["resumed"] == ["memories"]
    assert res["projections"]["memories"]["from"] == 4
    assert await in_progress(store) == set()
    assert await dump_views(store, t.VIEW_TABLES) == expected
    again = await rebuild(store, ["memories"], runner=runner, restart=True, progress=False)
    assert again["resumed"] == [] and again["projections"]["memories"]["from"] == 0
    assert await dump_views(store, t.VIEW_TABLES) == expected


def test_rebuild_cli(db_url: str, tmp_path: Path) -> None:
    """`memledger replay rebuild` prints JSON on stdout and progress on stderr; an
    unknown projection is a usage error (exit 2)."""
    cli = Cli(db_url, str(tmp_path / "l.forgets"))
    cli.append(story())
    cli.run("project")
    proc = cli.run("replay", "rebuild")
    assert b"rebuild:" in proc.stderr and b"events/s" in proc.stderr
    res = cli.json("replay", "rebuild", "--projection", "memories", "--quiet")
    assert res["head"] == len(story()) and list(res["projections"]) == ["memories"]
    bad = cli.run("replay", "rebuild", "--projection", "nope", check=2)
    assert b"unknown projection" in bad.stderr
    assert cli.json("replay", "verify")["ok"]
    slow = cli.json("replay", "rebuild", "--event-by-event", "--quiet", "--batch-size", "3")
    assert all(p["events"] == len(story()) for p in slow["projections"].values())
    assert cli.json("replay", "verify")["ok"]
