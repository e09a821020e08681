"""The key pool refilled outside the write lock (ledger/vault.py, "The key pool").

`Store` reserves a group's keys before its write transaction (`Vault.reserve`), and a
pool that runs low is refilled on a thread of its own (`Vault._after_take`), so the
key store's write and fsync never run under the ledger's write lock. The vault's rule
still holds exactly: a key enters the pool only once durable, so no event is ever
sealed with a key that a crash could lose; a close waits for a refill under way and
removes every unused key, those of that refill too; a process killed between a
refill and the append that would have used it leaves keys of nothing, and every
committed event readable.
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
from ledger.vault import FileKeyStore, KeyStore, PostgresKeyStore, is_sealed, sealed_key_id
from replay.verify import verify
from tests.factories import src, write
from tests.helpers import sealed_key_ids
from tests.ledger.test_vault_pool import at, key_records


def _key_store(db_url: str, tmp_path: Path) -> KeyStore:
    if db_url.startswith("sqlite"):
        return FileKeyStore(tmp_path / "ledger.vault")
    return PostgresKeyStore(db_url)


def _events(prefix: str, n: int, start: int = 0) -> list[Any]:
    return [parse_event(write(f"{prefix}{i}", f"v-{prefix}{i}", idem=f"{prefix}.{i}",
                              source=src(at=at(start + i)))) for i in range(n)]


class _Provisions:
    """Wraps a key store's `provision_pool`: records each call's thread and ids, and
    holds the background refills (`memledger-keys` threads) at a gate if one is set."""

    def __init__(self, keys: KeyStore, gate: threading.Event | None = None,
                 slow: float = 0.0) -> None:
        self.real = keys.provision_pool
        self.gate = gate
        self.slow = slow
        self.calls: list[tuple[str, list[str]]] = []
        self.lock = threading.Lock()
        keys.provision_pool = self  # type: ignore[method-assign]

    def __call__(self, n: int) -> dict[str, bytes]:
        name = threading.current_thread().name
        if name.startswith("memledger-keys"):
            if self.gate is not None:
                self.gate.wait()
            time.sleep(self.slow)  # a slow disk: appends go on meanwhile
        got = self.real(n)
        with self.lock:
            self.calls.append((name, list(got)))
        return got

    def ids(self) -> set[str]:
        return {k for _, got in self.calls for k in got}


async def test_no_event_is_sealed_with_a_key_not_yet_durable(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Appends of many sizes from concurrent callers, the refills slowed so that they
    overlap the appends: every key that seals an event was durable in the key store
    when it sealed it (within the fsynced part of the file; committed, seen from
    another connection, on PostgreSQL), no key seals two events, and no key store
    write ever ran inside a write transaction (on the inline thread, or on the event
    loop's thread, where PostgreSQL's transactions run)."""
    keys = _key_store(db_url, tmp_path)
    store = Store(db_url, register_path=str(tmp_path / "f"), vault=keys)
    assert store.vault is not None
    vault = store.vault
    prov = _Provisions(keys, slow=0.05)
    synced = [0]
    path = tmp_path / "ledger.vault"
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if os.readlink(f"/proc/self/fd/{fd}") == str(path):
            synced[0] = os.fstat(fd).st_size

    if isinstance(keys, FileKeyStore):
        monkeypatch.setattr(os, "fsync", fsync)
    observer = None if isinstance(keys, FileKeyStore) else PostgresKeyStore(db_url)
    real_seal = vault.seal_rows
    sealed: list[str] = []

    def seal_rows(rows: Any) -> None:
        real_seal(rows)
        kids = [sealed_key_id(r["payload"]) for r in rows
                if r["payload"] is not None and is_sealed(r["payload"])]
        if observer is None:
            on_disk = key_records(path)
            for kid in kids:
                end, tag = on_disk[kid]
                assert tag == b"K" and end <= synced[0], "sealed under an unsynced key"
        else:
            assert set(observer.load(kids)) == set(kids), "sealed under an uncommitted key"
        sealed.extend(kids)

    monkeypatch.setattr(vault, "seal_rows", seal_rows)
    sizes = [1, 7, 40, 3, 120, 1, 300, 64, 2, 250, 9, 500, 1, 33]

    async def caller(c: int) -> None:
        for j, n in enumerate(sizes[c:] + sizes[:c]):
            await store.append(_events(f"c{c}-{j}-", n, start=c * 1000 + j))

    try:
        await asyncio.gather(*(caller(c) for c in range(4)))
        total = 4 * sum(sizes)
        assert len(sealed) == len(set(sealed)) == total
        threads = {name for name, _ in prov.calls}
        assert any(n.startswith("memledger-keys") for n in threads), threads
        assert not any(n.startswith("memledger-views") or n == "MainThread" for n in threads)
        assert set(sealed) <= prov.ids()
        assert len(await sealed_key_ids(store)) == total
    finally:
        await store.close()
        if observer is not None:
            observer.close()


