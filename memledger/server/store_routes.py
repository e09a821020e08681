"""LangGraph Platform's store routes over `memledger.langgraph` (docs/http.md).

`PUT /store/items`, `GET /store/items`, `DELETE /store/items`, `POST /store/items/search`,
`POST /store/namespaces` and `GET /ok`, with the bodies the official `langgraph-sdk`
store client sends and reads, so `get_client(url=..., api_key=...).store` works against
`memledger serve` unchanged.

Only a principal's key may use them, and it sees one store: its own user's. A
namespace `(a, b)` of the key `T/U` is the LangGraph adapter's namespace `(U, a, b)` in
a store of tenant `T` scoped to the principal `T/U` (`MemledgerStore(principal=...)`,
which filters by the user's namespace prefix in the SQL of every read and refuses a
write outside it). That is the memledger namespace `[T, U, a, b]`: where `POST
/v1/memories` with `namespace: ["a", "b"]` writes. A put is a `memory.written`, a delete
a `memory.forgotten` (a real forget, R20), through the adapter.

The adapter runs its ledger on its own event loop thread; the server keeps one adapter
store per principal that used the store routes recently (`StorePool`, bounded).
"""

# No `from __future__ import annotations` here: FastAPI must see the route parameters'
# types (the dependencies made inside `store_router`) when the routes are defined.
import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from langgraph.store.base import InvalidNamespaceError, SearchItem
from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints

from ledger.keys import KeyInfo
from memledger.langgraph import AsyncMemledgerStore, encode_key, encode_label
from memledger.server.problems import ERROR_RESPONSES, Problem, forbidden

#: memledger namespaces have at most 8 parts: the tenant, the user and six labels.
MAX_LABELS = 6
#: Adapter stores kept open at once (each holds a thread and a connection pool).
MAX_OPEN_STORES = 32

Label = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[^.\x00]+$")]
Key = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StorePutIn(_In):
    """`PUT /store/items`: what `StoreClient.put_item` sends."""

    namespace: list[Label] = Field(min_length=1, max_length=MAX_LABELS)
    key: Key
    value: dict[str, JsonValue]
    index: Literal[False] | Annotated[list[Annotated[str, StringConstraints(max_length=256)]],
                                      Field(max_length=32)] | None = None
    ttl: float | None = Field(default=None, gt=0, le=10 * 365 * 24 * 60,
                              description="minutes until the item expires")


class StoreDeleteIn(_In):
    """`DELETE /store/items`: what `StoreClient.delete_item` sends."""

    namespace: list[Label] = Field(min_length=1, max_length=MAX_LABELS)
    key: Key


class StoreSearchIn(_In):
    """`POST /store/items/search`: what `StoreClient.search_items` sends."""

    namespace_prefix: list[Label] = Field(default_factory=list, max_length=MAX_LABELS)
    filter: dict[str, JsonValue] | None = None
    limit: int = Field(default=10, ge=1, le=1000)
    offset: int = Field(default=0, ge=0, le=1_000_000)
    query: str | None = Field(default=None, max_length=4096)
    refresh_ttl: bool | None = None


class StoreNamespacesIn(_In):
    """`POST /store/namespaces`: what `StoreClient.list_namespaces` sends."""

    prefix: list[Label] | None = Field(default=None, max_length=MAX_LABELS)
    suffix: list[Label] | None = Field(default=None, max_length=MAX_LABELS)
    max_depth: int | None = Field(default=None, ge=1, le=MAX_LABELS)
    limit: int = Field(default=100, ge=1, le=1000)
    offset: int = Field(default=0, ge=0, le=1_000_000)


class ItemOut(BaseModel):
    """An item as LangGraph's `Item.dict()` gives it (times in RFC 3339)."""

    namespace: list[str]
    key: str
    value: dict[str, JsonValue]
    created_at: str
    updated_at: str


class SearchItemOut(ItemOut):
    """A search hit; `score` is set only when a query ranked it."""

    score: float | None = None


class SearchOut(BaseModel):
    """`{"items": [...]}`."""

    items: list[SearchItemOut]


