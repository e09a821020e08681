"""The HTTP API: a thin ASGI adapter over the SDK (`memledger.MemoryLedger`).

No rule of its own: every write is an event built by `memledger.events` and appended by
the SDK, every read a `Principal` read. What it adds is the edge: who is calling (the
API key, `ledger.keys`), what that key may do, request limits, the one error shape
(`memledger.server.problems`) and metrics (`memledger.server.metrics`). docs/http.md
describes the routes.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
import structlog
from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from ledger.builders import Source
from ledger.errors import MemledgerError, ValidationError
from ledger.events import Event
from ledger.keys import KeyInfo, authenticate
from ledger.records import AppendResult
from ledger.validation import parse_event
from memledger import events as build
from memledger._ledger import MemoryLedger, Principal
from memledger.server import models as m
from memledger.server.metrics import Metrics
from memledger.server.problems import (
    ERROR_RESPONSES,
    Problem,
    forbidden,
    from_error,
    not_found,
    reason,
    unauthorized,
)
from memledger.server.store_routes import StorePool, store_router
from replay.audit import audit, audit_record
from replay.status import shard_table, status_report
from replay.verify import verify
from replay.verify.forgotten import verify_forgotten
from workers.health import broker_report
from workers.publish import PublishResult

log = structlog.get_logger("memledger.server")

#: The source kinds a principal's own key may write with; `operator` and
#: `system_of_record` events come from a tenant's service key or the operator's.
PRINCIPAL_SOURCES = frozenset({"explicit_user_request", "user_statement", "model_inference",
                               "tool_output", "retrieved_document"})

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]],
                    Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Settings:
    """What `memledger serve` configures."""

    db_url: str | None = None
    register_path: str | None = None
    broker: str | None = None
    #: Requests per second per key (a token bucket of `burst`); 0 turns the limit off.
    rate_limit: float = 50.0
    burst: int = 100
    max_body: int = 1 << 20
    max_batch: int = 1000
    #: `/readyz` fails when a projection lags the head by more than this many events.
    max_lag: int = 10_000


class RateLimiter:
    """A token bucket per API key: `check` raises 429 with `Retry-After` when empty."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self._buckets: dict[str, tuple[float, float]] = {}

    def check(self, key_id: str, now: float | None = None) -> None:
        """Take one token for `key_id`, or refuse the request."""
        if self.rate <= 0:
            return
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(key_id, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._buckets[key_id] = (tokens, now)
            wait = math.ceil((1.0 - tokens) / self.rate)
            raise Problem(429, "too many requests", f"rate limit of {self.rate:g} requests "
                          "per second for this key", rule="rate_limit",
                          headers={"Retry-After": str(max(1, wait))})
        self._buckets[key_id] = (tokens - 1.0, now)


class _TooLarge(Exception):
    pass


class Edge:
    """ASGI middleware: the body-size limit and the per-route metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics, max_body: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body = max_body

    async def __call__(self, scope: MutableMapping[str, Any],
                       receive: Callable[[], Awaitable[Any]],
                       send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        sent = False

        async def send_wrapped(msg: MutableMapping[str, Any]) -> None:
            nonlocal status, sent
            if msg["type"] == "http.response.start":
                status, sent = int(msg["status"]), True
            await send(msg)

        received = 0

        async def receive_limited() -> Any:
            nonlocal received
            msg = await receive()
            if msg.get("type") == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_body:
                    raise _TooLarge
            return msg

        try:
            length = dict(scope.get("headers") or []).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                raise _TooLarge
            await self.app(scope, receive_limited, send_wrapped)
        except _TooLarge:
            if not sent:
                await _send_problem(send_wrapped, _too_large(self.max_body))
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.request(scope.get("method", "?"), template, status,
                                 time.perf_counter() - started)


def _too_large(limit: int) -> Problem:
    return Problem(413, "request too large", f"the body exceeds {limit} bytes",
                   field="body", rule="max_body")


async def _send_problem(send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
                        p: Problem) -> None:
    body = orjson.dumps(p.body())
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in p.headers.items()]
    await send({"type": "http.response.start", "status": p.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def problem_response(p: Problem) -> JSONResponse:
    """The JSON response of a problem."""
    return JSONResponse(p.body(), status_code=p.status, headers=p.headers)


def _field(loc: Any) -> str:
    return ".".join(str(x) for x in loc)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error becomes a problem object; none echoes input or shows a traceback."""

    async def on_problem(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Problem)
        if exc.status == 429:
            metrics.rate_limited += 1
        return problem_response(exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = list(exc.errors())
        first = errors[0] if errors else {}
        metrics.reject("request_validation")
        # `msg` states the rule; the error's `input` (the value sent) is never included.
        return problem_response(Problem(422, "invalid request",
                                        str(first.get("msg", "invalid request")),
                                        field=_field(first.get("loc", ())) or None,
                                        rule=str(first.get("type", "invalid"))))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if isinstance(exc.__cause__, _TooLarge):
            return problem_response(_too_large(app.state.settings.max_body))
        if exc.status_code == 400:
            return problem_response(Problem(400, "malformed request",
                                            "the body could not be read", field="body",
                                            rule="malformed"))
        title = {404: "not found", 405: "method not allowed"}.get(exc.status_code, "error")
        return problem_response(Problem(exc.status_code, title, title,
                                        rule=title.replace(" ", "_"),
                                        headers=dict(exc.headers or {})))

    async def on_core(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, MemledgerError)
        metrics.reject(reason(exc))
        p = from_error(exc)
        if p.status >= 500:
            log.warning("request_failed", error=type(exc).__name__)
        return problem_response(p)

    async def on_any(request: Request, exc: Exception) -> JSONResponse:
        # The class only: an exception's text may quote the request.
        log.error("request_crashed", error=type(exc).__name__,
                  route=getattr(request.scope.get("route"), "path", None))
        return problem_response(Problem(500, "internal error", "the request failed",
                                        rule="internal"))

    app.add_exception_handler(Problem, on_problem)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(MemledgerError, on_core)
    app.add_exception_handler(Exception, on_any)


# -- identity -----------------------------------------------------------------------------

_bearer = HTTPBearer(auto_error=False, description="an API key from `memledger keys create`")
_api_key = APIKeyHeader(name="x-api-key", auto_error=False,
                        description="the same key, in the header the langgraph-sdk sends")


def _ledger(request: Request) -> MemoryLedger:
    ml: MemoryLedger = request.app.state.ledger
    return ml


async def identity(request: Request,
                   cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                   api_key: Annotated[str | None, Depends(_api_key)] = None) -> KeyInfo:
    """The key's identity (`Authorization: Bearer` or `x-api-key`); 401 without a valid
    key or with two different ones, 429 past the key's rate limit."""
    given = {k for k in (cred.credentials if cred else None, api_key) if k}
    if len(given) != 1:
        raise unauthorized()
    info = await authenticate(_ledger(request).store, given.pop())
    if info is None:
        raise unauthorized()
    request.app.state.limiter.check(info.key_id)
    return info


Identity = Annotated[KeyInfo, Depends(identity)]


async def principal_of(request: Request, info: Identity) -> Principal:
    """The principal of a principal's key; 403 for a tenant or operator key."""
    if info.kind != "principal" or info.tenant is None or info.user is None:
        raise forbidden("this route reads and writes one user's memory: use a key made "
                        "with `memledger keys create --principal TENANT/USER`",
                        field="authorization")
    return _ledger(request).principal(info.tenant, info.user)


User = Annotated[Principal, Depends(principal_of)]


async def operator_of(info: Identity) -> KeyInfo:
    """The operator's key; 403 for any other."""
    if info.kind != "operator":
        raise forbidden("an operator route: use a key made with `memledger keys create "
                        "--operator`", field="authorization")
    return info


Operator = Annotated[KeyInfo, Depends(operator_of)]


def _own(u: Principal, body: m.Owner) -> None:
    """A body that names a principal must name the key's own."""
    if body.tenant is not None and body.tenant != u.tenant:
        raise forbidden("the body names another tenant than the key's", field="tenant",
                        rule="principal")
    if body.user is not None and body.user != u.user:
        raise forbidden("the body names another user than the key's", field="user",
                        rule="principal")


def _source(src: m.SourceIn | None, default_id: str = "http") -> Source:
    if src is None:
        return Source.user_request(default_id)
    base = Source.user_request(src.id, seq=src.seq, at=src.at, event_id=src.event_id)
    return Source(src.kind, base.id, base.at, base.seq, base.event_id)


def _user_source(src: m.SourceIn | None) -> Source:
    if src is not None and src.kind not in PRINCIPAL_SOURCES:
        raise forbidden(f"a principal's key may not write with source kind {src.kind!r}; "
                        "use a tenant service key on POST /v1/events",
                        field="source.kind", rule="source_kind")
    return _source(src)


def _write_out(res: AppendResult | PublishResult, memory_id: str | None = None
               ) -> dict[str, Any]:
    if isinstance(res, PublishResult):
        return {"status": res.status, "position": None, "suppressed": False,
                "memory_id": memory_id}
    return {"status": res.status, "position": res.position, "suppressed": res.suppressed,
            "memory_id": memory_id}


def _parts(namespace: str) -> list[str]:
    return namespace.split("/") if namespace else []


AsOf = Annotated[str | None, Query(
    max_length=64, description="read as the ledger held it then: an RFC 3339 time (by "
    "recording time) or position:N (docs/projections.md#as-of)")]
Wait = Annotated[bool, Query(description="return once durable and readable (default); "
                                         "false: publish, or append without projecting")]


# -- the routes ---------------------------------------------------------------------------

async def no_nul(request: Request) -> None:
    """Refuse a NUL character in a query or path parameter (422): no database stores it
    in text (PostgreSQL refuses it), so no stored name can contain one."""
    for where, params in (("query", request.query_params), ("path", request.path_params)):
        for name, value in params.items():
            if "\x00" in str(value):
                raise Problem(422, "invalid request", "must not contain a NUL character",
                              field=f"{where}.{name}", rule="no_nul")


def _routes(metrics: Metrics) -> APIRouter:
    r = APIRouter(responses=ERROR_RESPONSES, dependencies=[Depends(no_nul)])

    async def submit(request: Request, ev: Event, wait: bool) -> AppendResult | PublishResult:
        res = await _ledger(request).submit(ev, wait=wait)
        metrics.event(res.status)
        return res

    @r.post("/v1/memories", response_model=m.WriteOut, tags=["memories"])
    async def remember(request: Request, u: User, body: m.RememberIn, wait: Wait = True
                       ) -> dict[str, Any]:
        """Write a memory for the key's principal (`Principal.remember`)."""
        _own(u, body)
        ev = build.write(tenant=u.tenant, actor=u.user, namespace=u.namespace(body.namespace),
                         key=body.key, value=body.value, source=_user_source(body.source),
                         task=body.task, session=body.session, memory_id=body.memory_id,
                         scope=body.scope, supersedes=body.supersedes,
                         expires_at=body.expires_at, text=body.text,
                         idempotency_key=body.idempotency_key,
                         expected_version=body.expected_version)
        return _write_out(await submit(request, ev, wait), ev.memory_id)

    @r.get("/v1/memories", response_model=m.MemoryOut, tags=["memories"])
    async def get_memory(u: User, key: Annotated[str, Query(min_length=1, max_length=256)],
                         namespace: Annotated[str, Query(
                             max_length=2048, description="below the user: a/b")] = "",
                         task: Annotated[str | None, Query(max_length=256)] = None,
                         session: Annotated[str | None, Query(max_length=256)] = None,
                         as_of: AsOf = None) -> dict[str, Any]:
        """The active value of a key (session beats task beats long-term), or 404."""
        got = await u.get(_parts(namespace), key, task=task, session=session, as_of=as_of)
        if got is None:
            raise not_found()
        return got.to_dict()

    @r.get("/v1/memories/{memory_id}", response_model=m.MemoryOut, tags=["memories"])
    async def get_by_id(u: User, memory_id: str) -> dict[str, Any]:
        """One memory version by id; another user's id is a 404 like an unknown one."""
        got = await u.get_by_id(memory_id)
        if got is None:
            raise not_found()
        return got.to_dict()

    @r.get("/v1/memories/{memory_id}/history", response_model=m.HistoryOut,
           tags=["memories"])
    async def history(u: User, memory_id: str, as_of: AsOf = None) -> dict[str, Any]:
        """Every version of the memory's key, oldest first; forgotten ones redacted."""
        got = await u.get_by_id(memory_id)
        if got is None:
            raise not_found()
        versions = await u.history(list(got.namespace[2:]), got.key, as_of=as_of)
        return {"versions": [v.to_dict() for v in versions]}

    async def forget(request: Request, u: User, ev: Event, target: dict[str, Any],
                     wait: bool) -> dict[str, Any]:
        res = await submit(request, ev, wait)
        covered: list[str] = []
        if isinstance(res, AppendResult) and wait and not res.suppressed:
            covered = await u.covered_by(res.position)
        return {**_write_out(res), "target": target, "covered": covered}

    @r.delete("/v1/memories/{memory_id}", response_model=m.ForgetOut, tags=["memories"])
    async def delete_memory(request: Request, u: User, memory_id: str, wait: Wait = True
                            ) -> dict[str, Any]:
        """Forget one memory by id (a real forget: erased everywhere once projected)."""
        if await u.get_by_id(memory_id) is None:
            raise not_found()
        ev = build.forget_memory(tenant=u.tenant, actor=u.user, memory_id=memory_id,
                                 source=_source(None))
        return await forget(request, u, ev, {"memory_id": memory_id}, wait)

    @r.post("/v1/forget", response_model=m.ForgetOut, tags=["memories"])
    async def forget_route(request: Request, u: User, body: m.ForgetIn, wait: Wait = True
                           ) -> dict[str, Any]:
        """Forget by `memory_id`, by `namespace` + `key`, or by `namespace_prefix`."""
        _own(u, body)
        targets = [body.memory_id is not None,
                   body.namespace is not None or body.key is not None,
                   body.namespace_prefix is not None]
        if sum(targets) != 1 or (targets[1] and (body.namespace is None or body.key is None)):
            raise Problem(422, "invalid request", "give exactly one target: memory_id, "
                          "namespace with key, or namespace_prefix", field="body",
                          rule="one_target")
        src = _user_source(body.source)
        env: dict[str, Any] = {"tenant": u.tenant, "actor": u.user, "source": src,
                               "reason": body.reason, "idempotency_key": body.idempotency_key}
        if body.memory_id is not None:
            if await u.get_by_id(body.memory_id) is None:
                raise not_found()
            ev = build.forget_memory(memory_id=body.memory_id, **env)
            target: dict[str, Any] = {"memory_id": body.memory_id}
        elif body.namespace is not None and body.key is not None:
            ev = build.forget_key(namespace=u.namespace(body.namespace), key=body.key, **env)
            target = {"namespace": body.namespace, "key": body.key}
        else:
            prefix = body.namespace_prefix or []
            ev = build.forget_prefix(namespace_prefix=u.namespace(prefix), **env)
            target = {"namespace_prefix": prefix}
        return await forget(request, u, ev, target, wait)

    @r.post("/v1/recall", response_model=m.RecallOut, tags=["recall"])
    async def recall(u: User, body: m.RecallIn) -> dict[str, Any]:
        """Memories and open tasks to put before a model turn, with the audit id."""
        _own(u, body)
        started = time.perf_counter()
        got = await u.recall(body.query, session=body.session, task=body.task,
                             budget=body.budget, limit=body.limit, as_of=body.as_of)
        metrics.recall.observe((), time.perf_counter() - started)
        return got.to_dict()

    @r.get("/v1/tasks", response_model=m.TasksOut, tags=["tasks"])
    async def tasks(u: User, include_closed: bool = False, as_of: AsOf = None
                    ) -> dict[str, Any]:
        """The principal's task summaries (open ones unless `include_closed`)."""
        return {"tasks": [x.to_dict() for x in await u.tasks(include_closed=include_closed,
                                                             as_of=as_of)]}

    @r.post("/v1/events", response_model=m.EventsOut, tags=["events"])
    async def post_events(request: Request, info: Identity,
                          body: Annotated[dict[str, Any] | list[dict[str, Any]], Body(
                              description="one wire event or a list (docs/events.md)")],
                          wait: Wait = True) -> Any:
        """Append wire events, each on its own, with `memledger append`'s results.

        For a tenant's service key and the operator's; a tenant key writes its own
        tenant only (403 for the whole request otherwise, nothing appended).
        """
        if info.kind == "principal":
            raise forbidden("a principal's key writes through /v1/memories and /v1/forget;"
                            " POST /v1/events takes a tenant service key or the operator's",
                            field="authorization")
        items = body if isinstance(body, list) else [body]
        limit = request.app.state.settings.max_batch
        if len(items) > limit:
            raise Problem(413, "request too large", f"at most {limit} events per request",
                          field="body", rule="max_batch")
        ml = _ledger(request)
        results: list[dict[str, Any] | None] = [None] * len(items)
        parsed: list[tuple[int, Event]] = []
        for i, item in enumerate(items):
            try:
                ev = parse_event(dict(item))
            except ValidationError as e:
                metrics.event("rejected")
                metrics.reject(reason(e))
                results[i] = {"line": i + 1, "status": "rejected", "position": None,
                              "error": str(e)}
                continue
            if info.kind == "tenant" and ev.tenant != info.tenant:
                raise forbidden("a tenant service key writes events of its own tenant "
                                "only", field=f"body.{i}.tenant" if isinstance(body, list)
                                else "body.tenant", rule="tenant")
            parsed.append((i, ev))
        if not wait and ml.broker_url is not None:
            published = await ml.publish([ev for _, ev in parsed]) if parsed else []
            for (i, _), pub in zip(parsed, published, strict=True):
                metrics.event(pub.status)
                results[i] = {"line": i + 1, "status": pub.status,
                              **({"error": pub.error} if pub.error else {})}
        else:
            top = 0
            for i, ev in parsed:
                try:
                    res = await ml.append(ev)
                except MemledgerError as e:
                    metrics.event("rejected")
                    metrics.reject(reason(e))
                    results[i] = {"line": i + 1, "status": "rejected", "position": None,
                                  "error": str(e)}
                    continue
                metrics.event(res.status)
                top = max(top, res.position)
                line: dict[str, Any] = {"line": i + 1, "status": res.status,
                                        "position": res.position}
                if res.suppressed:
                    line["suppressed"] = True
                results[i] = line
            if wait and top > 0:
                await ml.runner.catch_up(upto=top)
        done = [x for x in results if x is not None]
        # As `memledger append` prints them: absent keys stay absent (not null).
        return JSONResponse({"results": done,
                             "rejected": sum(x["status"] == "rejected" for x in done)})

    # -- operator routes ---------------------------------------------------------------

    @r.get("/v1/status", tags=["operator"])
    async def status(request: Request, _: Operator) -> dict[str, Any]:
        """Head, projections' positions and lag (`memledger status`)."""
        ml = _ledger(request)
        report = await status_report(ml.store)
        if ml.broker_url is not None:
            report.update(await broker_report(ml.broker_url))
        return report

    @r.get("/v1/audit", tags=["operator"])
    async def audit_route(request: Request, _: Operator,
                          memory_id: Annotated[str | None, Query(max_length=256)] = None,
                          namespace: Annotated[str | None, Query(max_length=2048)] = None,
                          key: Annotated[str | None, Query(max_length=256)] = None,
                          task: Annotated[str | None, Query(max_length=256)] = None,
                          tenant: Annotated[str | None, Query(max_length=128)] = None
                          ) -> dict[str, Any]:
        """The history of a memory, key or task (`memledger replay audit`)."""
        ns = namespace.split("/") if namespace else None
        return await audit(_ledger(request).store, memory_id=memory_id or None,
                           namespace=ns, key=key or None, task=task or None,
                           tenant=tenant or None)

    @r.get("/v1/audit/{audit_id}", tags=["operator"])
    async def audit_of_recall(request: Request, _: Operator, audit_id: str
                              ) -> dict[str, Any]:
        """One recall audit record; 404 if there is none."""
        try:
            return await audit_record(_ledger(request).store, audit_id)
        except ValidationError as e:
            if e.field != "audit_id":
                raise
            raise not_found("recall audit record") from None

    @r.post("/v1/verify", tags=["operator"])
    async def verify_route(request: Request, _: Operator,
                           body: Annotated[m.VerifyIn | None, Body()] = None
                           ) -> dict[str, Any]:
        """Integrity (or, with `forgotten`, erasure) checks (`memledger replay verify`)."""
        b = body or m.VerifyIn()
        store = _ledger(request).store
        if b.forgotten:
            return await verify_forgotten(store, catch_up=b.catch_up, limit=b.limit)
        return await verify(store, catch_up=b.catch_up, views=b.views, limit=b.limit)

    # -- probes ------------------------------------------------------------------------
    @r.get("/healthz", response_model=m.Health, tags=["probes"])
    async def healthz() -> dict[str, Any]:
        """The process answers."""
        return {"ok": True}

    @r.get("/readyz", response_model=m.Ready, tags=["probes"],
           responses={503: {"model": m.Ready, "description": "not ready"}})
    async def readyz(request: Request) -> Any:
        """The database answers and no projection lags more than `max_lag` events."""
        ml = _ledger(request)
        try:
            head = await ml.store.head()
            lag = {n: head - p for n, p in (await ml.runner.positions()).items()}
        except MemledgerError as e:
            return JSONResponse({"ready": False, "detail": type(e).__name__}, 503)
        ready = all(v <= request.app.state.settings.max_lag for v in lag.values())
        body = {"ready": ready, "head": head, "lag": lag}
        return body if ready else JSONResponse(body, 503)

    @r.get("/metrics", response_class=PlainTextResponse, tags=["probes"])
    async def metrics_route(request: Request) -> str:
        """Prometheus text format: requests, latency, events, rejects, recall, lag."""
        ml = _ledger(request)
        lag: dict[str, int] = {}
        shard_lag: dict[tuple[str, int], int] = {}
        owners: dict[int, str] = {}
        with contextlib.suppress(MemledgerError):
            head = await ml.store.head()
            lag = {n: head - p for n, p in (await ml.runner.positions()).items()}
            _, per_shard, owners = await shard_table(ml.store, list(lag))
            shard_lag = {(n, k): head - p for n, at in per_shard.items()
                         for k, p in at.items()}
        queues: dict[str, int] = {}
        if ml.broker_url is not None:
            rep = (await broker_report(ml.broker_url)).get("broker", {})
            queues = {q: int(v.get("ready", 0))
                      for q, v in (rep.get("queues") or {}).items()}
        return metrics.render(lag, queues, shard_lag, owners)

    return r


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ASGI app of `memledger serve` (run it with any ASGI server)."""
    cfg = settings or Settings()
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ml = MemoryLedger(cfg.db_url, register_path=cfg.register_path, broker=cfg.broker)
        await ml.open()
        app.state.ledger = ml
        app.state.stores = StorePool(ml.store.url, cfg.register_path)
        try:
            yield
        finally:
            await app.state.stores.close()
            await ml.close()

    app = FastAPI(title="memledger", version="1", lifespan=lifespan,
                  description="The HTTP API of memledger (docs/http.md). Every request "
                              "but the probes carries `Authorization: Bearer <key>` (or "
                              "the key in `x-api-key`).")
    app.state.settings = cfg
    app.state.limiter = RateLimiter(cfg.rate_limit, cfg.burst)
    app.state.metrics = metrics
    install_error_handlers(app, metrics)
    app.include_router(_routes(metrics))
    app.include_router(store_router(identity))
    app.add_middleware(Edge, metrics=metrics, max_body=cfg.max_body)  # type: ignore[arg-type]
    return app

