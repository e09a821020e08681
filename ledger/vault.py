"""The vault: per-subject envelope encryption of event content, and the key store.

Crypto-shredding (docs/forgetting.md, "Backups at rest"): the content of every event a
forget can erase (memory writes and corrections, task opens, notes and closes) is stored
encrypted with AES-256-GCM under a data key of its own subject. The keys live in a key
store apart from the ledger database and from every backup; a forget destroys the keys
of what it covers, so every copy of the ciphertext (a backup file, a copy of the
database file) becomes unreadable at once.

**Granularity: one key per content event.** A forget covers events one by one, by
their source order (`ledger.forgets`): a forget by key covers that key's writes with
order <= F but not a later write in the same slot, and a prefix forget covers a task's
notes up to F but not a later note. A key per slot or per task would either destroy
content the forget does not cover or force re-encrypting it; a key per event maps
every forget (by memory id, by key, by prefix, a task purge) to exactly the keys of
the events it covers, and nothing is ever re-encrypted.

**The key pool.** A key must be durable in the key store no later than the event it
seals (SQLite commits are not fsynced in WAL with synchronous=NORMAL, so a key written
with the event but not synced could be lost while the event survives). Rather than
one key-store fsync per group commit, the vault provisions keys ahead, in pools
(`KeyStore.provision_pool`: N random 128-bit ids, one write and one fsync, or one
INSERT of N rows; 64 keys first, doubling up to `POOL_MAX`), and each content event
takes a fresh one (`Vault.take`); the append path fills the pool before a group's
write transaction (`Vault.reserve`), so its write and fsync never hold the ledger's
write lock. The id of the key an event used is the one in its
sealed header (`sealed_key_id`), durable with the event itself: projections read it
with the payload (`keyed`, `StoredEvent.key_id`) and seal the view copies under the
same key; a forget finds the covered events by the forget rule in SQL over the
envelope columns and reads their keys from the payload headers (`substr` of the
payload, `projections.erasure.shred_keys`). Pool ids are checked against the present
keys and the fence like any id: a taken or fenced one refuses the batch, which is
drawn again. Unused pool keys are removed (not fenced) when the vault closes
cleanly; after a crash they remain as keys of nothing, harmless. Ledgers sealed
before the pool hold ids derived from the envelope (`key_id`, `memory_key_id`) in
their headers, and work unchanged since every reader takes the id from the header;
`subject_of` (the derived id) is still consulted where a payload in clear meets the
fence (a restore of a clear backup, `vault encrypt`). Task summaries, which belong to
no one event, keep a derived id per task (`summary_key_id`).

**What stays in clear:** the envelope, positions, the hash chain and the content digest
(the SHA-256 of the canonical plaintext event), so `replay verify` proves the chain
without keys. The digest is not keyed: see docs/forgetting.md for what a digest of a
short value lets someone who holds the envelope confirm.

Sealed payload format: `MAGIC` (5 bytes, never the `{` a JSON payload starts with),
the key id (16 bytes), a 12-byte random nonce, then the AES-GCM ciphertext and tag;
the magic and key id are the associated data.

The key store (`KeyStore`) is a file beside the SQLite database (`FileKeyStore`) or a
table in a schema of its own on PostgreSQL (`PostgresKeyStore`); data keys are wrapped
by a `KeyWrapper` (none, a master key from an environment variable or a file, or any
KMS client that implements the protocol). Destroying a key writes a durable fence entry
first, then removes the key; a fenced id is never provisioned again.
"""

from __future__ import annotations

import array
import asyncio
import base64
import binascii
import bisect
import contextlib
import fcntl
import hashlib
import itertools
import mmap
import os
import sqlite3
import struct
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final, Protocol, TypeVar

import numpy as np
import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from numpy.typing import NDArray
from sqlalchemy import LargeBinary, Text, type_coerce
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

from ledger.durable import fsync_dir, replace_file
from ledger.errors import MemledgerError

#: First bytes of a sealed payload (a plaintext payload is JSON and starts with `{`).
MAGIC: Final = b"\x00mlv1"
KEY_ID_BYTES: Final = 16
#: A data key: AES-256.
DATA_KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12
HEADER: Final = len(MAGIC) + KEY_ID_BYTES
#: How many ciphers a vault keeps built (`Vault._cache`).
CIPHER_CACHE: Final = 1 << 16
#: Keys a vault's first pool holds (`Vault.seal_rows`); each refill doubles it up to
#: `POOL_MAX`, so a short-lived process provisions few keys it never uses and a busy
#: one provisions (and fsyncs) once per `POOL_MAX` content events.
POOL_FIRST: Final = 64
POOL_MAX: Final = 4096
#: Event types whose payload is content a forget erases (sealed); the others (forgets,
#: purges, marks) keep their payload in clear, as erasure keeps it.
SEALED_TYPES: Final = frozenset({"memory.written", "memory.corrected", "task.opened",
                                 "task.noted", "task.closed"})
MEMORY_WRITE_TYPES: Final = frozenset({"memory.written", "memory.corrected"})
#: The settings that switch the vault on and say where its key store is.
ENV_ENABLE: Final = "MEMLEDGER_VAULT"
ENV_PATH: Final = "MEMLEDGER_VAULT_PATH"
ENV_URL: Final = "MEMLEDGER_VAULT_URL"
ENV_MASTER: Final = "MEMLEDGER_VAULT_MASTER_KEY"
ENV_MASTER_FILE: Final = "MEMLEDGER_VAULT_MASTER_KEY_FILE"
#: The PostgreSQL schema of the key store (never in a `memledger backup`; exclude it
#: from `pg_dump` with `--exclude-schema`, or give the key store a database of its own).
PG_SCHEMA: Final = "memledger_vault"

T = TypeVar("T")


def _cipher(kid: str, raw: bytes) -> tuple[AESGCM, bytes]:
    """The cipher of a data key and the sealed header's prefix that names it."""
    return AESGCM(raw), MAGIC + bytes.fromhex(kid)


class VaultError(MemledgerError):
    """The key store cannot be used as asked (missing, damaged, a fenced id)."""


class KeyFenced(VaultError):
    """A data key was asked for again after it was destroyed."""


# -- key ids and the cipher -----------------------------------------------------------------

def key_id(tenant: str, idempotency_key: str) -> str:
    """The data key id of an event's content (hex): a hash of its tenant and key."""
    h = hashlib.sha256(b"memledger-vault-key\x00" + tenant.encode() + b"\x00"
                       + idempotency_key.encode())
    return h.hexdigest()[:2 * KEY_ID_BYTES]


def memory_key_id(tenant: str, memory_id: str) -> str:
    """The data key id of a memory write's content: by its memory id, which one write
    holds (explicit ids are unique in a tenant) and which the view rows carry, so a
    view row read and written again finds its key without the event."""
    return key_id(tenant, "\x00memory\x00" + memory_id)


def summary_key_id(tenant: str, task_key: str) -> str:
    """The data key id of a task's summary in the tasks view: one per task, destroyed
    by the first purge or prefix forget that reaches the task (which is never served
    again after that, so its summary keeps no content from then on)."""
    return key_id(tenant, "\x00summary\x00" + task_key)


def subject_of(tenant: str, typ: str, memory_id: str | None, idempotency_key: str) -> str:
    """The data key id of an event's content: by memory id for a memory write, by
    idempotency key for a task event."""
    if typ in MEMORY_WRITE_TYPES and memory_id:
        return memory_key_id(tenant, memory_id)
    return key_id(tenant, idempotency_key)


def is_sealed(blob: bytes | None) -> bool:
    """Is `blob` a sealed payload (rather than plaintext JSON, or nothing)?"""
    return blob is not None and bytes(blob[:len(MAGIC)]) == MAGIC


def sealed_key_id(blob: bytes) -> str:
    """The key id a sealed payload names."""
    return bytes(blob[len(MAGIC):HEADER]).hex()


def seal(kid: str, key: bytes | AESGCM, plaintext: bytes) -> bytes:
    """Encrypt `plaintext` under the data key `key` (id `kid`; the key, or its cipher)."""
    head = MAGIC + bytes.fromhex(kid)
    nonce = os.urandom(NONCE_BYTES)
    aead = key if isinstance(key, AESGCM) else AESGCM(key)
    return head + nonce + aead.encrypt(nonce, plaintext, head)


def unseal(key: bytes | AESGCM, blob: bytes) -> bytes:
    """Decrypt a sealed payload; `VaultError` if it was altered or the key is wrong."""
    blob = bytes(blob)
    head, nonce = blob[:HEADER], blob[HEADER:HEADER + NONCE_BYTES]
    aead = key if isinstance(key, AESGCM) else AESGCM(key)
    try:
        return aead.decrypt(nonce, blob[HEADER + NONCE_BYTES:], head)
    except InvalidTag:
        raise VaultError(f"sealed payload under key {sealed_key_id(blob)} fails its "
                         "authentication tag (altered, or the wrong key store)") from None


# -- wrapping data keys ---------------------------------------------------------------------

class KeyWrapper(Protocol):
    """Wraps data keys before the key store keeps them (a KMS client implements this)."""

    name: str

    def wrap(self, kid: str, key: bytes) -> bytes:
        """The stored form of data key `key` (id `kid`)."""
        ...

    def unwrap(self, kid: str, wrapped: bytes) -> bytes:
        """The data key back from its stored form."""
        ...


