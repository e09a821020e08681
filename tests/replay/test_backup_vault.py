"""Backups and copies at rest cannot remember (ledger/vault.py, R20, R21).

A backup file, or a copy of the SQLite files (everything beside the ledger but the key
store), taken before a forget holds the forgotten value nowhere readable once the
forget is projected: not in clear, not under base64, hex or gzip of any field, and its
ciphertext cannot be opened with anything left on the machine. Restoring such a backup
returns the item redacted and counts it. Without the key store, restore refuses unless
told to restore envelopes only, and then nothing crashes.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gzip
import shutil
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import LargeBinary, select, type_coerce
from structlog.testing import capture_logs

from ledger import schema as t
from ledger.events import derive_memory_id
from ledger.store import Store
from ledger.validation import parse_event
from ledger.vault import (
    FileKeyStore,
    PostgresKeyStore,
    is_sealed,
    key_store_for,
    sealed_key_id,
    subject_of,
)
from projections import reads
from projections.runner import Runner
from replay.backup import backup, restore
from replay.errors import KeyStoreMissing
from replay.verify import verify
from replay.verify.forgotten import verify_forgotten
from tests.factories import event, src, write
from tests.helpers import sealed_key_ids

U7 = reads.Principal("shop-a", "u7")
NS7 = ["shop-a", "u7", "preferences"]
NOW = 1_900_000_000_000_000
SECRET = "NUMBAT-code-5512"
KEPT = "kept-value-QUOLL"
NOTE_SECRET = "NUMBAT-note-9031"


def at(minute: int) -> str:
    """A source time on 2026-09-20."""
    return f"2026-09-20T10:{minute:02d}:00+08:00"


def keys_for(db_url: str, where: Path) -> Any:
    """A key store of the test's own: a file in `where`, or a PostgreSQL schema."""
    if db_url.startswith("sqlite"):
        return key_store_for(db_url, path=str(where / "ledger.vault"))
    return PostgresKeyStore(db_url)


def vault_store(db_url: str, where: Path, keys: Any = None) -> Store:
    """A store with the vault on."""
    return Store(db_url, register_path=str(where / "ledger.forgets"),
                 vault=keys if keys is not None else keys_for(db_url, where))


def decodings(data: bytes) -> list[bytes]:
    """`data`, and what it decodes to as base64, hex, gzip or zlib (where it does)."""
    out = [data]
    s = data.strip()
    for dec in (lambda b: base64.b64decode(b, validate=True), binascii.unhexlify,
                gzip.decompress, zlib.decompress):
        with contextlib.suppress(ValueError, binascii.Error, OSError, EOFError, zlib.error):
            out.append(dec(s))
    return out


def fields_of(line: bytes) -> list[bytes]:
    """Every scalar field of a JSON line as bytes (and the line itself)."""
    out = [line]
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return out
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif x is not None:
            out.append(str(x).encode())
    return out


def readable_anywhere(blob: bytes, needle: str) -> bool:
    """Is `needle` in `blob`, as is or under base64 / hex / gzip of the whole or of any
    field of any line (two levels deep)?"""
    n = needle.encode()
    for whole in decodings(blob):
        for line in whole.split(b"\n"):
            for f in fields_of(line):
                for d in decodings(f):
                    if n in d or any(n in dd for dd in decodings(d)):
                        return True
    return False


def story() -> list[dict[str, Any]]:
    """A secret memory and a kept one, and a task with a secret note."""
    return [
        write("pin", SECRET, idem="b1", source=src(at=at(0))),
        write("lang", KEPT, idem="b2", source=src(at=at(1))),
        event("task.opened", {"task_key": "T5", "namespace": ["shop-a", "u7", "tickets"],
                              "title": "inspection"}, actor="aftersales", idem="b3",
              source=src("system_of_record", "as", at(2))),
        event("task.noted", {"task_key": "T5", "kind": "user_report", "text": NOTE_SECRET},
              actor="u7", idem="b4", source=src(at=at(3))),
    ]


