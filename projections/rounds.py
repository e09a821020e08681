"""What a fused projection round knows, shared with the projections it applies.

`Runner.round` locks every projection's checkpoint, moves them all to the round's end
in one statement and checks that no shard checkpoint exists, before any projection
applies its share. A projection that reads those positions (the indexes ask how far
the views they are fed from have got, `projections.vectors.source_shard_positions`)
can take them from here instead of reading them again. The round's facts also carry
a memo for what one transaction reads repeatedly and only it could change (the
ledger's resolved embedder): it lives as long as the round's transaction. What one
projection reads from the views that a later one reads again (the slots a batch
reaches: vectors, then lexical) is kept apart, in `views`, and dropped if the round's
savepoint is rolled back.

The ledger's tombstones are in the memo too (`tombstones`): the views of a round read
those of the same tenants up to the same position (the memories view, the stored
history), and no view writes them; only an append does, at positions after the
round's end, which a read `upto` it never returns.

Outside a round (`Runner.step`, bulk loads, rebuilds, replays) `current()` is None
and every reader goes to SQL as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.forgets import Tombstone
from ledger.store import Store


@dataclass
class RoundFacts:
    """A fused round's checkpoints (every projection of the runner, as moved by it;
    no shard checkpoints exist) and its per-transaction memo."""

    positions: Mapping[str, int]
    memo: dict[Any, Any] = field(default_factory=dict)
    #: What a projection read from the views the round has changed, for a later one
    #: (`projections.vectors.slots_of`): dropped when the round's savepoint is rolled
    #: back (`Runner._apply_plan`), since the views it was read from are then undone.
    views: dict[Any, Any] = field(default_factory=dict)

    def position(self, name: str) -> int | None:
        """A projection's checkpoint in this round; None if the round does not know it."""
        return self.positions.get(name)


_FACTS: ContextVar[RoundFacts | None] = ContextVar("memledger_round", default=None)


def current() -> RoundFacts | None:
    """The facts of the round being applied, or None outside a fused round."""
    return _FACTS.get()


@contextlib.contextmanager
def applying(facts: RoundFacts) -> Iterator[RoundFacts]:
    """Make `facts` current for the block (the round's apply)."""
    token = _FACTS.set(facts)
    try:
        yield facts
    finally:
        _FACTS.reset(token)


async def tombstones(store: Store, conn: AsyncConnection, tenants: Iterable[str],
                     upto: int) -> list[Tombstone]:
    """`store.tombstones(conn, tenants, upto=upto)`, read once per round for the same
    tenants and position (a new list each call)."""
    key = frozenset(tenants)
    facts = current()
    if facts is None:
        return await store.tombstones(conn, key, upto=upto)
    memo = ("tombstones", key, upto)
    got: list[Tombstone] | None = facts.memo.get(memo)
    if got is None:
        got = facts.memo[memo] = await store.tombstones(conn, key, upto=upto)
    return list(got)
