"""The HTTP API (docs/http.md) against a real `memledger serve` process on a loopback
port, through a real HTTP client, on SQLite and PostgreSQL: every route, the auth
matrix (401 / 403 / 404), cross-user and cross-tenant reads that leak nothing (R24),
`POST /v1/events` giving `memledger append`'s results, a forget over HTTP that leaves
no byte of the value in the database files (R20), problems that echo no secret (R23)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from ledger import keys
from ledger.store import Store
from tests.cli import BIN, Cli

SRC = {"kind": "explicit_user_request", "id": "C17"}


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_key(db_url: str, register: str, kind: str, tenant: str | None = None,
             user: str | None = None) -> tuple[str, str]:
    """(key, key_id) of a new key in the ledger at `db_url`."""
    async def go() -> tuple[str, str]:
        store = Store(db_url, register_path=register)
        try:
            key, info = await keys.create_key(store, kind, tenant=tenant, user=user)
        finally:
            await store.close()
        return key, info.key_id
    return asyncio.run(go())


class Server:
    """`memledger serve` as a subprocess on a free loopback port, ended by `stop`."""

    def __init__(self, db_url: str, register: str, *flags: str) -> None:
        self.db_url, self.register = db_url, register
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(BIN), "--db", db_url, "--forget-register", register, "serve", "--host",
             "127.0.0.1", "--port", str(self.port), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "MEMLEDGER_LOG_LEVEL": "WARNING"})
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(self.proc.communicate())
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError("memledger serve did not come up")
            time.sleep(0.1)

    def client(self, key: str | None = None) -> httpx.Client:
        """An HTTP client; with `key`, every request carries it as a bearer token."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def stop(self) -> bytes:
        """End the server (SIGTERM: a graceful shutdown); returns what it wrote on stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _, err = self.proc.communicate()
        return err


@pytest.fixture
def register(tmp_path: Path) -> str:
    return str(tmp_path / "ledger.forgets")


@pytest.fixture
def served(db_url: str, register: str) -> Iterator[tuple[Server, dict[str, str]]]:
    """A server on `db_url` and keys: u7, u8 (shop-a), x1 (shop-b), the two tenants'
    service keys, the operator's, and a revoked key of u7's."""
    ks = {
        "u7": make_key(db_url, register, "principal", "shop-a", "u7")[0],
        "u8": make_key(db_url, register, "principal", "shop-a", "u8")[0],
        "x1": make_key(db_url, register, "principal", "shop-b", "u7")[0],
        "shop-a": make_key(db_url, register, "tenant", "shop-a")[0],
        "shop-b": make_key(db_url, register, "tenant", "shop-b")[0],
        "op": make_key(db_url, register, "operator")[0],
    }
    revoked, revoked_id = make_key(db_url, register, "principal", "shop-a", "u7")
    asyncio.run(_revoke(db_url, register, revoked_id))
    ks["revoked"] = revoked
    srv = Server(db_url, register, "--rate-limit", "0")
    try:
        yield srv, ks
    finally:
        srv.stop()


async def _revoke(db_url: str, register: str, key_id: str) -> None:
    store = Store(db_url, register_path=register)
    try:
        assert await keys.revoke_key(store, key_id) is not None
    finally:
        await store.close()


def remember(c: httpx.Client, key: str, value: Any, seq: int, **extra: Any) -> dict[str, Any]:
    """POST /v1/memories and return the body (asserting 200)."""
    r = c.post("/v1/memories", json={"namespace": ["preferences"], "key": key,
                                     "value": value, "source": {
                                         **SRC, "seq": seq,
                                         "at": f"2026-11-30T10:00:{seq:02d}+00:00"},
                                     **extra})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


#: Every route a principal's key uses: (method, path, JSON body). `{id}` is filled in.
PRINCIPAL_ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/memories", {"namespace": ["p"], "key": "k", "value": 1, "source": SRC}),
    ("GET", "/v1/memories?namespace=preferences&key=reply_language", None),
    ("GET", "/v1/memories/{id}", None),
    ("GET", "/v1/memories/{id}/history", None),
    ("DELETE", "/v1/memories/{id}", None),
    ("POST", "/v1/forget", {"memory_id": "{id}"}),
    ("POST", "/v1/recall", {"query": "language"}),
    ("GET", "/v1/tasks", None),
]
OPERATOR_ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/v1/status", None),
    ("GET", "/v1/audit?task=T900", None),
    ("GET", "/v1/audit/nope", None),
    ("POST", "/v1/verify", {"catch_up": False, "views": False}),
]
EVENTS_ROUTE: list[tuple[str, str, Any]] = [("POST", "/v1/events", [])]


def call(c: httpx.Client, method: str, path: str, body: Any, mid: str) -> httpx.Response:
    """One request of a route table, with the memory id filled in."""
    path = path.replace("{id}", mid)
    if body is not None:
        body = orjson.loads(orjson.dumps(body).replace(b"{id}", mid.encode()))
    return c.request(method, path, json=body) if body is not None else c.request(method, path)


def test_auth_matrix(served: tuple[Server, dict[str, str]]) -> None:
    """No key, a malformed, unknown or revoked key: 401 everywhere but the probes; a key
    of the wrong kind: 403; another user's or tenant's memory id: 404, like an unknown
    one, on every route that takes an id (no existence oracle)."""
    srv, ks = served
    with srv.client(ks["u7"]) as u7:
        mid = remember(u7, "reply_language", "Simplified Chinese", 1)["memory_id"]
    everything = PRINCIPAL_ROUTES + OPERATOR_ROUTES + EVENTS_ROUTE
    for token in (None, "", "garbage", "mlk_0000_nope", ks["revoked"], ks["u7"] + "x"):
        with srv.client(token) as c:
            for method, path, body in everything:
                r = call(c, method, path, body, mid)
                assert r.status_code == 401, (token, method, path, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["rule"] == "api_key"
    for who in ("shop-a", "op"):  # a service or operator key is no principal
        with srv.client(ks[who]) as c:
            for method, path, body in PRINCIPAL_ROUTES:
                assert call(c, method, path, body, mid).status_code == 403, (who, path)
    for who in ("u7", "shop-a"):
        with srv.client(ks[who]) as c:
            for method, path, body in OPERATOR_ROUTES:
                assert call(c, method, path, body, mid).status_code == 403, (who, path)
    with srv.client(ks["u7"]) as c:
        assert c.post("/v1/events", json=[]).status_code == 403
    for who in ("u8", "x1"):  # same tenant other user; other tenant, same user name
        with srv.client(ks[who]) as c:
            for method, path, body in PRINCIPAL_ROUTES:
                if "{id}" in path or "{id}" in orjson.dumps(body).decode():
                    r = call(c, method, path, body, mid)
                    unknown = call(c, method, path, body, "m_unknown")
                    assert r.status_code == unknown.status_code == 404, (who, path, r.text)
                    assert r.json() == unknown.json()
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert httpx.get(srv.url + path).status_code == 200
    with srv.client(ks["u7"]) as u7:  # u7's memory is untouched by all of that
        assert u7.get(f"/v1/memories/{mid}").json()["value"] == "Simplified Chinese"


def test_reads_leak_nothing_across_users_and_tenants(
        served: tuple[Server, dict[str, str]]) -> None:
    """u7 of shop-a writes; u8 of shop-a and u7 of shop-b read every read route and see
    none of it (R24); a body naming another user or tenant is refused with 403."""
    srv, ks = served
    with srv.client(ks["u7"]) as u7:
        mid = remember(u7, "reply_language", "LEAK-CANARY-u7", 1)["memory_id"]
        r = u7.post("/v1/events", json={})
        assert r.status_code == 403
    with srv.client(ks["shop-a"]) as svc:
        r = svc.post("/v1/events", json={
            "type": "task.opened", "idempotency_key": "t1", "tenant": "shop-a",
            "actor": "aftersales", "data": {"task_key": "T900",
                                            "namespace": ["shop-a", "u7", "tickets"],
                                            "title": "LEAK-CANARY-task"},
            "source": {"kind": "system_of_record", "id": "aftersales",
                       "at": "2026-11-30T10:00:00+00:00"}})
        assert r.status_code == 200 and r.json()["results"][0]["status"] == "appended"
    for who in ("u8", "x1"):
        with srv.client(ks[who]) as c:
            seen = [
                c.get("/v1/memories", params={"namespace": "preferences",
                                              "key": "reply_language"}),
                c.get("/v1/memories", params={"namespace": "shop-a/u7/preferences",
                                              "key": "reply_language"}),
                c.get(f"/v1/memories/{mid}"),
                c.get(f"/v1/memories/{mid}/history"),
                c.post("/v1/recall", json={"query": "LEAK-CANARY reply language"}),
                c.post("/v1/recall", json={"task": "T900"}),
                c.get("/v1/tasks", params={"include_closed": True}),
            ]
            for r in seen:
                assert r.status_code in (200, 404), r.text
                assert b"LEAK-CANARY" not in r.content, (who, r.request.url, r.text)
            assert seen[4].json()["items"] == [] and seen[6].json()["tasks"] == []
            for body in ({"user": "u7"}, {"tenant": "shop-a", "user": "u7"}):
                if who == "u8":
                    r = c.post("/v1/recall", json={"query": "x", **body})
                    assert r.status_code == 403 and r.json()["rule"] == "principal"
            r = c.post("/v1/memories", json={"namespace": ["p"], "key": "k", "value": 1,
                                             "source": SRC, "user": "someone-else"})
            assert r.status_code == 403 and r.json()["field"] == "user"
    with srv.client(ks["u7"]) as u7:
        assert u7.get("/v1/tasks").json()["tasks"][0]["title"] == "LEAK-CANARY-task"


def test_every_principal_route(served: tuple[Server, dict[str, str]]) -> None:
    """remember, get (by key and by id), history, recall, tasks, DELETE and POST /forget
    do what the SDK does; a forget says what it covered and the memory is gone."""
    srv, ks = served
    with srv.client(ks["u7"]) as u7:
        first = remember(u7, "reply_language", "English", 1)
        again = remember(u7, "reply_language", "English", 1)  # a retry: a duplicate
        assert (first["status"], again["status"]) == ("appended", "duplicate")
        assert again["position"] == first["position"]
        second = remember(u7, "reply_language", "Simplified Chinese", 2)
        got = u7.get("/v1/memories", params={"namespace": "preferences",
                                             "key": "reply_language"}).json()
        assert (got["value"], got["version"], got["memory_id"]) == (
            "Simplified Chinese", 2, second["memory_id"])
        assert got["namespace"] == ["shop-a", "u7", "preferences"]
        old = u7.get(f"/v1/memories/{first['memory_id']}").json()
        assert (old["status"], old["value"]) == ("superseded", "English")
        hist = u7.get(f"/v1/memories/{second['memory_id']}/history").json()["versions"]
        assert [v["value"] for v in hist] == ["English", "Simplified Chinese"]
        rec = u7.post("/v1/recall", json={"query": "reply language", "limit": 5}).json()
        assert [i["value"] for i in rec["items"]] == ["Simplified Chinese"]
        assert rec["audit_id"]
        assert u7.get("/v1/tasks").json() == {"tasks": []}
        sess = remember(u7, "tone", "brief", 3, session="S1")
        assert u7.get("/v1/memories", params={"namespace": "preferences", "key": "tone"}
                      ).status_code == 404
        assert u7.get("/v1/memories", params={"namespace": "preferences", "key": "tone",
                                              "session": "S1"}).json()["layer"] == "session"

        gone = u7.post("/v1/forget", json={"namespace": ["preferences"],
                                           "key": "reply_language"}).json()
        assert gone["target"] == {"namespace": ["preferences"], "key": "reply_language"}
        assert sorted(gone["covered"]) == sorted([first["memory_id"], second["memory_id"]])
        assert u7.get(f"/v1/memories/{second['memory_id']}").status_code == 404
        assert u7.get("/v1/memories", params={"namespace": "preferences",
                                              "key": "reply_language"}).status_code == 404
        # As of before the forget: there, version 2, redacted (docs/projections.md#as-of).
        past = {"namespace": "preferences", "key": "reply_language",
                "as_of": f"position:{second['position']}"}
        then = u7.get("/v1/memories", params=past).json()
        assert (then["version"], then["value"], then["redacted"]) == (2, None, True)
        assert then["position"] == second["position"]
        first_then = u7.get("/v1/memories", params={**past, "as_of": "position:1"}).json()
        assert (first_then["version"], first_then["redacted"]) == (1, True)
        rec = u7.post("/v1/recall", json={"query": "reply language",
                                          "as_of": past["as_of"]}).json()
        assert [(i["version"], i["value"]) for i in rec["items"]] == [(2, None)]
        assert u7.get("/v1/tasks", params={"as_of": "position:1"}).json() == {"tasks": []}
        bad = u7.get("/v1/memories", params={**past, "as_of": "yesterday"})
        assert bad.status_code == 422 and "yesterday" not in bad.text
        d = u7.delete(f"/v1/memories/{sess['memory_id']}")
        assert d.status_code == 200 and d.json()["covered"] == [sess["memory_id"]]
        assert u7.delete(f"/v1/memories/{sess['memory_id']}").status_code == 404
        last = remember(u7, "a", 1, 10)["memory_id"]
        everything = u7.post("/v1/forget", json={"namespace_prefix": []}).json()
        assert sorted(everything["covered"]) == sorted(  # forgotten before, and now
            [first["memory_id"], second["memory_id"], sess["memory_id"], last])
        assert u7.post("/v1/recall", json={}).json()["items"] == []


def test_problems_name_the_field_and_echo_nothing(
        served: tuple[Server, dict[str, str]]) -> None:
    """A rejected secret, a schema violation and a broken rule each give one problem
    shape with the field and the rule, never the value sent, never a traceback."""
    srv, ks = served
    card = "4111 1111 1111 1111"
    with srv.client(ks["u7"]) as u7:
        r = u7.post("/v1/memories", json={"namespace": ["billing"], "key": "card",
                                          "value": f"my card is {card}", "source": SRC})
        assert r.status_code == 422, r.text
        p = r.json()
        assert set(p) == {"status", "title", "detail", "field", "rule"}
        assert p["field"] and "4111" not in r.text
        r = u7.post("/v1/memories", json={"namespace": ["p"], "value": "SHOULD-NOT-ECHO",
                                          "source": SRC})
        assert r.status_code == 422 and r.json()["field"] == "body.key"
        assert "SHOULD-NOT-ECHO" not in r.text
        r = u7.post("/v1/memories", content=b"{not json SHOULD-NOT-ECHO",
                    headers={"content-type": "application/json"})
        assert r.status_code == 422 and "SHOULD-NOT-ECHO" not in r.text
        r = u7.post("/v1/memories", json={"namespace": ["p"], "key": "k", "value": 1,
                                          "source": {**SRC, "kind": "operator"}})
        assert r.status_code == 403 and r.json()["rule"] == "source_kind"
        r = u7.post("/v1/forget", json={"memory_id": "m1", "namespace": ["p"], "key": "k"})
        assert r.status_code == 422 and r.json()["rule"] == "one_target"
        r = u7.get("/no/such/route")
        assert r.status_code == 404 and set(r.json()) == set(p)
        for r in (u7.get("/v1/memories", params={"key": "k", "namespace": "a" * 3000}),):
            assert r.status_code == 422 and "aaaa" not in r.text
        assert b"Traceback" not in srv.stop()


def test_events_route_gives_the_append_commands_results(
        served: tuple[Server, dict[str, str]], tmp_path: Path) -> None:
    """A batch through POST /v1/events gets, line by line, what `memledger append` prints
    for the same lines on a fresh ledger; a tenant key may write its own tenant only."""
    srv, ks = served
    batch = [
        {"type": "memory.written", "idempotency_key": "e1", "tenant": "shop-a",
         "actor": "u7", "source": {"kind": "explicit_user_request", "id": "C1",
                                   "at": "2026-11-30T10:00:00+00:00"},
         "data": {"namespace": ["shop-a", "u7", "p"], "key": "lang", "value": "fr"}},
        {"type": "memory.written", "idempotency_key": "e2", "tenant": "shop-a",
         "actor": "u8", "source": {"kind": "explicit_user_request", "id": "C1",
                                   "at": "2026-11-30T10:00:01+00:00"},
         "data": {"namespace": ["shop-a", "u7", "p"], "key": "lang", "value": "de"}},
        {"type": "no.such.type", "idempotency_key": "e3", "tenant": "shop-a"},
        {"type": "memory.written", "idempotency_key": "e1", "tenant": "shop-a",
         "actor": "u7", "source": {"kind": "explicit_user_request", "id": "C1",
                                   "at": "2026-11-30T10:00:00+00:00"},
         "data": {"namespace": ["shop-a", "u7", "p"], "key": "lang", "value": "fr"}},
    ]
    cli = Cli(f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}", str(tmp_path / "cli.forgets"))
    expected = cli.append(batch, check=1)
    with srv.client(ks["shop-a"]) as svc:
        got = svc.post("/v1/events", json=batch).json()
        assert got["results"] == expected and got["rejected"] == 2
        other = {**batch[0], "tenant": "shop-b", "idempotency_key": "e9",
                 "data": {**batch[0]["data"], "namespace": ["shop-b", "u7", "p"]}}
        r = svc.post("/v1/events", json=[other])
        assert r.status_code == 403 and r.json()["rule"] == "tenant"
        one = svc.post("/v1/events", json={**batch[0], "idempotency_key": "e5",
                                           "source": {**batch[0]["source"], "id": "C5"}})
        assert one.json()["results"][0]["status"] == "appended"
    with srv.client(ks["u7"]) as u7:  # waited: readable at once
        got_lang = u7.get("/v1/memories", params={"namespace": "p", "key": "lang"}).json()
        assert got_lang["value"] == "fr"
    with srv.client(ks["op"]) as op:
        r = op.post("/v1/events", json=[other])
        assert r.json()["results"][0]["status"] == "appended"
        assert op.get("/v1/status").json()["head"] == 3
        a = op.get("/v1/audit", params={"namespace": "shop-a/u7/p", "key": "lang"})
        assert a.status_code == 200 and len(a.json()["events"]) >= 2, a.text
        assert op.post("/v1/verify", json={}).json()["ok"] is True
        assert op.post("/v1/verify", json={"forgotten": True}).json()["ok"] is True
        assert op.get("/v1/audit/nope").status_code == 404
        assert op.get("/v1/audit", params={"key": "k"}).status_code == 422


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_forget_over_http_leaves_no_bytes(served: tuple[Server, dict[str, str]]) -> None:
    """A value written and forgotten over HTTP is in no file of the ledger afterwards:
    database, WAL, forget register (R20)."""
    srv, ks = served
    with srv.client(ks["u7"]) as u7:
        remember(u7, "pet", "WOMBAT-unique-value-5521", 1)
        remember(u7, "pet2", "WOMBAT-second-value-5522", 2, task="T1")
        r = u7.post("/v1/forget", json={"namespace_prefix": ["preferences"]})
        assert len(r.json()["covered"]) == 2
    srv.stop()
    db = Path(srv.db_url.split(":///", 1)[1])
    files = [*db.parent.glob(db.name + "*"), Path(srv.register)]
    assert files and all(b"WOMBAT" not in p.read_bytes() for p in files)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_metrics_and_probes(served: tuple[Server, dict[str, str]]) -> None:
    """/metrics counts requests per route template, events, rejects and recall latency,
    and names no key, id or value; /readyz reports the lag."""
    srv, ks = served
    with srv.client(ks["u7"]) as u7:
        mid = remember(u7, "k", "METRIC-VALUE", 1)["memory_id"]
        u7.get(f"/v1/memories/{mid}")
        u7.post("/v1/recall", json={"query": "k"})
        u7.post("/v1/memories", json={"namespace": ["p"], "key": "k",
                                      "value": "card 4111 1111 1111 1111", "source": SRC})
    text = httpx.get(srv.url + "/metrics").text
    assert 'memledger_http_requests_total{method="GET",route="/v1/memories/{memory_id}",' \
           'status="200"} 1' in text
    assert 'memledger_events_total{status="appended"} 1' in text
    assert 'memledger_rejects_total{reason="validation_error"} 1' in text
    assert "memledger_recall_duration_seconds_count 1" in text
    assert 'memledger_projection_lag{projection="' in text
    for secret in (mid, "METRIC-VALUE", "4111", ks["u7"], ks["u7"].split("_")[1]):
        assert secret not in text
    ready = httpx.get(srv.url + "/readyz").json()
    assert ready["ready"] is True and ready["head"] == 1 and set(ready["lag"].values()) == {0}


def test_keys_commands(tmp_path: Path) -> None:
    """`keys create` prints the key once; `keys list` never shows it; the database holds
    only its keyed hash; `keys revoke` takes effect on a running server."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'l.db'}"
    cli = Cli(url, str(tmp_path / "l.forgets"))
    made = cli.json("keys", "create", "--principal", "shop-a/u7", "--label", "app")
    assert made["key"].startswith("mlk_") and made["kind"] == "principal"
    assert (made["tenant"], made["user"], made["label"]) == ("shop-a", "u7", "app")
    op = cli.json("keys", "create", "--operator")
    assert (op["kind"], op["tenant"], op["user"]) == ("operator", None, None)
    listed = cli.json("keys", "list")["keys"]
    assert [k["key_id"] for k in listed] == [made["key_id"], op["key_id"]]
    secret = made["key"].split("_", 2)[2].encode()
    blob = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert secret not in blob and made["key"].encode() not in blob
    assert made["key"].encode() not in cli.run("keys", "list").stdout
    assert cli.run("keys", "create", "--principal", "nouser", check=1)
    assert cli.run("keys", "create", "--principal", "a/b", "--operator", check=2)
    srv = Server(url, str(tmp_path / "l.forgets"))
    try:
        with srv.client(made["key"]) as c:
            assert c.get("/v1/tasks").status_code == 200
            assert cli.json("keys", "revoke", made["key_id"])["revoked_at"]
            assert c.get("/v1/tasks").status_code == 401
        assert cli.run("keys", "revoke", "nope", check=1)
        assert [k["key_id"] for k in cli.json("keys", "list")["keys"]] == [op["key_id"]]
        assert len(cli.json("keys", "list", "--all")["keys"]) == 2
    finally:
        err = srv.stop()
    assert made["key"].encode() not in err and secret not in err