class NamespacesOut(BaseModel):
    """`{"namespaces": [[...], ...]}`."""

    namespaces: list[list[str]]


class OkOut(BaseModel):
    """`GET /ok`: the liveness probe LangGraph's clients and tests call."""

    ok: bool


# -- the stores ------------------------------------------------------------------------

@dataclass
class _Open:
    store: AsyncMemledgerStore
    users: int = 0


@dataclass
class StorePool:
    """One adapter store per principal, opened on first use, the least recently used
    idle ones closed past `size`."""

    url: str
    register_path: str | None
    size: int = MAX_OPEN_STORES
    _open: OrderedDict[tuple[str, str], _Open] = field(default_factory=OrderedDict)

    @contextlib.asynccontextmanager
    async def use(self, tenant: str, user: str) -> AsyncIterator[AsyncMemledgerStore]:
        """The store of principal `tenant/user`, held open while in use."""
        who = (tenant, user)
        entry = self._open.get(who)
        if entry is None:
            entry = _Open(AsyncMemledgerStore(
                url=self.url, tenant=tenant, principal=f"{tenant}/{user}",
                register_path=self.register_path, name="http",
                # LangGraph Platform's default: a read refreshes an item's TTL.
                ttl={"refresh_on_read": True}))
            self._open[who] = entry
        self._open.move_to_end(who)
        entry.users += 1
        try:
            yield entry.store
        finally:
            entry.users -= 1
            await self._trim()

    async def _trim(self) -> None:
        while len(self._open) > self.size:
            idle = next((w for w, e in self._open.items() if e.users == 0), None)
            if idle is None:
                return
            await asyncio.to_thread(self._open.pop(idle).store.close)

    async def close(self) -> None:
        """Close every store (the server is stopping)."""
        while self._open:
            _, entry = self._open.popitem()
            await asyncio.to_thread(entry.store.close)


# -- the routes ------------------------------------------------------------------------

def _check_namespace(namespace: list[str] | tuple[str, ...], where: str, *,
                     put: bool = False) -> tuple[str, ...]:
    """LangGraph's rules for a namespace (non-empty labels without `.` or NUL; a put's
    root label is not `langgraph`), and memledger's label length."""
    for i, label in enumerate(namespace):
        if not label or "." in label or "\x00" in label:
            raise Problem(422, "invalid request", "namespace labels are non-empty and "
                          "contain no '.' and no NUL character", field=f"{where}.{i}",
                          rule="namespace_label")
        try:
            encode_label(label)
        except InvalidNamespaceError:
            raise Problem(422, "invalid request", "a namespace label is too long once "
                          "encoded", field=f"{where}.{i}", rule="namespace_label") from None
    if len(namespace) > MAX_LABELS:
        raise Problem(422, "invalid request", f"at most {MAX_LABELS} namespace labels",
                      field=where, rule="namespace_depth")
    if put and namespace and namespace[0] == "langgraph":
        raise Problem(422, "invalid request", "the root label of a namespace cannot be "
                      "'langgraph'", field=f"{where}.0", rule="namespace_root")
    return tuple(namespace)


def _check_key(key: str, where: str) -> str:
    try:
        encode_key(key)
    except ValueError:
        raise Problem(422, "invalid request", "the key is too long once encoded",
                      field=where, rule="key") from None
    return key


def _below(user: str, ns: tuple[str, ...]) -> tuple[str, ...] | None:
    """The client's namespace of an adapter namespace `(user, ...)`; None if another
    user's (never returned: the adapter's SQL is scoped to the user already)."""
    return ns[1:] if ns[:1] == (user,) else None


def _item(user: str, it: SearchItem | Any, score: bool) -> dict[str, Any] | None:
    ns = _below(user, tuple(it.namespace))
    if ns is None:
        return None
    out: dict[str, Any] = it.dict()
    out["namespace"] = list(ns)
    if score:
        out.setdefault("score", None)
    return out


