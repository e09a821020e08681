"""`memledger backup` and `memledger restore`: one portable, checksummed file.

Format (JSON Lines, gzip-compressed when the path ends in `.gz`):

1. a header object: `{"format": "memledger-backup", "version": 1, "schema_version",
   "source_backend", "position", "created_at", "tables": [{"name", "columns",
   "binary", "count"}]}`;
2. for each table in header order, a `{"table": name}` line, then one JSON array per
   row, values in `columns` order, binary columns base64-encoded;
3. a trailer `{"end": true, "rows": n, "sha256": hex}`, the SHA-256 of every byte
   (uncompressed) before the trailer line.

Only the ledger's own tables are saved (events, tombstones, task owners, dead letters,
recall audit records); views are rebuilt from them on restore. The backup reads every
table in one snapshot (REPEATABLE READ on PostgreSQL, one read transaction on SQLite),
so it is consistent at one position while appends go on. A payload that a tombstone
in the snapshot covers is written as erased, even if the erasure projection had not run
yet: a backup never holds content a forget it contains covers.

A restore reads the whole file twice: once to check it (checksum, structure, counts,
positions, hash chain and digests) before the database is touched, then to load it in
one transaction that re-checks the checksum before it commits. Then it reapplies the
forget register (R21) and rebuilds every view.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import gzip
import hashlib
import os
import stat
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO, Final, cast

import orjson
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.chain import ChainCheck
from ledger.errors import BackupError, BackupTargetExists, BackupTargetRefused
from ledger.events import digest
from ledger.forgets import tombstone_from_row
from ledger.records import now_iso
from ledger.register import DAMAGED_POLICIES
from ledger.store import Store
from ledger.vault import SEALED_TYPES, is_sealed, sealed_key_id, subject_of
from projections.registry import default_projections
from replay.errors import DatabaseNotEmpty, KeyStoreMissing, RegisterDamaged, RegisterMissing
from replay.progress import Progress, ProgressCallback
from replay.rebuild import FORGET_TYPES, rebuild, register_events
from replay.rows import binary_columns, by_tenant, covering, row_dict, stream_rows

FORMAT: Final = "memledger-backup"
VERSION: Final = 1
#: The ledger tables a backup holds, in the order it holds them.
BACKUP_TABLES: Final = (t.events, t.tombstones, t.task_owners, t.dead_letters,
                        t.recall_audit, t.recall_audit_items)
_BY_NAME: Final = {tb.name: tb for tb in BACKUP_TABLES}
GZIP_MAGIC: Final = b"\x1f\x8b"
LOAD_BATCH: Final = 1000


def _encode(row: dict[str, Any], columns: list[str], binary: set[str]) -> bytes:
    vals = [base64.b64encode(row[c]).decode("ascii") if c in binary and row[c] is not None
            else row[c] for c in columns]
    return orjson.dumps(vals)


class _HashingWriter:
    """Writes lines to a file (gzip or plain) and hashes the uncompressed bytes.

    A write that fails (the disk is full, ENOSPC) raises `BackupError` naming the
    backup target, here, before the error could pass through the database's read
    transaction and be taken for a database problem."""

    def __init__(self, raw: BinaryIO, target: Path, *, compress: bool) -> None:
        self.raw = raw
        self.target = target
        self.out: IO[bytes] = cast(BinaryIO, gzip.GzipFile(
            fileobj=self.raw, mode="wb", compresslevel=6)) \
            if compress else self.raw
        self.sha = hashlib.sha256()
        self.bytes = 0

    def line(self, data: bytes, *, hashed: bool = True) -> None:
        data += b"\n"
        if hashed:
            self.sha.update(data)
        self.bytes += len(data)
        try:
            self.out.write(data)
        except OSError as e:
            raise _write_error(self.target, e) from e

    def close(self) -> None:
        try:
            if self.out is not self.raw:
                self.out.close()
            self.raw.flush()
            os.fsync(self.raw.fileno())
            self.raw.close()
        except OSError as e:
            raise _write_error(self.target, e) from e


def _write_error(target: Path, e: OSError) -> BackupError:
    if e.errno == errno.ENOSPC:
        return BackupError(f"cannot write backup {target}: no space left on the device "
                           "that holds it; nothing was written there (free space or "
                           "choose another path)")
    return BackupError(f"cannot write backup {target}: {e.strerror or e}; nothing was "
                       "written there")


def check_target(target: Path, *, force: bool = False) -> None:
    """Refuse a backup path that is not a new path in an existing directory, or (with
    `force`) an existing regular file: never a device, a directory, a symbolic link
    or another special file, and never an existing file unless told to replace it."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise BackupTargetRefused(f"backup target {target} cannot be checked: "
                                  f"{e.strerror or e}") from e
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise BackupTargetRefused(
                f"backup target {target} is {_kind(st.st_mode)}, not a regular file",
                "; choose a path for a new file")
        if not force:
            raise BackupTargetExists(str(target))
    parent = target.parent
    if not parent.is_dir():
        raise BackupTargetRefused(f"backup target {target}: directory {parent} does not "
                                  "exist", "; create it first")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def _temp_file(target: Path) -> tuple[Path, BinaryIO]:
    """A new file beside `target`, mode 0600 (`mkstemp`), for writing the backup into."""
    try:
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                    suffix=".partial")
    except OSError as e:
        raise _write_error(target, e) from e
    return Path(name), os.fdopen(fd, "wb")


