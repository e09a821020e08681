"""`memledger backup` / `restore`: consistent online, portable, checked, and forgets hold.

A backup taken while appends go on restores to one consistent position; SQLite ->
PostgreSQL -> SQLite gives identical views and a passing verify; a backup from before a
forget, restored after it, returns nothing forgotten on any read path nor on disk (R21,
R22); a damaged or truncated file is refused and changes nothing.
"""

from __future__ import annotations

import asyncio
import gzip
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import select

from ledger import schema as t
from ledger.errors import BackupError
from ledger.store import Store
from ledger.validation import parse_event
from projections import reads
from projections.recall import recall
from replay.backup import BackupReader, backup, restore
from replay.verify import verify
from replay.verify.forgotten import verify_forgotten
from tests.cli import Cli
from tests.factories import event, src, write
from tests.helpers import dump_views
from tests.replay.test_verify import NS7, SECRET, TASK_SECRET, at, load, story

U7 = reads.Principal("shop-a", "u7")
NOW = 1_900_000_000_000_000
ALL_VIEWS = t.VIEW_TABLES


def sqlite_files(url: str) -> bytes:
    """Every byte of a SQLite ledger's files (database, WAL, shared memory)."""
    db = Path(url.split(":///", 1)[1])
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))


async def read_everything(store: Store) -> str:
    """What u7 can read on every path (get, recall, tasks), as one string."""
    async with store.read() as conn:
        got = [await reads.get(conn, U7, NS7, k, now_us=NOW) for k in ("lang", "addr", "pin")]
        tasks = await reads.tasks(conn, U7, include_closed=True)
    rec = await recall(store, "shop-a/u7", query="addr pin lang street", session=None,
                       task=None, budget=None, limit=50, now_us=NOW)
    return repr((got, tasks, rec["items"], rec["tasks"]))


async def ledger_rows(store: Store) -> list[tuple[Any, ...]]:
    """The events table as comparable tuples (payload included)."""
    async with store.read() as conn:
        rows = (await conn.execute(select(t.events).order_by(t.events.c.position))).all()
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in rows]


async def test_backup_under_concurrent_appends_restores_consistently(
        db_url: str, tmp_path: Path) -> None:
    """Appends go on during the backup; it restores to exactly the ledger at its position,
    tombstones and task owners included, and verifies clean."""
    live = Store(db_url, register_path=str(tmp_path / "live.forgets"))
    writer = Store(db_url, register_path=str(tmp_path / "live.forgets"))
    # Restored elsewhere with the live ledger's key store (the vault is on by default
    # for a new SQLite ledger; None: in clear, the target's default then applies).
    target = Store(f"sqlite+aiosqlite:///{tmp_path / 'restored.db'}",
                   register_path=str(tmp_path / "live.forgets"),
                   vault=live.vault.keys if live.vault is not None else None)
    try:
        await load(live)
        stop = asyncio.Event()
        started = asyncio.Event()
        appended = 0

        async def keep_appending() -> None:
            nonlocal appended
            i = 0
            while not stop.is_set() or i < 3:
                batch = [
                    event("task.opened", {"task_key": f"TC{i}",
                                          "namespace": ["shop-a", "u7", "tickets"]},
                          idem=f"c-open-{i}", source=src(at=at(20))),
                    write(f"k{i}", f"v{i}", idem=f"c-w-{i}", source=src(at=at(21))),
                ]
                if i % 3 == 2:
                    batch.append(event("memory.forgotten", {"namespace": NS7, "key": f"k{i}"},
                                       idem=f"c-f-{i}", source=src(at=at(22))))
                await writer.append([parse_event(e) for e in batch])
                appended += 1
                if appended == 3:
                    started.set()
                i += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(keep_appending())
        await started.wait()
        before = await live.head()
        res = await backup(live, tmp_path / "online.backup", progress=False)
        stop.set()
        await task
        assert res["position"] >= before
        assert await live.head() > res["position"]  # the ledger went on after the snapshot
        await restore(target, tmp_path / "online.backup", progress=False)
        p = res["position"]
        restored, now = await ledger_rows(target), await ledger_rows(live)
        assert _same_but_erased(restored[:p], now[:p])
        # Beyond the backup's position: only the forgets the register recorded since (R21).
        key, typ = (next(i for i, c in enumerate(t.events.columns) if c.name == n)
                    for n in ("idempotency_key", "type"))
        assert {r[typ] for r in restored[p:]} <= {"memory.forgotten"}
        assert {r[key] for r in restored[p:]} == {r[key] for r in now[p:]
                                                  if r[typ] == "memory.forgotten"}
        checked = await verify(target)
        assert checked["ok"], checked
        async with target.read() as conn:
            owners = (await conn.execute(select(t.task_owners.c.task_key))).scalars().all()
            opened = (await conn.execute(select(t.events.c.task_key).where(
                t.events.c.type == "task.opened"))).scalars().all()
        assert sorted(owners) == sorted(opened)
    finally:
        for s in (live, writer, target):
            await s.close()


