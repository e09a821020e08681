"""As-of reads (docs/projections.md#as-of): the view as it was with the ledger holding
exactly the events recorded up to an instant; forgotten content stays forgotten in the
past (R20, R21); principal scoping as for every read (R24).
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.forgets import Coordinates, covers, tombstone_from_row
from ledger.validation import parse_event
from memledger import MemoryLedger
from projections import asof, reads
from tests.cli import Cli

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PREFS = ["preferences"]
U7 = "shop-a/u7"
#: The story recorded as it happened: C17 on 20 September, C18 on 22 September (UTC).
C17_RECORDED = "2026-09-20T02:30:00.000000+00:00"
C18_RECORDED = "2026-09-22T01:30:00.000000+00:00"
C19_RECORDED = "2026-09-25T01:30:00.000000+00:00"
DAY21 = "2026-09-21T00:00:00Z"
DAY23 = "2026-09-23T00:00:00Z"


def story() -> list[dict[str, Any]]:
    """The running example (R29): lines 1-4 are C17, 5-8 C18, 9-11 seed 001."""
    return [orjson.loads(x) for x in (FIXTURES / "story.jsonl").read_bytes().splitlines()]


async def record_story(url: str, register: str) -> None:
    """Append the story with the recording clock at the days it happened."""
    evs = story()
    async with MemoryLedger(url, register_path=register) as ml:
        ml.store.clock = lambda: C17_RECORDED
        await ml.append(evs[:4], wait=True)
        ml.store.clock = lambda: C18_RECORDED
        await ml.append(evs[4:], wait=True)


async def test_story_as_of_through_the_cli(sqlite_url: str, tmp_path: Path) -> None:
    """As of 21 September u7's reply language is Simplified Chinese and T900 is
    "awaiting inspection"; as of 23 September English (version 2) and "inspecting",
    with the correction pending and the model's claim flagged (R5, R12, R29, R30).
    (The CLI on SQLite; the same reads on PostgreSQL go through the SDK below.)"""
    register = str(tmp_path / "r.forgets")
    await record_story(sqlite_url, register)
    cli = Cli(sqlite_url, register)
    get = ["get", "--as", U7, "--namespace", "shop-a/u7/preferences", "--key",
           "reply_language"]
    then = cli.json(*get, "--as-of", DAY21)
    assert (then["value"], then["version"], then["status"]) == ("Simplified Chinese", 1,
                                                                 "active")
    assert then["position"] == 4 and then["as_of"] == DAY21
    (t900,) = cli.json("tasks", "--as", U7, "--as-of", DAY21)["tasks"]
    assert t900["system"]["status"] == "awaiting inspection" and t900["corrections"] == []
    later = cli.json(*get, "--as-of", DAY23)
    assert (later["value"], later["version"]) == ("English", 2)
    (t900,) = cli.json("tasks", "--as", U7, "--as-of", DAY23)["tasks"]
    assert t900["system"]["status"] == "inspecting"
    assert t900["corrections"][0]["pending"] is True
    assert t900["conflicts"][0]["claimed"] == "fault confirmed"
    # The operator's view: what was active then, and the event that made it so.
    audit = cli.json("replay", "audit", "--memory-id", "L1", "--as-of", DAY21)
    (then_,) = audit["then"]
    assert then_["memory"]["status"] == "active" and then_["active"]["memory_id"] == "L1"
    assert then_["memory"]["made_by"] == {"position": 4, "why": "written by this event"}
    assert [e["position"] for e in audit["events"]] == [4]
    audit23 = cli.json("replay", "audit", "--memory-id", "L1", "--as-of", DAY23)
    assert audit23["then"][0]["memory"]["status"] == "superseded"
    assert audit23["then"][0]["memory"]["made_by"]["position"] == 8


async def test_forgotten_stays_forgotten_in_the_past(db_url: str, tmp_path: Path) -> None:
    """After u7 forgets the reply language, an as-of read of a time before the forget
    returns the version redacted (existence, version, source, no value); history then
    hides both values; after the forget it is gone; other principals read nothing."""
    register = str(tmp_path / "r.forgets")
    await record_story(db_url, register)
    async with MemoryLedger(db_url, register_path=register) as ml:
        ml.store.clock = lambda: C19_RECORDED
        u7 = ml.principal(U7)
        await u7.forget(PREFS, "reply_language", source={
            "kind": "explicit_user_request", "id": "C19", "at": "2026-09-25T09:00:00+08:00"})
        await ml.project()
        m = await u7.get(PREFS, "reply_language", as_of=DAY21)
        assert m is not None and m.redacted and m.value is None
        assert (m.memory_id, m.version, m.status, m.source["id"]) == ("L1", 1, "active", "C17")
        raw = orjson.dumps(m.to_dict())
        assert b"Chinese" not in raw
        hist = await u7.history(PREFS, "reply_language", as_of=DAY23)
        assert [(h.version, h.status, h.value, h.redacted) for h in hist] == [
            (1, "superseded", None, True), (2, "active", None, True)]
        assert await u7.get(PREFS, "reply_language", as_of="2026-09-26T00:00:00Z") is None
        rec = await u7.recall("reply language", as_of=DAY21)
        assert [(i.key, i.value, i.to_dict()["redacted"]) for i in rec.items] == [
            ("reply_language", None, True)]
        # Principal scoping is the same in the past (R24).
        other = ml.principal("shop-a/u8")
        assert await other.get(["..", "u7", "preferences"][2:], "reply_language",
                               as_of=DAY21) is None
        assert await other.tasks(as_of=DAY23) == []
        assert (await other.recall("T900 reply language", as_of=DAY23)).items == ()
        assert await ml.principal("shop-b/u7").history(PREFS, "reply_language",
                                                       as_of=DAY23) == []


async def test_stored_history_and_replay_agree(db_url: str, tmp_path: Path) -> None:
    """On both backends, an as-of get read from the stored history (one statement)
    equals the replayed one at every position and at both days, task overrides and
    principals included; while the history has not reached the instant the read
    replays, with the same answer."""
    register = str(tmp_path / "r.forgets")
    await record_story(db_url, register)
    reads_ = [("shop-a/u7", "reply_language", None), ("shop-a/user-417", "code_language",
                                                       None),
              ("shop-a/user-417", "code_language", "Q42"), ("shop-a/u8", "reply_language",
                                                          None)]
    async with MemoryLedger(db_url, register_path=register) as ml:
        for as_of in [f"position:{n}" for n in range(13)] + [DAY21, DAY23]:
            for principal, key, task in reads_:
                who = reads.Principal.parse(principal)
                stored = await asof.read_get(ml.store, who, [who.tenant, who.user,
                                                             "preferences"], key,
                                             as_of=as_of, task=task)
                async with ml.store.read() as conn:
                    instant = await asof.resolve(conn, as_of)
                    assert instant.stored
                    then = await asof.get(conn, who, [who.tenant, who.user, "preferences"],
                                          key, instant=replace(instant, history_at=0),
                                          task=task)
                want = {**then, **instant.wire()} if then.get("found") else then
                assert stored == want, (as_of, principal, key, task)
        m = await ml.principal("shop-a/user-417").get(PREFS, "code_language", task="Q42",
                                                      as_of="position:11")
        assert m is not None and (m.value, m.layer) == ("Java", "task")
        # The history view moved back (as during its rebuild): the read replays.
        async with ml.store.view_write() as conn:
            await conn.execute(t.checkpoints.update().where(
                t.checkpoints.c.name == "history").values(position=3))
            await conn.execute(t.mem_history.delete())
        m = await ml.principal(U7).get(PREFS, "reply_language", as_of=DAY21)
        assert m is not None and m.value == "Simplified Chinese"


async def test_as_of_values(sqlite_url: str, tmp_path: Path) -> None:
    """`position:N` is the prefix of N events (past the head: the head); a time before
    the first event is the empty ledger; anything else is refused with the two forms."""
    await record_story(sqlite_url, str(tmp_path / "r.forgets"))
    async with MemoryLedger(sqlite_url, register_path=str(tmp_path / "r.forgets")) as ml:
        u7 = ml.principal(U7)
        m = await u7.get(PREFS, "reply_language", as_of="position:4")
        assert m is not None and m.value == "Simplified Chinese"
        assert (await u7.get(PREFS, "reply_language", as_of="position:3")) is None
        far = await u7.get(PREFS, "reply_language", as_of="position:999")
        assert far is not None and far.to_dict()["position"] == 11
        assert await u7.tasks(as_of="2026-01-01T00:00:00+08:00") == []
        for bad in ("yesterday", "2026-09-21", "position:-1", "position:x"):
            with pytest.raises(ValidationError, match="as_of"):
                await u7.get(PREFS, "reply_language", as_of=bad)


# -- the property: an as-of read equals a fresh replay of the prefix ---------------------

USERS = ("u1", "u2")
KEYS = ("k1", "k2")


def _src(kind: str, minute: int) -> dict[str, Any]:
    return {"kind": kind, "id": "S", "at": f"2026-09-20T10:{minute:02d}:00+00:00"}


@st.composite
def histories(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Random histories of two users: writes (long and task layer, candidates too),
    corrections, confirmations, supersessions, forgets of every kind, task notes; source
    times drawn at random, so source order and recording order disagree."""
    out: list[dict[str, Any]] = []
    ids: list[tuple[str, str]] = []  # (user, memory id)
    for i in range(draw(st.integers(3, 14))):
        user = draw(st.sampled_from(USERS))
        minute = draw(st.integers(0, 59))
        ns = ["t", user, "p"]
        kind = draw(st.sampled_from(["write", "write", "correct", "confirm", "supersede",
                                     "forget_key", "forget_id", "forget_all", "open",
                                     "note", "close"]))
        base = {"idempotency_key": f"e{i}", "tenant": "t", "actor": user}
        if kind == "write" or (kind == "correct" and not ids):
            layer = draw(st.sampled_from(["long", "long", "task"]))
            data = {"namespace": ns, "key": draw(st.sampled_from(KEYS)),
                    "value": f"v{i}", "memory_id": f"m{i}", "layer": layer}
            if layer == "task":
                data["task_key"] = "T1"
            expiry = draw(st.none() | st.integers(0, 15))
            if expiry is not None:  # around the recording times (`_recorded`)
                data["expires_at"] = f"2026-09-21T00:{expiry:02d}:30+00:00"
            src = draw(st.sampled_from(["explicit_user_request", "user_statement"]))
            out.append({**base, "type": "memory.written", "source": _src(src, minute),
                        "data": data})
            ids.append((user, f"m{i}"))
        elif kind == "correct":
            owner, target = draw(st.sampled_from(ids))
            data = {"namespace": ["t", owner, "p"], "key": draw(st.sampled_from(KEYS)),
                    "value": f"v{i}", "memory_id": f"m{i}", "supersedes": target}
            out.append({**base, "actor": owner, "type": "memory.corrected",
                        "source": _src("explicit_user_request", minute), "data": data})
            ids.append((owner, f"m{i}"))
        elif kind in ("confirm", "supersede", "forget_id") and ids:
            owner, target = draw(st.sampled_from(ids))
            etype = {"confirm": "memory.confirmed", "supersede": "memory.superseded",
                     "forget_id": "memory.forgotten"}[kind]
            out.append({**base, "actor": owner, "type": etype,
                        "source": _src("explicit_user_request", minute),
                        "data": {"memory_id": target}})
        elif kind == "forget_key":
            out.append({**base, "type": "memory.forgotten",
                        "source": _src("explicit_user_request", minute),
                        "data": {"namespace": ns, "key": draw(st.sampled_from(KEYS))}})
        elif kind == "forget_all":
            out.append({**base, "type": "memory.forgotten",
                        "source": _src("explicit_user_request", minute),
                        "data": {"namespace_prefix": ["t", user]}})
        elif kind == "open":
            out.append({**base, "actor": "sys", "type": "task.opened",
                        "source": _src("system_of_record", minute),
                        "data": {"task_key": "T1", "namespace": ["t", "u1", "tickets"],
                                 "refs": {"order": "A1"}}})
        elif kind == "note":
            status = draw(st.booleans())
            out.append({**base, "actor": "sys" if status else "u1", "type": "task.noted",
                        "source": _src("system_of_record" if status else "user_statement",
                                       minute),
                        "data": {"task_key": "T1",
                                 "kind": "system_status" if status else "user_report",
                                 "text": f"n{i}"}})
        elif kind == "close":
            out.append({**base, "actor": "sys", "type": "task.closed",
                        "source": _src("system_of_record", minute),
                        "data": {"task_key": "T1"}})
    return out


