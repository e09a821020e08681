"""Recall's snapshot files written by the projection side (`index_cache.write_snapshots`,
called after a catch-up by `Runner.catch_up` in the background and by `replay rebuild`):
the first recall after `project` maps a file instead of loading the user (issue 20),
the file never holds what an applied forget covers (R20), a writer never replaces a
newer file, and PostgreSQL, snapshots off and small catch-ups write none.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from sqlalchemy import select

from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections import index_cache, matrix_snapshot
from projections.index_cache import CACHE, write_snapshots
from projections.runner import Runner
from projections.vectors import current_embedder
from replay.rebuild import rebuild
from tests.factories import event, src, write
from tests.projections.test_index_cache_snapshot import (
    _STEPS,
    NS,
    U7,
    append,
    at,
    fresh_index,
    run,
    same_index,
    seed,
    shown,
    snapshot_files,
)


@pytest.fixture
def low_min(monkeypatch: pytest.MonkeyPatch) -> None:
    """One event of a principal in a catch-up is enough to write its snapshot."""
    monkeypatch.setenv(index_cache.SNAPSHOT_MIN_ENV, "1")


def on_disk(store: Store) -> bytes:
    db = Path(store.url.split(":///", 1)[1])
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*") if p.is_file())


def matrix_holds(data: bytes, vec: bytes) -> bool:
    """Does a snapshot file's bytes hold `vec` as a column of its (transposed) matrix?"""
    h = matrix_snapshot._header(io.BytesIO(data), len(data))
    dim, cap = h["dim"], h["cap"]
    m = np.frombuffer(data, "<f4", count=dim * cap, offset=h["sections"]["columns"][0])
    v = np.frombuffer(vec, "<f4")
    return bool(np.all(m.reshape(dim, cap) == v[:, None], axis=0).any())


def in_snapshots(store: Store, vec: bytes) -> bool:
    """Is `vec` in the matrix of any snapshot file beside the database?"""
    return any(matrix_holds(p.read_bytes(), vec) for p in snapshot_files(store))


async def vector_of(store: Store, item: str) -> bytes:
    async with store.read() as conn:
        return bytes((await conn.execute(select(t.vectors.c.vector).where(
            t.vectors.c.item_id == item))).scalar_one())


async def test_first_recall_after_project_maps_its_snapshot(store: Store, low_min: None
                                                            ) -> None:
    """A catch-up writes the snapshot of each principal it moved enough; a process that
    never loaded the user maps it (no load) and answers as a load from the database.
    PostgreSQL keeps none."""
    await seed(store)
    await matrix_snapshot.settled()
    files = snapshot_files(store)
    if matrix_snapshot.directory(store.url) is None:
        assert files == []
        return
    assert len(files) == 2 and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    CACHE.clear()
    loads, mapped = CACHE.loads, CACHE.snapshot_loads
    first = await run(store)
    assert (CACHE.loads - loads, CACHE.snapshot_loads - mapped) == (0, 1)
    idx = CACHE.get((store.url, "shop-a", "u7", current_embedder().name))
    assert idx is not None
    same_index(idx, await fresh_index(store))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(matrix_snapshot.ENV, "0")
        CACHE.clear()
        assert shown(await run(store)) == shown(first)


