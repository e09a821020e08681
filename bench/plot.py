"""Plot the ratios of one or more `bench-out/results.json` files side by side (a PNG).

    .venv/bin/python -m bench.plot before.json:before bench-out/results.json:after \
        --out docs/bench-ratios.png

Each argument is `FILE[:LABEL]` (files with one label are merged: modules run
separately count as one run); every figure that has a ratio (memledger beside its
same-run baseline, higher is better) gets one bar per file, so a before/after pair shows
what moved. Figures missing from a file are left out of its bars. The dashed lines mark
the ratios the targets name (0.5x and 1x). `--match REGEX` keeps the figures whose
names match (the full run prints about a hundred).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import orjson


def load(spec: str) -> tuple[str, dict[str, float], str]:
    """(label, {figure name: ratio}, load average note) of one `FILE[:LABEL]`."""
    path, _, label = spec.partition(":")
    data = orjson.loads(Path(path).read_bytes())
    ratios = {r["name"]: float(r["ratio"]) for r in data["results"] if r.get("ratio")}
    m = data.get("machine", {})
    load_note = f"load {m.get('loadavg', ['?'])[0]}-{m.get('loadavg_end', ['?'])[0]}"
    return label or Path(path).stem, ratios, load_note


def plot(runs: list[tuple[str, dict[str, float], str]], out: Path, title: str) -> None:
    """Grouped horizontal bars, one group per figure, one bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    for _, ratios, _ in runs:
        names.extend(n for n in ratios if n not in names)
    height = 0.8 / max(1, len(runs))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(names) * max(1, len(runs)) / 1.5 + 1.5))
    for i, (label, ratios, load_note) in enumerate(runs):
        ys = [k + i * height for k, n in enumerate(names) if n in ratios]
        xs = [ratios[n] for n in names if n in ratios]
        bars = ax.barh(ys, xs, height=height, label=f"{label} ({load_note})")
        ax.bar_label(bars, labels=[f"{x:.2f}x" for x in xs], fontsize=7, padding=2)
    ax.set_yticks([k + height * (len(runs) - 1) / 2 for k in range(len(names))])
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    for x in (0.5, 1.0):
        ax.axvline(x, linestyle="--", linewidth=0.8, color="grey")
    ax.set_xlabel("ratio to the same run's baseline (higher is better, log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m bench.plot`."""
    ap = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="FILE[:LABEL]", help="results.json files")
    ap.add_argument("--out", default="docs/bench-ratios.png", help="PNG to write")
    ap.add_argument("--title", default="memledger / same-run baseline")
    ap.add_argument("--match", metavar="REGEX",
                    help="plot only the figures whose names match (re.search)")
    args = ap.parse_args(argv)
    merged: dict[str, tuple[str, dict[str, float], str]] = {}
    for spec in args.runs:  # files with the same label are one run (modules run apart)
        label, ratios, load_note = load(spec)
        if args.match:
            ratios = {n: r for n, r in ratios.items() if re.search(args.match, n)}
        if label in merged:
            _, seen, note = merged[label]
            ratios, load_note = {**seen, **ratios}, f"{note}, {load_note}"
        merged[label] = (label, ratios, load_note)
    plot(list(merged.values()), Path(args.out), args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
