"""The refusals of `replay.backup.restore`: subclasses of `BackupError` that say why.

Each keeps what was wrong (`problem`) apart from what to do, which the message words
in the terms of the Python API (`register_path`, `without_register=True`,
`force=True`); the command line says the same with its own flags.
"""

from __future__ import annotations

import os

from ledger.errors import BackupError


class RestoreRefused(BackupError):
    """A restore was refused before it changed anything."""

    def __init__(self, problem: str, remedy: str) -> None:
        self.problem = problem
        super().__init__(problem + remedy)


class RegisterMissing(RestoreRefused):
    """The forget register is not where the store says it is (R21)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        super().__init__(
            f"forget register {self.path} not found: without it a restore can bring back "
            "what was forgotten after the backup (R21)",
            ". Point register_path at it, or pass without_register=True to restore "
            "without it")


class DatabaseNotEmpty(RestoreRefused):
    """The target database holds data and the restore was not told to replace it."""

    def __init__(self, url: str) -> None:
        self.url = url
        super().__init__(f"the database {url} is not empty",
                         "; restore into an empty one, or pass force=True to replace "
                         "its contents")


class RegisterDamaged(RestoreRefused):
    """The forget register is damaged, torn, empty, of another ledger or lacks a forget
    the backup holds (docs/forgetting.md); nothing was changed."""

    def __init__(self, problem: str) -> None:
        super().__init__(
            f"{problem}; nothing was changed",
            ". Find an intact copy of the register, or pass register_damaged='repair' to "
            "restore with its intact entries kept (see docs/forgetting.md)")


class KeyStoreMissing(RestoreRefused):
    """The backup holds sealed content and the vault's key store is not here."""

    def __init__(self, where: str, sealed: int) -> None:
        self.where = where
        self.sealed = sealed
        super().__init__(
            f"the backup holds {sealed} encrypted payload(s) and the key store ({where}) "
            "is not here (or holds none of their keys): without it their content "
            "cannot be restored",
            ". Point the vault at its key store (MEMLEDGER_VAULT_PATH or "
            "MEMLEDGER_VAULT_URL), or pass envelopes_only=True to restore the envelopes "
            "with the content left sealed and unreadable")
