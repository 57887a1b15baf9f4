"""Plot ``stall_scale`` results: save stall against shards per rank, for ckptd, a bare copy and Megatron.

    python benchmarks/run.py --only stall_scale > stall_scale.jsonl
    python benchmarks/plot_stall_scale.py stall_scale.jsonl --out docs/stall_scale.svg

``--bench gpu_megatron_stall`` plots the GPU bench's Megatron rows instead (``run.py --only gpu``): ckptd's
checked save with its static copies queued before the checks (the default) and after them (``late``), under
the promise, one contiguous D2H copy of the same bytes, and Megatron's save.

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

# per bench: the shards field, the bytes field, and the series: (JSON field, label, line style)
SERIES_GPU = [
    ("megatron_dp_reshardable_s", "Megatron async dp_reshardable save", "s-"),
    ("ckptd_late_s", "ckptd checked, copies after the checks (before)", "x:"),
    ("ckptd_checked_s", "ckptd checked, copies queued before the checks (the default)", "o-"),
    ("ckptd_constant_s", "ckptd, assume_constant_structure=True", "^-"),
    ("d2h_contiguous_checked_s", "one contiguous D2H copy of the same bytes", "k--"),
]
SERIES = [
    ("megatron_dp_reshardable_s", "Megatron async dp_reshardable save", "s-"),
    ("ckptd_s", "ckptd save_checkpoint (checked, the default)", "o-"),
    ("ckptd_constant_s", "ckptd, assume_constant_structure=True", "^-"),
    ("memcpy_s", "bare copy of the same bytes (memcpy)", "k--"),
]


BENCHES = {"stall_scale": ("shards_per_rank", "bytes_per_rank", SERIES),
           "gpu_megatron_stall": ("shards", "bytes", SERIES_GPU)}


def stall_rows(lines: Iterable[str], bench: str = "stall_scale") -> list[dict[str, Any]]:
    """The ``bench`` rows among ``lines`` (those that measured: not a part's error), by shards per rank."""
    shards = BENCHES[bench][0]
    rows = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if row.get("bench") == bench and shards in row:
            rows.append(row)
    if not rows:
        raise ValueError(f"no {bench} rows in the input (run: benchmarks/run.py)")
    return sorted(rows, key=lambda r: r[shards])


def plot(rows: Sequence[dict[str, Any]], out: Path, title: str = "", bench: str = "stall_scale") -> list[str]:
    """Draw ``rows`` into ``out`` (the format from its suffix); returns the labels of the series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "ckptd-stall-scale"  # stable ids: same lines, same file
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    drawn = []
    shards, nbytes, series = BENCHES[bench]
    for field, label, style in series:
        points = [(r[shards], r[field] * 1e3) for r in rows
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
    mb = [r[nbytes] / 1e6 for r in rows]
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
    parser.add_argument("--bench", default="stall_scale", choices=sorted(BENCHES), help="whose rows to plot")
    args = parser.parse_args(argv)
    if args.results == "-":
        rows = stall_rows(sys.stdin, args.bench)
    else:
        with open(args.results, encoding="utf-8") as f:
            rows = stall_rows(f, args.bench)
    drawn = plot(rows, Path(args.out), args.title, args.bench)
    print(f"wrote {args.out}: {len(rows)} sizes, {len(drawn)} series", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
