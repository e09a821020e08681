"""`replay verify` runs the backend's integrity check; a damaged database is one clear
error in every command (issue 15, finding 5; R20, R21: verify is what an operator trusts
before and after a restore).

A real SQLite ledger file has bytes written over the root pages of its indexes (found
through `sqlite_master.rootpage` and the page size): verify fails naming the integrity
check, and `get`, `recall`, `replay audit` and `append` each exit 1 with one line on
stderr, no traceback. On PostgreSQL verify runs amcheck, and says so when this role may
not run it, without failing.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import uuid
from pathlib import Path

import orjson
import pytest

from ledger.errors import DatabaseCorrupt, IntegrityError, StoreUnavailable
from ledger.store import Store
from ledger.validation import parse_event
from projections.runner import Runner
from replay.verify import verify
from tests.cli import Cli
from tests.conftest import PG_HOST, _pg_admin
from tests.factories import write

NS = "shop-a/u7/preferences"


async def _build(url: str, register: str, n: int = 300) -> None:
    """A ledger of `n` writes, projected, in a real database."""
    store = Store(url, register_path=register)
    try:
        await store.append([parse_event(write(f"k{i}", "v" * 40, idem=f"i{i}"))
                            for i in range(n)])
        await Runner(store).catch_up()
    finally:
        await store.close()


def _corrupt_indexes(db: Path, tables: tuple[str, ...]) -> list[int]:
    """Overwrite the second half of the root page of every index on `tables`."""
    con = sqlite3.connect(db)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = int(con.execute("PRAGMA page_size").fetchone()[0])
        marks = ",".join("?" for _ in tables)
        roots = [int(r[0]) for r in con.execute(
            f"SELECT rootpage FROM sqlite_master WHERE type = 'index' AND tbl_name IN ({marks})",
            tables)]
    finally:
        con.close()
    with db.open("r+b") as f:
        for root in roots:
            f.seek((root - 1) * page + page // 2)
            f.write(b"\xa5" * (page // 2))
    return roots


def _one_clear_line(proc: subprocess.CompletedProcess[bytes]) -> str:
    err = proc.stderr.decode()
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert "ledger database is damaged" in lines[0], err
    assert "database disk image is malformed" in lines[0], err
    return lines[0]


def test_verify_fails_on_a_corrupt_index_page_and_every_command_says_so(
        tmp_path: Path) -> None:
    """Before the fix verify said `ok: true` and audit died with a traceback."""
    db = tmp_path / "ledger.db"
    register = str(tmp_path / "ledger.forgets")
    url = f"sqlite+aiosqlite:///{db}"
    asyncio.run(_build(url, register))
    cli = Cli(url, register)
    assert cli.json("replay", "verify")["integrity"] == {
        "check": "sqlite quick_check, integrity_check", "available": True, "ok": True}

    assert _corrupt_indexes(db, ("events", "mem_versions"))
    ver = cli.run("replay", "verify", check=1)
    res = orjson.loads(ver.stdout)
    assert res["ok"] is False
    assert res["integrity"]["ok"] is False
    assert {p["check"] for p in res["problems"]} == {"integrity"}
    assert all(p["detail"].startswith("sqlite quick_check, integrity_check: ")
               for p in res["problems"])
    assert "skipped" in res

    for args in (("replay", "audit", "--namespace", NS, "--key", "k5"),
                 ("get", "--as", "shop-a/u7", "--namespace", NS, "--key", "k5"),
                 ("recall", "--as", "shop-a/u7", "--query", "v")):
        proc = cli.run(*args, check=1)
        _one_clear_line(proc)
        assert orjson.loads(proc.stdout)["error"].startswith("the ledger database is damaged")

    app = cli.run("append", "-", check=1,
                  stdin=orjson.dumps(write("k1", "new", idem="after-damage")) + b"\n")
    line = orjson.loads(app.stdout.splitlines()[0])
    assert line["status"] == "rejected"
    assert "ledger database is damaged" in line["error"]
    assert "Traceback" not in app.stderr.decode()


def test_a_file_that_is_not_a_database_is_one_clear_error(tmp_path: Path) -> None:
    """`file is not a database` (SQLITE_NOTADB) is translated too, and verify reports it."""
    db = tmp_path / "ledger.db"
    db.write_bytes(b"not a sqlite file at all, " * 400)
    register = str(tmp_path / "ledger.forgets")
    cli = Cli(f"sqlite+aiosqlite:///{db}", register)
    proc = cli.run("status", check=1)
    err = proc.stderr.decode()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "ledger database is damaged (file is not a database)" in err
    res = orjson.loads(cli.run("replay", "verify", check=1).stdout)
    assert res["problems"][0]["check"] == "integrity"
    assert "file is not a database" in res["problems"][0]["detail"]


async def test_damage_is_a_database_corrupt_error_not_a_driver_error(tmp_path: Path) -> None:
    """At the library boundary: `DatabaseCorrupt` (an `IntegrityError`), not SQLAlchemy's."""
    db = tmp_path / "ledger.db"
    register = str(tmp_path / "ledger.forgets")
    url = f"sqlite+aiosqlite:///{db}"
    await _build(url, register, n=200)
    _corrupt_indexes(db, ("events", "mem_versions"))
    store = Store(url, register_path=register)
    try:
        from replay.audit import audit

        with pytest.raises(DatabaseCorrupt, match="database disk image is malformed") as info:
            await audit(store, namespace=NS.split("/"), key="k5")
        # Both: stored data failed a check, and a worker retries rather than dead-letters.
        assert isinstance(info.value, IntegrityError)
        assert isinstance(info.value, StoreUnavailable)
    finally:
        await store.close()


