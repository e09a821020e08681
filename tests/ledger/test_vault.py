"""The vault (ledger/vault.py): content sealed under per-event keys, keys apart from the
database, a forget destroys the keys of what it covers behind a durable fence (R20, R21).

On both backends: a sealed ledger reads back as before (get, projections, the SQLite
bulk rebuild's SQL path falls back), its database holds no plaintext payload, a forget
fences and removes exactly the covered events' keys, and a fenced key id is never
provisioned again.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import select, type_coerce
from sqlalchemy.types import LargeBinary
from structlog.testing import capture_logs

from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from ledger.vault import (
    FILE_MAGIC,
    FileKeyStore,
    KeyFenced,
    MasterKeyWrap,
    PostgresKeyStore,
    VaultError,
    is_sealed,
    key_store_for,
    seal,
    sealed_key_id,
    unseal,
)
from projections import reads
from projections.runner import Runner
from replay.rebuild import rebuild
from tests.factories import event, src, write
from tests.helpers import dump_views

U7 = reads.Principal("shop-a", "u7")
NS7 = ["shop-a", "u7", "preferences"]
NOW = 1_900_000_000_000_000
SECRET = "WOMBAT-pin-4417"


def vault_store(db_url: str, tmp_path: Path, *, on: bool = True) -> Store:
    """A store with the vault on (key store: a file in tmp_path, or the PostgreSQL
    schema of the test's own database)."""
    keys = key_store_for(db_url, path=str(tmp_path / "ledger.vault")) \
        if db_url.startswith("sqlite") else PostgresKeyStore(db_url)
    return Store(db_url, register_path=str(tmp_path / "ledger.forgets"),
                 vault=keys if on else False)


def at(minute: int) -> str:
    """A source time on 2026-09-20."""
    return f"2026-09-20T10:{minute:02d}:00+08:00"


async def raw_payloads(store: Store) -> list[tuple[str, str, bytes | None]]:
    """(type, idempotency key, payload as stored) of every event."""
    e = t.events.c
    async with store.read() as conn:
        rows = (await conn.execute(select(
            e.type, e.idempotency_key,
            type_coerce(e.payload, LargeBinary).label("p")).order_by(e.position))).all()
    return [(r[0], r[1], bytes(r[2]) if r[2] is not None else None) for r in rows]


async def key_ids(store: Store) -> dict[str, str]:
    """Idempotency key -> the key id its sealed payload names, of every sealed event."""
    return {idem: sealed_key_id(p) for _, idem, p in await raw_payloads(store)
            if p is not None and is_sealed(p)}


async def test_content_is_sealed_and_reads_back(db_url: str, tmp_path: Path) -> None:
    """Memory writes and task notes are stored sealed (no plaintext byte of the value in
    the payload column), forgets and marks stay clear, and every read gets plaintext."""
    store = vault_store(db_url, tmp_path)
    try:
        for e in (write("pin", SECRET, idem="v1", source=src(at=at(0))),
                  event("task.opened", {"task_key": "T1", "namespace": ["shop-a", "u7", "t"],
                                        "title": SECRET + "-title"}, actor="aftersales",
                        idem="v2", source=src("system_of_record", "as", at(1))),
                  event("memory.forgotten", {"namespace": NS7, "key": "other"}, idem="v3",
                        source=src(at=at(2)))):
            await store.append_one(parse_event(e))
        await Runner(store).catch_up()
        raw = await raw_payloads(store)
        kinds = {typ: is_sealed(p) for typ, _, p in raw}
        assert kinds == {"memory.written": True, "task.opened": True,
                         "memory.forgotten": False}
        assert all(SECRET.encode() not in (p or b"") for _, _, p in raw)
        async with store.read() as conn:
            got = await reads.get(conn, U7, NS7, "pin", now_us=NOW)
            evs = await store.read_events(conn, 0, 10)
        assert got is not None and got["value"] == SECRET
        assert evs[0].event is not None and evs[0].event.data["value"] == SECRET
    finally:
        await store.close()


async def test_forget_destroys_exactly_the_covered_keys(db_url: str, tmp_path: Path) -> None:
    """A forget by key fences and removes the keys of the writes it covers (order <= F)
    and no other: a later write in the same slot and another key stay readable."""
    store = vault_store(db_url, tmp_path)
    try:
        for e in (write("pin", SECRET, idem="a1", source=src(at=at(0))),
                  write("pin", SECRET + "-v2", idem="a2", source=src(at=at(1))),
                  write("lang", "Python", idem="a3", source=src(at=at(2)))):
            await store.append_one(parse_event(e))
        # Each event's key is a pool key, named in its sealed payload's header.
        ids = await key_ids(store)
        for e in (event("memory.forgotten", {"namespace": NS7, "key": "pin"}, idem="a4",
                        source=src(at=at(3))),
                  write("pin", "said again", idem="a5", source=src(at=at(4)))):
            await store.append_one(parse_event(e))
        ids.update(await key_ids(store))
        await Runner(store).catch_up()
        assert store.vault is not None
        keys = store.vault.keys
        assert len(set(ids.values())) == 4  # one key an event
        # Exactly the covered events' keys: not the later write's, nor the pool's
        # unused keys (which sealed nothing).
        unused = list(store.vault._pool)
        assert unused
        assert keys.fenced([*ids.values(), *unused]) == {ids["a1"], ids["a2"]}
        assert set(keys.load(ids.values())) == {ids["a3"], ids["a5"]}
        assert set(keys.load(unused)) == set(unused)
        async with store.read() as conn:
            pin = await reads.get(conn, U7, NS7, "pin", now_us=NOW)
            lang = await reads.get(conn, U7, NS7, "lang", now_us=NOW)
        assert pin is not None and pin["value"] == "said again"
        assert lang is not None and lang["value"] == "Python"
        with pytest.raises(KeyFenced):
            keys.provision([ids["a1"]])
    finally:
        await store.close()


async def test_rebuild_of_a_sealed_ledger_equals_the_plain_one(
        sqlite_url: str, tmp_path: Path) -> None:
    """The bulk rebuild (its SQLite SQL path reads JSON inside payloads) is not fooled
    by sealed payloads: the views rebuilt from a sealed ledger equal those of the same
    events in clear, and equal the incrementally projected ones."""
    evs = [write(f"k{i % 7}", f"value-{i}", idem=f"r{i}", source=src(at=at(i % 60)))
           for i in range(40)]
    evs.append(event("memory.forgotten", {"namespace": NS7, "key": "k3"}, idem="rf",
                     source=src(at=at(30))))
    views = []
    for name, on in (("sealed", True), ("plain", False)):
        d = tmp_path / name
        d.mkdir()
        store = vault_store(f"sqlite+aiosqlite:///{d / 'ledger.db'}", d, on=on)
        try:
            for e in evs:
                await store.append_one(parse_event(e))
            await Runner(store).catch_up()
            incremental = await dump_views(store)
            with capture_logs() as logs:
                await rebuild(store, restart=True)
            # The bulk load ran to its end (a failed one falls back to event by event).
            assert not [x for x in logs if "abandoned" in x["event"]]
            rebuilt = await dump_views(store)
            assert rebuilt == incremental
            views.append(rebuilt)
        finally:
            await store.close()
    assert views[0] == views[1]


def test_file_key_store_fence_and_removal(tmp_path: Path) -> None:
    """Destroying a key writes its fence line (fsynced) and overwrites the key's line in
    place: the key's bytes are gone from the file, the id is refused ever after, also
    by a store opened later (another process)."""
    path = tmp_path / "k.vault"
    ks = FileKeyStore(path)
    keys = ks.provision(["aa" * 16, "bb" * 16])
    assert keys["aa" * 16] in path.read_bytes()
    assert ks.destroy(["aa" * 16]) == 1
    data = path.read_bytes()
    assert keys["aa" * 16] not in data
    assert keys["bb" * 16] in data
    later = FileKeyStore(path)
    assert later.load() == {"bb" * 16: keys["bb" * 16]}
    with pytest.raises(KeyFenced):
        later.provision(["aa" * 16])
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_crash_between_fence_and_removal_is_finished_at_open(tmp_path: Path) -> None:
    """A fence written without the removal after it (a crash) counts as destroyed, and
    the next open overwrites the key."""
    path = tmp_path / "k.vault"
    ks = FileKeyStore(path)
    key = ks.provision(["cc" * 16])["cc" * 16]
    ks._fence(["cc" * 16])  # the crash: fence durable, key line still there
    assert key in path.read_bytes()
    again = FileKeyStore(path)
    assert again.load() == {}
    assert key not in path.read_bytes() and base64.b64encode(key) not in path.read_bytes()


def test_master_key_wraps_data_keys(tmp_path: Path) -> None:
    """With a master key the file holds wrapped keys only; the wrong master key is a
    clear error, never a wrong plaintext."""
    path = tmp_path / "k.vault"
    master = bytes(range(32))
    ks = FileKeyStore(path, MasterKeyWrap(master))
    key = ks.provision(["dd" * 16])["dd" * 16]
    assert key not in path.read_bytes() and base64.b64encode(key) not in path.read_bytes()
    assert FileKeyStore(path, MasterKeyWrap(master)).load()["dd" * 16] == key
    with pytest.raises(VaultError, match="another master key"):
        FileKeyStore(path, MasterKeyWrap(bytes(32))).load()


def test_sealed_payload_is_authenticated() -> None:
    """A flipped byte of a sealed payload (or its key id) fails the tag; no plaintext."""
    key = bytes(32)
    blob = bytearray(seal("ee" * 16, key, b'{"x":1}'))
    assert unseal(key, bytes(blob)) == b'{"x":1}'
    blob[-1] ^= 1
    with pytest.raises(VaultError, match="authentication tag"):
        unseal(key, bytes(blob))


def test_keys_never_in_errors(tmp_path: Path) -> None:
    """Errors of the vault name key ids and counts, never key bytes."""
    ks = FileKeyStore(tmp_path / "k.vault")
    key = ks.provision(["ff" * 16])["ff" * 16]
    ks.destroy(["ff" * 16])
    messages: list[Any] = []
    try:
        ks.provision(["ff" * 16])
    except KeyFenced as e:
        messages.append(str(e))
    try:
        unseal(bytes(32), seal("ff" * 16, key, b"{}"))
    except VaultError as e:
        messages.append(str(e))
    assert len(messages) == 2
    for m in messages:
        assert key.hex() not in m and base64.b64encode(key).decode() not in m


def test_master_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """`MEMLEDGER_VAULT_MASTER_KEY` (or its `_FILE`) wraps the key store's keys; a key
    that is not base64 of 32 bytes is refused with a message that does not echo it."""
    master = base64.b64encode(bytes(range(1, 33))).decode()
    monkeypatch.setenv("MEMLEDGER_VAULT_MASTER_KEY", master)
    url = f"sqlite+aiosqlite:///{tmp_path / 'l.db'}"
    ks = key_store_for(url)
    assert ks.wrapper.name == "master-key"
    key = ks.provision(["ab" * 16])["ab" * 16]
    assert base64.b64encode(key) not in (tmp_path / "l.db.vault").read_bytes()
    monkeypatch.delenv("MEMLEDGER_VAULT_MASTER_KEY")
    (tmp_path / "mk").write_text(master + "\n")
    monkeypatch.setenv("MEMLEDGER_VAULT_MASTER_KEY_FILE", str(tmp_path / "mk"))
    assert key_store_for(url).load() == {"ab" * 16: key}
    monkeypatch.delenv("MEMLEDGER_VAULT_MASTER_KEY_FILE")
    monkeypatch.setenv("MEMLEDGER_VAULT_MASTER_KEY", "c2hvcnQ=")
    with pytest.raises(VaultError, match="32 bytes") as e:
        key_store_for(url)
    assert "c2hvcnQ=" not in str(e.value)


async def test_sdk_get_on_a_sqlite_file_opens_sealed_views(sqlite_url: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """With the vault on, `Principal.get` on a SQLite file (where reads otherwise take
    the calling thread's raw sqlite3 connection, which skips the sealed columns' types)
    returns the plaintext, while the view row holds only ciphertext (R20, R24)."""
    import memledger

    monkeypatch.setenv("MEMLEDGER_VAULT", "on")
    async with memledger.MemoryLedger(sqlite_url,
                                      register_path=str(tmp_path / "l.forgets")) as ml:
        assert ml.store.vault is not None
        u7 = ml.principal("shop-a", "u7")
        await u7.remember(["preferences"], "pin", SECRET,
                          source=memledger.Source.user_request("C1", seq=1))
        got = await u7.get(["preferences"], "pin")
        assert got is not None and got.value == SECRET
        async with ml.store.read() as conn:
            raw = (await conn.execute(select(type_coerce(t.mem_versions.c.value,
                                                         LargeBinary)))).scalars().all()
        assert raw and all(SECRET.encode() not in bytes(v) for v in raw)


def test_a_json_lines_key_store_is_converted_in_place(tmp_path: Path) -> None:
    """A key store written as JSON Lines by an earlier version opens with the same keys
    and fences, is rewritten in the binary format, and keeps refusing fenced ids."""
    path = tmp_path / "k.vault"
    kept, gone = bytes(range(32)), bytes(range(1, 33))
    lines = [{"k": "aa" * 16, "w": base64.b64encode(kept).decode()},
             {"k": "bb" * 16, "w": base64.b64encode(gone).decode()},
             {"f": "bb" * 16}]
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    ks = FileKeyStore(path)
    assert ks.load() == {"aa" * 16: kept}
    data = path.read_bytes()
    assert data.startswith(FILE_MAGIC) and kept in data
    assert gone not in data and base64.b64encode(gone) not in data
    with pytest.raises(KeyFenced):
        FileKeyStore(path).provision(["bb" * 16])


def test_a_torn_record_is_cut_off_by_the_next_writer(tmp_path: Path) -> None:
    """A crash in the middle of an append leaves a torn record (never acknowledged):
    readers skip it, the next writer cuts it off, and every whole record still reads."""
    path = tmp_path / "k.vault"
    key = FileKeyStore(path).provision(["cc" * 16])["cc" * 16]
    with path.open("ab") as f:
        f.write(b"K" + bytes(10))  # a torn record
    assert FileKeyStore(path).load() == {"cc" * 16: key}
    other = FileKeyStore(path).provision(["dd" * 16])
    assert FileKeyStore(path).load() == {"cc" * 16: key, **other}


def test_two_processes_share_one_key_store(tmp_path: Path) -> None:
    """Two stores on one file (two processes): a key one provisions, the other reads
    (and never makes a second key of the same id); a key one destroys, the other
    refuses to provision again, and no later process finds it."""
    path = tmp_path / "k.vault"
    a, b = FileKeyStore(path), FileKeyStore(path)
    ka = a.provision(["a1" * 16])
    kb = b.provision(["b1" * 16, "a1" * 16])
    assert kb["a1" * 16] == ka["a1" * 16]  # the stored key, never a second one
    assert a.get("b1" * 16) == kb["b1" * 16]
    b.destroy(["a1" * 16])
    assert FileKeyStore(path).get("a1" * 16) is None
    with pytest.raises(KeyFenced):
        a.provision(["a1" * 16])
    assert ka["a1" * 16] not in path.read_bytes()
