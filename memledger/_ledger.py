"""The SDK: `MemoryLedger` (an open ledger) and `Principal` (one user's memory in it).

Both are thin: every rule lives in the core (validation, the append path, the
projections, the principal-scoped reads). `MemoryLedger` appends events and runs the
projections; `Principal` builds events on a user's behalf and reads what that user
may read, nothing else (R24).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

import orjson

from ledger import builders
from ledger.builders import Source, SourceLike
from ledger.errors import BrokerUnavailable, ValidationError
from ledger.events import Event
from ledger.records import AppendResult
from ledger.store import Store
from ledger.validation import parse_event
from memledger import migrations
from memledger.results import Memory, MemoryVersion, Recall, TaskSummary
from projections import asof, matrix_snapshot, reads
from projections.recall import recall as run_recall
from projections.runner import Runner
from projections.vectors import store_embedder
from replay import config

if TYPE_CHECKING:
    # Imported when the first publish needs it: the broker's client (redis, dramatiq)
    # is about a sixth of a CLI process's start-up, and most processes never publish.
    from workers.publish import Publisher, PublishResult

EventLike = Event | Mapping[str, Any]


def _now_us() -> int:
    return time.time_ns() // 1000


def as_event(obj: EventLike) -> Event:
    """Accept a validated `Event` or a wire dict (validated here)."""
    return obj if isinstance(obj, Event) else parse_event(dict(obj))


class MemoryLedger:
    """An open ledger: `async with MemoryLedger(url) as ml: ...`.

    `url` is a SQLAlchemy async URL (`sqlite+aiosqlite:///./memledger.db`, the default,
    or `postgresql+asyncpg://...`). `broker` (a Redis URL) is needed only for
    `wait=False` publishing, which hands events to the worker daemons instead of
    appending them in this process.
    """

    def __init__(self, url: str | None = None, *, register_path: str | None = None,
                 broker: str | None = None, migrate: bool = False,
                 inline_writes: bool = True) -> None:
        """`migrate=True` upgrades a database whose schema is behind when the ledger
        opens (`memledger db upgrade`); without it such a database is refused with
        the command to run. Meant for the embedded default, where the app is the only
        user of its file; a shared server is upgraded by its operator.

        `inline_writes` (on by default): on a SQLite file, write transactions (the
        append group, the projection round of a `wait=True` write, the recall audit)
        each run in one hand-off to a thread of their own (`ledger.inline`,
        `Store.use_inline`) instead of four thread hand-offs per statement through
        the async driver; docs/sdk.md, "Write transactions". No effect on PostgreSQL
        or an in-memory database. `inline_writes=False` keeps every write, appends
        included, on the async driver."""
        self.store = Store(url, register_path=register_path, inline_appends=inline_writes)
        if inline_writes:
            self.store.use_inline()
        self._migrate = migrate
        self.runner = Runner(self.store)
        self._broker_url = broker
        self._publisher: Publisher | None = None

    async def __aenter__(self) -> MemoryLedger:
        return await self.open()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def open(self) -> MemoryLedger:
        """Open the database (creating the schema of a new one); `async with` does this."""
        if self._migrate:
            await migrations.upgrade(self.store.url)
        await self.store.open()
        # The ledger's recorded embedder (`memledger config set embedder`), loaded now:
        # a model that is not installed here fails at open, naming the extra to install.
        await store_embedder(self.store)
        return self

    async def close(self) -> None:
        """Release the database connections and the broker connection."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        await matrix_snapshot.settled()  # recall's snapshot files still being written
        await self.store.close()

    @property
    def broker_url(self) -> str | None:
        """The broker `wait=False` publishes to, if the ledger was opened with one."""
        return self._broker_url

    def principal(self, tenant: str, user: str | None = None) -> Principal:
        """One user's memory: `ml.principal("shop-a", "u7")` or `ml.principal("shop-a/u7")`."""
        if user is None:
            who = reads.Principal.parse(tenant)
            return Principal(self, who.tenant, who.user)
        return Principal(self, *_checked_principal(tenant, user))

    # -- writes ------------------------------------------------------------------------
    @overload
    async def append(self, events: EventLike, *, wait: bool = ...) -> AppendResult: ...

    @overload
    async def append(self, events: Sequence[EventLike], *, wait: bool = ...
                     ) -> list[AppendResult]: ...

    async def append(self, events: EventLike | Sequence[EventLike], *, wait: bool = False
                     ) -> AppendResult | list[AppendResult]:
        """Append one event or a batch (all or none); with `wait`, also project them.

        Raw wire dicts are validated here, as `memledger append` validates a line. With
        `wait=True` the call returns once the events are durable and every view shows
        them: confirm "I'll remember that" to the user only then (R16).
        """
        # `Runner.round`: every view moved in one view transaction (one hand-off with
        # inline writes) where they are within a batch of the events, else step by step.
        if isinstance(events, Event | Mapping):
            one = await self.store.append_one(as_event(events))
            if wait:
                await self.runner.round(upto=max(one.position, 0))
            return one
        many = await self.store.append([as_event(e) for e in events])
        if wait and many:
            await self.runner.round(upto=max(r.position for r in many))
        return many

    async def submit(self, event: Event, *, wait: bool) -> AppendResult | PublishResult:
        """Append and project (`wait=True`), or hand over without waiting (`wait=False`).

        Without waiting, the event goes to the broker when the ledger was opened with
        `broker=`, for the worker daemons to append; otherwise it is appended here (it
        is durable when this returns) and projected by whoever runs the projections
        next (a worker, `memledger project`, or a later `wait=True` call).
        """
        if wait or self._broker_url is None:
            return await self.append(event, wait=wait)
        (res,) = await self.publish([event])
        if res.status == "not_sent":
            raise BrokerUnavailable(res.error or "the broker did not take the event")
        if res.status == "rejected":
            raise ValidationError("", res.error or "rejected")
        return res

    async def publish(self, events: Sequence[EventLike]) -> list[PublishResult]:
        """Hand events to the broker for the worker daemons to append (needs `broker=`).

        One result per event: `published`, `rejected` (invalid, with the reason) or
        `not_sent` (the broker was unreachable: tell the user it was not saved).
        """
        if self._broker_url is None:
            raise ValidationError("broker", "this ledger was opened without a broker URL; "
                                  "pass broker='redis://...' to MemoryLedger to publish")
        if self._publisher is None:
            from workers.publish import Publisher
            self._publisher = Publisher(self._broker_url)
        return await self._publisher.apublish([as_event(e) for e in events])

    async def project(self) -> dict[str, int]:
        """Run every projection in this process until it has caught up."""
        return await self.runner.catch_up()

    # -- settings ----------------------------------------------------------------------
    async def embedder(self) -> EmbedderSetting:
        """The ledger's embedder, where it comes from and what the vector index holds
        (`memledger config get embedder`; docs/recall.md, "Embedders")."""
        return EmbedderSetting.of(await config.embedder_report(self.store))

    async def set_embedder(self, name: str, *, rebuild: bool = True) -> EmbedderSetting:
        """Record the ledger's embedder (`memledger config set embedder NAME`): every
        process that opens the ledger then indexes and recalls with it.

        `name` is a built-in (`hashgram` or `hashgram-v2-512`, the default;
        `hashgram-v1-512`, with the bilingual concept list; `minilm`, `e5-small` with
        `memledger[models]`) or a name registered with
        `projections.vectors.register_embedder`; an unknown name, or a model whose
        package is not installed here, raises `ValidationError` and records nothing.
        With `rebuild` (the default) the vector index is rebuilt with it before this
        returns, unless it already holds only that model's vectors; without, recall
        skips the old model's vectors until `memledger replay rebuild --projection
        vectors` runs.
        """
        await config.set_embedder(self.store, name, rebuild_index=rebuild,
                                  runner=self.runner)
        return await self.embedder()


