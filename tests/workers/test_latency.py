"""The workers' latency machinery: write turns, the projector's priorities, broadcast
wake-ups. Correctness only (no timings asserted: the lag is measured by
`python -m bench --only workers`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

from ledger import schema as t
from ledger.backends.sqlite import WriteTurn, turn_path
from ledger.events import Event
from ledger.store import Store
from ledger.validation import parse_event
from projections.protocol import Projection
from projections.runner import Runner
from tests.factories import src, write
from tests.helpers import dump_views, fresh_replay
from workers.broker import LedgerBroker
from workers.projector import URGENT, Projector
from workers.wake import WakeListener, WakeSender, broker_sender


def events(n: int, prefix: str, *, keys: int = 7) -> list[Event]:
    """`n` validated memory writes over a few slots."""
    return [parse_event(write(f"k{i % keys}", i, idem=f"{prefix}-{i}",
                              source=src(at="2026-09-20T10:00:00+08:00", seq=i)))
            for i in range(n)]


async def positions(store: Store) -> dict[str, int]:
    """Each projection's checkpoint."""
    return await Runner(store).positions()


async def until(cond: Callable[[], Awaitable[bool]], within: float = 20.0) -> None:
    """Wait for an async condition (a functional wait, generous on purpose)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await cond():
        if loop.time() > deadline:
            pytest.fail("condition not reached")
        await asyncio.sleep(0.02)


# -- write turns --------------------------------------------------------------------------

def test_turn_path_only_for_sqlite_files(tmp_path: Path) -> None:
    """Turns are taken on SQLite files; PostgreSQL and in-memory databases have none."""
    db = tmp_path / "l.db"
    assert turn_path(f"sqlite+aiosqlite:///{db}") == f"{db}-turn"
    assert turn_path("sqlite+aiosqlite:///:memory:") is None
    assert turn_path("postgresql+asyncpg://postgres@127.0.0.1/x") is None


async def test_one_turn_at_a_time_and_handed_on_release(tmp_path: Path) -> None:
    """A second holder (another process, here another descriptor) gets the turn only
    when the first gives it back, and then at once."""
    path = str(tmp_path / "l.db-turn")
    a, b = WriteTurn(path), WriteTurn(path)
    try:
        async with a.hold() as granted:
            assert granted
            waiter = asyncio.ensure_future(_hold_once(b))
            await asyncio.sleep(0.3)
            assert not waiter.done()  # still A's turn
        assert await asyncio.wait_for(waiter, 20) is True
    finally:
        a.close()
        b.close()


async def _hold_once(turn: WriteTurn) -> bool:
    async with turn.hold() as granted:
        return granted


async def test_cancelled_or_timed_out_wait_gives_the_turn_back(tmp_path: Path) -> None:
    """A waiter that is cancelled, or gives up after its timeout and goes ahead without
    a turn, never keeps the turn it is granted later."""
    path = str(tmp_path / "l.db-turn")
    a, b, c = WriteTurn(path), WriteTurn(path), WriteTurn(path, timeout=0.2)
    try:
        async with a.hold():
            cancelled = asyncio.ensure_future(_hold_once(b))
            await asyncio.sleep(0.1)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert await _hold_once(c) is False  # timed out: went ahead without
            assert c.timeouts == 1
        # Both abandoned waits are granted now and give the turn straight back.
        for turn in (b, c, a):
            assert await asyncio.wait_for(_hold_once(turn), 20) is True
    finally:
        for turn in (a, b, c):
            turn.close()


async def test_turn_stores_sharing_a_file_converge(tmp_path: Path) -> None:
    """Two stores taking turns on one SQLite file, appending and projecting at once:
    every event once, every view equal to a rebuild."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'l.db'}"
    one = Store(url, register_path=str(tmp_path / "l.forgets"), write_turns=True)
    two = Store(url, register_path=str(tmp_path / "l.forgets"), write_turns=True)
    await one.open()
    await two.open()
    assert one.turn is not None and two.turn is not None
    try:
        batches = [events(40, f"t{i}") for i in range(6)]
        work: list[Awaitable[object]] = [(one, two)[i % 2].append([ev])
                                         for i, b in enumerate(batches) for ev in b]
        work += [Runner(s).catch_up() for s in (one, two, one, two)]
        await asyncio.gather(*work)
        await Runner(two).catch_up()
        assert await one.head() == 240
        assert set((await positions(one)).values()) == {240}
        fresh = await fresh_replay(one, tmp_path)
        assert await dump_views(one, t.VIEW_TABLES) == await dump_views(fresh, t.VIEW_TABLES)
        await fresh.close()
    finally:
        await one.close()
        await two.close()


