"""What a projection is to the runner: a name, the events it reads, its tables, the views
it reads from, and a fold of a batch into its tables (plus, optionally, a bulk load).

Projections know nothing of each other's modules: what one needs of another's view it
reads from that view's tables, and says so in `depends_on`. The runner
(`projections.runner`) does the reading, the transaction and the checkpoint; the
registry (`projections.registry`) lists the projections in the order they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.records import StoredEvent
from ledger.store import Store

#: A bulk load's progress, as recorded between steps (JSON-able).
State = dict[str, Any]


class Projection(Protocol):
    """A view kept up to date from the ledger."""

    name: str
    #: The event types it reads (None: every event); the runner still moves past the rest.
    types: tuple[str, ...] | None
    tables: tuple[Any, ...]
    #: Names of the projections whose views it reads (they run before it).
    depends_on: tuple[str, ...]
    # Optional, read with getattr: `sparse` (True: its `types` are a small share of the
    # ledger, so `Runner.catch_up` steps it on its own instead of in a fused window of
    # the views beside it, `Runner.groups`); `prepare` (slow work before a batch's
    # write transaction, `projections.vectors.VectorProjection.prepare`).

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        """Apply a batch of events (in position order) to the view, inside `conn`'s tx."""


@runtime_checkable
class BulkLoadable(Protocol):
    """A projection that can refill its emptied view in bulk (`projections.bulk`)."""

    name: str

    async def bulk_step(self, store: Store, conn: AsyncConnection, state: State,
                        size: int) -> tuple[State | None, int]:
        """Do one step of at most about `size` items, inside `conn`'s transaction.

        Returns the state to record (None when the load is complete) and the positions
        of progress to report (at least 1).
        """


def finished(state: State) -> tuple[None, int]:
    """The result of a bulk load's last step: the positions not yet reported."""
    return None, max(1, int(state["head"]) - int(state.get("reported", 0)))


def progressed(state: State, n: int) -> tuple[State, int]:
    """A step's result: the state to keep, and `n` positions of progress (at least 1)."""
    n = max(1, n)
    state["reported"] = int(state.get("reported", 0)) + n
    return state, n
