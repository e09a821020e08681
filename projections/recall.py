"""Recall: pick the few memories to put before a model turn, and audit the choice.

Pipeline (R15, R19, R26, R27): narrow by principal and layer -> score candidates
(exact key, keyword) -> re-check validity (only active, unexpired, unforgotten rows
are candidates at all) -> overrides (session over task over long-term for a key)
-> rank by relevance, then source reliability, then recency as a tie-breaker only
-> fit the token budget -> write an audit record of ids and scores, never values (R25).
"""

from __future__ import annotations

import hashlib
import math
import uuid
from typing import Any

import orjson

from ledger import schema as t
from ledger.store import Store, now_iso
from projections import reads

#: How much a source is trusted when two memories are equally relevant (R19).
RELIABILITY = {"explicit_user_request": 1.0, "operator": 0.95, "system_of_record": 0.9,
               "user_statement": 0.7, "model_inference": 0.5, "tool_output": 0.3,
               "retrieved_document": 0.3}


def estimate_tokens(text: str) -> int:
    """A conservative token estimate: one per CJK character, one per 4 other characters.

    Tokenisers give CJK text about one token per character, and English about one
    per four characters; counting high keeps a budget from being overrun.
    """
    cjk = sum(1 for c in text if "\u3000" <= c <= "\u9fff" or "\uf900" <= c <= "\ufaff")
    other = len(text) - cjk
    return cjk + math.ceil(other / 4)


def item_tokens(item: dict[str, Any]) -> int:
    """Tokens an item costs in a prompt: its key and value as the app would render them."""
    value = item["value"] if isinstance(item["value"], str) else orjson.dumps(
        item["value"]).decode()
    return estimate_tokens(f"{item['key']}: {value}") + 2


async def recall(store: Store, principal: str, *, query: str | None, session: str | None,
                 task: str | None, budget: int | None, limit: int, now_us: int
                 ) -> dict[str, Any]:
    """Run the recall pipeline for a principal; see the module docstring."""
    who = reads.Principal.parse(principal)
    await store.open()
    async with store.read() as conn:
        rows = await reads.active_memories(conn, who, now_us=now_us, task=task,
                                           session=session)
        open_tasks = await reads.tasks(conn, who)
    best: dict[tuple[str, str], Any] = {}
    for r in rows:
        k = (r.ns_path, r.mkey)
        if k not in best or reads.LAYER_RANK[r.layer] < reads.LAYER_RANK[best[k].layer]:
            best[k] = r  # session overrides task overrides long-term (R8, R27)
    scored: list[tuple[float, float, int, dict[str, Any], str]] = []
    for r in best.values():
        item = reads.memory_item(r)
        rel = RELIABILITY.get(item["source"].get("kind", ""), 0.5)
        if query:
            exact = query.strip().casefold() == r.mkey.casefold()
            score = 1.0 if exact else reads.keyword_score(query, f"{r.mkey} {r.text or ''}")
            reason = "exact key match" if exact else f"keyword match {score:.2f}"
            if score <= 0 and r.layer == "long":
                continue
            if score <= 0:
                reason = f"in current {r.layer}"
        else:
            score = 1.0
            reason = f"active {r.layer} memory in scope"
        scored.append((score, rel, r.position, item, reason))
    scored.sort(key=lambda s: (-s[0], -s[1], -s[2]))
    items: list[dict[str, Any]] = []
    used = 0
    for score, _rel, _pos, item, reason in scored[: max(limit * 4, limit)]:
        if len(items) >= limit:
            break
        cost = item_tokens(item)
        if budget is not None and used + cost > budget:
            continue
        used += cost
        items.append({**item, "score": round(score, 4), "reason": reason, "tokens": cost})
    if task is not None:
        open_tasks = [x for x in open_tasks if x["task_key"] == task]
    audit_id = await _audit(store, who, query, items)
    return {"items": items, "tasks": open_tasks, "audit_id": audit_id,
            "tokens": used, "budget": budget}


async def _audit(store: Store, who: reads.Principal, query: str | None,
                 items: list[dict[str, Any]]) -> str:
    audit_id = uuid.uuid4().hex
    record = [{"memory_id": i["memory_id"], "version": i["version"], "layer": i["layer"],
               "score": i["score"], "reason": i["reason"],
               "source": {k: i["source"].get(k) for k in ("kind", "id", "at")}}
              for i in items]
    async with store.view_write() as conn:
        await conn.execute(t.recall_audit.insert().values(
            audit_id=audit_id, at=now_iso(), tenant=who.tenant,
            principal=f"{who.tenant}/{who.user}",
            query_digest=hashlib.sha256(query.encode()).hexdigest() if query else None,
            items=orjson.dumps(record)))
        if items:
            await conn.execute(t.recall_audit_items.insert(), [
                {"audit_id": audit_id, "tenant": who.tenant, "memory_id": i["memory_id"]}
                for i in items])
    return audit_id
