"""The forget register describes itself and survives damage (issue 15, finding 2; R21).

Each line names its ledger, its sequence and the previous line's checksum: an empty,
torn, reordered, spliced or foreign register is detected; the writer repairs a torn
tail before it appends; a restore refuses a damaged register unless told to repair it,
and never writes a forget twice; `verify --forgotten` reports a missing or damaged
register; a register of the old format is still read and upgraded on the next forget.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from ledger.errors import BackupError, RegisterError
from ledger.register import ForgetRegister
from ledger.store import Store
from ledger.validation import parse_event
from replay.backup import backup, restore
from replay.verify.forgotten import verify_forgotten
from tests.cli import Cli
from tests.factories import event, src, write
from tests.replay.test_verify import NS7, at, load, story


def _forget(idem: str, minute: int, key: str = "addr") -> dict[str, Any]:
    return event("memory.forgotten", {"namespace": NS7, "key": key}, idem=idem,
                 source=src(at=at(minute)))


def _lines(path: str) -> list[bytes]:
    return Path(path).read_bytes().splitlines()


def _write(path: str, data: bytes, *, append: bool = False) -> None:
    with Path(path).open("ab" if append else "wb") as f:
        f.write(data)


def _register_problems(res: dict[str, Any]) -> list[str]:
    return [p["detail"] for p in res.get("problems", []) if p["place"] == "forget_register"]


async def _with_backup_then_forgets(store: Store, tmp_path: Path) -> Path:
    """A story without its forgets, a backup, then the story's forgets and one more."""
    before = [e for e in story() if e["type"] not in ("memory.forgotten", "task.purged")]
    await load(store, before)
    await backup(store, tmp_path / "old.backup", progress=False)
    after = [e for e in story() if e["type"] in ("memory.forgotten", "task.purged")]
    await load(store, [*after, _forget("late", 40, key="style")])
    return tmp_path / "old.backup"


async def test_lines_name_the_ledger_with_sequence_and_chain(store: Store,
                                                             register_path: str) -> None:
    """Every line carries the ledger id (chain link of event 1), seq 1, 2, ... and the
    previous line's checksum; scanning finds no problem."""
    await load(store)
    objs = [orjson.loads(x) for x in _lines(register_path)]
    assert [o["seq"] for o in objs] == [1, 2, 3]
    assert len({o["ledger"] for o in objs}) == 1 and objs[0]["ledger"]
    assert [o["prev"] for o in objs] == ["", objs[0]["c"], objs[1]["c"]]
    assert store.register.scan().problems(ledger=objs[0]["ledger"]) == []


async def test_torn_tail_is_repaired_before_the_next_forget(store: Store,
                                                            register_path: str) -> None:
    """A register cut short inside a line (crash mid-write) is truncated to its last
    whole line before the next append: the next forget is not glued onto the torn bytes
    and every later read succeeds (before: "line N is damaged" for ever)."""
    await load(store, story()[:10])
    _write(register_path, b'{"c":"0123","e":{"event":{"type":"memory.forg', append=True)
    assert store.register.scan().torn
    await load(store, [write("x", "y", idem="w-x", source=src(at=at(20))),
                       _forget("f-x", 21, key="x")])
    entries = list(store.register.entries())
    assert [e["event"]["idempotency_key"] for e in entries] == ["s10", "f-x"]
    scan = store.register.scan()
    assert not scan.torn and scan.damage == []
    assert (await verify_forgotten(store))["ok"]


async def test_restore_twice_writes_each_forget_once(db_url: str, tmp_path: Path) -> None:
    """Restoring an older backup reapplies the register's forgets without appending
    them to the register again (before: each restore added every one once more)."""
    reg = str(tmp_path / "l.forgets")
    store = Store(db_url, register_path=reg)
    try:
        path = await _with_backup_then_forgets(store, tmp_path)
        before = _lines(reg)
        for _ in range(2):
            res = await restore(store, path, force=True, progress=False)
            assert len(res["reapplied"]["appended"]) == 4
            assert _lines(reg) == before
        assert (await verify_forgotten(store))["ok"]
    finally:
        await store.close()


@pytest.mark.parametrize("damage", ["empty", "flipped", "reordered", "dropped", "torn"])
async def test_restore_refuses_a_damaged_register_unless_told(
        db_url: str, tmp_path: Path, damage: str) -> None:
    """An empty (0 bytes), flipped, reordered, spliced (a middle line dropped) or torn
    register stops the restore before the database changes; `register_damaged="repair"`
    keeps the intact entries (old file set aside) and restores (before: an empty
    register restored silently and brought forgotten values back)."""
    reg = str(tmp_path / "l.forgets")
    store = Store(db_url, register_path=reg)
    try:
        path = await _with_backup_then_forgets(store, tmp_path)
        lines = _lines(reg)
        assert len(lines) == 4
        bad = {"empty": [],
               "flipped": [lines[0], lines[1].replace(b'"seq":2', b'"seq":3'), *lines[2:]],
               "reordered": [lines[1], lines[0], *lines[2:]],
               "dropped": [lines[0], *lines[2:]],
               "torn": [*lines[:3], lines[3][:20]]}[damage]
        data = b"".join(x + b"\n" for x in bad)
        _write(reg, data[:-1] if damage == "torn" else data)
        head = await store.head()
        with pytest.raises(BackupError, match="forget register") as err:
            await restore(store, path, force=True, progress=False)
        assert "nothing was changed" in str(err.value)
        assert await store.head() == head
        problems = _register_problems(await verify_forgotten(store))
        assert problems, damage
        res = await restore(store, path, force=True, progress=False,
                            register_damaged="repair")
        assert res["register_repaired"]["set_aside"].endswith(".damaged")
        assert Path(res["register_repaired"]["set_aside"]).name == "l.forgets.damaged"
        assert store.register.scan().damage == []
        # The ledger's own forgets complete the repaired register: verify is clean.
        assert (await verify_forgotten(store))["ok"], damage
    finally:
        await store.close()


