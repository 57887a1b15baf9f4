"""A restarted trainer's first load of a deep model: ckptd's ``load_checkpoint`` vs Megatron's own (a dev tool).

    PYTHONPATH=... python benchmarks/profile_resume.py [--size LAYERSxHIDDENxHEADS] [--repeats N] [--root DIR]

``bench_load`` times loads of a wide 8-layer model, where every array has a few chunks and a load's planning
is cheap. A model with many layers per pipeline stage has thousands of params and each stacked array one
chunk a layer, so a load's planning (placing every ShardedTensor on its param, finding the chunks of every
region) is where a quadratic step would show. This tool saves the toy GPT once through a daemon (ckptd) and
once with Megatron's ``dist_checkpointing.save`` (``dp_reshardable``, synchronous), then ``--repeats``
times, alternating, loads each in two *new* rank processes (TP1 x DP2, nothing cached from the save) and
times the call: ckptd's ``load_checkpoint`` and Megatron's ``dist_checkpointing.load`` +
``load_state_dict``, both with the CPU shim's ``TorchFunctionMode`` off (on a GPU there is no shim); page
cache warm; slowest rank. Prints one JSON line. Default size: ``stall_scale``'s deepest (700 x 16 x 2,
9,808 shards a rank). ``--load-tp 2`` loads ckptd's checkpoint at TP2 x DP1 instead (merge-free; Megatron's
``dp_reshardable`` optimizer state does not load at another TP, so its fields are null).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_load import _sharded  # noqa: E402

from ckptd.testing.launch import DaemonProcess, run_ranks, socket_dir  # noqa: E402


def _model(cfg: dict[str, Any]) -> tuple[Any, Any]:
    import torch.distributed as dist

    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(vocab=128, seq=16, micro_batch_size=1, global_microbatches=2, **cfg)
    train_step(0)
    dist.barrier()
    return model, optimizer


def _save(rank: int, world: int, sock: str, workdir: str, cfg: dict[str, Any]) -> int:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint

    model, optimizer = _model(cfg)
    client = CheckpointClient(sock, timeout_s=600)
    save_checkpoint(client, 1, model, optimizer, extra={"iteration": 1}).wait(1200)
    client.close()
    mdir = os.path.join(workdir, "megatron")
    if rank == 0:
        os.makedirs(mdir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(model, optimizer, False), mdir,
                            content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    dist.barrier()
    return sum(p.numel() for c in model for p in c.parameters())


def _load(rank: int, world: int, workdir: str, cfg: dict[str, Any], which: str) -> float:
    import torch
    import torch.distributed as dist

    from ckptd.client.megatron import load_checkpoint
    from ckptd.testing.cpu_shim import suspended

    model, optimizer = _model(cfg)
    dist.barrier()
    with suspended(), torch.no_grad():
        t0 = time.perf_counter()
        if which == "ckptd":
            load_checkpoint(os.path.join(workdir, "ckptd"), 1, model, optimizer)
        else:
            from megatron.core import dist_checkpointing
            from megatron.core.utils import unwrap_model

            state = dist_checkpointing.load(_sharded(model, optimizer, True), os.path.join(workdir, "megatron"))
            unwrap_model(model[0]).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="700x16x2", help="layers x hidden x heads")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--root", default=None, help="where the checkpoints go (a temporary folder under it)")
    parser.add_argument("--load-tp", type=int, default=1, help="TP of the loading ranks (2: ckptd only)")
    args = parser.parse_args()
    layers, hidden, heads = (int(x) for x in args.size.split("x"))
    cfg: dict[str, Any] = {"layers": layers, "hidden": hidden, "heads": heads}
    load_cfg = {**cfg, "tp": args.load_tp}
    workdir = tempfile.mkdtemp(prefix="ckptd-profresume-", dir=args.root)
    try:
        with socket_dir() as sockets:
            sock = os.path.join(sockets, "d.sock")
            daemon = DaemonProcess(os.path.join(workdir, "ckptd"), sock, "--arena-size", "256MiB",
                                   log_path=os.path.join(workdir, "daemon.log"))
            try:
                daemon.wait_ready(300)
                params = run_ranks(_save, 2, sock, workdir, cfg, timeout_s=3600)[0]
            finally:
                daemon.stop(120)
        times: dict[str, list[float]] = {"ckptd": [], "megatron": []} if args.load_tp == 1 else {"ckptd": []}
        for _ in range(args.repeats):
            for which, got in times.items():
                got.append(max(run_ranks(_load, 2, workdir, load_cfg, which, timeout_s=3600)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    megatron = times.get("megatron")
    print(json.dumps({
        "bench": "profile_resume", "size": args.size, "params": params, "load_tp": args.load_tp,
        "ckptd_load_s": [round(t, 3) for t in times["ckptd"]],
        "megatron_load_s": [round(t, 3) for t in megatron] if megatron else None,
        "ratio_ckptd_vs_megatron": round(statistics.median(times["ckptd"]) / statistics.median(megatron), 3)
        if megatron else None,
    }), flush=True)


if __name__ == "__main__":
    main()
