"""An index of each namespace's rows newest first, so a store's search stops at its page.

A LangGraph store's search of a namespace without a query asks for its newest rows
(`ORDER BY order_key DESC, memory_id LIMIT n`). `ix_mem_lookup` (tenant, namespace
path, key, status) finds the namespace's rows but not in that order: SQLite read every
row of the namespace from the table and sorted them for any limit (93 us for a page of
10 out of 100 rows, measured). `ix_mem_order` (tenant, namespace path, order key,
memory id descending, status, layer, expiry) is scanned backwards in the search's order
and stops at the page's end, testing the live filter on the index's own columns (30 us).
No row changes.

Revision ID: 0010_namespace_order
Revises: 0009_forget_seek
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_namespace_order"
down_revision: str | None = "0009_forget_seek"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create `ix_mem_order`."""
    op.create_index("ix_mem_order", "mem_versions", [
        "tenant", "ns_path", "order_key", sa.text("memory_id DESC"), "status", "layer",
        "expires_us"])


def downgrade() -> None:
    """Drop `ix_mem_order`."""
    op.drop_index("ix_mem_order", table_name="mem_versions")