async def test_restore_refuses_a_register_of_another_ledger(db_url: str,
                                                            tmp_path: Path) -> None:
    """A register naming another ledger (another database's first event) is refused by
    restore and by the writer; nothing is appended."""
    a = Store(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}", register_path=str(tmp_path / "a.f"))
    b = Store(db_url, register_path=str(tmp_path / "b.f"))
    try:
        await load(a, [write("zz", "1", idem="other-1", source=src(at=at(0))),
                       _forget("other-2", 1, key="zz")])
        await load(b, story())
        await backup(b, tmp_path / "b.backup", progress=False)
        b.register = ForgetRegister(tmp_path / "a.f")
        with pytest.raises(BackupError, match="another ledger"):
            await restore(b, tmp_path / "b.backup", force=True, progress=False)
        head = await b.head()
        with pytest.raises(RegisterError, match="another ledger"):
            await b.append_one(parse_event(_forget("b-late", 30, key="lang")))
        assert await b.head() == head
    finally:
        await a.close()
        await b.close()


def test_verify_forgotten_reports_missing_and_damaged_register(db_url: str,
                                                               tmp_path: Path) -> None:
    """`memledger replay verify --forgotten` exits 1 and names the register when it is
    missing (the ledger holds forgets) or damaged, instead of `ok` (before: ok)."""
    reg = tmp_path / "l.forgets"
    cli = Cli(db_url, str(reg))
    cli.append(story())
    cli.run("project")
    assert cli.json("replay", "verify", "--forgotten")["ok"]
    good = reg.read_bytes()
    reg.unlink()
    res = cli.json("replay", "verify", "--forgotten", check=1)
    assert any("not found" in p for p in _register_problems(res))
    reg.write_bytes(good.replace(b'"seq":2', b'"seq":7'))
    res = cli.json("replay", "verify", "--forgotten", check=1)
    assert any("line 2 is damaged" in p for p in _register_problems(res))
    reg.write_bytes(good.split(b"\n", 1)[1])  # the first line cut away
    res = cli.json("replay", "verify", "--forgotten", check=1)
    assert _register_problems(res)


def _legacy(entry: dict[str, Any]) -> bytes:
    body = orjson.dumps(entry, option=orjson.OPT_SORT_KEYS)
    check = hashlib.sha256(body).hexdigest()[:16]
    return orjson.dumps({"e": orjson.Fragment(body), "c": check}) + b"\n"


async def test_legacy_register_is_read_reported_and_upgraded(store: Store,
                                                             register_path: str) -> None:
    """A register in the old format (no ledger, sequence or chain) is still read,
    `verify --forgotten` says it is legacy, and the next forget rewrites it in format 2
    with every entry kept."""
    await load(store, story()[:12])
    entries = list(store.register.entries())
    assert len(entries) == 2
    _write(register_path, b"".join(_legacy(e) for e in entries))
    assert store.register.scan().format == "legacy"
    assert list(store.register.entries()) == entries
    res = await verify_forgotten(store)
    assert res["ok"] and any("legacy" in n for n in res["notes"])
    await load(store, [_forget("f-after", 30, key="style")])
    scan = store.register.scan()
    assert scan.format == "v2" and scan.damage == []
    assert [e["event"]["idempotency_key"] for e in scan.entries] == ["s10", "s12", "f-after"]
    assert (await verify_forgotten(store))["ok"]


async def test_restoring_a_backup_of_an_empty_ledger_keeps_the_register_usable(
        db_url: str, tmp_path: Path) -> None:
    """A backup taken before the first event names no ledger: restoring it reapplies the
    register and the register then names the restored ledger, so later forgets are
    recorded (not refused as "another ledger")."""
    reg = str(tmp_path / "l.forgets")
    store = Store(db_url, register_path=reg)
    try:
        await store.open()
        await backup(store, tmp_path / "empty.backup", progress=False)
        await load(store)
        res = await restore(store, tmp_path / "empty.backup", force=True, progress=False)
        assert len(res["reapplied"]["appended"]) == 3
        await load(store, [write("x", "y", idem="w-x", source=src(at=at(20))),
                           _forget("f-x", 21, key="x")])
        assert len(list(store.register.entries())) == 4
        assert (await verify_forgotten(store))["ok"]
    finally:
        await store.close()


async def test_cli_restore_refuses_a_torn_register_until_told_to_repair(
        sqlite_url: str, tmp_path: Path) -> None:
    """`memledger restore` with a torn register exits 1 naming the flag that repairs it;
    `--register-damaged repair` restores, and the repaired register verifies (R21)."""
    reg = str(tmp_path / "l.forgets")
    store = Store(sqlite_url, register_path=reg)
    try:
        path = await _with_backup_then_forgets(store, tmp_path)
    finally:
        await store.close()
    torn = b"".join(x + b"\n" for x in _lines(reg))[:-25]  # the last line torn
    _write(reg, torn)
    cli = Cli(sqlite_url, reg)
    refused = cli.run("restore", str(path), "--force", check=1)
    assert b"--register-damaged repair" in refused.stderr
    assert b"Traceback" not in refused.stderr
    cli.json("restore", str(path), "--force", "--register-damaged", "repair")
    assert cli.json("replay", "verify", "--forgotten")["ok"]
