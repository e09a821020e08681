"""A small agent-app loop that uses memledger the way a real backend would.

No model is called: the conversation is scripted. Two styles:
- in process (default): the app appends and waits until the write is projected;
- `--publish`: the app publishes events to the broker and worker daemons ingest them
  (needs Redis and a running `memledger worker`).

Run: `.venv/bin/python examples/agent_app.py [--db URL] [--publish]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path

import memledger
from memledger import Source

TENANT, USER = "shop-a", "u7"  # from the app's login, never from chat text
PREFS = ["preferences"]  # below the user: the ledger stores [TENANT, USER, "preferences"]


def build_prompt(recalled: memledger.Recall, user_turn: str) -> str:
    """What the app would send to a model: recalled memories, then the user's turn."""
    lines = [f"- {i.key}: {i.value} ({i.memory.layer}, v{i.memory.version})"
             for i in recalled.items]
    return "Known about the user:\n" + "\n".join(lines) + f"\nUser: {user_turn}"


async def in_process(db_url: str) -> list[str]:
    """The conversation with in-process writes; returns the prompts it built."""
    prompts = []
    conv = f"C-{uuid.uuid4().hex[:6]}"
    async with memledger.MemoryLedger(db_url) as ml:
        u7 = ml.principal(TENANT, USER)
        # "From now on always answer me in Simplified Chinese" -> confirm only once durable.
        await u7.remember(PREFS, "reply_language", "Simplified Chinese",
                          source=Source.user_request(conv, seq=1))
        print("app: saved your reply language preference")
        recalled = await u7.recall("which language should replies use", budget=200)
        prompts.append(build_prompt(recalled, "how is my ticket going?"))
        # "Forget my language preference."
        await u7.forget(PREFS, "reply_language", source=Source.user_request(conv, seq=2))
        recalled = await u7.recall("which language should replies use")
        prompts.append(build_prompt(recalled, "hello again"))
    return prompts


async def via_workers(redis_url: str | None, db_url: str) -> list[str]:
    """The same conversation, publishing to the workers instead of appending in process."""
    conv = f"C-{uuid.uuid4().hex[:6]}"
    broker = redis_url or os.environ.get("MEMLEDGER_REDIS_URL", "redis://127.0.0.1:6379/0")
    async with memledger.MemoryLedger(db_url, broker=broker) as ml:
        u7 = ml.principal(TENANT, USER)
        await u7.remember(PREFS, "reply_language", "Simplified Chinese",
                          source=Source.user_request(conv, seq=1), wait=False)
        for _ in range(200):  # the worker daemon ingests and projects asynchronously
            if await u7.get(PREFS, "reply_language") is not None:
                break
            await asyncio.sleep(0.05)
        recalled = await u7.recall("reply language")
    return [build_prompt(recalled, "how is my ticket going?")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--db", help="database URL (default: a temporary SQLite file)")
    p.add_argument("--publish", action="store_true", help="publish to the worker daemons")
    p.add_argument("--redis", help="broker URL (default $MEMLEDGER_REDIS_URL)")
    args = p.parse_args()
    db = args.db or f"sqlite+aiosqlite:///{Path(tempfile.mkdtemp()) / 'app.db'}"
    started = time.perf_counter()
    prompts = asyncio.run(via_workers(args.redis, db) if args.publish else in_process(db))
    for prompt in prompts:
        print("---\n" + prompt)
    print(f"--- done in {time.perf_counter() - started:.2f}s")


if __name__ == "__main__":
    main()
