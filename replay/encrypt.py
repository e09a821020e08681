"""`memledger vault encrypt`: convert a ledger written in clear to sealed content, in place.

For a ledger written before the vault was switched on (ledger/vault.py): every content
payload still in clear (memory writes, task opens, notes and closes) is sealed under
a fresh key of the vault's pool (its id in the sealed header), batch by batch, each
batch in one write transaction, so the command can be stopped at any point and run
again: it finds what is still in clear and goes on. Dead letters still in clear are
sealed too. Then the views are rebuilt (their copies of the content are sealed as
they are written) and the database files are compacted (`Recorder.compact`: SQLite
VACUUM and WAL truncation, secure_delete being on; PostgreSQL VACUUM FULL), so no
plaintext copy is left in them. A payload whose derived key id (the id a ledger
sealed before the key pool would have used) a forget already fenced is erased
instead.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import LargeBinary, func, literal, select, type_coerce, update

from ledger import schema as t
from ledger.errors import MemledgerError
from ledger.store import Store
from ledger.vault import SEALED_TYPES, dead_letter, subject_of
from replay.progress import Progress, ProgressCallback
from replay.rebuild import rebuild

BATCH: Final = 2000


def _in_clear() -> Any:
    """SQL: a content payload still in clear (JSON starts with `{`; sealed does not)."""
    e = t.events.c
    raw = type_coerce(e.payload, LargeBinary)
    return (e.type.in_(sorted(SEALED_TYPES)) & e.payload.is_not(None)
            & (func.substr(raw, 1, 1) == literal(b"{", LargeBinary)))


async def count_in_clear(store: Store) -> int:
    """How many content payloads are still stored in clear."""
    async with store.read() as conn:
        return int((await conn.execute(select(func.count()).where(_in_clear()))).scalar() or 0)


async def encrypt_ledger(store: Store, *, batch: int = BATCH, compact: bool = True,
                         progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Seal every content payload still in clear, rebuild the views, compact the files."""
    if store.vault is None:
        raise MemledgerError("the vault is off for this ledger: set MEMLEDGER_VAULT=on "
                             "(and MEMLEDGER_VAULT_PATH or MEMLEDGER_VAULT_URL if the key "
                             "store is not in its default place), then run again")
    vault = store.vault
    await store.open()
    total = await count_in_clear(store)
    bar = Progress("vault encrypt", total, unit="events", report=progress)
    e = t.events.c
    sealed = erased = 0
    after = 0
    while True:
        async with store.write() as conn:
            rows = [dict(r._mapping) for r in (await conn.execute(
                select(e.position, e.tenant, e.type, e.memory_id, e.idempotency_key,
                       e.redacted, type_coerce(e.payload, LargeBinary).label("payload"))
                .where(_in_clear(), e.position > after).order_by(e.position)
                .limit(batch))).all()]
            if not rows:
                break
            after = int(rows[-1]["position"])
            kids = [subject_of(r["tenant"], r["type"], r["memory_id"], r["idempotency_key"])
                    for r in rows]
            gone = vault.fenced(kids)
            keep = []
            for r, kid in zip(rows, kids, strict=True):
                r["payload"] = bytes(r["payload"])
                if kid in gone:  # forgotten, its key destroyed: erase what is left
                    r["payload"], r["redacted"] = None, True
                    erased += 1
                else:
                    keep.append(r)
            vault.seal_rows(keep)
            sealed += len(keep)
            await store.recorder.replace_payloads(conn, rows)
        bar.advance(len(rows))
    bar.finish()
    dead = await _seal_dead_letters(store)
    rebuilt = await rebuild(store, restart=True, progress=progress)
    if compact:
        await store.recorder.compact()
    return {"sealed": sealed, "erased": erased, "dead_letters_sealed": dead,
            "in_clear_left": await count_in_clear(store),
            "views_rebuilt_to": rebuilt["head"], "compacted": compact}


async def _seal_dead_letters(store: Store) -> int:
    """Seal the payloads of dead letters still in clear, each under a key of its own
    (`ledger.vault.dead_letter`); returns how many."""
    dl = t.dead_letters.c
    raw = type_coerce(dl.payload, LargeBinary)
    n = 0
    async with store.write() as conn:
        rows = (await conn.execute(select(dl.id, dl.tenant, raw.label("payload")).where(
            dl.payload.is_not(None),
            func.substr(raw, 1, 1) == literal(b"{", LargeBinary)))).all()
        for rid, tenant, payload in rows:
            await conn.execute(update(t.dead_letters).where(dl.id == rid).values(
                payload=dead_letter(store.vault, tenant, bytes(payload))))
            n += 1
    return n
