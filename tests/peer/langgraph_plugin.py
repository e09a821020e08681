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
        nid = _base(item.nodeid)
        if any(nid.endswith(k) for k in DESELECT):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