def test_nul_in_a_parameter_is_a_422(served: tuple[Server, dict[str, str]]) -> None:
    """A NUL character in a query or path parameter is refused with the field named (a
    schemathesis find: PostgreSQL stores no NUL in text)."""
    srv, ks = served
    with srv.client(ks["u7"]) as u7:
        r = u7.get("/v1/memories", params={"namespace": "a\x00b", "key": "k"})
        assert r.status_code == 422 and r.json()["field"] == "query.namespace"
        r = u7.get("/v1/memories/m%00x")
        assert r.status_code == 422 and r.json()["field"] == "path.memory_id"


async def test_authenticate_with_the_stored_or_the_env_secret(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """`keys.authenticate` (one statement per request): a key is known under the secret it
    was made with, stored in `meta` or given by `MEMLEDGER_API_KEY_PEPPER`; a wrong
    secret part, a revoked key and an unknown id are refused."""
    key, info = await keys.create_key(store, "principal", tenant="shop-a", user="u7")
    assert (await keys.authenticate(store, key)) == info
    assert await keys.authenticate(store, key[:-1] + ("x" if key[-1] != "x" else "y")) is None
    assert await keys.authenticate(store, "mlk_nope_secret") is None
    monkeypatch.setenv(keys.PEPPER_ENV, "an operator's own secret")
    assert await keys.authenticate(store, key) is None  # made under the stored secret
    key2, info2 = await keys.create_key(store, "tenant", tenant="shop-a")
    assert (await keys.authenticate(store, key2)) == info2
    assert await keys.revoke_key(store, info2.key_id) is not None
    assert await keys.authenticate(store, key2) is None
