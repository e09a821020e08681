"""A forget's projection round seeks what it erases: its cost does not grow with the
tenant (R20; issue 20).

A forget (`wait=True`) returns once every view has applied it: the vector index drops
the entries it covers, the history view redacts the key's versions, the lexical index
drops its documents. Each of those statements must reach the covered rows by an index
seek on more than the tenant: a statement that seeks by the tenant alone reads every
row of the tenant, and each forget then costs in proportion to everything the tenant
holds (at 50,000 memories, about 200 ms of a 380 ms forget went to one such `DELETE`
of `vectors`, whose `OR` with a branch that could never be true left SQLite only the
tenant to seek by). The plans of every statement of the round are read with SQLite's
`EXPLAIN QUERY PLAN`.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from ledger import schema as t
from ledger.backends.sqlite import file_path
from memledger import MemoryLedger
from memledger.events import write

WRITTEN = "2026-09-30T10:00:00+00:00"
SOURCE = {"kind": "explicit_user_request", "id": "F1", "at": "2026-09-30T11:00:00+00:00"}
#: The tables a forget erases from: the views, and the ledger's events (their payloads).
VIEWS = {tb.name for tb in t.VIEW_TABLES} | {"events"}
#: Statements that read no covered row: a WHERE that is constant-false (SQLite skips
#: the loop), and the probe of the embedder the index was built by (its first row).
NOT_ERASING = (re.compile(r" WHERE 0 = 1$"),
               re.compile(r"^SELECT vectors\.model FROM vectors WHERE vectors\.model IS NOT "
                          r"NULL ORDER BY .* LIMIT \? OFFSET \?$"))


@contextmanager
def statements() -> Iterator[list[tuple[str, Any]]]:
    """Every statement any engine of this process runs meanwhile, with its parameters."""
    seen: list[tuple[str, Any]] = []

    def note(conn: Any, cursor: Any, sql: str, params: Any, context: Any,
             many: bool) -> None:
        seen.append((sql, params[0] if many and params else params))
    event.listen(Engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", note)


def _plans(db: sqlite3.Connection, seen: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """(statement, plan line) of each statement that reads or writes a view."""
    out = []
    for sql, params in seen:
        words = sql.split()
        if not words or words[0].upper() not in ("SELECT", "UPDATE", "DELETE", "INSERT",
                                                  "WITH"):
            continue
        if not VIEWS & set(re.findall(r"\w+", sql)):
            continue
        if any(p.search(" ".join(words)) for p in NOT_ERASING):
            continue
        args = params if isinstance(params, tuple | list) else ()
        try:
            lines = [r[3] for r in db.execute("EXPLAIN QUERY PLAN " + sql, args)]
        except sqlite3.Error:
            continue  # a statement of a temporary table, gone since
        out.extend((" ".join(words)[:300], ln) for ln in lines)
    return out


def _tenant_wide(plans: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Plan lines that read a whole view table, or seek one by the tenant alone."""
    bad = []
    for sql, ln in plans:
        m = re.match(r"(SCAN|SEARCH) (\w+)", ln)
        if m is None or m.group(2) not in VIEWS:
            continue
        if m.group(1) == "SCAN" or re.search(r"\(tenant=\?\)$", ln):
            bad.append((sql, ln))
    return bad


@pytest.mark.parametrize("kind", ["key", "prefix", "memory"])
async def test_a_forget_round_seeks_what_it_erases(sqlite_url: str, kind: str) -> None:
    """With many memories of one tenant in every view, the round of one forget (of a
    key, of a namespace prefix, of a memory by id) reads no view by a scan and seeks
    none by the tenant alone; and the forget did erase what it covers."""
    ml = MemoryLedger(sqlite_url)
    await ml.open()
    try:
        users = [ml.principal("shop-a", f"u{i}") for i in range(4)]
        await ml.append([write(
            tenant="shop-a", actor=f"u{i}", namespace=["shop-a", f"u{i}", "preferences",
                                                       f"area{j % 3}"],
            key=f"k{j // 3}", value={"v": f"value {j} of u{i}"},
            source={"kind": "explicit_user_request", "id": f"W{i}-{j}", "at": WRITTEN},
            idempotency_key=f"u{i}-{j}") for i in range(4) for j in range(60)], wait=True)
        p = users[1]
        target = await p.get(["preferences", "area1"], "k1")
        assert target is not None
        target_id = target.memory_id
        path = file_path(sqlite_url)
        assert path is not None
        with statements() as seen:
            if kind == "key":
                await p.forget(["preferences", "area1"], "k1", source=SOURCE)
            elif kind == "prefix":
                await p.forget_all(["preferences", "area1"], source=SOURCE)
            else:
                await p.forget_memory(target_id, source=SOURCE)
        assert await p.get(["preferences", "area1"], "k1") is None
        assert await users[2].get(["preferences", "area1"], "k1") is not None
        db = sqlite3.connect(path)
        try:
            plans = _plans(db, seen)
        finally:
            db.close()
    finally:
        await ml.close()
    touched = {m.group(1) for _, ln in plans if (m := re.match(r"(?:SCAN|SEARCH) (\w+)", ln))}
    assert {"vectors", "mem_history", "mem_versions"} <= touched, touched
    assert _tenant_wide(plans) == []
