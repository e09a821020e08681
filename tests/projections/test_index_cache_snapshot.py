"""Recall's persisted principal indexes (`projections.matrix_snapshot`): a cold recall
maps the snapshot and answers exactly as a fresh load would; a forget reaches the files.

R20 (a forget reaches every copy: the snapshot files beside the database), R14/R15
(recall answers from the current index only), issue 20 (cold recall).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections import matrix_snapshot, reads
from projections.index_cache import CACHE, _load_index, principal_index, read_positions
from projections.principal_index import PrincipalIndex
from projections.recall import recall
from projections.runner import Runner
from projections.vectors import current_embedder
from replay.rebuild import rebuild
from replay.verify.forgotten import verify_forgotten
from tests.factories import event, src, write

NS = ["shop-a", "u7", "preferences"]
U7 = reads.Principal("shop-a", "u7")
NOW = 1_800_000_000_000_000
Q = "which language and editor"
KW: dict[str, Any] = {"task": "T900", "session": "C18", "limit": 20}


def at(minute: int) -> str:
    return f"2026-09-20T10:{minute:02d}:00+08:00"


async def append(store: Store, *events: dict[str, Any]) -> None:
    await store.append([parse_event(e) for e in events])
    await Runner(store).catch_up()


async def run(store: Store, query: str = Q) -> dict[str, Any]:
    return await recall(store, "shop-a/u7", query=query, now_us=NOW, budget=None, **KW)


def shown(res: dict[str, Any]) -> Any:
    return ([(i["memory_id"], i["score"], i["reason"]) for i in res["items"]], res["tasks"])


async def seed(store: Store) -> None:
    await append(
        store,
        event("task.opened", {"task_key": "T900", "namespace": ["shop-a", "u7", "tickets"],
                              "title": "left earbud crackles"}, source=src(at=at(1))),
        write("reply_language", "Chinese", memory_id="L1", source=src(at=at(1))),
        write("code_language", "Java", memory_id="M18", source=src(at=at(1))),
        write("editor", "emacs", memory_id="E1", source=src(at=at(1))),
        write("reply_language", "English", memory_id="T1", layer="task", task_key="T900",
              source=src(at=at(2))),
        write("reply_language", "Japanese", memory_id="S1", layer="session",
              session_id="C18", source=src(at=at(2))),
        write("style", "brief", user="u8", memory_id="U8", source=src(at=at(2))))


def snapshot_files(store: Store) -> list[Path]:
    return matrix_snapshot.all_files(matrix_snapshot.directory(store.url))


def same_index(a: PrincipalIndex, b: PrincipalIndex) -> None:
    """Two indexes hold the same entries (row order may differ after patches)."""
    def long(x: PrincipalIndex) -> dict[str, Any]:
        return {m: (x.keys[i], x.orders[i], x.columns[:, i].tobytes())
                for m, i in x.row_of.items()}
    assert long(a) == long(b)

    def by_key(x: PrincipalIndex) -> dict[str, list[str]]:
        out = {k: sorted(x.ids[r] for r in v if x.alive[r]) for k, v in x.key_rows.items()}
        return {k: v for k, v in out.items() if v}
    assert by_key(a) == by_key(b)

    def grouped(x: PrincipalIndex) -> dict[Any, Any]:
        return {k: sorted(zip(g.ids, g.keys, [c.tobytes() for c in g.columns.T], strict=True))
                for k, g in x.groups.items()}
    assert grouped(a) == grouped(b)
    assert sorted(zip(a.task_ids, [r.tobytes() for r in a.task_matrix], strict=True)) == \
        sorted(zip(b.task_ids, [r.tobytes() for r in b.task_matrix], strict=True))


async def fresh_index(store: Store) -> PrincipalIndex:
    emb = current_embedder()
    async with store.read() as conn:
        at_ = await read_positions(conn, "shop-a", store)
        return await _load_index(conn, store, U7, emb, at_.vectors, at_.pending)


async def test_snapshot_used_and_equal_to_a_fresh_load(store: Store) -> None:
    """After a load the index is written beside a SQLite file; a process that never
    loaded the user maps it (no load) and answers exactly as a fresh load. PostgreSQL
    keeps none (no file beside a server database)."""
    await seed(store)
    first = await run(store)
    await matrix_snapshot.settled()
    files = snapshot_files(store)
    if matrix_snapshot.directory(store.url) is None:
        assert files == []
        return
    assert len(files) == 1 and files[0].stat().st_mode & 0o777 == 0o600
    assert b"Chinese" not in files[0].read_bytes()  # vectors, ids and keys only
    CACHE.clear()
    loads, mapped = CACHE.loads, CACHE.snapshot_loads
    again = await run(store)
    assert (CACHE.loads - loads, CACHE.snapshot_loads - mapped) == (0, 1)
    assert shown(again) == shown(first)
    idx = CACHE.get((store.url, "shop-a", "u7", current_embedder().name))
    assert idx is not None and isinstance(idx.columns.base, np.memmap)
    same_index(idx, await fresh_index(store))


async def test_stale_snapshot_patched_forward(sqlite_url: str, register_path: str) -> None:
    """A snapshot behind the index is patched with what changed (no full load), and
    then equals a fresh load; off (`MEMLEDGER_RECALL_SNAPSHOTS=0`), nothing is read."""
    store = Store(sqlite_url, register_path=register_path)
    try:
        await seed(store)
        await run(store)
        await matrix_snapshot.settled()
        CACHE.clear()
        await append(store,
                     write("code_language", "Python", memory_id="M31", supersedes="M18",
                           etype="memory.corrected", source=src(at=at(5))),
                     write("editor", "vim", memory_id="V1", source=src(at=at(6))),
                     event("memory.forgotten", {"memory_id": "E1"}, source=src(at=at(7))))
        loads, patches, mapped = CACHE.loads, CACHE.patches, CACHE.snapshot_loads
        patched = await run(store)
        assert (CACHE.loads - loads, CACHE.patches - patches,
                CACHE.snapshot_loads - mapped) == (1, 0, 0)  # the forget deleted it
        # Without a forget the file is patched forward instead.
        CACHE.clear()
        await run(store)  # a full load, which writes the snapshot again
        await matrix_snapshot.settled()
        CACHE.clear()
        for idx_ in range(2):
            await append(store, write("tone", f"warm {idx_}", memory_id=f"W{idx_}",
                                      source=src(at=at(8 + idx_))))
        loads, patches, mapped = CACHE.loads, CACHE.patches, CACHE.snapshot_loads
        patched = await run(store)
        assert (CACHE.loads - loads, CACHE.patches - patches,
                CACHE.snapshot_loads - mapped) == (0, 1, 1)
        idx = CACHE.get((store.url, "shop-a", "u7", current_embedder().name))
        assert idx is not None
        same_index(idx, await fresh_index(store))
        loads, mapped = CACHE.loads, CACHE.snapshot_loads
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(matrix_snapshot.ENV, "0")
            CACHE.clear()
            fresh = await run(store)
            assert (CACHE.loads - loads, CACHE.snapshot_loads - mapped) == (1, 0)
        assert shown(patched) == shown(fresh)
    finally:
        await matrix_snapshot.settled()
        await store.close()


@pytest.mark.parametrize("damage", ["truncate", "flip_meta", "flip_header", "flip_ids",
                                    "flip_kr_rows", "other_principal"])
async def test_damaged_snapshot_ignored_and_rewritten(sqlite_url: str, register_path: str,
                                                      damage: str) -> None:
    store = Store(sqlite_url, register_path=register_path)
    try:
        await seed(store)
        first = await run(store)
        await matrix_snapshot.settled()
        [path] = snapshot_files(store)
        data = bytearray(path.read_bytes())
        h, *_ = matrix_snapshot.held_items(path)
        if damage == "truncate":
            data = data[:len(data) - 100]
        elif damage == "flip_meta":
            data[h["sections"]["meta"][0] + 3] ^= 0x20
        elif damage == "flip_header":
            data[20] ^= 0x01
        elif damage in ("flip_ids", "flip_kr_rows"):  # caught by the section's CRC-32
            data[h["sections"][damage[5:]][0]] ^= 0x01
        if damage == "other_principal":  # u7's file under u8's name: never served to u8
            d = matrix_snapshot.directory(store.url)
            assert d is not None
            theirs = matrix_snapshot.path_for(d, "shop-a", "shop-a\x1fu8\x1f",
                                              current_embedder().name)
            shutil.copy(path, theirs)
            loads = CACHE.loads
            res = await recall(store, "shop-a/u8", query="language style", now_us=NOW,
                               session=None, task=None, budget=None, limit=10)
            assert CACHE.loads - loads == 1
            assert {i["memory_id"] for i in res["items"]} == {"U8"}
            return
        path.write_bytes(bytes(data))
        CACHE.clear()
        loads = CACHE.loads
        again = await run(store)
        assert CACHE.loads - loads == 1
        assert shown(again) == shown(first)
        await matrix_snapshot.settled()
        [path] = snapshot_files(store)
        matrix_snapshot.held_items(path)  # whole again
    finally:
        await matrix_snapshot.settled()
        await store.close()


async def test_forget_erases_snapshot_files(sqlite_url: str, register_path: str) -> None:
    """A forget deletes every snapshot holding what it covers, before it is reported
    applied: the forgotten vector's bytes are in no file beside the database; another
    user's snapshot stays; a copy put back by hand is found by `verify --forgotten`."""
    store = Store(sqlite_url, register_path=register_path)
    try:
        await seed(store)
        await run(store)
        await recall(store, "shop-a/u8", query="style", now_us=NOW, session=None,
                     task=None, budget=None, limit=10)
        await matrix_snapshot.settled()
        assert len(snapshot_files(store)) == 2
        async with store.read() as conn:
            vec = (await conn.execute(select(t.vectors.c.vector).where(
                t.vectors.c.item_id == "M18"))).scalar_one()
        mine = [p for p in snapshot_files(store)
                if "M18" in matrix_snapshot.held_items(p)[2]]
        kept = mine[0].read_bytes()
        h, row_ids, *_ = matrix_snapshot.held_items(mine[0])
        row = row_ids.index("M18")

        def column(data: bytes) -> bytes:  # the matrix is stored transposed
            dim, cap = h["dim"], h["cap"]
            m = np.frombuffer(data, "<f4", count=dim * cap, offset=h["sections"]["columns"][0])
            return m.reshape(dim, cap)[:, row].tobytes()
        assert column(kept) == bytes(vec)
        with mine[0].open("rb") as held:  # keeps the inode: what the forget left in it
            await append(store, event("memory.forgotten", {"memory_id": "M18"},
                                      source=src(at=at(9))))
            assert not mine[0].exists()
            left = held.read()
        assert column(left) == bytes(len(vec))  # zeroed in place before the unlink
        assert len(snapshot_files(store)) == 1  # u8's
        db = Path(sqlite_url.split(":///", 1)[1])
        on_disk = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*")
                           if p.is_file())
        assert bytes(vec) not in on_disk
        report = await verify_forgotten(store)
        assert report["ok"] is True and report["checked"]["recall_snapshots"] == 1
        mine[0].write_bytes(kept)
        report = await verify_forgotten(store)
        assert {p["place"] for p in report["problems"]} == {"recall_snapshot"}
        mine[0].unlink()
        # A prefix forget reaches the snapshot of every principal under it.
        await append(store, event("memory.forgotten", {"namespace_prefix": ["shop-a", "u8"]},
                                  actor="u8", source=src(at=at(10))))
        assert snapshot_files(store) == []
    finally:
        await matrix_snapshot.settled()
        await store.close()


