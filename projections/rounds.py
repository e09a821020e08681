"""What a fused projection round knows, shared with the projections it applies.

`Runner.round` locks every projection's checkpoint, moves them all to the round's end
in one statement and checks that no shard checkpoint exists, before any projection
applies its share. A projection that reads those positions (the indexes ask how far
the views they are fed from have got, `projections.vectors.source_shard_positions`)
can take them from here instead of reading them again. The round's facts also carry
a memo for what one transaction reads repeatedly and only it could change (the
ledger's resolved embedder): it lives as long as the round's transaction.

Outside a round (`Runner.step`, bulk loads, rebuilds, replays) `current()` is None
and every reader goes to SQL as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RoundFacts:
    """A fused round's checkpoints (every projection of the runner, as moved by it;
    no shard checkpoints exist) and its per-transaction memo."""

    positions: Mapping[str, int]
    memo: dict[str, Any] = field(default_factory=dict)

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
