"""The lease policy of `workers.leases` (pure): processes converge on owning every shard,
each at most its fair share, whatever joins and leaves, in whatever order they tick."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.leases import fair_share, plan


def tick(owned: dict[int, set[int]], me: int, shards: int, offset: int) -> None:
    """One process's tick against the shared lock table (`owned`: member -> shards)."""
    held = {k for m, ks in owned.items() if m != me for k in ks}
    start = offset % shards
    free = [k % shards for k in range(start, start + shards) if k % shards not in held]
    give, take = plan(owned[me], free, shards, len(owned))
    owned[me] -= set(give)
    owned[me] |= {k for k in take if k not in held}


@given(seed=st.integers(0, 10**6), shards=st.integers(1, 64),
       changes=st.lists(st.sampled_from(["join", "leave", "die"]), max_size=8))
@settings(max_examples=200, deadline=None)
def test_leases_converge_to_fair_shares(seed: int, shards: int, changes: list[str]) -> None:
    """After any run of joins, graceful leaves and deaths, and a few rounds of ticks in
    random order, every shard has exactly one owner and no process owns more than
    ceil(S / processes) (property)."""
    rng = random.Random(seed)
    owned: dict[int, set[int]] = {0: set()}
    offsets = {0: rng.randrange(10**6)}
    next_id = 1
    for change in changes:
        if change == "join" or len(owned) == 1:
            owned[next_id] = set()
            offsets[next_id] = rng.randrange(10**6)
            next_id += 1
        else:
            gone = rng.choice(sorted(owned))
            del owned[gone]  # a graceful leave and a death both end its session's locks
        for _ in range(rng.randrange(3)):  # some ticks between changes
            for m in rng.sample(sorted(owned), len(owned)):
                tick(owned, m, shards, offsets[m])
    for _ in range(3):
        for m in rng.sample(sorted(owned), len(owned)):
            tick(owned, m, shards, offsets[m])
    every = [k for ks in owned.values() for k in ks]
    assert sorted(every) == list(range(shards))
    fair = fair_share(shards, len(owned))
    assert all(len(ks) <= fair for ks in owned.values())


def test_plan_gives_back_above_the_share_and_drops_shards_past_s() -> None:
    """A process above its share gives back its highest shards; shards numbered past a
    smaller S are given back too; one below its share takes free ones."""
    assert plan({0, 1, 2, 3}, [], 4, 2) == ([2, 3], [])
    assert plan({0, 5}, [1, 2], 4, 1) == ([5], [1, 2])
    assert plan(set(), [3, 0, 1], 4, 2) == ([], [3, 0])
    assert fair_share(16, 3) == 6 and fair_share(16, 0) == 16
