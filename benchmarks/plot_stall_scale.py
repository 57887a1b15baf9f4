"""Plot ``stall_scale`` results: save stall against shards per rank, for ckptd, a bare copy and Megatron.

    python benchmarks/run.py --only stall_scale > stall_scale.jsonl
    python benchmarks/plot_stall_scale.py stall_scale.jsonl --out docs/stall_scale.svg

Reads the JSON lines ``run.py`` prints (other lines and other benchmarks' rows are skipped) and draws, on
log-log axes, the slowest rank's median stall per size: ckptd's checked save (the default), ckptd under
``assume_constant_structure=True``, the bare copy of the same bytes, and Megatron's async
``dp_reshardable`` save where the run measured it (NaN fields are left out). The SVG carries no date, so a
re-plot of the same lines gives the same file. Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# (JSON field, label, line style)
SERIES = [
    ("megatron_dp_reshardable_s", "Megatron async dp_reshardable save", "s-"),
    ("ckptd_s", "ckptd save_checkpoint (checked, the default)", "o-"),
    ("ckptd_constant_s", "ckptd, assume_constant_structure=True", "^-"),
    ("memcpy_s", "bare copy of the same bytes (memcpy)", "k--"),
]


def stall_rows(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The ``stall_scale`` rows among ``lines``, by shards per rank."""
    rows = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if row.get("bench") == "stall_scale":
            rows.append(row)
    if not rows:
        raise ValueError("no stall_scale rows in the input (run: benchmarks/run.py --only stall_scale)")
    return sorted(rows, key=lambda r: r["shards_per_rank"])


def plot(rows: Sequence[dict[str, Any]], out: Path, title: str = "") -> list[str]:
    """Draw ``rows`` into ``out`` (the format from its suffix); returns the labels of the series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "ckptd-stall-scale"  # stable ids: same lines, same file
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    drawn = []
    for field, label, style in SERIES:
        points = [(r["shards_per_rank"], r[field] * 1e3) for r in rows
                  if isinstance(r.get(field), (int, float)) and math.isfinite(r[field]) and r[field] > 0]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, style, label=label, linewidth=1.5, markersize=5)
        drawn.append(label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("shards per rank")
    ax.set_ylabel("stall per save, ms (slowest rank, median)")
    mb = [r["bytes_per_rank"] / 1e6 for r in rows]
    ax.set_title(title or f"Save stall against tensors per rank ({min(mb):.0f}-{max(mb):.0f} MB per rank)")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None} if out.suffix == ".svg" else None)
    plt.close(fig)
    return drawn


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="JSON lines from benchmarks/run.py ('-' for stdin)")
    parser.add_argument("--out", default="stall_scale.svg", help="image to write (.svg or .png)")
    parser.add_argument("--title", default="", help="the plot's title (default: names the bytes per rank)")
    args = parser.parse_args(argv)
    if args.results == "-":
        rows = stall_rows(sys.stdin)
    else:
        with open(args.results, encoding="utf-8") as f:
            rows = stall_rows(f)
    drawn = plot(rows, Path(args.out), args.title)
    print(f"wrote {args.out}: {len(rows)} sizes, {len(drawn)} series", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
