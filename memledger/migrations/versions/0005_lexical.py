"""The lexical recall arm: `lexical_docs`, and its full-text index per backend.

A new view (docs/recall.md, "The lexical arm"): each active memory's sorted term set
under its principal's hashed scope. SQLite indexes it with a contentless FTS5 table
`lexical_fts` kept equal to `lexical_docs` by three triggers; PostgreSQL with an
expression GIN index over `to_tsvector('simple', terms)`. Views are derived: the new
table starts empty and its projection's checkpoint starts at 0, so the next
`memledger project` (or any worker) fills it from the ledger; `memledger replay rebuild
--projection lexical` does it at once. No ledger row changes.

Revision ID: 0005_lexical
Revises: 0004_shard_checkpoints
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_lexical"
down_revision: str | None = "0004_shard_checkpoints"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The statements as they were at this revision (a revision is a snapshot: it does not
# import today's models, which may change).
_SQLITE = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS lexical_fts USING fts5("
    "scope, terms, content='', tokenize='unicode61 remove_diacritics 0')",
    "CREATE TRIGGER IF NOT EXISTS lexical_docs_ai AFTER INSERT ON lexical_docs BEGIN "
    "INSERT INTO lexical_fts(rowid, scope, terms) VALUES (new.docid, new.scope, new.terms);"
    " END",
    "CREATE TRIGGER IF NOT EXISTS lexical_docs_ad AFTER DELETE ON lexical_docs BEGIN "
    "INSERT INTO lexical_fts(lexical_fts, rowid, scope, terms) "
    "VALUES ('delete', old.docid, old.scope, old.terms); END",
    "CREATE TRIGGER IF NOT EXISTS lexical_docs_au AFTER UPDATE ON lexical_docs BEGIN "
    "INSERT INTO lexical_fts(lexical_fts, rowid, scope, terms) "
    "VALUES ('delete', old.docid, old.scope, old.terms); "
    "INSERT INTO lexical_fts(rowid, scope, terms) VALUES (new.docid, new.scope, new.terms);"
    " END",
)
_POSTGRESQL = (
    "CREATE INDEX IF NOT EXISTS ix_lexical_tsv ON lexical_docs "
    "USING gin (to_tsvector('simple'::regconfig, terms))",
)


def upgrade() -> None:
    """Create `lexical_docs` and its full-text index (FTS5 table and triggers on SQLite,
    a GIN expression index on PostgreSQL)."""
    op.create_table(
        "lexical_docs",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("item_id", sa.String(300), nullable=False),
        sa.Column("docid", sa.BigInteger, nullable=False),
        sa.Column("ns_path", sa.Text, nullable=False),
        sa.Column("layer", sa.String(8), nullable=False),
        sa.Column("task_key", sa.String(256), nullable=True),
        sa.Column("session_id", sa.String(256), nullable=True),
        sa.Column("scope", sa.String(32), nullable=False),
        sa.Column("terms", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("tenant", "item_id"),
        sa.UniqueConstraint("docid", name="uq_lexical_docid"),
    )
    op.create_index("ix_lexical_ns", "lexical_docs", ["tenant", "ns_path"])
    name = op.get_bind().dialect.name
    for stmt in _SQLITE if name == "sqlite" else _POSTGRESQL if name == "postgresql" else ():
        op.execute(stmt)


def downgrade() -> None:
    """Drop the lexical index and `lexical_docs` (recall then runs on vectors alone)."""
    if op.get_bind().dialect.name == "sqlite":
        for trigger in ("lexical_docs_ai", "lexical_docs_ad", "lexical_docs_au"):
            op.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        op.execute("DROP TABLE IF EXISTS lexical_fts")
    op.drop_table("lexical_docs")