async def test_verify_runs_the_backends_integrity_check(db_url: str, register_path: str
                                                        ) -> None:
    """On both backends a healthy ledger passes the backend's own check, named in the
    output (PostgreSQL: amcheck, created by this superuser role)."""
    await _build(db_url, register_path, n=50)
    store = Store(db_url, register_path=register_path)
    try:
        res = await verify(store)
    finally:
        await store.close()
    assert res["ok"] is True, res
    assert res["integrity"]["ok"] is True
    assert res["integrity"]["available"] is True
    assert res["integrity"]["check"] == store.recorder.integrity_check_name


@pytest.mark.postgres
async def test_without_amcheck_verify_says_so_and_does_not_fail() -> None:
    """A role that may not create amcheck: verify reports the check as not available,
    says why, and still passes a healthy ledger."""
    tag = uuid.uuid4().hex[:8]
    role, name = f"memledger_r_{tag}", f"memledger_t_noamcheck_{tag}"
    try:
        await _pg_admin(f'CREATE ROLE "{role}" LOGIN')
        await _pg_admin(f'CREATE DATABASE "{name}" OWNER "{role}"')
    except Exception as e:  # noqa: BLE001 - no server: the conftest rule
        from tests.conftest import unavailable

        unavailable("PostgreSQL", e)
    host = PG_HOST.split("@", 1)[1]
    url = f"postgresql+asyncpg://{role}@{host}/{name}"
    try:
        await _build(url, "/dev/null", n=20)
        store = Store(url, register_path="/dev/null")
        try:
            res = await verify(store)
        finally:
            await store.close()
        assert res["ok"] is True, res
        assert res["integrity"]["available"] is False
        assert "amcheck" in res["integrity"]["note"]
    finally:
        await _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await _pg_admin(f'DROP ROLE IF EXISTS "{role}"')


def test_a_worker_retries_on_a_damaged_database_instead_of_dead_lettering() -> None:
    """A good event that met a damaged database is kept for a retry, never recorded as
    a dead letter (a plain `MemledgerError` would be)."""
    from workers.policy import Disposition, classify

    assert classify(DatabaseCorrupt("database disk image is malformed")) is Disposition.RETRY
