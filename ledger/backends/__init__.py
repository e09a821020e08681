"""One recorder per backend (`ledger.recorder.Recorder`): SQLite and PostgreSQL."""

from __future__ import annotations

from ledger.backends.postgres import PostgresRecorder
from ledger.backends.sqlite import SQLiteRecorder
from ledger.recorder import Recorder


def recorder_for(url: str, *, pool_size: int = 5, write_turns: bool = False) -> Recorder:
    """The recorder of a database URL: SQLite for `sqlite...`, else PostgreSQL.

    `write_turns`: write transactions queue for SQLite's write lock across processes
    (`ledger.backends.sqlite.WriteTurn`); PostgreSQL queues its lock waiters itself."""
    if url.startswith("sqlite"):
        return SQLiteRecorder(url, pool_size=pool_size, write_turns=write_turns)
    return PostgresRecorder(url, pool_size=pool_size)
