"""A forget in one process reaches the ciphers another running process keeps
(ledger/vault.py `Vault._entry`, `KeyStore.revoked`; docs/forgetting.md "Keys cached in
a running process"; R20, R21).

A process that opened a value keeps its cipher, so the next `get` builds nothing. The
key's destroy is written by another process (a real child process here: the CLI's
`memledger forget`, a worker), and the running process must stop opening the value at
once: on a key store file, at its next use after a finished destroy (the overwritten key
record shows in the process's mapping of the file) and within a millisecond after one
cut short after its fence (the file's size and identity are looked at that often); on
PostgreSQL, once the server's announcement of the fence arrives (polled here, a
notification after the destroy's commit).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ledger.vault import FileKeyStore, KeyStore, PostgresKeyStore, Vault, sealed_key_id
from tests.ledger.test_vault_keystore import LongWrap

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"WOMBAT-pin-4417"


def _store(where: str, schema: str) -> KeyStore:
    return FileKeyStore(where) if not where.startswith("postgresql") \
        else PostgresKeyStore(where, schema=schema)


def _in_child(where: str, schema: str, kid: str, how: str) -> None:
    """`how` ('destroy' or 'fence': a destroy cut short after its fence) in a process
    of its own, the key store opened there afresh."""
    code = (
        "import sys\n"
        "from ledger.vault import FileKeyStore, PostgresKeyStore\n"
        "where, schema, kid, how = sys.argv[1:]\n"
        "ks = FileKeyStore(where) if not where.startswith('postgresql') "
        "else PostgresKeyStore(where, schema=schema)\n"
        "ks.destroy([kid]) if how == 'destroy' else ks._fence([kid])\n"
        "ks.close()\n")
    subprocess.run([sys.executable, "-c", code, where, schema, kid, how], check=True,
                   cwd=ROOT, timeout=60)


def _where(db_url: str, tmp_path: Path) -> str:
    return str(tmp_path / "k.vault") if db_url.startswith("sqlite") else db_url


def _until_none(vault: Vault, blob: bytes) -> bytes | None:
    """`vault.open(blob)` until it reads as erased (PostgreSQL: the notification may
    still be on its way), for at most 10 s; the last answer."""
    deadline = time.monotonic() + 10
    got = vault.open(blob)
    while got is not None and time.monotonic() < deadline:
        time.sleep(0.02)
        got = vault.open(blob)
    return got


@pytest.mark.parametrize("how", ["destroy", "fence"])
def test_another_process_forget_reaches_a_running_process_cache(
        db_url: str, tmp_path: Path, how: str) -> None:
    schema = f"kv_{uuid.uuid4().hex[:8]}"
    where = _where(db_url, tmp_path)
    running = Vault(_store(where, schema))
    rows = [{"type": "memory.written", "payload": SECRET},
            {"type": "memory.written", "payload": b"kept"}]
    running.seal_rows(rows)
    gone, kept = rows[0]["payload"], rows[1]["payload"]
    assert running.open(gone) == SECRET and running.open(kept) == b"kept"  # cached now
    kid = sealed_key_id(gone)
    _in_child(where, schema, kid, how)
    if db_url.startswith("sqlite") and how == "destroy":
        # A finished destroy overwrote the key's record: seen at the very next use.
        assert running.open(gone) is None
    assert _until_none(running, gone) is None
    assert running.key(kid) is None
    assert running.open(kept) == b"kept"  # the other key is untouched
    # A view copy of the subject is not sealed (nor stored in clear) once it is fenced.
    assert running.seal_view(kid, SECRET) is None
    running.close()
    fresh = Vault(_store(where, schema))
    assert fresh.open(gone) is None and fresh.open(kept) == b"kept"
    fresh.close()


def test_a_key_read_before_a_reconnect_is_checked_again(pg_url: str) -> None:
    """PostgreSQL: a fence committed while this process's connection was gone (no
    announcement reached it) still stops its cached cipher after it reconnects."""
    schema = f"kv_{uuid.uuid4().hex[:8]}"
    keys = PostgresKeyStore(pg_url, schema=schema)
    running = Vault(keys)
    rows = [{"type": "memory.written", "payload": SECRET}]
    running.seal_rows(rows)
    blob = rows[0]["payload"]
    assert running.open(blob) == SECRET
    keys._run(keys._conn.close())  # the connection drops
    _in_child(pg_url, schema, sealed_key_id(blob), "destroy")
    assert running.open(blob) is None  # reconnected: asked the server, not the cache
    running.close()



def test_a_destroy_after_another_process_rewrote_the_file(tmp_path: Path) -> None:
    """Another process rewrote the key store (a longer wrapped key widens every record:
    a new file renamed over the old one), then destroyed the key: the running process's
    descriptor still names the old file, which it notices (no name left) and reads the
    new one."""
    path = tmp_path / "k.vault"
    running, other = Vault(FileKeyStore(path)), FileKeyStore(path, LongWrap())
    rows = [{"type": "memory.written", "payload": SECRET}]
    running.seal_rows(rows)
    blob = rows[0]["payload"]
    assert running.open(blob) == SECRET
    ino = path.stat().st_ino
    other.provision(["ab" * 16])  # widens: the file is replaced
    assert path.stat().st_ino != ino
    other.destroy([sealed_key_id(blob)])
    assert running.open(blob) is None
    running.close()
    other.close()