def _recorded(position: int) -> str:
    """The recording time of a position in the property's ledgers: a minute apart, so
    writes' expiry times fall between them and an instant's expiry judgment varies."""
    return f"2026-09-21T00:{position:02d}:00.000000+00:00"


async def _append_all(url: str, register: str, events: list[dict[str, Any]]
                      ) -> list[dict[str, Any]]:
    """Append one by one, position N recorded at `_recorded(N)`; keep the events the
    ledger took (a rejected one is not in it)."""
    kept: list[dict[str, Any]] = []
    async with MemoryLedger(url, register_path=register) as ml:
        for e in events:
            ml.store.clock = functools.partial(_recorded, len(kept) + 1)
            try:
                res = await ml.append(e)
            except ValidationError:
                continue
            if res.status == "appended":
                kept.append(e)
        await ml.project()
    return kept


def _redact(item: dict[str, Any], hidden: set[str]) -> dict[str, Any]:
    if item.get("memory_id") in hidden and not item.get("redacted"):
        item = {**item, **dict.fromkeys(asof.REDACTED_FIELDS), "redacted": True}
    return item


async def _reads(url: str, register: str, who: reads.Principal,
                 instant: asof.Instant | None, now_us: int = 0) -> dict[str, Any]:
    """get (long and in T1), history and tasks of each key, live (expiry judged at
    `now_us`) or as of `instant`."""
    out: dict[str, Any] = {}
    async with MemoryLedger(url, register_path=register) as ml, ml.store.read() as conn:
        for key in KEYS:
            ns = [who.tenant, who.user, "p"]
            for task in (None, "T1"):
                if instant is None:
                    got = await reads.get(conn, who, ns, key, now_us=now_us, task=task)
                else:
                    got = await asof.get(conn, who, ns, key, instant=instant, task=task)
                out[f"get {key} {task}"] = got
            out[f"history {key}"] = (
                await reads.history(conn, who, ns, key) if instant is None else
                await asof.history(conn, who, ns, key, instant=instant))
        out["tasks"] = (await reads.tasks(conn, who, include_closed=True) if instant is None
                        else await asof.tasks(conn, who, instant=instant,
                                              include_closed=True))
    return out


