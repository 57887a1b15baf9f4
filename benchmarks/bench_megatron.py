"""Megatron save stall: ckptd versus Megatron's own ``dist_checkpointing.save``, on the same model, in one run.

Two gloo ranks (TP1 x DP2) train one step of the same GPT (>= 100M params at full size, CPU shim), then,
in these same processes, one after the other:

- ``memcpy``: a bare copy of the bytes the rank stages into a pre-faulted buffer (one contiguous copy
  of that many bytes), and the same gather ckptd does (every shard's ``stage_into``) into a private
  buffer;
- ``ckptd``: :func:`ckptd.client.megatron.save_checkpoint` through a ``ckptd serve`` process (the first
  save, which plans and caches, is reported apart; then the median of the next saves);
- ``megatron_dp_reshardable`` / ``megatron_fully_reshardable``: Megatron-LM's path — build
  ``model.sharded_state_dict()`` and ``optimizer.sharded_state_dict(model_sd, metadata=
  {'distrib_optim_sharding_type': T})``, ``dist_checkpointing.save(..., async_sharded_save=True)`` with
  the torch_dist strategy wrapped in ``FullyParallelSaveStrategyWrapper`` (Megatron-LM's defaults), and
  ``AsyncCallsQueue.schedule_async_request`` (a forked writer; this works on CPU).

Stall: wall time of the call(s) the training loop blocks on, slowest rank. Total: until the checkpoint is
complete (ckptd: committed; Megatron: ``maybe_finalize_async_calls(blocking=True)`` returned). Peak RSS:
each rank resets its high-water mark (``/proc/self/clear_refs``) before a mode and reports ``VmHWM`` minus
its RSS before the mode (the forked Megatron writers are separate processes and not counted). ckptd's
staging arena is mapped by the ranks at connect time, so it is in the "before" RSS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from typing import Any

from ckptd.testing.launch import DaemonProcess, run_ranks

MiB = 1 << 20
FULL = {"hidden": 1024, "layers": 8, "heads": 16, "vocab": 32768, "seq": 64, "micro_batch_size": 1}
SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 128, "seq": 16}
KINDS = ("dp_reshardable", "fully_reshardable")


def _gpt_params(cfg: dict[str, Any]) -> int:
    """Parameter count of the toy GPT (SwiGLU, ffn = 2 * hidden, biases, tied embeddings)."""
    h, n, v, s = cfg["hidden"], cfg["layers"], cfg["vocab"], cfg["seq"]
    ffn = cfg.get("ffn_hidden") or 2 * h
    layer = 4 * h * h + 4 * h + 3 * h * ffn + 2 * ffn + h + 4 * h
    return int(v * h + s * h + n * layer + 2 * h)


# --- rank side -----------------------------------------------------------------------------------
def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class _Peak:
    """Peak RSS growth of this process over one measured block."""

    def __enter__(self) -> _Peak:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS
        self.before = _status()["VmRSS"]
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = _status()["VmHWM"] - self.before


def _rank(rank: int, world: int, socket_path: str, workdir: str, cfg: dict[str, Any], repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint
    from ckptd.client.megatron.save import save_plan
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(**cfg)
    train_step(0)  # the optimizer has its state now
    out: dict[str, Any] = {"params": sum(p.numel() for c in model for p in c.parameters())}
    client = CheckpointClient(socket_path, timeout_s=600)

    # ckptd's first save plans and caches the static metadata; reported apart
    dist.barrier()
    t0 = time.perf_counter()
    handle = save_checkpoint(client, 1, model, optimizer, extra={"iteration": 1})
    out["ckptd_first_stall_s"] = time.perf_counter() - t0
    handle.wait(1200)
    shards = save_plan(model, optimizer, rank).shards
    staged = sum(s.nbytes for s in shards)
    out["staged_bytes"] = staged

    # baselines: one contiguous copy of the same byte count, and ckptd's gather into a private buffer
    src = torch.empty(staged, dtype=torch.uint8).fill_(1)
    dst = torch.empty(staged, dtype=torch.uint8).fill_(0)  # pre-faulted
    memcpy, gather = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        memcpy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        off = 0
        for s in shards:
            s.stage_into(dst[off : off + s.nbytes].view(s.data.dtype).view(s.data.shape))
            off += s.nbytes
        gather.append(time.perf_counter() - t0)
    out["memcpy_s"], out["gather_s"] = memcpy, gather
    del src, dst

    stall, total, peak = [], [], []
    for i in range(repeats):
        dist.barrier()
        with _Peak() as p:
            t0 = time.perf_counter()
            handle = save_checkpoint(client, 2 + i, model, optimizer, extra={"iteration": 2 + i})
            stall.append(time.perf_counter() - t0)
            handle.wait(1200)
            total.append(time.perf_counter() - t0)
        peak.append(p.growth)
        dist.barrier()
    out["ckptd"] = {"stall": stall, "total": total, "rss_growth": peak, "handle_stall": handle.stall_s}
    client.close()

    for kind in KINDS:
        out[kind] = _megatron_save(rank, model, optimizer, os.path.join(workdir, kind), kind,
                                   1 if kind == "fully_reshardable" else max(1, repeats - 1))
    return out


def _megatron_save(rank: int, model: list[Any], optimizer: Any, ckpt_root: str, kind: str,
                   repeats: int) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.utils import unwrap_model

    queue = AsyncCallsQueue(persistent=False)
    stall, total, peak = [], [], []
    for i in range(repeats):
        ckpt_dir = os.path.join(ckpt_root, f"iter_{i}")
        if rank == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
        dist.barrier()
        with _Peak() as p:
            t0 = time.perf_counter()
            model_sd = unwrap_model(model[0]).sharded_state_dict()
            optim_sd = optimizer.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": kind})
            strategy = FullyParallelSaveStrategyWrapper(
                TorchDistSaveShardedStrategy("torch_dist", 1), ps.get_data_parallel_group(with_context_parallel=True)
            )
            request = dist_checkpointing.save(
                {"model": model_sd, "optimizer": optim_sd}, ckpt_dir, strategy, async_sharded_save=True,
                content_metadata={"distrib_optim_sharding_type": kind},
            )
            queue.schedule_async_request(request)
            stall.append(time.perf_counter() - t0)
            queue.maybe_finalize_async_calls(blocking=True)
            total.append(time.perf_counter() - t0)
        peak.append(p.growth)
        del model_sd, optim_sd, request
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    queue.close()
    return {"stall": stall, "total": total, "rss_growth": peak}


# --- parent --------------------------------------------------------------------------------------
def _slowest(results: list[dict[str, Any]], mode: str, field: str) -> float:
    """Median over repeats of the slowest rank's figure."""
    n = len(results[0][mode][field])
    return float(statistics.median(max(r[mode][field][i] for r in results) for i in range(n)))


