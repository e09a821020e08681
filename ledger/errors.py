"""The project's exception tree: every failure a caller can act on has its own class.

Driver errors are translated into these at one boundary (the recorder's transactions,
`ledger.recorder`), with ``raise ... from e``, so callers never catch SQLAlchemy or asyncpg types.
"""

from __future__ import annotations


class MemledgerError(Exception):
    """Base class of every error memledger raises on purpose."""


class ValidationError(MemledgerError):
    """An event (or a request) broke a rule of the contract; nothing was written."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class IdempotencyConflict(ValidationError):
    """The idempotency key was used before for an event with different content."""

    def __init__(self, key: str) -> None:
        super().__init__(
            "idempotency_key",
            f"idempotency key {key!r} reused with different content; "
            "use a new key for a new event",
        )


class ConcurrencyConflict(MemledgerError):
    """An append stated an expected version that no longer holds; nothing was appended."""

    def __init__(self, target: str, expected: int, actual: int) -> None:
        self.target = target
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"expected version {expected} of {target} but it is at {actual}; "
            "re-read the current version and retry"
        )


class AccessDenied(MemledgerError):
    """A principal asked for something outside its namespaces."""


class StoreUnavailable(MemledgerError):
    """The database could not be reached or stayed busy; the operation may be retried."""


class IntegrityError(MemledgerError):
    """Stored data failed a check (hash chain, digest, backup checksum)."""


class DatabaseCorrupt(StoreUnavailable, IntegrityError):
    """The database itself is damaged (SQLite: "database disk image is malformed", "file
    is not a database"): restore a backup (docs/operations.md).

    An `IntegrityError` (stored data failed a check) and a `StoreUnavailable`: a worker
    keeps the message and tries again later (after the restore) rather than recording
    a good event as a dead letter because the database under it was damaged."""

    def __init__(self, cause: str) -> None:
        self.cause = cause
        super().__init__(
            f"the ledger database is damaged ({cause}); `memledger replay verify` runs "
            "the backend's integrity check, and a backup restores it (docs/operations.md)")


class BackupError(MemledgerError):
    """A backup file is unusable or a restore was refused; the live database is unchanged."""


class BackupTargetRefused(BackupError):
    """`backup` was pointed at a path it must not write (a device, a directory, a
    missing directory, an existing file without `force`); nothing was written there."""

    def __init__(self, problem: str, remedy: str = "") -> None:
        self.problem = problem
        super().__init__(problem + remedy)


class BackupTargetExists(BackupTargetRefused):
    """The backup path holds a file already and `backup` was not told to replace it."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"backup target {path} already exists",
                         "; choose a new path, or pass force=True to replace it")


class RegisterError(MemledgerError):
    """The forget register could not be read or written."""


class SchemaOutOfDate(MemledgerError):
    """The database's schema is not the one this memledger was built for: an older
    revision (the message names the command that upgrades it) or a newer one."""

    def __init__(self, revision: str | None, wanted: str, message: str) -> None:
        self.revision = revision
        self.wanted = wanted
        super().__init__(message)


class BrokerUnavailable(MemledgerError):
    """The message broker (Redis) could not take a message; the event was not sent."""
