"""Resume: ckptd's load versus Megatron's own ``dist_checkpointing.load``, on the same model, in one run.

One training run (TP1 x DP2, fp32) saves the same state twice: through ckptd (daemon, ``save_checkpoint``)
and with Megatron's ``dist_checkpointing.save`` (``dp_reshardable``, synchronous). Then, per mode, cold
(page cache dropped) and warm, the slowest rank's time until model and optimizer hold the state:

- ``megatron``: ``dist_checkpointing.load`` of its dp_reshardable checkpoint + ``load_state_dict``;
- ``ckptd``: ``load_checkpoint`` at the saving layout (TP1 x DP2);
- ``ckptd_fresh``: the same into an optimizer without state (its states cleared before each load, untimed),
  as a resumed job's is before its first step: the load allocates the states, and on a CPU every page of
  that new memory is faulted in during the read (on a GPU the states are device memory);
- ``ckptd_other_dp``: ``load_checkpoint`` on one rank (DP 2 -> 1), from the DP layout;
- ``ckptd_other_tp``: ``load_checkpoint`` at TP2 x DP1, merge-free (straight from the DP bucket slices);
- ``raw_place``: a plain parallel ``readinto`` of ckptd's files of the step (split over the ranks), each
  file into its own part of one pre-faulted buffer of the rank's bytes — what any loader of those bytes
  must at least do, since every byte needs a home of its own;
- ``raw_read``: the same reads into one reused buffer of the largest file's size (the baseline up to
  2026-12-02): its destination stays in the CPU cache, which no load's can, so the warm ratio against it
  measures the cache as much as the loader;
- ``raw_plain``: each file of the rank's share read with a plain ``read()`` (a new ``bytes`` each, dropped):
  the raw read as issue 10 measured it ("plain ``read()`` of ckptd's files, split over the 2 ranks").

``CKPTD_BENCH_LOAD_RANKS=1`` saves and loads on one rank (TP1 x DP1): on the 2-core machine a rank with a
core to spare, whose load's read threads do not share the rank's core with another rank, while each raw
baseline stays one reading thread a rank, as the issue's. The other-DP and other-TP loads need two ranks to
compare with: that run leaves them out (their keys are None).

The modes take turns: each repeat (5; 1 at smoke size) runs every mode once, in order, so a change of this
noisy machine's speed during the run reaches every mode alike; Megatron's repeats follow (its
``load_state_dict`` replaces the optimizer's state tensors, so a ckptd load right after it would read into
new memory); the warm repeats follow one untimed run of each mode. Times are the slowest rank's, median
over the repeats.

ckptd's loads run with the CPU shim's ``TorchFunctionMode`` taken off (``cpu_shim.suspended``, as
bench_stall_scale's saves: on a GPU there is no shim); Megatron's load needs the shim and keeps it.

The row carries every ratio the issue sets a target for and ``targets_met`` (each against its bound):
same layout vs Megatron (<= 1, cold and warm), vs the raw read into place, into the reused buffer and by
plain ``read()`` (<= 1.25 each), merge-free other TP vs same
layout (<= 1.5), cold storage load over in-memory restore (>= 5); ``ratio_other_dp_vs_same`` and the
fresh-state load against the same layout's and Megatron's (``ratio_fresh_vs_same``, ``ratio_fresh_vs_megatron``)
are reported too.

Cold: ``echo 3 > /proc/sys/vm/drop_caches`` where permitted (root outside a container); otherwise every
file of both checkpoints is evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (clean pages only: the
checkpoints are fsynced), and the row says which (``cold_method``). ``memory_restore``: new ranks load
through a client of the daemon, which still holds the step in its arena (the shm is not dropped by a
cache drop: "cold" there only means the commit manifest comes from disk); ``memory_restore_bytes`` says
how much came from memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from ckptd.testing.launch import DaemonProcess, run_ranks

MiB = 1 << 20
FULL = {"hidden": 1024, "layers": 8, "heads": 16, "vocab": 32768, "seq": 64, "micro_batch_size": 1}
SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 128, "seq": 16}
STEP = 1


def drop_caches(paths: list[str]) -> str:
    """Evict the checkpoints from the page cache; returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for top in paths:
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "fadvise_dontneed"


