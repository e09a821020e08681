"""The ledger check of `replay verify`: the ledger is intact.

- positions run 1..head without a gap;
- the hash chain, recomputed from `GENESIS` (`ledger.chain.ChainCheck`), equals the
  stored links (an envelope edited in place, or an event deleted, breaks it at that
  position);
- every present payload hashes to its `content_digest` and agrees with its envelope;
  an absent payload belongs to a suppressed or redacted event that a tombstone covers;
- the `tombstones` table holds exactly what the forget and purge events say.

A sealed payload (ledger/vault.py) is opened with the store's vault; one whose key is
absent (destroyed by a forget, or no key store here) is counted as
`sealed_without_key`: its envelope and the chain are checked, its content cannot be.
"""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.chain import ChainCheck
from ledger.events import digest
from ledger.forgets import Tombstone, tombstone_from_row, tombstone_of
from ledger.records import event_from_wire
from ledger.store import Store
from ledger.vault import VaultError, is_sealed
from replay.rows import FORGETS, by_tenant, covering, row_dict, stream_rows
from replay.verify.report import Report


def _envelope_disagreement(row: dict[str, Any], wire: dict[str, Any]) -> list[str]:
    src = wire.get("source") or {}
    pairs = {
        "type": wire.get("type"), "tenant": wire.get("tenant"),
        "idempotency_key": wire.get("idempotency_key"), "actor": wire.get("actor"),
        "source_kind": src.get("kind"), "source_id": src.get("id"),
        "source_at": src.get("at"), "source_seq": src.get("seq"),
        "source_event_id": src.get("event_id"),
    }
    return [k for k, v in pairs.items() if row[k] != v]


async def check_ledger(conn: AsyncConnection, store: Store, rep: Report) -> dict[str, Any]:
    """Positions, hash chain, digests, redactions and tombstones, in `conn`'s snapshot."""
    tomb_rows = {int(r.position): tombstone_from_row(r)
                 for r in (await conn.execute(select(t.tombstones))).all()}
    tombs = by_tenant(tomb_rows.values())
    expected_tombs: dict[int, Tombstone | None] = {}
    chain = ChainCheck()
    expected = 1
    n = redacted = suppressed = unreadable = 0
    # Raw: a sealed payload is opened here, so one whose key is absent is told apart
    # from one that is missing (ledger.vault).
    async for part in stream_rows(conn, t.events, store.recorder, batch=2000, raw=True):
        for r in part:
            row = row_dict(r)
            pos = int(row["position"])
            no_key = False
            if is_sealed(row["payload"]):
                try:
                    opened = store.vault.open(row["payload"]) if store.vault else None
                except VaultError:
                    rep.add("digest", position=pos,
                            detail="sealed payload fails its authentication tag")
                    opened = None
                if opened is None:
                    # No key here (destroyed, or the key store is absent): the chain
                    # and the envelope are checked, the content cannot be.
                    unreadable += 1
                    if row["suppressed"] or row["redacted"]:
                        rep.add("redaction", position=pos,
                                detail="event marked suppressed/redacted still has a payload")
                    row["payload"], no_key = None, True
                else:
                    row["payload"] = opened
            n += 1
            if pos != expected:
                rep.add("positions", position=pos,
                        detail=f"expected position {expected}, found {pos}: "
                               f"{pos - expected} event(s) missing" if pos > expected
                        else f"position {pos} out of order")
            expected = pos + 1
            if not chain.holds(row):
                rep.add("chain", position=pos,
                        detail="hash chain broken: the envelope of this event or of the one "
                               "before it was changed, or an event is missing")
            payload = row["payload"]
            if row["suppressed"]:
                suppressed += 1
            if row["redacted"]:
                redacted += 1
            if no_key:
                pass
            elif payload is not None:
                if digest(payload) != row["content_digest"]:
                    rep.add("digest", position=pos,
                            detail="payload does not match its content digest")
                if row["suppressed"] or row["redacted"]:
                    rep.add("redaction", position=pos,
                            detail="event marked suppressed/redacted still has a payload")
                try:
                    wire = orjson.loads(payload)
                    bad = _envelope_disagreement(row, wire)
                except (orjson.JSONDecodeError, AttributeError, TypeError):
                    wire, bad = None, ["payload is not a JSON event"]
                if bad:
                    rep.add("envelope", position=pos,
                            detail=f"payload disagrees with envelope on {', '.join(bad)}")
                if row["type"] in FORGETS and wire is not None and not bad:
                    try:
                        expected_tombs[pos] = tombstone_of(event_from_wire(wire), pos)
                    except (KeyError, TypeError, ValueError):
                        rep.add("envelope", position=pos, detail="forget payload unreadable")
            else:
                if not (row["suppressed"] or row["redacted"]):
                    rep.add("redaction", position=pos,
                            detail="payload missing on an event neither suppressed nor "
                                   "redacted")
                elif covering(tombs, row) is None:
                    rep.add("redaction", position=pos,
                            detail="content removed but no tombstone covers this event")
                if row["type"] in FORGETS:
                    expected_tombs[pos] = tomb_rows.get(pos)  # cannot re-derive: accept
                    rep.add("redaction", position=pos, detail="forget event without content")
    for pos, want in expected_tombs.items():
        have = tomb_rows.get(pos)
        if have is None:
            rep.add("tombstones", position=pos, detail="forget event has no tombstone")
        elif want is not None and have != want:
            rep.add("tombstones", position=pos,
                    detail="tombstone differs from what its forget event says")
    for pos in sorted(set(tomb_rows) - set(expected_tombs)):
        rep.add("tombstones", position=pos,
                detail="tombstone without a forget or purge event at that position")
    head = await store.recorder.max_position(conn)
    return {"head": head, "events": n, "redacted": redacted, "suppressed": suppressed,
            "tombstones": len(tomb_rows), "sealed_without_key": unreadable}
