"""Alembic's environment for memledger: run by `memledger.migrations`, never by hand.

The connection (online) or the URL (offline, `--sql`) comes from memledger's own
settings through `config.attributes`; there is no `alembic.ini` to edit. Each revision
runs in its own transaction; on SQLite the `batch_alter_table` operations copy and
rename tables, which is how SQLite alters a column.
"""

from __future__ import annotations

from alembic import context

from ledger import schema as t

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    # Offline (`memledger db upgrade --sql`): a script for the URL's dialect, no database.
    context.configure(url=config.attributes["url"], target_metadata=t.metadata,
                      literal_binds=True, render_as_batch=True,
                      transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    context.configure(connection=connection, target_metadata=t.metadata,
                      render_as_batch=connection.dialect.name == "sqlite",
                      transaction_per_migration=True,
                      # memledger's SQLite connections issue their own BEGIN, so DDL is
                      # transactional there as it is on PostgreSQL.
                      transactional_ddl=True)
    context.run_migrations()