async def backup(store: Store, path: str | os.PathLike[str], *, force: bool = False,
                 progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Write a consistent backup of the ledger tables to `path`.

    `path` must be new, or with `force` an existing regular file (`check_target`). The
    backup is written to a temporary file (mode 0600) in the same directory and renamed
    into place once complete and synced, so `path` is never seen half written."""
    target = Path(path)
    check_target(target, force=force)
    await store.open()
    partial, raw = _temp_file(target)
    writer = _HashingWriter(raw, target, compress=target.name.endswith(".gz"))
    erased = sealed = 0
    try:
        async with store.read() as conn:
            await store.recorder.keep_transaction_open(conn)
            counts = {str(tb.name): int((await conn.execute(
                select(func.count()).select_from(tb))).scalar() or 0) for tb in BACKUP_TABLES}
            position = int((await conn.execute(
                select(func.max(t.events.c.position)))).scalar() or 0)
            tombs = by_tenant(tombstone_from_row(r)
                              for r in (await conn.execute(select(t.tombstones))).all())
            header = {
                "format": FORMAT, "version": VERSION, "schema_version": t.SCHEMA_VERSION,
                "source_backend": store.dialect, "position": position,
                "created_at": now_iso(),
                "tables": [{"name": tb.name, "columns": [c.name for c in tb.columns],
                            "binary": binary_columns(tb), "count": counts[str(tb.name)]}
                           for tb in BACKUP_TABLES],
            }
            writer.line(orjson.dumps(header))
            bar = Progress("backup", sum(counts.values()), unit="rows", report=progress)
            for tb in BACKUP_TABLES:
                columns = [c.name for c in tb.columns]
                binary = set(binary_columns(tb))
                writer.line(orjson.dumps({"table": tb.name}))
                # Raw: a sealed payload is written sealed, never opened (ledger.vault).
                async for part in stream_rows(conn, tb, store.recorder, batch=2000,
                                              raw=True):
                    for r in part:
                        row = row_dict(r)
                        if tb is t.events and row["payload"] is not None and \
                                covering(tombs, row) is not None:
                            row["payload"], row["redacted"] = None, True
                            erased += 1
                        elif tb is t.events and is_sealed(row["payload"]):
                            sealed += 1
                        writer.line(_encode(row, columns, binary))
                    bar.advance(len(part))
            bar.finish()
        total = sum(counts.values())
        sha = writer.sha.hexdigest()
        writer.line(orjson.dumps({"end": True, "rows": total, "sha256": sha}), hashed=False)
        writer.close()
        size = _publish(partial, target, force=force)
    except BaseException:
        with contextlib.suppress(OSError):
            writer.raw.close()
        partial.unlink(missing_ok=True)
        raise
    return {"path": str(target), "position": position, "counts": counts,
            "bytes": size, "sha256": sha, "format": FORMAT,
            "version": VERSION, "erased_in_backup": erased, "sealed_payloads": sealed}


def _publish(partial: Path, target: Path, *, force: bool) -> int:
    """Move the finished file into place durably; returns its size in bytes.

    Without `force` the file is linked in (`link` fails if anything appeared at the path
    meanwhile, so nothing is replaced); with `force` the path is checked again and
    replaced in one rename."""
    try:
        if force:
            check_target(target, force=True)
            os.replace(partial, target)
        else:
            try:
                os.link(partial, target)
            except FileExistsError as e:
                raise BackupTargetExists(str(target)) from e
            except OSError as e:  # a file system without hard links: check, then rename
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                check_target(target)
                os.replace(partial, target)
            partial.unlink(missing_ok=True)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return target.stat().st_size
    except OSError as e:
        raise _write_error(target, e) from e


# -- reading ------------------------------------------------------------------------------

def _open_backup(path: Path) -> IO[bytes]:
    try:
        raw = path.open("rb")
    except OSError as e:
        raise BackupError(f"cannot read backup {path}: {e.strerror or e}") from e
    magic = raw.read(2)
    raw.seek(0)
    if magic == GZIP_MAGIC:
        return cast(BinaryIO, gzip.GzipFile(fileobj=raw, mode="rb"))
    return raw


class BackupReader:
    """Reads and checks a backup file; `rows()` yields decoded row batches per table.

    Every problem raises `BackupError` naming the line: a truncated file, a flipped
    byte (checksum, JSON, base64, chain or digest), a missing or extra row.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.header: dict[str, Any] = {}

    def _fail(self, line: int, msg: str) -> BackupError:
        return BackupError(f"backup {self.path} is unusable (line {line}): {msg}; "
                           "nothing was changed")

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        f = _open_backup(self.path)
        try:
            yield from enumerate(f, start=1)
        except (OSError, EOFError, zlib.error) as e:
            raise self._fail(0, f"compressed data is damaged or cut short ({e})") from e
        finally:
            f.close()

    def _check_header(self, obj: Any) -> dict[str, Any]:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise self._fail(1, "not a memledger backup (no header)")
        if obj.get("version") != VERSION:
            raise self._fail(1, f"format version {obj.get('version')!r} is not supported "
                                f"(this memledger reads version {VERSION})")
        if not isinstance(obj.get("schema_version"), int) or \
                obj["schema_version"] > t.SCHEMA_VERSION:
            raise self._fail(1, "written by a newer memledger schema; upgrade memledger")
        tables = obj.get("tables")
        if not isinstance(tables, list) or [x.get("name") for x in tables if
                                            isinstance(x, dict)] != list(_BY_NAME):
            raise self._fail(1, "header does not list the ledger tables")
        for spec in tables:
            known = {c.name for c in _BY_NAME[spec["name"]].columns}
            cols = spec.get("columns")
            if not isinstance(cols, list) or not set(cols) <= known:
                raise self._fail(1, f"table {spec['name']} has columns this memledger does "
                                    "not know; upgrade memledger")
            if not isinstance(spec.get("count"), int) or spec["count"] < 0:
                raise self._fail(1, f"table {spec['name']} has no row count")
        return obj

    def rows(self) -> Iterator[tuple[Any, list[dict[str, Any]]]]:
        """Check the whole file while yielding (table, batch of row dicts)."""
        sha = hashlib.sha256()
        tables: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None
        table: Any = None
        names: list[str] = []
        binary: set[str] = set()
        seen = 0
        total = 0
        next_table = 0
        batch: list[dict[str, Any]] = []
        chain, expected = ChainCheck(), 1
        trailer: dict[str, Any] | None = None
        last_line = 0
        for n, raw in self._lines():
            last_line = n
            if trailer is not None:
                raise self._fail(n, "data after the trailer")
            if not raw.endswith(b"\n"):
                raise self._fail(n, "file is cut short (last line incomplete)")
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise self._fail(n, "damaged line (not JSON)") from e
            if n == 1:
                self.header = self._check_header(obj)
                tables = self.header["tables"]
                sha.update(raw)
                continue
            if isinstance(obj, dict) and obj.get("end") is True:
                trailer = obj
                continue
            sha.update(raw)
            if isinstance(obj, dict) and "table" in obj:
                if current is not None and seen != current["count"]:
                    raise self._fail(n, f"table {current['name']} has {seen} rows, header "
                                        f"says {current['count']}")
                if batch:
                    yield table, batch
                    batch = []
                if next_table >= len(tables) or obj["table"] != tables[next_table]["name"]:
                    raise self._fail(n, f"unexpected table section {obj['table']!r}")
                current = tables[next_table]
                next_table += 1
                table = _BY_NAME[current["name"]]
                names = current["columns"]
                binary = set(current["binary"])
                seen = 0
                continue
            if current is None or not isinstance(obj, list) or len(obj) != len(names):
                raise self._fail(n, "row outside a table section or with the wrong width")
            row: dict[str, Any] = {c.name: None for c in table.columns}
            try:
                for name, value in zip(names, obj, strict=True):
                    row[name] = base64.b64decode(value, validate=True) \
                        if name in binary and value is not None else value
            except (binascii.Error, TypeError, ValueError) as e:
                raise self._fail(n, "damaged binary value") from e
            if table is t.events:
                expected = self._check_event(n, row, chain, expected)
            seen += 1
            total += 1
            batch.append(row)
            if len(batch) >= LOAD_BATCH:
                yield table, batch
                batch = []
        if trailer is None:
            raise self._fail(last_line, "file is truncated (no trailer)")
        if current is not None and seen != current["count"]:
            raise self._fail(last_line, f"table {current['name']} has {seen} rows, header "
                                        f"says {current['count']}")
        if next_table != len(tables):
            raise self._fail(last_line, "file is truncated (tables missing)")
        if trailer.get("sha256") != sha.hexdigest() or trailer.get("rows") != total:
            raise self._fail(last_line, "checksum mismatch: the file was changed or damaged")
        if expected - 1 != self.header.get("position"):
            raise self._fail(last_line, "events do not reach the header's position")
        if batch:
            yield table, batch

    def _check_event(self, n: int, row: dict[str, Any], chain: ChainCheck, expected: int
                     ) -> int:
        if row["position"] != expected:
            raise self._fail(n, f"event position {row['position']} where {expected} was "
                                "expected")
        try:
            holds = chain.holds(row)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise self._fail(n, "damaged event envelope") from e
        if not holds:
            raise self._fail(n, f"hash chain broken at position {expected}")
        # A sealed payload's digest is of its plaintext: its AES-GCM tag guards it here,
        # and `replay verify` checks the digest once the restore can open it.
        if row["payload"] is not None and not is_sealed(row["payload"]) and \
                digest(row["payload"]) != row["content_digest"]:
            raise self._fail(n, f"payload of position {expected} does not match its digest")
        return expected + 1

    def check(self) -> dict[str, Any]:
        """Read the whole file and check it; returns the header."""
        for _ in self.rows():
            pass
        return self.header


# -- restore ------------------------------------------------------------------------------

async def _is_empty(conn: AsyncConnection) -> bool:
    for tb in (*BACKUP_TABLES, *t.VIEW_TABLES):
        if (await conn.execute(select(tb).limit(1))).first() is not None:
            return False
    return True


async def _clear(store: Store, conn: AsyncConnection) -> None:
    for tb in (*t.VIEW_TABLES, *reversed(BACKUP_TABLES), t.checkpoints, t.shard_checkpoints):
        await store.recorder.delete_rows(conn, tb)
    # The embedding cache goes with the views it fed: it may hold vectors of content
    # the restored ledger's forgets cover.
    for tb in (t.embedding_refs, t.embedding_cache):
        await store.recorder.delete_rows(conn, tb)
    # Bookkeeping of the views just cleared (e.g. `vectors.pending_after`, rebuild
    # markers); the schema version, this database's shard count and its recorded
    # embedder (`config.embedder`) stay.
    await store.recorder.delete_rows(conn, t.meta, t.meta.c.name.not_in(
        ["schema_version", "shards", "config.embedder"]))


def _backup_forgets(reader: BackupReader
                    ) -> tuple[str | None, set[tuple[str, str]], set[str]]:
    """Check the whole file; return its ledger id, the forgets the register must hold
    and the key ids its sealed payloads name."""
    ledger: str | None = None
    forgets: set[tuple[str, str]] = set()
    sealed: set[str] = set()
    for table, batch in reader.rows():
        if table is t.events:
            for r in batch:
                if r["position"] == 1:
                    ledger = r["chain"]
                if r["type"] in FORGET_TYPES and not r["suppressed"]:
                    forgets.add((r["tenant"], r["idempotency_key"]))
                if is_sealed(r["payload"]):
                    sealed.add(sealed_key_id(r["payload"]))
    return ledger, forgets, sealed


class _Keys:
    """What the restore does with content payloads and the vault: a sealed payload
    whose key was destroyed restores redacted; one whose key is absent stays sealed
    (unreadable); with the vault on, a plaintext one is sealed as it is loaded, or
    restored redacted if its key was destroyed (a forget after the backup)."""

    def __init__(self, store: Store, sealed: set[str], *, envelopes_only: bool) -> None:
        self.vault = store.vault
        self.counts = {"sealed": len(sealed), "redacted_key_destroyed": 0,
                       "unreadable_no_key": 0, "sealed_now": 0}
        self.envelopes_only = False
        present = self.vault is not None and self.vault.keys.exists()
        if present and sealed and self.vault is not None:
            # A key store that knows none of the backup's keys (neither holds nor
            # fenced one) is not the backup's: a new, empty one made by default.
            ks = self.vault.keys
            present = bool(ks.load(sealed)) or bool(ks.fenced(sealed))
        if sealed and not present:
            if not envelopes_only:
                raise KeyStoreMissing(
                    self.vault.keys.where() if self.vault is not None else
                    "vault off for this ledger: set MEMLEDGER_VAULT=on", len(sealed))
            self.envelopes_only = True
        self.fenced: set[str] = set()
        if self.vault is not None and present:
            self.fenced = self.vault.fenced(sealed)

    def batch(self, rows: list[dict[str, Any]]) -> None:
        """Adjust one batch of event rows before it is imported."""
        v = self.vault
        plain: list[dict[str, Any]] = []
        for r in rows:
            p = r["payload"]
            if p is None:
                continue
            if is_sealed(p):
                kid = sealed_key_id(p)
                if kid in self.fenced:
                    r["payload"], r["redacted"] = None, True
                    self.counts["redacted_key_destroyed"] += 1
                elif self.envelopes_only or v is None or not v.readable(p):
                    self.counts["unreadable_no_key"] += 1
            elif v is not None and r["type"] in SEALED_TYPES:
                plain.append(r)
        if plain and v is not None:
            kids = [subject_of(r["tenant"], r["type"], r["memory_id"], r["idempotency_key"])
                    for r in plain]
            gone = v.fenced(kids)
            for r, k in zip(plain, kids, strict=True):
                if k in gone:
                    r["payload"], r["redacted"] = None, True
                    self.counts["redacted_key_destroyed"] += 1
            todo = [r for r in plain if r["payload"] is not None]
            v.seal_rows(todo)
            self.counts["sealed_now"] += len(todo)

    def report(self) -> dict[str, Any]:
        """The `vault` member of the restore's result."""
        return {"on": self.vault is not None, "envelopes_only": self.envelopes_only,
                **self.counts}


async def restore(store: Store, path: str | os.PathLike[str], *, force: bool = False,
                  without_register: bool = False, progress: ProgressCallback | None = None,
                  register_damaged: str = "refuse", envelopes_only: bool = False
                  ) -> dict[str, Any]:
    """Check a backup, load it, reapply the forget register and rebuild the views.

    A register that is damaged, torn, empty, of another ledger or lacking a forget the
    backup holds is refused (`register_damaged="refuse"`, nothing changes), unless
    `register_damaged="repair"`: its intact entries are kept (the old file set aside as
    `<name>.damaged`) and the restore goes on (docs/forgetting.md).

    Encrypted content (`ledger.vault`) needs the key store: without it the restore is
    refused (`KeyStoreMissing`, nothing changes) unless `envelopes_only`, which loads
    everything with the content left sealed and unreadable. Content whose key a forget
    destroyed restores redacted; the result's `vault` counts each case.
    """
    if register_damaged not in DAMAGED_POLICIES:
        raise BackupError(f"register_damaged must be one of {', '.join(DAMAGED_POLICIES)}")
    reader = BackupReader(path)
    ledger, forgets, sealed = _backup_forgets(reader)
    header = reader.header
    await store.open()
    if not store.register.exists() and not without_register:
        raise RegisterMissing(store.register.path)
    repaired = None
    problems: list[str] = []
    if store.register.exists():
        problems = store.register.scan().problems(ledger=ledger, expected=forgets)
        if problems and register_damaged == "refuse":
            raise RegisterDamaged(problems[0])
    # No key store for sealed content: refused here, before anything is changed.
    keys = _Keys(store, sealed, envelopes_only=envelopes_only)
    if store.register.exists():
        if problems:
            repaired = store.register.repair(ledger)
        if ledger is None:
            store.register.unclaim()  # a backup of an empty ledger: no first event yet
    register_events(store)  # a damaged register stops the restore before any change
    total = sum(x["count"] for x in header["tables"])
    bar = Progress("restore", total, unit="rows", report=progress)
    async with store.write() as conn:
        await store.recorder.keep_transaction_open(conn)
        if not await _is_empty(conn) and not force:
            raise DatabaseNotEmpty(_safe_url(store.url))
        await _clear(store, conn)
        # The reader re-checks the checksum at the end: a file changed since the
        # check raises here, inside the transaction, which then rolls back.
        for table, batch in reader.rows():
            if table is t.events:
                keys.batch(batch)
            await store.recorder.import_rows(conn, table, batch)
            bar.advance(len(batch))
        # Projections count as caught up until the register is reapplied: a worker
        # running meanwhile must not project restored content that a forget recorded
        # after the backup covers. `rebuild` below resets them to 0 after the reapply.
        await conn.execute(t.checkpoints.insert(), [
            {"name": p.name, "position": header["position"]}
            for p in default_projections()])
        await store.recorder.after_import(conn)
    bar.finish()
    rebuilt = await rebuild(store, restart=True, progress=progress)
    return {"restored": {"path": str(path), "position": header["position"],
                         "source_backend": header["source_backend"],
                         "created_at": header["created_at"],
                         "counts": {x["name"]: x["count"] for x in header["tables"]}},
            "reapplied": rebuilt["reapplied"], "head": rebuilt["head"],
            "projections": rebuilt["projections"], "vault": keys.report(),
            **({"register_repaired": repaired} if repaired is not None else {})}


def _safe_url(url: str) -> str:
    """A database URL without its password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}@{host}"
    return url
