"""The forget register: every forget and task purge, kept outside the ledger database.

A restore from an older backup reapplies what is here, so nothing forgotten after the
backup comes back (R21). The file is append-only JSON Lines; each line carries its own
checksum, and every append is fsynced before the ledger append returns. It holds
targets and source order, never forgotten content (no values, no reasons).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from ledger.errors import RegisterError


def default_register_path(db_url: str) -> str:
    """Where the register lives when nothing says otherwise (CONTRACT.md section 2)."""
    env = os.environ.get("MEMLEDGER_FORGET_REGISTER")
    if env:
        return env
    if db_url.startswith("sqlite"):
        path = db_url.split(":///", 1)[1] if ":///" in db_url else ""
        if not path or path.startswith(":memory:"):
            raise RegisterError(
                "an in-memory SQLite ledger has no place for its forget register; "
                "set MEMLEDGER_FORGET_REGISTER or give the register a path"
            )
        return path.split("?", 1)[0] + ".forgets"
    # A server database has no file beside it: name the file after the database.
    name = db_url.rsplit("/", 1)[-1].split("?", 1)[0] or "memledger"
    return f"memledger-{name}.forgets"


def _line(entry: dict[str, Any]) -> bytes:
    body = orjson.dumps(entry, option=orjson.OPT_SORT_KEYS)
    check = hashlib.sha256(body).hexdigest()[:16]
    return orjson.dumps({"e": orjson.Fragment(body), "c": check}) + b"\n"


class ForgetRegister:
    """Append-only, fsynced file of forget and purge events (their wire form)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def exists(self) -> bool:
        """True when the register file is there."""
        return self.path.exists()

    def append(self, entries: Sequence[dict[str, Any]]) -> None:
        """Append entries and fsync the file (and its folder on first creation)."""
        if not entries:
            return
        data = b"".join(_line(e) for e in entries)
        try:
            created = not self.path.exists()
            if created:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                dfd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as e:
            raise RegisterError(f"cannot write forget register {self.path}: {e}") from e

    def entries(self) -> Iterator[dict[str, Any]]:
        """Every entry in order; a torn last line (crash mid-write) is skipped, any other
        damage raises `RegisterError`."""
        if not self.path.exists():
            return
        try:
            lines = self.path.read_bytes().split(b"\n")
        except OSError as e:
            raise RegisterError(f"cannot read forget register {self.path}: {e}") from e
        last = len(lines) - 1
        for n, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                obj = orjson.loads(raw)
                body = orjson.dumps(obj["e"], option=orjson.OPT_SORT_KEYS)
                ok = hashlib.sha256(body).hexdigest()[:16] == obj["c"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                ok = False
            if not ok:
                if n == last:
                    continue  # torn final write (no newline): it was never acknowledged
                raise RegisterError(f"forget register {self.path} line {n + 1} is damaged")
            yield dict(obj["e"])
