"""Persisted principal indexes: a process that never loaded a user maps its matrix.

A recall's first look at a principal loads its vectors (`projections.index_cache`):
100k rows of 2 KB read, decoded and transposed. A snapshot is that index written to
a file once (by that recall, or by the projection side after a catch-up that moved
the principal far: `index_cache.write_snapshots`), so the next process (a restart,
another worker, the first recall after `memledger project`) maps it instead
(`np.memmap`, copy on write: patching it in memory never writes the file) and patches
it forward with the cache's own `_refresh`, or reloads it when it is too far behind.

Where: one file per (tenant, principal prefix, model) beside a SQLite file,
`<database>.recall-<tenant hash>-<hash of tenant, prefix, model>.snap` (no name on
disk; with `<database>.recall.lock` and `<database>.recall.generation`), mode 0600,
written atomically (temporary file, fsync, rename, fsync of the directory).
SQLite only: a server database (PostgreSQL) has no file beside it, and a forget
applied on one host could not reach a snapshot on another, so none is kept there.
`MEMLEDGER_RECALL_SNAPSHOTS=0` turns reading and writing them off (the erasure below
still runs, so files an earlier run wrote are still reached by a forget).

What a snapshot must never do (R20, docs/forgetting.md):
- hold a vector a forget covers once that forget is applied: the vectors projection
  calls `erase` in the same step that deletes the covered `vectors` rows; every file
  of the tenant holding a covered item has its vectors zeroed in place, is fsynced and
  is deleted. A writer takes the directory's lock, then refuses to write an index
  older than the tenant's latest tombstone (that forget may already have been
  applied, and this index may hold what it covers): the lock orders the check and
  the write against the erasure.
- outlive a rebuild of the view: `drop_all` (called by `replay.rebuild`) deletes every
  file and bumps the directory's generation, so a load that began before the rebuild
  does not write its old index after it.
- be served across principals or databases: the header names tenant, prefix, model,
  width and the database file (device, inode); any difference and the file is not
  used. The header carries a blake2b digest of itself and a CRC-32 of every section
  but the matrix (`zlib.crc32`, about four times faster than blake2b over the ~12 MB
  of packed columns of 100k rows: a torn write or a flipped bit is what it must
  catch, not an adversary, who could as well rewrite the header); the file's size is
  checked; a damaged file is deleted and rewritten by the next load.
- replace a newer snapshot of the same principal by an older one: a writer (a recall,
  or the projection side after a bulk catch-up, `index_cache.write_snapshots`) reads
  the current file's header under the lock and leaves a file of a later position.

Format (version 3): `MAGIC`, the header's length (u32), the header (JSON), its digest,
then sections at offsets the header gives: `columns` (float32 `(dim, capacity)`, 4 KiB
aligned, mapped), `alive`, then the packed columns, each a blob plus its end offsets
(little-endian i8), so a restart maps them without a Python pass per row: `orders` +
`order_ends`, `ids` + `id_ends`, `keys` + `key_ends`; `by_id` (live rows sorted by id,
searched by bisection), `kr_keys` + `kr_key_ends`, `kr_starts`, `kr_rows` (rows by
normalised key, sorted); then `tasks`, `groups` (each group's `(dim, k)` matrix in
turn) and `meta` (JSON: what is small: groups, task ids); the header's `crc` gives each
section's CRC-32. Version 2 (the same sections under one blake2b digest) and version 1
(ids, keys and rows by key in the JSON `meta`) are still read by `erase` and `holding`,
so a forget and `replay verify --forgotten` reach them; a load deletes them and writes
version 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson
import structlog
from sqlalchemy import bindparam, func, select

from ledger import schema as t
from ledger.backends.sqlite import file_path
from ledger.durable import fsync_dir
from ledger.store import Store
from projections.principal_index import (
    Group,
    KeyRows,
    PackedOrders,
    PackedText,
    PrincipalIndex,
    RowOf,
    pack,
)
from projections.sql import PointQuery, point_rows

log = structlog.get_logger("memledger.recall")

ENV: Final = "MEMLEDGER_RECALL_SNAPSHOTS"
MAGIC: Final = b"MLSNAP\x00\x01"
#: The format written; versions 1 (ids, keys and rows by key as JSON) and 2 (one blake2b
#: digest of the sections) are still read by `erase` and `holding`, never loaded (they
#: are deleted and written again).
VERSION: Final = 3
SUFFIX: Final = ".snap"
_ALIGN: Final = 4096
_LEN: Final = struct.Struct("<I")
_DIGEST: Final = 32
_GENERATION: Final = "generation"
_LOCK: Final = "lock"

_LATEST_TOMBSTONE: Final = PointQuery(select(func.max(t.tombstones.c.position)).where(
    t.tombstones.c.tenant == bindparam("tenant")))


def enabled() -> bool:
    """Read and write snapshots (`MEMLEDGER_RECALL_SNAPSHOTS`, on by default)?"""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def directory(url: str) -> Path | None:
    """The stem `<database>.recall` of the snapshot files beside a SQLite file (each
    is `<stem>-<tenant hash>-<principal hash>.snap`); None for other databases."""
    db = file_path(url)
    return Path(db + ".recall") if db else None


def _tag(*parts: str) -> str:
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=10).hexdigest()


def path_for(d: Path, tenant: str, prefix: str, model: str) -> Path:
    """The file of one principal's index of one model (tenant hash first: `erase` lists
    a tenant's files by it)."""
    return d.with_name(f"{d.name}-{_tag(tenant)}-{_tag(tenant, prefix, model)}{SUFFIX}")


