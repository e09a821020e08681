"""Recall's ranking: overrides by layer, priority tiers, relevance, then source
reliability, then recency (R19, R26, R27); and the open tasks a turn is about (R4).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, Final

import numpy as np
import orjson
from numpy.typing import NDArray

from projections import lexical, reads
from projections.candidates import MIN_RELEVANCE, SCORED, SEMANTIC, Candidate
from projections.embedding import Embedder
from projections.principal_index import PrincipalIndex
from projections.vectors import TASK_NOUNS, task_text

#: How much a source is trusted when two memories are equally relevant (R19).
RELIABILITY: Final = {
    "explicit_user_request": 1.0, "operator": 0.95, "system_of_record": 0.9,
    "user_statement": 0.7, "model_inference": 0.5, "tool_output": 0.3,
    "retrieved_document": 0.3}
#: Relevance is compared at this precision, so that near-equal scores fall through to
#: source reliability and then recency (R19) instead of to noise in the last digits.
RELEVANCE_DIGITS: Final = 3
#: A task must be at least this similar to the query to be offered at all.
TASK_MIN: Final = 0.15
#: Tasks within this much of the best match are equally good candidates: ambiguous (R4).
TASK_MARGIN: Final = 0.1


def _tier(r: Any) -> int:
    """Budget priority (R26): the current turn's session memories, then task facts and
    corrections, then everything else."""
    if r.layer == "session":
        return 0
    if r.layer == "task" or r.version > 1 or r.supersedes:
        return 1
    return 2


def rank(rows: Sequence[Any], cands: dict[str, Candidate], has_query: bool
         ) -> list[tuple[Any, float, str]]:
    """Overrides, then priority and rank order: [(row, relevance, reason)]."""
    by_key: dict[tuple[str, str], list[Any]] = {}
    for r in rows:
        k = (r.ns_path, r.mkey)
        got = by_key.get(k)
        if got is None:
            by_key[k] = [r]
        else:
            got.append(r)
    # (rank key, source order, result) per winner: the keys computed once each.
    keyed: list[tuple[tuple[int, float, float], bytes, tuple[Any, float, str]]] = []
    for group in by_key.values():
        if len(group) == 1:  # most groups: no override, the row's own candidate
            win = group[0]
            c = cands.get(win.memory_id)
            rel, basis = (c.relevance, c.basis) if c is not None else (0.0, SEMANTIC)
        else:
            group.sort(key=lambda r: reads.LAYER_RANK[r.layer])
            win = group[0]
            c = cands.get(win.memory_id, Candidate(0.0, SEMANTIC))
            rel = max(cands[r.memory_id].relevance if r.memory_id in cands else 0.0
                      for r in group)
            basis = c.basis if c.relevance >= rel else next(
                cands[r.memory_id].basis for r in group
                if r.memory_id in cands and cands[r.memory_id].relevance == rel)
        if win.layer == "long" and has_query and rel < MIN_RELEVANCE:
            continue
        reason = [f"{basis} {rel:.2f}" if basis in SCORED else basis]
        lower = len(group) > 1
        if win.layer == "session":
            reason.append("current session memory"
                          + (", overrides the stored value for this turn (R27)"
                             if lower else ""))
        elif win.layer == "task":
            reason.append("current task fact"
                          + (", overrides the long-term value in this task (R8)"
                             if lower else ""))
        else:
            reason.append("long-term memory")
        if win.layer == "long" and (win.version > 1 or win.supersedes):
            reason.append(f"correction (version {win.version})")
        kind = _source_kind(win)
        reason.append(f"source {kind}")
        keyed.append(((_tier(win), -round(rel, RELEVANCE_DIGITS),
                       -RELIABILITY.get(kind, 0.5)), bytes(win.order_key),
                      (win, rel, "; ".join(reason))))
    # Recency (source order, newest first) only breaks ties left by relevance and then
    # by source reliability (R19); both sorts are stable.
    keyed.sort(key=itemgetter(1), reverse=True)
    keyed.sort(key=itemgetter(0))
    return [x[2] for x in keyed]


def _source_kind(r: Any) -> str:
    return str(orjson.loads(r.source).get("kind", ""))


_REF_EDGE = r"(?<![0-9a-z]){}(?![0-9a-z])"


def relevant_tasks(open_tasks: list[dict[str, Any]], idx: PrincipalIndex, emb: Embedder,
                   qtext: str | None, qvec: NDArray[np.float32] | None, task: str | None
                   ) -> list[dict[str, Any]]:
    """The open tasks the turn is about (R4): the current one, or the query's matches."""
    if task is not None:
        return [{**x, "score": 1.0, "reason": "current task", "ambiguous": False}
                for x in open_tasks if x["task_key"] == task]
    if qtext is None or qvec is None:
        return [{**x, "score": 1.0, "reason": "open task", "ambiguous": False}
                for x in open_tasks]
    if not open_tasks:
        return []
    q = qtext.casefold()
    exact: list[dict[str, Any]] = []
    for x in open_tasks:
        refs = [x["task_key"], *[str(v) for v in (x.get("refs") or {}).values()]]
        if any(len(ref) >= 2 and re.search(_REF_EDGE.format(re.escape(ref.casefold())), q)
               for ref in refs):
            exact.append(x)
    if exact:
        amb = len(exact) > 1
        return [{**x, "score": 1.0, "reason": "the query names this task or one of its "
                 "references" + ("; several tasks match equally: ask which (R4)" if amb else ""),
                 "ambiguous": amb} for x in exact]
    pos = {k: i for i, k in enumerate(idx.task_ids)}
    missing = [x for x in open_tasks if x["task_key"] not in pos]
    sims: dict[str, float] = {}
    if idx.task_ids:
        s = idx.task_matrix @ qvec
        sims = {k: float(s[i]) for k, i in pos.items()}
    if missing:  # not indexed yet: embed the summary now
        s2 = emb.embed([task_text(x["task_key"], x) for x in missing]) @ qvec
        sims.update({x["task_key"]: float(v) for x, v in zip(missing, s2, strict=True)})
    scored = sorted(((sims.get(x["task_key"], 0.0), x) for x in open_tasks),
                    key=lambda p: -p[0])
    best = scored[0][0]
    if best >= TASK_MIN:
        close = [(s, x) for s, x in scored if s >= max(TASK_MIN, best - TASK_MARGIN)]
        why = "semantic match {:.2f} with the task summary"
    elif _TASK_NOUNS.intersection(lexical.query_terms(qtext)):
        # "How is that ticket going?": the query asks after a task by what it is, not by
        # anything of its own; every open task is a candidate, and the summaries pick one
        # only when it stands out by the margin (several: ask which, R4). The word is
        # matched as the lexical arm matches terms; no embedder vocabulary is needed.
        close = [(s, x) for s, x in scored if s >= best - TASK_MARGIN]
        why = "the query asks after a task without naming it (semantic match {:.2f})"
    else:
        return []
    amb = len(close) > 1
    return [{**x, "score": round(s, 4),
             "reason": why.format(s)
             + ("; several tasks match about equally: ask which (R4)" if amb else ""),
             "ambiguous": amb} for s, x in close]


#: The terms of `TASK_NOUNS` as the lexical arm reads text (stemmed words, CJK bigrams).
_TASK_NOUNS: Final = frozenset(lexical.terms(TASK_NOUNS))

