"""The HTTP API of memledger (`memledger serve`, docs/http.md).

Needs the `server` extra (`pip install 'memledger[server]'`: FastAPI and uvicorn).
`create_app(Settings(...))` is the ASGI app; the routes are a thin adapter over the SDK.
"""

from __future__ import annotations

from memledger.server.app import Settings, create_app

__all__ = ["Settings", "create_app"]