#: Recalls the property compares: (query, task).
RECALLS = (("k1", "T1"), (None, None), ("v5 k2", None))


async def _recalls(url: str, register: str, who: reads.Principal, as_of: str,
                   stored: bool) -> list[dict[str, Any]]:
    """The recalls of `RECALLS` as of `as_of`, from the stored history or replayed;
    scores rounded (an embedding computed in another batch may differ in the last
    bits), the audit id left out."""
    out = []
    async with MemoryLedger(url, register_path=register) as ml:
        for query, task in RECALLS:
            got = await asof.recall(ml.store, f"{who.tenant}/{who.user}", as_of=as_of,
                                    query=query, session=None, task=task, budget=None,
                                    limit=10, now_us=0, stored=stored)
            got.pop("audit_id")
            for item in got["items"]:
                item["score"] = round(item["score"], 4)
            out.append(got)
    return out


async def _check_history(events: list[dict[str, Any]], cuts: list[int], folder: Path) -> None:
    full = f"sqlite+aiosqlite:///{folder / 'full.db'}"
    full_reg = str(folder / "full.forgets")
    kept = await _append_all(full, full_reg, events)
    async with MemoryLedger(full, register_path=full_reg) as ml, \
            ml.store.read() as conn:
        tombs = [tombstone_from_row(r) for r in (await conn.execute(select(t.tombstones))).all()]
        erased = {r[0] for r in (await conn.execute(select(t.events.c.memory_id).where(
            t.events.c.payload.is_(None)))).all()}
    for cut in sorted({min(c, len(kept)) for c in cuts}):
        prefix = f"sqlite+aiosqlite:///{folder / f'prefix{cut}.db'}"
        prefix_reg = str(folder / f"prefix{cut}.forgets")
        later = [ts for ts in tombs if ts.position > cut]
        # The past as it may be shown: a forget erased its writes' expiry with their
        # content, so the prefix is replayed without it (a redacted memory's expiry
        # cannot be judged; see docs/projections.md).
        await _append_all(prefix, prefix_reg, [_without_expiry(e) if _erased(e, later, erased)
                                               else e for e in kept[:cut]])
        for user in USERS:
            who = reads.Principal("t", user)
            as_of = f"position:{cut}"
            async with MemoryLedger(full, register_path=full_reg) as ml, \
                    ml.store.read() as conn:
                instant = await asof.resolve(conn, as_of)
            assert instant.stored  # the history view has caught up: read from it
            got = await _reads(full, full_reg, who, instant)
            # The same instant replayed from the ledger gives the same answers.
            assert await _reads(full, full_reg, who, replace(instant, history_at=0)) == got
            fresh = await _reads(prefix, prefix_reg, who, None, instant.now_us)
            owner = Coordinates("t", ns_path="t\x1fu1\x1ftickets\x1f", task_key="T1")
            for name, want in fresh.items():
                if name.startswith("get"):
                    if want.get("found"):
                        want = _redact(want, _hidden(want, later, kept, erased))
                    assert got[name] == want, (name, cut)
                elif name.startswith("history"):
                    assert got[name] == [_redact(i, _hidden(i, later, kept, erased))
                                         for i in want], (name, cut)
                elif any(covers(ts, owner) for ts in later):
                    # Notes a later forget covers are withheld: the same tasks, redacted.
                    assert [x["task_key"] for x in got[name]] == \
                        [x["task_key"] for x in want], (name, cut)
                    assert all(x.get("redacted") for x in got[name]), (name, cut)
                else:
                    assert got[name] == want, (name, cut)
            # Recall: from the stored history (its vectors) as from a replay; with no
            # later forget, as a replay of the prefix alone; never a redacted value.
            recalled = await _recalls(full, full_reg, who, as_of, stored=True)
            assert recalled == await _recalls(full, full_reg, who, as_of, stored=False)
            if not later:
                assert recalled == await _recalls(prefix, prefix_reg, who, as_of,
                                                  stored=False), cut
            for got_recall in recalled:
                for item in got_recall["items"]:
                    gone = _hidden(item, later, kept, erased)
                    assert not gone or (item["redacted"] and item["value"] is None), item


