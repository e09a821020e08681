"""Retention: closed tasks past `retain_until` are purged by a sweep (R6, R28).

The purge is recorded as its own `task.purged` event, so it is replayed, lands in the
forget register and is reapplied on restore like any forget. `expires_at = null` on a
memory means no preset expiry, never "cannot be deleted": forgets still apply.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select

from ledger import schema as t
from ledger.events import Event, to_us
from ledger.store import Store
from ledger.validation import parse_event

RETENTION_SOURCE = "memledger-retention"


def purge_event(tenant: str, task_key: str, now: datetime) -> Event:
    """The `task.purged` event the sweep appends for one task."""
    at = now.astimezone(UTC).isoformat(timespec="microseconds")
    # Through validation, as every other event: the sweep gets no way around its rules.
    return parse_event({
        "type": "task.purged", "idempotency_key": f"purge:{task_key}", "tenant": tenant,
        "actor": RETENTION_SOURCE,
        "source": {"kind": "system_of_record", "id": RETENTION_SOURCE, "at": at},
        "data": {"task_key": task_key, "reason": "retention period ended"}})


async def sweep_retention(store: Store, now: datetime | None = None) -> list[tuple[str, str]]:
    """Purge every closed task whose `retain_until` has passed; returns (tenant, task)."""
    now = now or datetime.now(UTC)
    await store.open()
    tv = t.tasks_view.c
    async with store.read() as conn:
        rows = (await conn.execute(select(tv.tenant, tv.task_key).where(
            tv.status == "closed", tv.purged.is_(False), tv.retain_until_us.is_not(None),
            tv.retain_until_us <= to_us(now)))).all()
    due = [(r[0], r[1]) for r in rows]
    if due:
        await store.append([purge_event(tenant, key, now) for tenant, key in due])
    return due