FORGETS = [
    event("memory.forgotten", {"namespace": NS7, "key": "pin"}, idem="f1",
          source=src(at=at(10))),
    event("task.purged", {"task_key": "T5"}, actor="aftersales", idem="f2",
          source=src("system_of_record", "as", at(11))),
]


async def append(store: Store, evs: list[dict[str, Any]]) -> None:
    """Append and project."""
    for e in evs:
        await store.append_one(parse_event(e))
    await Runner(store).catch_up()


async def test_backup_before_forget_holds_nothing_readable(db_url: str,
                                                           tmp_path: Path) -> None:
    """A backup taken before a forget and a purge, searched after them, holds neither
    secret readable (also under base64, hex and gzip of every field); the keys that
    opened them are gone from the key store; a restore returns the memory redacted,
    counts it, keeps the rest readable, and verifies clean."""
    live = tmp_path / "live"
    live.mkdir()
    store = vault_store(db_url, live)
    path = tmp_path / "before.jsonl.gz"
    try:
        await append(store, story())
        res = await backup(store, path)
        assert res["sealed_payloads"] == 4
        ids = await sealed_key_ids(store)
        await append(store, FORGETS)
        assert store.vault is not None
        # The forget by key covers the pin; the purge covers the task's open and note.
        gone = {ids["b1"], ids["b3"], ids["b4"]}
        assert store.vault.keys.fenced(ids.values()) == gone
        assert store.vault.keys.load(gone) == {}
        assert store.vault.keys.fenced(gone) == gone
    finally:
        await store.close()
    data = path.read_bytes()
    for secret in (SECRET, NOTE_SECRET, KEPT):  # KEPT too: all content is sealed
        assert not readable_anywhere(data, secret), secret
    # Restore into a fresh database, with the live key store.
    if db_url.startswith("sqlite"):
        target_url = f"sqlite+aiosqlite:///{tmp_path / 'restored.db'}"
        keys = key_store_for(target_url, path=str(live / "ledger.vault"))
    else:
        target_url = db_url  # the same server database, emptied by force
        keys = PostgresKeyStore(db_url)
    target = vault_store(target_url, live, keys)
    try:
        out = await restore(target, path, force=True)
        assert out["vault"]["redacted_key_destroyed"] == 3
        assert out["vault"]["unreadable_no_key"] == 0
        async with target.read() as conn:
            pin = await reads.get(conn, U7, NS7, "pin", now_us=NOW)
            lang = await reads.get(conn, U7, NS7, "lang", now_us=NOW)
            tasks = await reads.tasks(conn, U7, include_closed=True)
        assert pin == {"found": False}
        assert lang["found"] and lang["value"] == KEPT
        assert NOTE_SECRET not in repr(tasks)
        assert (await verify(target))["ok"]
    finally:
        await target.close()


