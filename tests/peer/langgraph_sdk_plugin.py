"""A pytest plugin that runs langgraph-sdk's own store tests against `memledger serve`.

Loaded by `tests/peer/run_langgraph_sdk.py` (`make test-langgraph`), never by the main
suite. The suite's fixtures (`tests/integration/conftest.py`) build bare httpx clients,
because its reference server runs without auth; `memledger serve` needs a key. This
plugin rebinds the `httpx` that conftest module imported so that its clients carry the
headers `langgraph_sdk.get_client` would send: the SDK's own `_get_headers`, which reads
`LANGGRAPH_API_KEY` (the runner sets it to a principal's key) into `x-api-key`. The test
files themselves run unchanged; nothing is deselected (docs/langgraph.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from langgraph_sdk._shared.utilities import NOT_PROVIDED, _get_headers

CONFTEST = Path("tests") / "integration" / "conftest.py"


class KeyedHttpx:
    """The `httpx` module, but its clients send what `get_client(...)` sends."""

    def __init__(self, headers: dict[str, str]) -> None:
        self._headers = headers

    def __getattr__(self, name: str) -> Any:
        return getattr(httpx, name)

    def AsyncClient(self, *args: Any, **kwargs: Any) -> httpx.AsyncClient:
        kwargs["headers"] = {**self._headers, **(kwargs.get("headers") or {})}
        return httpx.AsyncClient(*args, **kwargs)

    def Client(self, *args: Any, **kwargs: Any) -> httpx.Client:
        kwargs["headers"] = {**self._headers, **(kwargs.get("headers") or {})}
        return httpx.Client(*args, **kwargs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    headers = _get_headers(NOT_PROVIDED, None)
    if "x-api-key" not in headers:
        raise pytest.UsageError("set LANGGRAPH_API_KEY to a principal's key of the server")
    rebound = 0
    for plugin in config.pluginmanager.get_plugins():
        if str(getattr(plugin, "__file__", "")).endswith(str(CONFTEST)):
            plugin.httpx = KeyedHttpx(headers)
            rebound += 1
    if not rebound:
        raise pytest.UsageError(f"no {CONFTEST} was loaded: is this the langgraph-sdk tree?")
