"""`backup` writes only where it should (issue 15, finding 7; R21: a backup an operator
can trust, docs/operations.md "Backup path rules").

An existing path is refused unless `--force` (and then only a regular file); a device,
a directory, a symbolic link or a missing directory is refused with one line and no
traceback, and nothing is left behind; the file is written as a 0600 temporary file in
the same directory and renamed into place; a full disk names the backup target, not
the database, and leaves neither the target nor a temporary file.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import pytest

import replay.backup as backup_module
from ledger.errors import BackupError, BackupTargetExists, BackupTargetRefused
from ledger.store import Store
from ledger.validation import parse_event
from replay.backup import BackupReader, backup
from tests.cli import Cli
from tests.factories import write


async def _load(store: Store, n: int = 40) -> None:
    await store.append([parse_event(write(f"k{i}", "v" * 200, idem=f"p{i}"))
                        for i in range(n)])


def _one_line_error(proc: subprocess.CompletedProcess[bytes]) -> str:
    err = proc.stderr.decode()
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".partial"))


async def test_new_path_is_written_0600_and_an_existing_one_needs_force(
        store: Store, tmp_path: Path) -> None:
    """Both backends: a new path gets a 0600 file; the same path again is refused and
    unchanged; with force it is replaced by a complete backup."""
    await _load(store)
    target = tmp_path / "ledger.backup"
    first = await backup(store, target, progress=None)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert first["bytes"] == target.stat().st_size
    before = target.read_bytes()
    await _load(store, 45)
    with pytest.raises(BackupTargetExists, match=r"already exists.*force=True"):
        await backup(store, target)
    assert target.read_bytes() == before
    second = await backup(store, target, force=True)
    assert second["position"] > first["position"]
    assert BackupReader(target).check()["position"] == second["position"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _leftovers(tmp_path) == []


async def test_special_files_directories_and_missing_directories_are_refused(
        store: Store, tmp_path: Path) -> None:
    """Even with force: a device, a directory, a symlink (to a regular file) and a path
    in a missing directory are refused, and the device and the link's file survive."""
    await _load(store, 5)
    aside = tmp_path / "aside"
    aside.write_bytes(b"keep me")
    link = tmp_path / "link.backup"
    link.symlink_to(aside)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases: list[tuple[Path, str]] = [
        (Path("/dev/null"), "character device"), (tmp_path, "a directory"),
        (link, "symbolic link"), (fifo, "named pipe"),
        (tmp_path / "missing" / "x.backup", "does not exist")]
    for path, why in cases:
        for force in (False, True):
            with pytest.raises(BackupTargetRefused, match=why):
                await backup(store, path, force=force)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert link.is_symlink() and aside.read_bytes() == b"keep me"
    assert not (tmp_path / "missing").exists()
    assert _leftovers(tmp_path) == []


class _FillsUp:
    """A file that takes `room` bytes and then fails like a full disk."""

    def __init__(self, raw: BinaryIO, room: int) -> None:
        self.raw, self.room = raw, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.raw.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


async def test_a_full_disk_names_the_backup_target_not_the_database(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC injected at the writer: before the fix it passed through the database's
    read transaction and came out as "ledger database unavailable"."""
    await _load(store)
    real = backup_module._temp_file

    def temp_file(target: Path) -> tuple[Path, BinaryIO]:
        path, raw = real(target)
        return path, _FillsUp(raw, 2000)  # type: ignore[return-value]

    monkeypatch.setattr(backup_module, "_temp_file", temp_file)
    target = tmp_path / "full.backup"
    with pytest.raises(BackupError, match=f"cannot write backup {target}: no space left"):
        await backup(store, target)
    assert not target.exists()
    assert _leftovers(tmp_path) == []


def test_cli_paths_force_and_a_real_full_tmpfs(sqlite_url: str, register_path: str,
                                               tmp_path: Path) -> None:
    """Through the CLI: one line on stderr, exit 1, for each refusal; `--force`
    replaces; a 64 KiB tmpfs (mounted here: root only) fills up naming the target."""
    cli = Cli(sqlite_url, register_path)
    events = b"\n".join(orjson.dumps(write(f"k{i}", "x" * 300, idem=f"c{i}"))
                        for i in range(300)) + b"\n"
    cli.run("append", "-", stdin=events)
    target = tmp_path / "b.backup"
    cli.json("backup", str(target), "--quiet")
    line = _one_line_error(cli.run("backup", str(target), "--quiet", check=1))
    assert line == f"error: backup target {target} already exists; choose a new path, " \
                   "or pass --force to replace it"
    assert cli.json("backup", str(target), "--quiet", "--force")["path"] == str(target)
    for path in ("/dev/full", str(tmp_path), str(tmp_path / "nowhere" / "b.backup")):
        line = _one_line_error(cli.run("backup", path, "--quiet", "--force", check=1))
        assert line.startswith(f"error: backup target {path}")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)

    small = tmp_path / "small"
    small.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a tiny tmpfs needs root and mount(8); ENOSPC is covered by injection")
    tag = uuid.uuid4().hex[:6]
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k",
                              f"memledger-{tag}", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        full = small / "b.backup"
        line = _one_line_error(cli.run("backup", str(full), "--quiet", check=1))
        assert line.startswith(f"error: cannot write backup {full}: no space left"), line
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
