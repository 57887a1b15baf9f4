"""The merged-layout optimizer read: the fast path versus zarr per piece, in one run, at a reduced size.

One rank saves a toy GPT at TP1 x DP1 (fp32) through the daemon; ``ckptd merge`` builds the merged layout;
then 2 ranks at TP2 x DP1 rebuild their bucket slices from it, alternating (``repeats`` times each, warm
page cache) between :func:`ckptd.client.megatron.reshard.merged_optimizer_slices` (``fast``: raw chunks
through one ChunkReader) and the read it replaced (``zarr``: one ``open_array`` + ``read_region`` per model
piece, kept below as the baseline), checking both give identical slices; then one full ``load_checkpoint``
(merged path). Prints one JSON line: the slowest rank's median per mode and the ratio.

    python benchmarks/bench_merged_read.py [--hidden 512 --layers 4 --vocab 8192 --repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from ckptd.testing.launch import DaemonProcess, run_ranks

STEP = 1


async def zarr_merged_slices(root: Any, step: int, manifest: Any, layout: Any) -> dict[str, torch.Tensor]:
    """The merged read before the fast path (main at 2e7c9c2): zarr per model piece."""
    from ckptd.client.megatron.layout import view_of
    from ckptd.client.state import torch_dtype
    from ckptd.writer.arrays import open_array, read_region
    from ckptd.writer.format import merged_array_name, step_dir
    from ckptd.writer.merge import merged_states

    states = merged_states(manifest)
    prefix = step_dir(step)
    sem = asyncio.Semaphore(8)

    async def param_state(param: Any, state: str) -> torch.Tensor:
        out = torch.empty(param.shape, dtype=torch_dtype(states[state]))
        for piece in param.model_pieces:
            region = piece.region()
            async with sem:
                arr = await open_array(root.store, f"{prefix}/{merged_array_name(state, piece.key)}")
                data = await read_region(arr, [r.start for r in region], [r.stop - r.start for r in region])
            view_of(piece, out).copy_(torch.from_numpy(data).reshape(piece.view_shape))
        return out

    slices: dict[str, torch.Tensor] = {}
    for buf, bucket in layout.buckets():
        s = buf.slice_numel(bucket)
        lo, hi = buf.dp_rank * s, (buf.dp_rank + 1) * s
        touched = [p for p in bucket.params if p.start - bucket.start < hi and p.end - bucket.start > lo]
        for state, dtype in states.items():
            out = torch.zeros(s, dtype=torch_dtype(dtype))
            values = await asyncio.gather(*(param_state(p, state) for p in touched))
            for p, value in zip(touched, values, strict=True):
                a, b = p.start - bucket.start, p.end - bucket.start
                i, j = max(a, lo), min(b, hi)
                out[i - lo : j - lo] = value.reshape(-1)[i - a : j - a]
            slices[layout.bucket_key(buf, bucket, state)] = out
    return slices


def _save(rank: int, world: int, socket: str, cfg: dict[str, Any]) -> int:
    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(**cfg)
    train_step(0)
    save_checkpoint(CheckpointClient(socket, timeout_s=600), STEP, model, optimizer).wait(600)
    return sum(p.numel() for c in model for p in c.parameters())


def _timed(rank: int, world: int, root: str, cfg: dict[str, Any], repeats: int) -> dict[str, Any]:
    from ckptd.client.megatron import get_layout, load_checkpoint
    from ckptd.client.megatron.reshard import merged_optimizer_slices
    from ckptd.testing.toy_gpt import build_gpt
    from ckptd.writer.root import open_root

    model, optimizer, _ = build_gpt(tp=2, seed=99, **cfg)
    layout = get_layout(model, optimizer)
    times: dict[str, list[float]] = {"fast": [], "zarr": []}

    async def go() -> bool:
        async with open_root(root, None, create=False) as ckpt:
            manifest = await ckpt.read_merged_manifest(STEP)
            assert manifest is not None
            got: dict[str, dict[str, torch.Tensor]] = {}
            for _ in range(repeats):
                for mode, fn in (("zarr", zarr_merged_slices), ("fast", merged_optimizer_slices)):
                    t0 = time.perf_counter()
                    got[mode] = await fn(ckpt, STEP, manifest, layout)
                    times[mode].append(time.perf_counter() - t0)
            return got["fast"].keys() == got["zarr"].keys() and all(
                torch.equal(got["fast"][k], got["zarr"][k]) for k in got["fast"])

    same = asyncio.run(go())
    t0 = time.perf_counter()
    load_checkpoint(root, STEP, model, optimizer)
    full = time.perf_counter() - t0
    nbytes = sum(t.numel() * 4 for t in merged_slices_shape(layout))
    return {"fast": statistics.median(times["fast"]), "zarr": statistics.median(times["zarr"]), "same": same,
            "load_checkpoint": full, "slice_bytes": nbytes}


def merged_slices_shape(layout: Any) -> list[torch.Tensor]:
    """Empty stand-ins, one per (bucket, state) of the three states, to count the bytes a rank rebuilds."""
    return [torch.empty(buf.slice_numel(bucket)) for buf, bucket in layout.buckets() for _ in range(3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "heads": 8, "seq": 32,
           "micro_batch_size": 1}
    with tempfile.TemporaryDirectory(prefix="bench-merged-") as tmp:
        root = os.path.join(tmp, "ckpt")
        daemon = DaemonProcess(root, os.path.join(tmp, "d.sock"), "--arena-size", "1GiB", "--no-prefault",
                               log_path=os.path.join(tmp, "daemon.log")).wait_ready()
        try:
            params = run_ranks(_save, 1, daemon.socket, cfg, timeout_s=1200)[0]
        finally:
            daemon.stop(timeout=60)
        subprocess.run([sys.executable, "-m", "ckptd.daemon.cli", "merge", root], check=True, capture_output=True)
        res = run_ranks(_timed, 2, root, cfg, args.repeats, timeout_s=1800)
    row = {"bench": "merged_read", "params": params, "from": "tp1dp1", "to": "tp2dp1", "cache": "warm",
           "repeats": args.repeats, "rank_slice_mib": round(max(r["slice_bytes"] for r in res) / 2**20, 1),
           "zarr_s": round(max(r["zarr"] for r in res), 3), "fast_s": round(max(r["fast"] for r in res), 3),
           "load_checkpoint_s": round(max(r["load_checkpoint"] for r in res), 3),
           "identical": all(r["same"] for r in res)}
    row["ratio_fast_vs_zarr"] = round(row["fast_s"] / row["zarr_s"], 3)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