async def test_copy_of_the_sqlite_files_before_a_forget(sqlite_url: str,
                                                        tmp_path: Path) -> None:
    """A copy of the database, its WAL and the files beside it (all but the key store)
    taken before a forget and a purge: payloads, memory values and texts, task notes and
    the task summary in it are sealed, so once the forget and the purge destroy their
    keys the values are readable nowhere in the copy; the kept memory's key still opens
    its own content only."""
    db = Path(sqlite_url.split(":///", 1)[1])
    store = vault_store(sqlite_url, tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    try:
        await append(store, story())
        # Everything beside the ledger but the key store (database, WAL, register).
        for p in list(tmp_path.iterdir()):  # noqa: ASYNC240 - a test's own files
            if p.is_file() and p.name != "ledger.vault":
                shutil.copy(p, copy / p.name)
        await append(store, FORGETS)
    finally:
        await store.close()
    copied = b"".join(p.read_bytes() for p in copy.iterdir())
    assert copied  # the database files were copied
    for secret in (SECRET, NOTE_SECRET, KEPT):  # events, memory views, notes, summary
        assert not readable_anywhere(copied, secret), secret
    # The copy opened with what is left on the machine: the forgotten value is gone,
    # the kept one is there.
    opened = Store(f"sqlite+aiosqlite:///{copy / db.name}",
                   register_path=str(copy / "ledger.forgets"),
                   vault=FileKeyStore(tmp_path / "ledger.vault"))
    try:
        async with opened.read() as conn:
            rows = (await conn.execute(t.mem_versions.select())).all()
        values = {r.mkey: r.value for r in rows}
        assert values["pin"] is None
        assert values["lang"] is not None and KEPT.encode() in values["lang"]
    finally:
        await opened.close()


async def test_restore_without_the_key_store(db_url: str, tmp_path: Path) -> None:
    """The key store is lost: restore refuses and changes nothing, unless told to
    restore envelopes only; then it loads, says so, reads find no content, nothing
    crashes, and verify still proves the chain."""
    live = tmp_path / "live"
    live.mkdir()
    store = vault_store(db_url, live)
    path = tmp_path / "b.jsonl"
    try:
        await append(store, story())
        await backup(store, path)
    finally:
        await store.close()
    if db_url.startswith("sqlite"):
        fresh_url = f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
    else:
        fresh_url = db_url
        await _drop_key_schema(db_url)
    fresh = Store(fresh_url, register_path=str(live / "ledger.forgets"), vault=False)
    try:
        with pytest.raises(KeyStoreMissing, match="envelopes_only"):
            await restore(fresh, path, force=True, without_register=True)
        out = await restore(fresh, path, force=True, without_register=True,
                            envelopes_only=True)
        assert out["vault"]["envelopes_only"] is True
        assert out["vault"]["unreadable_no_key"] == 4
        async with fresh.read() as conn:
            pin = await reads.get(conn, U7, NS7, "pin", now_us=NOW)
            tasks = await reads.tasks(conn, U7, include_closed=True)
            evs = await fresh.read_events(conn, 0, 10)
        assert pin == {"found": False}
        assert SECRET not in repr(tasks) and NOTE_SECRET not in repr(tasks)
        assert [e.event for e in evs] == [None] * 4
        assert (await verify(fresh))["ok"]
    finally:
        await fresh.close()


async def _drop_key_schema(db_url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(db_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute("DROP SCHEMA IF EXISTS memledger_vault CASCADE")
    finally:
        await conn.close()


# -- any interleaving -------------------------------------------------------------------

_ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 2)),
    st.tuples(st.just("forget"), st.integers(0, 2)),
    st.tuples(st.just("backup"), st.just(0))), min_size=1, max_size=7)


@given(ops=_ops)
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_interleaving_readable_iff_key(tmp_path_factory: pytest.TempPathFactory,
                                           ops: list[tuple[str, int]]) -> None:
    """Any interleaving of writes, forgets and backups: each memory is readable iff its
    key exists; a fenced key id is never provisioned again; no data key appears in a
    backup, a log line, an error message or a dead letter."""
    import asyncio

    asyncio.run(_interleaving(tmp_path_factory.mktemp("il"), ops))


async def _interleaving(where: Path, ops: list[tuple[str, int]]) -> None:
    url = f"sqlite+aiosqlite:///{where / 'ledger.db'}"
    ks = FileKeyStore(where / "ledger.vault")
    store = vault_store(url, where, ks)
    seen_keys: set[bytes] = set()
    backups: list[Path] = []
    written: list[tuple[str, str]] = []  # (memory id, the key id its payload names)
    try:
        with capture_logs() as logs:
            for n, (op, k) in enumerate(ops):
                key = f"k{k}"
                if op == "write":
                    idem = f"w{n}"
                    await append(store, [write(key, f"val-{n}", idem=idem,
                                               source=src(at=at(n)))])
                    written.append((derive_memory_id("shop-a", idem),
                                    (await sealed_key_ids(store))[idem]))
                elif op == "forget":
                    await append(store, [event("memory.forgotten",
                                               {"namespace": NS7, "key": key},
                                               idem=f"f{n}", source=src(at=at(n)))])
                else:
                    p = where / f"b{n}.jsonl"
                    await backup(store, p)
                    backups.append(p)
                seen_keys.update(ks.load().values())
            async with store.read() as conn:
                rows = {r.memory_id: r for r in (await conn.execute(
                    t.mem_versions.select())).all()}
                dead = (await conn.execute(t.dead_letters.select())).all()
        for mid, kid in written:
            has_key = bool(ks.load([kid]))
            row = rows.get(mid)
            readable = row is not None and row.value is not None
            assert readable == has_key, (mid, readable, has_key)
            if not has_key:
                assert ks.fenced([kid]) == {kid}
                with pytest.raises(Exception, match="never provisioned again"):
                    ks.provision([kid])
        blobs = [p.read_bytes() for p in backups] + [orjson.dumps(logs, default=str)]
        blobs += [repr(r).encode() for r in dead]
        for key in seen_keys:
            forms = (key, base64.b64encode(key), key.hex().encode())
            assert not any(f in b for f in forms for b in blobs)
    finally:
        await store.close()


