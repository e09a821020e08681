"""Recall's ranking (`projections.ranking.rank`) keeps its contract for any rows and
candidates: overrides by layer within a namespace and key (R8, R27), then priority
tier, relevance to 3 decimals, source reliability and recency in source order (R19),
with the reason of each winner. Checked against a plain restatement of those rules
(one group per key, the two stable sorts), over rows with shared keys, missing
candidates, equal relevances and equal source orders."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from projections import reads
from projections.candidates import MIN_RELEVANCE, SCORED, SEMANTIC, Candidate
from projections.ranking import RELEVANCE_DIGITS, RELIABILITY, rank

KINDS = [*RELIABILITY, "unknown_kind"]
BASES = ["semantic match", "lexical match", "semantic + lexical match", "exact key match",
         "in scope"]


def expected(rows: list[Any], cands: dict[str, Candidate], has_query: bool
             ) -> list[tuple[Any, float, str]]:
    """The ranking rules stated plainly, one group and one sort key at a time."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for r in rows:
        groups.setdefault((r.ns_path, r.mkey), []).append(r)
    out = []
    for group in groups.values():
        group = sorted(group, key=lambda r: reads.LAYER_RANK[r.layer])
        win = group[0]
        rels = [cands[r.memory_id].relevance if r.memory_id in cands else 0.0
                for r in group]
        rel = max(rels)
        own = cands.get(win.memory_id, Candidate(0.0, SEMANTIC))
        basis = own.basis if own.relevance >= rel else next(
            cands[r.memory_id].basis for r, v in zip(group, rels, strict=True)
            if r.memory_id in cands and v == rel)
        if win.layer == "long" and has_query and rel < MIN_RELEVANCE:
            continue
        parts = [f"{basis} {rel:.2f}" if basis in SCORED else basis]
        if win.layer == "session":
            parts.append("current session memory" + (
                ", overrides the stored value for this turn (R27)" if len(group) > 1
                else ""))
        elif win.layer == "task":
            parts.append("current task fact" + (
                ", overrides the long-term value in this task (R8)" if len(group) > 1
                else ""))
        else:
            parts.append("long-term memory")
        if win.layer == "long" and (win.version > 1 or win.supersedes):
            parts.append(f"correction (version {win.version})")
        kind = orjson.loads(win.source).get("kind", "")
        parts.append(f"source {kind}")
        out.append((win, rel, "; ".join(parts)))

    def tier(r: Any) -> int:
        if r.layer == "session":
            return 0
        return 1 if r.layer == "task" or r.version > 1 or r.supersedes else 2

    out.sort(key=lambda x: bytes(x[0].order_key), reverse=True)
    out.sort(key=lambda x: (tier(x[0]), -round(x[1], RELEVANCE_DIGITS),
                            -RELIABILITY.get(orjson.loads(x[0].source).get("kind", ""),
                                             0.5)))
    return out


row = st.tuples(
    st.sampled_from(["a", "b", "c"]),  # key: rows share keys, so groups form
    st.sampled_from(["long", "long", "task", "session"]),
    st.integers(1, 3),  # version
    st.booleans(),  # supersedes something
    st.sampled_from(KINDS),
    st.integers(0, 4),  # source order: equal orders happen
    st.one_of(st.none(), st.tuples(st.sampled_from([0.0, 0.04, 0.05, 0.3, 0.3004, 0.5, 1.0]),
                                   st.sampled_from(BASES))))


@settings(max_examples=300, deadline=None)
@given(st.lists(row, max_size=30), st.booleans())
def test_rank_follows_its_rules(spec: list[Any], has_query: bool) -> None:
    """Any rows and candidates: the same winners, order, relevances and reasons as the
    rules stated plainly."""
    rows = []
    cands: dict[str, Candidate] = {}
    for i, (key, layer, version, sup, kind, order, cand) in enumerate(spec):
        mid = f"m{i}"
        values: dict[str, Any] = {
            "tenant": "t", "memory_id": mid, "slot": key, "ns_path": "t\x1fu\x1f",
            "mkey": key, "layer": layer, "task_key": None, "session_id": None,
            "position": i, "order_key": bytes([order]), "version": version,
            "status": "active", "candidate": False, "value": None, "text": None,
            "scope": None, "supersedes": "m0" if sup else None, "superseded_by": None,
            "expires_at": None, "expires_us": None, "actor": "u",
            "source": orjson.dumps({"kind": kind}).decode()}
        rows.append(reads.MemVersionRow(**values))
        if cand is not None:
            cands[mid] = Candidate(*cand)
    got = rank(rows, cands, has_query)
    want = expected(rows, cands, has_query)
    assert [(r.memory_id, rel, why) for r, rel, why in got] == \
        [(r.memory_id, rel, why) for r, rel, why in want]
