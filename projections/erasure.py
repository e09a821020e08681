"""Erasure: covered content leaves the ledger's own payloads once a forget is appended.

The envelope, digest and hash chain stay, so `replay verify` still passes; the
content goes (R20). With the vault on, the data keys of the covered events are
destroyed first (`shred_keys`), so copies of their ciphertext elsewhere go with them.
Views erase their own copies in their own projections. Which events a tombstone
covers is the one rule of `ledger.forgets`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from sqlalchemy import LargeBinary, func, select, type_coerce, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.events import MEMORY_WRITES, ns_path
from ledger.forgets import Coordinates, Tombstone, covers, covers_sql
from ledger.recorder import Recorder
from ledger.records import StoredEvent
from ledger.store import Store
from ledger.vault import HEADER, is_sealed, sealed_key_id, summary_key_id
from projections.sql import chunks

FORGETS = ("memory.forgotten", "task.purged")
#: Events whose payload is content a tombstone can cover: memory writes and task
#: notes (a forget or purge keeps its own payload).
CONTENT_TYPES = (*sorted(MEMORY_WRITES), "task.opened", "task.noted", "task.closed")


class ErasureProjection:
    """Erases covered content from the ledger's payloads and dead letters."""

    name = "erasure"
    tables = ()
    types: tuple[str, ...] | None = FORGETS
    depends_on: tuple[str, ...] = ()
    #: Forgets are rare: `Runner.catch_up` steps it on its own (`Runner.groups`).
    sparse = True

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        """Erase what each forget or purge of the batch covers."""
        tombs = [ts for ts in await store.tombstones(
            conn, {se.tenant for se in batch if se.type in FORGETS},
            upto=batch[-1].position) if batch[0].position <= ts.position]
        for ts in tombs:
            await shred_keys(store, conn, ts)
            await erase_payloads(conn, ts)
            await shred_dead_letters(store, conn, ts)
            await erase_dead_letters(conn, ts)


def dead_letter_covered(obj: Any, ts: Tombstone) -> bool:
    """Does a rejected event (as received) name what a tombstone covers?

    A dead letter never became a memory, so it has no place in source order: any that
    names the covered target is erased, whatever its time (the cautious reading).
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("tenant"), str):
        return False
    d = obj.get("data")
    if not isinstance(d, dict):
        return False
    ns = d.get("namespace") or d.get("namespace_prefix")
    path = ns_path([str(p) for p in ns]) if isinstance(ns, list) else None
    tenant = obj["tenant"]
    return any(covers(ts, v) for v in (
        Coordinates(tenant, None, _text(d.get("memory_id")), path, _text(d.get("key")),
                    _text(d.get("task_key"))),
        Coordinates(tenant, None, _text(d.get("supersedes")))))


def _text(v: Any) -> str | None:
    # A field of another type names nothing (it could not equal a tombstone's value).
    return v if isinstance(v, str) else None


async def erase_dead_letters(conn: AsyncConnection, ts: Tombstone) -> int:
    """Null the stored payload of dead letters that name what a tombstone covers."""
    dl = t.dead_letters.c
    rows = (await conn.execute(select(dl.id, dl.payload).where(
        dl.tenant == ts.tenant, dl.payload.is_not(None)))).all()
    hit = []
    for r in rows:
        if r.payload is None:  # sealed, its key gone: `shred_dead_letters` nulls those
            continue
        try:
            obj = orjson.loads(r.payload)
        except orjson.JSONDecodeError:
            continue
        if dead_letter_covered(obj, ts):
            hit.append(r.id)
    for chunk in chunks(hit, 500):
        await conn.execute(update(t.dead_letters).where(dl.id.in_(chunk)).values(payload=None))
    return len(hit)


async def shred_dead_letters(store: Store, conn: AsyncConnection, ts: Tombstone) -> int:
    """Destroy the keys of the sealed dead letters that name what a tombstone covers
    (`ledger.vault.dead_letter`), and null their payloads: a copy taken before holds
    them unreadable. Returns how many dead letters."""
    if store.vault is None:
        return 0
    dl = t.dead_letters.c
    raw = type_coerce(dl.payload, LargeBinary)
    rows = (await conn.execute(select(dl.id, raw).where(
        dl.tenant == ts.tenant, dl.payload.is_not(None)))).all()
    hit: list[int] = []
    kids: list[str] = []
    for rid, blob in rows:
        blob = bytes(blob)
        if not is_sealed(blob):
            continue  # in clear (written before the vault): `erase_dead_letters`
        plain = store.vault.open(blob)
        try:
            covered = plain is None or dead_letter_covered(orjson.loads(plain), ts)
        except orjson.JSONDecodeError:
            continue
        if covered:
            hit.append(rid)
            kids.append(sealed_key_id(blob))
    store.vault.destroy(kids)
    for chunk in chunks(hit, 500):
        await conn.execute(update(t.dead_letters).where(dl.id.in_(chunk)).values(payload=None))
    return len(hit)


async def shred_keys(store: Store, conn: AsyncConnection, ts: Tombstone) -> int:
    """Destroy the data keys of every event a tombstone covers (fenced durably first,
    `ledger.vault`): each copy of their ciphertext, in a backup or a copy of the
    database file, becomes unreadable. Returns how many keys were fenced now."""
    if store.vault is None:
        return 0
    ev = t.events.c
    # The key of each covered event is the one its sealed payload names (ledger.vault:
    # a pool key, or on a ledger sealed before the pool a derived id): the header is
    # read in SQL, the payload is not opened.
    head = func.substr(type_coerce(ev.payload, LargeBinary), 1, HEADER)
    rows = (await conn.execute(select(head).where(
        covers_sql(ts, ev), ev.type.in_(CONTENT_TYPES), ev.payload.is_not(None)))).all()
    kids = [sealed_key_id(bytes(r[0])) for r in rows if is_sealed(bytes(r[0]))]
    # The summary keys of the tasks it reaches as a whole (a purge, a prefix forget of
    # the owner), found through the ledger's task owners: the tasks view may lag.
    to = t.task_owners.c
    kids += [summary_key_id(r[0], r[1]) for r in (await conn.execute(
        select(to.tenant, to.task_key).where(covers_sql(ts, to, order_key=None)))).all()]
    return store.vault.destroy(kids)


async def erase_payloads(conn: AsyncConnection, ts: Tombstone) -> int:
    """Null the payload of every event a tombstone covers; returns how many rows."""
    ev = t.events.c
    return await Recorder.erase_payloads(conn, covers_sql(ts, ev), ev.type.in_(CONTENT_TYPES))
