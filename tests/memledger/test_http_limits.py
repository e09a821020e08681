"""Request limits of the HTTP API (docs/http.md): the per-key rate limit answers 429 with
`Retry-After`, a body past `--max-body` and a batch past `--max-batch` answer 413; every
one as a problem object."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.memledger.test_http import SRC, Server, make_key


def test_rate_limit_body_and_batch_limits(tmp_path: Path) -> None:
    """A key past its burst gets 429 and Retry-After; another key is not held back; an
    oversized body or batch gets 413 before anything is written."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'l.db'}"
    reg = str(tmp_path / "l.forgets")
    a, _ = make_key(url, reg, "principal", "shop-a", "u7")
    b, _ = make_key(url, reg, "principal", "shop-a", "u8")
    svc, _ = make_key(url, reg, "tenant", "shop-a")
    srv = Server(url, reg, "--rate-limit", "0.5", "--burst", "3", "--max-body", "2000",
                 "--max-batch", "2")
    try:
        with srv.client(a) as c:
            codes = [c.get("/v1/tasks").status_code for _ in range(6)]
            assert codes[:3] == [200, 200, 200] and 429 in codes[3:]
            r = c.get("/v1/tasks")
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["rule"] == "rate_limit"
        with srv.client(b) as c:
            assert c.get("/v1/tasks").status_code == 200
            r = c.post("/v1/memories", json={"namespace": ["p"], "key": "k",
                                             "value": "x" * 5000, "source": SRC})
            assert r.status_code == 413 and r.json()["rule"] == "max_body"
            assert "xxxx" not in r.text
        with srv.client(svc) as c:
            r = c.post("/v1/events", json=[{}, {}, {}])
            assert r.status_code == 413 and r.json()["rule"] == "max_batch"
        metrics = httpx.get(srv.url + "/metrics").text
        assert "memledger_http_rate_limited_total 0" not in metrics
    finally:
        srv.stop()
