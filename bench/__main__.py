"""Run every benchmark module, print one table, write `bench-out/results.json`.

`python -m bench` (what `make bench` runs); `--only NAME` runs one module, `--quick`
uses smaller sizes. Modules run in a fixed order; one not written yet is skipped, and
one that fails is reported (exit status 1) without stopping the others.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import os
import resource
import sys
import time
import traceback
from typing import Any

import orjson

from bench.common import OUT_DIR, QUICK_ENV, format_table, machine
from ledger.logs import configure

ORDER = ("append", "projection", "get", "rebuild", "recall", "workers", "langgraph", "http",
         "postgres", "scale", "vault", "asof", "eval")


def _load(name: str) -> Any:
    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"bench.{name}":
            return None
        raise


def _cpu() -> float:
    """CPU seconds (user + sys) of this process and of its finished child processes."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m bench`."""
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--only", choices=ORDER, action="append",
                    help="run only this module (repeatable)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--out", default=str(OUT_DIR / "results.json"), help="JSON results file")
    args = ap.parse_args(argv)
    if args.quick:
        os.environ[QUICK_ENV] = "1"
    # As the CLI and workers run: warnings only (a debug line per event costs real time).
    configure()
    names = [n for n in ORDER if not args.only or n in args.only]
    everything: list[dict[str, Any]] = []
    modules: dict[str, Any] = {}
    failed = False
    info = machine()
    run_started, run_cpu = time.perf_counter(), _cpu()
    print(f"memledger bench: {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, "
          f"SQLite {info['sqlite']}, load average {info['loadavg'][0]}"
          f"{', quick sizes' if args.quick else ''}", flush=True)
    for name in names:
        try:
            mod = _load(name)
        except Exception:  # noqa: BLE001 - a broken module must not hide the others
            traceback.print_exc()
            modules[name] = {"status": "import failed"}
            failed = True
            continue
        if mod is None:
            print(f"[{name}] not written yet: skipped", flush=True)
            modules[name] = {"status": "missing"}
            continue
        print(f"[{name}] running ...", flush=True)
        started, cpu0 = time.perf_counter(), _cpu()
        try:
            results = asyncio.run(mod.run())
        except Exception:  # noqa: BLE001 - report, keep going, exit 1 at the end
            traceback.print_exc()
            modules[name] = {"status": "failed",
                             "seconds": round(time.perf_counter() - started, 1),
                             "cpu_seconds": round(_cpu() - cpu0, 1)}
            failed = True
            continue
        seconds, cpu = time.perf_counter() - started, _cpu() - cpu0
        gc.unfreeze()
        gc.collect()
        for r in results:
            r.setdefault("module", name)
        everything.extend(results)
        modules[name] = {"status": "ok", "seconds": round(seconds, 1),
                         "cpu_seconds": round(cpu, 1)}
        print(format_table(results), flush=True)
        print(f"[{name}] done in {seconds:.0f} s (CPU {cpu:.0f} s)\n", flush=True)
    if everything:
        print("== all results ==")
        print(format_table(everything))
    wall, cpu = time.perf_counter() - run_started, _cpu() - run_cpu
    load_end = machine()["loadavg"]
    split = ", ".join(f"{n} {m['seconds']:.0f}/{m['cpu_seconds']:.0f}"
                      for n, m in modules.items() if "seconds" in m)
    print(f"bench total: {wall:.0f} s wall, {cpu:.0f} s CPU (user+sys, children included), "
          f"load average {info['loadavg'][0]} -> {load_end[0]}"
          f"{', quick sizes' if args.quick else ''}")
    print(f"per module (wall/CPU s): {split}")
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "wb") as f:
        info["loadavg_end"] = load_end
        f.write(orjson.dumps({"machine": info, "quick": bool(args.quick), "modules": modules,
                              "total": {"seconds": round(wall, 1),
                                        "cpu_seconds": round(cpu, 1)},
                              "results": everything}, option=orjson.OPT_INDENT_2))
    print(f"results written to {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