class NoWrap:
    """Data keys stored as they are: the key store file's permissions (0600) protect them."""

    name = "none"

    def wrap(self, kid: str, key: bytes) -> bytes:
        return key

    def unwrap(self, kid: str, wrapped: bytes) -> bytes:
        return wrapped


class MasterKeyWrap:
    """Data keys wrapped with AES-256-GCM under a master key kept elsewhere (an
    environment variable or a file): a copy of the key store alone opens nothing."""

    name = "master-key"

    def __init__(self, master: bytes) -> None:
        if len(master) != 32:
            raise VaultError("the vault master key must be 32 bytes (base64 of 32 random "
                             "bytes, e.g. `openssl rand -base64 32`)")
        self._aead = AESGCM(master)

    def wrap(self, kid: str, key: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, key, kid.encode())

    def unwrap(self, kid: str, wrapped: bytes) -> bytes:
        try:
            return self._aead.decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:],
                                      kid.encode())
        except InvalidTag:
            raise VaultError("a data key does not unwrap with this master key: the key "
                             "store was written under another master key") from None


def wrapper_from_env() -> KeyWrapper:
    """The wrapper the environment names: `MEMLEDGER_VAULT_MASTER_KEY` (base64) or
    `MEMLEDGER_VAULT_MASTER_KEY_FILE` (a file holding it), else none."""
    raw = os.environ.get(ENV_MASTER)
    source = ENV_MASTER
    if not raw and os.environ.get(ENV_MASTER_FILE):
        source = os.environ[ENV_MASTER_FILE]
        try:
            raw = Path(source).read_text().strip()
        except OSError as e:
            raise VaultError(f"cannot read the vault master key file: {e.strerror}") from e
    if not raw:
        return NoWrap()
    try:
        master = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise VaultError(f"the vault master key ({source}) is not base64") from None
    return MasterKeyWrap(master)


# -- key stores -----------------------------------------------------------------------------

class KeyStore(ABC):
    """Where data keys live, apart from the ledger database and every backup."""

    #: What the store is, for reports: `file` or `postgresql`.
    kind: ClassVar[str]

    def __init__(self, wrapper: KeyWrapper | None = None) -> None:
        self.wrapper: KeyWrapper = wrapper or NoWrap()

    @abstractmethod
    def where(self) -> str:
        """The store's location, for messages (a path or a schema; never a password)."""

    @abstractmethod
    def exists(self) -> bool:
        """Does the store exist yet (a restore refuses to run without it)?"""

    @abstractmethod
    def load(self, ids: Iterable[str] | None = None) -> dict[str, bytes]:
        """Unwrapped data keys present in the store (all, or those of `ids`)."""

    def get(self, kid: str) -> bytes | None:
        """The unwrapped data key `kid`, or None if it is absent or destroyed."""
        return self.load([kid]).get(kid)

    @abstractmethod
    def fenced(self, ids: Iterable[str]) -> set[str]:
        """Which of `ids` are fenced (destroyed; never provisioned again)."""

    def revoked(self, kid: str) -> bool:
        """Is `kid` destroyed, by this process or another, as far as the store can tell
        now? The vault asks on every use of a cipher it keeps (`Vault._entry`), so
        another process's forget reaches a running process's cache: each store answers
        as cheaply as it can (a file: its size and identity; PostgreSQL: the fences
        the server announced). This default asks the store itself."""
        return self.get(kid) is None

    @abstractmethod
    def _provision(self, want: Sequence[str], *, fresh: bool = False) -> dict[str, bytes]:
        """Every key of `want`: those present, and new ones for the rest, stored durably
        before it returns; `KeyFenced` if any of the rest is fenced. Atomic against
        other processes' provisioning and fencing of the same ids. `fresh`: every id
        must be new (neither present nor fenced), else `KeyFenced` and nothing stored."""

    @abstractmethod
    def _release(self, ids: Sequence[str]) -> None:
        """Remove the keys of `ids` without fencing them (pool keys that sealed
        nothing: `Vault.close`)."""

    @abstractmethod
    def _fence(self, ids: Sequence[str]) -> None:
        """Durably record `ids` as destroyed (before their keys are removed)."""

    @abstractmethod
    def _remove(self, ids: Sequence[str]) -> None:
        """Remove the keys of fenced `ids` from the store's files."""

    def _new_keys(self, ids: Sequence[str]) -> dict[str, tuple[bytes, bytes]]:
        """Fresh random data keys for `ids`: id -> (key, its wrapped form)."""
        wrap = self.wrapper.wrap
        # One read of the random source for the batch, 32 bytes a key (what
        # `AESGCM.generate_key(bit_length=256)` reads for one), sliced.
        raw = os.urandom(DATA_KEY_BYTES * len(ids))
        out = {}
        for i, k in enumerate(ids):
            key = raw[i * DATA_KEY_BYTES:(i + 1) * DATA_KEY_BYTES]
            out[k] = (key, wrap(k, key))
        return out

    def provision(self, ids: Iterable[str]) -> dict[str, bytes]:
        """Create the keys of `ids` that do not exist (durable before it returns);
        returns every key of `ids`. A fenced id raises `KeyFenced`."""
        want = sorted(set(ids))
        return self._provision(want) if want else {}

    def provision_pool(self, n: int) -> dict[str, bytes]:
        """`n` new keys under random 128-bit ids, stored durably (one write and one
        fsync, or one INSERT) before it returns. An id that is present or fenced
        (a collision: about 2**-128 a pair) is never reused: the batch is drawn again."""
        for _ in range(8):
            ids = sorted({os.urandom(KEY_ID_BYTES).hex() for _ in range(n)})
            try:
                return self._provision(ids, fresh=True)
            except KeyFenced:
                continue
        raise VaultError("the key store refused eight batches of random key ids: its "
                         "random source is broken")

    def release(self, ids: Iterable[str]) -> None:
        """Remove keys that sealed nothing (unused pool keys), without fencing them."""
        want = sorted(set(ids))
        if want:
            self._release(want)

    def destroy(self, ids: Iterable[str]) -> int:
        """Fence `ids` durably, then remove their keys; returns how many were fenced now."""
        want = sorted(set(ids))
        new = sorted(set(want) - self.fenced(want))
        if new:
            self._fence(new)
        self._remove(want)
        return len(new)

    def close(self) -> None:  # noqa: B027 - most stores hold nothing open
        """Release what the store holds open."""

    def _forked(self) -> None:  # noqa: B027 - most stores hold nothing per process
        """In a forked child (`_after_fork`): drop what belongs to the parent process
        (open files, connections, threads, locks another thread may have held)."""


#: The tag byte of a key record, as indexing the file's mapping reads it.
_K_TAG: Final = ord("K")
#: A file key store's look for fences of destroys cut short (`FileKeyStore.revoked`)
#: happens at most this often, in seconds.
REVOKE_LOOK_S: Final = 0.001


