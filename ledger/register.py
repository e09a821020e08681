"""The forget register: every forget and task purge, kept outside the ledger database.

A restore from an older backup reapplies what is here, so nothing forgotten after the
backup comes back (R21). The file is append-only JSON Lines, one entry a line, and every
append is fsynced before the ledger append returns. It holds targets and source order,
never forgotten content (no values, no reasons).

The register describes itself (format 2, docs/forgetting.md): each line carries the
ledger it belongs to (`ledger`: the hash-chain link of the ledger's first event, which a
backup and a restore keep), its place (`seq`, 1, 2, ...), the checksum of the line before
it (`prev`) and its own checksum (`c`, over everything else in the line). So a damaged,
reordered, spliced or foreign register is detected line by line, and a register cut
short inside a line (a crash mid-write) is told apart from one damaged in its middle.
What the file alone cannot show (a tail cut off at a line boundary, an emptied file) is
found by comparing it with the ledger: every forget the ledger holds must be here.

Registers written before format 2 (lines of `{"e", "c"}` only) are still read; the
writer rewrites such a register in format 2 on its next append.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from ledger.durable import fsync_dir, replace_file
from ledger.errors import RegisterError

FORMAT: Final = 2
#: What `restore` may be told to do with a damaged register (`register_damaged=`).
DAMAGED_POLICIES: Final = ("refuse", "repair")


def default_register_path(db_url: str) -> str:
    """Where the register lives when nothing says otherwise (docs/forgetting.md)."""
    env = os.environ.get("MEMLEDGER_FORGET_REGISTER")
    if env:
        return env
    if db_url.startswith("sqlite"):
        path = db_url.split(":///", 1)[1] if ":///" in db_url else ""
        if not path or path.startswith(":memory:"):
            raise RegisterError(
                "an in-memory SQLite ledger has no place for its forget register; "
                "set MEMLEDGER_FORGET_REGISTER or give the register a path"
            )
        return path.split("?", 1)[0] + ".forgets"
    # A server database has no file beside it: name the file after the database.
    name = db_url.rsplit("/", 1)[-1].split("?", 1)[0] or "memledger"
    return f"memledger-{name}.forgets"


def _check(body: bytes, n: int) -> str:
    return hashlib.sha256(body).hexdigest()[:n]


def _line(entry: dict[str, Any], ledger: str | None, seq: int, prev: str) -> tuple[bytes, str]:
    """One format-2 line and its checksum; the checksum covers every other field."""
    body = orjson.dumps({"e": entry, "ledger": ledger, "prev": prev, "seq": seq, "v": FORMAT},
                        option=orjson.OPT_SORT_KEYS)
    c = _check(body, 32)
    # "c" sorts before "e": the line stays in canonical (sorted-key) form.
    return b'{"c":"' + c.encode() + b'",' + body[1:] + b"\n", c


def entry_key(entry: dict[str, Any]) -> tuple[str, str] | None:
    """(tenant, idempotency key) of an entry: one register line per forget."""
    ev = entry.get("event") if isinstance(entry, dict) else None
    if not isinstance(ev, dict):
        return None
    tenant, key = ev.get("tenant"), ev.get("idempotency_key")
    return (tenant, key) if isinstance(tenant, str) and isinstance(key, str) else None


@dataclass
class Scan:
    """What reading the whole register found: its entries, and any damage."""

    path: Path
    exists: bool = False
    format: str = "missing"  # "missing", "empty", "damaged", "legacy" or "v2"
    ledger: str | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    keys: set[tuple[str, str]] = field(default_factory=set)
    #: Damage, one sentence each (line numbers, never content).
    damage: list[str] = field(default_factory=list)
    #: The last line has no newline: a write cut short (never acknowledged).
    torn: bool = False
    #: Byte offset just after the last whole line.
    good_end: int = 0
    size: int = 0
    last_seq: int = 0
    last_c: str = ""

    def problems(self, *, ledger: str | None = None,
                 expected: Iterable[tuple[str, str]] = ()) -> list[str]:
        """Every reason not to trust this register for the ledger `ledger` (None: not
        known) that must hold the forgets `expected`: damage, a torn tail, an empty file,
        a foreign ledger, forgets missing."""
        out = list(self.damage)
        where = f"forget register {self.path}"
        if self.format == "empty":
            out.append(f"{where} is empty: a register is created with its first entry, "
                       "so its entries were lost")
        if self.torn:
            out.append(f"{where} ends inside a line (a write cut short, or the file was "
                       "truncated)")
        if ledger is not None and self.ledger is not None and self.ledger != ledger:
            out.append(f"{where} belongs to another ledger ({self.ledger or 'none named'}, "
                       f"this one is {ledger})")
        missing = sum(1 for k in expected if k not in self.keys)
        if missing:
            out.append(f"{where} lacks {missing} forget(s) the ledger holds: it was "
                       "truncated, emptied or replaced")
        return out


def scan_bytes(path: Path, data: bytes) -> Scan:
    """Read a register's bytes; never raises, every fault goes to `Scan.damage`."""
    s = Scan(path, exists=True, size=len(data))
    if not data.strip():
        s.format = "empty"
        return s
    lines = data.split(b"\n")
    if lines[-1]:
        s.torn = True
    whole = lines[:-1]
    s.good_end = len(data) - len(lines[-1])
    where = f"forget register {path}"
    fmt: str | None = None
    for n, raw in enumerate(whole, start=1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
            if not isinstance(obj, dict):
                raise TypeError
            if "v" in obj:
                c = obj.pop("c")
                ok = (obj["v"] == FORMAT and isinstance(obj["seq"], int)
                      and _check(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS), 32) == c)
                kind = "v2"
            else:
                body = orjson.dumps(obj["e"], option=orjson.OPT_SORT_KEYS)
                ok = _check(body, 16) == obj["c"]
                kind = "legacy"
                c = ""
            entry = obj["e"]
            if not isinstance(entry, dict):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            s.damage.append(f"{where} line {n} is damaged")
            continue
        if fmt is None:
            fmt = kind
            s.ledger = obj.get("ledger")
        elif kind != fmt:
            s.damage.append(f"{where} line {n} is in another format than line 1")
            continue
        if kind == "v2":
            if obj["ledger"] != s.ledger:
                s.damage.append(f"{where} line {n} belongs to another ledger than line 1")
            if obj["seq"] != s.last_seq + 1 or obj["prev"] != s.last_c:
                s.damage.append(f"{where} line {n} (entry {obj['seq']}) does not follow "
                                f"entry {s.last_seq}: entries are missing or out of order")
            s.last_seq, s.last_c = obj["seq"], c
        else:
            s.last_seq += 1
        s.entries.append(entry)
        k = entry_key(entry)
        if k is not None:
            s.keys.add(k)
    s.format = fmt or ("damaged" if s.damage else "empty")
    return s


