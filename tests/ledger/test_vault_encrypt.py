"""`memledger vault encrypt` (replay/encrypt.py): a ledger written in clear is sealed in
place, resumably, with progress, the views rebuilt sealed and the files compacted, so
no plaintext is left in the SQLite files; reads, views and verify are as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger.store import Store
from ledger.validation import parse_event
from ledger.vault import FileKeyStore, PostgresKeyStore
from projections import reads
from projections.runner import Runner
from replay.encrypt import count_in_clear, encrypt_ledger
from replay.progress import ProgressUpdate
from replay.verify import verify
from tests.cli import Cli
from tests.factories import event, src, write
from tests.helpers import dump_views
from workers.ingest import list_dead_letters, record_dead_letters

U7 = reads.Principal("shop-a", "u7")
NS7 = ["shop-a", "u7", "preferences"]
NOW = 1_900_000_000_000_000
SECRET = "DINGO-secret-7781"


def at(minute: int) -> str:
    """A source time on 2026-09-20."""
    return f"2026-09-20T10:{minute:02d}:00+08:00"


def story() -> list[dict[str, object]]:
    """Six writes (one of them the secret), a task with a note, a forget of one key."""
    evs: list[dict[str, object]] = [
        write(f"k{i}", f"value-{i}", idem=f"p{i}", source=src(at=at(i))) for i in range(5)]
    evs += [
        write("pin", SECRET, idem="p9", source=src(at=at(9))),
        event("task.opened", {"task_key": "T7", "namespace": ["shop-a", "u7", "t"],
                              "title": SECRET + "-task"}, actor="aftersales", idem="p10",
              source=src("system_of_record", "as", at(10))),
        event("memory.forgotten", {"namespace": NS7, "key": "k1"}, idem="p11",
              source=src(at=at(11))),
    ]
    return evs


class Stop(Exception):
    """Raised from the progress callback: the command interrupted mid-way."""


async def test_encrypt_in_place_resumable(db_url: str, tmp_path: Path) -> None:
    """Interrupted after its first batch, then run again, the conversion seals every
    content payload still in clear, rebuilds views equal to the ones before, verifies
    clean, reads the same values, and leaves the secret in no SQLite file."""
    reg = str(tmp_path / "ledger.forgets")
    plain = Store(db_url, register_path=reg, vault=False)
    try:
        for e in story():
            await plain.append_one(parse_event(e))
        await Runner(plain).catch_up()
        await record_dead_letters(plain, [(write("pin", DEAD, idem="d1", layer="bad"),
                                           ValueError("bad layer"))])
        before = await dump_views(plain)
        assert await count_in_clear(plain) == 6  # the forgotten write is erased already
    finally:
        await plain.close()
    keys = FileKeyStore(tmp_path / "ledger.vault") if db_url.startswith("sqlite") \
        else PostgresKeyStore(db_url)
    store = Store(db_url, register_path=reg, vault=keys)
    seen: list[ProgressUpdate] = []

    def stop_after_first(u: ProgressUpdate) -> None:
        seen.append(u)
        if u.done >= 2 and not u.final:
            raise Stop

    try:
        with pytest.raises(Stop):
            await encrypt_ledger(store, batch=2, progress=stop_after_first)
        assert await count_in_clear(store) == 4  # the first batch is committed
        res = await encrypt_ledger(store, batch=2)
        assert (res["sealed"], res["in_clear_left"]) == (4, 0)
        assert res["dead_letters_sealed"] == 1
        listed = await list_dead_letters(store)
        assert listed[0]["event"]["data"]["value"] == DEAD  # opens with its key
        assert await dump_views(store) == before
        assert (await verify(store))["ok"]
        async with store.read() as conn:
            got = await reads.get(conn, U7, NS7, "pin", now_us=NOW)
        assert got["found"] and got["value"] == SECRET
    finally:
        await store.close()
    if db_url.startswith("sqlite"):
        db = Path(db_url.split(":///", 1)[1])
        files = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))
        assert SECRET.encode() not in files
        assert DEAD.encode() not in files


DEAD = "NUMBAT-dead-letter-3390"


def test_vault_cli(tmp_path: Path) -> None:
    """`vault status` and `vault encrypt` from the command line; `restore` without the
    key store refuses with the flag to use, and `--envelopes-only` restores."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'l.db'}"
    # A ledger written in clear (the vault switched off; new ledgers have it on).
    Cli(url, str(tmp_path / "l.forgets"), env={"MEMLEDGER_VAULT": "off"}).append(story()[:6])
    cli = Cli(url, str(tmp_path / "l.forgets"))
    assert cli.json("vault", "status") == {"vault": False, "in_clear": 6}
    on = Cli(url, str(tmp_path / "l.forgets"), env={"MEMLEDGER_VAULT": "on"})
    assert on.json("vault", "encrypt", "--quiet")["in_clear_left"] == 0
    status = cli.json("vault", "status")  # on now: the key store file exists
    assert status["vault"] and status["in_clear"] == 0 and status["key_store"] == "file"
    on.json("backup", str(tmp_path / "b.jsonl"))
    other = Cli(f"sqlite+aiosqlite:///{tmp_path / 'new.db'}", str(tmp_path / "l.forgets"))
    err = other.json("restore", str(tmp_path / "b.jsonl"), "--without-register",
                     check=1)["error"]
    assert "--envelopes-only" in err and "key store" in err
    res = other.json("restore", str(tmp_path / "b.jsonl"), "--without-register",
                     "--envelopes-only", "--quiet")
    assert res["vault"]["envelopes_only"] and res["vault"]["unreadable_no_key"] == 6
