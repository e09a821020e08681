"""The broker's queue names and thread default, apart from `workers.broker`: the CLI's
argument parser needs them, and importing the broker module loads the Redis and
dramatiq clients, about a sixth of a CLI process's start-up for commands that never
use the broker."""

from __future__ import annotations

from typing import Final

INGEST_QUEUE: Final = "ingest"
PROJECT_QUEUE: Final = "project"
QUEUES: Final = (INGEST_QUEUE, PROJECT_QUEUE)
#: Worker threads per process. An ingest message holds its thread until its events
#: are committed, so threads x events per message bounds what a process has in flight:
#: with 16, messages of a few events each could not be ingested at 2,000/s.
DEFAULT_THREADS: Final = 64