async def test_no_snapshot_older_than_a_forget(sqlite_url: str, register_path: str) -> None:
    """An index loaded before a forget's tombstone is not written after it (the forget
    may already have erased the files), and a rebuild of the view deletes them all."""
    store = Store(sqlite_url, register_path=register_path)
    try:
        await seed(store)
        emb = current_embedder()
        async with store.read() as conn:
            at_ = await read_positions(conn, "shop-a", store)
            idx = await _load_index(conn, store, U7, emb, at_.vectors, None)
        gen = matrix_snapshot.generation(matrix_snapshot.directory(store.url))
        await store.append([parse_event(event("memory.forgotten", {"memory_id": "M18"},
                                              source=src(at=at(9))))])
        assert matrix_snapshot.save(store, matrix_snapshot.image("shop-a", U7.prefix, idx),
                                    gen) is None
        assert snapshot_files(store) == []
        await Runner(store).catch_up()
        await run(store)
        await matrix_snapshot.settled()
        assert len(snapshot_files(store)) == 1
        gen = matrix_snapshot.generation(matrix_snapshot.directory(store.url))
        await rebuild(store, ["vectors"])
        assert snapshot_files(store) == []
        async with store.read() as conn:
            at_ = await read_positions(conn, "shop-a", store)
            idx = await principal_index(conn, store, U7, emb, at_)
        # An index read before the rebuild is not written after it.
        assert matrix_snapshot.save(store, matrix_snapshot.image("shop-a", U7.prefix, idx),
                                    gen) is None
    finally:
        await matrix_snapshot.settled()
        await store.close()


