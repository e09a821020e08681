"""Shared helpers of the benchmarks: sizes, temp directories, raw sqlite3, results, events.

Every bench module exposes `async def run() -> list[dict]`; each dict is one figure
beside the baseline measured in the same run (build it with `result`). A module runs
alone with `python -m bench.<module> [--quick]` through `main(run)`.

`ratio` is always the speed relative to the baseline, higher is better: value/baseline
for rates (units ending in "/s"), baseline/value for latencies and durations.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import gc
import os
import platform
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

from sqlalchemy import Table
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.schema import CreateIndex, CreateTable

from ledger.builders import Source as WireSource
from ledger.builders import wire
from ledger.events import Event, Source, derive_memory_id, encode_json
from ledger.logs import configure
from ledger.records import event_from_wire
from ledger.validation import parse_event

QUICK_ENV: Final = "MEMLEDGER_BENCH_QUICK"
OUT_DIR: Final = Path("bench-out")
RESULT_KEYS: Final = ("name", "value", "unit", "baseline", "baseline_unit", "ratio", "note")


# -- sizes --------------------------------------------------------------------------------

def quick() -> bool:
    """True when `--quick` asked for smaller sizes (set by `python -m bench --quick`)."""
    return os.environ.get(QUICK_ENV, "") not in ("", "0")


def size(full: int, small: int) -> int:
    """`full` normally, `small` under `--quick`."""
    return small if quick() else full


# -- results ------------------------------------------------------------------------------

def is_rate(unit: str) -> bool:
    """Rates ("events/s") are better higher; anything else (us, ms, s) better lower."""
    return unit.endswith("/s")


def result(name: str, value: float, unit: str, baseline: float | None,
           baseline_unit: str | None = None, note: str = "") -> dict[str, Any]:
    """One benchmark figure beside its baseline; `ratio` > 1 means faster than baseline."""
    bunit = baseline_unit or unit
    ratio: float | None = None
    if baseline is not None and baseline > 0 and value > 0:
        ratio = value / baseline if is_rate(unit) else baseline / value
    return {"name": name, "value": value, "unit": unit, "baseline": baseline,
            "baseline_unit": bunit, "ratio": ratio, "note": note}


def percentile(samples: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) by nearest rank of a non-empty sample."""
    ordered = sorted(samples)
    rank = max(1, round(p / 100 * len(ordered) + 0.5 - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


def fmt_num(x: float | None) -> str:
    """A number for the table: three significant figures, thousands separated."""
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """Results as an aligned text table."""
    header = ("benchmark", "value", "baseline", "ratio", "note")
    rows = [header]
    for r in results:
        value = f"{fmt_num(r['value'])} {r['unit']}"
        base = f"{fmt_num(r['baseline'])} {r['baseline_unit']}" if r["baseline"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        rows.append((str(r["name"]), value, base, ratio, str(r["note"])))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), row[1].rjust(widths[1]),
                 row[2].rjust(widths[2]), row[3].rjust(widths[3]), row[4]]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Where the figures were measured."""
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version, "platform": platform.platform(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "at": datetime.now(UTC).isoformat(timespec="seconds")}


def say(msg: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    print(f"  .. {msg}", file=sys.stderr, flush=True)


# -- temp directories and databases -------------------------------------------------------

@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """`os.environ[name] = value` for the block (child processes too), then as before."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def vault_off() -> contextlib.AbstractContextManager[None]:
    """Ledgers made and opened inside run without the vault (`MEMLEDGER_VAULT=off`, also
    in child processes): for the modules whose raw sqlite3 baseline reads the ledger's
    payloads in clear, so both sides do the same work. The vault's own cost, with and
    without it in one run, is the `vault` module's."""
    return env_set("MEMLEDGER_VAULT", "off")


@contextlib.contextmanager
def workdir(name: str) -> Iterator[Path]:
    """A fresh temporary directory, removed afterwards: never the user's memledger.db."""
    with tempfile.TemporaryDirectory(prefix=f"memledger-bench-{name}-") as d:
        yield Path(d)


def sqlite_url(path: Path) -> str:
    """The SQLAlchemy URL of a SQLite file."""
    return f"sqlite+aiosqlite:///{path}"


def raw_connect(path: Path) -> sqlite3.Connection:
    """Raw sqlite3 as the baselines use it: WAL, synchronous=NORMAL, explicit BEGIN."""
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout=30000")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def create_like(conn: sqlite3.Connection, *tables: Table) -> None:
    """Create tables with exactly the columns, keys and indexes of the memledger schema."""
    dialect = sqlite_dialect.dialect()
    for table in tables:
        conn.execute(str(CreateTable(table).compile(dialect=dialect)))
        for index in table.indexes:
            conn.execute(str(CreateIndex(index).compile(dialect=dialect)))


def insert_sql(table: Table) -> str:
    """`INSERT INTO t (cols) VALUES (:cols)` for every column of a table."""
    cols = [c.name for c in table.columns]
    return (f"INSERT INTO {table.name} ({', '.join(cols)}) "
            f"VALUES ({', '.join(':' + c for c in cols)})")


def copy_sqlite(src: Path, dst: Path) -> None:
    """Copy a closed SQLite database (and its WAL, if any) to a new path."""
    with contextlib.closing(sqlite3.connect(str(src))) as s, \
            contextlib.closing(sqlite3.connect(str(dst))) as d:
        s.backup(d)


# -- timing -------------------------------------------------------------------------------

def settle() -> None:
    """Flush dirty pages before a timed phase, so set-up writes do not bill the next one."""
    os.sync()


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Build test data without cyclic GC, then freeze it so collections skip it later.

    Hundreds of thousands of live events would otherwise make every full collection
    during the measured part scan the benchmark's own input.
    """
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.freeze()


class Clock:
    """Wall-clock seconds of a block: `with Clock() as c: ...; c.seconds`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self) -> Clock:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.seconds = time.perf_counter() - self._t0


