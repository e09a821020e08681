"""The vault across a fork, and the key file's look-up by id (ledger/vault.py,
docs/forgetting.md "The key pool"; R20, R21).

A key seals one event, and a forget destroys the key of the event it erases: two
processes that took the same pool key would each seal with it, and forgetting one
event would destroy the other's. A process forked from one holding a vault (a worker
pool, a pre-forking server) must therefore start with a pool of its own, must not
release its parent's pool at close (the parent is about to seal with those keys), and
must not share its parent's open key file (a `flock` belongs to the open file
description, which a fork shares: the two would not exclude each other's appends) nor
its parent's PostgreSQL connection and event-loop thread.
"""

from __future__ import annotations

import os
import select
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.vault import POOL_FIRST, FileKeyStore, PostgresKeyStore, Vault


def _key_store(db_url: str, tmp_path: Path) -> Any:
    if db_url.startswith("sqlite"):
        return FileKeyStore(tmp_path / "ledger.vault")
    return PostgresKeyStore(db_url, schema="kv_fork")


def _forked(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Start `fn` in a forked child now; the returned call waits (at most 60 s) for
    its JSON result, raising what the child raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test runner
        os.close(r)
        code = 0
        try:
            out = orjson.dumps({"ok": fn()})
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out, code = orjson.dumps({"error": repr(e)}), 1
        view = memoryview(out)
        while view:
            view = view[os.write(w, view):]
        os._exit(code)
    os.close(w)

    def result() -> Any:
        chunks, deadline = [], time.monotonic() + 60
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    pytest.fail("the forked child hung (it waited on its parent's "
                                "lock, connection or thread)")
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(r)
            os.waitpid(pid, 0)
        got = orjson.loads(b"".join(chunks))
        assert "error" not in got, got["error"]
        return got["ok"]
    return result


def test_a_forked_child_never_takes_nor_releases_its_parents_pool(
        db_url: str, tmp_path: Path) -> None:
    """The child's takes are keys of its own; its close leaves the parent's pool in
    the key store; the parent's connection still works after the child's close."""
    ks = _key_store(db_url, tmp_path)
    vault = Vault(ks)
    try:
        first = vault.take(1)  # the pool now holds POOL_FIRST - 1 durable keys

        def child() -> list[str]:
            taken = vault.take(5)
            vault.close()  # releases the child's own unused keys, and its store
            return taken

        theirs = _forked(child)()
        mine = vault.take(5)
        assert not set(theirs) & set(mine)
        assert ks.load(first).keys() == set(first)  # the parent's store still answers
        rest = vault.take(POOL_FIRST - 1 - 5)  # the rest of the pool made before the fork
        everything = first + mine + rest + theirs
        assert len(set(everything)) == len(everything)
        fresh = _key_store(db_url, tmp_path)
        try:
            assert fresh.load(everything).keys() == set(everything)
        finally:
            fresh.close()
    finally:
        vault.close()


def test_a_forked_child_appends_to_the_key_file_under_a_lock_of_its_own(
        tmp_path: Path) -> None:
    """Parent and child provision pools at the same time into one key file opened
    before the fork: every key of both is in the file afterwards, as it was made."""
    path = tmp_path / "ledger.vault"
    ks = FileKeyStore(path)
    ks.provision_pool(4)  # the file is open (and locked, and unlocked) before the fork

    def provision() -> dict[str, str]:
        out: dict[str, str] = {}
        for _ in range(40):
            out.update((k, v.hex()) for k, v in ks.provision_pool(16).items())
        return out

    theirs = _forked(provision)
    mine = provision()
    made = {**mine, **theirs()}
    assert len(made) == 2 * 40 * 16
    fresh = FileKeyStore(path)
    try:
        assert {k: v.hex() for k, v in fresh.load(list(made)).items()} == made
    finally:
        fresh.close()
        ks.close()


_PREFIXES = [bytes([p]) * 8 for p in (1, 2, 3)]
_ids = st.builds(lambda p, tail: (p + tail).hex(), st.sampled_from(_PREFIXES),
                 st.binary(min_size=8, max_size=8))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(_ids, min_size=1, max_size=12, unique=True),
                        min_size=1, max_size=4),
       later=st.lists(_ids, min_size=1, max_size=12, unique=True),
       destroyed=st.sets(st.integers(0, 47), max_size=6),
       absent=st.lists(_ids, min_size=9, max_size=20, unique=True))
def test_a_look_up_by_id_finds_exactly_the_records_of_the_id(
        batches: list[list[str]], later: list[str], destroyed: set[int],
        absent: list[str]) -> None:
    """Ids that share their first 8 bytes (the file's index keys them by those), in
    batches, some destroyed: a new reader asked for more ids than its one-by-one scan
    takes (which sorts its index) gets exactly the keys present and not fenced, as a
    model of the file says; and after more keys are appended (records after its sorted
    index), so does each read of one id."""
    with tempfile.TemporaryDirectory() as d:
        ks = FileKeyStore(Path(d) / "ledger.vault")
        made: dict[str, bytes] = {}
        try:
            for batch in batches:
                made.update(ks.provision([k for k in batch if k not in made]))
            order = sorted(made)
            gone = {order[i] for i in destroyed if i < len(order)}
            if gone:
                ks.destroy(sorted(gone))
            fresh = FileKeyStore(Path(d) / "ledger.vault")
            try:
                asked = order + [k for k in absent if k not in made]
                want = {k: v for k, v in made.items() if k not in gone}
                assert fresh.load(asked) == want
                assert fresh.fenced(asked) == gone
                made.update(ks.provision([k for k in later if k not in made]))
                want = {k: v for k, v in made.items() if k not in gone}
                for k in sorted(set(asked) | set(made)):
                    assert fresh.load([k]) == ({k: want[k]} if k in want else {})
                    assert fresh.fenced([k]) == ({k} & gone)
            finally:
                fresh.close()
        finally:
            ks.close()
