"""An index by key on `mem_history`, so a forget redacts the key's rows by a seek.

A forget of a key redacts every version the history view holds of it (R20). Its
`UPDATE` compares the tenant, the namespace path and the key; `mem_history`'s indexes
start with (tenant, status, ...) and (slot, ...), so SQLite sought by the tenant alone
and read every history row of the tenant for each forget: its cost grew with the
tenant's size. `ix_memh_key` (tenant, namespace path, key) serves key forgets, and
prefix forgets given as a range of the path. No row changes.

Revision ID: 0009_forget_seek
Revises: 0008_tombstone_seek
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009_forget_seek"
down_revision: str | None = "0008_tombstone_seek"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create `ix_memh_key`."""
    op.create_index("ix_memh_key", "mem_history", ["tenant", "ns_path", "mkey"])


def downgrade() -> None:
    """Drop `ix_memh_key`."""
    op.drop_index("ix_memh_key", table_name="mem_history")
