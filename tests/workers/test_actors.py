"""Workers in process: retry policy, ingest idempotency, dead letters, wake-ups, publishing.

The actors' bodies run here against real databases (SQLite and PostgreSQL) and a real
Redis; `test_workers_daemon.py` runs the same code inside real worker processes.
"""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from sqlalchemy import select

from ledger import schema as t
from ledger.errors import (
    BrokerUnavailable,
    ConcurrencyConflict,
    IdempotencyConflict,
    StoreUnavailable,
    ValidationError,
)
from ledger.store import Store
from ledger.validation import parse_event
from projections.runner import Runner
from tests.factories import event, src, write
from tests.helpers import dump_views, fresh_replay
from workers import policy
from workers.broker import INGEST_QUEUE, LedgerBroker, queue_depths, safe_url
from workers.ingest import ingest_events, list_dead_letters, record_dead_letters
from workers.policy import Disposition
from workers.projector import Projector
from workers.publish import Publisher, publish

CARD = "4111 1111 1111 1111"  # a Luhn-valid test card number: must never be stored


def free_port() -> int:
    """A TCP port nothing listens on (a broker that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def broker_url(redis_db: str) -> str:
    """This run's Redis database, emptied for the test."""
    redis.Redis.from_url(redis_db).flushdb()
    return redis_db


