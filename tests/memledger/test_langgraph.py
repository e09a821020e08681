"""memledger.langgraph.MemledgerStore beyond LangGraph's own suites (docs/langgraph.md).

A delete is a forget (R20), writers in two processes lose nothing (R16), and a
principal-scoped store reads only its user's namespaces, checked in SQL (R24).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langgraph.store.base")

from memledger.langgraph import (
    STORE_VIEWS,
    MemledgerStore,
    decode_label,
    encode_key,
    encode_label,
)

ROOT = Path(__file__).resolve().parents[2]


def test_labels_memledger_refuses_round_trip(sqlite_url: str) -> None:
    for label in ["a/b", "x\n", "~tilde", "ok"]:
        assert decode_label(encode_label(label)) == label
    assert encode_label("ok") == "ok"
    store = MemledgerStore(url=sqlite_url)
    try:
        store.put(("u/1", "line\n"), "k/1", {"v": 1})
        assert store.get(("u/1", "line\n"), "k/1").value == {"v": 1}  # type: ignore[union-attr]
        assert store.list_namespaces() == [("u/1", "line\n")]
        assert encode_key("k/1") != "k/1"
    finally:
        store.close()


def test_delete_is_a_forget(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/lg.db"
    marker = "zq-marker-7731-unforgettable"
    store = MemledgerStore(url=url)
    try:
        store.put(("u7", "prefs"), "color", {"fav": marker})
        store.put(("u7", "prefs"), "other", {"fav": "kept"})
        store.delete(("u7", "prefs"), "color")
        assert store.get(("u7", "prefs"), "color") is None
        hist = store.history(("u7", "prefs"), "color")
        assert [v.status for v in hist] == ["forgotten"]
        assert hist[0].redacted and hist[0].value is None
        assert store.get(("u7", "prefs"), "other") is not None
    finally:
        store.close()
    # the views the store does not keep (recall's, as-of's), projected afterwards by
    # another process, never take the forgotten value in
    asyncio.run(_project_every_view(url))
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert marker.encode() not in f.read_bytes(), f"value left in {f.name}"


async def _project_every_view(url: str) -> dict[str, int]:
    from memledger import MemoryLedger

    async with MemoryLedger(url) as ml:
        await ml.project()
        return await ml.runner.positions()


def test_a_store_keeps_its_views_and_every_view_another_process_keeps(
        db_url: str) -> None:
    """A store's rounds keep the views it reads (`STORE_VIEWS`); once another process
    keeps the others (`memledger project`, a worker), its rounds keep them too, and a
    delete returns only once every one of them has applied it (R20)."""
    from memledger import MemoryLedger

    store = MemledgerStore(url=db_url)
    try:
        store.setup()
        assert {p.name for p in store._rounds.runner.projections} == STORE_VIEWS
        store.put(("u7", "prefs"), "color", {"fav": "teal"})
        store.flush()
        at = asyncio.run(_project_every_view(db_url))  # another process keeps them all
        assert min(at.values()) > 0
        store.put(("u7", "prefs"), "size", {"fav": "xl"})
        store.delete(("u7", "prefs"), "color")

        async def positions() -> tuple[int, dict[str, int]]:
            async with MemoryLedger(db_url) as ml:
                return await ml.store.head(), await ml.runner.positions()

        head, at = asyncio.run(positions())
        assert set(at.values()) == {head}, at  # every view, not only the store's
        assert store._rounds.runner.projections == store._ml.runner.projections
    finally:
        store.close()
    again = MemledgerStore(url=db_url)  # a store opened on such a ledger keeps them all
    try:
        again.setup()
        assert {p.name for p in again._rounds.runner.projections} > STORE_VIEWS
        assert again.get(("u7", "prefs"), "color") is None
    finally:
        again.close()


def test_principal_scope_sees_only_its_user(db_url: str) -> None:
    admin = MemledgerStore(url=db_url)
    try:
        admin.put(("u7", "prefs"), "lang", {"v": "zh"})
        admin.put(("u8", "prefs"), "lang", {"v": "en"})
        admin.flush()  # another store reads a put once its round has run
        u7 = MemledgerStore(url=db_url, principal="langgraph/u7")
        try:
            assert u7.get(("u8", "prefs"), "lang") is None
            assert u7.get(("u7", "prefs"), "lang") is not None
            assert [i.namespace for i in u7.search(())] == [("u7", "prefs")]
            assert [i.namespace for i in u7.search(("u8",))] == []
            assert u7.list_namespaces() == [("u7", "prefs")]
            assert u7.history(("u8", "prefs"), "lang") == []
        finally:
            u7.close()
    finally:
        admin.close()


WRITER = """
import sys
from memledger.langgraph import MemledgerStore
s = MemledgerStore(url=sys.argv[1])
for i in range(40):
    s.put(("w", sys.argv[2]), f"k{i}", {"i": i})