def _same_but_erased(restored: list[tuple[Any, ...]], live: list[tuple[Any, ...]]) -> bool:
    """Rows equal except payloads the backup wrote as erased (covered by a forget)."""
    cols = [c.name for c in t.events.columns]
    pi, ri = cols.index("payload"), cols.index("redacted")
    strip = [i for i in range(len(cols)) if i not in (pi, ri)]
    for a, b in zip(restored, live, strict=True):
        if a != b and ([a[i] for i in strip] != [b[i] for i in strip]
                       or a[pi] is not None or not a[ri]):
            return False
    return True


@pytest.mark.postgres
async def test_round_trip_sqlite_postgres_sqlite(tmp_path: Path, sqlite_url: str,
                                                 pg_url: str) -> None:
    """A SQLite backup restores into PostgreSQL and back with identical views, ledger
    rows and a passing verify."""
    reg = str(tmp_path / "l.forgets")
    first = Store(sqlite_url, register_path=reg)
    # One key store for the content wherever it is restored (the vault is on by default
    # for the new SQLite ledger).
    keys = first.vault.keys if first.vault is not None else None
    pg = Store(pg_url, register_path=reg, vault=keys)
    back = Store(f"sqlite+aiosqlite:///{tmp_path / 'back.db'}", register_path=reg, vault=keys)
    try:
        await load(first)
        views = await dump_views(first, ALL_VIEWS)
        await backup(first, tmp_path / "a.backup.gz", progress=False)
        await restore(pg, tmp_path / "a.backup.gz", progress=False)
        assert await dump_views(pg, ALL_VIEWS) == views
        assert (await verify(pg))["ok"]
        await backup(pg, tmp_path / "b.backup", progress=False)
        header = orjson.loads((tmp_path / "b.backup").read_bytes().split(b"\n", 1)[0])
        assert header["source_backend"] == "postgresql"
        await restore(back, tmp_path / "b.backup", progress=False)
        assert await dump_views(back, ALL_VIEWS) == views
        assert await ledger_rows(back) == await ledger_rows(first)
        assert (await verify(back))["ok"]
        assert (await verify_forgotten(back))["ok"]
    finally:
        for s in (first, pg, back):
            await s.close()


async def test_backup_from_before_a_forget_restores_nothing_forgotten(
        db_url: str, tmp_path: Path) -> None:
    """Forgets recorded after the backup are reapplied on restore: nothing they cover is
    readable on any path, held in any view or payload, or (SQLite) on disk (R21, R22)."""
    reg = str(tmp_path / "l.forgets")
    store = Store(db_url, register_path=reg)
    try:
        before_forgets = [e for e in story() if e["type"] not in
                          ("memory.forgotten", "task.purged")]
        await load(store, before_forgets)
        pin = write("pin", "QUOKKA-late-5", idem="late-1", memory_id="M9",
                    source=src(at=at(30)))
        await backup(store, tmp_path / "old.backup", progress=False)
        held = b"".join(r["payload"] or b"" for tb, rows in
                        BackupReader(tmp_path / "old.backup").rows() if tb is t.events
                        for r in rows)
        # Without the vault the old backup holds it and the restore must not bring it
        # back; with the vault (the default for a new SQLite ledger) it holds ciphertext.
        assert (SECRET.encode() in held) == (store.vault is None)
        # After the backup: u7 writes M9 and forgets it by id, the key and task forgets of
        # the story happen, and everything is projected and erased.
        after = [pin, event("memory.forgotten", {"memory_id": "M9"}, idem="late-2",
                            source=src(at=at(31)))]
        after += [e for e in story() if e["type"] in ("memory.forgotten", "task.purged")]
        await load(store, after)
        assert "QUOKKA" not in await read_everything(store)

        res = await restore(store, tmp_path / "old.backup", force=True, progress=False)
        how = {a["idempotency_key"]: a["how"] for a in res["reapplied"]["appended"]}
        # M9's write is not in the old backup: its forget is recorded all the same.
        assert how == {"late-2": "recorded", "s10": "appended", "s12": "appended",
                       "s15": "appended"}
        # Erased by the reapplied forgets, or (vault) restored redacted: keys destroyed.
        assert res["reapplied"]["payloads_erased"] + \
            res["vault"]["redacted_key_destroyed"] >= 3
        text = await read_everything(store)
        assert "QUOKKA" not in text and "German" not in text
        assert (await verify(store))["ok"]
        assert (await verify_forgotten(store))["ok"]
        # The memory's write replayed from its source later stays suppressed (R22).
        [late] = await store.append([parse_event(pin)])
        assert late.suppressed
        await load(store, [])
        assert "QUOKKA" not in await read_everything(store)
        if store.dialect == "sqlite":
            await store.close()
            files = sqlite_files(db_url)
            assert SECRET.encode() not in files
            assert TASK_SECRET.encode() not in files
            assert b"QUOKKA" not in files
    finally:
        await store.close()


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x04
    return bytes(b)


