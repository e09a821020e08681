"""The command line's shape (docs/operations.md): `memledger --help` lists the commands
by audience, `python -m memledger` is the same CLI, usage errors exit 2; errors below
`memledger/` name no CLI flag while the CLI words them with its flags as before; the
replay functions report progress to a callback and the CLI draws it on stderr; no CLI
code (argparse, stdout, sys.exit, dynamic imports between our packages) below
`memledger/`."""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from ledger.errors import BackupError, RegisterError, ValidationError
from ledger.store import Store
from memledger.cli import app, operator, server, workers
from memledger.cli.common import ProgressLine, error_message
from replay.audit import audit, audit_record
from replay.backup import backup, restore
from replay.errors import DatabaseNotEmpty, RegisterMissing
from replay.progress import ProgressUpdate
from replay.rebuild import rebuild
from tests.cli import BIN, Cli
from tests.factories import write
from tests.replay.test_verify import load, story
from workers.runtime import Settings

ROOT = Path(__file__).resolve().parents[2]
#: The commands of the contract's command line, each listed once.
COMMANDS = {"append", "publish", "project", "worker", "status", "get", "recall", "tasks",
            "replay", "backup", "restore", "sweep", "dead-letters", "serve", "keys", "shards",
            "vault", "history", "db", "config"}


