"""The token budget of a recall: what an item or a task costs in a prompt, and the
choice of what fits (R26).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Final

import orjson

from projections import reads

_RUNS: Final = re.compile(
    r"(?P<wide>[\u1100-\u11ff\u2e80-\u9fff\ua960-\ua97f\uac00-\ud7ff\uf900-\ufaff"
    r"\ufe30-\ufe4f\uff00-\uffef])"
    r"|(?P<astral>[\U00010000-\U0010ffff])"
    r"|(?P<word>[A-Za-z\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff]+)"
    r"|(?P<digits>[0-9]+)"
    r"|(?P<space>\s+)"
    r"|(?P<other>.)", re.S)


def estimate_tokens(text: str) -> int:
    """A conservative token estimate that is right for CJK text too.

    One token per CJK ideograph, kana, hangul syllable or full-width form (tokenisers
    give CJK text about one token per character, where the 4-characters-per-token rule
    of English would undercount it four times); two per character outside the BMP
    (emoji, rare ideographs); a latin, greek or cyrillic word costs one per 4 letters,
    rounded up; digits one per 3; whitespace nothing (it merges into the next token);
    any other character one.
    """
    n = 0
    for m in _RUNS.finditer(text):
        kind = m.lastgroup
        if kind == "wide" or kind == "other":
            n += 1
        elif kind == "astral":
            n += 2
        elif kind == "word":
            n += math.ceil(len(m.group()) / 4)
        elif kind == "digits":
            n += math.ceil(len(m.group()) / 3)
    return n


def render_item(item: dict[str, Any]) -> str:
    """How an app puts a memory in a prompt: `key: value` (what the budget counts)."""
    value = item["value"]
    shown = value if isinstance(value, str) else orjson.dumps(value).decode()
    return f"{item['key']}: {shown}"


def item_tokens(item: dict[str, Any]) -> int:
    """Tokens an item costs in a prompt: its rendering plus 2 for the line around it."""
    return estimate_tokens(render_item(item)) + 2


def task_tokens(task: dict[str, Any]) -> int:
    """Tokens a task summary costs: its JSON as returned, plus 2."""
    return estimate_tokens(orjson.dumps(task).decode()) + 2


def fit(tasks: list[dict[str, Any]], ranked: list[tuple[Any, float, str]],
        budget: int | None, limit: int, content: Callable[[Any], Any] | None = None
        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Take tasks, then items in priority order, while they fit the budget and limit.
    `content` gives a ranked row with its content readable (recall opens sealed
    values only for the rows it looks at here)."""
    used = 0
    picked_tasks: list[dict[str, Any]] = []
    for x in tasks:
        cost = task_tokens(x)
        if budget is not None and used + cost > budget:
            continue
        used += cost
        picked_tasks.append(x)
    items: list[dict[str, Any]] = []
    for r, rel, reason in ranked:
        if len(items) >= limit:
            break
        item = reads.memory_item(content(r) if content is not None else r)
        cost = item_tokens(item)
        if budget is not None and used + cost > budget:
            continue  # a smaller item further down may still fit
        used += cost
        items.append({**item, "score": round(rel, 4), "reason": reason, "tokens": cost})
    return picked_tasks, items, used