s.close()
"""


def test_two_processes_lose_nothing(db_url: str) -> None:
    MemledgerStore(url=db_url).close()  # the schema, before two processes race for it
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, db_url, name], cwd=ROOT)
             for name in ("p1", "p2")]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    store = MemledgerStore(url=db_url)
    try:
        for name in ("p1", "p2"):
            got = store.search(("w", name), limit=1000)
            assert sorted(i.key for i in got) == sorted(f"k{i}" for i in range(40))
    finally:
        store.close()


async def test_put_replayed_after_restore_does_not_resurrect(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backup taken before a delete, restored, then the original put appended again
    (a retry, a replayed queue): the key stays forgotten (R20, docs/forgetting.md).
    The restored ledger keeps the source's forget register and key store (the vault is
    on by default), as an operator restoring beside the source would."""
    from ledger.store import Store
    from memledger import MemoryLedger
    from replay.backup import backup, restore

    reg = str(tmp_path / "a.forgets")
    a_url = f"sqlite+aiosqlite:///{tmp_path}/a.db"
    store = MemledgerStore(url=a_url)
    sent: list[Any] = []
    real = store._ml.append

    async def recording(events: Any, *, wait: bool = False) -> Any:
        sent.extend(events if isinstance(events, list) else [events])
        return await real(events, wait=wait)

    store._ml.append = recording  # type: ignore[method-assign]
    try:
        store.put(("u7", "prefs"), "color", {"fav": "teal"})
        (put,) = sent
        async with MemoryLedger(a_url, register_path=reg) as ml:
            await backup(ml.store, tmp_path / "a.backup", progress=False)
        store.delete(("u7", "prefs"), "color")
    finally:
        store.close()
    b_url = f"sqlite+aiosqlite:///{tmp_path}/b.db"
    if (tmp_path / "a.db.vault").exists():
        monkeypatch.setenv("MEMLEDGER_VAULT_PATH", str(tmp_path / "a.db.vault"))
    await restore(Store(b_url, register_path=str(tmp_path / "a.db.forgets")),
                  tmp_path / "a.backup", progress=False)
    async with MemoryLedger(b_url, register_path=str(tmp_path / "a.db.forgets")) as ml:
        await ml.append(put, wait=True)
    again = MemledgerStore(url=b_url)
    try:
        assert again.get(("u7", "prefs"), "color") is None
        assert again.search(("u7",)) == []
    finally:
        again.close()


async def test_concurrent_calls_share_projection_rounds(db_url: str) -> None:
    """LangGraph's `test_large_batches_async` pattern, small: puts, gets, namespace
    listings, searches and deletes of the same keys, all in flight at once. Every call
    finishes with LangGraph's answers, and the writers share catch-ups of the views
    instead of each running its own (one per write starved the 6,000-call original:
    every catch-up was a write transaction per view, taken in turn; a round is one)."""
    from memledger.langgraph import AsyncMemledgerStore

    n = 30
    async with AsyncMemledgerStore.from_conn_string(db_url) as store:
        await store.setup()
        runner = store._ml.runner
        rounds = 0
        real = runner.round

        async def counted(upto: int | None = None) -> int:
            nonlocal rounds
            rounds += 1
            return await real(upto)

        runner.round = counted  # type: ignore[method-assign]
        calls: list[Any] = []
        for i in range(n):
            ns = ("test", "c", str(i % 2))
            calls += [store.aput(ns, f"k{i}", {"v": i}),
                      store.aget(ns, f"k{i}"),
                      store.alist_namespaces(prefix=("test",), max_depth=2),
                      store.asearch(("test",)),
                      store.aput(ns, f"k{i}", {"v": i, "again": True}),
                      store.adelete(ns, f"k{i}")]
        results = await asyncio.gather(*calls)
        assert len(results) == 6 * n
        for i in range(n):
            got = results[6 * i + 1]
            assert got is None or got.value["v"] == i  # before or after its own put
            assert results[6 * i + 2] in ([], [("test", "c")])
        writes = 3 * n
        assert rounds <= writes // 4, (rounds, writes)
        # the last write of every key was its delete: nothing is left
        assert await store.asearch(("test",), limit=1000) == []
        assert await store.alist_namespaces() == []


