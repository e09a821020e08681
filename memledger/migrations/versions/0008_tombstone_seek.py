"""Tombstone indexes the reads seek: by tenant, kind and the coordinates each kind
compares.

Every read tests that no tombstone covers a row (`projections.reads.unforgotten`), one
sub-select per kind of tombstone: a key forget is sought by (tenant, kind, namespace
path, key), a memory-id forget by (tenant, kind, memory id), a task purge by (tenant,
kind, task key), a prefix forget by (tenant, kind). With the tenant-only index each row
tested read every tombstone of its tenant, so every delete made all later reads of the
tenant slower. The tenant-only index goes: each new index starts with the tenant. No
row changes.

Revision ID: 0008_tombstone_seek
Revises: 0007_asof_history
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008_tombstone_seek"
down_revision: str | None = "0007_asof_history"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the three seek indexes of `tombstones`; drop `ix_tombstones_tenant`."""
    op.create_index("ix_tombstones_key", "tombstones", ["tenant", "kind", "ns_path", "mkey"])
    op.create_index("ix_tombstones_memory", "tombstones", ["tenant", "kind", "memory_id"])
    op.create_index("ix_tombstones_task", "tombstones", ["tenant", "kind", "task_key"])
    op.drop_index("ix_tombstones_tenant", table_name="tombstones")


def downgrade() -> None:
    """Back to the tenant-only index."""
    op.create_index("ix_tombstones_tenant", "tombstones", ["tenant"])
    op.drop_index("ix_tombstones_task", table_name="tombstones")
    op.drop_index("ix_tombstones_memory", table_name="tombstones")
    op.drop_index("ix_tombstones_key", table_name="tombstones")
