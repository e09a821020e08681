"""The embedding cache: `embedding_cache` and `embedding_refs`.

A slow embedder's (a packaged model's) vectors kept by (embedder name, SHA-256 of the
text), so a vectors rebuild or another tenant with the same text does not embed it
again; `embedding_refs` names the index items (tenant, item id) that used each digest,
so a forget erases the cached vectors of what it covers. Both start empty: the next
projection batch fills them. The ledger's embedder setting is a `meta` row
(`config.embedder`, `memledger config set embedder NAME`), which needs no DDL. No
ledger row changes.

Revision ID: 0006_embedder_config_cache
Revises: 0005_lexical
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_embedder_config_cache"
down_revision: str | None = "0005_lexical"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the cache and its references."""
    op.create_table(
        "embedding_cache",
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("digest", sa.LargeBinary(32), nullable=False),
        sa.Column("dim", sa.Integer, nullable=False),
        sa.Column("vector", sa.LargeBinary, nullable=False),
        sa.PrimaryKeyConstraint("model", "digest"),
    )
    op.create_table(
        "embedding_refs",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("item_id", sa.String(300), nullable=False),
        sa.Column("digest", sa.LargeBinary(32), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "item_id", "digest"),
    )
    op.create_index("ix_embedding_refs_digest", "embedding_refs", ["digest"])


def downgrade() -> None:
    """Drop the cache (vectors then re-embed on every rebuild); the `meta` row stays."""
    op.drop_table("embedding_refs")
    op.drop_table("embedding_cache")
