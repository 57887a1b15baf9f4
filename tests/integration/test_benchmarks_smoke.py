"""CI runs the benchmarks at smoke size: they must run and print their JSON lines (speed is not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
PLOT = RUNNER.parent / "plot_stall_scale.py"

pytestmark = pytest.mark.timeout(900)


def test_benchmarks_run_at_smoke_size(tmp_path, tmp_path_factory):
    out = subprocess.run([sys.executable, str(RUNNER), "--smoke", "--root", str(tmp_path)],
                         capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    by_bench = {r["bench"]: r for r in rows}
    figures = [("stall", "ratio_vs_memcpy"), ("drain", "ratio_vs_raw_write"), ("daemon_rss", "ratio_4x_data"),
               ("megatron_stall", "ratio_vs_memcpy"), ("merge", "throughput_ratio_vs_copy"),
               ("s3_drain", "ratio_vs_raw_put"), ("stall_scale", "ratio_vs_memcpy"),
               ("load", "ratio_ckptd_vs_raw_warm"), ("load", "ratio_ckptd_vs_raw_plain_warm"),
               ("staged_load", "ratio_fresh_over_pool"), ("s3_load", "ratio_tp2_vs_same"),
               ("plain_many", "ratio_vs_memcpy"), ("plain_many", "planned_ratio_vs_memcpy"),
               ("plain_many", "load_ratio_vs_raw_place")]
    for bench, figure in figures:
        assert bench in by_bench, f"{bench} missing: {sorted(by_bench)}\n{out.stderr[-2000:]}"
        assert by_bench[bench].get(figure, 0) > 0, by_bench[bench]
    assert by_bench["machine"]["smoke"] is True
    assert by_bench["s3_load"]["tp2_equal_whole"] is True  # by piece and by whole chunk: the same state
    staged = by_bench["staged_load"]  # every round in the pool's one buffer; the baseline a tensor per region
    assert staged["pool_allocations"] == 1 and staged["fresh_allocations"] == staged["rounds"] > 1, staged
    # the repeated figures: the key holds the median of `runs` runs (one at smoke size), bracketed by min/max
    for bench, figure in [("merge", "throughput_ratio_vs_copy"), ("merge", "peak_rss_mib"),
                          ("s3_drain", "ratio_vs_raw_put")]:
        row = by_bench[bench]
        assert row["runs"] == 1, row
        assert row[f"{figure}_min"] <= row[figure] <= row[f"{figure}_max"], row
    assert not list(tmp_path.iterdir()), "the benchmarks left files behind"
    # docs/benchmarks.md's plot is drawn from these lines: every series the run measured is drawn
    svg = tmp_path_factory.mktemp("plot") / "stall_scale.svg"
    plotted = subprocess.run([sys.executable, str(PLOT), "-", "--out", str(svg)], input=out.stdout,
                             capture_output=True, text=True, timeout=300)
    assert plotted.returncode == 0, plotted.stderr[-4000:]
    drawing = svg.read_text()
    for label in ("Megatron async dp_reshardable save", "ckptd save_checkpoint (checked, the default)",
                  "ckptd, assume_constant_structure=True", "bare copy of the same bytes (memcpy)"):
        assert label in drawing, label
    assert "4 series" in plotted.stderr, plotted.stderr


def test_the_gpu_rows_plot_with_every_series(tmp_path):
    """The GPU bench's Megatron rows (docs/benchmarks.md's second plot) draw each series they hold; a part that
    failed (an error row) is left out."""
    def row(shards: int, scale: float) -> dict:
        return {"bench": "gpu_megatron_stall", "shards": shards, "bytes": shards * 10**5,
                "megatron_dp_reshardable_s": 3.0 * scale, "ckptd_late_s": 0.03 * scale,
                "ckptd_checked_s": 0.02 * scale, "ckptd_constant_s": 0.019 * scale,
                "d2h_contiguous_checked_s": 0.018 * scale}
    lines = [json.dumps(row(1356, 1.0)), json.dumps(row(9812, 2.0)),
             json.dumps({"bench": "gpu_megatron_stall", "error": "RuntimeError: a part failed"})]
    svg = tmp_path / "gpu.svg"
    plotted = subprocess.run([sys.executable, str(PLOT), "-", "--bench", "gpu_megatron_stall", "--out", str(svg)],
                             input="\n".join(lines), capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr[-4000:]
    assert "2 sizes, 5 series" in plotted.stderr, plotted.stderr
    drawing = svg.read_text()
    for label in ("Megatron async dp_reshardable save", "ckptd checked, copies after the checks (before)",
                  "ckptd checked, copies queued before the checks (the default)",
                  "one contiguous D2H copy of the same bytes"):
        assert label in drawing, label