class FileKeyStore(KeyStore):
    """A binary file beside the SQLite database (`<db>.vault`), mode 0600.

    **Layout.** A 16-byte head (`FILE_MAGIC`, the record width `W` as a big-endian
    u16, zeros), then fixed-size records of `_REC.size + W` bytes: tag (1 byte), key id
    (16 bytes), length (2 bytes, big-endian), then `W` bytes holding that many bytes
    of content and zeros after it. Tags: `K` a wrapped key, `F` a fence whose key may
    still be in the file (a destroy under way, or cut short by a crash), `X` a fence
    whose key record is overwritten, `D` a destroyed or released key (its bytes
    zeroed). `W` is the longest wrapped key the file holds (32 bytes unwrapped, 60
    under a master key); a longer one (another wrapper) makes the writer rewrite the
    file with a larger `W` first.

    **Reading only what is needed.** A process maps the file (`mmap`, read only) and
    takes the first 8 bytes of every record's id into one integer array, with no
    Python step per record; a key is found by comparing that array (a scan for the
    first few look-ups, then a sorted copy and binary search), confirmed against the
    whole id and tag in the mapping, and unwrapped only when asked for. So a new
    process that opens two values of a 100k-key store reads two keys, not 100k. The
    records appended after the sorted copy (up to an eighth of the file before it is
    sorted again) are compared all at once for a look-up of many ids (a pool's
    collision check: one `isin`), and found in a map by id, filled as they are met, for
    a read of one key (`_seek`, `bisect` over compact copies of the sorted index): a
    process that opens another process's events reads each new key once, one at a
    time, and a sort of the tail per read made that cost milliseconds.

    **Writes.** Writers take an exclusive `flock` on the file (and check that the path
    still names the file they locked: a rewrite replaces it), read what other
    processes appended since their last look, append their records in one write and
    fsync before they return: one fsync for a whole pool of keys
    (`KeyStore.provision_pool`). Destroying a key appends its `F` record and fsyncs
    first, then overwrites the key's record in place with a `D` record, fsyncs, and
    only then turns the `F` into an `X`. A crash in between leaves an `F`: the key
    counts as destroyed at once (every reader checks for a fence), and the next
    process that opens the file overwrites it. A crash in the middle of an append
    leaves a torn record (or zeros), never acknowledged, which readers skip and the
    next writer cuts off.

    Key stores written by an earlier memledger (JSON Lines `{"k": id, "w": base64}` /
    `{"f": id}`, or the variable-length records of `FILE_MAGIC_V2`) are rewritten in
    this format when first opened (a new file, fsynced, renamed over the old one, the
    old file's bytes zeroed before its last link goes); destroyed keys are not
    carried over.
    """

    kind: ClassVar[str] = "file"

    def __init__(self, path: str | os.PathLike[str], wrapper: KeyWrapper | None = None
                 ) -> None:
        super().__init__(wrapper)
        self.path = Path(path)
        self._ino: int | None = None
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._opened = False
        self._map: mmap.mmap | None = None
        # Unwrapped keys by id, with the number of the record they were read from.
        self._plain: dict[str, tuple[int, bytes]] = {}
        self._width = -1  # record content width W; -1 until the head is read
        self._n = 0  # whole records indexed (and mapped)
        self._hi = np.zeros(0, np.int64)  # first 8 bytes of each record's id; [:n] used
        self._order: NDArray[np.int64] | None = None  # records [0, _ns) sorted by _hi
        self._sorted_hi: NDArray[np.int64] | None = None
        self._ns = 0
        self._scans = 0
        # For look-ups of a few ids (a key read): the sorted index as compact arrays
        # `bisect` searches, and the records after it by id, filled as they are met.
        self._sorted_a: array.array[int] | None = None
        self._order_a: array.array[int] | None = None
        self._tail_ids: dict[int, list[int]] = {}
        self._tail_upto = 0
        self._pending: list[int] = []  # `F` records seen at the first read
        self._looked = -1.0  # `time.monotonic()` of `revoked`'s last look at the file
        _PER_PROCESS.add(self)

    def _forked(self) -> None:
        """A forked child shares the parent's open file description, and with it the
        parent's `flock`: the two would not exclude each other's appends. The child
        opens the file afresh (its own description, its own lock) and reads it again."""
        self._lock = threading.Lock()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # the child's copy: the parent's stays open
        self._fd, self._ino = None, None
        self._reset()

    def where(self) -> str:
        return str(self.path)

    def exists(self) -> bool:
        return self.path.exists()

    # -- the file ------------------------------------------------------------------------
    def _reset(self) -> None:
        """Forget what was read of the file (it was replaced: read it again)."""
        if self._map is not None:
            self._map.close()
        self._map = None
        self._plain.clear()
        self._width, self._n, self._ns, self._scans = -1, 0, 0, 0
        self._hi = np.zeros(0, np.int64)
        self._order = self._sorted_hi = None
        self._unindex()

    def _unindex(self) -> None:
        """Forget the few-id look-up's arrays and tail map (the index was rebuilt)."""
        self._sorted_a = self._order_a = None
        self._tail_ids, self._tail_upto = {}, self._ns

    def _open_fd(self, create: bool) -> int | None:
        """The store's file descriptor (reopened if the file was replaced), or None if
        the file does not exist and `create` is false."""
        if self._fd is not None:
            try:
                same = os.stat(self.path).st_ino == self._ino
            except FileNotFoundError:
                same = False
            if same:
                return self._fd
            os.close(self._fd)
            self._fd, self._ino = None, None
            self._reset()  # replaced (rewritten by another process): read it again
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            return None
        with _flocked(fd):
            if os.fstat(fd).st_size == 0:
                os.write(fd, _file_head(0))
                os.fsync(fd)
                fsync_dir(self.path)
            first = os.pread(fd, len(FILE_MAGIC), 0)
        if first[:1] == b"{" or first == FILE_MAGIC_V2:
            os.close(fd)
            self._convert_legacy()
            return self._open_fd(create)
        self._fd, self._ino = fd, os.fstat(fd).st_ino
        return fd

    @contextlib.contextmanager
    def _locked(self, create: bool) -> Iterator[int | None]:
        """The file descriptor under an exclusive `flock`, the path checked to still
        name the locked file (a rewrite by another process replaces it), and what other
        processes appended read (a torn record cut off). None if there is no file and
        `create` is false."""
        while True:
            fd = self._open_fd(create)
            if fd is None:
                yield None
                return
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            fcntl.flock(fd, fcntl.LOCK_UN)  # replaced meanwhile: open the new one
        try:
            self._read_tail(fd, writer=True)
            yield fd
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _rec_size(self) -> int:
        return _REC.size + self._width

    def _read_tail(self, fd: int, *, writer: bool) -> None:
        """Map and index the records appended since the last look (no Python step per
        record). A torn last record is left for later by a reader (its writer may still
        be at work) and cut off by a writer (holding the lock, it knows nobody is)."""
        size = os.fstat(fd).st_size
        if self._n == 0:  # the width of a file without records may have been set since
            head = os.pread(fd, _HEAD_BYTES, 0)
            if len(head) < _HEAD_BYTES or head[:len(FILE_MAGIC)] != FILE_MAGIC:
                raise VaultError(f"key store {self.path} is not a memledger key store "
                                 "(or its first bytes are damaged)")
            self._width = _WIDTH.unpack_from(head, len(FILE_MAGIC))[0]
        rec = self._rec_size()
        whole = (size - _HEAD_BYTES) // rec
        if whole < self._n:  # shorter than what was read: not ours to trust, read again
            self._reset()
            self._read_tail(fd, writer=writer)
            return
        if whole > self._n:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(fd, _HEAD_BYTES + whole * rec, mmap.MAP_SHARED,
                                  mmap.PROT_READ)
            base = self._n
            view = np.frombuffer(self._map, dtype=_rec_dtype(rec), count=whole - base,
                                 offset=_HEAD_BYTES + base * rec)
            tags = np.array(view["tag"])
            hi = view["hi"].astype(np.int64)
            del view  # no view may outlive the mapping
            bad = np.flatnonzero(~np.isin(tags, _TAGS))
            if len(bad):
                first = int(bad[0])
                if tags[first:].any():
                    raise VaultError(f"key store {self.path} is damaged at byte "
                                     f"{_HEAD_BYTES + (base + first) * rec}")
                whole = base + first  # zeros at the end: an append cut short
                tags, hi = tags[:first], hi[:first]
            if not self._opened:
                self._pending = (np.flatnonzero(tags == _F) + base).tolist()
            late = np.flatnonzero((tags == _F) | (tags == _X)) if self._plain else ()
            if len(self._hi) < whole:
                grown = np.zeros(max(whole, 2 * len(self._hi), 1024), np.int64)
                grown[:base] = self._hi[:base]
                self._hi = grown
            self._hi[base:whole] = hi
            self._n = whole
            for i in late:  # another process's fences: drop the keys read before
                self._plain.pop(self._record(base + int(i))[1].hex(), None)
        end = _HEAD_BYTES + self._n * rec
        if writer and end < size:  # a torn record of a crashed writer
            os.ftruncate(fd, end)
            os.fsync(fd)
        if not self._opened:
            self._opened = True
            pending, self._pending = self._pending, []
            if pending:  # fenced before a crash, key record not yet overwritten
                if writer:
                    self._settle(fd, pending)
                else:
                    with _flocked(fd):
                        self._settle(fd, pending)

    def _record(self, i: int) -> tuple[bytes, bytes, bytes]:
        """(tag, raw id, content) of record `i`, as the file holds it now."""
        assert self._map is not None
        rec = self._rec_size()
        off = _HEAD_BYTES + i * rec
        raw = self._map[off:off + rec]
        tag, rid, length = _REC.unpack_from(raw)
        return tag, rid, raw[_REC.size:_REC.size + length]

    def _find(self, rids: Sequence[bytes]) -> list[list[int]]:
        """The numbers of the records of each raw id, in file order."""
        n = self._n
        if not n or not rids:
            return [[] for _ in rids]
        ints = [int.from_bytes(r[:8], "big", signed=True) for r in rids]
        hits: list[list[int]]
        if len(rids) > _SCAN_BATCH or self._scans >= _SCANS or self._order is not None:
            self._sort(n)
            hits = self._seek(ints, n) if len(rids) <= _SCAN_BATCH else self._match(ints, n)
        else:
            self._scans += len(rids)
            hi = self._hi[:n]
            hits = [np.flatnonzero(hi == k).tolist() for k in ints]
        return [[i for i in got if self._record(i)[1] == rid]
                for rid, got in zip(rids, hits, strict=True)]

    def _sort(self, n: int) -> None:
        """(`_lock` held.) Sort the id array of the first `n` records, if it is not
        sorted or more than `_UNSORTED` (or an eighth of the sorted) records came after
        the sort."""
        if self._order is None or n - self._ns > max(_UNSORTED, self._ns // 8):
            self._order = np.argsort(self._hi[:n], kind="stable")
            self._sorted_hi = self._hi[:n][self._order]
            self._ns = n
            self._unindex()

    def _seek_ready(self, n: int) -> None:
        """(`_lock` held, the id array sorted.) The few-id look-up's arrays, and the
        records after the sort up to `n` put in `_tail_ids` by id."""
        if self._sorted_a is None or self._order_a is None:
            assert self._sorted_hi is not None and self._order is not None
            self._sorted_a = array.array("q", self._sorted_hi.tobytes())
            self._order_a = array.array("q", self._order.astype(np.int64).tobytes())
        if self._tail_upto < n:
            tail = self._tail_ids
            for i, h in enumerate(self._hi[self._tail_upto:n].tolist(), self._tail_upto):
                tail.setdefault(h, []).append(i)
            self._tail_upto = n

    def _seek(self, ints: Sequence[int], n: int) -> list[list[int]]:
        """A few ids (a key read): `bisect` in the sorted index, and the tail's records
        by id (each record after the index is put in `_tail_ids` once, when first met),
        so a read costs a few microseconds whatever the size of the file or its tail."""
        self._seek_ready(n)
        sa, oa, tail = self._sorted_a, self._order_a, self._tail_ids
        assert sa is not None and oa is not None
        out = []
        for k in ints:
            lo = up = bisect.bisect_left(sa, k)
            while up < len(sa) and sa[up] == k:  # ids share their first 8 bytes rarely
                up += 1
            # The index is a stable sort, so equal ids are in file order; the tail's
            # records come after all of them.
            out.append(oa[lo:up].tolist() + tail.get(k, []))
        return out

    def _match(self, ints: Sequence[int], n: int) -> list[list[int]]:
        """Many ids (a pool's collision check): the sorted index searched and the tail
        compared with all of them at once; then only the ids some record shares are
        looked at one by one (none, for a pool of fresh random ids, where a scan of the
        tail per id made provisioning quadratic)."""
        assert self._sorted_hi is not None and self._order is not None
        keys = np.array(ints, np.int64)
        lo = self._sorted_hi.searchsorted(keys, "left")
        up = self._sorted_hi.searchsorted(keys, "right")
        tail, ns = self._hi[self._ns:n], self._ns
        in_tail = (np.isin(keys, tail) if len(tail)
                   else np.zeros(len(keys), bool))
        order = self._order
        hits: list[list[int]] = [[] for _ in ints]
        for j in np.flatnonzero((up > lo) | in_tail).tolist():
            got = order[lo[j]:up[j]].tolist()
            if in_tail[j]:
                got.extend((np.flatnonzero(tail == keys[j]) + ns).tolist())
            hits[j] = got
        return hits

    def _states(self, ids: Sequence[str]) -> list[tuple[int | None, bool]]:
        """For each id: (its key record, or None; is it fenced)."""
        out: list[tuple[int | None, bool]] = []
        for recs in self._find([bytes.fromhex(k) for k in ids]):
            key, fenced = None, False
            for i in recs:
                tag = self._record(i)[0]
                if tag == b"K":
                    key = i
                elif tag in (b"F", b"X"):
                    fenced = True
            out.append((key, fenced))
        return out

    def _append(self, fd: int, records: bytes) -> None:
        """Write `records` at the end (the caller holds the lock and has read the tail),
        fsync, and index them."""
        os.pwrite(fd, records, _HEAD_BYTES + self._n * self._rec_size())
        os.fsync(fd)
        self._read_tail(fd, writer=True)
        if self._order is not None:
            # Look-ups here go through the sorted index: the records this process wrote
            # are indexed now, on the writing path (a pool's refill, a fence), not by
            # the next read, which paid 0.2-1.3 ms for a pool of 1,000-4,096 keys, and
            # an argsort of the whole file when they pushed the tail past the re-sort.
            self._sort(self._n)
            self._seek_ready(self._n)

    def _records(self, tag: bytes, ids: Iterable[str],
                 content: dict[str, bytes] | None = None) -> bytes:
        width = self._width
        out = bytearray()
        for k in ids:
            body = b"" if content is None else content[k]
            out += _REC.pack(tag, bytes.fromhex(k), len(body)) + body.ljust(width, b"\x00")
        return bytes(out)

    def _overwrite(self, fd: int, records: Iterable[int]) -> int:
        """Overwrite key records in place with `D` records (zeros where the key was)
        and fsync; returns how many."""
        rec = self._rec_size()
        done = 0
        for i in records:
            tag, rid, _ = self._record(i)
            if tag == b"K":
                os.pwrite(fd, _REC.pack(b"D", rid, 0) + bytes(self._width),
                          _HEAD_BYTES + i * rec)
                done += 1
        if done:
            os.fsync(fd)
        return done

    def _settle(self, fd: int, fences: Sequence[int]) -> None:
        """Overwrite the key records of the ids of `F` records `fences` (fsynced), then
        turn those `F`s into `X`s (a lost `X` only means the check is made again)."""
        rids = [self._record(i)[1] for i in fences]
        self._overwrite(fd, [i for recs in self._find(rids) for i in recs])
        rec = self._rec_size()
        for i in fences:
            if self._record(i)[0] == b"F":
                os.pwrite(fd, b"X", _HEAD_BYTES + i * rec)
        for rid in rids:
            self._plain.pop(rid.hex(), None)

    def _widen(self, fd: int, width: int) -> None:
        """Make room for content of `width` bytes (the caller holds the lock): an empty
        file gets a new head; one with records is rewritten (keys and fences; `D`
        records are dropped) and replaced, and this process reopens it."""
        if self._n == 0:
            os.pwrite(fd, _file_head(width), 0)
            os.fsync(fd)  # the head is durable before any record of its width
            self._width = width
            return
        keys: dict[str, bytes] = {}
        fences: list[str] = []
        for i in range(self._n):
            tag, rid, body = self._record(i)
            if tag == b"K":
                keys[rid.hex()] = body
            elif tag in (b"F", b"X"):
                fences.append(rid.hex())
        self._write_new(fd, width, keys, fences)

    def _write_new(self, old_fd: int, width: int, keys: dict[str, bytes],
                   fences: Iterable[str]) -> None:
        """Replace the file by one of `width` holding `keys` (those not fenced) and
        `fences` (as `X`): written beside, fsynced, renamed over it; then the old file's
        bytes are zeroed (they held the keys of forgotten subjects too) and fsynced."""
        fenced = set(fences)
        self._width = width
        data = bytearray(_file_head(width))
        data += self._records(b"X", sorted(fenced))
        data += self._records(b"K", [k for k in keys if k not in fenced], keys)
        replace_file(self.path, self.path.with_name(self.path.name + ".converting"),
                     bytes(data))
        old = os.fstat(old_fd).st_size
        os.pwrite(old_fd, bytes(old), 0)
        os.fsync(old_fd)
        self._reset()

    def _convert_legacy(self) -> None:
        """Rewrite a key store of an earlier format (JSON Lines, or `FILE_MAGIC_V2`'s
        variable-length records) in this one."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            with _flocked(fd):
                data = b""
                while chunk := os.pread(fd, 1 << 20, len(data)):
                    data += chunk
                if data[:1] == b"{":
                    keys, fences = self._parse_json_lines(data)
                elif data[:len(FILE_MAGIC_V2)] == FILE_MAGIC_V2:
                    keys, fences = self._parse_v2(data)
                else:
                    return  # another process converted it meanwhile
                width = max((len(w) for w in keys.values()), default=0)
                self._write_new(fd, width, keys, fences)
        finally:
            os.close(fd)

    def _parse_json_lines(self, data: bytes) -> tuple[dict[str, bytes], set[str]]:
        keys: dict[str, bytes] = {}
        fences: set[str] = set()
        lines = data.split(b"\n")
        for n, line in enumerate(lines):
            try:
                obj = orjson.loads(line) if line.strip() else {}
            except orjson.JSONDecodeError:
                if n == len(lines) - 1:
                    break  # a torn last line was never acknowledged
                raise VaultError(f"key store {self.path} is damaged at line "
                                 f"{n + 1}") from None
            if "k" in obj:
                keys[obj["k"]] = base64.b64decode(obj["w"])
            elif "f" in obj:
                fences.add(obj["f"])
        return keys, fences

    def _parse_v2(self, data: bytes) -> tuple[dict[str, bytes], set[str]]:
        keys: dict[str, bytes] = {}
        fences: set[str] = set()
        i, n = len(FILE_MAGIC_V2), len(data)
        while i + _REC.size <= n:
            tag, raw_id, length = _REC.unpack_from(data, i)
            end = i + _REC.size + length
            if end > n:
                break  # a torn last record was never acknowledged
            if tag == b"K":
                keys[raw_id.hex()] = data[i + _REC.size:end]
            elif tag == b"F":
                fences.add(raw_id.hex())
            elif tag != b"D":
                raise VaultError(f"key store {self.path} is damaged at byte {i}")
            i = end
        return keys, fences

    def _refresh(self) -> int | None:
        """Read what other processes appended since the last look (caller holds
        `_lock`); the file descriptor, or None while the file does not exist."""
        fd = self._open_fd(create=False)
        if fd is not None:
            self._read_tail(fd, writer=False)
        return fd

    # -- the interface -------------------------------------------------------------------
    def _unwrapped(self, kid: str, record: int) -> bytes:
        key = self.wrapper.unwrap(kid, self._record(record)[2])
        self._plain[kid] = (record, key)
        return key

    def _cached(self, kid: str) -> bytes | None:
        """The key read earlier, if its record still holds it (another process's
        destroy overwrites it in place, which the mapping shows)."""
        got, m = self._plain.get(kid), self._map
        if got is None or m is None:
            return None
        if m[_HEAD_BYTES + got[0] * self._rec_size()] != _K_TAG:  # the record's tag byte
            del self._plain[kid]
            return None
        return got[1]

    def _present(self, ids: Sequence[str]) -> dict[str, bytes]:
        """The keys of `ids` the file holds and no fence names (caller holds `_lock`)."""
        out: dict[str, bytes] = {}
        todo = []
        for k in ids:
            key = self._cached(k)
            if key is None:
                todo.append(k)
            else:
                out[k] = key
        if todo:
            for k, (rec, fenced) in zip(todo, self._states(todo), strict=True):
                if rec is not None and not fenced:
                    out[k] = self._unwrapped(k, rec)
        return out

    def load(self, ids: Iterable[str] | None = None) -> dict[str, bytes]:
        with self._lock:
            if ids is None:
                self._refresh()
                fenced = {self._record(i)[1] for i in range(self._n)
                          if self._record(i)[0] in (b"F", b"X")}
                out = {}
                for i in range(self._n):
                    tag, rid, _ = self._record(i)
                    if tag == b"K" and rid not in fenced:
                        out[rid.hex()] = self._unwrapped(rid.hex(), i)
                return out
            wanted = list(dict.fromkeys(ids))
            if self._fd is None:
                self._refresh()
            got = self._present(wanted)
            if len(got) < len(wanted):
                seen = (self._ino, self._n)
                self._refresh()  # appended (or rewritten) by another process since?
                if (self._ino, self._n) != seen:
                    got.update(self._present([k for k in wanted if k not in got]))
            return got

    def create(self) -> None:
        """Create the file (empty, with its head) if it does not exist."""
        with self._lock:
            self._open_fd(create=True)

    def get(self, kid: str) -> bytes | None:
        """`load([kid])` for one id (a reader's first open of a value: `Vault.open`),
        each candidate record read once: the same answer, fences and other processes'
        appends counted alike."""
        with self._lock:
            key = self._cached(kid)
            if key is not None:
                return key
            if self._fd is None:
                self._refresh()
            rid = bytes.fromhex(kid)
            found, key = self._one(kid, rid)
            if not found:
                seen = (self._ino, self._n)
                self._refresh()  # appended (or rewritten) by another process since?
                if (self._ino, self._n) != seen:
                    key = self._one(kid, rid)[1]
            return key

    def revoked(self, kid: str) -> bool:
        """A destroy that finished (its `destroy` returned) overwrote the key's record
        in place, which this process's mapping of the file shows at once (`_cached`,
        no system call; a rewrite zeroes the old file, which shows the same way). A
        destroy cut short after its fence (its process died before the overwrite) is
        seen by a look at the file at most `REVOKE_LOOK_S` apart: one `fstat` (the size
        is what was read, and the file still has a name), and if either changed, the
        records appended since (their fences drop the keys they name, `_read_tail`).
        Then the answer is `get`'s."""
        with self._lock:
            fd, now = self._fd, time.monotonic()
            if fd is None or self._width < 0:
                self._refresh()
                self._looked = now
            elif now - self._looked >= REVOKE_LOOK_S:
                self._looked = now
                st = os.fstat(fd)
                if st.st_nlink == 0 or st.st_size != _HEAD_BYTES + self._n * self._rec_size():
                    self._refresh()
            if self._cached(kid) is not None:
                return False  # the record it was read from still holds the key
        return self.get(kid) is None

    def _one(self, kid: str, rid: bytes) -> tuple[bool, bytes | None]:
        """(caller holds `_lock`) Whether the file holds a key or a fence of `rid`, and
        the unwrapped key (None if absent or fenced), read as `_states` reads it."""
        n = self._n
        if not n:
            return False, None
        if self._order is None or n - self._ns > max(_UNSORTED, self._ns // 8):
            return self._fallback(kid)
        hit = self._seek([int.from_bytes(rid[:8], "big", signed=True)], n)[0]
        key_rec: int | None = None
        body = b""
        fenced = False
        for i in hit:
            tag, got, content = self._record(i)
            if got != rid:
                continue
            if tag == b"K":
                key_rec, body = i, content
            elif tag in (b"F", b"X"):
                fenced = True
        if fenced:
            return True, None
        if key_rec is None:
            return False, None
        key = self.wrapper.unwrap(kid, body)
        self._plain[kid] = (key_rec, key)
        return True, key

    def _fallback(self, kid: str) -> tuple[bool, bytes | None]:
        """`_one` where the sorted index is not built (or due to be rebuilt): by
        `_states`, which builds it when due."""
        (rec, fenced), = self._states([kid])
        if fenced:
            return True, None
        if rec is None:
            return False, None
        return True, self._unwrapped(kid, rec)

    def fenced(self, ids: Iterable[str]) -> set[str]:
        with self._lock:
            self._refresh()
            want = list(dict.fromkeys(ids))
            return {k for k, (_, f) in zip(want, self._states(want), strict=True) if f}

    def _provision(self, want: Sequence[str], *, fresh: bool = False) -> dict[str, bytes]:
        with self._lock:
            self._refresh()  # a fence another process wrote since counts
            if not fresh:
                have = self._present(want)
                if len(have) == len(want):
                    return have
            while True:
                with self._locked(create=True) as fd:
                    assert fd is not None
                    states = self._states(want)
                    _refuse_fenced([k for k, (rec, fenced) in zip(want, states, strict=True)
                                    if fenced or (fresh and rec is not None)])
                    have = {k: self._unwrapped(k, rec)
                            for k, (rec, _) in zip(want, states, strict=True)
                            if rec is not None}
                    new = self._new_keys([k for k in want if k not in have])
                    if not new:
                        return have
                    width = max(len(w) for _, w in new.values())
                    if width > self._width:
                        self._widen(fd, width)
                        continue  # rewritten: lock the file the path names now
                    first = self._n
                    self._append(fd, self._records(b"K", list(new),
                                                   {k: w for k, (_, w) in new.items()}))
                    for i, (k, (key, _)) in enumerate(new.items()):
                        self._plain[k] = (first + i, key)
                        have[k] = key
                    return have

    def _fence(self, ids: Sequence[str]) -> None:
        with self._lock, self._locked(create=True) as fd:
            assert fd is not None
            self._append(fd, self._records(b"F", ids))
            for k in ids:
                self._plain.pop(k, None)

    def _remove(self, ids: Sequence[str]) -> None:
        """Overwrite the key records of the fenced ones of `ids` (the fences another
        process wrote count), then mark their fences settled."""
        with self._lock, self._locked(create=False) as fd:
            if fd is None:
                return
            fences = [i for recs in self._find([bytes.fromhex(k) for k in ids])
                      for i in recs if self._record(i)[0] == b"F"]
            self._settle(fd, fences)

    def _release(self, ids: Sequence[str]) -> None:
        with self._lock, self._locked(create=False) as fd:
            if fd is None:
                return
            self._overwrite(fd, [i for recs in self._find([bytes.fromhex(k) for k in ids])
                                 for i in recs])
            for k in ids:
                self._plain.pop(k, None)

    def close(self) -> None:
        with self._lock:
            self._reset()
            if self._fd is not None:
                os.close(self._fd)
                self._fd, self._ino = None, None
            self._opened = False


#: First bytes of a key store file (`FileKeyStore`); the record width follows.
FILE_MAGIC: Final = b"\x00mlks3\n"
#: First bytes of a key store file of the previous format (variable-length records,
#: rewritten in the current one when first opened).
FILE_MAGIC_V2: Final = b"\x00mlks2\n"
_WIDTH: Final = struct.Struct(">H")
#: Bytes before the first record: the magic, the width, zeros.
_HEAD_BYTES: Final = 16
#: A key store record's head: tag, key id, length of the content that follows (the
#: record then runs to the file's width).
_REC: Final = struct.Struct(">c16sH")
_F: Final = ord("F")
_X: Final = ord("X")
_TAGS: Final = np.frombuffer(b"KFXD", dtype=np.uint8)
#: Look-ups by a scan of the id array before a sorted copy is made (and a batch of
#: more ids than `_SCAN_BATCH` sorts at once); at most `_UNSORTED` records (or an
#: eighth of the sorted ones) appended since the sort are scanned before it is redone.
_SCANS: Final = 32
_SCAN_BATCH: Final = 8
_UNSORTED: Final = 4096


def _file_head(width: int) -> bytes:
    head = FILE_MAGIC + _WIDTH.pack(width)
    return head + bytes(_HEAD_BYTES - len(head))


def _rec_dtype(size: int) -> np.dtype[Any]:
    """A record as numpy reads it: its tag and the first 8 bytes of its id."""
    return np.dtype({"names": ["tag", "hi"], "formats": ["u1", ">i8"], "offsets": [0, 1],
                     "itemsize": size})


@contextlib.contextmanager
def _flocked(fd: int) -> Iterator[None]:
    """Hold an exclusive lock on the key store file (between processes)."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _refuse_fenced(hit: Sequence[str]) -> None:
    if hit:
        raise KeyFenced(f"{len(hit)} data key(s) were destroyed by a forget and are never "
                        "provisioned again")


class PostgresKeyStore(KeyStore):
    """Tables `data_keys` and `key_fence` in a schema of their own (`memledger_vault`),
    on the ledger's server or another one (`MEMLEDGER_VAULT_URL`).

    The interface is synchronous (it is called where rows are encoded and decoded);
    its queries run on a private event loop in a daemon thread with one asyncpg
    connection. A destroy commits the fence rows and the deletion in one transaction,
    then VACUUMs `data_keys` so the deleted row versions leave the table's pages.
    """

    kind: ClassVar[str] = "postgresql"

    def __init__(self, url: str, wrapper: KeyWrapper | None = None, *,
                 schema: str = PG_SCHEMA) -> None:
        super().__init__(wrapper)
        self.dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
        self.schema = schema
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: Any = None
        self._cache: dict[str, bytes] = {}
        # Ids other processes fenced, as the server announced them (`_heard`).
        self._revoked: set[str] = set()
        self._lock = threading.Lock()
        _PER_PROCESS.add(self)

    def _forked(self) -> None:
        """A forked child has no event-loop thread and must not speak on the parent's
        connection: it connects again on first use (the parent's stays the parent's).
        The parent's loop shares its epoll instance with the child, so closing it here,
        or letting it be collected (which closes it), would unregister the parent's
        descriptors and leave the parent's loop waiting forever: it is marked closed
        (what it does then touches nothing) and kept, with the connection, for the
        child's lifetime."""
        self._lock = threading.Lock()
        if self._loop is not None:
            self._loop._closed = True  # type: ignore[attr-defined]
            _INHERITED.append((self._loop, self._conn))
        self._loop, self._conn = None, None

    def where(self) -> str:
        host = self.dsn.rsplit("@", 1)[-1]
        return f"schema {self.schema} at {host}"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True,
                                 name="memledger-vault").start()
                self._loop = loop
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _connection(self) -> Any:
        import asyncpg

        if self._conn is None or self._conn.is_closed():
            # Keys read on a connection that was lost were not covered by its
            # announcements since: read them again (with their fences) when next used.
            self._cache.clear()
            self._conn = await asyncpg.connect(self.dsn)
            s = self.schema
            await self._conn.execute(
                f'CREATE SCHEMA IF NOT EXISTS "{s}"; '
                f'CREATE TABLE IF NOT EXISTS "{s}".data_keys '
                "(key_id text PRIMARY KEY, wrapped bytea NOT NULL); "
                f'CREATE TABLE IF NOT EXISTS "{s}".key_fence '
                "(key_id text PRIMARY KEY, fenced_at timestamptz NOT NULL DEFAULT now())")
            # Listening before any key is read on this connection: every fence
            # committed after a read is announced to this process (`_heard`).
            await self._conn.add_listener(self._channel(), self._heard)
        return self._conn

    def _channel(self) -> str:
        return f"{self.schema}.key_fence"[:63]

    def _heard(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        """A fence another process (or this one) committed: the ids it names are never
        served from this process's cache again (`revoked`)."""
        for kid in payload.split(","):
            self._revoked.add(kid)
            self._cache.pop(kid, None)

    def revoked(self, kid: str) -> bool:
        """Announced as fenced since this connection began listening, or (a key not
        read on it) fenced or absent on the server now. No query for a key read on the
        current connection: its destroy would have been announced, within the time a
        notification takes to arrive."""
        if kid in self._revoked:
            return True
        conn = self._conn
        if conn is None or conn.is_closed():  # lost: what it heard no longer covers all
            self._cache.clear()
        return kid not in self._cache and self.get(kid) is None

    def exists(self) -> bool:
        async def q() -> bool:
            import asyncpg

            conn = await asyncpg.connect(self.dsn)
            try:
                return bool(await conn.fetchval(
                    "SELECT to_regclass($1) IS NOT NULL", f'"{self.schema}".data_keys'))
            finally:
                await conn.close()
        return self._run(q())

    def load(self, ids: Iterable[str] | None = None) -> dict[str, bytes]:
        wanted = None if ids is None else list(ids)
        # `.get`, never `in` then `[]`: the listener thread drops fenced ids (`_heard`).
        cache = self._cache
        if wanted is not None:
            hit = {k: v for k in wanted if (v := cache.get(k)) is not None}
            if len(hit) == len(wanted):
                return hit

        async def q() -> list[Any]:
            c = await self._connection()
            # A fenced key whose row is still there (a destroy cut short) is destroyed.
            unfenced = (f'NOT EXISTS (SELECT 1 FROM "{self.schema}".key_fence f '
                        "WHERE f.key_id = k.key_id)")
            if wanted is None:
                return list(await c.fetch(f'SELECT k.key_id, k.wrapped FROM '
                                          f'"{self.schema}".data_keys k WHERE {unfenced}'))
            return list(await c.fetch(
                f'SELECT k.key_id, k.wrapped FROM "{self.schema}".data_keys k '
                f"WHERE k.key_id = ANY($1::text[]) AND {unfenced}", wanted))
        got = {r[0]: self.wrapper.unwrap(r[0], bytes(r[1])) for r in self._run(q())}
        cache.update(got)
        return got

    def fenced(self, ids: Iterable[str]) -> set[str]:
        wanted = list(ids)

        async def q() -> list[Any]:
            c = await self._connection()
            return list(await c.fetch(f'SELECT key_id FROM "{self.schema}".key_fence '
                                      "WHERE key_id = ANY($1::text[])", wanted))
        return {r[0] for r in self._run(q())} if wanted else set()

    def _provision(self, want: Sequence[str], *, fresh: bool = False) -> dict[str, bytes]:
        # No shortcut through the cache: another process may have fenced a cached id.
        new = self._new_keys(want)
        s = self.schema
        taken = "" if fresh else " ON CONFLICT DO NOTHING"

        async def q() -> list[Any]:
            import asyncpg

            c = await self._connection()
            async with c.transaction():
                # The fence is checked inside the transaction that inserts, with the
                # fence table locked against a destroy's insert until it commits.
                await c.execute(f'LOCK TABLE "{s}".key_fence IN SHARE MODE')
                hit = await c.fetchval(f'SELECT count(*) FROM "{s}".key_fence '
                                       "WHERE key_id = ANY($1::text[])", list(new))
                if hit:
                    raise KeyFenced(f"{hit} data key(s) were destroyed by a forget and "
                                    "are never provisioned again")
                # One INSERT of every row (a pool is hundreds of keys).
                try:
                    await c.execute(
                        f'INSERT INTO "{s}".data_keys (key_id, wrapped) '
                        "SELECT * FROM unnest($1::text[], $2::bytea[])" + taken,
                        list(new), [w for _, w in new.values()])
                except asyncpg.UniqueViolationError:
                    raise KeyFenced("a new key id is taken already") from None
                if fresh:
                    return []
                # What is stored now, ours or another process's key of the same id.
                return list(await c.fetch(
                    f'SELECT key_id, wrapped FROM "{s}".data_keys '
                    "WHERE key_id = ANY($1::text[])", list(new)))
        rows = self._run(q())
        got = {k: key for k, (key, _) in new.items()} if fresh else {}
        for r in rows:
            mine = new[r[0]]
            got[r[0]] = mine[0] if bytes(r[1]) == mine[1] else \
                self.wrapper.unwrap(r[0], bytes(r[1]))
        self._cache.update(got)
        return {k: got[k] for k in want if k in got}

    def _release(self, ids: Sequence[str]) -> None:
        async def q() -> None:
            c = await self._connection()
            await c.execute(f'DELETE FROM "{self.schema}".data_keys '
                            "WHERE key_id = ANY($1::text[])", list(ids))
        self._run(q())
        for k in ids:
            self._cache.pop(k, None)

    def _fence(self, ids: Sequence[str]) -> None:
        async def q() -> None:
            c = await self._connection()
            async with c.transaction():
                await c.executemany(f'INSERT INTO "{self.schema}".key_fence (key_id) '
                                    "VALUES ($1) ON CONFLICT DO NOTHING",
                                    [(k,) for k in ids])
                # Announced at commit to every process listening (`_heard`); a payload
                # holds at most 8,000 bytes, so ids go in groups of 200.
                for i in range(0, len(ids), 200):
                    await c.execute("SELECT pg_notify($1, $2)", self._channel(),
                                    ",".join(ids[i:i + 200]))
        self._run(q())
        for k in ids:
            self._cache.pop(k, None)

    def _remove(self, ids: Sequence[str]) -> None:
        async def q() -> None:
            c = await self._connection()
            n = await c.execute(f'DELETE FROM "{self.schema}".data_keys '
                                "WHERE key_id = ANY($1::text[])", list(ids))
            if n != "DELETE 0":
                await c.execute(f'VACUUM "{self.schema}".data_keys')
        self._run(q())
        for k in ids:
            self._cache.pop(k, None)

    def close(self) -> None:
        if self._loop is not None:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._run(self._conn.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
            self._conn = None


def default_key_store_path(db_url: str) -> str | None:
    """`<sqlite path>.vault` for a SQLite file (or `MEMLEDGER_VAULT_PATH`), else None."""
    env = os.environ.get(ENV_PATH)
    if env:
        return env
    if not db_url.startswith("sqlite") or ":///" not in db_url:
        return None
    path = db_url.split(":///", 1)[1].split("?", 1)[0]
    if not path or path.startswith(":memory:") or path.startswith("file:"):
        return None
    return path + ".vault"


def key_store_for(db_url: str, *, path: str | None = None, url: str | None = None,
                  wrapper: KeyWrapper | None = None) -> KeyStore:
    """The key store of a ledger: a file for SQLite, a schema for PostgreSQL."""
    wrapper = wrapper or wrapper_from_env()
    url = url or os.environ.get(ENV_URL)
    if url:
        return PostgresKeyStore(url, wrapper)
    path = path or default_key_store_path(db_url)
    if path is not None:
        return FileKeyStore(path, wrapper)
    if db_url.startswith("sqlite"):
        raise VaultError("an in-memory SQLite ledger has no place for its key store; set "
                         f"{ENV_PATH}")
    return PostgresKeyStore(db_url, wrapper)


def default_on(db_url: str) -> bool:
    """Is the vault on for this ledger when nothing says (no `vault=` argument and
    `MEMLEDGER_VAULT` unset)? On for every new ledger that has a place for its key
    store apart from the database, and for any ledger whose key store exists:

    - a key store database is named (`MEMLEDGER_VAULT_URL`), or the key store file
      (`<sqlite path>.vault`, or `MEMLEDGER_VAULT_PATH`) exists: on;
    - a SQLite file ledger that is new (no file, or no event yet): on;
    - otherwise off: an existing SQLite ledger written in clear (convert it with
      `memledger vault encrypt` after `MEMLEDGER_VAULT=on`), an in-memory ledger (no
      file beside it, nothing at rest), and PostgreSQL without `MEMLEDGER_VAULT_URL`
      (its default key store, a schema of the ledger's own database, would travel in
      every `pg_dump` of it).
    """
    if os.environ.get(ENV_URL):
        return True
    path = default_key_store_path(db_url)
    if path is None:
        return False
    if Path(path).exists():
        return True
    db = _sqlite_file(db_url)
    return db is not None and _no_events_yet(db)


def _sqlite_file(db_url: str) -> str | None:
    if not db_url.startswith("sqlite") or ":///" not in db_url:
        return None
    db = db_url.split(":///", 1)[1].split("?", 1)[0]
    return None if not db or db.startswith((":memory:", "file:")) else db


def _no_events_yet(db: str) -> bool:
    """Does the SQLite file hold no event yet (no file, an empty one, no `events` table
    or an empty one)? Read only; any doubt answers no (the vault stays off)."""
    p = Path(db)
    if not p.exists() or p.stat().st_size == 0:
        return True
    try:
        conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True, timeout=5)
        try:
            if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                            "name = 'events'").fetchone() is None:
                return True
            return conn.execute("SELECT 1 FROM events LIMIT 1").fetchone() is None
        finally:
            conn.close()
    except sqlite3.Error:
        return False


def open_vault(db_url: str, setting: bool | KeyStore | None) -> Vault | None:
    """The vault a ledger uses: an explicit key store, on/off, else `MEMLEDGER_VAULT`,
    else `default_on`. A key store file chosen by default is created at once, so the
    choice holds for every process that opens the ledger later (also once the
    ledger has events)."""
    if isinstance(setting, KeyStore):
        return Vault(setting)
    on = setting if setting is not None else enabled_by_env()
    if on is None:
        on = default_on(db_url)
    if not on:
        return None
    keys = key_store_for(db_url)
    if isinstance(keys, FileKeyStore) and setting is None:
        keys.create()
    return Vault(keys)


def enabled_by_env() -> bool | None:
    """`MEMLEDGER_VAULT` as a setting: True (on), False (off) or None (not set)."""
    v = os.environ.get(ENV_ENABLE, "").strip().lower()
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    return None


# -- the vault: what the recorder calls -----------------------------------------------------

class Vault:
    """Seals event payloads on their way into `events` and opens them on the way out."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys
        # Ciphers (with the sealed-payload head of their id) by key id: building one
        # costs about two encryptions, and a view row is opened on every `get`. Dropped
        # when the key is destroyed; bounded, oldest first, so a long-running process
        # does not keep one per event it ever saw.
        self._cache: dict[str, tuple[AESGCM, bytes]] = {}
        # The key pool: ids of durable keys that have sealed nothing yet, newest last,
        # with their ciphers built when the pool was filled (`reserve`), so a take
        # under the write lock builds nothing.
        self._pool: list[str] = []
        self._pool_keys: dict[str, tuple[AESGCM, bytes]] = {}
        self._pool_next = POOL_FIRST
        self._pool_lock = threading.Lock()
        _PER_PROCESS.add(self)

    def _forked(self) -> None:
        """A forked child drops the parent's pool without releasing it: its keys are
        the parent's to hand out (a key seals one event, so two processes must never
        take the same one) and to release at close (a child's close would remove keys
        the parent is about to seal with). The child provisions a pool of its own."""
        self._pool_lock = threading.Lock()
        self._pool, self._pool_keys = [], {}
        self._pool_next = POOL_FIRST

    def _evict(self) -> None:
        """Drop the older half of the cipher cache."""
        cache = self._cache
        for k in list(itertools.islice(cache, CIPHER_CACHE // 2)):
            del cache[k]

    def _put(self, kid: str, raw: bytes) -> tuple[AESGCM, bytes]:
        if len(self._cache) >= CIPHER_CACHE:
            self._evict()
        entry = self._cache[kid] = _cipher(kid, raw)
        return entry

    def _entry(self, kid: str) -> tuple[AESGCM, bytes] | None:
        entry = self._cache.get(kid)
        if entry is None:
            raw = self.keys.get(kid)
            if raw is not None:
                entry = self._put(kid, raw)
        elif self.keys.revoked(kid):  # another process's forget since it was cached
            self._cache.pop(kid, None)
            return None
        return entry

    def ready(self, n: int) -> bool:
        """Does the pool hold `n` keys already (a `take(n)` would write nothing)?"""
        return len(self._pool) >= n

    def reserve(self, n: int) -> None:
        """Fill the pool until it holds at least `n` keys: the key store's durable write
        (one write and one fsync, or one INSERT) and the ciphers of the new keys. The
        append path calls it before its write transaction (`Store._commit_group`), so
        neither runs under the ledger's write lock; `take` still refills by itself when
        nobody reserved."""
        with self._pool_lock:
            self._fill(n)

    def _fill(self, n: int) -> None:
        """(`_pool_lock` held.) Provision pools until the pool holds `n` keys."""
        pool = self._pool
        while len(pool) < n:
            size = max(self._pool_next, n - len(pool))
            self._pool_next = min(self._pool_next * 2, POOL_MAX)
            got = self.keys.provision_pool(size)
            # Keys enter the pool only once `provision_pool` returned: durable.
            self._pool_keys.update((k, _cipher(k, raw)) for k, raw in got.items())
            pool[:0] = list(got)  # taken from the end: what was left goes first

    def take(self, n: int) -> list[str]:
        """`n` fresh key ids from the pool, each durable in the key store already and
        never handed out again (refilled, one durable write, when it runs short)."""
        with self._pool_lock:
            pool = self._pool
            if len(pool) < n:
                self._fill(n)
            out = pool[len(pool) - n:]
            del pool[len(pool) - n:]
            keys, cache = self._pool_keys, self._cache
            while cache and len(cache) + n > CIPHER_CACHE:
                self._evict()
            for k in out:
                cache[k] = keys.pop(k)
            return out

    def seal_rows(self, rows: Sequence[dict[str, Any]]) -> None:
        """Encrypt, in place, the payload of every content row, each under a fresh key
        of the pool (durable before this returns: no fsync here unless the pool ran
        short). The key id goes into the sealed payload's header, which is durable with
        the event itself."""
        todo = [r for r in rows if r["type"] in SEALED_TYPES and r["payload"] is not None
                and not is_sealed(r["payload"])]
        if not todo:
            return
        ids = self.take(len(todo))
        cache = self._cache
        nonces = os.urandom(NONCE_BYTES * len(todo))  # one call for the batch
        for i, (r, kid) in enumerate(zip(todo, ids, strict=True)):
            aead, head = cache[kid]
            nonce = nonces[i * NONCE_BYTES:(i + 1) * NONCE_BYTES]
            r["payload"] = head + nonce + aead.encrypt(nonce, r["payload"], head)

    def ensure(self, ids: Iterable[str]) -> None:
        """Provision the keys of `ids` that do not exist (one durable write for all);
        a fenced id raises `KeyFenced`."""
        missing = sorted({k for k in ids if k not in self._cache})
        if missing:
            for k, v in self.keys.provision(missing).items():
                self._put(k, v)

    def key(self, kid: str) -> AESGCM | None:
        """The cipher of data key `kid`, or None if the key is destroyed or absent."""
        entry = self._entry(kid)
        return None if entry is None else entry[0]

    def open(self, blob: bytes | None) -> bytes | None:
        """The plaintext of a stored payload: plaintext passes through; a sealed one
        whose key is gone reads as None (erased)."""
        if blob is None or not is_sealed(blob):
            return blob
        entry = self._entry(sealed_key_id(blob))
        return None if entry is None else unseal(entry[0], blob)

    def seal_view(self, kid: str, data: bytes) -> bytes | None:
        """A view copy of subject `kid`'s content, sealed under the subject's key. No
        key: the content came from a payload stored in clear (a ledger not yet
        converted by `memledger vault encrypt`) and stays so; a fenced key: the
        subject is forgotten, and nothing is stored."""
        entry = self._entry(kid)
        if entry is not None:
            aead, head = entry
            nonce = os.urandom(NONCE_BYTES)
            return head + nonce + aead.encrypt(nonce, data, head)
        return None if self.keys.fenced([kid]) else data

    def seal_text(self, kid: str, text: str) -> str | None:
        """`seal_view` for a text column: `TEXT_MAGIC` + base64 of the sealed bytes (or
        the text as it is without a key, or None once the key is fenced)."""
        sealed = self.seal_view(kid, text.encode())
        if sealed is None or not is_sealed(sealed):
            return None if sealed is None else str(text)
        return TEXT_MAGIC + base64.b64encode(sealed).decode("ascii")

    def readable(self, blob: bytes) -> bool:
        """Does the key of a sealed payload exist here?"""
        return self.key(sealed_key_id(blob)) is not None

    def destroy(self, ids: Iterable[str]) -> int:
        """Fence and remove keys (a forget); returns how many were fenced now."""
        ids = list(ids)
        for k in ids:
            self._cache.pop(k, None)
        return self.keys.destroy(ids) if ids else 0

    def fenced(self, ids: Iterable[str]) -> set[str]:
        """Which of `ids` are fenced."""
        return self.keys.fenced(ids)

    def close(self) -> None:
        """Remove the pool's unused keys (they sealed nothing), release the key store.
        After a crash they stay in the store: keys of nothing, harmless."""
        with self._pool_lock:
            unused, self._pool = self._pool, []
            self._pool_keys.clear()
        if unused:
            self.keys.release(unused)
        self._cache.clear()
        self.keys.close()


#: Vaults and key stores alive in this process, told when it forks (`_after_fork`).
_PER_PROCESS: weakref.WeakSet[Vault | KeyStore] = weakref.WeakSet()
#: In a forked child: the parent's event loops and connections, never used or closed
#: here (`PostgresKeyStore._forked`).
_INHERITED: list[tuple[Any, Any]] = []


def _after_fork() -> None:
    """In a forked child: each vault and key store drops its parent's per-process
    state (`Vault._forked`, `KeyStore._forked`)."""
    for obj in list(_PER_PROCESS):
        obj._forked()


os.register_at_fork(after_in_child=_after_fork)


#: The attribute of an engine's dialect that holds its vault (read by `SealedPayload`).
DIALECT_ATTR: Final = "memledger_vault"


def attach(dialect: Dialect, vault: Vault | None) -> None:
    """Let `SealedPayload` columns read through this engine open sealed payloads."""
    setattr(dialect, DIALECT_ATTR, vault)


class Subject(bytes):
    """Plaintext content bytes that know their subject's key id (`kid`), on their way
    into a view column of type `SealedView`, which seals them under that key. (Only on
    the way in: reads return plain `bytes`, which is what orjson parses.)"""

    kid: str

    def __new__(cls, data: bytes, kid: str) -> Subject:
        obj = super().__new__(cls, data)
        obj.kid = kid
        return obj


class SubjectText(str):
    """A `Subject` for text columns (`SealedText`)."""

    kid: str

    def __new__(cls, text: str, kid: str) -> SubjectText:
        obj = super().__new__(cls, text)
        obj.kid = kid
        return obj


def dead_letter(vault: Vault | None, tenant: str | None, data: bytes) -> bytes:
    """A dead letter's payload on its way into `dead_letters.payload` (a `SealedView`):
    with the vault on, the content of a subject of its own, under a fresh pool key (a
    rejected event has no place in the ledger, so no envelope names its key; the key
    id is in the sealed bytes, and erasure destroys it when a forget names what the
    dead letter names, `projections.erasure.shred_dead_letters`)."""
    if vault is None:
        return data
    (kid,) = vault.take(1)
    return Subject(data, kid)


def subject(data: bytes | None, kid: str) -> bytes | None:
    """`data` as the content of subject `kid` (None stays None; no `kid`: as it is)."""
    return data if data is None or not kid else Subject(data, kid)


def subject_text(text: str | None, kid: str) -> str | None:
    """`text` as the content of subject `kid` (None stays None; no `kid`: as it is)."""
    return text if text is None or not kid else SubjectText(text, kid)


#: First characters of a sealed text value (base64 of the sealed bytes follows).
TEXT_MAGIC: Final = "\x01mlv1:"


def _vault_of(dialect: Dialect) -> Vault | None:
    v: Vault | None = getattr(dialect, DIALECT_ATTR, None)
    return v


class SealedView(TypeDecorator[bytes]):
    """A view column holding content (`mem_versions.value`, `task_notes.body`): a
    `Subject` value is sealed under its subject's key on the way in, and opened on the
    way out; once the key is destroyed it reads as None."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> bytes | None:
        kid = getattr(value, "kid", None)
        vault = _vault_of(dialect)
        if kid is None or vault is None:
            return value  # type: ignore[no-any-return]
        return vault.seal_view(kid, bytes(value))

    def process_result_value(self, value: Any, dialect: Dialect) -> bytes | None:
        if value is None or bytes(value[:1]) != MAGIC[:1]:
            return value  # type: ignore[no-any-return]
        vault = _vault_of(dialect)
        blob = bytes(value)
        return None if vault is None else vault.open(blob)


