"""Crypto-shredding holds for any interleaving, on both backends (ledger/vault.py, R20, R21).

Any order of memory writes, task notes, forgets by key, task purges, dead letters,
backups and restarts (a new process on the same ledger and key store): a subject's
content is readable iff its data key exists; a fenced key id is never provisioned
again, by this process or a new one; and no data key appears in a backup, a log line,
an error message or a dead letter, in any of the forms a key could be written (raw,
base64, hex).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import uuid
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
    KeyFenced,
    KeyStore,
    PostgresKeyStore,
    is_sealed,
    sealed_key_id,
)
from projections.runner import Runner
from replay.backup import backup
from tests.factories import event, src, write
from workers.ingest import record_dead_letters

_example = itertools.count()

_ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 2)),
    st.tuples(st.just("note"), st.integers(0, 1)),
    st.tuples(st.just("forget"), st.integers(0, 2)),
    st.tuples(st.just("purge"), st.integers(0, 1)),
    st.tuples(st.just("dead"), st.integers(0, 2)),
    st.tuples(st.just("backup"), st.just(0)),
    st.tuples(st.just("restart"), st.just(0))), min_size=1, max_size=9)


def at(n: int) -> str:
    """A source time on 2026-09-20, minute `n` (the op's own order)."""
    return f"2026-09-20T{10 + n // 60:02d}:{n % 60:02d}:00+08:00"


@given(ops=_ops)
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_readable_iff_key_for_any_interleaving(db_url: str, tmp_path: Path,
                                              ops: list[tuple[str, int]]) -> None:
    """Any interleaving on either backend: readable iff the key exists; fenced ids are
    refused for ever; no key in a backup, a log line, an error or a dead letter."""
    n = next(_example)
    where = tmp_path / f"ex{n}"
    where.mkdir()
    # Each example has a tenant (and on PostgreSQL a key store schema) of its own, so
    # the examples sharing the test's database never see each other's subjects.
    asyncio.run(_run(db_url, where, f"t{uuid.uuid4().hex[:10]}", f"kv_{n}", ops))


def _keys(db_url: str, where: Path, schema: str) -> KeyStore:
    if db_url.startswith("sqlite"):
        return FileKeyStore(where / "ledger.vault")
    return PostgresKeyStore(db_url, schema=schema)


async def _run(db_url: str, where: Path, tenant: str, schema: str,
               ops: list[tuple[str, int]]) -> None:
    url = db_url if not db_url.startswith("sqlite") else \
        f"sqlite+aiosqlite:///{where / 'ledger.db'}"
    ns = [tenant, "u7", "preferences"]
    store = Store(url, register_path=str(where / "ledger.forgets"),
                  vault=_keys(db_url, where, schema))
    seen: set[bytes] = set()
    blobs: list[bytes] = []
    errors: list[str] = []
    writes: list[tuple[str, str]] = []  # (memory id, the key id its payload names)
    notes: list[tuple[str, str]] = []  # (idempotency key, the key id)
    opened: set[str] = set()

    async def append(ev: dict[str, Any]) -> str:
        res = await store.append_one(parse_event(ev))
        assert res.status == "appended", res
        await Runner(store).catch_up()
        return "suppressed" if res.suppressed else "appended"

    async def kid_of(idem: str) -> str:
        """The key id the event's sealed payload names (a pool key), read raw."""
        async with store.read() as conn:
            raw = (await conn.execute(select(type_coerce(t.events.c.payload, LargeBinary))
                                      .where(t.events.c.tenant == tenant,
                                             t.events.c.idempotency_key == idem))).scalar()
        assert raw is not None and is_sealed(bytes(raw))
        return sealed_key_id(bytes(raw))

    await store.open()
    try:
        with capture_logs() as logs:
            for i, (op, k) in enumerate(ops):
                if op == "write":
                    await append(write(f"k{k}", f"val-{i}", tenant=tenant, idem=f"w{i}",
                                       source=src(at=at(i))))
                    writes.append((derive_memory_id(tenant, f"w{i}"), await kid_of(f"w{i}")))
                elif op == "note":
                    task = f"T{k}"
                    if task not in opened:
                        await append(event("task.opened", {
                            "task_key": task, "namespace": [tenant, "u7", "tickets"],
                            "title": f"title-{i}"}, tenant=tenant, actor="aftersales",
                            idem=f"o{i}", source=src("system_of_record", "as", at(i))))
                        opened.add(task)
                    status = await append(event(
                        "task.noted", {"task_key": task, "kind": "user_report",
                                       "text": f"note-{i}"},
                        tenant=tenant, idem=f"n{i}", source=src(at=at(i))))
                    if status == "appended":  # a suppressed note never had content
                        notes.append((f"n{i}", await kid_of(f"n{i}")))
                elif op == "forget":
                    await append(event("memory.forgotten", {"namespace": ns, "key": f"k{k}"},
                                       tenant=tenant, idem=f"f{i}", source=src(at=at(i))))
                elif op == "purge":
                    if f"T{k}" in opened:
                        await append(event("task.purged", {"task_key": f"T{k}"},
                                           tenant=tenant, actor="aftersales", idem=f"p{i}",
                                           source=src("system_of_record", "as", at(i))))
                elif op == "dead":
                    # A rejected write naming the key, with a value (as a worker stores it).
                    raw = write(f"k{k}", f"dead-{i}", tenant=tenant, idem=f"d{i}",
                                source=src(at=at(i)), layer="no-such-layer")
                    await record_dead_letters(store, [(raw, ValueError("bad layer"))])
                elif op == "backup":
                    p = where / f"b{i}.jsonl"
                    await backup(store, p)
                    blobs.append(p.read_bytes())
                else:  # another process takes over the same ledger and key store
                    await store.close()
                    store = Store(url, register_path=str(where / "ledger.forgets"),
                                  vault=_keys(db_url, where, schema))
                    await store.open()
                assert store.vault is not None
                seen.update(store.vault.keys.load().values())
            async with store.read() as conn:
                mem = {r.memory_id: r.value for r in (await conn.execute(
                    select(t.mem_versions.c.memory_id, t.mem_versions.c.value)
                    .where(t.mem_versions.c.tenant == tenant))).all()}
                # A note's content as the ledger holds it (opened with its key; the
                # tasks view drops every note of a purged task, even a later one).
                payloads = {r.idempotency_key: r.payload for r in (await conn.execute(
                    select(t.events.c.idempotency_key, t.events.c.payload)
                    .where(t.events.c.tenant == tenant))).all()}
                dead = (await conn.execute(select(t.dead_letters)
                                           .where(t.dead_letters.c.tenant == tenant))).all()
        assert store.vault is not None
        keys = store.vault.keys
        fresh = _keys(db_url, where, schema)  # a new process's view of the key store
        subjects = [(kid, mem.get(mid)) for mid, kid in writes]
        subjects += [(kid, payloads.get(idem)) for idem, kid in notes]
        assert len({kid for kid, _ in subjects}) == len(subjects)  # a key an event
        for kid, content in subjects:
            has_key = keys.get(kid) is not None
            assert (content is not None) == has_key, (kid, content, has_key, ops)
            assert (fresh.get(kid) is not None) == has_key
            if not has_key:
                assert keys.fenced([kid]) == {kid}
                for ks in (keys, fresh):
                    try:
                        ks.provision([kid])
                    except KeyFenced as e:
                        errors.append(str(e))
                    else:
                        pytest.fail("a fenced key id was provisioned again")
        fresh.close()
        blobs.append(orjson.dumps(logs, default=str))
        blobs += [repr(tuple(r)).encode() for r in dead]
        blobs += [e.encode() for e in errors]
        for key in seen:
            forms = (key, base64.b64encode(key), key.hex().encode(),
                     base64.urlsafe_b64encode(key))
            assert not any(f in b for f in forms for b in blobs)
    finally:
        await store.close()
