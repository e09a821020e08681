"""The vault's file key store (ledger/vault.py `FileKeyStore`, docs/forgetting.md "The key
store"; R20, R21): fixed-size records a new process finds by id without decoding the
rest, the same answers as a model of the store for any sequence of operations across
processes, crashes and earlier formats.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.vault import (
    FILE_MAGIC,
    FILE_MAGIC_V2,
    FileKeyStore,
    KeyFenced,
    MasterKeyWrap,
    NoWrap,
)

_HEAD = 16
_REC = struct.Struct(">c16sH")


def records(path: Path) -> list[tuple[bytes, str, bytes]]:
    """(tag, key id, content) of every record, read by the documented layout."""
    data = path.read_bytes()
    assert data.startswith(FILE_MAGIC)
    width = int.from_bytes(data[len(FILE_MAGIC):len(FILE_MAGIC) + 2], "big")
    out = []
    for i in range(_HEAD, len(data) - _REC.size - width + 1, _REC.size + width):
        tag, rid, n = _REC.unpack_from(data, i)
        out.append((tag, rid.hex(), data[i + _REC.size:i + _REC.size + n]))
    return out


class LongWrap:
    """A wrapper whose stored form is longer than a master key's (as a KMS's is)."""

    name = "long"

    def wrap(self, kid: str, key: bytes) -> bytes:
        return b"\x01" * 40 + key[::-1] + b"\x02" * 50

    def unwrap(self, kid: str, wrapped: bytes) -> bytes:
        return wrapped[40:-50][::-1]


def test_a_new_process_reads_only_the_keys_it_is_asked_for(tmp_path: Path) -> None:
    """A store opened on a file of many keys unwraps just the keys asked for (the rest
    are left as bytes in the file), and answers the same as the process that wrote it."""
    path = tmp_path / "k.vault"
    writer = FileKeyStore(path)
    pool = writer.provision_pool(3000)
    writer.close()
    asked: list[str] = []

    class Counting(NoWrap):
        def unwrap(self, kid: str, wrapped: bytes) -> bytes:
            asked.append(kid)
            return wrapped

    reader = FileKeyStore(path, Counting())
    some = sorted(pool)[::500]
    assert reader.load(some) == {k: pool[k] for k in some}
    assert sorted(asked) == some  # unwrapped only what was asked, once each
    for k in some:
        assert reader.get(k) == pool[k]
    assert sorted(asked) == some  # served again from what it read
    assert reader.load(["ee" * 16]) == {} and reader.fenced(some) == set()
    many = sorted(pool)[1::3]  # a batch large enough to sort the ids
    assert reader.load(many) == {k: pool[k] for k in many}
    reader.close()


def test_a_fence_written_by_another_process_is_seen(tmp_path: Path) -> None:
    """A key destroyed through one store object (another process) is unreadable through
    one that read it earlier, fenced for it, and never provisioned again by it."""
    path = tmp_path / "k.vault"
    a, b = FileKeyStore(path), FileKeyStore(path)
    keys = a.provision_pool(100)
    kid = sorted(keys)[7]
    assert b.get(kid) == keys[kid]
    assert a.destroy([kid]) == 1
    assert b.get(kid) is None  # its record was overwritten in place
    assert b.fenced([kid]) == {kid}
    with pytest.raises(KeyFenced):
        b.provision([kid])
    assert keys[kid] not in path.read_bytes()
    a.close()
    b.close()


def test_one_id_reads_see_fences_in_the_sorted_index_and_after_it(tmp_path: Path) -> None:
    """`get` of one id (a reader's first open) answers as `load`: a fence the reader has
    mapped whose key record is still in the file (a destroy cut short) makes the key
    unreadable, whether the fence is in the reader's sorted index or in the records
    appended after it, and a key another process provisioned since is found (a miss
    reads the file's tail)."""
    path = tmp_path / "k.vault"
    a, b = FileKeyStore(path), FileKeyStore(path)
    keys = a.provision_pool(200)
    ids = sorted(keys)
    a._fence([ids[60]])
    assert b.load(ids[:50]) == {k: keys[k] for k in ids[:50]}  # b's index sorted
    assert b.get(ids[60]) is None and b.load([ids[60]]) == {}
    a._fence([ids[70]])
    more = a.provision_pool(20)
    new = sorted(more)[3]
    assert b.get(new) == more[new]  # not in b's mapping yet: read from the tail
    assert b.get(ids[70]) is None and b.load([ids[70]]) == {}
    assert b.get(ids[61]) == keys[ids[61]]
    a.close()
    b.close()


def test_records_a_store_writes_are_indexed_when_written(tmp_path: Path) -> None:
    """Once one-id reads go through the sorted index, the records this store appends
    (a pool's refill, a fence) are indexed as it writes them, so the next read seeks
    at once (it had indexed a refill's 1,000-4,096 records itself: 0.2-1.3 ms, and
    re-sorted the whole file when they passed the re-sort point). Reads of old keys,
    new keys and fenced keys answer as before."""
    path = tmp_path / "k.vault"
    ks = FileKeyStore(path)
    first = ks.provision_pool(5000)
    ids = sorted(first)
    ks._plain.clear()  # the keys it provisioned are held unwrapped: read from the file
    assert ks.load(ids[:40]) == {k: first[k] for k in ids[:40]}  # sorts the index
    assert ks._order is not None
    other = FileKeyStore(path)
    for batch in range(6):  # past the re-sort point (4,096 records after the sort)
        more = ks.provision_pool(1000)
        assert ks._tail_upto == ks._n  # indexed by the write
        assert ks._n - ks._ns <= max(4096, ks._ns // 8)  # re-sorted by the write
        new = sorted(more)
        ks._plain.clear()  # reads below seek, as an evicted key's read does
        assert ks.get(new[batch]) == more[new[batch]]
        assert ks.get(ids[batch]) == first[ids[batch]]
        assert other.get(new[-1]) == more[new[-1]]  # another process reads the tail
    ks._fence([ids[100]])
    assert ks._tail_upto == ks._n
    ks._plain.clear()
    assert ks.get(ids[100]) is None and ks.load([ids[100]]) == {}
    ks.close()
    other.close()


def test_a_crash_between_fence_and_overwrite_is_settled_at_the_next_open(
        tmp_path: Path) -> None:
    """A destroy cut short after its fence was durable but before the key's record was
    overwritten: the key reads as destroyed at once, and the next process to open the
    file overwrites it (the key's bytes leave the file)."""
    path = tmp_path / "k.vault"
    ks = FileKeyStore(path)
    keys = ks.provision(["a1" * 16, "b2" * 16])
    ks._fence(["a1" * 16])  # the first half of `destroy`, then the process dies
    ks.close()
    assert keys["a1" * 16] in path.read_bytes()
    fresh = FileKeyStore(path)
    assert fresh.get("a1" * 16) is None
    assert fresh.get("b2" * 16) == keys["b2" * 16]
    assert keys["a1" * 16] not in path.read_bytes()
    tags = {(tag, kid) for tag, kid, _ in records(path)}
    assert (b"X", "a1" * 16) in tags and (b"D", "a1" * 16) in tags
    assert (b"F", "a1" * 16) not in tags
    fresh.close()


def test_a_previous_format_key_store_is_converted(tmp_path: Path) -> None:
    """A key store written in the previous binary format (variable-length records, a
    fenced key not yet overwritten, a destroyed one, a torn last record) opens with the
    same keys and fences; the destroyed and fenced keys' bytes leave the file, and the
    old file's blocks are zeroed before it goes."""
    path = tmp_path / "k.vault"
    kept, fenced, destroyed = bytes(range(32)), bytes(range(1, 33)), bytes(range(2, 34))
    old = bytearray(FILE_MAGIC_V2)
    old += _REC.pack(b"K", bytes.fromhex("aa" * 16), 32) + kept
    old += _REC.pack(b"K", bytes.fromhex("bb" * 16), 32) + fenced
    old += _REC.pack(b"D", bytes.fromhex("cc" * 16), 32) + bytes(32)
    old += _REC.pack(b"F", bytes.fromhex("cc" * 16), 0)
    old += _REC.pack(b"F", bytes.fromhex("bb" * 16), 0)
    old += b"K" + bytes(7)  # torn
    path.write_bytes(bytes(old))
    fd = os.open(path, os.O_RDONLY)  # the old file, as another process still holds it
    try:
        ks = FileKeyStore(path)
        assert ks.load() == {"aa" * 16: kept}
        assert ks.fenced(["aa" * 16, "bb" * 16, "cc" * 16]) == {"bb" * 16, "cc" * 16}
        assert not any(os.pread(fd, len(old), 0))  # the old blocks were zeroed
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data.startswith(FILE_MAGIC) and kept in data
    assert fenced not in data and destroyed not in data
    with pytest.raises(KeyFenced):
        FileKeyStore(path).provision(["cc" * 16])
    ks.close()


def test_a_longer_wrapped_key_widens_the_file(tmp_path: Path) -> None:
    """A key wrapped longer than the file's records rewrites the file wider first: every
    key and fence is kept, a process holding the old file finds the new one."""
    path = tmp_path / "k.vault"
    short = FileKeyStore(path)
    first = short.provision(["a1" * 16, "b2" * 16])
    short.destroy(["b2" * 16])
    long = FileKeyStore(path, LongWrap())
    added = long.provision(["c3" * 16])
    assert len(records(path)[0][2]) in (0, 122)  # X records carry nothing
    assert {len(c) for t, _, c in records(path) if t == b"K"} == {32, 122}
    assert short.get("a1" * 16) == first["a1" * 16]
    assert short.fenced(["b2" * 16]) == {"b2" * 16}
    with pytest.raises(KeyFenced):
        long.provision(["b2" * 16])
    assert long.get("c3" * 16) == added["c3" * 16]
    more = short.provision(["d4" * 16])  # writes into the new file, at its width
    assert FileKeyStore(path).load(["a1" * 16, "d4" * 16]) == {"a1" * 16: first["a1" * 16],
                                                               **more}
    short.close()
    long.close()


def test_zeros_at_the_end_are_an_append_cut_short(tmp_path: Path) -> None:
    """Whole records of zeros at the end (an append whose data never reached the disk)
    are skipped by readers and cut off by the next writer; zeros in the middle are
    damage."""
    path = tmp_path / "k.vault"
    keys = FileKeyStore(path, MasterKeyWrap(bytes(32))).provision(["a1" * 16])
    rec = _REC.size + 60
    with path.open("ab") as f:
        f.write(bytes(2 * rec))
    assert FileKeyStore(path, MasterKeyWrap(bytes(32))).load() == keys
    more = FileKeyStore(path, MasterKeyWrap(bytes(32))).provision(["b2" * 16])
    assert len(records(path)) == 2
    assert FileKeyStore(path, MasterKeyWrap(bytes(32))).load() == {**keys, **more}


def torn(path: Path, n: int) -> None:
    """What a writer killed in the middle of an append leaves: it cut off any torn
    record first (as every writer does), then wrote part of a record."""
    if not path.exists():
        return
    data = path.read_bytes()
    rec = _REC.size + int.from_bytes(data[len(FILE_MAGIC):len(FILE_MAGIC) + 2], "big")
    whole = _HEAD + (len(data) - _HEAD) // rec * rec
    with path.open("r+b") as f:
        f.truncate(whole)
        f.seek(whole)
        f.write(b"K" + os.urandom(min(n, rec - 2)))


_IDS = [f"{i:02x}" * 16 for i in range(1, 13)]

_OPS = st.lists(st.one_of(
    st.tuples(st.just("provision"), st.lists(st.sampled_from(_IDS), min_size=1, max_size=4),
              st.integers(0, 2)),
    st.tuples(st.just("pool"), st.integers(1, 40), st.integers(0, 2)),
    st.tuples(st.just("destroy"), st.lists(st.sampled_from(_IDS), min_size=1, max_size=3),
              st.integers(0, 2)),
    st.tuples(st.just("release"), st.lists(st.sampled_from(_IDS), min_size=1, max_size=3),
              st.integers(0, 2)),
    st.tuples(st.just("fence only"), st.sampled_from(_IDS), st.integers(0, 2)),
    st.tuples(st.just("torn"), st.integers(1, 60), st.integers(0, 2)),
    st.tuples(st.just("reopen"), st.just(0), st.integers(0, 2)),
), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_three_processes_agree_with_a_model(tmp_path_factory: pytest.TempPathFactory,
                                            ops: list[tuple[str, object, int]]) -> None:
    """Any interleaving of provisioning, pools, destroys, releases, destroys cut short
    after the fence, torn appends and restarts, through three store objects on one file
    (three processes): every store reads exactly the model's keys, reports exactly its
    fences, refuses a fenced id, and no destroyed key's bytes remain in the file once a
    process has opened it since; a read of one id (`get`) answers as `load` does."""
    path = tmp_path_factory.mktemp("ks") / "k.vault"
    stores = [FileKeyStore(path) for _ in range(3)]
    keys: dict[str, bytes] = {}
    fences: set[str] = set()
    gone: set[bytes] = set()
    for op, arg, who in ops:
        ks = stores[who]
        if op == "provision":
            ids = list(arg)  # type: ignore[call-overload]
            if fences & set(ids):
                with pytest.raises(KeyFenced):
                    ks.provision(ids)
            else:
                got = ks.provision(ids)
                for k in ids:
                    assert got[k] == keys.setdefault(k, got[k])
        elif op == "pool":
            pool = ks.provision_pool(int(arg))  # type: ignore[call-overload]
            assert not set(pool) & (set(keys) | fences)
            keys.update(pool)
        elif op == "destroy":
            ids = list(arg)  # type: ignore[call-overload]
            assert ks.destroy(ids) == len(set(ids) - fences)
            gone.update(keys.pop(k) for k in set(ids) if k in keys)
            fences.update(ids)
        elif op == "release":
            ids = [k for k in arg if k not in fences]  # type: ignore[attr-defined]
            ks.release(ids)
            for k in ids:
                keys.pop(k, None)
        elif op == "fence only":
            kid = str(arg)
            if kid not in fences:
                ks._fence([kid])  # a destroy cut short: the fence is durable, no more
                fences.add(kid)
                if kid in keys:
                    gone.add(keys.pop(kid))
        elif op == "torn":
            torn(path, int(arg))  # type: ignore[call-overload]
        else:
            ks.close()
            stores[who] = FileKeyStore(path)
        for s in stores:
            # One id at a time (`get`, a reader's first open), before anything else has
            # read what the others appended: a key another process provisioned since is
            # found (the look-up reads the file's tail on a miss).
            for k in keys:
                assert s.get(k) == keys[k]
            assert s.fenced(_IDS) == fences & set(_IDS)  # reads what others appended
            for k in _IDS:
                assert s.get(k) == keys.get(k)
            for k in fences:
                assert s.get(k) is None
            assert s.load(keys) == keys
    fresh = FileKeyStore(path)
    assert fresh.load() == keys
    data = path.read_bytes() if path.exists() else b""
    assert not [k for k in gone if k in data]
    for s in [*stores, fresh]:
        s.close()