class SealedText(TypeDecorator[str]):
    """`SealedView` for a text column (`mem_versions.text`): sealed bytes are stored as
    `TEXT_MAGIC` + base64."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        kid = getattr(value, "kid", None)
        vault = _vault_of(dialect)
        if kid is None or vault is None:
            return value  # type: ignore[no-any-return]
        return vault.seal_text(kid, value)

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        if value is None or not value.startswith(TEXT_MAGIC):
            return value  # type: ignore[no-any-return]
        vault = _vault_of(dialect)
        blob = base64.b64decode(value[len(TEXT_MAGIC):])
        plain = None if vault is None else vault.open(blob)
        return None if plain is None else plain.decode()


def seal_columns(table: Any, rows: Sequence[dict[str, Any]], dialect: Dialect
                 ) -> Sequence[dict[str, Any]]:
    """`rows` with their sealed view columns sealed as their types would on the way in:
    for a writer that hands the driver plain tuples and so skips the types."""
    vault = _vault_of(dialect)
    cols = _SEALED_COLS.get(table.name)
    if cols is None:
        cols = _SEALED_COLS[table.name] = [
            (c.name, isinstance(c.type, SealedText)) for c in table.columns
            if isinstance(c.type, SealedView | SealedText)]
    if not cols or vault is None:
        return rows
    out = []
    for r in rows:
        r = dict(r)
        for name, text in cols:
            v = r[name]
            kid = getattr(v, "kid", None)
            if kid is not None:
                r[name] = vault.seal_text(kid, v) if text else vault.seal_view(kid, v)
        out.append(r)
    return out


#: The sealed columns of each view table, by table name (`seal_columns`).
_SEALED_COLS: dict[str, list[tuple[str, bool]]] = {}


class SealedPayload(TypeDecorator[bytes]):
    """`events.payload`: binary; a sealed value is opened on its way out of the
    database with the vault attached to the engine (`attach`), so every reader of
    events (projections, bulk loads, verify, audit, replay) gets plaintext. Without a
    vault, or once its key is destroyed, a sealed payload reads as None (erased).
    Writes pass through: the recorder seals rows before it inserts them
    (`Recorder.insert_events`), and a restore imports sealed rows as they are."""

    impl = LargeBinary
    cache_ok = True

    def process_result_value(self, value: Any, dialect: Dialect) -> bytes | None:
        if value is None or bytes(value[:1]) != MAGIC[:1]:
            return value  # type: ignore[no-any-return]
        vault = _vault_of(dialect)
        blob = bytes(value)
        return None if vault is None else vault.open(blob)


class _KeyedBlob:
    """A sealed binary column read as `(plaintext, key id)` when sealed (plaintext None
    once the key is destroyed, or without a vault), as it is when in clear."""

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if value is None or not is_sealed(value):
            return value
        blob = bytes(value)
        vault = _vault_of(dialect)
        return (None if vault is None else vault.open(blob)), sealed_key_id(blob)


class KeyedPayload(_KeyedBlob, SealedPayload):
    """`SealedPayload` that also tells which key sealed a payload (`_KeyedBlob`;
    `split_keyed` takes either form apart). For readers whose view copies are sealed
    under the event's own key (`keyed`)."""

    cache_ok = True


