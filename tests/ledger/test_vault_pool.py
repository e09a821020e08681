"""The vault's key pool (ledger/vault.py, docs/forgetting.md "The key pool"; R20, R21).

Keys are provisioned ahead, many in one durable write, and each content event takes a
fresh one: the pool is fsynced before any of its keys seals an event; a clean close
removes the keys that sealed nothing (not fenced: they were never a subject's); a
pool id that is taken or fenced is never provisioned; a process killed in the middle
of its pool leaves every committed event readable.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ledger.vault as vault_mod
from ledger.store import Store
from ledger.validation import parse_event
from ledger.vault import (
    FILE_MAGIC,
    POOL_FIRST,
    FileKeyStore,
    KeyFenced,
    PostgresKeyStore,
    Vault,
    is_sealed,
    sealed_key_id,
)
from projections.runner import Runner
from replay.verify import verify
from tests.factories import src, write
from tests.helpers import sealed_key_ids

_REC_HEAD = 1 + 16 + 2  # tag, key id, length (ledger.vault._REC)
_FILE_HEAD = 16  # magic, record width (u16, big-endian), zeros


def at(minute: int) -> str:
    """A source time on 2026-09-21."""
    return f"2026-09-21T10:{minute % 60:02d}:{minute // 60:02d}+08:00"


def key_records(path: Path) -> dict[str, tuple[int, bytes]]:
    """The records of a key store file as they are on disk, read by the layout
    docs/forgetting.md gives (fixed-size records after a 16-byte head): id -> (end
    offset, tag) of its last record."""
    data = path.read_bytes()
    assert data.startswith(FILE_MAGIC)
    width = int.from_bytes(data[len(FILE_MAGIC):len(FILE_MAGIC) + 2], "big")
    out: dict[str, tuple[int, bytes]] = {}
    i = _FILE_HEAD
    while i + _REC_HEAD + width <= len(data):
        tag, kid, n = data[i:i + 1], data[i + 1:i + 17].hex(), int.from_bytes(
            data[i + 17:i + 19], "big")
        assert n <= width and not any(data[i + _REC_HEAD + n:i + _REC_HEAD + width])
        i += _REC_HEAD + width
        out[kid] = (i, tag)
    return out


async def test_a_pool_is_fsynced_before_its_keys_seal_an_event(
        sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key that seals an event was in the key store file, inside what an fsync
    of that file covered, before the event was sealed (so before it commits); the
    pool is provisioned once for many group commits, not once per commit."""
    path = tmp_path / "ledger.vault"
    store = Store(sqlite_url, register_path=str(tmp_path / "f"), vault=FileKeyStore(path))
    synced = [0]  # the key store file's size at its last fsync
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        with_path = os.readlink(f"/proc/self/fd/{fd}") if Path("/proc/self/fd").exists() \
            else ""
        if with_path == str(path):
            synced[0] = os.fstat(fd).st_size

    monkeypatch.setattr(os, "fsync", fsync)
    assert store.vault is not None
    vault = store.vault
    real_seal = vault.seal_rows
    checked: list[str] = []
    pools = [0]
    real_pool = vault.keys.provision_pool

    def provision_pool(n: int) -> dict[str, bytes]:
        pools[0] += 1
        return real_pool(n)

    def seal_rows(rows: Any) -> None:
        real_seal(rows)
        on_disk = key_records(path)
        for r in rows:
            if r["payload"] is not None and is_sealed(r["payload"]):
                kid = sealed_key_id(r["payload"])
                end, tag = on_disk[kid]
                assert tag == b"K" and end <= synced[0], "sealed under an unsynced key"
                checked.append(kid)

    monkeypatch.setattr(vault.keys, "provision_pool", provision_pool)
    monkeypatch.setattr(vault, "seal_rows", seal_rows)
    try:
        for i in range(40):  # 40 group commits of 2 events
            await store.append([parse_event(write(f"k{i}-{j}", f"v{i}-{j}", idem=f"a{i}.{j}",
                                                  source=src(at=at(i)))) for j in range(2)])
        assert len(checked) == len(set(checked)) == 80  # a fresh key an event
        assert pools[0] == 2  # 64, then 128: not one provisioning per commit
        assert set(await sealed_key_ids(store)) == {f"a{i}.{j}" for i in range(40)
                                                for j in range(2)}
    finally:
        await store.close()



