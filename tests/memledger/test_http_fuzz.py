"""schemathesis against the server's own `/openapi.json` (docs/http.md): every route,
with a principal's key and with the operator's, a bounded number of examples, coverage,
fuzzing and stateful phases: no 5xx, and every response matches the document (status
code, content type, schema)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.memledger.test_http import Server, make_key

ST = Path(sys.executable).with_name("st")
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")


def fuzz(srv: Server, key: str, examples: int, cwd: Path
         ) -> subprocess.CompletedProcess[str]:
    """One bounded `st run` against the running server with `key` (its cache in `cwd`)."""
    return subprocess.run(
        [str(ST), "run", f"{srv.url}/openapi.json", "-H", f"Authorization: Bearer {key}",
         "-H", f"x-api-key: {key}",  # the same key in the other header (both are declared)
         "--checks", CHECKS, "--max-examples", str(examples), "-w", "1", "--no-color",
         "--phases", "coverage,fuzzing,stateful", "--seed", "20261201"],
        capture_output=True, text=True, timeout=600, cwd=cwd,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""})


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_schema_mismatch(db_url: str, tmp_path: Path
                                                          ) -> None:
    """Fuzzing every operation finds no server error and no response off the schema."""
    reg = str(tmp_path / "l.forgets")
    user, _ = make_key(db_url, reg, "principal", "shop-a", "u7")
    op, _ = make_key(db_url, reg, "operator")
    srv = Server(db_url, reg, "--rate-limit", "0")
    try:
        for key, examples in ((user, 12), (op, 6)):
            res = fuzz(srv, key, examples, tmp_path)
            assert res.returncode == 0, res.stdout[-6000:]
            assert " passed" in res.stdout and "22/22" in res.stdout  # 16 + 6 store routes
    finally:
        err = srv.stop()
    assert b"Traceback" not in err
