"""One recorder per backend (`ledger.recorder.Recorder`): SQLite and PostgreSQL."""

from __future__ import annotations

from ledger.backends.postgres import PostgresRecorder
from ledger.backends.sqlite import SQLiteRecorder
from ledger.recorder import Recorder


def recorder_for(url: str, *, pool_size: int = 5) -> Recorder:
    """The recorder of a database URL: SQLite for `sqlite...`, else PostgreSQL."""
    if url.startswith("sqlite"):
        return SQLiteRecorder(url, pool_size=pool_size)
    return PostgresRecorder(url, pool_size=pool_size)