async def test_corrupted_backup_is_refused_and_changes_nothing(
        db_url: str, tmp_path: Path) -> None:
    """One flipped byte anywhere, or a cut-short file (plain or gzip), is refused with a
    clear error before the live database is touched."""
    reg = str(tmp_path / "l.forgets")
    store = Store(db_url, register_path=reg)
    try:
        await load(store)
        await backup(store, tmp_path / "good.backup", progress=False)
        good = (tmp_path / "good.backup").read_bytes()
        await load(store, [write("after", "backup", idem="x1", source=src(at=at(40)))])
        before_views = await dump_views(store, ALL_VIEWS)
        before_rows = await ledger_rows(store)
        lines = good.split(b"\n")
        row_at = len(lines[0]) + len(lines[1]) + 2 + 40  # inside the first event row
        bad: dict[str, bytes] = {
            "header": _flip(good, 15),
            "row": _flip(good, row_at),
            "middle": _flip(good, len(good) // 2),
            "trailer": _flip(good, len(good) - 10),
            "truncated": good[: len(good) * 2 // 3],
            "no trailer": b"\n".join(lines[:-2]) + b"\n",
            "gzip truncated": gzip.compress(good)[:-40],
            "gzip flipped": _flip(gzip.compress(good), 200),
        }
        for name, data in bad.items():
            path = tmp_path / f"bad-{name.replace(' ', '-')}.backup"
            path.write_bytes(data)
            with pytest.raises(BackupError, match=r"unusable|not a memledger backup") as err:
                await restore(store, path, force=True, progress=False)
            assert "nothing was changed" in str(err.value), name
        assert await dump_views(store, ALL_VIEWS) == before_views
        assert await ledger_rows(store) == before_rows
        BackupReader(tmp_path / "good.backup").check()  # the original is still fine
    finally:
        await store.close()


def test_restore_cli_refusals(db_url: str, tmp_path: Path) -> None:
    """`restore` refuses a non-empty database without --force, a missing register without
    --without-register, and a damaged file: exit 1, a clear message, nothing changed."""
    cli = Cli(db_url, str(tmp_path / "l.forgets"))
    cli.append(story())
    cli.run("project")
    made = cli.json("backup", str(tmp_path / "b.jsonl"))
    assert made["position"] == len(story()) and made["counts"]["tombstones"] == 3
    err = cli.json("restore", str(tmp_path / "b.jsonl"), check=1)["error"]
    assert "not empty" in err and "--force" in err
    (tmp_path / "cut.jsonl").write_bytes((tmp_path / "b.jsonl").read_bytes()[:-200])
    err = cli.json("restore", str(tmp_path / "cut.jsonl"), "--force", check=1)["error"]
    assert "unusable" in err
    assert cli.json("replay", "verify")["ok"]

    # Elsewhere, with the first ledger's key store where it has one (the vault's default
    # for a new SQLite ledger): a new ledger's own would hold none of the backup's keys.
    first_keys = tmp_path / "ledger.db.vault"
    other = Cli(f"sqlite+aiosqlite:///{tmp_path / 'new.db'}", str(tmp_path / "none.forgets"),
                env={"MEMLEDGER_VAULT_PATH": str(first_keys)} if first_keys.exists() else None)
    err = other.json("restore", str(tmp_path / "b.jsonl"), check=1)["error"]
    assert "forget register" in err and "--without-register" in err
    res = other.json("restore", str(tmp_path / "b.jsonl"), "--without-register")
    assert res["head"] == len(story()) and res["reapplied"]["appended"] == []
    assert other.json("replay", "verify")["ok"]
    assert other.json("get", "--as", "shop-a/u7", "--namespace", "shop-a/u7/preferences",
                      "--key", "lang")["value"] == "English"
