"""What every audience module of the CLI shares.

JSON on stdout and messages on stderr, JSON Lines in, the store named by the global
options, the progress line on stderr, and `Audience`: how a module adds its subcommands
so that `memledger --help` lists them together.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any, BinaryIO, TextIO

import orjson

from ledger.errors import BackupTargetExists, MemledgerError, RegisterError, ValidationError
from ledger.store import Store
from memledger import MemoryLedger
from replay.errors import (
    DatabaseNotEmpty,
    KeyStoreMissing,
    RegisterDamaged,
    RegisterMissing,
    RestoreRefused,
)
from replay.progress import ProgressUpdate

#: A subcommand: takes the parsed arguments, returns the exit code.
Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
REDIS_HELP = "broker URL (default $MEMLEDGER_REDIS_URL or redis://127.0.0.1:6379/0)"


# -- output -------------------------------------------------------------------------------

def out(obj: Any) -> None:
    """Print one JSON object on stdout."""
    sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
    sys.stdout.flush()


def say(msg: str) -> None:
    """Print a human message on stderr."""
    print(msg, file=sys.stderr, flush=True)


def now_us() -> int:
    """Microseconds since the epoch."""
    return time.time_ns() // 1000


def read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for every non-blank line of a file or stdin."""
    stream: BinaryIO = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    try:
        for n, line in enumerate(stream, start=1):
            if line.strip():
                yield n, line
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def _clock(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressLine:
    """Draws `replay.progress` updates on stderr: done/total, units/s and ETA.

    On a terminal one line is redrawn in place; otherwise (a log file, a CI job) a plain
    line is written every few seconds, so the output stays readable when captured. The
    first update of each phase and its end are always written.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self._tty = self.stream.isatty()
        self._every = 0.2 if self._tty else 5.0
        self._label: str | None = None
        self._last = 0.0

    def __call__(self, u: ProgressUpdate) -> None:
        if u.final:
            self._write(f"{u.label}: {u.done:,} {u.unit} in {_clock(u.elapsed)} "
                        f"({u.rate:,.0f} {u.unit}/s)", final=True)
            self._label = None
            return
        now = time.monotonic()
        if u.label == self._label and now - self._last < self._every:
            return
        self._label, self._last = u.label, now
        pct = f" ({100 * u.done / u.total:5.1f}%)" if u.total else ""
        eta = _clock(u.eta) if u.eta is not None else "-"
        self._write(f"{u.label}: {u.done:,}/{u.total:,} {u.unit}{pct}, "
                    f"{u.rate:,.0f} {u.unit}/s, ETA {eta}")

    def _write(self, text: str, *, final: bool = False) -> None:
        if self._tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def progress_of(args: argparse.Namespace) -> ProgressLine | None:
    """The progress line on stderr, unless the command was given `--quiet`."""
    return None if getattr(args, "quiet", False) else ProgressLine()


# -- the store ----------------------------------------------------------------------------

@contextlib.contextmanager
def _register_hint(args: argparse.Namespace) -> Iterator[None]:
    """A default forget register that cannot be placed: say which flag places it."""
    try:
        yield
    except RegisterError as e:
        if args.forget_register is not None:
            raise
        raise RegisterError(f"{e} (--forget-register PATH)") from e


def open_store(args: argparse.Namespace) -> Store:
    """The store named by --db / MEMLEDGER_DB_URL, with its forget register."""
    with _register_hint(args):
        return Store(args.db, register_path=args.forget_register)


def open_ledger(args: argparse.Namespace) -> MemoryLedger:
    """The SDK on the store named by the global options (principal-scoped reads)."""
    with _register_hint(args):
        return MemoryLedger(args.db, register_path=args.forget_register)


# -- errors -------------------------------------------------------------------------------

#: What to do about a refused restore, in the CLI's flags (the library says it in
#: Python parameters).
_REMEDIES: Mapping[type[RestoreRefused], str] = {
    RegisterMissing: ". Point --forget-register at it, or pass --without-register to "
                     "restore without it",
    DatabaseNotEmpty: "; restore into an empty one, or pass --force to replace its "
                      "contents",
    RegisterDamaged: ". Find an intact copy of the register, or pass --register-damaged "
                     "repair to restore with its intact entries kept (see "
                     "docs/forgetting.md)",
    KeyStoreMissing: ". Point MEMLEDGER_VAULT_PATH (or MEMLEDGER_VAULT_URL) at the key "
                     "store, or pass --envelopes-only to restore the envelopes with the "
                     "content left sealed and unreadable",
}


def error_message(e: MemledgerError, args: argparse.Namespace) -> str:
    """The error as the CLI words it: parameters named by the command's flags.

    A `ValidationError` whose field is a parameter the command sets from a flag
    (`error_flags` of the command) names the flag instead; a refused restore says what
    to do with the restore's flags, an existing backup target with the backup's. Every
    other message is the library's own.
    """
    flags: Mapping[str, str] = getattr(args, "error_flags", {})
    if isinstance(e, ValidationError) and e.field in flags:
        return f"{flags[e.field]}: {e.message}"
    if isinstance(e, RestoreRefused) and type(e) in _REMEDIES:
        return e.problem + _REMEDIES[type(e)]
    if isinstance(e, BackupTargetExists):
        return e.problem + "; choose a new path, or pass --force to replace it"
    return str(e)


# -- subcommands --------------------------------------------------------------------------

def handles(parser: argparse.ArgumentParser, handler: Handler,
            flags: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Make `handler` run for `parser`'s command.

    `flags` maps the names the library uses in its errors (a `ValidationError`'s field)
    to the flags of this command that set them, so error messages name the flags.
    """
    parser.set_defaults(handler=handler, error_flags=dict(flags or {}))
    return parser


class Audience:
    """The subcommands of one audience (apps, operators, workers), listed together."""

    def __init__(self, title: str,
                 sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        self.title = title
        self.sub = sub
        self.listed: list[tuple[str, str]] = []

    def command(self, name: str, help: str, handler: Handler | None = None, *,
                flags: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
        """Add subcommand `name`; without a handler it takes sub-subcommands of its own."""
        parser = self.sub.add_parser(name, help=help)
        if handler is not None:
            handles(parser, handler, flags)
        self.listed.append((name, help))
        return parser
