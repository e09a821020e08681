"""Fixtures: one contract suite for every backend, real services or a clear skip.

PostgreSQL tests get a fresh database per test on the local server (dropped after);
Redis tests get a Redis database number of their own per run. Without a server the
tests skip with the reason, except under CI=true, where a missing service fails.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger.logs import configure
from ledger.store import Store

configure("WARNING")

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PG_HOST = os.environ.get("MEMLEDGER_TEST_PG", "postgresql+asyncpg://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("MEMLEDGER_TEST_REDIS", "redis://127.0.0.1:6379")
RUN_ID = uuid.uuid4().hex[:8]


def unavailable(what: str, err: BaseException | str) -> None:
    """Skip on a laptop without the service; fail in CI, where it must be there."""
    msg = f"{what} not reachable ({err}); start it with ../shared/services.sh"
    if CI:
        pytest.fail(msg)
    pytest.skip(msg)


async def _pg_admin(sql: str) -> None:
    import asyncpg

    dsn = PG_HOST.replace("postgresql+asyncpg", "postgresql") + "/postgres"
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    name = f"memledger_t_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    try:
        asyncio.run(_pg_admin(f'CREATE DATABASE "{name}"'))
    except Exception as e:  # noqa: BLE001 - any failure to connect means "no server"
        unavailable("PostgreSQL", e)
    yield f"{PG_HOST}/{name}"
    asyncio.run(_pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite ledger file for one test."""
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The contract suite's backend: every test using it runs on SQLite and PostgreSQL."""
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def register_path(tmp_path: Path) -> str:
    """A forget register file of the test's own."""
    return str(tmp_path / "ledger.forgets")


@pytest.fixture
async def store(db_url: str, register_path: str) -> AsyncIterator[Store]:
    """An opened store on the test's backend."""
    s = Store(db_url, register_path=register_path)
    await s.open()
    yield s
    await s.close()


@pytest.fixture(scope="session")
def redis_db() -> Iterator[str]:
    """A Redis database number of this run's own (flushed before and after)."""
    import redis

    # MEMLEDGER_TEST_REDIS_DB pins the number, so concurrent runs on one server never share one.
    db = int(os.environ.get("MEMLEDGER_TEST_REDIS_DB") or 1 + (int(RUN_ID, 16) % 15))
    # Under pytest-xdist (`make test` runs the suite on several processes) each worker
    # process takes the next number along, so two workers never flush each other's queues.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        db = 1 + (db - 1 + int(worker[2:])) % 15
    url = f"{REDIS_URL}/{db}"
    try:
        client: Any = redis.Redis.from_url(url, socket_connect_timeout=2)
        client.flushdb()
    except Exception as e:  # noqa: BLE001
        unavailable("Redis", e)
    yield url
    client.flushdb()