class KeyedView(_KeyedBlob, SealedView):
    """`SealedView` read as `(plaintext, key id)` when sealed (`KeyedPayload`)."""

    cache_ok = True


class KeyedText(SealedText):
    """`SealedText` read as `(text, key id)` when sealed (`KeyedPayload`)."""

    cache_ok = True

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if value is None or not value.startswith(TEXT_MAGIC):
            return value
        blob = base64.b64decode(value[len(TEXT_MAGIC):])
        vault = _vault_of(dialect)
        plain = None if vault is None else vault.open(blob)
        return (None if plain is None else plain.decode()), sealed_key_id(blob)


_KEYED: Final[dict[type, type[TypeDecorator[Any]]]] = {
    SealedPayload: KeyedPayload, SealedView: KeyedView, SealedText: KeyedText}


def keyed(column: Any) -> Any:
    """A sealed column (`events.payload`, `mem_versions.value` / `.text`) selected so
    that it reads with its key id (`split_keyed`), under its own name."""
    return type_coerce(column, _KEYED[type(column.type)]()).label(column.name)


def split_keyed(value: Any) -> tuple[Any, str | None]:
    """(content, key id) of a value read through `keyed`: a sealed one gives the id
    in its header (with content None if it could not be opened), one in clear no id.
    A sealed value read raw (no vault: not opened) gives no content and its id."""
    if type(value) is tuple:
        return value
    if isinstance(value, bytes | bytearray | memoryview) and value[:1] == MAGIC[:1]:
        raw = bytes(value[:HEADER])
        if is_sealed(raw):
            return None, sealed_key_id(raw)
    return value, None


def sealed_columns(stmt: Any) -> tuple[tuple[int, Any], ...]:
    """The selected columns of `stmt` whose type opens sealed content, by index."""
    return tuple((i, c.type) for i, c in enumerate(stmt.selected_columns)
                 if isinstance(c.type, SealedView | SealedText | SealedPayload))


def open_columns(rows: Sequence[Sequence[Any]], sealed: Sequence[tuple[int, Any]],
                 dialect: Dialect) -> list[tuple[Any, ...]]:
    """Driver rows with their sealed columns opened as their types would on the way
    out: for a reader that takes the driver's rows and so skips the types."""
    out = []
    for r in rows:
        row = list(r)
        for i, typ in sealed:
            if row[i] is not None:
                row[i] = typ.process_result_value(row[i], dialect)
        out.append(tuple(row))
    return out
