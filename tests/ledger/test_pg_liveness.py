"""PostgreSQL without `pool_pre_ping` (issue 20): a pooled connection the server ended is
replaced without a failed request, for reads at once and for writes once the client
has seen the connection close."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from sqlalchemy import text

from ledger.store import Store
from ledger.validation import parse_event
from tests.factories import write

pytestmark = pytest.mark.postgres

_KILL = ("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
         "WHERE application_name = 'memledger' AND datname = current_database() "
         "AND pid <> pg_backend_pid()")


async def _backend_pid(store: Store) -> int:
    async with store.read_once() as conn:
        return int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())


async def _kill_pooled(pg_url: str) -> int:
    conn = await asyncpg.connect(pg_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        return int(await conn.fetchval(_KILL))
    finally:
        await conn.close()


async def test_engine_does_not_ping_on_checkout(pg_url: str, register_path: str) -> None:
    """The pool has no pre-ping round trip (its cost was ~40% of a point read)."""
    store = Store(pg_url, register_path=register_path)
    await store.open()
    try:
        assert store.recorder.engine.sync_engine.pool._pre_ping is False
    finally:
        await store.close()


async def test_read_right_after_the_backend_is_killed_is_retried(pg_url: str,
                                                                register_path: str) -> None:
    """A read issued the instant its pooled connection was terminated (the client has not
    seen the close yet) runs again on a new connection: no error reaches the caller."""
    store = Store(pg_url, register_path=register_path)
    await store.open()
    try:
        before = await _backend_pid(store)
        assert await _kill_pooled(pg_url) >= 1
        after = await _backend_pid(store)  # no pause: the retry, not the checkout, saves it
        assert after != before
        assert await store.head() == 0
    finally:
        await store.close()


async def test_closed_pooled_connections_are_replaced_at_checkout(pg_url: str,
                                                                   register_path: str) -> None:
    """Once the client has seen the server end its pooled connections (a restart), a
    write, which is never retried, still succeeds: checkout swapped the dead ones."""
    store = Store(pg_url, register_path=register_path)
    await store.open()
    try:
        await store.append_one(parse_event(write("a", 1)))
        before = await _backend_pid(store)
        assert await _kill_pooled(pg_url) >= 1
        await asyncio.sleep(0.5)  # the client reads the server's close while idle
        res = await store.append_one(parse_event(write("b", 2)))
        assert res.status == "appended"
        assert await _backend_pid(store) != before
        assert await store.head() == 2
    finally:
        await store.close()
