"""The running example of docs/requirements.md, end to end through the CLI
(R1-R13, R24, R27, R29).

C17 (2026-09-20): u7 reports the left earbud of order A123, the after-sales system opens
T900 "awaiting inspection", u7 asks for Simplified Chinese from now on. C18 (09-22): a new
conversation finds T900 through u7's open tasks, the status is re-queried ("inspecting"),
u7 corrects to the right earbud, a model's wrong summary is stopped. Seed 001: user-417
prefers Java (M18), then Python (M31, version 2); "Java this time" stays in its task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cli import Cli
from tests.factories import event, src, write

C17 = "2026-09-20T10:00:00+08:00"
C18 = "2026-09-22T09:00:00+08:00"
AFTERSALES = {"actor": "aftersales"}


def sor(at: str, seq: int = 0) -> dict[str, Any]:
    return src("system_of_record", "aftersales", at, seq)


def u7(at: str, sid: str, seq: int, kind: str = "explicit_user_request") -> dict[str, Any]:
    return src(kind, sid, at, seq)


@pytest.fixture
def cli(db_url: str, tmp_path: Path) -> Cli:
    return Cli(db_url, str(tmp_path / "story.forgets"))


def test_after_sales_story(cli: Cli) -> None:
    """C17 -> C18 as the sources tell it: every check of R29 holds on this backend."""
    c17 = [
        event("task.opened", {"task_key": "T900", "namespace": ["shop-a", "u7", "tickets"],
                              "refs": {"order": "A123"}, "title": "earbud inspection"},
              **AFTERSALES, source=sor(C17), idem="as-T900-open"),
        event("task.noted", {"task_key": "T900", "kind": "user_report",
                             "text": "the left earbud of order A123 crackles"},
              source=u7(C17, "C17", 1, "user_statement"), idem="C17-1"),
        event("task.noted", {"task_key": "T900", "kind": "system_status",
                             "text": "awaiting inspection",
                             "fields": {"status": "awaiting inspection"}},
              **AFTERSALES, source=sor(C17, 1), idem="as-T900-1"),
        write("reply_language", "Simplified Chinese", idem="C17-2", source=u7(C17, "C17", 2),
              memory_id="L1"),
    ]
    assert [r["status"] for r in cli.append(c17)] == ["appended"] * 4
    cli.run("project")

    # C18: "how is that ticket going?" -> u7's one open task, never a guess (R4).
    tasks = cli.json("tasks", "--as", "shop-a/u7")["tasks"]
    assert [x["task_key"] for x in tasks] == ["T900"]
    assert tasks[0]["refs"] == {"order": "A123"}

    c18 = [
        event("task.noted", {"task_key": "T900", "kind": "system_status", "text": "inspecting",
                             "fields": {"status": "inspecting"}},
              **AFTERSALES, source=sor(C18), idem="as-T900-2"),
        event("task.noted", {"task_key": "T900", "kind": "correction",
                             "text": "I said it wrong, it is the right earbud",
                             "fields": {"side": "right"}},
              source=u7(C18, "C18", 3), idem="C18-3"),
        event("task.noted", {"task_key": "T900", "kind": "user_report",
                             "text": "inspection confirmed the fault",
                             "fields": {"status": "fault confirmed"}},
              source=u7(C18, "C18", 4, "model_inference"), idem="C18-4"),
        write("reply_language", "English", idem="C18-5", source=u7(C18, "C18", 5),
              etype="memory.corrected", supersedes="L1"),
    ]
    assert [r["status"] for r in cli.append(c18)] == ["appended"] * 4
    # A model may not state a system fact (R3, R29): rejected, the rest unaffected.
    bad = cli.append([event("task.noted", {"task_key": "T900", "kind": "system_status",
                                           "text": "fault confirmed"},
                            source=u7(C18, "C18", 6, "model_inference"))], check=1)
    assert bad[0]["status"] == "rejected"
    assert "system_of_record" in bad[0]["error"]
    cli.run("project")

    (t900,) = cli.json("tasks", "--as", "shop-a/u7")["tasks"]
    assert t900["system"]["status"] == "inspecting"
    assert t900["system"]["as_of"] == C18
    assert t900["reports"][0]["text"] == "the left earbud of order A123 crackles"
    assert t900["corrections"][0]["text"] == "I said it wrong, it is the right earbud"
    assert t900["corrections"][0]["pending"] is True  # not confirmed by the system (R5)
    assert t900["conflicts"][0]["claimed"] == "fault confirmed"  # flagged, not merged (R30)

    lang = cli.json("get", "--as", "shop-a/u7", "--namespace", "shop-a/u7/preferences",
                    "--key", "reply_language")
    assert (lang["value"], lang["version"], lang["status"]) == ("English", 2, "active")

    # Seed 001: Java (M18) -> Python (M31, version 2); "Java this time" in its task only.
    ns417 = ["shop-a", "user-417", "preferences"]
    seed = [
        write("code_language", "Java", user="user-417", ns=ns417, memory_id="M18",
              source=src(at="2026-06-01T10:00:00+08:00"), idem="U18"),
        write("code_language", "Python", user="user-417", ns=ns417, memory_id="M31",
              supersedes="M18", etype="memory.corrected",
              source=src(at="2026-08-01T10:00:00+08:00"), idem="U31"),
        write("code_language", "Java", user="user-417", ns=ns417, layer="task",
              task_key="Q42", source=src(at="2026-09-01T10:00:00+08:00"), idem="U40"),
    ]
    cli.append(seed)
    cli.run("project")
    args = ["get", "--as", "shop-a/user-417", "--namespace", "shop-a/user-417/preferences",
            "--key", "code_language"]
    default = cli.json(*args)
    assert (default["memory_id"], default["value"], default["version"]) == ("M31", "Python", 2)
    assert cli.json(*args, "--task", "Q42")["value"] == "Java"

    # Another account and another tenant read nothing (R24).
    assert cli.json("tasks", "--as", "shop-a/u8") == {"tasks": []}
    assert cli.json("get", "--as", "shop-a/u8", "--namespace", "shop-a/u7/preferences",
                    "--key", "reply_language") == {"found": False}
    assert cli.json("get", "--as", "shop-b/u7", "--namespace", "shop-a/u7/preferences",
                    "--key", "reply_language") == {"found": False}
    assert cli.json("recall", "--as", "shop-a/u8", "--query", "reply language")["items"] == []

    # Closed: never recalled as open (R6).
    cli.append([event("task.closed", {"task_key": "T900", "resolution": "replaced"},
                      **AFTERSALES, source=sor("2026-09-30T10:00:00+08:00"))])
    cli.run("project")
    assert cli.json("tasks", "--as", "shop-a/u7") == {"tasks": []}
    closed = cli.json("tasks", "--as", "shop-a/u7", "--all")["tasks"]
    assert [(x["task_key"], x["status"]) for x in closed] == [("T900", "closed")]
    status = cli.json("status")
    assert all(p["lag"] == 0 for p in status["projections"].values())


def test_append_reports_every_line(cli: Cli) -> None:
    """append prints a result per non-blank line, commits valid lines, exits 1 on rejects."""
    good = write("reply_language", "Simplified Chinese", idem="k1")
    import orjson
    data = b"\n".join([orjson.dumps(good), b"", b"{broken", orjson.dumps(good),
                       orjson.dumps(write("card", "4111 1111 1111 1111"))]) + b"\n"
    lines = cli.lines("append", "-", stdin=data, check=1)
    assert [(x["line"], x["status"]) for x in lines] == [
        (1, "appended"), (3, "rejected"), (4, "duplicate"), (5, "rejected")]
    assert "4111" not in lines[3]["error"]
    assert cli.json("status")["head"] == 1


def test_usage_error_exits_2(cli: Cli) -> None:
    """A usage error exits 2 and prints usage on stderr."""
    proc = cli.run("get", "--as", "shop-a/u7", check=2)
    assert b"usage" in proc.stderr