def bench_megatron(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    from run import emit

    cfg = dict(SMOKE if args.smoke else FULL)
    world = 2
    repeats = 2 if args.smoke else 3
    params = _gpt_params(cfg)
    arena_mib = int(params * 16 / MiB * 1.2) + 64  # fp32: 4 B model + 12 B optimizer per param, over the node
    root = os.path.join(workdir, "ckptd")
    sock = os.path.join(args.sockets, "megatron.sock")
    daemon = DaemonProcess(root, sock, "--arena-size", f"{arena_mib}MiB", "--keep", "1",
                           log_path=os.path.join(workdir, "megatron-daemon.log"))
    try:
        daemon.wait_ready(300)
        results = run_ranks(_rank, world, sock, workdir, cfg, repeats, timeout_s=3600)
    finally:
        daemon.stop(120)
    staged = max(r["staged_bytes"] for r in results)
    memcpy = statistics.median(max(r["memcpy_s"][i] for r in results) for i in range(repeats))
    gather = statistics.median(max(r["gather_s"][i] for r in results) for i in range(repeats))
    ckptd = _slowest(results, "ckptd", "stall")
    dp = _slowest(results, "dp_reshardable", "stall")
    fully = _slowest(results, "fully_reshardable", "stall")
    rows = [
        emit({
            "bench": "megatron_stall",
            "ckptd_s": round(ckptd, 4),
            "megatron_dp_reshardable_s": round(dp, 4),
            "megatron_fully_reshardable_s": round(fully, 4),
            "memcpy_s": round(memcpy, 4),
            "gather_copy_s": round(gather, 4),
            "ratio_vs_memcpy": round(ckptd / memcpy, 3),
            "ratio_vs_gather_copy": round(ckptd / gather, 3),
            "ratio_fully_over_ckptd": round(fully / ckptd, 1),
            "ratio_dp_over_ckptd": round(dp / ckptd, 2),
            "ckptd_first_save_stall_s": round(max(r["ckptd_first_stall_s"] for r in results), 4),
            "ckptd_total_s": round(_slowest(results, "ckptd", "total"), 3),
            "megatron_dp_reshardable_total_s": round(_slowest(results, "dp_reshardable", "total"), 3),
            "megatron_fully_reshardable_total_s": round(_slowest(results, "fully_reshardable", "total"), 3),
            "params": results[0]["params"],  # TP1: every rank holds the whole model
            "staged_bytes_per_rank": staged,
            "ranks": world,
        }),
    ]
    growth = {m: [max(r[m]["rss_growth"]) for r in results] for m in ("ckptd", *KINDS)}
    rows.append(emit({
        "bench": "megatron_peak_rss",
        "ckptd_growth_mib_per_rank": round(max(growth["ckptd"]) / MiB, 1),
        "megatron_dp_reshardable_growth_mib_per_rank": round(max(growth["dp_reshardable"]) / MiB, 1),
        "megatron_fully_reshardable_growth_mib_per_rank": round(max(growth["fully_reshardable"]) / MiB, 1),
        "ckptd_growth_mib_node": round(sum(growth["ckptd"]) / MiB, 1),
        "megatron_dp_reshardable_growth_mib_node": round(sum(growth["dp_reshardable"]) / MiB, 1),
        "megatron_fully_reshardable_growth_mib_node": round(sum(growth["fully_reshardable"]) / MiB, 1),
        "arena_mib": arena_mib,
        "note": "VmHWM minus RSS before each mode, rank processes only (the arena is mapped before)",
    }))
    return rows


BENCHES = {"megatron": bench_megatron}
ALIASES = {"megatron_stall": "megatron", "megatron_peak_rss": "megatron"}
