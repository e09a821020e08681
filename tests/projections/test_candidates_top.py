"""The semantic arm's pool (`projections.candidates._top`): the k best scores at or
above the floor, best first, equal scores newest first (R19's tie-breaker), whatever
the scores: many ties, removed rows (-inf), fewer rows than k or than a block."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from projections.candidates import MIN_RELEVANCE, TOP_BLOCK, _top


def reference(scores: np.ndarray, k: int, floor: float, orders: list[bytes]) -> list[int]:
    """Every row sorted by score, then source order (newest first), then row."""
    rows = [i for i in range(len(scores)) if scores[i] >= np.float32(floor)]
    rows.sort(key=lambda i: (orders[i], i), reverse=True)
    rows.sort(key=lambda i: -float(scores[i]))
    return rows[:k]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_pool_is_the_k_best_newest_first_on_ties(data: st.DataObject) -> None:
    """Exact against a full sort, with few distinct values (ties across the k-th place)
    and with rows enough for the block threshold to apply."""
    n = data.draw(st.integers(0, 12 * TOP_BLOCK))
    k = data.draw(st.integers(1, 80))
    levels = data.draw(st.lists(st.floats(-0.25, 1.0, width=32), min_size=1, max_size=40))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scores = np.asarray(levels, dtype=np.float32)[rng.integers(0, len(levels), n)]
    if n and data.draw(st.booleans()):
        scores[rng.integers(0, n, n // 3)] = -np.inf  # removed rows
    orders = [bytes(rng.integers(0, 3, 2).tolist()) for _ in range(n)]
    got = _top(scores, k, MIN_RELEVANCE, orders).tolist()
    assert got == reference(scores, k, MIN_RELEVANCE, orders)


def test_pool_with_distinct_scores_is_argpartitions() -> None:
    """Without ties, the same rows in the same order as a partition of every score."""
    rng = np.random.default_rng(7)
    for n in (10, 1_000, 100_000):
        scores = (rng.permutation(n) / n).astype(np.float32)  # distinct
        for k in (1, 68, 500):
            want = np.argpartition(-scores, k - 1)[:k] if n > k else np.arange(n)
            want = want[scores[want] >= MIN_RELEVANCE]
            want = want[np.argsort(-scores[want], kind="stable")]
            assert _top(scores, k, MIN_RELEVANCE).tolist() == want.tolist()
