"""The newcomer's path: `make demo`'s script and the agent-app example run as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
ENV = {**os.environ, "MEMLEDGER_LOG_LEVEL": "ERROR"}


def test_demo_checks_every_step() -> None:
    """`make demo` runs the after-sales story: every step it claims is checked and passes
    (R4-R6, R8, R12, R16, R20, R21, R24, R27, R29, R30)."""
    proc = subprocess.run([PY, "examples/demo.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    steps = re.findall(r"^\s*(\d+)\. ", out, re.M)
    assert [int(s) for s in steps] == list(range(1, 12))
    assert "FAILED" not in out
    assert out.count("    ok: ") >= 18
    assert out.rstrip().endswith("all steps passed")


def test_agent_app_in_process(tmp_path: Path) -> None:
    """The example app remembers, recalls into a prompt, forgets, and the next prompt no
    longer holds the forgotten preference (R16, R20)."""
    db = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    proc = subprocess.run([PY, "examples/agent_app.py", "--db", db], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.split("---\n")[1:3]
    assert "reply_language: Simplified Chinese" in first
    assert "Simplified Chinese" not in second


@pytest.mark.redis
@pytest.mark.slow
def test_agent_app_through_workers(tmp_path: Path, redis_db: str) -> None:
    """The same app in the publish style: a worker daemon ingests and projects its event."""
    db = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    env = {**ENV, "MEMLEDGER_REDIS_URL": redis_db, "MEMLEDGER_DB_URL": db,
           "MEMLEDGER_FORGET_REGISTER": str(tmp_path / "app.forgets")}
    worker = subprocess.Popen([str(Path(PY).with_name("memledger")), "worker",
                               "--processes", "1", "--threads", "2"], env=env)
    try:
        time.sleep(1)
        proc = subprocess.run([PY, "examples/agent_app.py", "--db", db, "--publish",
                               "--redis", redis_db], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        assert "reply_language: Simplified Chinese" in proc.stdout
    finally:
        worker.terminate()
        worker.wait(30)
