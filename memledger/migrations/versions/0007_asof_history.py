"""Stored history for as-of reads: `mem_history`.

A new view (docs/projections.md, "As-of reads"): every state each memory version held,
with the ledger positions it held for (`valid_from` <= P < `valid_to`), its content
(removed again when a forget covers it) and, for active rows, its embedding. Views are
derived: the table starts empty and the `history` projection's checkpoint starts at 0,
so the next `memledger project` (or any worker) fills it from the ledger; until it has
caught up, as-of reads replay the ledger as before. `memledger replay rebuild
--projection history` fills it at once. No ledger row changes; the index of the
events' recording times gains the position (an as-of read by time then reads the
first position recorded after T from the index alone).

Revision ID: 0007_asof_history
Revises: 0006_embedder_config_cache
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_asof_history"
down_revision: str | None = "0006_embedder_config_cache"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create `mem_history` and its two indexes (by slot; by tenant, status and
    namespace); add the position to `ix_events_recorded_at`."""
    op.create_table(
        "mem_history",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("memory_id", sa.String(256), nullable=False),
        sa.Column("valid_from", sa.BigInteger, nullable=False),
        sa.Column("valid_to", sa.BigInteger, nullable=True),
        sa.Column("slot", sa.String(32), nullable=False),
        sa.Column("ns_path", sa.Text, nullable=False),
        sa.Column("mkey", sa.String(256), nullable=False),
        sa.Column("layer", sa.String(8), nullable=False),
        sa.Column("task_key", sa.String(256), nullable=True),
        sa.Column("session_id", sa.String(256), nullable=True),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("order_key", sa.LargeBinary, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("status", sa.String(12), nullable=False),
        sa.Column("candidate", sa.Boolean, nullable=False),
        sa.Column("value", sa.LargeBinary, nullable=True),
        sa.Column("text", sa.Text, nullable=True),
        sa.Column("scope", sa.String(256), nullable=True),
        sa.Column("supersedes", sa.String(256), nullable=True),
        sa.Column("superseded_by", sa.String(256), nullable=True),
        sa.Column("expires_at", sa.String(64), nullable=True),
        sa.Column("expires_us", sa.BigInteger, nullable=True),
        sa.Column("actor", sa.String(256), nullable=False),
        sa.Column("source", sa.LargeBinary, nullable=False),
        sa.Column("redacted", sa.Boolean, nullable=False),
        sa.Column("model", sa.String(64), nullable=True),
        sa.Column("vector", sa.LargeBinary, nullable=True),
        sa.PrimaryKeyConstraint("tenant", "memory_id", "valid_from"),
    )
    op.create_index("ix_memh_slot", "mem_history", ["slot", "valid_from"])
    op.create_index("ix_memh_scan", "mem_history",
                    ["tenant", "status", "ns_path", "valid_to", "valid_from"])
    op.drop_index("ix_events_recorded_at", table_name="events")
    op.create_index("ix_events_recorded_at", "events", ["recorded_at", "position"])


def downgrade() -> None:
    """Drop `mem_history` (as-of reads then replay the ledger on every call); the
    recording-time index goes back to the time alone."""
    op.drop_table("mem_history")
    op.drop_index("ix_events_recorded_at", table_name="events")
    op.create_index("ix_events_recorded_at", "events", ["recorded_at"])