def store_router(identity: Callable[..., Coroutine[Any, Any, KeyInfo]]) -> APIRouter:
    """The store routes; `identity` is the app's key check (401, 429)."""
    r = APIRouter(responses=ERROR_RESPONSES, tags=["store"])

    async def principal_key(info: Annotated[KeyInfo, Depends(identity)]) -> KeyInfo:
        if info.kind != "principal" or info.tenant is None or info.user is None:
            raise forbidden("the store routes are one user's store: use a key made with "
                            "`memledger keys create --principal TENANT/USER`",
                            field="authorization")
        return info

    Who = Annotated[KeyInfo, Depends(principal_key)]

    @contextlib.asynccontextmanager
    async def store_of(request: Request, who: KeyInfo
                       ) -> AsyncIterator[tuple[AsyncMemledgerStore, str]]:
        assert who.tenant is not None and who.user is not None
        pool: StorePool = request.app.state.stores
        async with pool.use(who.tenant, who.user) as store:
            yield store, who.user

    @r.put("/store/items", status_code=204, response_class=Response)
    async def put_item(request: Request, who: Who, body: StorePutIn) -> Response:
        """Store or replace an item (a `memory.written`; `ttl` in minutes)."""
        ns = _check_namespace(body.namespace, "body.namespace", put=True)
        key = _check_key(body.key, "body.key")
        async with store_of(request, who) as (store, user):
            await store.aput((user, *ns), key, dict(body.value), index=body.index,
                             ttl=body.ttl)
        return Response(status_code=204)

    @r.get("/store/items", response_model=ItemOut | None)
    async def get_item(request: Request, who: Who,
                       key: Annotated[str, Query(min_length=1, max_length=256)],
                       namespace: Annotated[str, Query(
                           max_length=2048, description="the labels joined by '.'")] = "",
                       refresh_ttl: bool | None = None) -> Any:
        """The item, or `null` when there is none (as LangGraph Platform answers)."""
        ns = _check_namespace(namespace.split("."), "query.namespace")
        _check_key(key, "query.key")
        async with store_of(request, who) as (store, user):
            got = await store.aget((user, *ns), key, refresh_ttl=refresh_ttl)
        return None if got is None else _item(user, got, score=False)

    @r.delete("/store/items", status_code=204, response_class=Response)
    async def delete_item(request: Request, who: Who, body: StoreDeleteIn) -> Response:
        """Delete an item: a `memory.forgotten` of its key, erased everywhere (R20)."""
        ns = _check_namespace(body.namespace, "body.namespace")
        key = _check_key(body.key, "body.key")
        async with store_of(request, who) as (store, user):
            await store.adelete((user, *ns), key)
        return Response(status_code=204)

    @r.post("/store/items/search", response_model=SearchOut)
    async def search_items(request: Request, who: Who, body: StoreSearchIn
                           ) -> dict[str, Any]:
        """Items below a namespace prefix, newest first, filtered by value fields."""
        ns = _check_namespace(body.namespace_prefix, "body.namespace_prefix")
        async with store_of(request, who) as (store, user):
            found = await store.asearch((user, *ns), query=body.query,
                                        filter=dict(body.filter) if body.filter else None,
                                        limit=body.limit, offset=body.offset,
                                        refresh_ttl=body.refresh_ttl)
        items = [_item(user, it, score=True) for it in found]
        return {"items": [x for x in items if x is not None]}

    @r.post("/store/namespaces", response_model=NamespacesOut)
    async def list_namespaces(request: Request, who: Who, body: StoreNamespacesIn
                              ) -> dict[str, Any]:
        """The user's namespaces, matching `prefix` / `suffix`, cut at `max_depth`."""
        prefix = _check_namespace(body.prefix or [], "body.prefix")
        suffix = _check_namespace(body.suffix or [], "body.suffix")
        async with store_of(request, who) as (store, user):
            found = await store.alist_namespaces(
                prefix=(user, *prefix), suffix=suffix or None,
                max_depth=None if body.max_depth is None else body.max_depth + 1,
                limit=body.limit, offset=body.offset)
        below = [_below(user, tuple(ns)) for ns in found]
        return {"namespaces": [list(ns) for ns in below if ns]}

    @r.get("/ok", response_model=OkOut, tags=["probes"])
    async def ok() -> dict[str, Any]:
        """The process answers (LangGraph's clients probe `/ok`)."""
        return {"ok": True}

    return r