def tenant_files(d: Path, tenant: str) -> list[Path]:
    """Every snapshot file of a tenant beside the database of stem `d`."""
    return sorted(d.parent.glob(f"{d.name}-{_tag(tenant)}-*{SUFFIX}"))


def all_files(d: Path | None) -> list[Path]:
    """Every snapshot file of stem `d` (temporary files of an interrupted write too)."""
    if d is None:
        return []
    return sorted(p for p in d.parent.glob(f"{d.name}-*")
                  if p.name.endswith((SUFFIX, SUFFIX + ".tmp")))


def database_identity(url: str) -> list[int] | None:
    """(device, inode) of the database file: a snapshot never serves another file."""
    db = file_path(url)
    if db is None:
        return None
    try:
        st = os.stat(db)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


def _beside(d: Path, what: str) -> Path:
    return d.with_name(f"{d.name}.{what}")


@contextlib.contextmanager
def _locked(d: Path) -> Iterator[None]:
    fd = os.open(_beside(d, _LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def generation(d: Path | None) -> int:
    """The directory's generation (bumped by `drop_all`); 0 if none."""
    if d is None:
        return 0
    try:
        return int(_beside(d, _GENERATION).read_text())
    except (OSError, ValueError):
        return 0


# -- writing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Image:
    """What a snapshot holds, copied from an index on the event loop's thread (the
    matrix is shared: a concurrent patch only zeroes or appends past `n`; packed
    columns share their blobs, which never change)."""

    tenant: str
    prefix: str
    idx: PrincipalIndex
    n: int
    alive: bytes
    ids: Sequence[str]
    keys: Sequence[str]
    orders: Sequence[bytes]
    key_rows: dict[str, list[int]] | KeyRows
    groups: list[tuple[tuple[str, str], list[str], list[str], np.ndarray]]
    task_ids: list[str]
    task_matrix: np.ndarray


def _first(col: Any, n: int) -> Any:
    """The first `n` items of a column, unaffected by later appends."""
    return col.frozen(n) if hasattr(col, "frozen") else list(col[:n])


def image(tenant: str, prefix: str, idx: PrincipalIndex) -> Image:
    """Copy what the file needs out of `idx` (cheap: packed columns are shared, lists
    copied; rows by key copied as they are)."""
    n = idx.n
    kr = idx.key_rows
    key_rows = kr.frozen(n) if isinstance(kr, KeyRows) else {
        k: [r for r in rows if r < n] for k, rows in kr.items()}
    return Image(tenant, prefix, idx, n, np.ascontiguousarray(idx.alive[:n], np.uint8).tobytes(),
                 _first(idx.ids, n), _first(idx.keys, n), _first(idx.orders, n), key_rows,
                 [(k, list(g.ids), list(g.keys), np.array(g.columns, dtype="<f4"))
                  for k, g in idx.groups.items()],
                 list(idx.task_ids), np.array(idx.task_matrix, dtype="<f4"))


#: The sections after the matrix, in file order (each with its CRC-32; see the module doc).
_SECTIONS: Final = ("alive", "orders", "order_ends", "ids", "id_ends", "keys", "key_ends",
                    "by_id", "kr_keys", "kr_key_ends", "kr_starts", "kr_rows", "tasks",
                    "groups", "meta")


def _i8(a: Any) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def _packed_columns(im: Image) -> dict[str, bytes]:
    """ids, keys and source orders packed (blob + end offsets); live rows sorted by id;
    rows by normalised key as sorted keys with their rows (CSR)."""
    out: dict[str, bytes] = {}
    for name, col, text in (("ids", im.ids, True), ("keys", im.keys, True),
                            ("orders", im.orders, False)):
        blob, ends = pack(col, text)
        out[name], out[name[:-1] + "_ends"] = blob, _i8(ends)
    ids = list(im.ids)
    alive = np.frombuffer(im.alive, dtype=np.uint8)
    live = {ids[r]: r for r in np.flatnonzero(alive).tolist()}  # the last row of an id
    out["by_id"] = _i8([live[m] for m in sorted(live)])
    by_key = sorted((k.encode(), rows) for k, rows in im.key_rows.items() if rows)
    kblob, kends = pack([k for k, _ in by_key], False)
    out["kr_keys"], out["kr_key_ends"] = kblob, _i8(kends)
    out["kr_starts"] = _i8(np.cumsum([0, *(len(r) for _, r in by_key)]))
    out["kr_rows"] = _i8([r for _, rows in by_key for r in rows])
    return out


def _encode(im: Image, db: list[int]) -> tuple[bytes, np.ndarray, list[bytes]]:
    """(everything before the matrix, the matrix, everything after it)."""
    idx = im.idx
    columns = np.ascontiguousarray(idx.columns)
    cap = columns.shape[1]
    meta = orjson.dumps({"groups": [[k[0], k[1], ids, keys] for k, ids, keys, _ in im.groups],
                         "task_ids": im.task_ids})
    parts = {**_packed_columns(im), "alive": im.alive,
             "tasks": im.task_matrix.astype("<f4").tobytes(),
             "groups": b"".join(m.astype("<f4").tobytes() for *_, m in im.groups),
             "meta": meta}
    tail = [parts[name] for name in _SECTIONS]
    header: dict[str, Any] = {
        "v": VERSION, "tenant": im.tenant, "prefix": im.prefix, "model": idx.model,
        "dim": idx.dim, "position": idx.position, "stamp": idx.stamp, "n": im.n,
        "cap": cap, "other_models": idx.other_models, "db": db,
        "groups": [m.shape[1] for *_, m in im.groups], "tasks": len(im.task_ids),
        "crc": {name: zlib.crc32(part) for name, part in zip(_SECTIONS, tail, strict=True)}}
    # The header's size does not depend on the offsets' values beyond a bound: lay the
    # sections out after a generously sized header.
    for _ in range(2):
        head_len = len(MAGIC) + _LEN.size + len(orjson.dumps(header)) + _DIGEST + 64
        off = -(-head_len // _ALIGN) * _ALIGN
        sections = {"columns": [off, columns.nbytes]}
        off += columns.nbytes
        for name, part in zip(_SECTIONS, tail, strict=True):
            sections[name] = [off, len(part)]
            off += len(part)
        header["sections"], header["size"] = sections, off
    raw = orjson.dumps(header)
    head = MAGIC + _LEN.pack(len(raw)) + raw + hashlib.blake2b(raw, digest_size=_DIGEST).digest()
    start = header["sections"]["columns"][0]
    assert len(head) <= start
    return head + b"\x00" * (start - len(head)), columns, tail


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def _replace(path: Path, parts: Iterable[Any]) -> None:
    """`ledger.durable.replace_file` for a file written in parts (no 200 MB join)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for part in parts:
            _write_all(fd, part)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path)


def save(store: Store, im: Image, gen: int) -> Path | None:
    """Write the snapshot of `im` (in a worker thread); None when it must not be
    written: snapshots off, not a SQLite file, the directory's generation moved since
    the index was read (a rebuild), or a forget of the tenant is newer than the index."""
    d = directory(store.url)
    db = database_identity(store.url)
    idx = im.idx
    if d is None or db is None or not enabled() or idx.pending is not None:
        return None
    with _locked(d):
        if generation(d) != gen:
            return None
        latest = point_rows(store, _LATEST_TOMBSTONE, {"tenant": im.tenant})
        if latest is None or (latest and latest[0][0] is not None
                              and int(latest[0][0]) > idx.position):
            return None
        path = path_for(d, im.tenant, im.prefix, idx.model)
        held = held_position(path)
        if held is not None and held > idx.position:
            return None  # another writer's file is newer: keep it
        head, columns, tail = _encode(im, db)
        _replace(path, [head, columns, *tail])
    return path


_WRITES: set[asyncio.Future[Any]] = set()


def save_soon(store: Store, tenant: str, prefix: str, idx: PrincipalIndex, gen: int) -> None:
    """Write a snapshot of `idx` in a worker thread (the recall does not wait)."""
    im = image(tenant, prefix, idx)
    track(asyncio.get_running_loop().run_in_executor(None, save, store, im, gen))


def track(fut: asyncio.Future[Any]) -> None:
    """Count a snapshot write running in the background (`settled` waits for it; a
    failure is logged, never raised: a recall then loads from the database)."""
    _WRITES.add(fut)

    def done(f: Any) -> None:
        _WRITES.discard(f)
        if not f.cancelled() and f.exception() is not None:
            log.warning("recall_snapshot_not_written", error=repr(f.exception()))

    fut.add_done_callback(done)


async def settled() -> None:
    """Wait for every snapshot write this process started (tests, benchmarks, close)."""
    while _WRITES:
        await asyncio.gather(*list(_WRITES), return_exceptions=True)


# -- reading ------------------------------------------------------------------------------

class Damaged(Exception):
    """A snapshot file that is not whole (truncated, altered, another format)."""


def _header(f: Any, size: int) -> dict[str, Any]:
    start = f.read(len(MAGIC) + _LEN.size)
    if len(start) < len(MAGIC) + _LEN.size or start[:len(MAGIC)] != MAGIC:
        raise Damaged("magic")
    (n,) = _LEN.unpack(start[len(MAGIC):])
    if n > size:
        raise Damaged("header length")
    raw = f.read(n)
    digest = f.read(_DIGEST)
    if hashlib.blake2b(raw, digest_size=_DIGEST).digest() != digest:
        raise Damaged("header digest")
    header: dict[str, Any] = orjson.loads(raw)
    if header.get("v") not in (1, 2, VERSION) or header.get("size") != size:
        raise Damaged("version or size")
    return header


#: The sections after the matrix in a version 1 file.
_SECTIONS_V1: Final = ("alive", "orders", "order_ends", "tasks", "groups", "meta")


def _sections(f: Any, header: dict[str, Any]) -> dict[str, bytes]:
    """The sections after the matrix of a current-format file, each checked against
    its CRC-32 (a version 1 or 2 file is an earlier format: `Damaged`)."""
    if header["v"] != VERSION:
        raise Damaged("an earlier format")  # written again by the next load
    out: dict[str, bytes] = {}
    crc = header["crc"]
    for name in _SECTIONS:
        off, n = header["sections"][name]
        f.seek(off)
        out[name] = f.read(n)
        if len(out[name]) != n:
            raise Damaged(name)
        if zlib.crc32(out[name]) != crc[name]:
            raise Damaged(f"{name} checksum")
    return out


def held_header(path: Path) -> dict[str, Any] | None:
    """The header of the snapshot at `path` (nothing else is read); None when there
    is none or it cannot be read."""
    try:
        with path.open("rb") as f:
            return _header(f, os.fstat(f.fileno()).st_size)
    except (Damaged, OSError, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
        return None


def held_position(path: Path) -> int | None:
    """The `vectors` position of the snapshot at `path`; None when none is readable."""
    h = held_header(path)
    try:
        return None if h is None else int(h["position"])
    except (KeyError, TypeError, ValueError):
        return None


def _forget_file(path: Path, why: str) -> None:
    log.warning("recall_snapshot_ignored", file=path.name, reason=why)
    with contextlib.suppress(OSError):
        path.unlink()


def load(store: Store, tenant: str, prefix: str, model: str, dim: int
         ) -> PrincipalIndex | None:
    """The principal's index from its snapshot (matrix mapped copy-on-write), or None:
    none, off, of another principal, model or database, or damaged (then deleted)."""
    d = directory(store.url)
    if d is None or not enabled():
        return None
    path = path_for(d, tenant, prefix, model)
    try:
        f = path.open("rb")
    except OSError:
        return None
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            h = _header(f, size)
            if (h["tenant"], h["prefix"], h["model"], h["dim"]) != (tenant, prefix, model, dim) \
                    or h["db"] != database_identity(store.url):
                return None  # another principal's file under a colliding name, or stale
            s = _sections(f, h)
        n, cap = int(h["n"]), int(h["cap"])
        off, nbytes = h["sections"]["columns"]
        if nbytes != dim * cap * 4 or n > cap:
            raise Damaged("matrix shape")
        columns = np.memmap(path, dtype="<f4", mode="c", offset=off, shape=(dim, cap)
                            ).view(np.ndarray) if cap else np.zeros((dim, 0), np.float32)
        alive = np.zeros(cap, dtype=bool)
        alive[:n] = np.frombuffer(s["alive"], dtype=np.uint8).astype(bool)
        # Packed as they lie in the file: no Python object per row (`PackedText`).
        cols = {}
        for name in ("ids", "keys", "orders", "kr_keys"):
            ends = np.frombuffer(s[name[:-1] + "_ends"], dtype="<i8")
            if len(ends) and ends[-1] != len(s[name]):
                raise Damaged(name)
            cols[name] = (s[name], ends)
        ids, keys = PackedText(*cols["ids"]), PackedText(*cols["keys"])
        orders = PackedOrders(*cols["orders"])
        by_id = np.frombuffer(s["by_id"], dtype="<i8")
        starts = np.frombuffer(s["kr_starts"], dtype="<i8")
        kr_rows = np.frombuffer(s["kr_rows"], dtype="<i8")
        if not len(ids) == len(keys) == len(orders) == n \
                or len(by_id) != int(np.count_nonzero(alive[:n])) \
                or len(starts) != len(cols["kr_keys"][1]) + 1 or starts[-1] != len(kr_rows):
            raise Damaged("row count")
        row_of = RowOf(ids, by_id)
        key_rows = KeyRows(PackedOrders(*cols["kr_keys"]), starts, kr_rows)
        meta = orjson.loads(s["meta"])
        groups: dict[tuple[str, str], Group] = {}
        gm = np.frombuffer(s["groups"], dtype="<f4")
        at = 0
        for (layer, gkey, gids, gkeys), k in zip(meta["groups"], h["groups"], strict=True):
            groups[(layer, gkey)] = Group(gids, gkeys, gm[at:at + dim * k].reshape(dim, k)
                                          .astype(np.float32))
            at += dim * k
        task_ids: list[str] = meta["task_ids"]
        tasks = np.frombuffer(s["tasks"], dtype="<f4").reshape(len(task_ids), dim
                                                               ).astype(np.float32)
    except (Damaged, ValueError, KeyError, TypeError, OSError, orjson.JSONDecodeError) as e:
        _forget_file(path, repr(e))
        return None
    return PrincipalIndex(
        position=int(h["position"]), pending=None, model=model, dim=dim, columns=columns,
        n=n, alive=alive, ids=ids, keys=keys, orders=orders, row_of=row_of,
        key_rows=key_rows, groups=groups, task_ids=task_ids, task_matrix=tasks,
        stamp=float(h["stamp"]), other_models=int(h["other_models"]))


# -- erasure ------------------------------------------------------------------------------

def held_items(path: Path) -> tuple[dict[str, Any], list[str], set[str], set[str]]:
    """(header, long-term ids in row order, every memory id, task keys) a snapshot
    file holds (either format); raises `Damaged` (or a decoding error) when it cannot
    be read."""
    with path.open("rb") as f:
        h = _header(f, os.fstat(f.fileno()).st_size)

        def section(name: str) -> bytes:
            off, n = h["sections"][name]
            f.seek(off)
            got: bytes = f.read(n)
            if len(got) != n:
                raise Damaged(name)
            return got

        meta = orjson.loads(section("meta"))
        if h["v"] >= 2:  # the packed columns of versions 2 and 3
            ids = list(PackedText(section("ids"), np.frombuffer(section("id_ends"), "<i8")))
        else:
            ids = meta["ids"]
    mems = set(ids)
    for g in meta["groups"]:
        mems.update(g[2])
    return h, ids, mems, set(meta["task_ids"])


def _scrub(path: Path, h: dict[str, Any], rows: Sequence[int]) -> None:
    """Zero, in the file itself, the covered rows' vectors and every section after the
    matrix, and fsync: the blocks the file frees hold no covered vector."""
    dim, cap = int(h["dim"]), int(h["cap"])
    with path.open("r+b") as f:
        if rows and cap:
            off = h["sections"]["columns"][0]
            m = np.memmap(f, dtype="<f4", mode="r+", offset=off, shape=(dim, cap))
            m[:, np.fromiter(rows, dtype=np.int64)] = 0.0
            m.flush()
            del m
        for name, (off, n) in h["sections"].items():
            if name != "columns":
                f.seek(off)
                f.write(b"\x00" * n)
        f.flush()
        os.fsync(f.fileno())


def erase(url: str, tenant: str, memory_ids: Iterable[str] = (),
          task_keys: Iterable[str] = (), ns_prefix: str | None = None) -> int:
    """Delete every snapshot of `tenant` that holds one of these memories or tasks, or
    whose principal a namespace forget of `ns_prefix` reaches (after zeroing the
    covered vectors in place). Runs whatever `MEMLEDGER_RECALL_SNAPSHOTS` says, so
    files written earlier are reached. Returns how many files were deleted."""
    d = directory(url)
    if d is None:
        return 0
    files = tenant_files(d, tenant)
    if not files:
        return 0
    mems, tasks = set(memory_ids), set(task_keys)
    gone = 0
    with _locked(d):
        for path in files:
            try:
                h, ids, held_m, held_t = held_items(path)
                if h["tenant"] != tenant:
                    continue  # another tenant's file under a colliding name
                whole = ns_prefix is not None and h["prefix"].startswith(ns_prefix)
                ids_hit = held_m & mems
                if not (whole or ids_hit or held_t & tasks or (
                        ns_prefix is not None and ns_prefix.startswith(h["prefix"]))):
                    continue
                _scrub(path, h, range(int(h["n"])) if whole else
                       [i for i, m in enumerate(ids) if m in ids_hit])
            except (Damaged, OSError, ValueError, KeyError, TypeError,
                    orjson.JSONDecodeError):
                pass  # not readable: deleted all the same
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                gone += 1
        for tmp in d.parent.glob(f"{d.name}-*{SUFFIX}.tmp"):  # an interrupted write's
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if gone:
            fsync_dir(d)
    return gone


def drop_all(url: str) -> int:
    """Delete every snapshot and bump the generation (a rebuild of the `vectors` view:
    what the files hold no longer describes it). Returns how many were deleted."""
    d = directory(url)
    if d is None or not d.parent.is_dir():
        return 0
    gone = 0
    with _locked(d):
        _beside(d, _GENERATION).write_text(str(generation(d) + 1))
        for path in all_files(d):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                gone += 1
        fsync_dir(d)
    return gone


def holding(url: str, tenant: str, memory_ids: set[str], task_keys: set[str]
            ) -> list[str]:
    """Names of the tenant's snapshot files that hold one of these items, and of any
    file that cannot be read (`replay verify --forgotten`)."""
    d = directory(url)
    if d is None:
        return []
    out: list[str] = []
    for path in tenant_files(d, tenant):
        try:
            _, _, held_m, held_t = held_items(path)
        except (Damaged, OSError, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
            out.append(path.name)
            continue
        if held_m & memory_ids or held_t & task_keys:
            out.append(path.name)
    return out
