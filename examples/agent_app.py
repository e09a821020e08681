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
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from memledger import MemoryLedger

TENANT, USER = "shop-a", "u7"  # from the app's login, never from chat text
PRINCIPAL = f"{TENANT}/{USER}"
PREFS = [TENANT, USER, "preferences"]


def now() -> str:
    return datetime.now(UTC).isoformat()


def remember_event(conversation: str, seq: int, key: str, value: Any) -> dict[str, Any]:
    """The event for "from now on ..., remember it" said by the logged-in user."""
    return {"type": "memory.written", "idempotency_key": f"{conversation}-{seq}",
            "tenant": TENANT, "actor": USER,
            "source": {"kind": "explicit_user_request", "id": conversation, "at": now(),
                       "seq": seq},
            "data": {"namespace": PREFS, "key": key, "value": value}}


def forget_event(conversation: str, seq: int, key: str) -> dict[str, Any]:
    """The event for "forget that"."""
    return {"type": "memory.forgotten", "idempotency_key": f"{conversation}-{seq}",
            "tenant": TENANT, "actor": USER,
            "source": {"kind": "explicit_user_request", "id": conversation, "at": now(),
                       "seq": seq},
            "data": {"namespace": PREFS, "key": key}}


def build_prompt(recalled: dict[str, Any], user_turn: str) -> str:
    """What the app would send to a model: recalled memories, then the user's turn."""
    lines = [f"- {i['key']}: {i['value']} ({i['layer']}, v{i['version']})"
             for i in recalled["items"]]
    return "Known about the user:\n" + "\n".join(lines) + f"\nUser: {user_turn}"


async def in_process(db_url: str) -> list[str]:
    """The conversation with in-process writes; returns the prompts it built."""
    prompts = []
    conv = f"C-{uuid.uuid4().hex[:6]}"
    async with MemoryLedger(db_url) as ml:
        # "From now on always answer me in Simplified Chinese" -> confirm only once durable.
        await ml.remember(remember_event(conv, 1, "reply_language", "Simplified Chinese"))
        print("app: saved your reply language preference")
        recalled = await ml.recall(PRINCIPAL, query="which language should replies use",
                                   budget=200)
        prompts.append(build_prompt(recalled, "how is my ticket going?"))
        # "Forget my language preference."
        await ml.remember(forget_event(conv, 2, "reply_language"))
        recalled = await ml.recall(PRINCIPAL, query="which language should replies use")
        prompts.append(build_prompt(recalled, "hello again"))
    return prompts


async def via_workers(redis_url: str | None, db_url: str) -> list[str]:
    """The same conversation, publishing to the workers instead of appending in process."""
    from workers.publish import publish

    conv = f"C-{uuid.uuid4().hex[:6]}"
    publish([remember_event(conv, 1, "reply_language", "Simplified Chinese")],
            redis_url=redis_url)
    async with MemoryLedger(db_url) as ml:
        for _ in range(200):  # the worker daemon ingests and projects asynchronously
            got = await ml.get(PRINCIPAL, PREFS, "reply_language")
            if got["found"]:
                break
            await asyncio.sleep(0.05)
        recalled = await ml.recall(PRINCIPAL, query="reply language")
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
