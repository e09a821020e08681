"""MemledgerStore's projection rounds after the put (docs/langgraph.md, "Writes").

A put returns once its event is durable in the ledger (R14, R16); the views apply it in
a round run in the background and shared by the puts that follow. Every read through
the store waits for the views to reach every position the store has appended, on the
caller's thread and on the loop, on both backends, with and without a principal; a
delete still returns only after its round (R20); a round's error reaches the next
caller; `close()` waits for the pending round; another store on the same ledger reads
a put once the writer's round has run.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("langgraph.store.base")

from langgraph.store.base import PutOp

from memledger import MemoryLedger
from memledger.langgraph import STORE_VIEWS, MemledgerStore


def _eventually(cond: Callable[[], bool], what: str, limit_s: float = 120.0) -> None:
    """Poll `cond` until it holds (a liveness bound for a background round on a loaded
    machine, not a speed check)."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {limit_s} s")
        time.sleep(0.01)


def _held(store: MemledgerStore) -> threading.Event:
    """Hold the store's projection rounds until the returned event is set."""
    gate = threading.Event()
    runner = store._rounds.runner
    real = runner.round

    async def held(upto: int | None = None) -> int:
        await asyncio.to_thread(gate.wait)
        return await real(upto)

    runner.round = held  # type: ignore[method-assign]
    return gate


KEYS = ("a", "b", "c")
OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS), st.integers(0, 99)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("batch"), st.lists(st.tuples(st.sampled_from(KEYS),
                                                   st.none() | st.integers(0, 99)),
                                         min_size=1, max_size=3)),
    st.tuples(st.sampled_from(["get", "aget"]), st.sampled_from(KEYS)),
    st.tuples(st.sampled_from(["search", "asearch", "list", "history"])),
), min_size=1, max_size=10)