# -- events -------------------------------------------------------------------------------

BASE_AT: Final = datetime(2026, 9, 1, tzinfo=UTC)
VALUE_WORDS: Final = ("window seat", "aisle seat", "email", "phone", "English", "Chinese",
                      "evening delivery", "no onions", "dark mode", "weekly digest")


def at(seconds: int) -> str:
    """An RFC 3339 source time `seconds` after a fixed base."""
    return (BASE_AT + timedelta(seconds=seconds)).isoformat()


BASE_US: Final = int(BASE_AT.timestamp()) * 1_000_000
#: One event in this many is also run through `parse_event` to prove the bench's events
#: are exactly the validated ones (full validation of 200k events costs about a minute,
#: longer than the benchmarks it would set up).
CHECK_EVERY: Final = 25


def _event(etype: str, data: dict[str, Any], *, tenant: str, actor: str, kind: str, sid: str,
           when: int, idem: str, i: int) -> Event:
    """A bench event from the shared wire builder, in its normalised form.

    `data` states every field validation would fill in (layer, memory_id, text), so the
    wire object is already normalised and decodes like a stored event; one in
    `CHECK_EVERY` is validated and must come out identical.
    """
    obj = wire(etype, data, tenant=tenant, actor=actor, source=WireSource(kind, sid, at(when)),
               idempotency_key=idem)
    ev = event_from_wire(obj, Source(kind, sid, at(when), None, None,
                                     BASE_US + when * 1_000_000))
    if i % CHECK_EVERY == 0 and parse_event(obj) != ev:
        raise AssertionError(f"bench event {idem} differs from its validated form")
    return ev


def _write_data(tenant: str, user: str, key: str, value: Any, *, idem: str,
                supersedes: str | None = None, folder: str = "preferences") -> dict[str, Any]:
    data: dict[str, Any] = {
        "namespace": [tenant, user, folder], "key": key, "value": value, "layer": "long",
        "memory_id": derive_memory_id(tenant, idem),
        "text": f"{key}: {encode_json(value).decode()}"}
    if supersedes is not None:
        data["supersedes"] = supersedes
    return data


def memory_write(tenant: str, user: str, key: str, value: Any, *, idem: str, when: int,
                 source_id: str = "C1", supersedes: str | None = None,
                 folder: str = "preferences") -> Event:
    """A validated `memory.written` (or `memory.corrected` when it supersedes) event."""
    return _write(tenant, user, key, value, idem=idem, when=when, source_id=source_id,
                  supersedes=supersedes, folder=folder, i=0)


def _write(tenant: str, user: str, key: str, value: Any, *, idem: str, when: int,
           source_id: str, supersedes: str | None = None, folder: str = "preferences",
           i: int = 1) -> Event:
    return _event("memory.corrected" if supersedes else "memory.written",
                  _write_data(tenant, user, key, value, idem=idem, supersedes=supersedes,
                              folder=folder),
                  tenant=tenant, actor=user, kind="explicit_user_request", sid=source_id,
                  when=when, idem=idem, i=i)