def _erased(e: dict[str, Any], later: list[Any], erased: set[str]) -> bool:
    """Is `e` a write whose content is gone from the whole ledger, or that a later
    forget covers (by the one forget rule)?"""
    if e["type"] not in ("memory.written", "memory.corrected"):
        return False
    d = e["data"]
    if d["memory_id"] in erased:
        return True
    coords = Coordinates("t", parse_event(dict(e)).order, d["memory_id"],
                         "\x1f".join(d["namespace"]) + "\x1f", d["key"], d.get("task_key"))
    return any(covers(ts, coords) for ts in later)


def _without_expiry(e: dict[str, Any]) -> dict[str, Any]:
    return {**e, "data": {k: v for k, v in e["data"].items() if k != "expires_at"}}


def _hidden(item: dict[str, Any], later: list[Any], kept: list[dict[str, Any]],
            erased: set[str]) -> set[str]:
    """The item's id if its content is gone from the whole ledger or a later forget
    covers it by the one forget rule (its order read from the event that wrote it)."""
    if item["memory_id"] in erased:
        return {item["memory_id"]}
    for e in kept:
        if e["type"] in ("memory.written", "memory.corrected") and \
                e["data"].get("memory_id") == item["memory_id"]:
            ev = parse_event(dict(e))
            coords = Coordinates("t", ev.order, item["memory_id"],
                                 "\x1f".join(item["namespace"]) + "\x1f", item["key"],
                                 item["task_key"])
            if any(covers(ts, coords) for ts in later):
                return {item["memory_id"]}
    return set()


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(events=histories(), cuts=st.lists(st.integers(0, 14), min_size=1, max_size=2))
def test_as_of_equals_a_fresh_replay_of_the_prefix(events: list[dict[str, Any]],
                                                    cuts: list[int]) -> None:
    """For random histories and instants, get / history / tasks as of position N (on the
    whole ledger, after later forgets and their erasure; from the stored history and
    replayed) equal the same reads of a new ledger holding only the first N events,
    expiry judged at N's recording time, with what later forgets cover redacted; recall
    as of N from the stored history equals its replay, and a replay of the prefix."""
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(_check_history(events, cuts, Path(d)))