@pytest.mark.postgres
async def test_turn_store_on_postgres_takes_no_turn(pg_url: str, register_path: str) -> None:
    """PostgreSQL queues its own lock waiters: write turns there are none."""
    store = Store(pg_url, register_path=register_path, write_turns=True)
    await store.open()
    try:
        assert store.turn is None
        await store.append(events(5, "pg"))
        await Runner(store).catch_up()
        assert set((await positions(store)).values()) == {5}
    finally:
        await store.close()


# -- the projector's priorities -----------------------------------------------------------

async def test_wakeup_projects_memories_now_and_the_rest_when_due(store: Store) -> None:
    """While appends arrive, a wake-up brings the urgent view to the head at once and
    leaves the others to their catch-up, which then comes on its own (a timer, or the
    next pass once due); a request waits for all of them."""
    proj = Projector(store, min_interval=0, catch_up_interval=3600)
    await store.append(events(30, "a"))
    await proj.request()
    assert set((await positions(store)).values()) == {30}
    await store.append(events(30, "b"))
    proj.poke()

    async def urgent_done() -> bool:
        pos = await positions(store)
        return all(pos[n] == 60 for n in URGENT)

    await until(urgent_done)
    others = {n: p for n, p in (await positions(store)).items() if n not in URGENT}
    assert others and all(p == 30 for p in others.values())  # not due for an hour

    proj.catch_up_interval = 0.05
    await store.append(events(5, "c"))
    proj.poke()

    async def all_done() -> bool:
        return set((await positions(store)).values()) == {65}

    await until(all_done)  # no request: the catch-up came due by itself
    await store.append(events(10, "d"))
    proj.poke()
    await proj.request()
    assert set((await positions(store)).values()) == {75}
    assert proj.reached >= 75
    await proj.close()


class _Recording(Runner):
    """A runner that records its steps and appends more events after the first step of
    a non-urgent projection (an ingest committing in the middle of a catch-up)."""

    def __init__(self, store: Store, more: Sequence[Event], batch_size: int) -> None:
        super().__init__(store, batch_size=batch_size)
        self.calls: list[tuple[str, int | None]] = []
        self.more = list(more)
        self.appended_at: int | None = None

    async def step(self, proj: Projection, upto: int | None = None,
                   size: int | None = None) -> int:
        self.calls.append((proj.name, upto))
        n = await super().step(proj, upto, size)
        if proj.name not in URGENT and self.more:
            batch, self.more = self.more, []
            await self.store.append(batch)
            self.appended_at = len(self.calls)
        return n


async def test_urgent_view_goes_before_every_batch_of_the_others(store: Store,
                                                                 tmp_path: Path) -> None:
    """Events committed during a catch-up are projected into the urgent view before the
    next batch of any other projection, and the pass still ends at its own target."""
    await store.append(events(50, "p"))
    runner = _Recording(store, events(5, "q"), batch_size=10)
    proj = Projector(store, runner, min_interval=0)
    await proj.run_pass()
    at = runner.appended_at
    assert at is not None
    assert runner.calls[at] == (URGENT[0], 55)  # the new head, before anything else
    assert all(name in URGENT for name, upto in runner.calls if upto == 55)
    pos = await positions(store)
    assert all(pos[n] == 55 for n in URGENT)
    assert all(pos[n] >= 50 for n in pos)
    await proj.request()  # and everything converges
    fresh = await fresh_replay(store, tmp_path)
    assert await dump_views(store, t.VIEW_TABLES) == await dump_views(fresh, t.VIEW_TABLES)
    await fresh.close()
    await proj.close()



