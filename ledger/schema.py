"""Tables of the ledger and of the views, one SQLAlchemy metadata for both backends.

The ledger tables (`events`, `tombstones`, `task_owners`, `meta`) are the primary
record; everything under "views" is derived and can be dropped and rebuilt by replay.
Order keys are stored as binary so both backends compare them bytewise (no collation).
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import (
    DDL,
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
    event,
)

from ledger.vault import SealedPayload, SealedText, SealedView

SCHEMA_VERSION: Final = 1
#: The Alembic revision these tables are (`memledger/migrations/versions`, the head of
#: its one version tree). `Store.open` stamps it on a new database and refuses a
#: database at any other revision with the command that upgrades it. A change to a
#: table, column or index below needs a new revision and this set to its id
#: (docs/operations.md#adding-a-migration); tests/ledger/test_migrations.py fails until
#: both are done.
SCHEMA_REVISION: Final = "0010_namespace_order"

metadata = MetaData()

#: Alembic's version table, as Alembic itself defines it. Kept in its own metadata: it
#: belongs to the migration machinery, not to the models `memledger db check` compares.
version_metadata = MetaData()
alembic_version = Table(
    "alembic_version",
    version_metadata,
    Column("version_num", String(32), nullable=False),
    PrimaryKeyConstraint("version_num", name="alembic_version_pkc"),
)

# -- ledger -------------------------------------------------------------------------------

events = Table(
    "events",
    metadata,
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
    # Sealed (encrypted under its subject's data key) when the vault is on: the type
    # opens it on the way out (`ledger.vault.SealedPayload`); the DDL is a plain blob.
    Column("payload", SealedPayload, nullable=True),
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
    # As-of reads turn a time into the last position recorded by then
    # (`projections.asof`): without it that is a scan of the whole ledger. The position
    # makes it covering: the first position recorded after T is read from the index.
    Index("ix_events_recorded_at", "recorded_at", "position"),
)

tombstones = Table(
    "tombstones",
    metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("tenant", String(128), nullable=False),
    # memory_id | key | prefix | task
    Column("kind", String(16), nullable=False),
    Column("memory_id", String(256), nullable=True),
    Column("ns_path", Text, nullable=True),
    Column("mkey", String(256), nullable=True),
    Column("task_key", String(256), nullable=True),
    Column("order_key", LargeBinary, nullable=False),
    # The reads' tombstone test seeks these (`projections.reads.unforgotten`: one
    # sub-select per kind), and a tenant's tombstones are read by their prefix.
    Index("ix_tombstones_key", "tenant", "kind", "ns_path", "mkey"),
    Index("ix_tombstones_memory", "tenant", "kind", "memory_id"),
    Index("ix_tombstones_task", "tenant", "kind", "task_key"),
)

task_owners = Table(
    "task_owners",
    metadata,
    Column("tenant", String(128), nullable=False),
    Column("task_key", String(256), nullable=False),
    Column("ns_path", Text, nullable=False),
    PrimaryKeyConstraint("tenant", "task_key"),
)

meta = Table(
    "meta",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("lease_owner", String(128), nullable=True),
    Column("lease_until", Float, nullable=True),
    Column("updated_at", Float, nullable=True),
)

# Sharded projections (`projections.shards`, docs/projections.md#shards): one row per
# (projection, shard) that has moved on its own. A shard without a row is at its
# projection's `checkpoints` position; a row is always at or past it. The number of
# shards is the `meta` row `shards` (default 16).
shard_checkpoints = Table(
    "shard_checkpoints",
    metadata,
    Column("projection", String(64), nullable=False),
    Column("shard", Integer, nullable=False),
    Column("position", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=True),
    PrimaryKeyConstraint("projection", "shard"),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("received_at", String(40), nullable=False),
    Column("tenant", String(128), nullable=True),
    Column("idempotency_key", String(256), nullable=True),
    Column("error", Text, nullable=False),
    # The event as received, unless it was rejected as a secret: then only its envelope.
    # Sealed under a key of its own when the vault is on (`ledger.vault.dead_letter`).
    Column("payload", SealedView, nullable=True),
    sqlite_autoincrement=True,
)

recall_audit = Table(
    "recall_audit",
    metadata,
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
    metadata,
    Column("audit_id", String(40), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("memory_id", String(256), nullable=False),
    PrimaryKeyConstraint("audit_id", "memory_id"),
    Index("ix_recall_audit_items_memory", "tenant", "memory_id"),
)

# An event one projection could not apply, skipped by that view only until it is retried
# (`projections.runner`, docs/projections.md#quarantine). What failed is named by its
# class and a short message with every quoted part cut out: never a memory's value.
quarantine = Table(
    "quarantine",
    metadata,
    Column("projection", String(64), nullable=False),
    Column("position", BigInteger, nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("type", String(32), nullable=False),
    Column("error", String(128), nullable=False),
    Column("message", String(256), nullable=False),
    Column("code_version", String(64), nullable=False),
    Column("recorded_at", String(40), nullable=False),
    Column("attempts", Integer, nullable=False, default=1),
    Column("last_tried_at", String(40), nullable=False),
    PrimaryKeyConstraint("projection", "position"),
    Index("ix_quarantine_position", "position"),
)

LEDGER_TABLES: Final = (events, tombstones, task_owners, meta, checkpoints, shard_checkpoints,
                        dead_letters, recall_audit, recall_audit_items, quarantine)

# -- API keys of the HTTP API -------------------------------------------------------------

api_keys = Table(
    "api_keys",
    metadata,
    # The key's public id (the part of the key before its secret): what `keys list`
    # shows and `keys revoke` takes.
    Column("key_id", String(32), primary_key=True),
    # HMAC-SHA256 of the whole key (`ledger.keys`): the key itself is never stored.
    Column("digest", String(64), nullable=False),
    Column("kind", String(16), nullable=False),  # principal | tenant | operator
    Column("tenant", String(128), nullable=True),
    Column("user_id", String(256), nullable=True),
    Column("label", Text, nullable=True),
    Column("created_at", String(40), nullable=False),
    Column("revoked_at", String(40), nullable=True),
)

#: Not part of the ledger's record (a backup does not carry them) and not a view: the
#: credentials of the HTTP API, created and revoked by the operator.
AUTH_TABLES: Final = (api_keys,)

# -- views --------------------------------------------------------------------------------

mem_versions = Table(
    "mem_versions",
    metadata,
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
    # Content: sealed under the write's subject key when the vault is on (ledger.vault).
    Column("value", SealedView, nullable=True),
    Column("text", SealedText, nullable=True),
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
# A namespace's rows newest first (`projections.store_reads`, a store's search of one
# namespace): an index scan in the search's order that stops at the page's end, with
# the live filter's columns in the index so rows that fail it are passed over without
# reading the table (migration 0010_namespace_order). `memory_id` descending: the
# search orders by `order_key DESC, memory_id`, the index scanned backwards.
Index("ix_mem_order", mem_versions.c.tenant, mem_versions.c.ns_path,
      mem_versions.c.order_key, mem_versions.c.memory_id.desc(), mem_versions.c.status,
      mem_versions.c.layer, mem_versions.c.expires_us)

mem_marks = Table(
    "mem_marks",
    metadata,
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
    metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("tenant", String(128), nullable=False),
    Column("task_key", String(256), nullable=False),
    Column("type", String(32), nullable=False),
    Column("order_key", LargeBinary, nullable=False),
    Column("body", SealedView, nullable=True),  # sealed like mem_versions.value
    Index("ix_task_notes_task", "tenant", "task_key"),
)

tasks_view = Table(
    "tasks_view",
    metadata,
    Column("tenant", String(128), nullable=False),
    Column("task_key", String(256), nullable=False),
    Column("ns_path", Text, nullable=True),
    Column("status", String(8), nullable=False),
    Column("retain_until_us", BigInteger, nullable=True),
    Column("purged", Boolean, nullable=False),
    Column("summary", SealedView, nullable=False),  # sealed like mem_versions.value
    PrimaryKeyConstraint("tenant", "task_key"),
    Index("ix_tasks_owner", "tenant", "ns_path", "status"),
)

vectors = Table(
    "vectors",
    metadata,
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

# The embedding cache (projections/embed_cache.py): a slow embedder's vector of a text,
# keyed by the embedder's name and the SHA-256 of the text, so a rebuild or a second
# tenant with the same text does not embed it again. Not a view: a rebuild of `vectors`
# keeps it (that is its point). `embedding_refs` says which index items used which
# digest, so a forget erases the cached vectors of what it covers (R20) even after the
# text itself has left the views.
embedding_cache = Table(
    "embedding_cache",
    metadata,
    Column("model", String(64), nullable=False),
    Column("digest", LargeBinary(32), nullable=False),
    Column("dim", Integer, nullable=False),
    Column("vector", LargeBinary, nullable=False),
    PrimaryKeyConstraint("model", "digest"),
)
embedding_refs = Table(
    "embedding_refs",
    metadata,
    Column("tenant", String(128), nullable=False),
    Column("item_id", String(300), nullable=False),
    Column("digest", LargeBinary(32), nullable=False),
    PrimaryKeyConstraint("tenant", "item_id", "digest"),
    Index("ix_embedding_refs_digest", "digest"),
)

# Stored history of the memories view (projections/history.py): one row per state a
# memory version held, valid for ledger positions valid_from <= P < valid_to (NULL: still
# current). As-of reads (projections/asof.py) read the rows valid at P instead of
# replaying the ledger. Content a forget covers is removed from every row (`redacted`).
mem_history = Table(
    "mem_history",
    metadata,
    Column("tenant", String(128), nullable=False),
    Column("memory_id", String(256), nullable=False),
    Column("valid_from", BigInteger, nullable=False),
    Column("valid_to", BigInteger, nullable=True),
    Column("slot", String(32), nullable=False),
    Column("ns_path", Text, nullable=False),
    Column("mkey", String(256), nullable=False),
    Column("layer", String(8), nullable=False),
    Column("task_key", String(256), nullable=True),
    Column("session_id", String(256), nullable=True),
    Column("position", BigInteger, nullable=False),
    Column("order_key", LargeBinary, nullable=False),
    Column("version", Integer, nullable=False),
    Column("status", String(12), nullable=False),
    Column("candidate", Boolean, nullable=False),
    Column("value", SealedView, nullable=True),  # sealed like mem_versions.value
    Column("text", SealedText, nullable=True),
    Column("scope", String(256), nullable=True),
    Column("supersedes", String(256), nullable=True),
    Column("superseded_by", String(256), nullable=True),
    Column("expires_at", String(64), nullable=True),
    Column("expires_us", BigInteger, nullable=True),
    Column("actor", String(256), nullable=False),
    Column("source", LargeBinary, nullable=False),
    Column("redacted", Boolean, nullable=False),
    # The embedding of an active, unredacted row's text (as-of recall scores with it).
    Column("model", String(64), nullable=True),
    Column("vector", LargeBinary, nullable=True),
    PrimaryKeyConstraint("tenant", "memory_id", "valid_from"),
    Index("ix_memh_slot", "slot", "valid_from"),
    # A principal's active rows with their interval: recall as of P filters the interval
    # on the index entries alone.
    Index("ix_memh_scan", "tenant", "status", "ns_path", "valid_to", "valid_from"),
    # A forget of a key (or of a namespace prefix, as a range) redacts the key's rows
    # by a seek, not by reading every row of the tenant.
    Index("ix_memh_key", "tenant", "ns_path", "mkey"),
)

# The lexical index (projections/lexical.py): one row per active memory with its *set*
# of terms (sorted, deduplicated, space-separated: no order, no positions, no counts).
# `docid` is a deterministic 63-bit hash of (tenant, item_id), the full-text row id.
lexical_docs = Table(
    "lexical_docs",
    metadata,
    Column("tenant", String(128), nullable=False),
    Column("item_id", String(300), nullable=False),
    Column("docid", BigInteger, nullable=False),
    Column("ns_path", Text, nullable=False),
    Column("layer", String(8), nullable=False),
    Column("task_key", String(256), nullable=True),
    Column("session_id", String(256), nullable=True),
    Column("scope", String(32), nullable=False),  # hashed principal: the FTS5 filter term
    Column("terms", Text, nullable=False),
    PrimaryKeyConstraint("tenant", "item_id"),
    UniqueConstraint("docid", name="uq_lexical_docid"),
    Index("ix_lexical_ns", "tenant", "ns_path"),
)

#: SQLite: a contentless FTS5 table (no copy of the text: only its inverted index; the
#: positions it keeps are those in the sorted term set, not in the text) over
#: `lexical_docs`, kept equal to it by triggers, so every delete of a row (a forget, a
#: rebuild, a restore) leaves the index too.
LEXICAL_FTS: Final = "lexical_fts"
#: A per-connection TEMP `fts5vocab` view of the index (each term's document count, for
#: recall's frequent-term drop): no schema object, created on a connection's first use.
LEXICAL_VOCAB: Final = "lexical_vocab"
LEXICAL_VOCAB_DDL: Final = (f"CREATE VIRTUAL TABLE IF NOT EXISTS temp.{LEXICAL_VOCAB} "
                            f"USING fts5vocab(main, {LEXICAL_FTS}, 'col')")
_SQLITE_LEXICAL_DDL: Final = (
    f"CREATE VIRTUAL TABLE IF NOT EXISTS {LEXICAL_FTS} USING fts5("
    "scope, terms, content='', tokenize='unicode61 remove_diacritics 0')",
    f"CREATE TRIGGER IF NOT EXISTS lexical_docs_ai AFTER INSERT ON lexical_docs BEGIN "
    f"INSERT INTO {LEXICAL_FTS}(rowid, scope, terms) VALUES (new.docid, new.scope, new.terms);"
    " END",
    f"CREATE TRIGGER IF NOT EXISTS lexical_docs_ad AFTER DELETE ON lexical_docs BEGIN "
    f"INSERT INTO {LEXICAL_FTS}({LEXICAL_FTS}, rowid, scope, terms) "
    "VALUES ('delete', old.docid, old.scope, old.terms); END",
    f"CREATE TRIGGER IF NOT EXISTS lexical_docs_au AFTER UPDATE ON lexical_docs BEGIN "
    f"INSERT INTO {LEXICAL_FTS}({LEXICAL_FTS}, rowid, scope, terms) "
    "VALUES ('delete', old.docid, old.scope, old.terms); "
    f"INSERT INTO {LEXICAL_FTS}(rowid, scope, terms) VALUES (new.docid, new.scope, new.terms);"
    " END",
)
#: PostgreSQL: an expression GIN index over the terms (no tsvector column is stored).
_PG_LEXICAL_DDL: Final = (
    "CREATE INDEX IF NOT EXISTS ix_lexical_tsv ON lexical_docs "
    "USING gin (to_tsvector('simple'::regconfig, terms))",
)
#: Objects made by the raw DDL above, per dialect, as (kind, name, a query that returns
#: a row when the object exists): outside `metadata`, so `memledger db check` skips
#: them in Alembic's comparison (with FTS5's shadow tables, `lexical_fts_*`) and runs
#: each query instead.
_SQLITE_OBJECT: Final = "SELECT 1 FROM sqlite_master WHERE type = '{kind}' AND name = '{name}'"
_PG_INDEX: Final = ("SELECT 1 FROM pg_indexes WHERE indexname = '{name}' "
                    "AND schemaname = current_schema()")
DDL_OBJECTS: Final = {
    "sqlite": tuple((kind, name, _SQLITE_OBJECT.format(kind=kind, name=name)) for kind, name in (
        ("table", LEXICAL_FTS), ("trigger", "lexical_docs_ai"),
        ("trigger", "lexical_docs_ad"), ("trigger", "lexical_docs_au"))),
    "postgresql": (("index", "ix_lexical_tsv", _PG_INDEX.format(name="ix_lexical_tsv")),),
}
for _stmt in _SQLITE_LEXICAL_DDL:
    event.listen(lexical_docs, "after_create",
                 DDL(_stmt).execute_if(dialect="sqlite"))  # type: ignore[no-untyped-call]
for _stmt in _PG_LEXICAL_DDL:
    event.listen(lexical_docs, "after_create",
                 DDL(_stmt).execute_if(dialect="postgresql"))  # type: ignore[no-untyped-call]

VIEW_TABLES: Final = (mem_versions, mem_marks, task_notes, tasks_view, vectors, lexical_docs,
                      mem_history)
