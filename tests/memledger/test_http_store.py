"""LangGraph Platform's store routes (`/store/items`, ..., docs/http.md) against a real
`memledger serve` process, through the official `langgraph-sdk` client and plain httpx,
on SQLite and PostgreSQL: the SDK's round trip with its `x-api-key` header, a principal's
store scoped to its own user (nothing crosses users or tenants over any store route,
R24), deletes that are real forgets (no byte left, R20; in the server's forget register,
R21), LangGraph's namespace rules as problems."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langgraph_sdk import get_sync_client
from langgraph_sdk.errors import UnprocessableEntityError

from ledger import keys
from ledger.store import Store
from tests.memledger.test_http import Server

Served = tuple[Server, dict[str, str]]

#: name -> (kind, tenant, user) of the keys each test's server knows.
KEYS = {"u7": ("principal", "shop-a", "u7"), "u8": ("principal", "shop-a", "u8"),
        "x1": ("principal", "shop-b", "u7"), "shop-a": ("tenant", "shop-a", None),
        "op": ("operator", None, None), "revoked": ("principal", "shop-a", "u7")}


async def _make_keys(db_url: str, register: str) -> dict[str, str]:
    store = Store(db_url, register_path=register)
    try:
        out = {}
        for name, (kind, tenant, user) in KEYS.items():
            out[name], info = await keys.create_key(store, kind, tenant=tenant, user=user)
        assert await keys.revoke_key(store, info.key_id) is not None  # the last one
    finally:
        await store.close()
    return out


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    """A server on `db_url` with the keys of `KEYS` (one store session makes them all)."""
    register = str(tmp_path / "ledger.forgets")
    ks = asyncio.run(_make_keys(db_url, register))
    srv = Server(db_url, register, "--rate-limit", "0")
    try:
        yield srv, ks
    finally:
        srv.stop()


def keyed(srv: Server, key: str | None) -> httpx.Client:
    """A client that sends `key` as the langgraph-sdk does, in `x-api-key`."""
    return httpx.Client(base_url=srv.url, timeout=60,
                        headers={"x-api-key": key} if key is not None else {})


#: Every store route with a body or parameters aimed at u7's item `prefs/lang`.
STORE_ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("PUT", "/store/items", {"json": {"namespace": ["prefs"], "key": "lang",
                                      "value": {"v": "mine"}}}),
    ("GET", "/store/items", {"params": {"namespace": "prefs", "key": "lang"}}),
    ("DELETE", "/store/items", {"json": {"namespace": ["prefs"], "key": "lang"}}),
    ("POST", "/store/items/search", {"json": {"namespace_prefix": []}}),
    ("POST", "/store/namespaces", {"json": {}}),
]


def test_the_sdk_store_client_round_trip(served: Served) -> None:
    """`get_sync_client(url, api_key).store`: put, get, search (filter, paging), list
    namespaces (prefix, max depth), delete; the items are the principal's memories below
    the user (`GET /v1/memories` sees them) and a bearer header works as well; the
    namespace rules answer 422 (`namespace_rules_are_problems`)."""
    srv, ks = served
    client = get_sync_client(url=srv.url, api_key=ks["u7"])
    store = client.store
    store.put_item(["prefs"], key="lang", value={"v": "zh", "n": 1})
    store.put_item(["prefs", "work"], key="editor", value={"v": "vim", "n": 2})
    store.put_item(["notes"], key="n1", value={"v": "x", "n": 3}, ttl=60)
    got = store.get_item(["prefs"], key="lang")
    assert (got["namespace"], got["key"], got["value"]) == (["prefs"], "lang",
                                                            {"v": "zh", "n": 1})
    assert got["created_at"] == got["updated_at"]
    store.put_item(["prefs"], key="lang", value={"v": "en", "n": 1})
    again = store.get_item(["prefs"], key="lang")
    assert again["value"] == {"v": "en", "n": 1}
    assert again["created_at"] == got["created_at"] < again["updated_at"]

    every = store.search_items([], limit=10)["items"]
    assert sorted((tuple(i["namespace"]), i["key"]) for i in every) == [
        (("notes",), "n1"), (("prefs",), "lang"), (("prefs", "work"), "editor")]
    assert all(i["score"] is None for i in every)
    below = store.search_items(["prefs"], filter={"n": {"$gte": 2}})["items"]
    assert [i["key"] for i in below] == ["editor"]
    pages = [store.search_items(["prefs"], limit=1, offset=k)["items"] for k in (0, 1, 2)]
    assert sorted(p[0]["key"] for p in pages[:2]) == ["editor", "lang"] and pages[2] == []

    assert store.list_namespaces()["namespaces"] == [["notes"], ["prefs"],
                                                     ["prefs", "work"]]
    assert store.list_namespaces(prefix=["prefs"], max_depth=1)["namespaces"] == [["prefs"]]
    assert store.list_namespaces(suffix=["work"])["namespaces"] == [["prefs", "work"]]

    with srv.client(ks["u7"]) as u7:  # the same memory, through the /v1 routes
        mem = u7.get("/v1/memories", params={"namespace": "prefs", "key": "lang"}).json()
        assert mem["namespace"] == ["shop-a", "u7", "prefs"]
        assert mem["value"] == {"v": "en", "n": 1} and mem["version"] == 2
        r = u7.get("/store/items", params={"namespace": "prefs.work", "key": "editor"})
        assert r.status_code == 200 and r.json()["value"]["v"] == "vim"

    store.delete_item(["prefs"], key="lang")
    assert store.get_item(["prefs"], key="lang") is None
    with srv.client(ks["u7"]) as u7:
        assert u7.get("/v1/memories", params={"namespace": "prefs", "key": "lang"}
                      ).status_code == 404
        hist = u7.get(f"/v1/memories/{mem['memory_id']}/history")
        assert hist.status_code == 404  # forgotten: no longer readable by id either
    client.close()
    namespace_rules_are_problems(srv, ks)


def test_store_routes_keep_each_user_to_their_own_store(served: Served) -> None:
    """u8 (same tenant) and u7 of shop-b see and change nothing of shop-a/u7's store over
    any store route, whatever namespace they name; service, operator, missing, revoked
    and mismatched keys are refused (403 / 401); `/ok` needs no key."""
    srv, ks = served
    with keyed(srv, ks["u7"]) as u7:
        for ns, key in ((["prefs"], "lang"), (["shop-a", "u7", "prefs"], "lang"),
                        (["u7", "prefs"], "lang")):
            r = u7.put("/store/items", json={"namespace": ns, "key": key,
                                             "value": {"v": "LEAK-CANARY"}})
            assert r.status_code == 204, r.text
    for who in ("u8", "x1"):
        with keyed(srv, ks[who]) as c:
            seen = [c.request(m, p, **kw) for m, p, kw in STORE_ROUTES]
            seen += [c.get("/store/items", params={"namespace": ns, "key": "lang"})
                     for ns in ("shop-a.u7.prefs", "u7.prefs", "prefs", "shop-b.u7.prefs")]
            seen += [c.post("/store/items/search", json={"namespace_prefix": p})
                     for p in ([], ["shop-a"], ["u7"], ["shop-a", "u7"])]
            seen += [c.post("/store/namespaces", json={"prefix": p, "max_depth": 6})
                     for p in (None, ["shop-a"], ["u7"])]
            for r in seen:
                assert r.status_code in (200, 204), r.text
                assert b"LEAK-CANARY" not in r.content, (who, r.request.url, r.text)
            # their own put landed in their own store, the delete removed only that
            assert c.get("/store/items", params={"namespace": "prefs", "key": "lang"}
                         ).json() is None
            assert c.post("/store/namespaces", json={}).json()["namespaces"] == []
    with keyed(srv, ks["u7"]) as u7:  # u7's items are all still there, untouched
        items = u7.post("/store/items/search", json={"namespace_prefix": []}).json()["items"]
        assert sorted(i["key"] for i in items) == ["lang"] * 3
        assert {i["value"]["v"] for i in items} == {"LEAK-CANARY"}
        assert sorted(u7.post("/store/namespaces", json={}).json()["namespaces"]) == [
            ["prefs"], ["shop-a", "u7", "prefs"], ["u7", "prefs"]]
    for who in ("shop-a", "op"):
        with keyed(srv, ks[who]) as c:
            for m, p, kw in STORE_ROUTES:
                r = c.request(m, p, **kw)
                assert r.status_code == 403 and r.json()["field"] == "authorization", p
    for token in (None, "garbage", ks["revoked"]):
        with keyed(srv, token) as c:
            for m, p, kw in STORE_ROUTES:
                r = c.request(m, p, **kw)
                assert r.status_code == 401 and r.json()["rule"] == "api_key", (token, p)
    with httpx.Client(base_url=srv.url, headers={"x-api-key": ks["u7"],
                                                 "Authorization": f"Bearer {ks['u8']}"}) as c:
        assert c.get("/store/items", params={"namespace": "prefs", "key": "lang"}
                     ).status_code == 401  # two different keys: whose request is it?
    assert httpx.get(srv.url + "/ok").json() == {"ok": True}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_store_delete_is_a_forget_that_leaves_no_bytes(served: Served) -> None:
    """A value put and deleted through the store routes is in no file of the ledger
    afterwards (R20), and the delete is in the server's forget register (R21)."""
    srv, ks = served
    register = Path(srv.register)
    before = register.read_bytes() if register.exists() else b""
    client = get_sync_client(url=srv.url, api_key=ks["u7"])
    client.store.put_item(["pets"], key="p1", value={"name": "WOMBAT-store-7731"})
    client.store.put_item(["pets", "old"], key="p2", value={"name": "WOMBAT-store-7732"})
    assert len(client.store.search_items(["pets"])["items"]) == 2
    client.store.delete_item(["pets"], key="p1")
    client.store.delete_item(["pets", "old"], key="p2")
    assert client.store.search_items(["pets"])["items"] == []
    client.close()
    with srv.client(ks["op"]) as op:
        assert op.post("/v1/verify", json={"forgotten": True}).json()["ok"] is True
    srv.stop()
    after = register.read_bytes()
    assert len(after) > len(before)  # two forgets recorded where the server keeps them
    db = Path(srv.db_url.split(":///", 1)[1])
    files = [*db.parent.glob(db.name + "*"), register]
    assert files and all(b"WOMBAT" not in p.read_bytes() for p in files)