async def test_restore_of_a_clear_backup_into_the_vault(sqlite_url: str,
                                                        tmp_path: Path) -> None:
    """A backup written in clear (before the vault), restored into a ledger with the
    vault on, is sealed as it loads, and what a forget since destroyed the key of
    restores redacted."""
    plain = Store(sqlite_url, register_path=str(tmp_path / "ledger.forgets"), vault=False)
    try:
        await append(plain, story())
        await backup(plain, tmp_path / "clear.jsonl")
    finally:
        await plain.close()
    target_url = f"sqlite+aiosqlite:///{tmp_path / 'target.db'}"
    keys = FileKeyStore(tmp_path / "target.vault")
    mid = derive_memory_id("shop-a", "b1")
    # Forgotten since, in a ledger sealed before the key pool (derived key ids): a
    # plaintext payload whose derived id is fenced restores redacted.
    keys.provision([subject_of("shop-a", "memory.written", mid, "b1")])
    keys.destroy([subject_of("shop-a", "memory.written", mid, "b1")])
    target = Store(target_url, register_path=str(tmp_path / "ledger.forgets"), vault=keys)
    try:
        out = await restore(target, tmp_path / "clear.jsonl", without_register=True)
        assert out["vault"]["sealed_now"] == 3
        assert out["vault"]["redacted_key_destroyed"] == 1
        async with target.read() as conn:
            lang = await reads.get(conn, U7, NS7, "lang", now_us=NOW)
            pin = await reads.get(conn, U7, NS7, "pin", now_us=NOW)
    finally:
        await target.close()
    assert lang["found"] and lang["value"] == KEPT
    assert pin == {"found": False}
    db = Path(target_url.split(":///", 1)[1])
    files = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))
    for secret in (SECRET, NOTE_SECRET, KEPT):
        assert secret.encode() not in files, secret


async def test_dead_letters_are_sealed_and_shredded(db_url: str, tmp_path: Path) -> None:
    """A dead letter (a rejected write naming the pin) is sealed under a key of its own:
    a backup taken before the forget of the pin holds it nowhere readable, the forget
    destroys its key and nulls it, and the listing shows it without content."""
    from workers.ingest import list_dead_letters, record_dead_letters

    dead_secret = "NUMBAT-dead-7718"
    store = vault_store(db_url, tmp_path)
    path = tmp_path / "before.jsonl"
    try:
        await append(store, story())
        rejected = write("pin", dead_secret, idem="d1", source=src(at=at(5)),
                         layer="no-such-layer")
        assert await record_dead_letters(store, [(rejected, ValueError("bad layer"))]) == 1
        listed = await list_dead_letters(store, tenant="shop-a")
        assert listed[0]["event"]["data"]["value"] == dead_secret  # readable with its key
        async with store.read() as conn:
            raw = (await conn.execute(select(type_coerce(
                t.dead_letters.c.payload, LargeBinary)))).scalar_one()
        assert is_sealed(bytes(raw)) and dead_secret.encode() not in bytes(raw)
        kid = sealed_key_id(bytes(raw))
        await backup(store, path)
        await append(store, FORGETS[:1])
        assert store.vault is not None and store.vault.keys.fenced([kid]) == {kid}
        listed = await list_dead_letters(store, tenant="shop-a")
        assert listed[0]["event"] is None
        assert (await verify_forgotten(store))["ok"]
    finally:
        await store.close()
    assert not readable_anywhere(path.read_bytes(), dead_secret)
