"""Run the `memledger` console script as an operator or app would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

BIN = Path(sys.executable).with_name("memledger")


class Cli:
    """The CLI bound to one database and forget register."""

    def __init__(self, db_url: str, register: str, env: dict[str, str] | None = None) -> None:
        self.db_url = db_url
        self.register = register
        self.env = {**os.environ, "MEMLEDGER_LOG_LEVEL": "WARNING", **(env or {})}

    def run(self, *args: str, stdin: bytes | None = None, check: int | None = 0
            ) -> subprocess.CompletedProcess[bytes]:
        """Run a command; assert its exit code unless `check` is None."""
        proc = subprocess.run(
            [str(BIN), "--db", self.db_url, "--forget-register", self.register, *args],
            input=stdin, capture_output=True, env=self.env, timeout=300)
        if check is not None:
            assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
        return proc

    def json(self, *args: str, **kw: Any) -> Any:
        """Run a command that prints one JSON object."""
        return orjson.loads(self.run(*args, **kw).stdout)

    def lines(self, *args: str, **kw: Any) -> list[Any]:
        """Run a command that prints JSON lines."""
        return [orjson.loads(x) for x in self.run(*args, **kw).stdout.splitlines() if x.strip()]

    def append(self, events: list[dict[str, Any]], check: int | None = 0) -> list[Any]:
        """Append wire events through stdin."""
        data = b"\n".join(orjson.dumps(e) for e in events) + b"\n"
        return self.lines("append", "-", stdin=data, check=check)
