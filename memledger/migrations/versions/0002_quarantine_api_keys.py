"""The quarantine of poison events (per view) and the API keys of the HTTP API.

Both tables are new; nothing existing changes. A database made between d2f33e6 and the
first release with migrations may hold them already (that code created every table it
knew at open): they are created only where missing, so such a database upgrades too.

Downgrade drops both: the quarantine's records (the events it lists are then applied
again by the next projection run, which may quarantine them anew) and every API key
(create them again with `memledger keys create`).

Revision ID: 0002_quarantine_api_keys
Revises: 0001_baseline
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

revision: str = "0002_quarantine_api_keys"
down_revision: str | None = "0001_baseline"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _missing(name: str) -> bool:
    if context.is_offline_mode():
        return True  # a script for a database at the previous revision
    return not sa.inspect(op.get_bind()).has_table(name)


def upgrade() -> None:
    """Create `quarantine` and `api_keys` where missing."""
    if _missing("quarantine"):
        op.create_table(
            "quarantine",
            sa.Column("projection", sa.String(64), nullable=False),
            sa.Column("position", sa.BigInteger, nullable=False),
            sa.Column("tenant", sa.String(128), nullable=False),
            sa.Column("type", sa.String(32), nullable=False),
            sa.Column("error", sa.String(128), nullable=False),
            sa.Column("message", sa.String(256), nullable=False),
            sa.Column("code_version", sa.String(64), nullable=False),
            sa.Column("recorded_at", sa.String(40), nullable=False),
            sa.Column("attempts", sa.Integer, nullable=False),
            sa.Column("last_tried_at", sa.String(40), nullable=False),
            sa.PrimaryKeyConstraint("projection", "position"),
        )
        op.create_index("ix_quarantine_position", "quarantine", ["position"])
    if _missing("api_keys"):
        op.create_table(
            "api_keys",
            sa.Column("key_id", sa.String(32), primary_key=True),
            sa.Column("digest", sa.String(64), nullable=False),
            sa.Column("kind", sa.String(16), nullable=False),
            sa.Column("tenant", sa.String(128), nullable=True),
            sa.Column("user_id", sa.String(256), nullable=True),
            sa.Column("label", sa.Text, nullable=True),
            sa.Column("created_at", sa.String(40), nullable=False),
            sa.Column("revoked_at", sa.String(40), nullable=True),
        )


def downgrade() -> None:
    """Drop `api_keys` and `quarantine` (their rows go with them)."""
    op.drop_table("api_keys")
    op.drop_index("ix_quarantine_position", table_name="quarantine")
    op.drop_table("quarantine")