async def test_urgent_batches_are_fused_rounds_on_the_inline_thread(
        sqlite_url: str, register_path: str, tmp_path: Path) -> None:
    """Where the store's write transactions run inline (a projecting worker process,
    `workers.runtime`), the urgent views' batches are fused rounds there, one
    transaction each and no step of theirs, and so are the other projections' slices
    but those of the sparse ones (which step); every view ends as a replay from
    scratch makes it."""
    store = Store(sqlite_url, register_path=register_path)
    await store.open()
    assert store.use_inline() and store.inline is not None
    inline = store.inline
    ran: list[str] = []
    real_run = inline.run

    async def run(body: Any) -> Any:
        ran.append(threading.current_thread().name)
        return await real_run(body)

    inline.run = run  # type: ignore[method-assign]
    try:
        await store.append(events(10, "t"))
        runner = _Recording(store, [], batch_size=15)
        proj = Projector(store, runner, min_interval=0, catch_up_interval=3600)
        await proj.request()
        assert set((await positions(store)).values()) == {10}
        await store.append(events(40, "u"))
        runner.calls.clear()
        ran.clear()
        proj._active_at = float("inf")  # appends arriving: the others wait their turn
        await proj.run_pass(full=False)
        pos = await positions(store)
        assert all(pos[n] == 50 for n in URGENT)
        assert all(pos[n] == 10 for n in pos if n not in URGENT)
        assert not runner.calls  # no step: the urgent views went in rounds
        assert len(ran) == 3  # 40 positions in batches of 15: three transactions
        await store.append(events(8, "v"))
        runner.calls.clear()
        await proj.request()  # a full pass: the others step, the urgent view first
        assert set((await positions(store)).values()) == {58}
        # Only the sparse projections step (their step reads their own events only);
        # the others went in rounds of their own.
        sparse = {p.name for p in runner.projections if getattr(p, "sparse", False)}
        assert sparse and {name for name, _ in runner.calls} == sparse
        fresh = await fresh_replay(store, tmp_path)
        assert await dump_views(store, t.VIEW_TABLES) == \
            await dump_views(fresh, t.VIEW_TABLES)
        await fresh.close()
        await proj.close()
    finally:
        await store.close()

# -- broadcast wake-ups -------------------------------------------------------------------

@pytest.mark.redis
async def test_wakeups_are_broadcast_to_every_listener(redis_db: str) -> None:
    """Every listening process hears each wake-up (and one on subscribing); a sender
    coalesces a burst of commits and always announces the latest head."""
    redis.Redis.from_url(redis_db).flushdb()
    heard = [threading.Event(), threading.Event()]
    listeners = [WakeListener(redis_db, ev.set) for ev in heard]
    broker = LedgerBroker(redis_db)
    sent: list[int] = []
    send = broker_sender(broker)

    def record(head: int) -> None:
        sent.append(head)
        send(head)

    sender = WakeSender(record)
    try:
        for listener in listeners:
            listener.start()
        for ev in heard:
            assert await asyncio.to_thread(ev.wait, 20)  # subscribed
            ev.clear()
        for head in range(1, 30):
            sender.notify(head)
        await sender.close()
        await asyncio.sleep(0.05)
        await sender.close()
        assert sent[-1] == 29 and len(sent) < 29
        for ev in heard:
            assert await asyncio.to_thread(ev.wait, 20)
        assert all(listener.heard >= 1 for listener in listeners)
    finally:
        for listener in listeners:
            await asyncio.to_thread(listener.stop)
        broker.client.close()


async def test_listener_survives_a_down_broker(tmp_path: Path) -> None:
    """With the broker unreachable the listener keeps trying quietly and stops on
    request; a wake-up that cannot be sent is dropped, never raised to the append."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    listener = WakeListener(url, lambda: None, retry_s=0.05)
    listener.start()
    sender = WakeSender(broker_sender(LedgerBroker(url)))
    sender.notify(3)
    await sender.close()
    assert sender.failures == 1
    await asyncio.sleep(0.2)
    await asyncio.to_thread(listener.stop)
    assert listener.heard == 0