@dataclass(frozen=True)
class EmbedderSetting:
    """A ledger's embedder (`MemoryLedger.embedder`).

    `name`: the embedder used, as its vectors are named; `source`: where that comes
    from (`recorded` by `set_embedder` or `memledger config set`, `MEMLEDGER_EMBEDDER`,
    `vectors`: the model the stored vectors carry, or `default`); `recorded`: the
    recorded name, if any; `index_models`: vectors per model name in the index;
    `index_current`: whether the index holds that model's vectors only (False until a
    rebuild after a change); `dim`: the vectors' width.
    """

    name: str
    source: str
    recorded: str | None
    index_models: dict[str, int]
    index_current: bool
    dim: int

    @classmethod
    def of(cls, report: dict[str, Any]) -> EmbedderSetting:
        """From `replay.config.embedder_report`'s dict (the embedder loads here)."""
        if "error" in report:
            raise ValidationError("embedder", str(report["error"]))
        return cls(name=str(report["model"]), source=str(report["source"]),
                   recorded=report["recorded"], index_models=dict(report["index_models"]),
                   index_current=bool(report["index_current"]), dim=int(report["dim"]))


def _memory(got: dict[str, Any]) -> Memory:
    """`Memory.from_dict` for a dict nobody else holds: the dict itself is its kept copy
    (`to_dict`), and the attributes get new copies of what a caller could change
    through them (the value and the source, each by an orjson round trip where it is a
    container; the namespace becomes a tuple): a fraction of `copy.deepcopy`'s cost,
    and less than a round trip of the whole dict (it holds JSON values only: it was
    decoded from the view row, and its other entries are strings, numbers or None)."""
    return Memory(got["memory_id"], tuple(got["namespace"]), got["key"],
                  _json_copy(got["value"]), got["layer"], got["version"], got["status"],
                  _json_copy(got["source"]), got.get("task_key"), got.get("session_id"),
                  got.get("scope"), got.get("expires_at"), got)


