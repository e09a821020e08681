"""Every projection, in the order `projections.runner.Runner` runs them."""

from __future__ import annotations

from projections.erasure import ErasureProjection
from projections.history import HistoryProjection
from projections.lexical import LexicalProjection
from projections.protocol import Projection
from projections.vectors import VectorProjection
from projections.views import MemoryProjection, TaskProjection


def default_projections() -> list[Projection]:
    """Every projection, each after the projections whose views it reads."""
    projs: list[Projection] = [MemoryProjection(), TaskProjection(), ErasureProjection(),
                               VectorProjection(), LexicalProjection(),
                               HistoryProjection()]
    seen: set[str] = set()
    for p in projs:
        missing = set(p.depends_on) - seen
        assert not missing, f"projection {p.name!r} runs before {sorted(missing)}"
        seen.add(p.name)
    return projs