async def test_small_catch_ups_and_snapshots_off_write_none(sqlite_url: str,
                                                           register_path: str,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Below `MEMLEDGER_RECALL_SNAPSHOT_MIN` events of a principal (1,250 by default: a
    worker's stream of small rounds) no file is written, none at all with
    `MEMLEDGER_RECALL_SNAPSHOTS=0`, and a file still near the range's end is kept."""
    store = Store(sqlite_url, register_path=register_path)
    try:
        await seed(store)
        await matrix_snapshot.settled()
        assert snapshot_files(store) == []
        monkeypatch.setenv(index_cache.SNAPSHOT_MIN_ENV, "1")
        monkeypatch.setenv(matrix_snapshot.ENV, "0")
        await append(store, write("tone", "warm", memory_id="W1", source=src(at=at(8))))
        await matrix_snapshot.settled()
        assert snapshot_files(store) == []
        assert await write_snapshots(store, 0, await store.head()) == []
        monkeypatch.setenv(matrix_snapshot.ENV, "1")
        assert await write_snapshots(store, 0, await store.head()) == ["shop-a/u7",
                                                                      "shop-a/u8"]
        # Files within SNAPSHOT_BEHIND positions of the range's end are kept, not
        # rewritten (a recall patches that much itself).
        assert await write_snapshots(store, 0, await store.head()) == []
        matrix_snapshot.drop_all(store.url)
        assert await write_snapshots(store, 0, await store.head(), min_events=8) == []
    finally:
        await matrix_snapshot.settled()
        await store.close()


async def test_project_snapshot_never_holds_a_forgotten_item(sqlite_url: str,
                                                            register_path: str,
                                                            low_min: None) -> None:
    """A forget applied after `project` wrote the file erases it (the vector's bytes are
    in no file beside the database); a write after it writes the file again without the
    forgotten item; and an index read before a forget's tombstone is never written."""
    store = Store(sqlite_url, register_path=register_path)
    try:
        await seed(store)
        await matrix_snapshot.settled()
        vec = await vector_of(store, "M18")
        [mine] = [p for p in snapshot_files(store) if matrix_holds(p.read_bytes(), vec)]
        with mine.open("rb") as held:  # keeps the inode: what the forget left in it
            await append(store, event("memory.forgotten", {"memory_id": "M18"},
                                      source=src(at=at(9))))
            left = held.read()
        await matrix_snapshot.settled()
        assert not matrix_holds(left, vec)  # zeroed in place, then deleted
        assert vec not in on_disk(store) and not in_snapshots(store, vec)
        await append(store, write("tone", "warm", memory_id="W1", source=src(at=at(10))))
        await matrix_snapshot.settled()
        mine = [p for p in snapshot_files(store) if "W1" in matrix_snapshot.held_items(p)[2]]
        assert len(mine) == 1 and "M18" not in matrix_snapshot.held_items(mine[0])[2]
        assert vec not in on_disk(store) and not in_snapshots(store, vec)
        # The tombstone is in the ledger, the forget not yet applied to the view: the
        # indexes read now may hold E1, so none of the tenant is written (the forget may
        # be applied before a file lands; the lock orders the check and the erasure).
        matrix_snapshot.drop_all(store.url)
        e1 = await vector_of(store, "E1")
        await store.append([parse_event(event("memory.forgotten", {"memory_id": "E1"},
                                              source=src(at=at(11))))])
        assert await write_snapshots(store, 0, await store.head()) == []
        assert snapshot_files(store) == []  # (E1 is still in the view, not yet forgotten)
        await Runner(store).catch_up()
        await matrix_snapshot.settled()
        assert e1 not in on_disk(store) and not in_snapshots(store, e1)
    finally:
        await matrix_snapshot.settled()
        await store.close()


async def test_rebuild_writes_the_snapshots(sqlite_url: str, register_path: str,
                                            low_min: None) -> None:
    """`replay rebuild` drops every file with the view, then writes those its range
    calls for: the first recall after it maps one and equals a load."""
    store = Store(sqlite_url, register_path=register_path)
    try:
        await seed(store)
        await matrix_snapshot.settled()
        res = await rebuild(store, ["vectors"])
        assert res["recall_snapshots"] == 2 and len(snapshot_files(store)) == 2
        CACHE.clear()
        loads, mapped = CACHE.loads, CACHE.snapshot_loads
        await run(store)
        assert (CACHE.loads - loads, CACHE.snapshot_loads - mapped) == (0, 1)
        idx = CACHE.get((store.url, "shop-a", "u7", current_embedder().name))
        assert idx is not None
        same_index(idx, await fresh_index(store))
    finally:
        await matrix_snapshot.settled()
        await store.close()


async def test_two_writers_keep_the_newest(sqlite_url: str, register_path: str) -> None:
    """Writers of one principal's file (two recalls, or a recall and the projection
    side) race under the directory lock and an atomic rename: whatever the order, the
    file left is whole and of the newest position; an older index never replaces it."""
    store = Store(sqlite_url, register_path=register_path)
    try:
        await seed(store)
        old = await fresh_index(store)
        gen = matrix_snapshot.generation(matrix_snapshot.directory(store.url))
        await append(store, write("tone", "warm", memory_id="W1", source=src(at=at(8))))
        new = await fresh_index(store)
        assert new.position > old.position
        images = [matrix_snapshot.image("shop-a", U7.prefix, x) for x in (new, old) * 3]
        got: list[Path | None] = []
        threads = [threading.Thread(target=lambda im=im: got.append(
            matrix_snapshot.save(store, im, gen))) for im in images]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        [path] = snapshot_files(store)
        assert matrix_snapshot.held_position(path) == new.position
        assert matrix_snapshot.save(store, images[1], gen) is None
        CACHE.clear()
        mapped = CACHE.snapshot_loads
        await run(store)
        assert CACHE.snapshot_loads - mapped == 1
    finally:
        await matrix_snapshot.settled()
        await store.close()


def as_version_2(path: Path) -> None:
    """Rewrite a current file as version 2 wrote it: the same sections under one
    blake2b digest in the header instead of a CRC-32 each."""
    import hashlib

    import orjson

    data = bytearray(path.read_bytes())
    h = matrix_snapshot.held_header(path)
    assert h is not None and h["v"] == matrix_snapshot.VERSION
    digest = hashlib.blake2b(digest_size=32)
    for name in matrix_snapshot._SECTIONS:
        off, n = h["sections"][name]
        digest.update(bytes(data[off:off + n]))
    del h["crc"]
    h["v"], h["digest"] = 2, digest.hexdigest()
    raw = orjson.dumps(h)
    head = (matrix_snapshot.MAGIC + matrix_snapshot._LEN.pack(len(raw)) + raw
            + hashlib.blake2b(raw, digest_size=32).digest())
    start = h["sections"]["columns"][0]
    assert len(head) <= start
    data[:start] = head + b"\x00" * (start - len(head))
    path.write_bytes(bytes(data))


async def test_a_version_2_file_is_reached_by_forgets_and_never_loaded(
        sqlite_url: str, register_path: str, low_min: None) -> None:
    """A file of the earlier format (one blake2b digest) is still read by `holding`
    and erased by a forget, but a load deletes it and writes the current format."""
    store = Store(sqlite_url, register_path=register_path)
    try:
        await seed(store)
        await matrix_snapshot.settled()
        [mine] = [p for p in snapshot_files(store)
                  if "M18" in matrix_snapshot.held_items(p)[2]]
        as_version_2(mine)
        assert "M18" in matrix_snapshot.held_items(mine)[2]  # readable as it is
        CACHE.clear()
        loads = CACHE.loads
        await run(store)
        await matrix_snapshot.settled()
        assert CACHE.loads - loads == 1
        assert matrix_snapshot.held_header(mine)["v"] == matrix_snapshot.VERSION  # type: ignore[index]
        as_version_2(mine)
        vec = await vector_of(store, "M18")
        assert matrix_holds(mine.read_bytes(), vec)
        with mine.open("rb") as held:  # keeps the inode: what the forget left in it
            await append(store, event("memory.forgotten", {"memory_id": "M18"},
                                      source=src(at=at(9))))
            left = held.read()
        await matrix_snapshot.settled()
        assert not matrix_holds(left, vec)  # zeroed in place (it was read), then deleted
        assert matrix_snapshot.holding(store.url, "shop-a", {"M18"}, set()) == []
        assert vec not in on_disk(store)
    finally:
        await matrix_snapshot.settled()
        await store.close()


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_STEPS)
async def test_recall_from_project_snapshots_equals_a_load(tmp_path_factory: Any,
                                                          steps: list[tuple[str, int]]
                                                          ) -> None:
    """For any sequence of writes, corrections and forgets, each projected by a
    catch-up that writes the snapshots it calls for: a process starting from those files
    answers exactly as one that loads from the database."""
    d = tmp_path_factory.mktemp("snap")
    store = Store(f"sqlite+aiosqlite:///{d / 'ledger.db'}", register_path=str(d / "f"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(index_cache.SNAPSHOT_MIN_ENV, "1")
        try:
            await seed(store)
            mapped = CACHE.snapshot_loads
            for i, (op, k) in enumerate(steps):
                s = src(at=at(10 + i))
                if op in ("write", "recall"):
                    await append(store, write(f"k{k}", f"value {i}", source=s))
                elif op == "correct":
                    await append(store, write("code_language", f"lang {i}",
                                              memory_id=f"C{i}", source=s))
                elif op == "forget":
                    await append(store, event("memory.forgotten", {"memory_id": "L1"},
                                              source=s))
                elif op == "forget_key":
                    await append(store, event("memory.forgotten",
                                              {"namespace": NS, "key": f"k{k}"}, source=s))
                elif op == "session":
                    await append(store, write("mood", f"m {i}", layer="session",
                                              session_id="C18", source=s))
                else:
                    await append(store, write("note", f"n {i}", layer="task",
                                              task_key="T900", source=s))
                await matrix_snapshot.settled()
                CACHE.clear()
                from_files = await run(store)
                mp.setenv(matrix_snapshot.ENV, "0")
                CACHE.clear()
                loaded = await run(store)
                mp.setenv(matrix_snapshot.ENV, "1")
                assert shown(from_files) == shown(loaded)
            assert CACHE.snapshot_loads > mapped  # the files were used
        finally:
            await matrix_snapshot.settled()
            await store.close()
            CACHE.clear()


async def test_memledger_project_leaves_the_snapshot(tmp_path: Path) -> None:
    """`memledger append` then `memledger project` (two processes, as an operator runs
    them): the command exits after writing the snapshot, and a process that never
    loaded the user maps it on its first recall."""
    import asyncio
    import os
    import subprocess
    import sys

    import orjson

    db = tmp_path / "l.db"
    url = f"sqlite+aiosqlite:///{db}"
    args = ["--db", url, "--forget-register", str(tmp_path / "l.forgets")]
    env = {**os.environ, "MEMLEDGER_LOG_LEVEL": "WARNING",
           index_cache.SNAPSHOT_MIN_ENV: "3"}
    lines = b"".join(orjson.dumps(write(f"k{i}", f"value {i}", memory_id=f"K{i}",
                                        source=src(at=at(i), seq=i))) + b"\n"
                     for i in range(5))
    for cmd, stdin in ((["append", "-"], lines), (["project"], None)):
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "memledger", *args, *cmd], input=stdin,
            capture_output=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
    store = Store(url, register_path=str(tmp_path / "l.forgets"))
    try:
        [path] = snapshot_files(store)
        assert {f"K{i}" for i in range(5)} <= matrix_snapshot.held_items(path)[2]
        CACHE.clear()
        loads, mapped = CACHE.loads, CACHE.snapshot_loads
        await run(store, "value")
        assert (CACHE.loads - loads, CACHE.snapshot_loads - mapped) == (0, 1)
    finally:
        await store.close()
        CACHE.clear()