def _json_copy(v: Any) -> Any:
    """A copy of a decoded JSON value that shares nothing mutable with it."""
    if isinstance(v, dict | list):
        return orjson.loads(orjson.dumps(v))
    return v


_CONTROL = re.compile("[\x00-\x1f]")


def _checked_principal(tenant: str, user: str) -> tuple[str, str]:
    if isinstance(tenant, str) and isinstance(user, str) and tenant and user \
            and "/" not in tenant and "/" not in user \
            and not _CONTROL.search(tenant) and not _CONTROL.search(user):
        return tenant, user  # what `Principal.parse` accepts, without building the text
    who = reads.Principal.parse(f"{tenant}/{user}")
    if (who.tenant, who.user) != (tenant, user):
        raise ValidationError("principal", "tenant and user must not contain '/'")
    return who.tenant, who.user


class Principal:
    """One user's memory: reads are scoped to the user, writes are owned by the user.

    Namespaces are given below the user: `["preferences"]` means
    `[tenant, user, "preferences"]`. Writes are on the user's behalf (`actor` is the
    user) unless `actor=` names the operator or service that writes for them.
    """

    def __init__(self, ledger: MemoryLedger, tenant: str, user: str) -> None:
        self.ledger = ledger
        self.tenant = tenant
        self.user = user
        self._who = reads.Principal(tenant, user)

    def __repr__(self) -> str:
        return f"Principal({self.tenant!r}, {self.user!r})"

    def namespace(self, parts: Sequence[str] = ()) -> list[str]:
        """The full namespace of `parts` below this user."""
        if isinstance(parts, str):
            raise ValidationError("namespace", "give the namespace as a list of parts")
        return [self.tenant, self.user, *parts]

    def _env(self, actor: str | None, source: SourceLike) -> dict[str, Any]:
        return {"tenant": self.tenant, "actor": actor or self.user, "source": source}

    # -- memory writes -----------------------------------------------------------------
    async def remember(self, namespace: Sequence[str], key: str, value: Any, *,
                       source: SourceLike, task: str | None = None,
                       session: str | None = None, memory_id: str | None = None,
                       scope: str | None = None, supersedes: str | None = None,
                       expires_at: str | None = None, text: str | None = None,
                       idempotency_key: str | None = None,
                       expected_version: int | None = None, actor: str | None = None,
                       wait: bool = True) -> AppendResult | PublishResult:
        """Write a memory; the layer is `session` / `task` when one is given, else long.

        With `wait=True` (the default) this returns once the memory is durable and
        readable; see `MemoryLedger.submit` for `wait=False`.
        """
        ev = builders.write(namespace=self.namespace(namespace), key=key, value=value,
                            task=task, session=session, memory_id=memory_id, scope=scope,
                            supersedes=supersedes, expires_at=expires_at, text=text,
                            idempotency_key=idempotency_key,
                            expected_version=expected_version, **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    async def correct(self, namespace: Sequence[str], key: str, value: Any, *,
                      supersedes: str, source: SourceLike, task: str | None = None,
                      session: str | None = None, memory_id: str | None = None,
                      scope: str | None = None, expires_at: str | None = None,
                      text: str | None = None, idempotency_key: str | None = None,
                      expected_version: int | None = None, actor: str | None = None,
                      wait: bool = True) -> AppendResult | PublishResult:
        """Correct a memory: a new version that supersedes the memory `supersedes`."""
        ev = builders.correct(namespace=self.namespace(namespace), key=key, value=value,
                              supersedes=supersedes, task=task, session=session,
                              memory_id=memory_id, scope=scope, expires_at=expires_at,
                              text=text,
                              idempotency_key=idempotency_key,
                              expected_version=expected_version, **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    async def supersede(self, memory_id: str, *, source: SourceLike,
                        superseded_by: str | None = None, idempotency_key: str | None = None,
                        actor: str | None = None, wait: bool = True
                        ) -> AppendResult | PublishResult:
        """Stop a memory being active."""
        ev = builders.supersede(memory_id=memory_id, superseded_by=superseded_by,
                                idempotency_key=idempotency_key, **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    async def confirm(self, memory_id: str, *, source: SourceLike,
                      idempotency_key: str | None = None, actor: str | None = None,
                      wait: bool = True) -> AppendResult | PublishResult:
        """Make a candidate active (the user or an operator confirms it)."""
        ev = builders.confirm(memory_id=memory_id, idempotency_key=idempotency_key,
                              **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    async def forget(self, namespace: Sequence[str], key: str, *, source: SourceLike,
                     reason: str | None = None, idempotency_key: str | None = None,
                     actor: str | None = None, wait: bool = True
                     ) -> AppendResult | PublishResult:
        """Forget a key in every layer: unreadable at once, erased everywhere (R20)."""
        ev = builders.forget_key(namespace=self.namespace(namespace), key=key, reason=reason,
                                 idempotency_key=idempotency_key, **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    async def forget_memory(self, memory_id: str, *, source: SourceLike,
                            reason: str | None = None, idempotency_key: str | None = None,
                            actor: str | None = None, wait: bool = True
                            ) -> AppendResult | PublishResult:
        """Forget one memory by its id."""
        ev = builders.forget_memory(memory_id=memory_id, reason=reason,
                                    idempotency_key=idempotency_key,
                                    **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    async def forget_all(self, namespace: Sequence[str] = (), *, source: SourceLike,
                         reason: str | None = None, idempotency_key: str | None = None,
                         actor: str | None = None, wait: bool = True
                         ) -> AppendResult | PublishResult:
        """Forget everything below `namespace` (everything about the user by default)."""
        ev = builders.forget_prefix(namespace_prefix=self.namespace(namespace), reason=reason,
                                    idempotency_key=idempotency_key,
                                    **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    # -- task writes -------------------------------------------------------------------
    async def open_task(self, task_key: str, *, source: SourceLike,
                        namespace: Sequence[str] = (), refs: Mapping[str, str] | None = None,
                        title: str | None = None, idempotency_key: str | None = None,
                        actor: str | None = None, wait: bool = True
                        ) -> AppendResult | PublishResult:
        """Open a task owned by this user (or by `namespace` below the user)."""
        ev = builders.open_task(task_key=task_key, namespace=self.namespace(namespace),
                                refs=refs, title=title, idempotency_key=idempotency_key,
                                **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    async def note_task(self, task_key: str, kind: str, text: str, *, source: SourceLike,
                        fields: Mapping[str, Any] | None = None,
                        idempotency_key: str | None = None, actor: str | None = None,
                        wait: bool = True) -> AppendResult | PublishResult:
        """Add a note to a task (`system_status` needs a `Source.system(...)` source)."""
        ev = builders.note_task(task_key=task_key, kind=kind, text=text, fields=fields,
                                idempotency_key=idempotency_key, **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    async def close_task(self, task_key: str, *, source: SourceLike,
                         resolution: str | None = None, retain_until: str | None = None,
                         idempotency_key: str | None = None, actor: str | None = None,
                         wait: bool = True) -> AppendResult | PublishResult:
        """Close a task; `retain_until` is when its content is purged."""
        ev = builders.close_task(task_key=task_key, resolution=resolution,
                                 retain_until=retain_until, idempotency_key=idempotency_key,
                                 **self._env(actor, source))
        return await self.ledger.submit(ev, wait=wait)

    # -- reads -------------------------------------------------------------------------
    async def get(self, namespace: Sequence[str], key: str, *, task: str | None = None,
                  session: str | None = None, as_of: str | None = None) -> Memory | None:
        """The active value of `key` for this user (session beats task beats long-term).

        `as_of` (an RFC 3339 time or `position:N`) reads it as the ledger held it then
        (docs/projections.md#as-of): content forgotten since comes back `redacted`."""
        if as_of is not None:
            then = await asof.read_get(self.ledger.store, self._who, self.namespace(namespace),
                                       key, as_of=as_of, task=task, session=session)
            return Memory.from_dict(then) if then.get("found") else None
        store = self.ledger.store
        ns, now_us = self.namespace(namespace), _now_us()
        got = reads.get_now(store, self._who, ns, key, now_us=now_us, task=task,
                            session=session)
        if got is None:  # PostgreSQL: the statement prepared on a driver connection
            got = await reads.get_driver(store, self._who, ns, key, now_us=now_us,
                                         task=task, session=session)
        if got is None:  # neither here (busy, an error to report): the async path
            async with store.read_once() as conn:
                got = await reads.get(conn, self._who, ns, key, now_us=now_us, task=task,
                                      session=session)
        return _memory(got) if got.get("found") else None

    async def get_by_id(self, memory_id: str) -> Memory | None:
        """One memory version by its id, if this user may read it; else `None`.

        Active, candidate or superseded versions are returned (`status` says which);
        a forgotten or expired one, another user's and an unknown id are all `None`.
        """
        async with self.ledger.store.read_once() as conn:
            got = await reads.get_by_id(conn, self._who, memory_id, now_us=_now_us())
        return Memory.from_dict(got) if got.get("found") else None

    async def covered_by(self, position: int) -> list[str]:
        """The ids of this user's memory versions the forget at `position` covers."""
        async with self.ledger.store.read() as conn:
            return await reads.covered_by(conn, self._who, position)

    async def history(self, namespace: Sequence[str], key: str, *, as_of: str | None = None
                      ) -> list[MemoryVersion]:
        """Every version of a key, oldest first; forgotten ones redacted. With `as_of`,
        the versions the ledger held then, with the status each had then."""
        async with self.ledger.store.read() as conn:
            if as_of is not None:
                instant = await asof.resolve(conn, as_of)
                rows = await asof.history(conn, self._who, self.namespace(namespace), key,
                                          instant=instant)
            else:
                rows = await reads.history(conn, self._who, self.namespace(namespace), key)
        return [MemoryVersion.from_dict(r) for r in rows]

    async def tasks(self, *, include_closed: bool = False, as_of: str | None = None
                    ) -> list[TaskSummary]:
        """This user's task summaries (open ones unless `include_closed`); with `as_of`,
        as they were then."""
        async with self.ledger.store.read() as conn:
            if as_of is not None:
                instant = await asof.resolve(conn, as_of)
                rows = await asof.tasks(conn, self._who, instant=instant,
                                        include_closed=include_closed)
            else:
                rows = await reads.tasks(conn, self._who, include_closed=include_closed)
        return [TaskSummary.from_dict(r) for r in rows]

    async def recall(self, query: str | None = None, *, session: str | None = None,
                     task: str | None = None, budget: int | None = None,
                     limit: int = 20, as_of: str | None = None) -> Recall:
        """Memories and open tasks to put before a model turn, with an audit id (R25);
        with `as_of`, what recall would have chosen from the memory held then."""
        if limit < 1:
            raise ValidationError("limit", "must be at least 1")
        if as_of is not None:
            got = await asof.recall(self.ledger.store, f"{self.tenant}/{self.user}",
                                    as_of=as_of, query=query, session=session, task=task,
                                    budget=budget, limit=limit, now_us=_now_us())
            return Recall.from_dict(got)
        out = await run_recall(self.ledger.store, f"{self.tenant}/{self.user}", query=query,
                               session=session, task=task, budget=budget, limit=limit,
                               now_us=_now_us())
        return Recall.from_dict(out)


__all__ = ["EventLike", "MemoryLedger", "Principal", "Source", "as_event"]
