"""The baseline: the schema of commit d2f33e6 (2026-12-01), the last release before
migrations.

A database made by that release (or by any later code before migrations shipped) has
these tables and no `alembic_version`; `memledger db upgrade` recognises it by its
`events` table and stamps this revision before applying the later ones. A new database
goes through this revision too (`memledger db upgrade` on an empty database) or is
created at the head by `Store.open` and stamped.

The tables are written out here as that release defined them, not imported from
`ledger.schema`, so this revision stays what it was whatever the models become.

Revision ID: 0001_baseline
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.schema import CreateIndex, CreateTable

revision: str = "0001_baseline"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

base = MetaData()

events = Table(
    "events",
    base,
    # Positions are assigned by the appender under the write lock (max + 1), never by a
    # sequence: a sequence leaves holes on rollback, and a hole would stall or fool a
    # poller. Rows are never deleted, so a position is never reused.
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("tenant", String(128), nullable=False),
    Column("idempotency_key", String(256), nullable=False),
    Column("type", String(32), nullable=False),
    Column("actor", String(256), nullable=False),
    Column("source_kind", String(32), nullable=False),
    Column("source_id", String(256), nullable=False),
    Column("source_at", String(64), nullable=False),
    Column("source_seq", BigInteger, nullable=True),
    Column("source_event_id", String(256), nullable=True),
    Column("order_key", LargeBinary, nullable=False),
    # Envelope index columns: kept after erasure so forgets, audits and late events can
    # still be matched to their slot without the content.
    Column("slot", String(32), nullable=True),
    Column("memory_id", String(256), nullable=True),
    Column("ns_path", Text, nullable=True),
    Column("mkey", String(256), nullable=True),
    Column("layer", String(8), nullable=True),
    Column("task_key", String(256), nullable=True),
    # What a write supersedes is a reference, not content: it survives erasure, so a
    # rebuild after a forget resolves supersession exactly as before it.
    Column("supersedes", String(256), nullable=True),
    Column("payload", LargeBinary, nullable=True),
    Column("content_digest", String(64), nullable=False),
    Column("chain", String(64), nullable=False),
    Column("recorded_at", String(40), nullable=False),
    Column("suppressed", Boolean, nullable=False, default=False),
    Column("redacted", Boolean, nullable=False, default=False),
    UniqueConstraint("tenant", "idempotency_key", name="uq_events_idem"),
    Index("ix_events_slot", "slot"),
    Index("ix_events_memory", "tenant", "memory_id"),
    Index("ix_events_task", "tenant", "task_key"),
    Index("ix_events_ns", "tenant", "ns_path", "mkey"),
)

tombstones = Table(
    "tombstones",
    base,
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("tenant", String(128), nullable=False),
    # memory_id | key | prefix | task
    Column("kind", String(16), nullable=False),
    Column("memory_id", String(256), nullable=True),
    Column("ns_path", Text, nullable=True),
    Column("mkey", String(256), nullable=True),
    Column("task_key", String(256), nullable=True),
    Column("order_key", LargeBinary, nullable=False),
    Index("ix_tombstones_tenant", "tenant"),
)

task_owners = Table(
    "task_owners",
    base,
    Column("tenant", String(128), nullable=False),
    Column("task_key", String(256), nullable=False),
    Column("ns_path", Text, nullable=False),
    PrimaryKeyConstraint("tenant", "task_key"),
)

meta = Table(
    "meta",
    base,
    Column("name", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

checkpoints = Table(
    "checkpoints",
    base,
    Column("name", String(64), primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("lease_owner", String(128), nullable=True),
    Column("lease_until", Float, nullable=True),
    Column("updated_at", Float, nullable=True),
)

dead_letters = Table(
    "dead_letters",
    base,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("received_at", String(40), nullable=False),
    Column("tenant", String(128), nullable=True),
    Column("idempotency_key", String(256), nullable=True),
    Column("error", Text, nullable=False),
    # The event as received, unless it was rejected as a secret: then only its envelope.
    Column("payload", LargeBinary, nullable=True),
    sqlite_autoincrement=True,
)

recall_audit = Table(
    "recall_audit",
    base,
    Column("audit_id", String(40), primary_key=True),
    Column("at", String(40), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("principal", String(300), nullable=False),
    Column("query_digest", String(64), nullable=True),
    # JSON list of {memory_id, version, layer, score, reason}: ids and scores, no values.
    Column("items", LargeBinary, nullable=False),
    Index("ix_recall_audit_tenant", "tenant"),
)

recall_audit_items = Table(
    "recall_audit_items",
    base,
    Column("audit_id", String(40), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("memory_id", String(256), nullable=False),
    PrimaryKeyConstraint("audit_id", "memory_id"),
    Index("ix_recall_audit_items_memory", "tenant", "memory_id"),
)


# -- views --------------------------------------------------------------------------------

mem_versions = Table(
    "mem_versions",
    base,
    Column("tenant", String(128), nullable=False),
    Column("memory_id", String(256), nullable=False),
    Column("slot", String(32), nullable=False),
    Column("ns_path", Text, nullable=False),
    Column("mkey", String(256), nullable=False),
    Column("layer", String(8), nullable=False),
    Column("task_key", String(256), nullable=True),
    Column("session_id", String(256), nullable=True),
    Column("position", BigInteger, nullable=False),
    Column("order_key", LargeBinary, nullable=False),
    Column("version", Integer, nullable=False),
    # active | candidate | superseded | forgotten (expiry is decided at read time)
    Column("status", String(12), nullable=False),
    Column("candidate", Boolean, nullable=False),
    Column("value", LargeBinary, nullable=True),
    Column("text", Text, nullable=True),
    Column("scope", String(256), nullable=True),
    Column("supersedes", String(256), nullable=True),
    Column("superseded_by", String(256), nullable=True),
    Column("expires_at", String(64), nullable=True),
    Column("expires_us", BigInteger, nullable=True),
    Column("actor", String(256), nullable=False),
    Column("source", LargeBinary, nullable=False),
    PrimaryKeyConstraint("tenant", "memory_id"),
    Index("ix_mem_slot", "slot"),
    Index("ix_mem_lookup", "tenant", "ns_path", "mkey", "status"),
    Index("ix_mem_status", "tenant", "status"),
)

mem_marks = Table(
    "mem_marks",
    base,
    Column("position", BigInteger, nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("target", String(256), nullable=False),
    # superseded | confirmed
    Column("kind", String(12), nullable=False),
    Column("order_key", LargeBinary, nullable=False),
    Column("by_id", String(256), nullable=True),
    # A `supersedes` written by a candidate counts only once that candidate is confirmed.
    Column("via_candidate", String(256), nullable=True),
    Column("owner", Text, nullable=True),
    PrimaryKeyConstraint("position", "target", "kind"),
    Index("ix_marks_target", "tenant", "target"),
    Index("ix_marks_via", "tenant", "via_candidate"),
)

task_notes = Table(
    "task_notes",
    base,
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("tenant", String(128), nullable=False),
    Column("task_key", String(256), nullable=False),
    Column("type", String(32), nullable=False),
    Column("order_key", LargeBinary, nullable=False),
    Column("body", LargeBinary, nullable=True),
    Index("ix_task_notes_task", "tenant", "task_key"),
)

tasks_view = Table(
    "tasks_view",
    base,
    Column("tenant", String(128), nullable=False),
    Column("task_key", String(256), nullable=False),
    Column("ns_path", Text, nullable=True),
    Column("status", String(8), nullable=False),
    Column("retain_until_us", BigInteger, nullable=True),
    Column("purged", Boolean, nullable=False),
    Column("summary", LargeBinary, nullable=False),
    PrimaryKeyConstraint("tenant", "task_key"),
    Index("ix_tasks_owner", "tenant", "ns_path", "status"),
)

vectors = Table(
    "vectors",
    base,
    Column("tenant", String(128), nullable=False),
    Column("item_id", String(300), nullable=False),
    Column("kind", String(8), nullable=False),  # memory | task
    Column("ns_path", Text, nullable=False),
    Column("layer", String(8), nullable=False),
    Column("task_key", String(256), nullable=True),
    Column("session_id", String(256), nullable=True),
    Column("model", String(64), nullable=False),
    Column("dim", Integer, nullable=False),
    Column("vector", LargeBinary, nullable=False),
    PrimaryKeyConstraint("tenant", "item_id"),
    Index("ix_vectors_ns", "tenant", "ns_path"),
)


def upgrade() -> None:
    """Create every table and index of d2f33e6."""
    for table in base.sorted_tables:
        op.execute(CreateTable(table))
        for index in sorted(table.indexes, key=lambda ix: str(ix.name)):
            op.execute(CreateIndex(index))


def downgrade() -> None:
    """Refused: below the baseline there is no schema, and dropping it drops the ledger."""
    raise RuntimeError("the baseline revision cannot be downgraded: that would drop the "
                       "ledger; restore a backup into an empty database instead")
