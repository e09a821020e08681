"""The `memledger` command line, for agent apps, operators and worker daemons.

Every command prints JSON on stdout (one object, or one per line where it says lines),
human messages and progress on stderr, and exits 0 on success, 1 on rejected input or
a failed check, 2 on usage errors.

The commands live with their audience: `memledger.cli.app`, `memledger.cli.operator`,
`memledger.cli.workers`, `memledger.cli.server`. This module holds the global options,
the dispatch and the translation of errors into exit codes; `memledger.cli.common` what
they share.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import textwrap
from collections.abc import Generator
from types import ModuleType

from ledger.errors import MemledgerError
from ledger.logs import configure
from memledger.cli import app, operator, server, workers
from memledger.cli.common import Audience, error_message, out, say

__all__ = ["build_parser", "main"]

#: The audience modules, in the order `memledger --help` lists them. Each has a
#: `TITLE` and `add_commands(audience)`.
AUDIENCES: tuple[ModuleType, ...] = (app, operator, workers, server)


def _listing(audiences: list[Audience], columns: int = 79) -> str:
    """Each audience's title, then its commands with their help, wrapped at `columns`."""
    width = max(len(name) for a in audiences for name, _ in a.listed) + 4
    blocks = []
    for a in audiences:
        rows = [f"{a.title}:"]
        for name, text in a.listed:
            lines = textwrap.wrap(text, columns - width) or [""]
            rows.append(f"  {name:<{width - 2}}{lines[0]}")
            rows.extend(" " * width + line for line in lines[1:])
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help, but the commands are listed by audience (the epilog), not in
    argparse's one list under COMMAND."""

    def _iter_indented_subactions(self, action: argparse.Action
                                  ) -> Generator[argparse.Action, None, None]:
        if not isinstance(action, argparse._SubParsersAction):
            yield from super()._iter_indented_subactions(action)


def build_parser() -> argparse.ArgumentParser:
    """The parser of the global options and every subcommand."""
    p = argparse.ArgumentParser(
        prog="memledger", formatter_class=_HelpFormatter,
        description="The `memledger` command line: JSON on stdout, messages on stderr;\n"
                    "exit 0 on success, 1 on rejected input or a failed check, 2 on a "
                    "usage error.")
    p.add_argument("--db", default=os.environ.get("MEMLEDGER_DB_URL"),
                   help="database URL (default $MEMLEDGER_DB_URL or "
                        "sqlite+aiosqlite:///./memledger.db)")
    p.add_argument("--forget-register", default=None,
                   help="forget register file (default $MEMLEDGER_FORGET_REGISTER or "
                        "<sqlite path>.forgets)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="one of the commands listed below")
    audiences = []
    for module in AUDIENCES:
        aud = Audience(module.TITLE, sub)
        module.add_commands(aud)
        audiences.append(aud)
    p.epilog = _listing(audiences)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `memledger` console script; returns the exit code."""
    configure()
    args = build_parser().parse_args(argv)  # a usage error exits 2 here
    try:
        code: int = asyncio.run(args.handler(args))
    except MemledgerError as e:
        msg = error_message(e, args)
        say(f"error: {msg}")
        out({"error": msg})
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    return code