_STEPS = st.lists(st.tuples(st.sampled_from(["write", "correct", "forget", "forget_key",
                                             "session", "task_write", "recall"]),
                            st.integers(0, 3)), min_size=2, max_size=5)


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_STEPS)
async def test_recall_with_snapshot_equals_recall_without(tmp_path_factory: Any,
                                                         steps: list[tuple[str, int]]) -> None:
    """For any sequence of writes, corrections and forgets, with recalls (and so
    snapshot writes) in between: a process starting from the snapshot answers exactly as
    one that loads from the database."""
    d = tmp_path_factory.mktemp("snap")
    store = Store(f"sqlite+aiosqlite:///{d / 'ledger.db'}", register_path=str(d / "f"))
    try:
        await seed(store)
        await run(store)
        for i, (op, k) in enumerate(steps):
            s = src(at=at(10 + i))
            if op == "write":
                await append(store, write(f"k{k}", f"value {i}", source=s))
            elif op == "correct":
                await append(store, write("code_language", f"lang {i}", memory_id=f"C{i}",
                                          source=s))
            elif op == "forget":
                await append(store, event("memory.forgotten", {"memory_id": "L1"}, source=s))
            elif op == "forget_key":
                await append(store, event("memory.forgotten", {"namespace": NS,
                                                               "key": f"k{k}"}, source=s))
            elif op == "session":
                await append(store, write("mood", f"m {i}", layer="session", session_id="C18",
                                          source=s))
            elif op == "task_write":
                await append(store, write("note", f"n {i}", layer="task", task_key="T900",
                                          source=s))
            else:
                await run(store)
                await matrix_snapshot.settled()
            CACHE.clear()
            with_snapshot = await run(store)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(matrix_snapshot.ENV, "0")
                CACHE.clear()
                without = await run(store)
            assert shown(with_snapshot) == shown(without)
    finally:
        await matrix_snapshot.settled()
        await store.close()
        CACHE.clear()
