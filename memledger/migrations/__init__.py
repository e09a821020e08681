"""Schema migrations: Alembic revisions shipped inside the package, run from memledger's
own settings (`memledger db upgrade|current|check|downgrade`, docs/operations.md).

One version tree under `memledger/migrations/versions`; its head is
`ledger.schema.SCHEMA_REVISION`. The first revision is the schema of d2f33e6, the last
release before migrations: a database it made has no `alembic_version` and is
recognised by its `events` table, stamped at that baseline and then upgraded. Each
revision runs in its own transaction, on PostgreSQL under a session advisory lock and
on SQLite under a lock file beside the database, so two upgraders never overlap.

How to add a migration (docs/operations.md#adding-a-migration): change the tables in
`ledger.schema`, write `versions/NNNN_what.py` with `down_revision` the previous head
(`python -m memledger.migrations revision "what"` writes the file with the
differences Alembic detects as a starting point), set `SCHEMA_REVISION` to its id, and
run tests/ledger/test_migrations.py: it upgrades the d2f33e6 fixtures to head and
fails while `db check` finds any difference between the models and the database.
"""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, make_url

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.store import Store

#: Where the revisions are, as a package resource: no `alembic.ini` to edit.
SCRIPT_LOCATION: Final = "memledger:migrations"
BASELINE: Final = "0001_baseline"


def _config(**attributes: Any) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    # The file is named after the revision id alone (`0004_what.py`): the id holds the slug.
    cfg.set_main_option("file_template", "%%(rev)s")
    cfg.attributes.update(attributes)
    return cfg


def script() -> ScriptDirectory:
    """The version tree."""
    return ScriptDirectory.from_config(_config())


def head() -> str:
    """The head revision of the version tree (one head: the tree does not branch)."""
    heads = script().get_heads()
    if len(heads) != 1:
        raise ValidationError("revision", f"the version tree has {len(heads)} heads "
                              f"({', '.join(sorted(heads))}); merge them into one")
    return heads[0]


