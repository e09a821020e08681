"""Per-shard checkpoints of the projections (projections sharded by tenant).

`shard_checkpoints` holds one row per (projection, shard) that has moved on its own
(docs/workers.md, "Shards"); a projection with no rows here stands at its
`checkpoints` row, so an upgraded database starts unsharded-equal and needs no data
step. The shard count is a `meta` row (`shards`), read as 16 when absent. A new table
only: no ledger row changes.

Revision ID: 0004_shard_checkpoints
Revises: 0003_events_recorded_at
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_shard_checkpoints"
down_revision: str | None = "0003_events_recorded_at"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create `shard_checkpoints`."""
    op.create_table(
        "shard_checkpoints",
        sa.Column("projection", sa.String(64), nullable=False),
        sa.Column("shard", sa.Integer, nullable=False),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=True),
        sa.PrimaryKeyConstraint("projection", "shard"),
    )


def downgrade() -> None:
    """Drop `shard_checkpoints`: every projection falls back to its `checkpoints` row.

    Shards that had moved past it are replayed from there (exactly once still holds:
    the view rows they wrote are re-derived by the same resolution)."""
    op.drop_table("shard_checkpoints")