@pytest.mark.parametrize("principal", [None, "langgraph/u7"])
def test_reads_through_the_store_see_every_write_it_returned(
        db_url: str, principal: str | None) -> None:
    """For any sequence of puts, deletes and batches, each read through the store (sync
    on the caller's thread, async on the loop; get, search, list_namespaces, history)
    gives what the writes it made before say, whatever round is still running: the
    views are never read behind the store's own appends."""
    store = MemledgerStore(url=db_url, principal=principal)
    fresh = itertools.count()
    try:
        store.setup()

        @settings(max_examples=25, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(OPS)
        def check(ops: list[Any]) -> None:
            ns = ("u7", "t", str(next(fresh)))
            model: dict[str, int] = {}
            for op in ops:
                kind = op[0]
                if kind == "put":
                    store.put(ns, op[1], {"v": op[2]})
                    model[op[1]] = op[2]
                elif kind == "delete":
                    store.delete(ns, op[1])
                    model.pop(op[1], None)
                elif kind == "batch":
                    store.batch([PutOp(ns, k, None if v is None else {"v": v})
                                 for k, v in op[1]])
                    for k, v in op[1]:  # the last put of a key wins
                        if v is None:
                            model.pop(k, None)
                        else:
                            model[k] = v
                elif kind in ("get", "aget"):
                    got = (store.get(ns, op[1]) if kind == "get"
                           else asyncio.run(store.aget(ns, op[1])))
                    assert (None if got is None else got.value["v"]) == model.get(op[1])
                elif kind in ("search", "asearch"):
                    found = (store.search(ns, limit=10) if kind == "search"
                             else asyncio.run(store.asearch(ns, limit=10)))
                    assert {i.key: i.value["v"] for i in found} == model
                elif kind == "list":
                    assert store.list_namespaces(prefix=ns) == ([ns] if model else [])
                else:
                    for key in KEYS:
                        active = [v for v in store.history(ns, key) if v.status == "active"]
                        assert [v.value["v"] for v in active] == (  # type: ignore[index]
                            [model[key]] if key in model else [])

        check()
    finally:
        store.close()


def test_a_put_returns_before_its_round_and_other_stores_read_it_after(
        db_url: str) -> None:
    """With the rounds held, a put returns (it waits for its append only) and another
    store on the ledger does not read it yet; the writer's own get waits for the round
    and reads it. A put whose round nobody waits for is read by the other store once
    the background round has run."""
    writer = MemledgerStore(url=db_url)
    other = MemledgerStore(url=db_url)
    try:
        writer.setup()
        other.setup()
        gate = _held(writer)
        writer.put(("u7", "prefs"), "lang", {"v": "zh"})
        writer.put(("u7", "prefs"), "tone", {"v": "dry"})
        assert writer._rounds.behind()
        assert other.get(("u7", "prefs"), "lang") is None  # the views do not show it yet
        mine: list[Any] = []
        reader = threading.Thread(target=lambda: mine.append(
            writer.get(("u7", "prefs"), "tone")))
        reader.start()
        reader.join(timeout=0.5)
        assert reader.is_alive()  # the writer's read waits for the held round
        assert mine == []
        gate.set()
        reader.join(timeout=120)
        assert [i.value for i in mine] == [{"v": "dry"}]
        assert {i.key for i in other.search(("u7",))} == {"lang", "tone"}
        writer.put(("u7", "prefs"), "late", {"v": 1})  # nobody waits for its round
        _eventually(lambda: other.get(("u7", "prefs"), "late") is not None,
                    "the background round")
    finally:
        other.close()
        writer.close()


def test_puts_during_a_round_get_a_round_of_their_own(db_url: str) -> None:
    """A put appended after a running round read its head, with nobody waiting for
    anything afterwards, is still projected in the background: another store reads it."""
    writer = MemledgerStore(url=db_url)
    other = MemledgerStore(url=db_url)
    try:
        writer.setup()
        other.setup()
        runner = writer._rounds.runner
        real = runner.round
        gate = threading.Event()
        rounds: list[int] = []

        async def then_held(upto: int | None = None) -> int:
            got = await real(upto)  # the head is read in here
            rounds.append(got)
            if len(rounds) == 1:
                await asyncio.to_thread(gate.wait)
            return got

        runner.round = then_held  # type: ignore[method-assign]
        writer.put(("u7", "prefs"), "first", {"v": 1})
        _eventually(lambda: len(rounds) == 1, "the first round")
        writer.put(("u7", "prefs"), "during", {"v": 2})  # after the round's head
        assert writer._rounds.appended > rounds[0]
        gate.set()
        _eventually(lambda: other.get(("u7", "prefs"), "during") is not None,
                    "a round for the put made during the first")
        assert other.get(("u7", "prefs"), "first") is not None
    finally:
        other.close()
        writer.close()


def test_a_delete_returns_only_after_its_round(db_url: str) -> None:
    """A delete is a forget when it returns: with the rounds held it does not return;
    once they run, every view (the erasure included) has applied it (R20)."""
    store = MemledgerStore(url=db_url)
    try:
        store.put(("u7", "prefs"), "lang", {"v": "zh"})
        gate = _held(store)
        before = store._rounds.appended
        done = threading.Event()

        def delete() -> None:
            store.delete(("u7", "prefs"), "lang")
            done.set()

        t = threading.Thread(target=delete)
        t.start()
        _eventually(lambda: store._rounds.appended > before, "the delete's append")
        t.join(timeout=0.5)
        assert not done.is_set()  # appended, not returned: its round is held
        gate.set()
        t.join(timeout=120)
        assert done.is_set()
        head = store._call(store._ml.store.head())
        assert set(store._call(store._rounds.runner.positions()).values()) == {head}
    finally:
        store.close()


def _failing_once(store: MemledgerStore) -> list[int]:
    """The store's next round raises `RuntimeError("round failed")`; later ones run.
    Returns the list of round calls made."""
    runner = store._rounds.runner
    real = runner.round
    calls: list[int] = []

    async def once(upto: int | None = None) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("round failed")
        return await real(upto)

    runner.round = once  # type: ignore[method-assign]
    return calls


def test_a_background_round_error_reaches_the_next_caller(db_url: str) -> None:
    """A round that fails with nobody waiting is raised to the store's next call, once;
    the call after runs a round again and reads the put (it was durable)."""
    store = MemledgerStore(url=db_url)
    try:
        store.setup()
        calls = _failing_once(store)
        store.put(("u7", "prefs"), "lang", {"v": "zh"})
        _eventually(lambda: store._rounds._failed is not None, "the failing round")
        with pytest.raises(RuntimeError, match="round failed"):
            store.get(("u7", "prefs"), "lang")
        got = store.get(("u7", "prefs"), "lang")
        assert got is not None and got.value == {"v": "zh"}
        assert len(calls) == 2
    finally:
        store.close()


def test_a_round_error_reaches_its_waiter_once(db_url: str) -> None:
    """A read waiting for a failing round gets its error; the next read retries, and the
    error is not raised a second time."""
    store = MemledgerStore(url=db_url)
    try:
        store.setup()
        _failing_once(store)
        store.put(("u7", "prefs"), "lang", {"v": "zh"})
        # the read waits for the failing round (or, had it failed first, is the next
        # caller): either way it is given the error, not a view behind the put
        with pytest.raises(RuntimeError, match="round failed"):
            store.get(("u7", "prefs"), "lang")
        assert store.search(("u7",))[0].value == {"v": "zh"}
        assert asyncio.run(store.aget(("u7", "prefs"), "lang")) is not None
    finally:
        store.close()


def test_close_waits_for_the_pending_round_and_raises_an_unseen_error(
        db_url: str) -> None:
    """`close()` runs the round the last puts left and leaves every view it keeps at the
    head; a round error no caller was given is raised by `close()`, after it has
    released the ledger."""
    store = MemledgerStore(url=db_url)
    store.setup()
    gate = _held(store)
    for i in range(3):
        store.put(("u7", "prefs"), f"k{i}", {"i": i})
    closing = threading.Thread(target=store.close)
    closing.start()
    closing.join(timeout=0.5)
    assert closing.is_alive()  # waiting for the held round
    gate.set()
    closing.join(timeout=120)
    assert not closing.is_alive()

    async def positions() -> tuple[int, set[int]]:
        async with MemoryLedger(db_url) as ml:
            at = await ml.runner.positions()
            return await ml.store.head(), {at[name] for name in STORE_VIEWS}

    head, at = asyncio.run(positions())
    assert at == {head}

    failing = MemledgerStore(url=db_url)
    failing.setup()
    _failing_once(failing)
    failing.put(("u7", "prefs"), "k9", {"i": 9})
    _eventually(lambda: failing._rounds._failed is not None, "the failing round")
    with pytest.raises(RuntimeError, match="round failed"):
        failing.close()
    assert not failing._finalizer.alive
    head, at = asyncio.run(positions())
    assert at == {head}  # close ran the round again before raising