# --- rank side -----------------------------------------------------------------------------------
def _sharded(model: list[Any], optimizer: Any, loading: bool) -> dict[str, Any]:
    from megatron.core.utils import unwrap_model

    model_sd = unwrap_model(model[0]).sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                            metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return {"model": model_sd, "optimizer": optim_sd}


def _save(rank: int, world: int, socket_path: str, workdir: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(**cfg)
    train_step(0)
    client = CheckpointClient(socket_path, timeout_s=600)
    save_checkpoint(client, STEP, model, optimizer, extra={"iteration": STEP}).wait(1200)
    client.close()
    mdir = os.path.join(workdir, "load-megatron")
    if rank == 0:
        os.makedirs(mdir, exist_ok=True)
    dist.barrier()
    megatron_ok = ""
    try:
        dist_checkpointing.save(_sharded(model, optimizer, False), mdir,
                                content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    except Exception as exc:  # reported, not fatal: the other modes still run
        megatron_ok = f"{type(exc).__name__}: {exc}"[:300]
    dist.barrier()
    return {"params": sum(p.numel() for c in model for p in c.parameters()), "megatron_save_error": megatron_ok}


def raw_readers(root: str, rank: int, world: int, step: int = STEP) -> tuple[Callable[[], None], Callable[[], None]]:
    """The two raw baselines of this rank's share of the step's files (every ``world``-th, from ``rank``):
    each file into one reused buffer of the largest file's size, and each into its own part of one
    pre-faulted buffer of all of them (every byte a home of its own, as a load's)."""
    import torch

    files = sorted(os.path.join(d, f) for d, _s, fs in os.walk(os.path.join(root, f"step_{step}")) for f in fs)
    mine = files[rank::world]
    sizes = [os.path.getsize(f) for f in mine]
    buf = torch.empty(max(sizes, default=1), dtype=torch.uint8)
    place = torch.ones(max(sum(sizes), 1), dtype=torch.uint8)  # pre-faulted, as a live model's memory is

    def reused() -> None:
        view = memoryview(buf.numpy())
        for path, n in zip(mine, sizes, strict=True):
            with open(path, "rb", buffering=0) as fh:
                fh.readinto(view[:n])

    def into_place() -> None:
        view, at = memoryview(place.numpy()), 0
        for path, n in zip(mine, sizes, strict=True):
            with open(path, "rb", buffering=0) as fh:
                fh.readinto(view[at : at + n])
            at += n

    return reused, into_place


def plain_reader(root: str, rank: int, world: int) -> Callable[[], None]:
    """The rank's share of the step's files (as :func:`raw_readers`), each read with a plain ``read()``."""
    files = sorted(os.path.join(d, f) for d, _s, fs in os.walk(os.path.join(root, f"step_{STEP}")) for f in fs)
    mine = files[rank::world]

    def plain() -> None:
        for path in mine:
            with open(path, "rb", buffering=0) as fh:
                fh.read()

    return plain


def _timed(rank: int, world: int, workdir: str, cfg: dict[str, Any], modes: list[str], repeats: int,
           cold_paths: list[str], socket_path: str = "") -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ckptd.client.megatron import load_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(seed=4321, data_seed=1234, **cfg)
    train_step(0)  # live optimizer state exists (as in a restarted job before its load)
    root = os.path.join(workdir, "load-ckptd")
    raw_read, raw_place = raw_readers(root, rank, world)
    out: dict[str, Any] = {"cold_method": ""}

    def megatron_load() -> None:
        from megatron.core import dist_checkpointing
        from megatron.core.utils import unwrap_model

        with torch.no_grad():  # the loaded tensors replace params in place
            state = dist_checkpointing.load(_sharded(model, optimizer, True), os.path.join(workdir, "load-megatron"))
            unwrap_model(model[0]).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

    from ckptd.client import CheckpointClient

    # a restarted trainer connects to its daemon once (it saves through it); the load is what is timed
    client = CheckpointClient(socket_path, timeout_s=600) if "memory" in modes else None

    from ckptd.testing.cpu_shim import suspended

    def memory_load() -> None:
        with suspended():
            loaded = load_checkpoint(client, STEP, model, optimizer)
        out["memory_bytes"] = loaded.from_memory_bytes

    def ckptd_load() -> None:
        with suspended():
            load_checkpoint(root, STEP, model, optimizer)

    def clear_states() -> None:
        from ckptd.client.megatron.layout import bind, get_layout
        from ckptd.client.megatron.staged import inner_optimizers

        for inner in inner_optimizers(bind(optimizer, get_layout(model, optimizer))):
            inner.state.clear()

    run = {"ckptd": ckptd_load, "ckptd_fresh": ckptd_load, "raw_read": raw_read, "raw_place": raw_place,
           "megatron": megatron_load, "memory": memory_load, "raw_plain": plain_reader(root, rank, world)}
    untimed = {"ckptd_fresh": clear_states}  # what a mode needs done before each of its runs
    failed: set[str] = set()

    def attempt(mode: str) -> float | None:
        """One run of ``mode``, timed; None once it has failed (its first error is in the row)."""
        if mode in failed:
            return None
        if mode in untimed:
            untimed[mode]()
            dist.barrier()
        t0 = time.perf_counter()
        try:
            run[mode]()
        except Exception as exc:
            out[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            failed.add(mode)
            return None
        return time.perf_counter() - t0

    # the modes take turns within each repeat (A B C, A B C, ...): a drift of this noisy machine's speed during
    # the run moves every mode alike instead of the modes timed last. Megatron's repeats come after the
    # others': its load_state_dict replaces the optimizer's state tensors, and a ckptd load (or restore)
    # after it would then read into new memory (page faults) instead of the states it installed before
    turns = [[m for m in modes if m != "megatron"]] + ([["megatron"]] if "megatron" in modes else [])
    for temp in ("cold", "warm"):
        for group in turns:
            for mode in group:
                out[f"{mode}_{temp}"] = []
                if temp == "warm":  # untimed: the last cold run left the page cache (and the CPU caches) cold
                    dist.barrier()
                    attempt(mode)
            for _ in range(repeats):
                for mode in group:
                    dist.barrier()
                    if temp == "cold" and rank == 0:
                        out["cold_method"] = drop_caches(cold_paths)
                    dist.barrier()
                    took = attempt(mode)
                    if took is not None:
                        out[f"{mode}_{temp}"].append(took)
    dist.barrier()
    if client is not None:
        client.close()
    return out


# --- parent --------------------------------------------------------------------------------------
def _slowest(results: list[dict[str, Any]], key: str) -> float | None:
    if any(not r.get(key) for r in results):
        return None
    n = min(len(r[key]) for r in results)
    return round(float(statistics.median(max(r[key][i] for r in results) for i in range(n))), 6)


def bench_load(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    from run import emit

    cfg = dict(SMOKE if args.smoke else FULL)
    repeats = 1 if args.smoke else 5
    world = int(os.environ.get("CKPTD_BENCH_LOAD_RANKS", "2"))
    from bench_megatron import _gpt_params

    arena_mib = int(_gpt_params(cfg) * 16 / MiB * 1.2) + 64
    root = os.path.join(workdir, "load-ckptd")
    sock = os.path.join(args.sockets, "load.sock")
    daemon = DaemonProcess(root, sock, "--arena-size", f"{arena_mib}MiB", "--keep", "1",
                           log_path=os.path.join(workdir, "load-daemon.log"))
    paths = [root, os.path.join(workdir, "load-megatron")]
    try:
        daemon.wait_ready(300)
        saved = run_ranks(_save, world, sock, workdir, cfg, timeout_s=3600)
        # new ranks (the savers are gone); the daemon still holds the step: in-memory restore is measured too
        modes = ["raw_read", "raw_place", "raw_plain", "ckptd", "ckptd_fresh", "megatron", "memory"]
        same = run_ranks(_timed, world, workdir, cfg, modes, repeats, paths, sock, timeout_s=3600)
    finally:
        daemon.stop(120)
    # another DP (2 -> 1) and another TP (1 -> 2 at DP1, merge-free) against the same layout on as many ranks;
    # a one-rank run has no like to compare them with (its ratios are left out)
    other_dp = other_tp = [{} for _ in range(world)]
    if world == 2:
        other_dp = run_ranks(_timed, 1, workdir, cfg, ["ckptd"], repeats, paths, timeout_s=3600)
        other_tp = run_ranks(_timed, 2, workdir, {**cfg, "tp": 2}, ["ckptd"], repeats, paths, timeout_s=3600)
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(os.path.join(root, f"step_{STEP}"))
                 for f in fs)
    row: dict[str, Any] = {"bench": "load", "model_params": saved[0]["params"], "ranks": world,
                           "checkpoint_bytes": nbytes, "cold_method": same[0]["cold_method"], "runs": repeats}
    for temp in ("cold", "warm"):
        raw = _slowest(same, f"raw_read_{temp}")
        place = _slowest(same, f"raw_place_{temp}")
        plain = _slowest(same, f"raw_plain_{temp}")
        ck = _slowest(same, f"ckptd_{temp}")
        mg = _slowest(same, f"megatron_{temp}")
        dp = _slowest(other_dp, f"ckptd_{temp}")
        tp = _slowest(other_tp, f"ckptd_{temp}")
        mem = _slowest(same, f"memory_{temp}")
        fresh = _slowest(same, f"ckptd_fresh_{temp}")
        row[f"ckptd_fresh_{temp}_s"] = fresh
        if fresh and ck:
            row[f"ratio_fresh_vs_same_{temp}"] = round(fresh / ck, 3)
        if fresh and mg:
            row[f"ratio_fresh_vs_megatron_{temp}"] = round(fresh / mg, 3)
        row.update({f"raw_place_{temp}_s": place, f"raw_read_{temp}_s": raw, f"raw_plain_{temp}_s": plain,
                    f"ckptd_{temp}_s": ck,
                    f"megatron_{temp}_s": mg,
                    f"ckptd_other_dp_{temp}_s": dp, f"ckptd_other_tp_{temp}_s": tp, f"memory_restore_{temp}_s": mem})
        if ck and place:
            row[f"ratio_ckptd_vs_raw_place_{temp}"] = round(ck / place, 3)
        if ck and raw:
            row[f"ratio_ckptd_vs_raw_{temp}"] = round(ck / raw, 3)
        if ck and plain:
            row[f"ratio_ckptd_vs_raw_plain_{temp}"] = round(ck / plain, 3)
        if ck and mg:
            row[f"ratio_ckptd_vs_megatron_{temp}"] = round(ck / mg, 3)
        if ck and tp:
            row[f"ratio_other_tp_vs_same_{temp}"] = round(tp / ck, 3)
        if ck and dp:
            row[f"ratio_other_dp_vs_same_{temp}"] = round(dp / ck, 3)
    errors = {k: v for r in [*saved, *same, *other_dp, *other_tp] for k, v in r.items() if k.endswith("_error") and v}
    if errors:
        row["errors"] = errors
    cold = row.get("ckptd_cold_s")
    if cold and row.get("memory_restore_warm_s"):
        row["ratio_cold_storage_over_memory"] = round(cold / row["memory_restore_warm_s"], 2)
    row["memory_restore_bytes"] = sum(r.get("memory_bytes", 0) for r in same)
    row["targets_met"] = _targets(row)
    return [emit(row)]


# issue 10's targets: (ratio, bound, at most or at least)
TARGETS = [("ratio_ckptd_vs_megatron_cold", 1.0, "max"), ("ratio_ckptd_vs_megatron_warm", 1.0, "max"),
           ("ratio_ckptd_vs_raw_place_cold", 1.25, "max"), ("ratio_ckptd_vs_raw_place_warm", 1.25, "max"),
           ("ratio_ckptd_vs_raw_cold", 1.25, "max"), ("ratio_ckptd_vs_raw_warm", 1.25, "max"),
           ("ratio_ckptd_vs_raw_plain_cold", 1.25, "max"), ("ratio_ckptd_vs_raw_plain_warm", 1.25, "max"),
           ("ratio_other_tp_vs_same_cold", 1.5, "max"), ("ratio_other_tp_vs_same_warm", 1.5, "max"),
           ("ratio_cold_storage_over_memory", 5.0, "min")]


def _targets(row: dict[str, Any]) -> dict[str, bool | None]:
    """Each target ratio of the row against its bound (None where the ratio is missing)."""
    out: dict[str, bool | None] = {}
    for key, bound, kind in TARGETS:
        value = row.get(key)
        out[key] = None if value is None else (value <= bound if kind == "max" else value >= bound)
    return out


BENCHES = {"load": bench_load}
