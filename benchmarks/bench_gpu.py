"""The CUDA paths, on a machine with a GPU (``--only gpu``): a save's D2H staging and a load's H2D, against bare
copies of the same bytes in the same run.

One rank (NCCL, world 1) on the first GPU beside a ``ckptd serve`` daemon whose root and arena are in
``/dev/shm`` (so a drain between saves costs no disk time, and what is timed is the rank's side). In that one
process, one after the other:

- ``gpu_stall``: ``CheckpointClient.save`` of CUDA tensors (few large; thousands of small) against
  ``d2h_per_tensor`` (the same tensors copied into one page-locked host buffer, one ``non_blocking`` copy each,
  one synchronize) and ``d2h_contiguous`` (one copy of a GPU buffer of the same byte count into it). Each save
  is waited on until committed before the next copy; the modes take turns; medians.
- ``gpu_megatron_stall``: ``save_checkpoint`` of the toy GPT trained on the GPU — checked (the default), checked
  with the static copies started after the checks instead of before them (``late``: the save as it was before
  :mod:`ckptd.client.early`; ``early_gain_checked`` is late over checked) and under ``assume_constant_structure``
  — at 117.6M params (8 x 1024), ~1,350 shards (96 x 256, 1 GB), ~2,800 shards (200 x 192, 1.2 GB) and ~9,800
  shards (700 x 128, 1.8 GB), against the same two D2H copies of the bytes it stages, and Megatron's async
  ``dp_reshardable`` save of the same state (one save above 5,000 shards: it takes seconds).
- ``gpu_load``: after a save of the 117.6M model and one more training step, ``load_checkpoint`` into the GPU
  model and optimizer, from storage (page cache warm) and from the daemon's memory, checked bit-exact against
  the saved state, against ``raw_h2d`` (the step's files read into one page-locked buffer by as many threads as
  ckptd's reads use, then one H2D copy of it) and Megatron's ``dist_checkpointing.load`` + ``load_state_dict``
  of its own checkpoint.

Without CUDA it prints one line that says so. ``CKPTD_BENCH_GPU_PARTS`` (default
``plain,gpt,deep,wide,load,deeper``) picks parts, for a short run on a lent machine;
``CKPTD_BENCH_GPU_MEGATRON=0`` leaves Megatron's own save out.
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd.testing.launch import DaemonProcess, run_ranks

MiB = 1 << 20
# (name, tensors, elements each, dtype name)
PLAIN = [("large", 8, 32 << 20, "float32"), ("many", 4096, 64 << 10, "float32"),
         ("10k_small", 10_000, 16 << 10, "bfloat16")]
PLAIN_SMOKE = [("large", 2, 1 << 20, "float32"), ("many", 64, 4 << 10, "float32")]
GPT = {"hidden": 1024, "layers": 8, "heads": 16, "vocab": 32768, "seq": 64, "micro_batch_size": 1}
DEEP = {"hidden": 256, "layers": 96, "heads": 4, "vocab": 1024, "seq": 64, "micro_batch_size": 1}  # ~1,350 shards
DEEPER = {"hidden": 128, "layers": 700, "heads": 4, "vocab": 1024, "seq": 64, "micro_batch_size": 1}  # ~9,800
WIDE = {"hidden": 192, "layers": 200, "heads": 4, "vocab": 1024, "seq": 64, "micro_batch_size": 1}  # ~2,800
GPT_SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 128, "seq": 16}
_PARTS = set(os.environ.get("CKPTD_BENCH_GPU_PARTS", "plain,gpt,deep,wide,load,deeper").split(","))
_MEGATRON = os.environ.get("CKPTD_BENCH_GPU_MEGATRON", "1") != "0"


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


class _D2H:
    """The baselines: the same bytes into one page-locked buffer, per tensor and as one contiguous copy."""

    def __init__(self, tensors: list[Any]) -> None:
        import torch

        self.tensors = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        self.nbytes = sum(t.numel() for t in self.tensors)
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True).fill_(0)
        self.flat = torch.ones(self.nbytes, dtype=torch.uint8, device="cuda")

    def per_tensor(self) -> float:
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        at = 0
        for t in self.tensors:
            self.host[at : at + t.numel()].copy_(t, non_blocking=True)
            at += t.numel()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def contiguous(self) -> float:
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.host.copy_(self.flat, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def _timed(base: _D2H, save: Any, repeats: int, step: int) -> tuple[list[float], list[float], list[float]]:
    """``repeats`` saves of steps ``step + 1`` on, each waited on until committed and preceded by the two D2H
    baselines: the stalls, the per-tensor copies, the contiguous copies."""
    import torch

    stall, per, flat = [], [], []
    for i in range(repeats):
        per.append(base.per_tensor())
        flat.append(base.contiguous())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = save(step + 1 + i)
        stall.append(time.perf_counter() - t0)
        handle.wait(600)
    return stall, per, flat


def _plain(client: Any, sizes: list[tuple[str, int, int, str]], repeats: int, step: int) -> tuple[list[dict], int]:
    import torch

    rows = []
    for name, count, numel, dtype in sizes:
        state = {f"t{i:05d}": torch.randn(numel, device="cuda").to(getattr(torch, dtype)) for i in range(count)}
        base = _D2H(list(state.values()))
        step += 1
        client.save(step, state).wait(600)  # the first save plans
        stall, per, flat = _timed(base, lambda step, state=state: client.save(step, state), repeats, step)
        step += repeats
        rows.append({"bench": "gpu_stall", "case": name, "tensors": count, "bytes": base.nbytes,
                     "ckptd_s": round(_med(stall), 5), "d2h_per_tensor_s": round(_med(per), 5),
                     "d2h_contiguous_s": round(_med(flat), 5),
                     "ratio_vs_d2h_per_tensor": round(_med(stall) / _med(per), 3),
                     "ratio_vs_d2h_contiguous": round(_med(stall) / _med(flat), 3),
                     "d2h_gib_per_s": round(base.nbytes / _med(flat) / (1 << 30), 1),
                     "arena_pinned": bool(client._staging.pinned)})
        del state, base
        torch.cuda.empty_cache()
    return rows, step


def _megatron_stall(client: Any, workdir: str, cfg: dict[str, Any], repeats: int, step: int) -> tuple[dict, int]:
    import torch
    from bench_megatron import _megatron_save

    from ckptd.client import early
    from ckptd.client.megatron import save_checkpoint
    from ckptd.client.megatron.save import save_plan
    from ckptd.client.megatron.staged import cached
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(**cfg)
    train_step(0)
    step += 1
    t0 = time.perf_counter()
    save_checkpoint(client, step, model, optimizer, extra={"iteration": step}).wait(600)
    first = time.perf_counter() - t0
    staged = cached(optimizer)
    assert staged is not None
    base = _D2H([s.data for s in save_plan(model, optimizer, 0).shards])
    out: dict[str, Any] = {"bench": "gpu_megatron_stall", "layers": cfg["layers"], "hidden": cfg["hidden"],
                           "params": sum(p.numel() for c in model for p in c.parameters()),
                           "shards": len(staged.plan.metas), "copies": staged.plan.copies,
                           "bytes": staged.plan.nbytes,
                           "first_save_s": round(first, 4)}
    for key in ("checked", "late", "constant"):
        constant = key == "constant"
        if constant:  # the first save under the promise checks and captures
            step += 1
            save_checkpoint(client, step, model, optimizer, extra={"iteration": step},
                            assume_constant_structure=True).wait(600)
        def save(step: int, model: Any = model, optimizer: Any = optimizer, constant: bool = constant) -> Any:
            return save_checkpoint(client, step, model, optimizer, extra={"iteration": step},
                                   assume_constant_structure=constant)

        # "late": the checked save as it was before the static copies started ahead of the checks
        begin = early.begin
        if key == "late":
            early.begin = lambda *args: None
        try:
            stall, per, flat = _timed(base, save, repeats, step)
        finally:
            early.begin = begin
        step += repeats
        out[f"ckptd_{key}_s"] = round(_med(stall), 5)
        out[f"d2h_per_tensor_{key}_s"] = round(_med(per), 5)
        out[f"{key}_ratio_vs_d2h_per_tensor"] = round(_med(stall) / _med(per), 3)
        out[f"d2h_contiguous_{key}_s"] = round(_med(flat), 5)
        out[f"{key}_ratio_vs_d2h_contiguous"] = round(_med(stall) / _med(flat), 3)
    out["early_gain_checked"] = round(out["ckptd_late_s"] / out["ckptd_checked_s"], 3)
    if _MEGATRON:
        mega = _megatron_save(0, model, optimizer, os.path.join(workdir, f"mega-{cfg['layers']}"), "dp_reshardable",
                              1 if len(staged.plan.metas) > 5000 else max(1, repeats - 2))
        out["megatron_dp_reshardable_s"] = round(_med(mega["stall"]), 4)
        out["ratio_megatron_over_ckptd_checked"] = round(_med(mega["stall"]) / out["ckptd_checked_s"], 1)
    del model, optimizer, train_step, base
    torch.cuda.empty_cache()
    return out, step


def _load(client: Any, root: str, workdir: str, cfg: dict[str, Any], repeats: int, step: int) -> tuple[dict, int]:
    import torch
    from bench_load import _sharded
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    from ckptd.client.megatron import load_checkpoint, save_checkpoint
    from ckptd.testing.demo import state_digests
    from ckptd.testing.toy_gpt import build_gpt
    from ckptd.writer.fanout import POOL_THREADS

    model, optimizer, train_step = build_gpt(**cfg)
    train_step(0)
    mdir = os.path.join(workdir, "load-megatron")
    os.makedirs(mdir, exist_ok=True)
    # Megatron's save first: its sharded_state_dict adds keys to the param groups, which ckptd's save then holds
    dist_checkpointing.save(_sharded(model, optimizer, False), mdir,
                            content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    step += 1
    save_checkpoint(client, step, model, optimizer, extra={"iteration": step}).wait(600)
    saved = state_digests(model, optimizer)
    train_step(1)  # the live state differs from the saved one
    files = sorted(os.path.join(d, f) for d, _s, fs in os.walk(os.path.join(root, f"step_{step}")) for f in fs)
    sizes = [os.path.getsize(f) for f in files]
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True).fill_(0)
    dev = torch.empty(sum(sizes), dtype=torch.uint8, device="cuda")

    view = memoryview(host.numpy())
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def read_one(i: int) -> None:
        with open(files[i], "rb", buffering=0) as fh:
            fh.readinto(view[starts[i] : starts[i] + sizes[i]])

    def raw_h2d() -> None:  # as many threads as ckptd's reads use
        list(pool.map(read_one, range(len(files))))
        dev.copy_(host, non_blocking=True)

    def megatron() -> None:
        with torch.no_grad():
            state = dist_checkpointing.load(_sharded(model, optimizer, True), mdir)
            unwrap_model(model[0]).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

    memory_bytes = [0]

    def memory() -> None:
        memory_bytes[0] = load_checkpoint(client, step, model, optimizer).from_memory_bytes

    modes = {"raw_h2d": raw_h2d, "ckptd": lambda: load_checkpoint(root, step, model, optimizer),
             "ckptd_memory": memory, "megatron": megatron}
    pool = ThreadPoolExecutor(POOL_THREADS)
    times: dict[str, list[float]] = {m: [] for m in modes}
    wrong: dict[str, list[str]] = {}  # per ckptd mode, the state entries that differ from the saved ones
    for i in range(repeats + 1):  # the first round is untimed (warms the page cache and the GPU)
        for mode, fn in modes.items():
            if mode.startswith("ckptd"):
                train_step(2 + i)  # untimed: the live state moves away from the saved one
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i:
                times[mode].append(time.perf_counter() - t0)
            if mode.startswith("ckptd") and i in (0, repeats):  # checked after the first and the last
                now = state_digests(model, optimizer)
                # Megatron's load (timed after the first check) adds a "step" to each param group, which a
                # ckptd load leaves: the groups are compared before it ran
                keys = sorted(set(saved) | set(now)) if i == 0 else [k for k in saved if "param_groups" not in k]
                wrong[mode] = wrong.get(mode, []) + [k for k in keys if saved.get(k) != now.get(k)][:5]
    pool.shutdown()
    med = {m: _med(v) for m, v in times.items()}
    out = {"bench": "gpu_load", "params": sum(p.numel() for c in model for p in c.parameters()),
           "bytes": sum(sizes), **{f"{m}_s": round(v, 4) for m, v in med.items()},
           "ratio_vs_raw_h2d": round(med["ckptd"] / med["raw_h2d"], 3),
           "ratio_vs_megatron": round(med["ckptd"] / med["megatron"], 3),
           "ratio_storage_over_memory": round(med["ckptd"] / med["ckptd_memory"], 2),
           "memory_restore_bytes": memory_bytes[0], "bit_exact_storage": wrong.get("ckptd") == [],
           "bit_exact_memory": wrong.get("ckptd_memory") == [], "differing": wrong}
    return out, step


def _rank(rank: int, world: int, socket_path: str, root: str, workdir: str, smoke: bool, repeats: int) -> list[dict]:
    from ckptd.client import CheckpointClient

    client = CheckpointClient(socket_path, timeout_s=600)
    rows: list[dict] = []
    step = 0

    def attempt(name: str, fn: Any, *args: Any) -> None:
        nonlocal step
        t0 = time.perf_counter()
        try:
            got, step = fn(client, *args, step)
        except Exception as exc:  # reported, not fatal: the other parts still run
            import traceback

            rows.append({"bench": name, "error": f"{type(exc).__name__}: {exc}"[:500],
                         "trace": traceback.format_exc()[-1500:]})
            print("# part failed:", json.dumps(rows[-1]), file=sys.stderr, flush=True)
            step += 1000
            return
        for row in got if isinstance(got, list) else [got]:
            rows.append({**row, "part_s": round(time.perf_counter() - t0, 1)})
            print("# part done:", json.dumps(rows[-1]), file=sys.stderr, flush=True)  # kept if a later part hangs

    if "plain" in _PARTS:
        attempt("gpu_stall", _plain, PLAIN_SMOKE if smoke else PLAIN, repeats)
    for name, cfg in [("gpt", GPT_SMOKE)] if smoke else [("gpt", GPT), ("deep", DEEP), ("wide", WIDE)]:
        if name in _PARTS:
            attempt("gpu_megatron_stall", _megatron_stall, workdir, cfg, repeats)
    if "load" in _PARTS:
        attempt("gpu_load", _load, root, workdir, GPT_SMOKE if smoke else GPT, max(1, repeats - 2))
    if not smoke and "deeper" in _PARTS:  # the longest part last
        attempt("gpu_megatron_stall", _megatron_stall, workdir, DEEPER, repeats)
    client.close()
    return rows


def bench_gpu(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    import torch
    from run import emit

    if not torch.cuda.is_available():
        return [emit({"bench": "gpu", "skipped": "no CUDA device"})]
    props = torch.cuda.get_device_properties(0)
    emit({"bench": "gpu_machine", "gpu": props.name, "gpu_memory_gib": round(props.total_memory / (1 << 30)),
          "torch": torch.__version__, "cuda": torch.version.cuda})
    shm = tempfile.mkdtemp(prefix="ckptd-gpu-", dir="/dev/shm")
    root = os.path.join(shm, "root")
    sock = os.path.join(args.sockets, "gpu.sock")
    arena = "256MiB" if args.smoke else "8GiB"
    daemon = DaemonProcess(root, sock, "--arena-size", arena, "--keep", "2",
                           log_path=os.path.join(workdir, "gpu-daemon.log"))
    try:
        daemon.wait_ready(300)
        rows = run_ranks(_rank, 1, sock, root, shm, args.smoke, 2 if args.smoke else 4, timeout_s=1800,
                         backend="nccl")[0]
    finally:
        daemon.stop(120)
        shutil.rmtree(shm, ignore_errors=True)
    return [emit(row) for row in rows]


BENCHES = {"gpu": bench_gpu}
ALIASES = {"gpu_stall": "gpu", "gpu_megatron_stall": "gpu", "gpu_load": "gpu"}
