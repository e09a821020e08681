"""The `memledger` command line."""

from __future__ import annotations

from replay.cli import main

__all__ = ["main"]
