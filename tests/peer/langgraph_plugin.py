"""A pytest plugin that runs LangGraph's own store tests against `MemledgerStore`.

Loaded by `tests/peer/run_langgraph.py` (`make test-langgraph`), never by the main
suite. It rebinds the store classes the test modules imported (`InMemoryStore`,
`SqliteStore`, `AsyncSqliteStore`) to memledger's adapter before the tests run, and
deselects the tests that inspect LangGraph internals (listed with their reasons in
docs/langgraph.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from memledger.langgraph import AsyncMemledgerStore, MemledgerStore

REBIND = {
    "InMemoryStore": MemledgerStore,
    "SqliteStore": MemledgerStore,
    "AsyncSqliteStore": AsyncMemledgerStore,
}

#: test id (file::name, parameters stripped) -> why it does not apply to another store.
DESELECT: dict[str, str] = {
    # LangGraph internals
    "test_store.py::test_vector_store_initialization":
        "reads SqliteStore's sqlite3 connection (`store.conn`) and its vec tables",
    "test_store.py::test_nonnull_migrations": "runs SqliteStore.MIGRATIONS (its SQL schema)",
    # memledger's rules, by design (docs/langgraph.md, "What differs")
    "langgraph_checkpoint_sqlite-3.1.2/tests/test_store.py::test_sql_injection_vulnerability":
        "stores {'password': ...}: memledger refuses secrets in values (R23)",
}


def _base(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    rebound: set[Any] = set()
    for item in items:
        mod = getattr(item, "module", None)
        if mod is not None and mod not in rebound:
            rebound.add(mod)
            for name, cls in REBIND.items():
                if name in vars(mod):
                    setattr(mod, name, cls)
        nid = f"{item.path.parent.parent.name}/{_base(item.nodeid)}"
        if any(nid.endswith(k) for k in DESELECT):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
