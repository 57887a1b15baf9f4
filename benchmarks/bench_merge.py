"""Merge benchmark: peak RSS flat in model size (bounded by buckets), throughput vs a plain copy.

Two GPT sizes 4x apart, same bucket size, saved through a real daemon by 2 gloo ranks; then ``ckptd merge``
runs as its own process while its peak RSS is sampled. Baseline in the same run: copying the same stored
bucket bytes (read + write + fsync) on the same filesystem.

Each size is saved once and merged ``runs`` times (``--repeat``; 3 at full size, 1 at smoke size), the merge's
output removed between runs. The copies alternate with the merges (copy, merge, copy, ..., merge, copy) and
each merge is compared with the mean of the copies either side of it, since the disk's speed drifts; the
row reports the median over the runs and its min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20


def _rank_save(rank: int, world: int, socket_path: str, build: dict[str, Any], workdir: str) -> dict[str, Any]:
    from bench_megatron import _megatron_save

    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import get_layout, save_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(**build)
    train_step(0)
    client = CheckpointClient(socket_path, timeout_s=600)
    save_checkpoint(client, 1, model, optimizer).wait(1200)
    client.close()
    layout = get_layout(model, optimizer)
    # Megatron's own fully_reshardable save of the same model, for its peak RSS (the gather ckptd avoids)
    fully = _megatron_save(rank, model, optimizer, os.path.join(workdir, "megatron-fully"), "fully_reshardable", 1)
    return {
        "params": sum(p.numel() for chunk in model for p in chunk.parameters()),
        "buckets": sum(len(b.buckets) for b in layout.buffers),
        "megatron_fully_rss_growth": fully["rss_growth"][0],
    }


def _copy_baseline(src: str, dst: str) -> tuple[float, int]:
    """Read every stored optimizer chunk and write it elsewhere on the same filesystem, with fsync."""
    t0 = time.perf_counter()
    total = 0
    for dirpath, _dirs, files in os.walk(src):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, src)
            target = os.path.join(dst, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(path, "rb") as fh:
                data = fh.read()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            total += len(data)
    return time.perf_counter() - t0, total


def _tree(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, name), root) for d, dirs, files in os.walk(root) for name in dirs + files}


def _merge_once(root: str) -> dict[str, Any]:
    """One ``ckptd merge`` of the root's step as its own process, its peak RSS sampled; then its output is
    removed (whatever it added under the root, so no stored name is spelled here) for the next run."""
    from run import rss_sampler

    before = _tree(root)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ckptd.daemon.cli", "merge", root, "--json", "--workers", "2"],
                            stdout=subprocess.PIPE, text=True)
    peaks, stop = rss_sampler(proc.pid)
    out, _ = proc.communicate()
    wall_s = time.perf_counter() - t0
    stop.set()
    if proc.returncode != 0:
        raise RuntimeError(f"ckptd merge exited with {proc.returncode}")
    summary = json.loads(out)
    if summary.get("already_merged") or summary.get("tasks_skipped"):
        raise RuntimeError(f"the merge's earlier output was not removed, so this run measured nothing: {summary}")
    for rel in sorted(_tree(root) - before):  # parents sort before their children
        path = os.path.join(root, rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    return {"summary": summary, "wall_s": wall_s, "peak_rss": peaks()["hwm"]}


def bench_merge(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    from run import emit, runs, spread

    from ckptd.testing.launch import DaemonProcess, run_ranks

    if args.smoke:
        sizes = [dict(hidden=64, layers=1), dict(hidden=64, layers=4)]
        bucket = 20_000
    else:
        sizes = [dict(hidden=512, layers=3, vocab=1024), dict(hidden=512, layers=13, vocab=1024)]
        bucket = 2_000_000
    rows = []
    for size in sizes:
        build = {**size, "overlap_grad_reduce": True, "bucket_size": bucket, "seq": 32}
        root = os.path.join(workdir, f"merge-{size['layers']}")
        sock = os.path.join(args.sockets, "merge.sock")
        daemon = DaemonProcess(root, sock, "--arena-size", "4GiB" if not args.smoke else "256MiB",
                               log_path=os.path.join(workdir, "merge-daemon.log"))
        daemon.wait_ready(120)
        info = run_ranks(_rank_save, 2, sock, build, workdir, timeout_s=3600)
        daemon.stop()
        src = os.path.join(root, "step_1", "optim")
        n = runs(args)
        copies, merges = [], []
        for i in range(n + 1):
            copy_s, copied = _copy_baseline(src, os.path.join(workdir, "copy"))
            copies.append(copy_s)
            shutil.rmtree(os.path.join(workdir, "copy"), ignore_errors=True)
            if i < n:
                merges.append(_merge_once(root))
        baselines = [(copies[i] + copies[i + 1]) / 2 for i in range(n)]
        ratios = [b / m["summary"]["seconds"] for b, m in zip(baselines, merges, strict=True)]
        rows.append(emit({
            "bench": "merge", "model_params": info[0]["params"] * (1 if size.get("tp", 1) == 1 else 2),
            "buckets_per_rank": info[0]["buckets"],
            **spread("peak_rss_mib", [m["peak_rss"] / MiB for m in merges], 1),
            "bytes_read": merges[0]["summary"]["bytes_read"],
            **spread("merge_s", [m["wall_s"] for m in merges]),
            **spread("merge_inner_s", [m["summary"]["seconds"] for m in merges]),
            **spread("copy_s", baselines),
            "copy_s_before_after": [round(c, 3) for c in copies],
            "copy_bytes": copied,
            **spread("throughput_ratio_vs_copy", ratios),
            "runs": n,
            "megatron_fully_reshardable_rss_growth_mib_per_rank": round(
                max(r["megatron_fully_rss_growth"] for r in info) / MiB, 1),
            "megatron_fully_reshardable_rss_growth_mib_node": round(
                sum(r["megatron_fully_rss_growth"] for r in info) / MiB, 1),
        }))
        shutil.rmtree(root, ignore_errors=True)
    small, big = rows[-2], rows[-1]
    rows.append(emit({"bench": "merge_rss_flatness",
                      "params_ratio": round(big["model_params"] / small["model_params"], 2),
                      "peak_rss_ratio": round(big["peak_rss_mib"] / small["peak_rss_mib"], 3),  # of the medians
                      "runs": big["runs"]}))
    return rows


BENCHES = {"merge": bench_merge}