async def test_pools_are_provisioned_outside_the_write_transaction(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The append path fills the pool before a group's write transaction
    (`Vault.reserve` from `Store._commit_group`, on a thread of the event loop's
    executor): no key store write runs where a write transaction runs (the inline
    thread on a SQLite file, the event loop's thread on PostgreSQL), the ciphers of a
    pool are built with it, and every key still seals one event."""
    store = Store(db_url, register_path=str(tmp_path / "f"),
                  vault=_key_store(db_url, tmp_path))
    assert store.vault is not None
    vault = store.vault
    threads: list[str] = []
    real_pool = vault.keys.provision_pool

    def provision_pool(n: int) -> dict[str, bytes]:
        threads.append(threading.current_thread().name)
        return real_pool(n)

    built: list[str] = []
    real_aesgcm = vault_mod.AESGCM

    def aesgcm(key: bytes) -> Any:
        built.append(threading.current_thread().name)
        return real_aesgcm(key)

    monkeypatch.setattr(vault.keys, "provision_pool", provision_pool)
    monkeypatch.setattr(vault_mod, "AESGCM", aesgcm)
    sizes = [1, 70, 3, 200, 1, 500, 64, 2]

    async def caller(c: int) -> None:
        for j, n in enumerate(sizes[c:] + sizes[:c]):
            await store.append([parse_event(write(
                f"c{c}-{j}-{i}", f"v{i}", idem=f"c{c}.{j}.{i}",
                source=src(at=at(c * 100 + j)))) for i in range(n)])

    try:
        await asyncio.gather(*(caller(c) for c in range(3)))
        main = threading.current_thread().name
        assert threads, "no pool was provisioned"
        for name in threads + built:
            assert not name.startswith("memledger-views") and name != main, name
        ids = await sealed_key_ids(store)
        assert len(ids) == len(set(ids.values())) == 3 * sum(sizes)
    finally:
        await store.close()

def _key_store(db_url: str, tmp_path: Path, schema: str = "memledger_vault") -> Any:
    if db_url.startswith("sqlite"):
        return FileKeyStore(tmp_path / "ledger.vault")
    return PostgresKeyStore(db_url, schema=schema)


async def test_a_clean_close_removes_unused_pool_keys(db_url: str, tmp_path: Path) -> None:
    """After a clean close the key store holds the keys of the events (readable in a new
    process), not the pool's unused keys, and none of those is fenced."""
    store = Store(db_url, register_path=str(tmp_path / "f"),
                  vault=_key_store(db_url, tmp_path))
    try:
        for i in range(3):
            await store.append_one(parse_event(write(f"k{i}", f"v{i}", idem=f"c{i}",
                                                     source=src(at=at(i)))))
        await Runner(store).catch_up()
        assert store.vault is not None
        unused = list(store.vault._pool)
        assert len(unused) == POOL_FIRST - 3
        used = await sealed_key_ids(store)
    finally:
        await store.close()
    fresh = _key_store(db_url, tmp_path)
    try:
        assert fresh.load(unused) == {}
        assert fresh.fenced(unused) == set()
        assert set(fresh.load(used.values())) == set(used.values())
    finally:
        fresh.close()
    again = Store(db_url, register_path=str(tmp_path / "f"),
                  vault=_key_store(db_url, tmp_path))
    try:
        async with again.read() as conn:
            evs = await again.read_events(conn, 0, 10)
        assert [e.event.data["value"] for e in evs if e.event is not None] == \
            ["v0", "v1", "v2"]
        assert [e.key_id for e in evs] == [used[f"c{i}"] for i in range(3)]
    finally:
        await again.close()


def test_a_pool_never_takes_a_present_or_fenced_id(db_url: str, tmp_path: Path) -> None:
    """Provisioning a pool checks every id against the keys and the fence like any
    id: a taken or fenced id refuses the whole batch (nothing stored), and a pool is
    drawn again rather than reuse one."""
    ks = _key_store(db_url, tmp_path, schema="kv_pool")
    try:
        have = ks.provision(["a0" * 16])
        ks.provision(["f0" * 16])
        ks.destroy(["f0" * 16])
        for taken in ("a0" * 16, "f0" * 16):
            with pytest.raises(KeyFenced):
                ks._provision(sorted([taken, "b0" * 16]), fresh=True)
            assert ks.load(["b0" * 16]) == {}
        assert ks.load(["a0" * 16]) == have  # the present key is untouched
        pool = ks.provision_pool(50)
        assert len(pool) == 50 and not ks.fenced(pool)
        assert ks.load(pool) == pool
        vault = Vault(ks)
        ids = vault.take(3) + vault.take(POOL_FIRST)
        assert len(set(ids)) == len(ids)
        vault.close()  # releases what is left, closes the store
    finally:
        ks.close()


_CRASH = textwrap.dedent("""
    import asyncio, sys
    from ledger.store import Store
    from ledger.validation import parse_event
    from ledger.vault import FileKeyStore
    from tests.factories import src, write

    async def main() -> None:
        d = sys.argv[1]
        store = Store(f"sqlite+aiosqlite:///{d}/ledger.db", register_path=f"{d}/f",
                      vault=FileKeyStore(f"{d}/ledger.vault"))
        i = 0
        while True:
            await store.append([parse_event(write(f"k{i}", f"crash-{i}", idem=f"x{i}",
                                source=src(at="2026-09-21T10:00:00+08:00")))])
            print(i, flush=True)
            i += 1

    asyncio.run(main())
""")


def _append_until_killed(where: Path, after: int) -> int:
    """Run the writer process, SIGKILL it once it has acknowledged `after` appends;
    the last acknowledged index."""
    proc = subprocess.Popen([sys.executable, "-c", _CRASH, str(where)],
                            stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    acked = -1
    deadline = time.monotonic() + 120
    while acked < after and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acked = int(line)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert acked >= after, "the writer process did not get going"
    return acked


async def test_a_kill_in_the_middle_of_a_pool_loses_no_committed_event(
        tmp_path: Path) -> None:
    """A process killed (SIGKILL) while it appends, its pool half used: a new process
    reads every event the dead one committed, the unused pool keys are leftovers that
    open nothing, and verify is clean."""
    acked = _append_until_killed(tmp_path, 70)  # into its second pool (64, then 128)
    store = Store(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}",
                  register_path=str(tmp_path / "f"),
                  vault=FileKeyStore(tmp_path / "ledger.vault"))
    try:
        async with store.read() as conn:
            evs = await store.read_events(conn, 0, 10_000)
        assert len(evs) >= acked + 1  # every acknowledged append is there
        assert all(e.event is not None and e.event.data["value"] == f"crash-{e.position - 1}"
                   for e in evs)
        used = {e.key_id for e in evs}
        on_disk = {k for k, (_, tag) in key_records(tmp_path / "ledger.vault").items()
                   if tag == b"K"}
        assert used <= on_disk and len(on_disk - used) > 0  # leftovers of the dead pool
        assert (await verify(store))["ok"]
    finally:
        await store.close()
