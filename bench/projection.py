"""Projection throughput on SQLite: events/s applied to the views by `Runner.catch_up()`.

The ledger holds a realistic mix (`bench.common.mixed_events`: ~80% new memories across
thousands of users in four tenants, ~10% corrections of existing slots, ~10% task
events), appended through `Store.append`. Measured on copies of that one ledger:

- the memories projection alone through `Runner(store, [MemoryProjection()]).catch_up()`;
- every view but vectors (memories, tasks, erasure, lexical, history) in one
  `Runner.catch_up()` on another copy, as `memledger project` runs them: fused windows,
  each transaction reading its events once for every projection; the time each
  `apply` took is in the note, the rest is reading, decoding and checkpoints;
- the vectors projection (when present) alone over a prefix of the ledger, beside raw
  sqlite3 inserting the same vector rows;
- the baseline: raw `sqlite3` (WAL, synchronous=NORMAL) on the same ledger and the same
  view tables, reading the events in batches of 1,000 and doing the upserts a
  hand-written projector needs (insert each write with its version, mark the version a
  correction supersedes, insert task notes and upsert the task row, advance the
  checkpoint in the same transaction), in one pass. Its memories-only figure is that
  pass minus the time of its task statements. Target: >= 0.5x.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncConnection

from bench.common import (
    Clock,
    create_like,
    insert_sql,
    main,
    mixed_ledger,
    raw_connect,
    result,
    say,
    settle,
    size,
    sqlite_url,
    vault_off,
    workdir,
)
from ledger import schema as t
from ledger.events import MEMORY_WRITES, TASK_TYPES, encode_json, parse_rfc3339, to_us
from ledger.records import StoredEvent
from ledger.store import Store
from projections.protocol import Projection
from projections.registry import default_projections
from projections.runner import Runner
from projections.views import MemoryProjection

BATCH = 1000


class Timed:
    """A projection wrapper that adds up the time spent in its `apply`."""

    def __init__(self, inner: Projection) -> None:
        self.inner = inner
        self.name = inner.name
        self.tables = inner.tables
        # What the runner reads of a projection: the event types it folds (the runner
        # reads only those) and the views it reads.
        self.types = inner.types
        self.depends_on = inner.depends_on
        # ... and how `catch_up` groups it (`Runner.groups`).
        self.sparse = getattr(inner, "sparse", False)
        self.seconds = 0.0

    async def apply(self, store: Store, conn: AsyncConnection,
                    batch: Sequence[StoredEvent]) -> None:
        """Delegate, timing the call."""
        t0 = time.perf_counter()
        await self.inner.apply(store, conn, batch)
        self.seconds += time.perf_counter() - t0


async def catch_up(db: Path, projections: Sequence[Projection]) -> tuple[float, dict[str, int]]:
    """Seconds for `Runner.catch_up()` with these projections, and what it applied."""
    store = Store(sqlite_url(db))
    await store.open()
    try:
        runner = Runner(store, list(projections), batch_size=BATCH)
        with Clock() as c:
            applied = await runner.catch_up()
    finally:
        await store.close()
    return c.seconds, applied


# -- the raw sqlite3 baseline -------------------------------------------------------------

EVENT_COLS = ("position, tenant, type, actor, source_kind, source_id, source_at, source_seq, "
              "order_key, slot, memory_id, ns_path, mkey, layer, task_key, payload")
SUPERSEDE = ("UPDATE mem_versions SET status = 'superseded', superseded_by = ? "
             "WHERE tenant = ? AND memory_id = ?")
TASK_UPSERT = (
    "INSERT INTO tasks_view (tenant, task_key, ns_path, status, retain_until_us, purged, "
    "summary) VALUES (?, ?, ?, ?, NULL, 0, ?) ON CONFLICT (tenant, task_key) DO UPDATE "
    "SET status = excluded.status, summary = excluded.summary")


def _source(r: Any) -> bytes:
    src: dict[str, Any] = {"kind": r[4], "id": r[5], "at": r[6]}
    if r[7] is not None:
        src["seq"] = r[7]
    return encode_json({**src, "actor": r[3], "position": r[0]})


def raw_project(db: Path) -> tuple[float, float, int]:
    """Raw sqlite3 projecting every event in one pass: seconds in all, seconds of the
    task statements among them, and the number of events."""
    name = "raw"
    task_s = 0.0
    with contextlib.closing(raw_connect(db)) as conn:
        conn.execute("INSERT INTO checkpoints (name, position) VALUES (?, 0)", (name,))
        ins_mem, ins_mark = insert_sql(t.mem_versions), insert_sql(t.mem_marks)
        ins_note = insert_sql(t.task_notes)
        after, n = 0, 0
        with Clock() as c:
            while True:
                conn.execute("BEGIN IMMEDIATE")
                rows = conn.execute(f"SELECT {EVENT_COLS} FROM events WHERE position > ? "
                                    "ORDER BY position LIMIT ?", (after, BATCH)).fetchall()
                if not rows:
                    conn.execute("COMMIT")
                    break
                writes = [(r, orjson.loads(r[15])["data"]) for r in rows
                          if r[2] in MEMORY_WRITES and r[15] is not None]
                slots = sorted({r[9] for r, _ in writes})
                version: dict[str, int] = {}
                for i in range(0, len(slots), 900):
                    chunk = slots[i:i + 900]
                    version.update(conn.execute(
                        "SELECT slot, max(version) FROM mem_versions WHERE slot IN "
                        f"({', '.join('?' * len(chunk))}) GROUP BY slot", chunk).fetchall())
                mem_rows, marks, supersede = [], [], []
                for r, d in writes:
                    v = version.get(r[9], 0) + 1
                    version[r[9]] = v
                    exp = d.get("expires_at")
                    mem_rows.append({
                        "tenant": r[1], "memory_id": r[10], "slot": r[9], "ns_path": r[11],
                        "mkey": r[12], "layer": r[13], "task_key": r[14],
                        "session_id": d.get("session_id"), "position": r[0],
                        "order_key": r[8], "version": v, "status": "active",
                        "candidate": False, "value": encode_json(d["value"]),
                        "text": d.get("text"), "scope": d.get("scope"),
                        "supersedes": d.get("supersedes"), "superseded_by": None,
                        "expires_at": exp,
                        "expires_us": to_us(parse_rfc3339(exp)) if exp else None,
                        "actor": r[3], "source": _source(r)})
                    if d.get("supersedes"):
                        supersede.append((r[10], r[1], d["supersedes"]))
                        marks.append({"position": r[0], "tenant": r[1],
                                      "target": d["supersedes"], "kind": "superseded",
                                      "order_key": r[8], "by_id": r[10],
                                      "via_candidate": None, "owner": None})
                conn.executemany(ins_mark, marks)
                conn.executemany(SUPERSEDE, supersede)
                conn.executemany(ins_mem, mem_rows)
                t0 = time.perf_counter()
                _raw_tasks(conn, rows, ins_note)
                task_s += time.perf_counter() - t0
                after = rows[-1][0]
                n += len(rows)
                conn.execute("UPDATE checkpoints SET position = ? WHERE name = ?", (after, name))
                conn.execute("COMMIT")
    return c.seconds, task_s, n


def _raw_tasks(conn: Any, rows: Sequence[Any], ins_note: str) -> None:
    notes, upserts = [], []
    for r in rows:
        if r[2] not in TASK_TYPES or r[15] is None:
            continue
        ev = orjson.loads(r[15])
        body = encode_json({"data": ev["data"], "source": ev["source"], "actor": r[3]})
        notes.append({"position": r[0], "tenant": r[1], "task_key": r[14], "type": r[2],
                      "order_key": r[8], "body": body})
        status = "closed" if r[2] in ("task.closed", "task.purged") else "open"
        upserts.append((r[1], r[14], r[11], status,
                        encode_json({"task_key": r[14], "status": status, "last": ev["data"]})))
    conn.executemany(ins_note, notes)
    conn.executemany(TASK_UPSERT, upserts)


# -- the benchmark ------------------------------------------------------------------------

async def vectors_run(db: Path, upto: int) -> tuple[float, int]:
    """Seconds for the vectors projection alone over the first `upto` events.

    The views it reads (memories, tasks) are brought to `upto` first, untimed.
    """
    store = Store(sqlite_url(db))
    await store.open()
    try:
        ready = [p for p in default_projections() if p.name in ("memories", "tasks")]
        await Runner(store, ready, batch_size=BATCH).catch_up(upto)
        vec = [p for p in default_projections() if p.name == "vectors"]
        with Clock() as c:
            applied = await Runner(store, vec, batch_size=BATCH).catch_up(upto)
        assert applied == {"vectors": upto}, applied
    finally:
        await store.close()
    with contextlib.closing(raw_connect(db)) as conn:
        rows = int(conn.execute("SELECT count(*) FROM vectors").fetchone()[0])
    return c.seconds, rows


def raw_vectors(src: Path, dst: Path) -> float:
    """Seconds for raw sqlite3 to insert the vector rows `src` holds, 1,000 per commit."""
    with contextlib.closing(raw_connect(src)) as conn:
        cols = [c.name for c in t.vectors.columns]
        rows = conn.execute(f"SELECT {', '.join(cols)} FROM vectors").fetchall()
    ins = (f"INSERT INTO vectors ({', '.join(cols)}) "
           f"VALUES ({', '.join('?' for _ in cols)})")
    with contextlib.closing(raw_connect(dst)) as conn:
        create_like(conn, t.vectors)
        with Clock() as c:
            for i in range(0, len(rows), BATCH):
                conn.execute("BEGIN")
                conn.executemany(ins, rows[i:i + BATCH])
                conn.execute("COMMIT")
    return c.seconds


async def run() -> list[dict[str, Any]]:
    """Projection throughput, issue-3 projections and memories alone, beside raw
    sqlite3. The ledgers have no vault: the raw baseline reads their payloads in clear
    (`vault_off`)."""
    with vault_off():
        return await _run()


async def _run() -> list[dict[str, Any]]:
    n = size(200_000, 6_000)
    n_vec = size(10_000, 1_000)
    out: list[dict[str, Any]] = []
    with workdir("projection") as d:
        for name in ("views.db", "all.db", "raw.db", "vectors.db"):
            await mixed_ledger(d / name, n)

        say("raw sqlite3 baseline")
        settle()
        raw_all_s, raw_task_s, got = raw_project(d / "raw.db")
        assert got == n
        # The memories-only baseline is that pass without its task statements.
        raw_mem_s = raw_all_s - raw_task_s

        mem = Timed(MemoryProjection())
        say(f"Runner.catch_up, memories projection alone, {n:,} events")
        settle()
        mem_s, applied = await catch_up(d / "views.db", [mem])
        assert applied == {"memories": n}, applied
        out.append(result(
            f"projection: memories alone ({n // 1000}k events)", n / mem_s, "events/s",
            n / raw_mem_s, "events/s",
            f"raw: sqlite3 reads the batch, inserts versions, marks superseded (the one pass "
            "less its task statements); apply "
            f"{mem.seconds:.1f}s, reading and checkpoints {mem_s - mem.seconds:.1f}s; "
            "target >= 0.5x"))

        # The vector index (issue 7) is timed apart, on a prefix: its embedding work has
        # no raw-SQL equivalent and would dominate (and outlast) the 200k run.
        timed = [Timed(p) for p in default_projections() if p.name != "vectors"]
        names = ", ".join(p.name for p in timed)
        say(f"Runner.catch_up, {names} together, {n:,} events")
        settle()
        all_s, applied = await catch_up(d / "all.db", timed)
        assert all(v == n for v in applied.values()), applied
        shares = ", ".join(f"{p.name} {p.seconds:.1f}s" for p in timed)
        reading = all_s - sum(p.seconds for p in timed)
        out.append(result(
            f"projection: {names} ({n // 1000}k events)", n / all_s,
            "events/s", n / raw_all_s, "events/s",
            f"raw: memories + task notes/rows in one pass; one catch_up of the five; "
            f"apply: {shares}; reading and checkpoints {reading:.1f}s; target >= 0.5x"))

        if any(p.name == "vectors" for p in default_projections()):
            say(f"Runner.catch_up, vectors alone, first {n_vec:,} events")
            vec_s, rows = await vectors_run(d / "vectors.db", n_vec)
            settle()
            raw_s = raw_vectors(d / "vectors.db", d / "raw-vectors.db")
            out.append(result(
                f"projection: vectors alone (first {n_vec // 1000}k events)", n_vec / vec_s,
                "events/s", rows / raw_s, "rows/s",
                f"raw: sqlite3 inserting the same {rows:,} vector rows (no embedding); "
                "embedding has no raw-SQL equivalent"))
    return out


if __name__ == "__main__":
    sys.exit(main(run))
