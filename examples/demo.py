"""`make demo`: the after-sales story of the source documents, told as it happens.

Runs on a fresh embedded SQLite ledger in a temporary folder (no server). Each step
prints one line saying what happened and what was checked; any failed check stops the
demo with exit 1. `--workers` tells the same start through `publish` and a worker
daemon (needs Redis).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

import memledger
from memledger import Source, ValidationError
from memledger import events as ev

C17 = "2026-09-20T10:00:00+08:00"
C18 = "2026-09-22T09:00:00+08:00"
PREFS = ["preferences"]  # below the user: stored as ["shop-a", "u7", "preferences"]
_step = 0


def step(msg: str) -> None:
    global _step
    _step += 1
    print(f"{_step:>2}. {msg}", flush=True)


def check(cond: bool, what: str) -> None:
    if not cond:
        print(f"    FAILED: {what}", flush=True)
        raise SystemExit(1)
    print(f"    ok: {what}", flush=True)


def aftersales(at: str, seq: int) -> Source:
    """The after-sales system of record as a source."""
    return Source.system("aftersales", at=at, seq=seq)


def query_aftersales(ticket: str, day: str) -> str:
    """Stands in for the system of record: T900's status as it would answer on that day."""
    return "awaiting inspection" if day < "2026-09-21" else "inspecting"


class Cli:
    def __init__(self, db: str, register: str) -> None:
        self.base = [str(Path(sys.executable).with_name("memledger")), "--db", db,
                     "--forget-register", register]

    def __call__(self, *args: str) -> tuple[int, Any]:
        proc = subprocess.run([*self.base, *args], capture_output=True, timeout=300,
                              env={**os.environ, "MEMLEDGER_LOG_LEVEL": "ERROR"})
        lines = [x for x in proc.stdout.splitlines() if x.strip()]
        return proc.returncode, orjson.loads(lines[-1]) if lines else None


