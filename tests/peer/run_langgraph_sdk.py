"""`make test-langgraph`, second part: langgraph-sdk's own store tests, unmodified,
against a real `memledger serve`.

Fetches the source distribution of `langgraph-sdk` with `tests/peer/run_langgraph.py`'s
`fetch` (same cache, `$MEMLEDGER_PEER_CACHE`), starts `memledger serve` on a free
loopback port over a fresh SQLite ledger (or `$MEMLEDGER_PEER_DB_URL`), makes a
principal's key, and runs the sdist's `tests/integration/test_store.py` with
`LANGGRAPH_INTEGRATION_URL` pointed at the server and `LANGGRAPH_API_KEY` set to the key
(`tests/peer/langgraph_sdk_plugin.py` gives the suite's bare httpx clients the SDK's
headers). The SDK package itself is imported from the same sdist. When the registry
cannot be reached the run is skipped with the reason (exit 0), and fails under `CI=true`.

Run from the repository's root: `python -m tests.peer.run_langgraph_sdk [pytest args]`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.memledger.test_http import Server, make_key
from tests.peer.run_langgraph import ROOT, fetch

PACKAGE, VERSION = "langgraph-sdk", "0.4.14"
FILES = ["tests/integration/test_store.py"]
#: The principal the suite's key belongs to: any user works (its namespaces are below it).
PRINCIPAL = ("langgraph-sdk", "integration")


def main() -> int:
    cache = Path(os.environ.get("MEMLEDGER_PEER_CACHE")
                 or Path.home() / ".cache" / "memledger-peer")
    tree = fetch(cache, PACKAGE, VERSION)
    if tree is None:
        print("SKIPPED langgraph-sdk's store tests: the package registry is unreachable",
              file=sys.stderr)
        return 1 if os.environ.get("CI", "").lower() == "true" else 0
    with tempfile.TemporaryDirectory(prefix="memledger-sdk-") as tmp:
        db_url = (os.environ.get("MEMLEDGER_PEER_DB_URL")
                  or f"sqlite+aiosqlite:///{tmp}/ledger.db")
        register = f"{tmp}/ledger.forgets"
        key, _ = make_key(db_url, register, "principal", *PRINCIPAL)
        srv = Server(db_url, register, "--rate-limit", "0")
        try:
            path = [str(tree), str(ROOT), str(ROOT / "tests" / "peer")]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(path),
                       LANGGRAPH_INTEGRATION_URL=srv.url, LANGGRAPH_API_KEY=key)
            cmd = [sys.executable, "-m", "pytest", "-p", "langgraph_sdk_plugin",
                   "-p", "no:cacheprovider", "-q", "-o", "addopts=", "-o",
                   "asyncio_mode=auto", "--rootdir", str(tree), "-c",
                   str(tree / "pyproject.toml"), *sys.argv[1:], *FILES]
            print(f"== {PACKAGE}=={VERSION}: {' '.join(FILES)} against memledger serve "
                  f"({srv.url})", flush=True)
            rc = subprocess.run(cmd, cwd=tree, env=env, check=False).returncode
        finally:
            err = srv.stop()
        if b"Traceback" in err:
            print(err.decode(errors="replace")[-4000:], file=sys.stderr)
            rc = rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