async def _assert_poison_held_and_views_replayed(store: Any, tmp_path: Path,
                                                 poison_at: int) -> None:
    """Only the poison event is quarantined (for the vectors view alone) and every view
    equals a fresh replay of the ledger."""
    from ledger import schema as t
    from tests.helpers import assert_views_replay

    async with store.read() as conn:
        held = (await conn.execute(t.quarantine.select())).all()
    assert [(r.projection, r.position) for r in held] == [("vectors", poison_at)]
    await assert_views_replay(store, tmp_path)


@pytest.mark.parametrize("how", ["python", "database"])
async def test_inline_writes_run_appends_and_rounds_off_the_async_driver(
        store: Any, tmp_path: Path, how: str) -> None:
    """`Store.use_inline` (what the LangGraph store turns on): on a SQLite file the
    append and the fused round each run as one transaction on the inline thread, none
    of their statements on the async engine; the views equal a fresh replay's and an
    event one view cannot apply (a Python error, or a database error inside the
    savepoint) is quarantined for that view alone, as on the async path. A body that
    raises commits nothing. PostgreSQL keeps the async path."""
    from sqlalchemy import event as sa_event
    from sqlalchemy import select

    from ledger import schema as t
    from tests.projections.test_quarantine import POISON, append, runner_with, story

    if store.dialect != "sqlite":
        assert store.use_inline() is False and store.inline is None
        return
    assert store.use_inline() is True
    runner = runner_with(store, "vectors", how)
    events = story()
    at = await append(store, events[:1])
    await runner.round()  # from 0: steps (a bulk load may run), on the async driver
    on_driver = 0

    def counted(*_a: Any) -> None:
        nonlocal on_driver
        on_driver += 1

    sa_event.listen(store.engine.sync_engine, "before_cursor_execute", counted)
    runs = 0
    real = store.inline.run

    async def run(body: Any) -> Any:
        nonlocal runs
        runs += 1
        return await real(body)

    store.inline.run = run
    try:
        for e in events[1:]:
            at |= await append(store, [e])
            assert await runner.round() == at[e["idempotency_key"]]
    finally:
        sa_event.remove(store.engine.sync_engine, "before_cursor_execute", counted)
    assert on_driver == 0
    assert runs == 2 * len(events[1:])  # an append and a round each
    await _assert_poison_held_and_views_replayed(store, tmp_path, at[POISON])

    async def fails(conn: Any) -> None:
        await conn.execute(t.meta.insert().values(name="inline-test", value="x"))
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        await store.inline.run(fails)

    async def meta_row(conn: Any) -> Any:
        return (await conn.execute(select(t.meta.c.value).where(
            t.meta.c.name == "inline-test"))).first()

    assert await store.inline.run(meta_row) is None  # rolled back, connection usable


async def test_a_round_projects_every_view_in_one_transaction_as_steps_would(
        store: Any, tmp_path: Path) -> None:
    """`Runner.round` (a store's projection round): after the ledger's commit (R14),
    every view moves in ONE view transaction, to the same rows a step-by-step catch-up
    from scratch gives, and an event one view cannot apply is quarantined for that view
    alone (R17) while the others apply it. A projection at 0 (a possible bulk load)
    falls back to steps."""
    from tests.projections.test_quarantine import POISON, append, runner_with, story

    runner = runner_with(store, "vectors")
    opened = 0
    real = store.view_write

    def counted() -> Any:
        nonlocal opened
        opened += 1
        return real()

    store.view_write = counted
    events = story()
    at = await append(store, events[:1])
    assert await runner.round() == at["w-a"]
    assert opened > 1  # from 0: steps, a transaction each
    for e in events[1:]:
        at |= await append(store, [e])
        before = opened
        assert await runner.round() == at[e["idempotency_key"]]
        assert opened - before == 1, e["idempotency_key"]
    head = await store.head()
    assert set((await runner.positions()).values()) == {head}
    await _assert_poison_held_and_views_replayed(store, tmp_path, at[POISON])