def _run(*args: str, env: dict[str, str] | None = None, module: bool = False,
         stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-m", "memledger"] if module else [str(BIN)]
    return subprocess.run([*cmd, *args], input=stdin, capture_output=True, timeout=120,
                          env={**os.environ, "MEMLEDGER_LOG_LEVEL": "WARNING", **(env or {})})


def _groups(help_text: str) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in help_text.splitlines():
        if re.match(r"^\S.* commands \(.*\):$", line):
            current = groups.setdefault(line[:-1], [])
        elif current is not None and (m := re.match(r"^  (\S+)\s", line)):
            current.append(m.group(1))
        elif not line.strip():
            current = None
    return groups


def test_help_lists_the_commands_by_audience() -> None:
    """`memledger --help` lists every command once, under its audience, in order."""
    proc = _run("--help")
    assert proc.returncode == 0
    groups = _groups(proc.stdout.decode())
    assert list(groups) == [app.TITLE, operator.TITLE, workers.TITLE, server.TITLE]
    assert groups[app.TITLE] == ["append", "publish", "get", "recall", "history", "tasks"]
    assert groups[operator.TITLE] == ["status", "project", "sweep", "replay", "shards",
                                      "config", "db", "backup", "restore", "vault"]
    assert groups[workers.TITLE] == ["worker", "dead-letters"]
    assert groups[server.TITLE] == ["serve", "keys"]
    listed = [c for names in groups.values() for c in names]
    assert sorted(listed) == sorted(COMMANDS)


def test_config_embedder_set_get_show_and_status(tmp_path: Path) -> None:
    """`memledger config set embedder NAME` records the ledger's embedder and rebuilds the
    vector index with it; `config get`, `config show` and `status` show it; an unknown
    name exits 1 and records nothing; `--no-rebuild` names the command to run."""
    cli = Cli(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", str(tmp_path / "c.forgets"),
              env={"MEMLEDGER_EMBEDDER": ""})
    cli.append([write("reply_language", "Simplified Chinese", memory_id="A")])
    cli.run("project")
    got = cli.json("config", "get", "embedder")
    assert (got["name"], got["source"], got["recorded"]) == ("hashgram-v2-512", "default", None)
    bad = cli.run("config", "set", "embedder", "no-such-model", check=1)
    assert b"unknown embedder" in bad.stderr
    res = cli.json("config", "set", "embedder", "hashgram-v1-256", "--quiet")
    assert (res["changed"], res["model"], res["dim"]) == (True, "hashgram-v1-256", 256)
    assert res["rebuild"] is not None
    shown = cli.json("config", "show")["embedder"]
    assert (shown["recorded"], shown["source"], shown["index_models"]) == (
        "hashgram-v1-256", "recorded", {"hashgram-v1-256": 1})
    assert cli.json("status")["embedder"]["name"] == "hashgram-v1-256"
    later = cli.run("config", "set", "embedder", "hashgram", "--no-rebuild")
    assert b"memledger replay rebuild --projection vectors" in later.stderr
    assert cli.json("config", "get", "embedder")["index_current"] is False
    assert cli.run("config", "get", "colour", check=2).returncode == 2


def test_python_dash_m_memledger_is_the_same_cli(tmp_path: Path) -> None:
    """`python -m memledger` prints the same help and runs commands like the script."""
    assert _run("--help", module=True).stdout == _run("--help").stdout
    db = ["--db", f"sqlite+aiosqlite:///{tmp_path / 'l.db'}",
          "--forget-register", str(tmp_path / "l.forgets")]
    appended = _run(*db, "append", "-", module=True,
                    stdin=orjson.dumps(write("lang", "English")) + b"\n")
    assert appended.returncode == 0, appended.stderr
    assert orjson.loads(appended.stdout) == {"line": 1, "status": "appended", "position": 1}
    projected = _run(*db, "project", module=True)
    assert projected.returncode == 0, projected.stderr
    assert orjson.loads(projected.stdout)["head"] == 1


def test_unknown_or_missing_command_is_a_usage_error() -> None:
    """An unknown command, no command, or an unknown replay action exits 2 with usage
    on stderr and nothing on stdout."""
    for args in (["nope"], [], ["replay", "nope"], ["replay"]):
        proc = _run(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stdout == b""
        assert b"usage: memledger" in proc.stderr
    assert b"invalid choice: 'nope'" in _run("nope").stderr


def test_cli_words_errors_with_its_flags(tmp_path: Path) -> None:
    """The CLI's messages name its flags as before, though the library's do not."""
    cli = Cli(f"sqlite+aiosqlite:///{tmp_path / 'l.db'}", str(tmp_path / "l.forgets"))
    cli.append([write("lang", "English")])
    err = cli.json("replay", "audit", "--audit-id", "nope", check=1)["error"]
    assert err == "--audit-id: no recall audit record 'nope'"
    err = cli.json("replay", "audit", "--namespace", "shop-a", "--key", "k", check=1)["error"]
    assert err == "--namespace: needs at least tenant/user"
    err = cli.json("replay", "audit", "--namespace", "shop-a/u7/preferences", "--key", "lang",
                   "--tenant", "shop-b", check=1)["error"]
    assert err == "--tenant: differs from the namespace's tenant"
    bad = cli.run("replay", "rebuild", "--projection", "nope", check=2)
    assert bad.stderr.startswith(b"error: --projection: unknown projection 'nope'; one of ")
    zero = cli.run("worker", "--processes", "0", check=2)
    assert b"error: --processes and --threads must be at least 1" in zero.stderr
    zero = cli.run("project", "--batch-size", "0", check=2)
    assert b"error: --batch-size must be at least 1" in zero.stderr
    env = {k: v for k, v in os.environ.items() if k != "MEMLEDGER_FORGET_REGISTER"}
    memory = subprocess.run([str(BIN), "--db", "sqlite+aiosqlite:///:memory:", "project"],
                            capture_output=True, env=env, timeout=120)
    assert memory.returncode == 1
    assert "(--forget-register PATH)" in orjson.loads(memory.stdout)["error"]


def test_error_wording_keeps_other_fields() -> None:
    """Only the fields a command sets from a flag are renamed: an event's own field
    (`namespace` in an appended line) keeps its name."""
    e = ValidationError("namespace", "must have at least 2 parts")
    assert error_message(e, argparse.Namespace(error_flags={})) == str(e)
    flagged = argparse.Namespace(error_flags={"namespace": "--namespace"})
    assert error_message(e, flagged) == "--namespace: must have at least 2 parts"
    assert error_message(RegisterError("damaged"), flagged) == "damaged"


async def test_library_errors_name_no_cli_flag(store: Store, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """replay, workers and the register word their errors in their own parameters."""
    await load(store)
    raised: list[Exception] = []
    for call in (audit_record(store, "nope"), audit(store, namespace=["shop-a"], key="k"),
                 audit(store, memory_id="m", task="t"), rebuild(store, ["nope"])):
        with pytest.raises(ValidationError) as err:
            await call
        raised.append(err.value)
    assert [e.field for e in raised] == ["audit_id", "namespace", "audit", "projection"]
    await backup(store, tmp_path / "b.jsonl")
    with pytest.raises(DatabaseNotEmpty) as full:
        await restore(store, tmp_path / "b.jsonl")
    assert "force=True" in str(full.value)
    empty = Store(f"sqlite+aiosqlite:///{tmp_path / 'new.db'}",
                  register_path=str(tmp_path / "none.forgets"))
    try:
        with pytest.raises(RegisterMissing) as missing:
            await restore(empty, tmp_path / "b.jsonl")
    finally:
        await empty.close()
    assert "without_register=True" in str(missing.value)
    assert isinstance(missing.value, BackupError)
    raised += [full.value, missing.value]
    with pytest.raises(ValueError, match="processes") as settings:
        Settings(redis_url="redis://x", processes=0)
    monkeypatch.delenv("MEMLEDGER_FORGET_REGISTER", raising=False)
    with pytest.raises(RegisterError) as memory:
        Store("sqlite+aiosqlite:///:memory:")
    raised += [settings.value, memory.value]
    for e in raised:
        assert not re.search(r"--[a-z]", str(e)), e


async def test_progress_is_reported_to_the_callback(store: Store, tmp_path: Path) -> None:
    """rebuild, backup and restore tell the callback every step and the end of each
    phase; without one they report nothing."""
    await load(store)
    updates: list[ProgressUpdate] = []
    await rebuild(store, progress=updates.append, bulk=False)
    assert {u.label for u in updates} == {"rebuild"}
    assert [u.final for u in updates].count(True) == 1 and updates[-1].final
    assert updates[-1].done == updates[-1].total > 0
    dones = [u.done for u in updates]
    assert dones == sorted(dones)
    updates.clear()
    made = await backup(store, tmp_path / "b.jsonl", progress=updates.append)
    assert updates[-1].label == "backup" and updates[-1].final
    assert updates[-1].done == updates[-1].total == sum(made["counts"].values())
    updates.clear()
    await restore(store, tmp_path / "b.jsonl", force=True, progress=updates.append)
    assert [u.label for u in updates if u.final] == ["restore", "rebuild"]
    assert (await rebuild(store, progress=None))["head"] == len(story())


def test_progress_line_on_a_captured_stream() -> None:
    """Captured (no terminal), the line is written at a phase's first step, at most every
    few seconds after, and at its end; a new phase starts with a line of its own."""
    stream = io.StringIO()
    line = ProgressLine(stream)
    line(ProgressUpdate("rebuild", 50, 200, "events", 2.0))
    line(ProgressUpdate("rebuild", 100, 200, "events", 2.5))
    line(ProgressUpdate("rebuild", 200, 200, "events", 4.0, final=True))
    line(ProgressUpdate("backup", 10, 20, "rows", 1.0))
    assert stream.getvalue().splitlines() == [
        "rebuild: 50/200 events ( 25.0%), 25 events/s, ETA 0:00:06",
        "rebuild: 200 events in 0:00:04 (50 events/s)",
        "backup: 10/20 rows ( 50.0%), 10 rows/s, ETA 0:00:01",
    ]


def _modules(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_no_cli_code_below_memledger() -> None:
    """ledger, projections, replay and workers use no argparse, print nothing, write no
    stdout and never exit the process; nothing imports between our packages by name."""
    ours = ("memledger", "ledger", "projections", "workers", "replay")
    found = []
    for path in _modules(*ours):
        own = path.relative_to(ROOT).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in ("import_module", "__import__") and node.args and \
                        isinstance(node.args[0], ast.Constant) and \
                        str(node.args[0].value).split(".")[0] in set(ours) - {own}:
                    found.append(f"{where} dynamic import of {node.args[0].value}")
            if own == "memledger":
                continue
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                if "argparse" in names:
                    found.append(f"{where} imports argparse")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "print":
                found.append(f"{where} prints")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "sys" and node.attr in ("exit", "stdout"):
                found.append(f"{where} uses sys.{node.attr}")
    assert found == []