async def story(folder: Path, workers: bool) -> None:
    db_path = folder / "memledger.db"
    db = f"sqlite+aiosqlite:///{db_path}"
    register = str(folder / "memledger.db.forgets")
    broker = os.environ.get("MEMLEDGER_REDIS_URL", "redis://127.0.0.1:6379/0")
    cli = Cli(db, register)
    print(f"ledger: {db_path} (forget register beside it)\n")

    async with memledger.MemoryLedger(db, register_path=register,
                                      broker=broker if workers else None) as ml:
        u7 = ml.principal("shop-a", "u7")
        step("C17, 2026-09-20: u7 reports the left earbud of order A123; the after-sales "
             "system opens T900")
        status = query_aftersales("T900", "2026-09-20")
        c17 = [
            ev.open_task(tenant="shop-a", actor="aftersales", task_key="T900",
                         namespace=u7.namespace(["tickets"]), refs={"order": "A123"},
                         title="earbud inspection", source=aftersales(C17, 1)),
            ev.note_task(tenant="shop-a", actor="u7", task_key="T900", kind="user_report",
                         text="the left earbud of order A123 crackles",
                         source=Source.user_statement("C17", at=C17, seq=1)),
            ev.note_task(tenant="shop-a", actor="aftersales", task_key="T900",
                         kind="system_status", text=status, fields={"status": status},
                         source=aftersales(C17, 2)),
        ]
        if workers:
            await via_workers(cli, c17, ml)
        else:
            await ml.append(c17)
        res = await u7.remember(PREFS, "reply_language", "Simplified Chinese", memory_id="L1",
                                source=Source.user_request("C17", at=C17, seq=2))
        check(res.status == "appended", "the reply-language preference is durable and "
              "projected before the app says 'saved' (R16)")

        step("C18, 2026-09-22, a new conversation: 'how is that ticket going?'")
        tasks = await u7.tasks()
        check([t.task_key for t in tasks] == ["T900"],
              "T900 found as u7's one open task, not guessed (R4)")
        fresh = query_aftersales("T900", "2026-09-22")
        await u7.note_task("T900", "system_status", fresh, fields={"status": fresh},
                           actor="aftersales", source=aftersales(C18, 0))
        (t900,) = await u7.tasks()
        check(t900.system["status"] == "inspecting" and t900.system["as_of"] == C18,
              f"status re-queried from the system of record: {t900.system['status']!r} "
              f"as of {t900.system['as_of']} (R29)")
        lang = await u7.get(PREFS, "reply_language")
        check(lang is not None and lang.value == "Simplified Chinese", "the answer uses the "
              "stored reply language, Simplified Chinese")

        step("u7: 'I said it wrong, it is the right earbud'; a model summarises "
             "'inspection confirmed the fault'")
        await u7.note_task("T900", "correction", "it is the right earbud",
                           fields={"side": "right"}, source=Source.user_request("C18", at=C18,
                                                                                seq=1))
        await u7.note_task("T900", "user_report", "inspection confirmed the fault",
                           fields={"status": "fault confirmed"},
                           source=Source.model("C18", at=C18, seq=2))
        try:
            await u7.note_task("T900", "system_status", "fault confirmed",
                               source=Source.model("C18", at=C18, seq=3))
            stopped = False
        except ValidationError:
            stopped = True
        (t900,) = await u7.tasks()
        check(stopped, "a model cannot write a system fact: rejected (R3)")
        check(t900.corrections[0]["pending"] is True,
              "the correction is kept as the user's, pending the system's confirmation (R5)")
        check(t900.to_dict()["conflicts"][0]["claimed"] == "fault confirmed",
              "the wrong summary is flagged as a conflict, never merged (R30)")

        step("u7: 'from now on answer me in English'")
        await u7.correct(PREFS, "reply_language", "English", supersedes="L1",
                         source=Source.user_request("C18", at=C18, seq=4))
        lang = await u7.get(PREFS, "reply_language")
        check(lang is not None and (lang.value, lang.version) == ("English", 2),
              "English is version 2; Simplified Chinese is superseded, never returned (R12)")

        step("user-417: Java (M18), then 'from now on Python' (M31); 'use Java this time'")
        u417 = ml.principal("shop-a", "user-417")
        await u417.remember(PREFS, "code_language", "Java", memory_id="M18",
                            source=Source.user_request("C3", at="2026-06-01T10:00:00+08:00"))
        await u417.correct(PREFS, "code_language", "Python", supersedes="M18", memory_id="M31",
                           source=Source.user_request("C9", at="2026-08-01T10:00:00+08:00"))
        await u417.remember(PREFS, "code_language", "Java", task="Q42",
                            source=Source.user_request("C12", at="2026-09-01T10:00:00+08:00"))
        default = await u417.get(PREFS, "code_language")
        this_time = await u417.get(PREFS, "code_language", task="Q42")
        check(default is not None and (default.memory_id, default.value, default.version)
              == ("M31", "Python", 2), "the long-term default is M31 Python, version 2")
        check(this_time is not None and this_time.value == "Java",
              "'Java this time' holds inside task Q42 only (R8, R27)")

        step("another account asks about T900 and u7's preferences")
        u8 = ml.principal("shop-a", "u8")
        other = await u8.recall("T900 earbud reply language")
        check(other.items == () and other.tasks == () and
              await u8.get(PREFS, "reply_language") is None,
              "shop-a/u8 reads nothing, even where similarity would match (R24)")

    step("operator: backup while the system runs")
    backup = folder / "before-forget.backup"
    rc, out = cli("backup", str(backup))
    check(rc == 0, f"backup written at position {out.get('position') if out else '?'}")

    async with memledger.MemoryLedger(db, register_path=register) as ml:
        u7 = ml.principal("shop-a", "u7")
        step("u7: 'forget my reply language'")
        await u7.forget(PREFS, "reply_language", wait=False,
                        source=Source.user_request("C18", at=C18, seq=9))
        check(await u7.get(PREFS, "reply_language") is None, "unreadable the moment the "
              "append returned, before any projection ran (R20)")
        await ml.project()

    step("operator: restore the backup taken before the forget")
    rc, out = cli("restore", str(backup), "--force")
    reapplied = (out or {}).get("reapplied") or {}
    check(rc == 0, f"restored; {reapplied.get('entries', '?')} forget(s) in the register, "
          f"{len(reapplied.get('appended', []))} recorded after the backup reapplied, "
          f"{reapplied.get('payloads_erased', '?')} payload(s) erased again")
    async with memledger.MemoryLedger(db, register_path=register) as ml:
        u7 = ml.principal("shop-a", "u7")
        lang = await u7.get(PREFS, "reply_language")
        recalled = await u7.recall("reply language")
        check(lang is None and all(i.key != "reply_language" for i in recalled.items),
              "nothing forgotten came back (R21)")
    await asyncio.sleep(0)
    data = b"".join(p.read_bytes() for p in folder.glob("memledger.db*")
                    if not p.name.endswith(".forgets"))
    check(b"Simplified Chinese" not in data and b"English" not in data,
          "the forgotten values' bytes are in none of the database files")

    step("operator: verify the ledger and every view")
    rc, out = cli("replay", "verify")
    check(rc == 0 and out.get("ok") is True, "hash chain, digests and views all check out")
    rc, out = cli("replay", "verify", "--forgotten")
    check(rc == 0, "every forgotten item is erased from every copy")

    step("u7 closes the ticket; a closed task is not open")
    async with memledger.MemoryLedger(db, register_path=register) as ml:
        u7 = ml.principal("shop-a", "u7")
        await u7.close_task("T900", resolution="replaced", actor="aftersales",
                            source=aftersales("2026-09-30T10:00:00+08:00", 4))
        check(await u7.tasks() == [], "T900 is no longer recalled as open (R6)")
    print("\nall steps passed")


async def via_workers(cli: Cli, events: list[memledger.Event],
                      ml: memledger.MemoryLedger) -> None:
    """Publish events and let a worker daemon ingest and project them."""
    worker = subprocess.Popen([*cli.base, "worker", "--processes", "1", "--threads", "2"],
                              env={**os.environ, "MEMLEDGER_LOG_LEVEL": "ERROR"})
    u7 = ml.principal("shop-a", "u7")
    try:
        sent = await ml.publish(events)
        check(all(r.status == "published" for r in sent),
              f"{len(events)} events published to the broker")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if [t.task_key for t in await u7.tasks()] == ["T900"]:
                break
            await asyncio.sleep(0.2)
        check(bool(await u7.tasks()), "the worker daemon ingested and projected them")
    finally:
        worker.terminate()
        worker.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", action="store_true", help="publish through a worker daemon")
    p.add_argument("--keep", action="store_true", help="keep the demo folder")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="memledger-demo-"))
    try:
        asyncio.run(story(folder, args.workers))
    finally:
        if args.keep:
            print(f"(kept {folder})")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
