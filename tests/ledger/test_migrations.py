"""Schema migrations (docs/operations.md#upgrading-schema-migrations): a database made
by d2f33e6, the last release before migrations, upgrades to the head and then reads,
verifies and takes writes as a new one does; `db check` is the gate that catches a
schema change made in `ledger.schema` without a revision.

The fixtures `tests/fixtures/d2f33e6_story.{db,sql}` were made by d2f33e6's own code
from the running example (`tests/fixtures/story.jsonl`, R29) with
`tests/fixtures/make_d2f33e6.sh`.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import asyncpg
import orjson
import pytest
from sqlalchemy import text

from ledger import schema as t
from ledger.errors import SchemaOutOfDate
from ledger.store import Store
from memledger import MemoryLedger, migrations
from replay.verify import verify
from replay.verify.forgotten import verify_forgotten
from tests.cli import Cli

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PREFS = ["preferences"]


def test_one_head_and_it_is_the_models_revision() -> None:
    """The version tree has one head, and `ledger.schema.SCHEMA_REVISION` names it: a
    new revision that does not move it (or a second head) fails here."""
    assert migrations.script().get_heads() == [t.SCHEMA_REVISION]
    assert migrations.head() == t.SCHEMA_REVISION
    revs = [s.revision for s in migrations.script().walk_revisions()]
    assert revs[-1] == migrations.BASELINE


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def baseline_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database made by d2f33e6's code from the running example, on each backend."""
    if request.param == "sqlite":
        shutil.copy(FIXTURES / "d2f33e6_story.db", tmp_path / "ledger.db")
        return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    url = str(request.getfixturevalue("pg_url"))

    async def load() -> None:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        try:
            # pg_dump's plain output, less its psql meta-commands (`\restrict`).
            dump = (FIXTURES / "d2f33e6_story.sql").read_text().splitlines()
            await conn.execute("\n".join(x for x in dump if not x.startswith("\\")))
        finally:
            await conn.close()

    asyncio.run(load())
    return url


async def test_baseline_is_refused_then_upgraded(baseline_url: str, tmp_path: Path) -> None:
    """A d2f33e6 database is not opened as it is: the error names the exact upgrade
    command; `db upgrade` stamps it at the baseline, applies each later revision, and
    then the models and the database agree."""
    store = Store(baseline_url, register_path=str(tmp_path / "r.forgets"))
    with pytest.raises(SchemaOutOfDate) as err:
        await store.open()
    await store.close()
    assert "db upgrade" in str(err.value) and "memledger --db" in str(err.value)
    assert (await migrations.current(baseline_url))["state"] == "unversioned"

    res = await migrations.upgrade(baseline_url)
    assert res["from_state"] == "unversioned" and res["to"] == t.SCHEMA_REVISION
    assert res["steps"][0] == "0002_quarantine_api_keys"
    assert res["steps"][-1] == t.SCHEMA_REVISION
    checked = await migrations.check(baseline_url)
    assert checked["ok"], checked["differences"]
    again = await migrations.upgrade(baseline_url)
    assert again["steps"] == []  # at the head: nothing to do


async def test_upgraded_baseline_reads_verifies_and_writes(baseline_url: str,
                                                           tmp_path: Path) -> None:
    """After the upgrade the running example reads as before (R12, R24, R29), `replay
    verify` passes, and the ledger takes new events: a forget is effective and erased
    (R20)."""
    await migrations.upgrade(baseline_url)
    async with MemoryLedger(baseline_url, register_path=str(tmp_path / "r.forgets")) as ml:
        # Its vectors are hashgram-v1-512 (the default then) and nothing is recorded: it
        # keeps v1, and verify's fresh replay embeds with v1 too (issue 18).
        setting = await ml.embedder()
        assert (setting.name, setting.source, setting.index_current) == (
            "hashgram-v1-512", "vectors", True)
        verified = await verify(ml.store)
        assert verified["ok"] is True and verified["head"] == 11, verified
        u7 = ml.principal("shop-a/u7")
        lang = await u7.get(PREFS, "reply_language")
        assert lang is not None and (lang.value, lang.version) == ("English", 2)
        hist = await u7.history(PREFS, "reply_language")
        assert [(h.value, h.status) for h in hist] == [("Simplified Chinese", "superseded"),
                                                       ("English", "active")]
        (t900,) = await u7.tasks()
        assert t900.task_key == "T900" and t900.system["status"] == "inspecting"
        p417 = ml.principal("shop-a/user-417")
        code = await p417.get(PREFS, "code_language")
        assert code is not None and (code.memory_id, code.value) == ("M31", "Python")
        assert await ml.principal("shop-a/u8").get(PREFS, "reply_language") is None

        await u7.forget(PREFS, "reply_language", source={
            "kind": "explicit_user_request", "id": "C19", "at": "2026-09-25T09:00:00+08:00"})
        assert await u7.get(PREFS, "reply_language") is None
        assert (await verify(ml.store))["ok"] is True
        assert (await verify_forgotten(ml.store))["ok"] is True