class Deferred:
    """Collects what the ingest would send again later (instead of a broker)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[Any], int, int]] = []

    async def __call__(self, events: list[Any], deferrals: int, delay_ms: int) -> None:
        self.calls.append((events, deferrals, delay_ms))


async def lag(store: Store) -> int:
    """The largest projection lag."""
    head = await store.head()
    return max(head - p for p in (await Runner(store).positions()).values())


# -- policy (pure) ------------------------------------------------------------------------

def test_transient_errors_retry_and_invalid_ones_never_do() -> None:
    """Only transient failures are retried; invalid events go to dead letters at once."""
    assert policy.classify(StoreUnavailable("down")) is Disposition.RETRY
    assert policy.classify(TimeoutError()) is Disposition.RETRY
    assert policy.classify(ValidationError("data.key", "bad")) is Disposition.DEAD
    assert policy.classify(IdempotencyConflict("k")) is Disposition.DEAD
    assert policy.classify(ConcurrencyConflict("slot", 1, 2)) is Disposition.DEAD
    assert policy.should_retry(0, StoreUnavailable("down"))
    assert not policy.should_retry(policy.INGEST_MAX_RETRIES, StoreUnavailable("down"))
    assert not policy.should_retry(0, ValidationError("data.key", "bad"))


def test_missing_referent_is_deferred_with_growing_delays() -> None:
    """A note whose task is not ingested yet is tried again later, with backoff."""
    err = ValidationError("data.task_key", "no open task 'T900' owned by 'u7'; open it first")
    assert policy.classify(err) is Disposition.DEFER
    delays = [policy.defer_delay_ms(n) for n in range(policy.MAX_DEFERRALS)]
    assert delays == sorted(delays) and delays[0] == policy.DEFER_BASE_MS


def test_secret_dead_letter_keeps_envelope_only() -> None:
    """A dead letter for a secret keeps the envelope and never the data (R23)."""
    raw = write("card", CARD, idem="s1")
    with pytest.raises(ValidationError) as info:
        parse_event(raw)
    fields = policy.dead_letter_fields(raw, info.value)
    assert fields["withheld"] and "data" not in fields["payload"]
    assert fields["payload"]["idempotency_key"] == "s1"
    assert "4111" not in orjson.dumps(fields).decode()


def test_safe_url_hides_the_password() -> None:
    """Broker URLs shown in status and logs never carry the password."""
    assert safe_url("redis://:hunter2@db:6380/1") == "redis://:***@db:6380/1"
    assert safe_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# -- ingest against a real database -------------------------------------------------------

async def test_redelivered_message_appends_each_event_once(store: Store) -> None:
    """The same ingest message delivered N times appends its events once (R11)."""
    events = [write(f"k{i}", i, idem=f"dup-{i}") for i in range(20)]
    first = await ingest_events(store, events)
    assert first.appended == 20
    for _ in range(4):
        again = await ingest_events(store, [dict(e) for e in reversed(events)])
        assert again.duplicates == 20 and again.appended == 0
    assert await store.head() == 20


async def test_invalid_events_become_dead_letters_once(store: Store) -> None:
    """Rejected events are dead letters with their error; a redelivery adds none."""
    good = write("lang", "zh", idem="ok-1")
    bad = write("lang", "zh", idem="bad-1", etype="memory.nonsense")
    conflict = write("lang", "en", idem="ok-1")  # same key, other content
    msg = [good, bad, conflict, "not an object"]
    out = await ingest_events(store, msg)
    assert (out.appended, out.dead) == (1, 3)
    await ingest_events(store, msg)
    letters = await list_dead_letters(store)
    assert len(letters) == 3
    by_key = {d["idempotency_key"]: d for d in letters}
    assert "type" in by_key["bad-1"]["error"]
    assert "reused with different content" in by_key["ok-1"]["error"]
    assert by_key["ok-1"]["event"]["data"]["value"] == "en"
    assert await list_dead_letters(store, tenant="nobody") == []


async def test_secret_is_never_stored_in_a_dead_letter(store: Store) -> None:
    """A secret rejected by ingest leaves only its envelope in dead letters (R23)."""
    await ingest_events(store, [write("card", CARD, idem="card-1")])
    [letter] = await list_dead_letters(store)
    assert letter["content_withheld"] and "data" not in letter["event"]
    assert "R23" in letter["error"]
    async with store.read() as conn:
        rows = (await conn.execute(select(t.dead_letters))).all()
    dumped = repr([tuple(r) for r in rows])
    assert "4111" not in dumped and "1111 1111" not in dumped


async def test_note_before_its_task_is_deferred_then_appended(store: Store) -> None:
    """A note that overtook its task.opened is sent again later and then appended."""
    opened = event("task.opened", {"task_key": "T900", "namespace": ["shop-a", "u7"]},
                   idem="open-1")
    note = event("task.noted", {"task_key": "T900", "kind": "user_report",
                                "text": "left earbud crackles"}, idem="note-1",
                 source=src(at="2026-09-20T10:05:00+08:00"))
    later = Deferred()
    out = await ingest_events(store, [note], defer=later)
    assert out.deferred == 1 and later.calls[0][1:] == (1, policy.defer_delay_ms(0))
    await ingest_events(store, [opened])
    events, deferrals, _ = later.calls[0]
    retry = await ingest_events(store, events, deferrals=deferrals, defer=later)
    assert retry.appended == 1
    assert await list_dead_letters(store) == []


async def test_referent_that_never_arrives_ends_as_dead_letter(store: Store) -> None:
    """After the last deferral, a note for a task that never opened is a dead letter."""
    note = event("task.noted", {"task_key": "T404", "kind": "user_report", "text": "hi"},
                 idem="orphan-1")
    later = Deferred()
    out = await ingest_events(store, [note], deferrals=policy.MAX_DEFERRALS, defer=later)
    assert out.dead == 1 and later.calls == []
    [letter] = await list_dead_letters(store)
    assert "never ingested" in letter["error"]


async def test_unreachable_database_raises_for_a_retry(tmp_path: Path) -> None:
    """With the database down the ingest raises StoreUnavailable, so dramatiq retries."""
    port = free_port()
    down = Store(f"postgresql+asyncpg://postgres@127.0.0.1:{port}/nope",
                 register_path=str(tmp_path / "r.forgets"))
    with pytest.raises(StoreUnavailable):
        await ingest_events(down, [write("k", 1)])
    with pytest.raises(StoreUnavailable):
        await record_dead_letters(down, [({"x": 1}, ValidationError("", "bad"))])
    await down.close()


# -- wake-ups against a real database -----------------------------------------------------

async def test_wakeups_reordered_duplicated_or_lost_converge(store: Store, tmp_path: Path
                                                             ) -> None:
    """Wake-ups in any order, repeated, bogus or missing leave views equal a rebuild."""
    proj = Projector(store, min_interval=0)
    heads = []
    for i in range(6):
        evs = [parse_event(write(f"k{j % 7}", j, idem=f"w-{i}-{j}",
                                 source=src(at=f"2026-09-20T10:{i:02d}:{j:02d}+08:00")))
               for j in range(30)]
        res = await store.append(evs)
        heads.append(res[-1].position)
    wakes = [*heads, *heads, 10**9, 0, -4]
    random.Random(6).shuffle(wakes)
    await asyncio.gather(*(proj.request(h) for h in wakes[:5]))  # the rest are "lost"
    await proj.request()  # what the sweep does
    assert await lag(store) == 0
    assert await proj.request(heads[0]) is None  # an old wake-up: nothing to do
    fresh = await fresh_replay(store, tmp_path)
    assert await dump_views(store, t.VIEW_TABLES) == await dump_views(fresh, t.VIEW_TABLES)
    await fresh.close()
    await proj.close()


async def test_requests_during_a_pass_share_the_next_one(store: Store) -> None:
    """Many concurrent wake-ups cost two passes at most, not one each."""
    proj = Projector(store, min_interval=0)
    await store.append([parse_event(write(f"k{i}", i)) for i in range(50)])
    await asyncio.gather(*(proj.request() for _ in range(40)))
    assert proj.passes <= 2
    assert await lag(store) == 0
    await proj.close()


# -- publishing ---------------------------------------------------------------------------

def test_publish_validates_locally_then_sends(broker_url: str) -> None:
    """Valid events reach the ingest queue; invalid ones are rejected and never sent."""
    items: list[Any] = [write("a", 1), b"{not json", write("card", CARD), write("b", 2)]
    res = publish(items, redis_url=broker_url, batch_size=1)
    assert [r.status for r in res] == ["published", "rejected", "rejected", "published"]
    assert [r.line for r in res] == [1, 2, 3, 4]
    assert "malformed JSON" in str(res[1].error) and "R23" in str(res[2].error)
    broker = LedgerBroker(broker_url)
    assert queue_depths(broker.client)[INGEST_QUEUE]["ready"] == 2
    stored = repr(broker.client.hgetall(f"memledger:{INGEST_QUEUE}.msgs"))
    assert "4111" not in stored
    broker.client.close()


def test_publisher_sees_the_backlog_it_may_slow_down_for(broker_url: str) -> None:
    """`backlog()` counts the messages no worker has taken yet (back-pressure is the
    publisher's to apply); with the broker down it raises, never guesses."""
    with Publisher(broker_url, batch_size=10) as pub:
        assert pub.backlog() == 0
        pub.publish([write(f"k{i}", i, idem=f"bp-{i}") for i in range(35)])
        assert pub.backlog() == 4
    with Publisher(f"redis://127.0.0.1:{free_port()}/0") as down, \
            pytest.raises(BrokerUnavailable):
        down.backlog()


def test_publish_to_a_down_broker_reports_not_sent() -> None:
    """With Redis unreachable every valid event is reported not_sent, never lost silently."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    with Publisher(url, batch_size=2) as pub:
        res = pub.publish([write("a", 1), write("b", 2), {"type": "x"}, write("c", 3)])
    assert [r.status for r in res] == ["not_sent", "not_sent", "rejected", "not_sent"]
    assert all("not sent" in str(r.error) for r in res if r.status == "not_sent")


def test_several_processes_split_projection_from_ingest() -> None:
    """With --processes N and both queues, process 0 projects and sweeps, the rest ingest."""
    from workers.broker import DEFAULT_THREADS, PROJECT_QUEUE, PROJECT_THREADS
    from workers.daemon import roles
    from workers.runtime import Settings

    many = roles(Settings(redis_url="redis://x", processes=3))
    assert [r.queues for r in many] == [(PROJECT_QUEUE,), (INGEST_QUEUE,), (INGEST_QUEUE,)]
    assert {r.processes for r in many} == {1}
    # Ingest threads bound the messages in flight; the projector's only get wake-ups.
    assert [r.threads for r in many] == [PROJECT_THREADS, DEFAULT_THREADS, DEFAULT_THREADS]
    assert roles(Settings(redis_url="redis://x", processes=2, threads=4))[0].threads == 4
    only = roles(Settings(redis_url="redis://x", processes=2, queues=(INGEST_QUEUE,)))
    assert [r.queues for r in only] == [(INGEST_QUEUE,), (INGEST_QUEUE,)]


async def test_batched_appends_of_concurrent_messages_share_commits(store: Store) -> None:
    """Concurrent ingest messages held briefly by the batcher are appended together,
    each event still on its own: a bad one does not sink the others."""
    from workers.ingest import AppendBatcher

    batcher = AppendBatcher(store, linger=0.05)
    msgs = [[write(f"k{i}", i, idem=f"b-{i}")] for i in range(30)]
    msgs.append([write("card", CARD, idem="b-card")])
    outs = await asyncio.gather(*(ingest_events(store, m, append=batcher) for m in msgs))
    assert sum(o.appended for o in outs) == 30 and sum(o.dead for o in outs) == 1
    async with store.read() as conn:
        recorded = {r[0] for r in (await conn.execute(select(t.events.c.recorded_at))).all()}
    assert len(recorded) == 1  # one group-commit transaction stamped them all
