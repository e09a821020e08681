"""Durable writes of the small files kept beside a SQLite ledger (the forget register,
the vault's key store): a whole-file replacement that survives a crash at any point,
and the directory fsync that makes a file's creation or renaming durable."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the creation or renaming of `path` durable (fsync its directory)."""
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def replace_file(path: Path, tmp: Path, data: bytes) -> None:
    """Replace `path` by `data`: written to `tmp` (mode 0600), fsynced, renamed over
    `path`, and the rename made durable, so a crash leaves the old file or the new one."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path)