async def test_fresh_database_is_at_head_and_checks_clean(db_url: str, tmp_path: Path) -> None:
    """A new database is created at the head and stamped by `Store.open`; one built by
    running every revision from nothing is the same: `db check` is clean for both."""
    store = Store(db_url)
    await store.open()
    await store.close()
    assert (await migrations.current(db_url))["state"] == "current"
    assert (await migrations.check(db_url))["ok"] is True
    # From nothing through every revision (the baseline included): the models exactly.
    other = db_url.replace("ledger.db", "migrated.db") if db_url.startswith("sqlite") else None
    if other is None:
        async with store.engine.begin() as conn:  # empty the same database
            await conn.run_sync(t.metadata.drop_all)
            await conn.run_sync(t.version_metadata.drop_all)
        other = db_url
    res = await migrations.upgrade(other)
    assert res["from_state"] == "empty" and res["steps"][0] == migrations.BASELINE
    checked = await migrations.check(other)
    assert checked["ok"], checked["differences"]
    await store.close()


async def test_check_fails_on_hand_made_drift(db_url: str, tmp_path: Path) -> None:
    """`db check` exits 1 and names the difference when the database and the models
    disagree: an index dropped by hand, a column added by hand."""
    store = Store(db_url)
    await store.open()
    async with store.engine.begin() as conn:
        await conn.execute(text("DROP INDEX ix_events_recorded_at"))
        await conn.execute(text("ALTER TABLE task_owners ADD COLUMN note VARCHAR(20)"))
    await store.close()
    cli = Cli(db_url, str(tmp_path / "r.forgets"))
    proc = cli.run("db", "check", check=1)
    res = orjson.loads(proc.stdout)
    assert res["ok"] is False
    assert any("ix_events_recorded_at" in d for d in res["differences"])
    assert any("remove_column" in d and "note" in d for d in res["differences"])
    assert b"difference" in proc.stderr


async def test_check_sees_the_full_text_index_made_outside_the_models(db_url: str) -> None:
    """The lexical arm's full-text objects are made by raw DDL (SQLite: an FTS5 table and
    triggers; PostgreSQL: a GIN expression index): `db check` does not report them as
    extra, and does report one that is missing."""
    store = Store(db_url)
    await store.open()
    assert (await migrations.check(db_url))["ok"]
    drop = ("DROP TRIGGER lexical_docs_ad" if store.dialect == "sqlite"
            else "DROP INDEX ix_lexical_tsv")
    async with store.engine.begin() as conn:
        await conn.execute(text(drop))
    await store.close()
    res = await migrations.check(db_url)
    assert res["ok"] is False
    assert any(d.startswith("missing") and d.split()[-1] in drop for d in res["differences"])


async def test_downgrade_steps_back_and_open_says_so(db_url: str) -> None:
    """`db downgrade` goes back one revision; the store then refuses to open with the
    upgrade command; `db upgrade` returns it to the head. The baseline cannot go back."""
    store = Store(db_url)
    await store.open()
    await store.close()
    res = await migrations.downgrade(db_url)
    assert res["steps"] == [t.SCHEMA_REVISION] and res["to"] != t.SCHEMA_REVISION
    store = Store(db_url)
    with pytest.raises(SchemaOutOfDate, match="db upgrade"):
        await store.open()
    await store.close()
    assert not (await migrations.check(db_url))["ok"]
    await migrations.upgrade(db_url)
    assert (await migrations.check(db_url))["ok"]
    await migrations.downgrade(db_url, migrations.BASELINE)
    with pytest.raises(RuntimeError, match="baseline"):
        await migrations.downgrade(db_url, "base")
    assert (await migrations.current(db_url))["revision"] == migrations.BASELINE


async def test_two_upgraders_never_overlap(baseline_url: str) -> None:
    """Two upgrades at once (PostgreSQL: advisory lock; SQLite: lock file): one applies
    the revisions, the other waits and finds nothing left to do."""
    a, b = await asyncio.gather(migrations.upgrade(baseline_url),
                                migrations.upgrade(baseline_url))
    after_baseline = [r.revision for r in migrations.script().walk_revisions(
        base=migrations.BASELINE, head="heads") if r.revision != migrations.BASELINE]
    assert sorted([len(a["steps"]), len(b["steps"])]) == [0, len(after_baseline)]
    assert (await migrations.check(baseline_url))["ok"]


async def test_sdk_migrate_opt_in(baseline_url: str, tmp_path: Path) -> None:
    """`MemoryLedger(url, migrate=True)` upgrades a database that is behind, then opens."""
    async with MemoryLedger(baseline_url, register_path=str(tmp_path / "r.forgets"),
                            migrate=True) as ml:
        lang = await ml.principal("shop-a/u7").get(PREFS, "reply_language")
        assert lang is not None and lang.value == "English"
    assert (await migrations.current(baseline_url))["state"] == "current"


def test_upgrade_sql_is_a_script_for_the_dialect(tmp_path: Path) -> None:
    """`db upgrade --sql` prints the script without touching a database: PostgreSQL's
    dialect from a PostgreSQL URL, from an empty database or from a given revision."""
    cli = Cli("postgresql+asyncpg://nobody@127.0.0.1:1/none", str(tmp_path / "r.forgets"))
    full = cli.run("db", "upgrade", "--sql").stdout.decode()
    assert "CREATE TABLE events" in full and "BYTEA" in full
    assert "CREATE INDEX ix_events_recorded_at" in full
    assert full.rstrip().endswith("COMMIT;")
    part = migrations.upgrade_sql(cli.db_url, start=migrations.BASELINE)
    assert "CREATE TABLE events" not in part and "CREATE TABLE quarantine" in part
