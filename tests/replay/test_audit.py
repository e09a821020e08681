"""`replay audit`: the history of a key, a memory or a task, with redaction, resulting
versions and statuses, and the recalls that used a memory, never values (R7, R20, R25)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger.errors import ValidationError
from ledger.store import Store
from projections.recall import recall
from replay.audit import audit, audit_record
from tests.cli import Cli
from tests.replay.test_verify import NS7, SECRET, TASK_SECRET, load, story

NOW = 1_900_000_000_000_000


async def test_audit_key_history_with_versions_and_redaction(store: Store) -> None:
    """By namespace and key: both versions with position, actor, source and content, the
    old one superseded; a forgotten key shows its write redacted and the forget."""
    await load(store)
    res = await audit(store, namespace=NS7, key="lang")
    writes = [e for e in res["events"] if e["type"].startswith("memory.")]
    assert [(e["position"], e["type"], e.get("version"), e.get("status")) for e in writes] == [
        (1, "memory.written", 1, "superseded"), (3, "memory.corrected", 2, "active")]
    first = writes[0]
    assert first["actor"] == "u7" and first["source"]["kind"] == "explicit_user_request"
    assert first["source"]["id"] == "C17" and first["recorded_at"]
    assert first["content"]["value"] == "Simplified Chinese"
    assert first["superseded_by"] == "L2"

    gone = await audit(store, namespace=NS7, key="addr")
    [w, f] = gone["events"]
    assert w["redacted"] is True and "content" not in w and w["status"] == "forgotten"
    assert w["forgotten_by"] == f["position"] and f["type"] == "memory.forgotten"
    assert SECRET not in repr(gone)


async def test_audit_memory_id_and_recalls(store: Store) -> None:
    """By memory id: its events (written, confirmed) and every recall that used it, with
    audit id, time, principal, score and reason, never the value (R25)."""
    await load(store)
    used = await recall(store, "shop-a/u7", query="food", session=None, task=None,
                        budget=None, limit=10, now_us=NOW)
    assert "C1" in [i["memory_id"] for i in used["items"]]
    res = await audit(store, memory_id="C1")
    assert [e["type"] for e in res["events"]] == ["memory.written", "memory.confirmed"]
    assert res["events"][0]["status"] == "active"
    [rc] = res["recalls"]
    assert rc["audit_id"] == used["audit_id"] and rc["principal"] == "shop-a/u7"
    assert {"at", "score", "reason", "version"} <= set(rc)
    record = await audit_record(store, used["audit_id"])
    assert record["principal"] == "shop-a/u7"
    assert "noodles" not in repr(record) and "noodles" not in repr(rc)


async def test_audit_task_with_purge(store: Store) -> None:
    """By task: a purged task's events are listed, their content redacted, the purge
    shown, the task reported purged (R6, R28)."""
    await load(store)
    res = await audit(store, task="T950", tenant="shop-a")
    assert [e["type"] for e in res["events"]] == ["task.opened", "task.closed", "task.purged"]
    assert all(e.get("redacted") for e in res["events"][:2])
    assert res["tasks"] == [{"tenant": "shop-a", "task_key": "T950", "status": "closed",
                             "purged": True}]
    assert TASK_SECRET not in repr(res)
    live = await audit(store, task="T900")
    assert [e["content"]["kind"] for e in live["events"][1:]] == ["user_report",
                                                                 "system_status"]


async def test_audit_needs_one_subject(store: Store) -> None:
    """Exactly one subject: a key without a namespace is rejected."""
    with pytest.raises(ValidationError):
        await audit(store, key="lang")
    with pytest.raises(ValidationError):
        await audit(store, memory_id="L1", task="T900")


def test_audit_cli(db_url: str, tmp_path: Path) -> None:
    """`memledger replay audit` prints the history; usage errors exit 2."""
    cli = Cli(db_url, str(tmp_path / "l.forgets"))
    cli.append(story())
    cli.run("project")
    res = cli.json("replay", "audit", "--namespace", "shop-a/u7/preferences", "--key", "lang")
    assert [e["position"] for e in res["events"]] == [1, 3]
    cli.run("replay", "audit", "--namespace", "shop-a/u7/preferences", check=2)
    cli.run("replay", "audit", check=2)
    err = cli.json("replay", "audit", "--audit-id", "nope", check=1)
    assert "no recall audit record" in err["error"]
