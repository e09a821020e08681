"""A projection runner killed mid-batch resumes from its checkpoint: exactly-once effect."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections.runner import Runner
from tests.factories import src, write
from tests.helpers import dump_views, fresh_replay


async def checkpoint(store: Store, name: str = "memories") -> int:
    async with store.read() as conn:
        return int((await conn.execute(select(t.checkpoints.c.position).where(
            t.checkpoints.c.name == name))).scalar() or 0)


@pytest.mark.slow
async def test_sigkill_mid_batch_then_resume(sqlite_url: str, register_path: str,
                                             tmp_path: Path) -> None:
    """SIGKILL the runner in the middle of a large backlog; after a restart the views
    equal a fresh rebuild (no event lost, none applied twice)."""
    store = Store(sqlite_url, register_path=register_path)
    await store.open()
    n = 8_000
    for b in range(n // 1000):
        await store.append([parse_event(write(
            f"k{i % 300}", i, user=f"u{i % 50}", idem=f"e{b}-{i}",
            source=src(at=f"2026-09-20T10:{(i // 60) % 60:02d}:{i % 60:02d}+08:00")))
            for i in range(b * 1000, (b + 1) * 1000)])
    env = {**os.environ, "MEMLEDGER_LOG_LEVEL": "WARNING"}
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("memledger")), "--db", sqlite_url,
        "--forget-register", register_path, "project", "--batch-size", "200", env=env)
    try:
        for _ in range(600):
            if 0 < await checkpoint(store) < n:
                break
            await asyncio.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        await asyncio.wait_for(proc.wait(), 30)
    killed_at = await checkpoint(store)
    assert killed_at < n, "the runner finished before it could be killed"
    await Runner(store).catch_up()
    assert await checkpoint(store) == n
    fresh = await fresh_replay(store, tmp_path)
    try:
        assert await dump_views(store) == await dump_views(fresh)
    finally:
        await fresh.close()
        await store.close()
