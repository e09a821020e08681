"""structlog set-up: a short processor chain, JSON lines on stderr unless a TTY.

Log lines carry ids, positions and counts, never a memory's value or a secret.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import orjson
import structlog


def configure(level: str | None = None) -> None:
    """Configure structlog once for a process (CLI, worker, tests)."""
    name = (level or os.environ.get("MEMLEDGER_LOG_LEVEL") or "WARNING").upper()
    lvl = logging.getLevelNamesMapping().get(name, logging.WARNING)
    renderer: structlog.typing.Processor
    logger_factory: Any
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer(colors=False)
        logger_factory = structlog.PrintLoggerFactory(file=sys.stderr)
    else:
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        logger_factory = structlog.BytesLoggerFactory(file=sys.stderr.buffer)
    factory = structlog.make_filtering_bound_logger(lvl)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=factory,
        logger_factory=logger_factory,
        cache_logger_on_first_use=True,
    )


def configure_default() -> None:
    """Quiet defaults for library use: an app that configured structlog keeps its setup."""
    if not structlog.is_configured():
        configure()