def namespace_rules_are_problems(srv: Server, ks: dict[str, str]) -> None:
    """LangGraph's namespace rules (no '.', no empty label, root not 'langgraph') and
    memledger's depth (six labels below the user) are 422 problems naming the field;
    the SDK raises them as its own `UnprocessableEntityError`."""
    with keyed(srv, ks["u7"]) as c:
        cases = [
            (c.put("/store/items", json={"namespace": ["a.b"], "key": "k", "value": {}}),
             "body.namespace.0"),
            (c.put("/store/items", json={"namespace": [""], "key": "k", "value": {}}),
             "body.namespace.0"),
            (c.put("/store/items", json={"namespace": [], "key": "k", "value": {}}),
             "body.namespace"),
            (c.put("/store/items", json={"namespace": ["langgraph"], "key": "k",
                                         "value": {}}), "body.namespace.0"),
            (c.put("/store/items", json={"namespace": list("abcdefg"), "key": "k",
                                         "value": {}}), "body.namespace"),
            (c.get("/store/items", params={"namespace": "", "key": "k"}),
             "query.namespace.0"),
            (c.get("/store/items", params={"namespace": "a..b", "key": "k"}),
             "query.namespace.1"),
            (c.post("/store/items/search", json={"namespace_prefix": ["x"], "nope": 1}),
             "body.nope"),
            (c.put("/store/items", json={"namespace": ["a"], "key": "k", "value": 3}),
             "body.value"),
        ]
        for r, field in cases:
            assert r.status_code == 422, r.text
            assert r.json()["field"] == field, r.text
        for value in ({"blob": "x" * 17_000}, {"card": "4111 1111 1111 1111"}):
            r = c.put("/store/items", json={"namespace": ["a"], "key": "k", "value": value})
            assert r.status_code == 422 and "4111" not in r.text, r.text  # memledger's rules
    client = get_sync_client(url=srv.url, api_key=ks["u7"])
    with pytest.raises(UnprocessableEntityError):
        client.store.put_item(["langgraph", "x"], key="k", value={"v": 1})
    deep = list("abcdef")
    client.store.put_item(deep, key="k", value={"v": 1})  # six labels: the most
    assert client.store.get_item(deep, key="k")["value"] == {"v": 1}
    client.close()
