"""The audit record of a recall (R25): ids, versions, scores and reasons of what was
returned, with a digest of the query; never a value, never the query text.
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.store import Store
from projections import reads
from projections.sql import insert_rows


async def write_audit(store: Store, who: reads.Principal, query: str | None,
                 items: list[dict[str, Any]], tasks: list[dict[str, Any]],
                 now_us: int) -> str:
    """Write the audit record of a recall (R25): ids and scores, never values."""
    audit_id = uuid.uuid4().hex
    # Only what the ledger's envelope keeps after a forget (ids, version, layer,
    # namespace, source kind/id/time/position) plus score and a templated reason: a
    # forget leaves nothing in here to erase.
    record: list[dict[str, Any]] = [
        {"kind": "memory", "memory_id": i["memory_id"], "version": i["version"],
         "layer": i["layer"], "namespace": i["namespace"], "score": i["score"],
         "reason": i["reason"],
         "source": {k: i["source"].get(k) for k in ("kind", "id", "at", "position")}}
        for i in items]
    record.extend({"kind": "task", "task_key": x["task_key"], "score": x["score"],
                   "reason": x["reason"], "ambiguous": x["ambiguous"]} for x in tasks)
    at = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=now_us)).isoformat(
        timespec="microseconds")
    row = {"audit_id": audit_id, "at": at, "tenant": who.tenant,
           "principal": f"{who.tenant}/{who.user}",
           "query_digest": hashlib.sha256(query.encode()).hexdigest() if query else None,
           "items": orjson.dumps(record)}
    item_rows = [{"audit_id": audit_id, "tenant": who.tenant, "memory_id": i["memory_id"]}
                 for i in items]

    async def body(conn: AsyncConnection) -> None:
        # Plain rows through `insert_rows` (on SQLite: the driver's executemany, no
        # statement compiled per call).
        await insert_rows(store, conn, t.recall_audit, [row])
        await insert_rows(store, conn, t.recall_audit_items, item_rows)

    # One short view transaction, committed before the caller gets the result (R25);
    # with inline writes on (`Store.use_inline`), in one hand-off to the inline thread.
    await store.transaction(body, views=True)
    return audit_id