class ForgetRegister:
    """Append-only, fsynced, self-checking file of forget and purge events."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        # The last scan and the (inode, size, mtime) it was taken at: appends by this process
        # then need no re-read; a change by another process (or a repair) re-reads.
        self._cache: tuple[tuple[int, int, int], Scan] | None = None

    def exists(self) -> bool:
        """True when the register file is there."""
        return self.path.exists()

    def scan(self) -> Scan:
        """Read and check the whole register (a missing file is `format == "missing"`)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return Scan(self.path)
        except OSError as e:
            raise RegisterError(f"cannot read forget register {self.path}: {e}") from e
        return scan_bytes(self.path, data)

    def _current(self) -> Scan:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return Scan(self.path)
        if self._cache is not None and self._cache[0] == (st.st_ino, st.st_size,
                                                          st.st_mtime_ns):
            return self._cache[1]
        return self.scan()

    def append(self, entries: Sequence[dict[str, Any]], *, ledger: str | None = None) -> None:
        """Append entries not yet here (one line per forget: a restore reapplying them
        adds nothing) and fsync.

        First repairs a torn tail (truncates to the last whole line, fsync) and rewrites
        a legacy register in format 2, even when `entries` is empty. `ledger` names the
        ledger appending; a register of another ledger is refused (`RegisterError`),
        nothing is written.
        """
        try:
            s = self._current()
            # A legacy register, or one written without knowing its ledger (the ledger
            # was empty), is rewritten in format 2 naming the ledger, once.
            rewrite = not s.damage and (s.format == "legacy" or (
                s.format == "v2" and s.ledger is None and ledger is not None))
            if not entries and not s.torn and not rewrite:
                return
            if ledger is None:
                ledger = s.ledger
            elif s.ledger is not None and s.ledger != ledger:
                raise RegisterError(
                    f"forget register {self.path} belongs to another ledger "
                    f"({s.ledger}, this one is {ledger}); point --forget-register or "
                    "MEMLEDGER_FORGET_REGISTER at this ledger's register "
                    "(docs/forgetting.md)")
            if s.torn:
                self._truncate(s.good_end)
                s = self.scan()
            if rewrite:
                self._rewrite(s.entries, ledger)
                s = self.scan()
            keys = set(s.keys)
            seq, prev = s.last_seq, s.last_c
            out: list[bytes] = []
            for e in entries:
                k = entry_key(e)
                if k is not None and k in keys:
                    continue
                if k is not None:
                    keys.add(k)
                seq += 1
                if s.format == "legacy":
                    # A damaged legacy register is not rewritten (that would drop its
                    # damaged lines unseen): it grows in its own format until repaired.
                    body = orjson.dumps(e, option=orjson.OPT_SORT_KEYS)
                    line = orjson.dumps({"e": orjson.Fragment(body), "c": _check(body, 16)})
                    out.append(line + b"\n")
                else:
                    line, prev = _line(e, ledger, seq, prev)
                    out.append(line)
                s.entries.append(e)
            if not out:
                self._cache = None
                return
            created = not s.exists
            if created:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, b"".join(out))
                os.fsync(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if created:
                self._fsync_dir()
        except OSError as e:
            self._cache = None
            raise RegisterError(f"cannot write forget register {self.path}: {e}") from e
        s.keys, s.last_seq, s.last_c = keys, seq, prev
        s.exists, s.ledger = True, ledger
        s.format = "legacy" if s.format == "legacy" else "v2"
        s.size = s.good_end = st.st_size
        self._cache = ((st.st_ino, st.st_size, st.st_mtime_ns), s)

    def _truncate(self, size: int) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_dir(self) -> None:
        fsync_dir(self.path)

    def _rewrite(self, entries: Sequence[dict[str, Any]], ledger: str | None) -> None:
        """Replace the file by `entries` in format 2: a temporary file, fsync, rename."""
        tmp = self.path.with_name(self.path.name + ".rewrite")
        data = bytearray()
        prev = ""
        for seq, e in enumerate(entries, start=1):
            line, prev = _line(e, ledger, seq, prev)
            data += line
        replace_file(self.path, tmp, bytes(data))
        self._cache = None

    def repair(self, ledger: str | None) -> dict[str, Any]:
        """Keep every intact entry (each line's own checksum holds), drop the rest, and
        write them again as a format-2 register of `ledger`; the old file is kept beside
        it as `<name>.damaged`. Returns what was kept and dropped (counts only)."""
        s = self.scan()
        try:
            if s.exists:
                aside = self.path.with_name(self.path.name + ".damaged")
                os.replace(self.path, aside)
            else:
                aside = None
            seen: set[tuple[str, str]] = set()
            keep: list[dict[str, Any]] = []
            for e in s.entries:
                k = entry_key(e)
                if k is not None and k in seen:
                    continue
                if k is not None:
                    seen.add(k)
                keep.append(e)
            if keep:
                self._rewrite(keep, ledger)
        except OSError as e:
            raise RegisterError(f"cannot repair forget register {self.path}: {e}") from e
        self._cache = None
        return {"kept": len(keep), "damaged_lines": len(s.damage), "torn_tail": s.torn,
                "set_aside": str(aside) if aside is not None else None}

    def unclaim(self) -> bool:
        """Rewrite an intact format-2 register as naming no ledger (restoring a backup of
        an empty ledger: its first event will be the first forget reapplied, a new ledger
        id); the next append names the ledger again. True when it was rewritten."""
        s = self.scan()
        if s.format != "v2" or s.ledger is None or s.damage or s.torn:
            return False
        try:
            self._rewrite(s.entries, None)
        except OSError as e:
            raise RegisterError(f"cannot rewrite forget register {self.path}: {e}") from e
        return True

    def upgrade(self, ledger: str | None) -> bool:
        """Rewrite a legacy register in format 2 now; True when it was legacy."""
        s = self.scan()
        if s.format != "legacy":
            return False
        if s.damage:
            raise RegisterError(f"{s.damage[0]}; repair it first (docs/forgetting.md)")
        try:
            self._rewrite(s.entries, ledger)
        except OSError as e:
            raise RegisterError(f"cannot rewrite forget register {self.path}: {e}") from e
        return True

    def entries(self) -> Iterator[dict[str, Any]]:
        """Every entry in order; a torn last line (crash mid-write) is skipped, any other
        damage raises `RegisterError`."""
        s = self.scan()
        if s.damage:
            raise RegisterError(s.damage[0])
        yield from s.entries
