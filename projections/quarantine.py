"""Quarantine: the events one projection could not apply, skipped by that view only.

An event that made a projection fail is recorded in the `quarantine` table, in the
transaction that applies the rest of its batch and moves the checkpoint
(`projections.runner.Runner.step`); every other view applies it as usual. It is
re-applied by `Runner.retry_quarantined`: on the first step of a runner whose code
version differs from the one that quarantined it (an upgrade), or on an operator's
`memledger replay retry-quarantined`. See docs/projections.md#quarantine.

Which failures quarantine (`is_poison`): any error of the projection's own code, and a
database error that the event's data causes (data, integrity, programming errors).
Never a transient or infrastructure failure (`StoreUnavailable`, a lock, a lost
connection, a generic database error such as a damaged file, out of memory): those
stop the batch as before, and the next step tries it again, so a database that is down
or damaged never quarantines the whole ledger.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata as _dist
from typing import Any, Final

from sqlalchemy import func, select
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    DisconnectionError,
    IntegrityError,
    NotSupportedError,
    ProgrammingError,
    ResourceClosedError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.errors import StoreUnavailable
from ledger.recorder import is_transient
from ledger.records import StoredEvent, now_iso

#: Bump when a projection's fold changes what it can apply without a new release: a
#: runner of another code version retries what an older one quarantined.
PROJECTIONS_REVISION: Final = 1
_MESSAGE_MAX: Final = 200
#: A quoted part of an error message: where Python and the drivers put values.
_QUOTED: Final = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")


def code_version() -> str:
    """This code's version: the distribution's version and the projections' revision."""
    try:
        dist = _dist.version("memledger")
    except _dist.PackageNotFoundError:
        dist = "unknown"
    return f"{dist}+p{PROJECTIONS_REVISION}"


def is_poison(e: BaseException) -> bool:
    """Is this failure caused by the events applied (quarantine them), rather than by
    the database or the process (stop and try the batch again later)?"""
    if not isinstance(e, Exception) or isinstance(
            e, StoreUnavailable | MemoryError | OSError | TimeoutError):
        return False
    if isinstance(e, DBAPIError):
        if is_transient(e):
            return False
        return isinstance(e, DataError | IntegrityError | ProgrammingError | NotSupportedError)
    return not isinstance(e, DisconnectionError | PoolTimeout | ResourceClosedError)


def safe_message(e: BaseException) -> str:
    """The first line of an error's message with every quoted part replaced by `'…'`,
    at most 200 characters: the values an error quotes never reach the table or a log."""
    raw = e.orig if isinstance(e, DBAPIError) and e.orig is not None else e
    text = str(raw).splitlines()[0] if str(raw) else ""
    return _QUOTED.sub("'…'", text)[:_MESSAGE_MAX]


@dataclass(frozen=True, slots=True)
class Failure:
    """One event a projection could not apply, and why (class and safe message)."""

    event: StoredEvent
    error: str
    message: str

    @classmethod
    def of(cls, event: StoredEvent, e: BaseException) -> Failure:
        """The failure of `event` with error `e`."""
        return cls(event, type(e).__name__[:128], safe_message(e))


async def held_positions(conn: AsyncConnection, projection: str, after: int,
                         upto: int) -> set[int]:
    """The quarantined positions of a projection in (`after`, `upto`]."""
    q = t.quarantine.c
    rows = (await conn.execute(select(q.position).where(
        q.projection == projection, q.position > after, q.position <= upto))).all()
    return {int(r[0]) for r in rows}


async def record(conn: AsyncConnection, projection: str, failures: Sequence[Failure]) -> None:
    """Quarantine these events for a projection (again: count the attempt)."""
    q = t.quarantine.c
    now = now_iso()
    version = code_version()
    for f in failures:
        where = (q.projection == projection) & (q.position == f.event.position)
        res = await conn.execute(t.quarantine.update().where(where).values(
            error=f.error, message=f.message, code_version=version, last_tried_at=now,
            attempts=q.attempts + 1))
        if not res.rowcount:
            await conn.execute(t.quarantine.insert().values(
                projection=projection, position=f.event.position, tenant=f.event.tenant,
                type=f.event.type, error=f.error, message=f.message, code_version=version,
                recorded_at=now, attempts=1, last_tried_at=now))


async def release(conn: AsyncConnection, projection: str, position: int) -> None:
    """End the quarantine of one event for a projection (it has been applied)."""
    q = t.quarantine.c
    await conn.execute(t.quarantine.delete().where(q.projection == projection,
                                                   q.position == position))


async def entries(conn: AsyncConnection, projection: str | None = None, *,
                  positions: Sequence[int] | None = None,
                  stale_only: bool = False, limit: int | None = None
                  ) -> list[dict[str, Any]]:
    """Quarantine entries (of a projection, at these positions, recorded by another
    code version; at most `limit`), in position order."""
    q = t.quarantine.c
    stmt = select(t.quarantine)
    if projection is not None:
        stmt = stmt.where(q.projection == projection)
    if stale_only:
        stmt = stmt.where(q.code_version != code_version())
    if limit is not None:
        stmt = stmt.order_by(q.position).limit(limit)
    out: list[dict[str, Any]] = []
    if positions is None:
        out = [dict(r._mapping) for r in (await conn.execute(stmt)).all()]
    else:
        wanted = sorted(set(positions))
        for i in range(0, len(wanted), 500):
            out.extend(dict(r._mapping) for r in (await conn.execute(
                stmt.where(q.position.in_(wanted[i:i + 500])))).all())
    return sorted(out, key=lambda r: (int(r["position"]), str(r["projection"])))


async def summary(conn: AsyncConnection) -> dict[str, dict[str, int]]:
    """Per projection with quarantined events: their count and the oldest position."""
    q = t.quarantine.c
    rows = (await conn.execute(select(q.projection, func.count(), func.min(q.position))
                               .group_by(q.projection))).all()
    return {str(r[0]): {"count": int(r[1]), "oldest_position": int(r[2])} for r in rows}
