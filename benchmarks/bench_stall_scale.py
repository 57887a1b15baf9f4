"""Save stall against the number of tensors: ckptd's Megatron save vs a bare copy vs Megatron's own async save.

The same toy GPT (two gloo ranks, TP1 x DP2, CPU shim) at growing depth and shrinking width, so the
shards per rank grow from ~35 to ~10,000 while the bytes stay ~5-15 MB; per size, in the same processes:

- ``memcpy``: one contiguous copy of the bytes the rank stages, into a pre-faulted buffer, taken right before
  each timed save without the shim (checked and promised). Every save is waited on until committed, then
  the machine settles (``_settle``: ``sync``, a short pause) before the next copy and save, so the two find
  the daemon, the kernel and the caches alike (before 2026-12-03 15:45 all copies ran first, on a machine
  that had not yet saved anything);
- ``ckptd``: :func:`ckptd.client.megatron.save_checkpoint` after its first (planning) save, with the CPU
  shim's ``TorchFunctionMode`` taken off around the call (on a GPU there is no shim), median of the
  repeats; ``ckptd_with_shim_s`` is the same save with the shim on, to show the shim's share;
- ``ckptd_serial``: where the rank has a second core to itself (:func:`ckptd.client.staging.spare_core`; the
  default ``ckptd`` save then copies its static sources on a worker thread while its checks
  run), the same checked save with that copy made on the caller's thread before the checks, as where no core
  is spare, taking turns with it; NaN where none is (the default is that save already);
- ``ckptd_constant``: the same save with ``assume_constant_structure=True`` (no per-tensor checks, the
  staging space granted ahead, no wait for the daemon's answer), shim off; ``constant_with_shim_s`` with it on;
- ``memcpy_cold`` and ``ckptd_constant_cold``: the same copy and the same save under the promise, each
  after the CPU caches were pushed out (``_evict``). Back-to-back copies of ~10 MB find source and
  destination in the 32 MiB L3; a save in training follows a step that streamed through gigabytes, so
  neither its sources nor its staging space are cached. The cold pair compares like with like;
- ``megatron_dp_reshardable``: Megatron-LM's async ``dist_checkpointing.save`` (bench_megatron's code);
- ``ckptd_first_save``: the first save of the run, which plans (shards, layout, copy program, re-homing,
  the plan's registration with the daemon); the call only, shim off (with it on up to the run of 2026-12-02 21:59).

Stall: wall time of the call the training loop blocks on, slowest rank, median over repeats.
``overhead_us_per_shard`` is (stall - memcpy) / shards per rank.

Sizes: ``FULL`` by default, ``REDUCED`` with ``CKPTD_BENCH_REDUCED=1``, or any list with
``CKPTD_BENCH_STALL_SIZES=layers x hidden x heads,...`` (e.g. ``2x256x4,96x32x4``);
``CKPTD_BENCH_STALL_ARENA`` sets the daemon's arena (default 256MiB; wider models need more).
``CKPTD_BENCH_STALL_MEGATRON=0`` leaves out Megatron's own save (its fields are NaN);
``CKPTD_BENCH_STALL_REPEATS=N`` times N saves per variant instead of 5; ``CKPTD_BENCH_STALL_RANKS=N`` runs N
ranks (TP1 x DPN) instead of 2 (1 on the 2-core machine: a rank with a core to spare).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

from ckptd.testing.launch import DaemonProcess, run_ranks

# (layers, hidden, heads): ~35, ~500, ~1,500 and ~10,000 shards per rank
FULL = [(2, 256, 4), (32, 64, 4), (96, 32, 4), (700, 16, 2)]
REDUCED = [(2, 256, 4), (32, 64, 4), (96, 32, 4), (240, 16, 2)]
SMOKE = [(2, 64, 4)]


def _timed_saves(
    client: Any, model: Any, optimizer: Any, first_step: int, repeats: int, shim: bool, constant: bool = False,
    evict: Any = None, copy: Any = None, copies: list[float] | None = None,
) -> list[float]:
    """``repeats`` saves, each timed and waited on until committed. With ``copy``, each save is preceded by
    one timed bare copy (appended to ``copies``) under the same conditions: after the last save's commit and
    :func:`_settle`, the caches pushed out first where ``evict`` is given. So the copy and the save find the
    daemon, the kernel and the CPU caches alike, whatever the machine does meanwhile."""
    import torch.distributed as dist

    from ckptd.client.megatron import save_checkpoint
    from ckptd.testing.cpu_shim import suspended

    out = []
    for i in range(repeats):
        if copy is not None and copies is not None:
            if evict is not None:
                evict()
            dist.barrier()
            t0 = time.perf_counter()
            copy()
            copies.append(time.perf_counter() - t0)
        if evict is not None:
            evict()
        dist.barrier()
        step = first_step + i
        if shim:
            t0 = time.perf_counter()
            handle = save_checkpoint(client, step, model, optimizer, extra={"iteration": step},
                                     assume_constant_structure=constant)
            out.append(time.perf_counter() - t0)
        else:
            with suspended():
                t0 = time.perf_counter()
                handle = save_checkpoint(client, step, model, optimizer, extra={"iteration": step},
                                         assume_constant_structure=constant)
                out.append(time.perf_counter() - t0)
        handle.wait(1200)
        _settle()
    return out


def _settle() -> None:
    """Let the machine quiet down after a commit: the kernel's writeback and journal commit of what the step
    wrote and retention deleted, then the daemon's own work after a commit. The copy and the save timed next
    then find the machine alike; without this the first of them absorbs that background."""
    os.sync()
    time.sleep(SETTLE_S)


SETTLE_S = 0.2


def _rank(rank: int, world: int, socket_path: str, workdir: str, sizes: list[tuple[int, int, int]],
          repeats: int, megatron: bool) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from bench_megatron import _megatron_save

    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint
    from ckptd.client.megatron.staged import cached
    from ckptd.testing.cpu_shim import suspended
    from ckptd.testing.toy_gpt import build_gpt

    client = CheckpointClient(socket_path, timeout_s=600)
    rows = []
    step = 0
    for layers, hidden, heads in sizes:
        model, optimizer, train_step = build_gpt(hidden=hidden, layers=layers, heads=heads, vocab=128, seq=16,
                                                 micro_batch_size=1, global_microbatches=2)
        train_step(0)
        dist.barrier()
        step += 1
        with suspended():  # the planning save, shim off like the timed ones (on a GPU there is no shim)
            t0 = time.perf_counter()
            handle = save_checkpoint(client, step, model, optimizer, extra={"iteration": step})
            first = time.perf_counter() - t0
        handle.wait(1200)
        _settle()
        staged = cached(optimizer)
        assert staged is not None
        plan = staged.plan
        src = torch.empty(plan.nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty(plan.nbytes, dtype=torch.uint8).fill_(0)  # pre-faulted
        copy = functools.partial(dst.copy_, src)
        memcpy: list[float] = []  # the copies taken before the warm saves without shim, checked and promised
        memcpy_cold: list[float] = []
        threaded = client._staging.threaded
        stall: list[float] = []
        serial: list[float] = []  # the static copy on the caller's thread, before the checks (else not taken)
        for _ in range(repeats):  # taking turns with it
            stall += _timed_saves(client, model, optimizer, step + 1, 1, shim=False, copy=copy, copies=memcpy)
            step += 1
            if threaded:
                client._staging.threaded = False
                serial += _timed_saves(client, model, optimizer, step + 1, 1, shim=False, copy=copy, copies=memcpy)
                client._staging.threaded = True
                step += 1
        with_shim = _timed_saves(client, model, optimizer, step + 1, repeats, shim=True)
        step += repeats
        # the first save under the promise is a checked one that captures what the others read
        _timed_saves(client, model, optimizer, step + 1, 1, shim=False, constant=True)
        step += 1
        constant = _timed_saves(client, model, optimizer, step + 1, repeats, shim=False, constant=True, copy=copy,
                                copies=memcpy)
        step += repeats
        constant_shim = _timed_saves(client, model, optimizer, step + 1, repeats, shim=True, constant=True)
        step += repeats
        constant_cold = _timed_saves(client, model, optimizer, step + 1, repeats, shim=False, constant=True,
                                     evict=_evict, copy=copy, copies=memcpy_cold)
        step += repeats
        del src, dst, copy
        row: dict[str, Any] = {
            "layers": layers, "hidden": hidden, "shards": len(plan.metas), "copies": plan.copies,
            "bytes": plan.nbytes, "first": first, "memcpy": memcpy, "stall": stall, "with_shim": with_shim,
            "constant": constant, "constant_shim": constant_shim, "memcpy_cold": memcpy_cold,
            "constant_cold": constant_cold, "serial": serial, "threaded": threaded,
            "params": sum(p.numel() for c in model for p in c.parameters()),
        }
        if megatron:
            mega = _megatron_save(rank, model, optimizer, os.path.join(workdir, f"mega-{layers}"), "dp_reshardable",
                                  max(1, repeats - 1))
            row["megatron"] = mega["stall"]
        rows.append(row)
        del model, optimizer, train_step
    client.close()
    return rows


_junk: list[Any] = []


def _evict() -> None:
    """Push the CPU caches out (read and write 3x a 32 MiB L3): the state a save finds after a training step,
    which streams through far more than any cache holds."""
    import torch

    if not _junk:
        _junk.append(torch.ones(96 << 20, dtype=torch.uint8))
    _junk[0].add_(1)


def _parse_sizes(text: str) -> list[tuple[int, int, int]]:
    """``"2x256x4,96x32x4"`` -> ``[(2, 256, 4), (96, 32, 4)]`` (layers x hidden x heads)."""
    out = []
    for item in text.split(","):
        layers, hidden, heads = (int(n) for n in item.strip().split("x"))
        out.append((layers, hidden, heads))
    return out


def _slowest(results: list[list[dict[str, Any]]], i: int, field: str) -> float:
    n = len(results[0][i][field])
    return float(statistics.median(max(r[i][field][k] for r in results) for k in range(n)))


def bench_stall_scale(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    from run import emit

    reduced = os.environ.get("CKPTD_BENCH_REDUCED") == "1"
    chosen = os.environ.get("CKPTD_BENCH_STALL_SIZES", "")
    sizes = SMOKE if args.smoke else _parse_sizes(chosen) if chosen else REDUCED if reduced else FULL
    repeats = 2 if args.smoke else int(os.environ.get("CKPTD_BENCH_STALL_REPEATS", "5"))
    world = int(os.environ.get("CKPTD_BENCH_STALL_RANKS", "2"))
    root = os.path.join(workdir, "stall-scale")
    sock = os.path.join(args.sockets, "stall-scale.sock")
    arena = os.environ.get("CKPTD_BENCH_STALL_ARENA", "256MiB")  # wider models (chosen sizes) need more
    daemon = DaemonProcess(root, sock, "--arena-size", arena, "--keep", "1",
                           log_path=os.path.join(workdir, "stall-scale-daemon.log"))
    try:
        daemon.wait_ready(300)
        megatron = os.environ.get("CKPTD_BENCH_STALL_MEGATRON", "1") != "0"
        results = run_ranks(_rank, world, sock, workdir, sizes, repeats, megatron, timeout_s=7200)
    finally:
        daemon.stop(120)
    rows = []
    for i, (layers, hidden, _heads) in enumerate(sizes):
        shards = max(r[i]["shards"] for r in results)
        stall = _slowest(results, i, "stall")
        memcpy = _slowest(results, i, "memcpy")
        shim = _slowest(results, i, "with_shim")
        mega = _slowest(results, i, "megatron") if "megatron" in results[0][i] else float("nan")
        serial = _slowest(results, i, "serial") if results[0][i]["serial"] else float("nan")
        const = _slowest(results, i, "constant")
        const_shim = _slowest(results, i, "constant_shim")
        memcpy_cold = _slowest(results, i, "memcpy_cold")
        const_cold = _slowest(results, i, "constant_cold")
        rows.append(emit({
            "bench": "stall_scale",
            "layers": layers,
            "hidden": hidden,
            "shards_per_rank": shards,
            "copies_per_rank": max(r[i]["copies"] for r in results),
            "bytes_per_rank": max(r[i]["bytes"] for r in results),
            "ckptd_s": round(stall, 5),
            "memcpy_s": round(memcpy, 5),
            "ratio_vs_memcpy": round(stall / memcpy, 3),
            "overhead_us_per_shard": round((stall - memcpy) / shards * 1e6, 2),
            "static_copy_threaded": all(r[i]["threaded"] for r in results),
            "ckptd_serial_s": round(serial, 5),
            "serial_ratio_vs_memcpy": round(serial / memcpy, 3),
            "ckptd_with_shim_s": round(shim, 5),
            "shim_share": round(max(0.0, shim - stall) / shim, 3),
            "ckptd_constant_s": round(const, 5),
            "constant_ratio_vs_memcpy": round(const / memcpy, 3),
            "constant_overhead_us_per_shard": round((const - memcpy) / shards * 1e6, 2),
            "constant_with_shim_s": round(const_shim, 5),
            "constant_shim_share": round(max(0.0, const_shim - const) / const_shim, 3),
            "memcpy_cold_s": round(memcpy_cold, 5),
            "ckptd_constant_cold_s": round(const_cold, 5),
            "constant_cold_ratio_vs_memcpy_cold": round(const_cold / memcpy_cold, 3),
            "constant_cold_overhead_us_per_shard": round((const_cold - memcpy_cold) / shards * 1e6, 2),
            "megatron_dp_reshardable_s": round(mega, 4),
            "ratio_megatron_over_ckptd": round(mega / stall, 1),
            "ckptd_first_save_s": round(max(r[i]["first"] for r in results), 4),
            "ranks": world,
            "sizes": "smoke" if args.smoke else "chosen" if chosen else "reduced" if reduced else "full",
        }))
    return rows


BENCHES = {"stall_scale": bench_stall_scale}