def _revision_of(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def _state(conn: Connection) -> dict[str, Any]:
    insp = inspect(conn)
    rev = _revision_of(conn) if insp.has_table("alembic_version") else None
    top = head()
    if rev is not None:
        known = {s.revision for s in script().walk_revisions()}
        state = "current" if rev == top else "behind" if rev in known else "ahead"
    elif insp.has_table("events"):
        state = "unversioned"  # made before migrations shipped: the baseline
    else:
        state = "empty"
    return {"revision": rev, "head": top, "state": state}


async def current(url: str | None = None) -> dict[str, Any]:
    """The database's revision, the head, and whether it is `current`, `behind`,
    `unversioned` (made before migrations), `empty` or `ahead` (a newer memledger)."""
    store = Store(url)
    try:
        async with store.engine.connect() as conn:
            return await conn.run_sync(_state)
    finally:
        await store.close()


def _run(conn: Connection, action: str, target: str) -> dict[str, Any]:
    before = _state(conn)
    # Alembic runs everything in one transaction when it finds one open: end the one the
    # inspection began, so that each revision gets its own.
    conn.commit()
    if before["state"] == "ahead":
        raise ValidationError("revision", f"the database is at revision {before['revision']}, "
                              "which this memledger does not know: upgrade memledger")
    cfg = _config(connection=conn)
    if before["state"] == "unversioned":
        command.stamp(cfg, BASELINE)
        conn.commit()
    if action == "upgrade":
        command.upgrade(cfg, target)
    else:
        command.downgrade(cfg, target)
    after = _revision_of(conn)
    if conn.in_transaction():
        conn.commit()
    steps = _steps(before["revision"] or (BASELINE if before["state"] == "unversioned"
                                          else None), after)
    return {"from": before["revision"], "from_state": before["state"], "to": after,
            "head": before["head"], "steps": steps}


def _steps(start: str | None, end: str | None) -> list[str]:
    """The revisions between two, in the order they were applied (either direction)."""
    order = [s.revision for s in reversed(list(script().walk_revisions()))]
    i = order.index(start) + 1 if start else 0
    j = order.index(end) + 1 if end else 0
    return order[i:j] if j >= i else list(reversed(order[j:i]))


async def _migrate(url: str | None, action: str, target: str) -> dict[str, Any]:
    store = Store(url)
    try:
        async with store.engine.connect() as c0:
            conn = await c0.execution_options(memledger_write=True)
            async with store.recorder.migration_lock(conn):
                return await conn.run_sync(_run, action, target)
    finally:
        await store.close()


async def upgrade(url: str | None = None, target: str = "head") -> dict[str, Any]:
    """Upgrade the database to `target` (the head by default): stamp a database made
    before migrations at the baseline, then apply each later revision in its own
    transaction. A database already there is left alone (`steps` is empty)."""
    return await _migrate(url, "upgrade", target)


async def downgrade(url: str | None = None, target: str = "-1") -> dict[str, Any]:
    """Step the database back to `target` (one revision by default), where the
    revisions in between can go back; the baseline cannot."""
    return await _migrate(url, "downgrade", target)


def upgrade_sql(url: str | None = None, target: str = "head",
                start: str | None = None) -> str:
    """The SQL an upgrade from `start` (default: an empty database) to `target` would
    run, for the URL's dialect, without touching any database (`db upgrade --sql`)."""
    url = url or Store(url).url  # the default URL; no engine is needed, only its dialect
    dialect = make_url(url).get_backend_name()
    buf = io.StringIO()
    cfg = _config(url=f"{dialect}://")
    cfg.output_buffer = buf
    command.upgrade(cfg, f"{start}:{target}" if start else target, sql=True)
    return buf.getvalue()


def _describe(diff: Any) -> str:
    """One line per difference Alembic found: what, and on which object."""
    if isinstance(diff, list):
        return "; ".join(_describe(d) for d in diff)
    op, *rest = diff
    names = [getattr(x, "name", None) or str(x) for x in rest[:3] if x is not None]
    return f"{op} {' '.join(str(n) for n in names)}"


def _check(conn: Connection) -> dict[str, Any]:
    state = _state(conn)
    problems: list[str] = []
    if state["state"] != "current":
        problems.append(f"revision {state['revision'] or state['state']} is not the head "
                        f"{state['head']}: run `memledger db upgrade`")
    ctx = MigrationContext.configure(conn, opts={"compare_type": True,
                                                 "include_name": _compared})
    problems.extend(_describe(d) for d in compare_metadata(ctx, t.metadata))
    problems.extend(f"missing {kind} {name}" for kind, name in _missing_ddl_objects(conn))
    return {**state, "ok": not problems, "differences": problems}


def _ddl_names() -> set[str]:
    return {obj[1] for objects in t.DDL_OBJECTS.values() for obj in objects}


def _compared(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic compares everything but the objects `ledger.schema` makes by raw DDL
    (and FTS5's shadow tables of its full-text table), which `_missing_ddl_objects`
    checks instead."""
    if name is None:
        return True
    return name not in _ddl_names() and not name.startswith(f"{t.LEXICAL_FTS}_")


def _missing_ddl_objects(conn: Connection) -> list[tuple[str, str]]:
    """The raw-DDL objects of this database's kind that it lacks."""
    return [(kind, name) for kind, name, exists in t.DDL_OBJECTS.get(conn.dialect.name, ())
            if conn.execute(text(exists)).first() is None]


async def check(url: str | None = None) -> dict[str, Any]:
    """Do the database and the models agree? The revision is the head and Alembic finds
    no difference in tables, columns, types, nullability, indexes or constraints."""
    store = Store(url)
    try:
        async with store.engine.connect() as conn:
            return await conn.run_sync(_check)
    finally:
        await store.close()


def revision(message: str, url: str) -> Path:
    """Write a new revision file after the head, pre-filled with the differences Alembic
    detects between the models and the database at `url` (which must be at the head):
    a starting point for the migration's author, who reviews and edits it."""
    async def go() -> Path:
        store = Store(url)
        try:
            async with store.engine.connect() as conn:
                return await conn.run_sync(_revision, message)
        finally:
            await store.close()

    return asyncio.run(go())


def _revision(conn: Connection, message: str) -> Path:
    top = head()
    number = int(top.split("_", 1)[0]) + 1
    slug = "_".join(message.lower().split())[:40]
    rev_id = f"{number:04d}_{slug}"[:32]
    cfg = _config(connection=conn)
    sc = command.revision(cfg, message=message, autogenerate=True, rev_id=rev_id)
    assert sc is not None and not isinstance(sc, list)
    return Path(sc.path)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m memledger.migrations revision "what changed" --db URL` (for authors)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4 or args[0] != "revision" or args[2] != "--db":
        print('usage: python -m memledger.migrations revision "what changed" --db URL',
              file=sys.stderr)
        return 2
    print(revision(args[1], args[3]))
    return 0