def pref_value(rng: random.Random, n: int) -> dict[str, Any]:
    """A small realistic preference value (about 100 bytes encoded)."""
    return {"choice": rng.choice(VALUE_WORDS), "rank": n % 7,
            "note": f"said in conversation, option {n % 97}"}


def simple_writes(n: int, *, users: int, tenant: str = "shop-a", seed: int = 11,
                  ) -> list[Event]:
    """`n` new long-term memories spread over `users` users of one tenant (keys k0..)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        user = f"u{i % users}"
        out.append(_write(tenant, user, f"k{i // users}", pref_value(rng, i),
                          idem=f"w{i}", when=i, source_id=f"C{user}", i=i))
    return out


def mixed_events(n: int, *, seed: int = 7, tenants: int = 4, users: int | None = None,
                 corrections: float = 0.10, task_share: float = 0.10) -> list[Event]:
    """A realistic stream of `n` validated events, in source order.

    Mostly new long-term memories across many users, `corrections` of them correct an
    existing slot (`memory.corrected` superseding the slot's newest version), and
    `task_share` are task events (a user opens a task, then notes and system statuses).
    """
    rng = random.Random(seed)
    users = users or max(50, n // 40)
    people = [(f"shop-{i % tenants}", f"u{i}") for i in range(users)]
    written: list[tuple[str, str, str, str]] = []  # tenant, user, key, newest memory_id
    keys_of: dict[str, int] = {}
    open_task: dict[str, str] = {}
    events: list[Event] = []
    for i in range(n):
        r = rng.random()
        when = i * 2
        idem = f"e{i}"
        ev: Event
        if r < task_share:
            tenant, user = rng.choice(people)
            task = open_task.get(user)
            if task is None:
                task = f"T{i}"
                open_task[user] = task
                ev = _event("task.opened", {"task_key": task, "namespace": [tenant, user],
                                            "refs": {"order": f"A{i}"},
                                            "title": "earbuds not charging"},
                            tenant=tenant, actor=user, kind="explicit_user_request",
                            sid=f"C{user}", when=when, idem=idem, i=i)
            elif rng.random() < 0.3:
                ev = _event("task.noted", {"task_key": task, "kind": "system_status",
                                           "text": "replacement shipped",
                                           "fields": {"status": "shipped", "carrier": "SF"}},
                            tenant=tenant, actor="aftersales", kind="system_of_record",
                            sid="aftersales", when=when, idem=idem, i=i)
            else:
                ev = _event("task.noted", {"task_key": task, "kind": "user_report",
                                           "text": "the right earbud still does not charge"},
                            tenant=tenant, actor=user, kind="explicit_user_request",
                            sid=f"C{user}", when=when, idem=idem, i=i)
        elif r < task_share + corrections and written:
            j = rng.randrange(len(written))
            tenant, user, key, prior = written[j]
            ev = _write(tenant, user, key, pref_value(rng, i), idem=idem, when=when,
                        source_id=f"C{user}", supersedes=prior, i=i)
            written[j] = (tenant, user, key, str(ev.memory_id))
        else:
            tenant, user = rng.choice(people)
            k = keys_of.get(user, 0)
            keys_of[user] = k + 1
            key = f"pref_{k}"
            ev = _write(tenant, user, key, pref_value(rng, i), idem=idem, when=when,
                        source_id=f"C{user}", i=i)
            written.append((tenant, user, key, str(ev.memory_id)))
        events.append(ev)
    return events


# -- ledgers ------------------------------------------------------------------------------

_SESSION: dict[str, Any] = {}
#: Set-up ledgers kept between runs, by code version (`setup_cache_dir`).
CACHE_ENV: Final = "MEMLEDGER_BENCH_CACHE"
#: What a set-up ledger's bytes depend on: the append path and the schema it creates.
_VERSIONED: Final = ("ledger", "projections")


async def load_ledger(db: Path, events: Sequence[Event], *, batch: int = 4000) -> float:
    """Append `events` to a new ledger at `db` through `Store.append`; returns seconds."""
    from ledger.store import Store

    store = Store(sqlite_url(db))
    await store.open()
    try:
        with Clock() as c:
            for i in range(0, len(events), batch):
                await store.append(events[i:i + batch])
    finally:
        await store.close()
    return c.seconds


def code_version() -> str:
    """A digest of everything a set-up ledger's contents depend on: the sources of the
    packages that append and create the schema, this module (the event generator), the
    SQLite, SQLAlchemy and Python versions and the vault setting. Any change gives a new
    version, so a cached ledger built by other code is never used."""
    import hashlib

    import sqlalchemy

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = [Path(__file__).resolve()]
    for pkg in _VERSIONED:
        files.extend(sorted((root / pkg).rglob("*.py")))
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(f"{sqlite3.sqlite_version} {sqlalchemy.__version__} {sys.version} "
             f"vault={os.environ.get('MEMLEDGER_VAULT', '')}".encode())
    return h.hexdigest()[:16]


def setup_cache_dir() -> Path | None:
    """Where set-up ledgers are kept between runs (`bench-out/cache/<code version>/`), or
    None when `MEMLEDGER_BENCH_CACHE=0` or the vault is on (its keys live beside the
    ledger, which a copy of the file alone would not carry). Older versions' entries are
    removed when a new version's directory is made."""
    if os.environ.get(CACHE_ENV, "1") in ("0", "off", "no"):
        return None
    if os.environ.get("MEMLEDGER_VAULT", "") != "off":
        return None
    base = OUT_DIR.resolve() / "cache"
    here = base / code_version()
    if not here.is_dir():
        if base.is_dir():
            for old in base.iterdir():
                shutil.rmtree(old, ignore_errors=True)
        here.mkdir(parents=True, exist_ok=True)
    return here


def _session_dir() -> Path:
    if "dir" not in _SESSION:
        _SESSION["dir"] = tempfile.mkdtemp(prefix="memledger-bench-session-")
        atexit.register(shutil.rmtree, _SESSION["dir"], True)
    return Path(_SESSION["dir"])


async def cached_ledger(dst: Path, key: str, make: Callable[[], Sequence[Event]], *,
                        depends: Sequence[Path] = (), batch: int = 4000) -> None:
    """A ledger of the events `make()` returns at `dst`, appended through `Store.append`
    (`load_ledger`, `batch` per call) and nothing else: no projection has run on it.

    Built once per process and copied for each caller, so modules run together share
    the set-up cost; the copy is the caller's to change. It is also kept in
    `setup_cache_dir()` for later runs of the same code; its name
    carries `key` and a digest of the module defining `make` and of `depends` (data
    files the events are made from), so a changed generator builds afresh
    (`MEMLEDGER_BENCH_CACHE=0`: always afresh). Shared and kept only without the vault
    (`vault_off`); with it, built at `dst` for each caller.
    """
    import hashlib

    mod = sys.modules.get(getattr(make, "__module__", "") or "")
    sources = [Path(f) for f in (getattr(mod, "__file__", None),) if f] + list(depends)
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()[:12]
    name = f"{key}-b{batch}-{digest}"
    if os.environ.get("MEMLEDGER_VAULT", "") != "off":
        # The vault's keys live beside the ledger (`<file>.vault`): built in place,
        # never copied without them.
        with no_gc():
            events = make()
        say(f"appending {len(events):,} events through Store.append (set-up {key})")
        await load_ledger(dst, events, batch=batch)
        return
    if name not in _SESSION:
        cache = setup_cache_dir()
        kept = cache / f"{name}.db" if cache is not None else None
        if kept is not None and kept.is_file():
            say(f"set-up ledger {key} from the cache of this code version "
                f"({kept.parent.name}; MEMLEDGER_BENCH_CACHE=0 builds it afresh)")
            _SESSION[name] = kept
        else:
            path = _session_dir() / f"{name}.db"
            with no_gc():
                events = make()
            say(f"appending {len(events):,} events through Store.append (set-up {key})")
            secs = await load_ledger(path, events, batch=batch)
            say(f"set-up ledger ready in {secs:.0f} s ({len(events) / secs:,.0f} events/s)")
            del events
            if kept is not None:
                part = kept.with_suffix(".part")
                copy_sqlite(path, part)
                part.replace(kept)  # whole or absent, never half written
            _SESSION[name] = path
    copy_sqlite(_SESSION[name], dst)


async def mixed_ledger(dst: Path, n: int, *, seed: int = 3) -> None:
    """A ledger of `mixed_events(n, seed)` at `dst` (`cached_ledger`: built once, kept
    between runs of the same code)."""
    await cached_ledger(dst, f"mixed-{n}-{seed}", lambda: mixed_events(n, seed=seed))


# -- running ------------------------------------------------------------------------------

def main(run: Callable[[], Coroutine[Any, Any, list[dict[str, Any]]]],
         argv: Sequence[str] | None = None) -> int:
    """Run one bench module from its `__main__` block and print its table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    args = ap.parse_args(argv)
    if args.quick:
        os.environ[QUICK_ENV] = "1"
    configure()
    results = asyncio.run(run())
    print(format_table(results))
    return 0