async def test_a_close_waits_for_a_refill_and_removes_its_keys(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A close that finds a background refill under way waits for it; then every key
    that sealed nothing is removed, the refill's own keys too (none fenced), and the
    events' keys stay and open them in a new process."""
    keys = _key_store(db_url, tmp_path)
    store = Store(db_url, register_path=str(tmp_path / "f"), vault=keys)
    gate = threading.Event()
    prov = _Provisions(keys, gate=gate)
    real_wait = vault_mod._wait

    def wait(fut: Any) -> None:
        gate.set()  # the refill is let go only once the close waits for it
        real_wait(fut)

    monkeypatch.setattr(vault_mod, "_wait", wait)
    try:
        await store.append(_events("a", 50))  # the first pool (64), then a refill
        assert store.vault is not None
        refill = store.vault._refill
        assert refill is not None and not refill.done()
        used = await sealed_key_ids(store)
    finally:
        await store.close()
    assert refill.done() and gate.is_set()
    background = {k for name, got in prov.calls if name.startswith("memledger-keys")
                  for k in got}
    assert background, "no refill ran in the background"
    unused = prov.ids() - set(used.values())
    assert background <= unused
    fresh = _key_store(db_url, tmp_path)
    try:
        assert fresh.load(unused) == {}
        assert fresh.fenced(unused) == set()
        assert set(fresh.load(used.values())) == set(used.values())
    finally:
        fresh.close()
    again = Store(db_url, register_path=str(tmp_path / "f"), vault=_key_store(db_url, tmp_path))
    try:
        async with again.read() as conn:
            evs = await again.read_events(conn, 0, 100)
        assert [e.event.data["value"] for e in evs if e.event is not None] == \
            [f"v-a{i}" for i in range(50)]
    finally:
        await again.close()


_KILLED = textwrap.dedent("""
    import asyncio, sys, time
    from ledger.store import Store
    from ledger.validation import parse_event
    from ledger.vault import FileKeyStore
    from tests.factories import src, write

    async def main() -> None:
        d, batch = sys.argv[1], int(sys.argv[2])
        store = Store(f"sqlite+aiosqlite:///{d}/ledger.db", register_path=f"{d}/f",
                      vault=FileKeyStore(f"{d}/ledger.vault"))
        real, refilled = store.vault._background, []

        def background(size: int) -> None:
            real(size)
            refilled.append(size)

        store.vault._background = background
        i = 0
        while True:
            await store.append([parse_event(write(f"k{i + j}", f"killed-{i + j}",
                                idem=f"x{i + j}", source=src(at="2026-09-21T10:00:00+08:00")))
                                for j in range(batch)])
            i += batch
            refill = store.vault._refill
            if refill is not None:  # a refill under way: let it make its keys durable
                refill.result()
            if refilled:
                print(i, len(store.vault._pool), flush=True)
                time.sleep(60)  # killed here, between the refill and the next append
            print(i, 0, flush=True)

    asyncio.run(main())
""")


def _run_until_refilled(where: Path, batch: int) -> tuple[int, int]:
    """Run the writer process until a background refill has made its keys durable,
    then SIGKILL it: (events it committed, keys left in its pool)."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(where), str(batch)],
                            stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    acked, pooled = 0, 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acked, pooled = map(int, line.split())
        if pooled:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return acked, pooled


@pytest.mark.parametrize("batch", [1, 37])
async def test_a_kill_between_a_refill_and_the_append_loses_nothing(
        tmp_path: Path, batch: int) -> None:
    """A process killed (SIGKILL) after a background refill made its keys durable and
    before any append took them: a new process reads every event the dead one
    committed, each under a key the store holds; the refill's keys are leftovers that
    seal nothing; verify is clean, and the new process appends under keys of its own."""
    acked, pooled = _run_until_refilled(tmp_path, batch)
    assert pooled > 0, "the writer process never refilled its pool in the background"
    store = Store(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}",
                  register_path=str(tmp_path / "f"),
                  vault=FileKeyStore(tmp_path / "ledger.vault"))
    try:
        async with store.read() as conn:
            evs = await store.read_events(conn, 0, 10_000)
        assert len(evs) == acked
        assert all(e.event is not None and e.event.data["value"] == f"killed-{e.position - 1}"
                   for e in evs)
        used = {e.key_id for e in evs}
        on_disk = {k for k, (_, tag) in key_records(tmp_path / "ledger.vault").items()
                   if tag == b"K"}
        assert used <= on_disk
        assert len(on_disk - used) >= pooled  # the dead process's pool: keys of nothing
        assert (await verify(store))["ok"]
        await store.append(_events("after", 3))
        after = await sealed_key_ids(store)
        assert {after[f"after.{i}"] for i in range(3)}.isdisjoint(on_disk)
    finally:
        await store.close()
