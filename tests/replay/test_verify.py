"""`replay verify`: integrity of the ledger and of every view, on both backends.

It passes on a healthy ledger with corrections, candidates, tasks, forgets and purges,
and names the position or view row of each tampering: a payload changed, an envelope
changed (actor), an event deleted, a view row edited by hand. `--forgotten` proves the
erasure of every copy and finds a copy put back (R20, R21, R22).

The scenario built here is shared by the other `test_replay_*` modules.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import delete, select, update

from ledger import schema as t
from ledger.events import encode_json
from ledger.store import Store
from ledger.validation import parse_event
from projections.runner import Runner
from replay.verify import verify
from replay.verify.forgotten import verify_forgotten
from tests.cli import Cli
from tests.factories import event, src, write

SECRET = "QUOKKA-street-11"
TASK_SECRET = "QUOKKA-title-77"
NS7 = ["shop-a", "u7", "preferences"]
NS8 = ["shop-a", "u8", "preferences"]


def at(minute: int) -> str:
    """A source time on 2026-09-20 (C17)."""
    return f"2026-09-20T10:{minute:02d}:00+08:00"


def sor(minute: int) -> dict[str, Any]:
    """A system-of-record source."""
    return src("system_of_record", "aftersales", at(minute))


def story() -> list[dict[str, Any]]:
    """Writes, a correction, a confirmed candidate, tasks, a key forget, a user's prefix
    forget and a task purge: every kind of event verify and restore must handle."""
    return [
        write("lang", "Simplified Chinese", idem="s1", memory_id="L1", source=src(at=at(0))),
        write("style", "terse", idem="s2", source=src(at=at(1))),
        write("lang", "English", idem="s3", memory_id="L2", supersedes="L1",
              etype="memory.corrected", source=src(at=at(2))),
        write("food", "noodles", idem="s4", memory_id="C1",
              source=src("user_statement", at=at(3))),
        event("memory.confirmed", {"memory_id": "C1"}, idem="s5", source=src(at=at(4))),
        event("task.opened", {"task_key": "T900", "namespace": ["shop-a", "u7", "tickets"],
                              "refs": {"order": "A123"}, "title": "earbud inspection"},
              actor="aftersales", idem="s6", source=sor(5)),
        event("task.noted", {"task_key": "T900", "kind": "user_report",
                             "text": "the left earbud crackles"},
              idem="s7", source=src("user_statement", at=at(6))),
        event("task.noted", {"task_key": "T900", "kind": "system_status",
                             "text": "awaiting inspection",
                             "fields": {"status": "awaiting inspection"}},
              actor="aftersales", idem="s8", source=sor(7)),
        write("addr", SECRET, idem="s9", source=src(at=at(8))),
        event("memory.forgotten", {"namespace": NS7, "key": "addr"}, idem="s10",
              source=src(at=at(9))),
        write("lang", "German", user="u8", idem="s11", source=src(sid="C20", at=at(10))),
        event("memory.forgotten", {"namespace_prefix": ["shop-a", "u8"]}, actor="u8",
              idem="s12", source=src(sid="C20", at=at(11))),
        event("task.opened", {"task_key": "T950", "namespace": ["shop-a", "u7", "tickets"],
                              "title": TASK_SECRET}, actor="aftersales", idem="s13",
              source=sor(12)),
        event("task.closed", {"task_key": "T950", "resolution": "refunded"},
              actor="aftersales", idem="s14", source=sor(13)),
        event("task.purged", {"task_key": "T950"}, actor="ops", idem="s15",
              source=src("operator", "ops", at(14))),
    ]


async def load(store: Store, events: list[dict[str, Any]] | None = None) -> None:
    """Append the events (the story by default) and project them."""
    for e in events if events is not None else story():
        await store.append_one(parse_event(e))
    await Runner(store).catch_up()


def checks(res: dict[str, Any]) -> set[tuple[str, Any]]:
    """(check, position) of every problem reported."""
    return {(p["check"], p.get("position")) for p in res.get("problems", [])}


async def test_verify_passes_on_a_healthy_ledger(store: Store) -> None:
    """A ledger with every kind of event, forgets included, verifies clean (R20, R22)."""
    await load(store)
    res = await verify(store)
    assert res["ok"], res
    assert res["head"] == res["events"] == len(story())
    assert res["redacted"] >= 3  # the forgotten address, u8's memory, T950's events
    assert res["tombstones"] == 3
    assert res["views"]["mem_versions"] == 6
    forgotten = await verify_forgotten(store)
    assert forgotten["ok"], forgotten


async def test_verify_detects_tampered_payload(store: Store) -> None:
    """A payload changed in place fails its digest at that position."""
    await load(store)
    forged = encode_json({**parse_event(story()[1]).to_wire(), "data": {
        **parse_event(story()[1]).to_wire()["data"], "value": "verbose"}})
    async with store.view_write() as conn:
        await conn.execute(update(t.events).where(t.events.c.position == 2)
                           .values(payload=forged))
    res = await verify(store, views=False)
    assert not res["ok"]
    assert ("digest", 2) in checks(res)


async def test_verify_detects_tampered_envelope(store: Store) -> None:
    """An envelope edited in place (the actor) breaks the hash chain at that position."""
    await load(store)
    async with store.view_write() as conn:
        await conn.execute(update(t.events).where(t.events.c.position == 3)
                           .values(actor="mallory"))
    res = await verify(store, views=False)
    assert not res["ok"]
    assert ("chain", 3) in checks(res)
    assert ("envelope", 3) in checks(res)  # the payload still names u7


async def test_verify_detects_deleted_event(store: Store) -> None:
    """A deleted event leaves a gap in positions and a broken link after it."""
    await load(store)
    async with store.view_write() as conn:
        await conn.execute(delete(t.events).where(t.events.c.position == 4))
    res = await verify(store, views=False)
    assert not res["ok"]
    found = checks(res)
    assert ("positions", 5) in found
    assert ("chain", 5) in found


async def test_verify_detects_view_row_edited_by_hand(store: Store) -> None:
    """A view row edited by hand differs from a fresh replay: table, key and column."""
    await load(store)
    mv = t.mem_versions.c
    async with store.view_write() as conn:
        await conn.execute(update(t.mem_versions).where(mv.memory_id == "L2")
                           .values(value=encode_json("Klingon")))
    res = await verify(store)
    assert not res["ok"]
    [problem] = res["problems"]
    assert problem["check"] == "view" and problem["table"] == "mem_versions"
    assert problem["key"] == {"tenant": "shop-a", "memory_id": "L2"}
    assert problem["columns"] == ["value"]
    assert "Klingon" not in repr(res)  # a report names columns, never values


async def test_verify_detects_missing_and_extra_view_rows(store: Store) -> None:
    """A view row deleted, or one that no event explains, is reported."""
    await load(store)
    tv = t.tasks_view.c
    async with store.view_write() as conn:
        await conn.execute(delete(t.tasks_view).where(tv.task_key == "T900"))
        await conn.execute(t.task_notes.insert().values(
            position=999, tenant="shop-a", task_key="T900", type="task.noted",
            order_key=b"\x00", body=None))
    res = await verify(store)
    details = {(p.get("table"), p["detail"]) for p in res["problems"]}
    assert ("tasks_view", "row missing from the view (a fresh replay has it)") in details
    assert ("task_notes", "row in the view but not in a fresh replay") in details


async def test_verify_detects_tombstone_tampering(store: Store) -> None:
    """A tombstone deleted (or invented) no longer matches the forget events."""
    await load(store)
    ts = t.tombstones.c
    async with store.view_write() as conn:
        pos = (await conn.execute(select(ts.position).order_by(ts.position))).scalars().first()
        await conn.execute(delete(t.tombstones).where(ts.position == pos))
    res = await verify(store, views=False)
    assert ("tombstones", pos) in checks(res)
    # The events it covered are now redacted with nothing covering them.
    assert any(p["check"] == "redaction" for p in res["problems"])


async def test_verify_forgotten_finds_content_put_back(store: Store) -> None:
    """`--forgotten` names the view row and the ledger payload still holding covered
    content (R20)."""
    await load(store)
    ev, mv = t.events.c, t.mem_versions.c
    async with store.view_write() as conn:
        pos = (await conn.execute(select(ev.position).where(ev.idempotency_key == "s9"))
               ).scalar_one()
        await conn.execute(update(t.events).where(ev.position == pos).values(
            payload=parse_event(story()[8]).encode(), redacted=False))
        await conn.execute(update(t.mem_versions).where(mv.mkey == "addr").values(
            value=encode_json(SECRET)))
    res = await verify_forgotten(store, catch_up=False)
    assert not res["ok"]
    places = {p["place"] for p in res["problems"]}
    assert {"mem_versions", "events.payload"} <= places
    assert SECRET not in repr(res)


async def test_verify_forgotten_reports_register_entry_missing_from_ledger(
        store: Store) -> None:
    """A register forget the ledger does not hold is reported, with the command to fix it
    (R21)."""
    await load(store, story()[:9])
    lost = parse_event(story()[9])
    store.register.append([{"position": 99, "event": lost.to_wire()}])
    res = await verify_forgotten(store)
    assert not res["ok"]
    [problem] = [p for p in res["problems"] if p["place"] == "register"]
    assert problem["idempotency_key"] == "s10"
    assert "replay rebuild" in problem["detail"]


@pytest.mark.parametrize("tamper", [False, True])
def test_verify_cli_exit_codes(db_url: str, tmp_path: Any, tamper: bool) -> None:
    """`memledger replay verify` prints `{"ok": true}` and exits 0, or exits 1 with the
    problems."""
    cli = Cli(db_url, str(tmp_path / "l.forgets"))
    cli.append(story())
    cli.run("project")
    if tamper:
        import asyncio

        async def edit() -> None:
            s = Store(db_url, register_path=str(tmp_path / "l.forgets"))
            async with s.view_write() as conn:
                await conn.execute(update(t.events).where(t.events.c.position == 1)
                                   .values(source_id="C99"))
            await s.close()

        asyncio.run(edit())
        res = cli.json("replay", "verify", check=1)
        assert not res["ok"] and res["problems"][0]["position"] == 1
    else:
        res = cli.json("replay", "verify")
        assert res["ok"] and res["head"] == len(story())
        assert cli.json("replay", "verify", "--forgotten")["ok"]
