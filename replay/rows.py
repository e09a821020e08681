"""Row-level helpers shared by verify, backup and restore.

Streaming reads in primary-key order (the same order on both backends), the values of
rows in a comparable form, and which tombstone covers a stored event by its envelope
alone (so coverage can be decided after the content is gone).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Final

from sqlalchemy import LargeBinary, Table, select, type_coerce
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import TypeDecorator

from ledger.events import MEMORY_WRITES
from ledger.forgets import Coordinates, Tombstone, covers
from ledger.recorder import Recorder

#: Task events whose content a forget or purge erases (the purge itself keeps its own).
TASK_CONTENT: Final = frozenset({"task.opened", "task.noted", "task.closed"})
FORGETS: Final = frozenset({"memory.forgotten", "task.purged"})


def order_columns(table: Table, recorder: Recorder) -> list[Any]:
    """The table's primary key as ORDER BY terms that sort alike on both backends
    (text bytewise: `Recorder.bytewise`), so a merge of two streams lines up."""
    cols = list(table.primary_key.columns) or list(table.columns)
    return [recorder.bytewise(c) for c in cols]


async def stream_rows(conn: AsyncConnection, table: Table, recorder: Recorder, *,
                      where: Any = None, batch: int = 1000, raw: bool = False
                      ) -> AsyncIterator[Sequence[Any]]:
    """Yield lists of rows of `table` in primary-key order, `batch` rows at a time.

    `raw`: columns of a decorated type come as stored (a backup keeps sealed payloads
    sealed, `ledger.vault`), not opened."""
    q = select(*raw_columns(table)) if raw else select(table)
    if where is not None:
        q = q.where(where)
    result = await conn.stream(q.order_by(*order_columns(table, recorder)))
    async for part in result.partitions(batch):
        yield part


def plain(value: Any) -> Any:
    """A column value in comparable Python form (memoryview -> bytes)."""
    if isinstance(value, memoryview | bytearray):
        return bytes(value)
    return value


def row_dict(row: Any) -> dict[str, Any]:
    """A SQLAlchemy row as a dict of plain values."""
    return {str(k): plain(v) for k, v in row._mapping.items()}


def raw_columns(table: Table) -> list[Any]:
    """The table's columns, those of a decorated type read as their stored type."""
    return [type_coerce(c, c.type.impl_instance).label(c.name)
            if isinstance(c.type, TypeDecorator) else c for c in table.columns]


def binary_columns(table: Table) -> list[str]:
    """Names of the table's binary columns (encoded as base64 in backups)."""
    return [c.name for c in table.columns if isinstance(
        c.type.impl_instance if isinstance(c.type, TypeDecorator) else c.type, LargeBinary)]


def by_tenant(tombs: Iterable[Tombstone]) -> dict[str, list[Tombstone]]:
    """Tombstones grouped by tenant."""
    out: dict[str, list[Tombstone]] = {}
    for ts in tombs:
        out.setdefault(ts.tenant, []).append(ts)
    return out


def covering(tombs: Mapping[str, Sequence[Tombstone]], row: Mapping[str, Any]
             ) -> Tombstone | None:
    """The first tombstone that covers a stored event's content, judged by its envelope
    (the one rule, `ledger.forgets.covers`; `projections.erasure.erase_payloads` applies
    it in SQL), or None."""
    typ = row["type"]
    if typ not in MEMORY_WRITES and typ not in TASK_CONTENT:
        return None
    candidates = tombs.get(row["tenant"])
    if not candidates:
        return None
    v = Coordinates(row["tenant"], bytes(row["order_key"]), row["memory_id"],
                    row["ns_path"], row["mkey"], row["task_key"])
    return next((ts for ts in candidates if covers(ts, v)), None)
