"""An index on `events.recorded_at`, for as-of reads by recording time.

`projections.asof` turns an RFC 3339 time into the last position recorded by then;
without the index that is a scan of the whole ledger. An index only: no row changes.

Revision ID: 0003_events_recorded_at
Revises: 0002_quarantine_api_keys
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003_events_recorded_at"
down_revision: str | None = "0002_quarantine_api_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create `ix_events_recorded_at`."""
    op.create_index("ix_events_recorded_at", "events", ["recorded_at"])


def downgrade() -> None:
    """Drop `ix_events_recorded_at` (as-of reads by time then scan the ledger)."""
    op.drop_index("ix_events_recorded_at", table_name="events")
