"""`memledger append FILE` shares transactions between lines, yet answers each line alone.

A chunk of lines is appended as one request; when the ledger refuses it, each line is
appended on its own, so a rejected line (invalid, an idempotency key reused with other
content, a task the user does not own) never blocks the others, and duplicates (R11)
report the first position. Run in-process with chunks of 2 lines so answers cross
chunk boundaries.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson
import pytest

from memledger.cli import app
from tests.factories import event, src, write


def _lines() -> list[bytes]:
    first = write("lang", "English", idem="k1")
    return [orjson.dumps(x) for x in (
        first,
        write("seat", "window", idem="k2"),
        write("lang", "Chinese", idem="k1"),              # key reused, other content
        event("task.noted", {"task_key": "T404", "kind": "user_report", "text": "hi"}),
        write("meal", "veg", idem="k3"),
        first,                                           # the same event again
    )] + [b'{"not": "an event"}', orjson.dumps(write("tone", "brief", idem="k4",
                                                     source=src(at="2026-09-21T10:00:00Z")))]


@pytest.mark.parametrize("chunk", [2, 1000])
async def test_each_line_gets_its_own_answer_across_shared_transactions(
        db_url: str, tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Appended, rejected and duplicate lines are answered in line order with the same
    positions whether the lines share a transaction or not; the exit status is 1."""
    monkeypatch.setattr(app, "APPEND_CHUNK", chunk)
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"\n".join(_lines()) + b"\n")
    args = argparse.Namespace(db=db_url, forget_register=str(tmp_path / "f"),
                              file=str(path))
    assert await app.cmd_append(args) == 1
    got = [orjson.loads(x) for x in capfd.readouterr().out.splitlines()]
    assert [(o["line"], o["status"], o["position"]) for o in got] == [
        (1, "appended", 1), (2, "appended", 2), (3, "rejected", None),
        (4, "rejected", None), (5, "appended", 3), (6, "duplicate", 1),
        (7, "rejected", None), (8, "appended", 4)]
    assert "k1" in got[2]["error"] and "T404" in got[3]["error"]
