"""Where a warm load's time goes: bench_load's paths at a reduced size, timed and profiled (a dev tool).

    PYTHONPATH=... python benchmarks/profile_load.py [--size LAYERSxHIDDENxHEADSxVOCAB] [--repeats N] [--prof DIR]
        [--chunk-bytes 4MiB]

Saves once through a daemon (TP1 x DP2, fp32, bench_load's ``_save``), then in new ranks: the raw parallel
read of the step's files (into one reused buffer, and into place as bench_load's ``raw_place``), ckptd's
same-layout load from storage and the in-memory restore, both warm, the storage load cold (the step's
files evicted with ``POSIX_FADV_DONTNEED``, nothing else), the warm load into an optimizer without state
(``fresh``: its states cleared before each load, as a resumed job's before its first step: the load
allocates them, and on a CPU every page of the new memory is faulted in), then the merge-free loads at TP2 x DP1 and at
TP1 x DP2 with other grad-buffer buckets (3M elements: the slice edges cut params); slowest rank, median of
``--repeats``; the growth of each rank's peak RSS in a warm load (the largest rank's, through
``/proc/self/clear_refs``) and the bytes that load read from storage (``*_read_mib``, the largest rank's).
With ``--prof`` rank 0 writes one cProfile per mode (``<mode>.prof``) after the timed runs. The CPU shim's
``TorchFunctionMode`` is taken off around ckptd's calls, as bench_load does (on a GPU there is no shim).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
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

from bench_load import STEP, _save, raw_readers  # noqa: E402
from bench_megatron import _gpt_params  # noqa: E402

from ckptd.testing.launch import DaemonProcess, run_ranks, socket_dir  # noqa: E402

MiB = 1 << 20
OTHER_BUCKETS = {"overlap_grad_reduce": True, "bucket_size": 3_000_000}  # the saving run: one bucket a buffer


def _rank(rank: int, world: int, workdir: str, cfg: dict[str, Any], modes: list[str], repeats: int,
          sock: str, prof: str) -> dict[str, list[float]]:
    import torch.distributed as dist

    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import load_checkpoint
    from ckptd.testing.cpu_shim import suspended
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(seed=4321, data_seed=1234, **cfg)
    train_step(0)
    root = os.path.join(workdir, "load-ckptd")
    files = sorted(os.path.join(d, f) for d, _s, fs in os.walk(os.path.join(root, f"step_{STEP}")) for f in fs)
    raw_read, raw_place = raw_readers(root, rank, world)
    client = CheckpointClient(sock, timeout_s=600) if "memory" in modes else None

    def ckptd() -> None:
        with suspended():
            load_checkpoint(root, STEP, model, optimizer)

    def memory() -> None:
        with suspended():
            loaded = load_checkpoint(client, STEP, model, optimizer)  # type: ignore[arg-type]
        if loaded.from_memory_bytes == 0:
            raise RuntimeError("nothing came from memory")

    def evict() -> None:  # this step's files only (the machine is shared): clean pages, fsynced at save
        if rank == 0:
            for path in files:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        dist.barrier()

    def cold() -> None:
        ckptd()  # timed: the caller evicted before

    def clear_states() -> None:  # a resumed job before its first step: the optimizer has no state yet
        from ckptd.client.megatron.layout import bind, get_layout
        from ckptd.client.megatron.staged import inner_optimizers

        for inner in inner_optimizers(bind(optimizer, get_layout(model, optimizer))):
            inner.state.clear()

    def fresh() -> None:
        ckptd()  # timed: the caller cleared the optimizer's states before, so the load makes them anew

    run = {"raw_read": raw_read, "raw_place": raw_place, "ckptd": ckptd, "memory": memory, "cold": cold,
           "fresh": fresh}
    out: dict[str, list[float]] = {}
    phases = _time_phases()
    reads = _count_reads()
    for mode in modes:
        run[mode]()  # warm the page cache (and the destination tensors: the first load re-homes Adam's states)
        before = _rss_reset_peak()
        reads.clear()
        run[mode]()
        out[f"{mode}:peak_growth_mib"] = [(_status_kib("VmHWM") - before) / 1024]
        out[f"{mode}:read_mib"] = [sum(reads) / MiB]  # ckptd's chunk reads from storage in that load
        times, cpu = [], []
        for _ in range(repeats):
            dist.barrier()
            if mode == "cold":
                evict()
            if mode == "fresh":
                clear_states()
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            run[mode]()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out[mode] = times
        out[f"{mode}:cpu_s"] = [statistics.median(cpu)]  # the process's CPU time, all its threads, user + system
        for name, spent in phases.items():
            out[f"{mode}:{name}"] = [statistics.median(spent[-repeats:])] if spent else [0.0]
            spent.clear()
        if prof and rank == 0 and mode not in ("raw_read", "raw_place", "cold", "fresh"):
            pr = cProfile.Profile()
            pr.enable()
            run[mode]()
            pr.disable()
            tag = ("_tp" + str(cfg["tp"]) if cfg.get("tp") else "") + ("_buckets" if cfg.get("bucket_size") else "")
            pr.dump_stats(os.path.join(prof, f"{mode}{tag}.prof"))
        dist.barrier()
    if client is not None:
        client.close()
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def _rss_reset_peak() -> int:
    """Reset this process's peak RSS (``VmHWM``) to its RSS now, which it returns (KiB)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5\n")
    return _status_kib("VmRSS")


def _count_reads() -> list[int]:
    """Count ckptd's reads of stored chunks from a local root: each read's bytes (a chunk is read whole, with
    its crc32c trailer, however little of it a load places), appended by the read pool's threads."""
    from ckptd.client import fastread
    from ckptd.client.chunkio import CRC_BYTES, Job

    sizes: list[int] = []
    read = fastread.read_local

    def counted(path: str, job: Job) -> None:
        sizes.append(job.chunk.nbytes + CRC_BYTES)
        read(path, job)

    fastread.read_local = counted
    return sizes


def _time_phases() -> dict[str, list[float]]:
    """Wrap the load's steps (as ``load.py`` calls them) in timers; returns their durations, by name."""
    import functools
    import inspect

    from ckptd.client.megatron import load

    spent: dict[str, list[float]] = {}
    for name in ("read_flat_async", "fill_async", "apply_optimizer_state", "drop_unsaved_state",
                 "plan_dp_slices", "plan_merged_slices", "plan_reads", "arena_source", "get_layout",
                 "optimizer_regions",
                 "plan_rank_state", "model_template", "decode_layout", "slice_targets", "run_sync",
                 "load_checkpoint_async", "open_root"):
        fn = getattr(load, name, None)
        if fn is None:
            continue
        spent[name] = []

        def wrap(fn: Any, into: list[float]) -> Any:
            if inspect.iscoroutinefunction(fn):
                @functools.wraps(fn)
                async def timed_async(*a: Any, **k: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return await fn(*a, **k)
                    finally:
                        into.append(time.perf_counter() - t0)
                return timed_async

            @functools.wraps(fn)
            def timed(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    into.append(time.perf_counter() - t0)
            return timed

        setattr(load, name, wrap(fn, spent[name]))
    from ckptd.client.fastread import ChunkReader

    spent["ChunkReader.run"] = []
    ChunkReader.run = wrap(ChunkReader.run, spent["ChunkReader.run"])  # type: ignore[method-assign]
    return spent


def _slowest(results: list[dict[str, list[float]]], mode: str) -> float:
    n = min(len(r[mode]) for r in results)
    return round(float(statistics.median(max(r[mode][i] for r in results) for i in range(n))), 4)


def _largest(results: list[dict[str, list[float]]], key: str, digits: int = 1) -> float:
    return round(max(r[key][0] for r in results), digits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="4x512x8x32768", help="layers x hidden x heads x vocab")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prof", default="")
    parser.add_argument("--root", default=None)
    parser.add_argument("--chunk-bytes", default="", help="the daemon's largest chunk (default: its own, 16MiB)")
    args = parser.parse_args()
    layers, hidden, heads, vocab = (int(x) for x in args.size.split("x"))
    cfg = {"hidden": hidden, "layers": layers, "heads": heads, "vocab": vocab, "seq": 64, "micro_batch_size": 1}
    if args.prof:
        os.makedirs(args.prof, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="ckptd-profload-", dir=args.root)
    root = os.path.join(workdir, "load-ckptd")
    arena_mib = int(_gpt_params(cfg) * 16 / MiB * 1.2) + 64
    chunks = ["--chunk-bytes", args.chunk_bytes] if args.chunk_bytes else []
    try:
        with socket_dir() as sockets:
            sock = os.path.join(sockets, "load.sock")
            daemon = DaemonProcess(root, sock, "--arena-size", f"{arena_mib}MiB", "--keep", "1", *chunks,
                                   log_path=os.path.join(workdir, "daemon.log"))
            try:
                daemon.wait_ready(300)
                saved = run_ranks(_save, 2, sock, workdir, cfg, timeout_s=3600)
                modes = ["raw_read", "raw_place", "ckptd", "memory", "cold", "fresh"]
                same = run_ranks(_rank, 2, workdir, cfg, modes, args.repeats, sock, args.prof, timeout_s=3600)
            finally:
                daemon.stop(120)
        tp = run_ranks(_rank, 2, workdir, {**cfg, "tp": 2}, ["ckptd"], args.repeats, sock, args.prof,
                       timeout_s=3600)
        # the same TP/DP with other grad-buffer buckets: merge-free, and at DP 2 the slice edges cut params
        buckets = run_ranks(_rank, 2, workdir, {**cfg, **OTHER_BUCKETS}, ["ckptd"], args.repeats, sock, args.prof,
                            timeout_s=3600)
    finally:  # a full-size checkpoint is GBs: never leave one behind
        shutil.rmtree(workdir, ignore_errors=True)
    row = {"bench": "profile_load", "size": args.size, "params": saved[0]["params"],
           "raw_read_warm_s": _slowest(same, "raw_read"),
           "raw_place_warm_s": _slowest(same, "raw_place"), "ckptd_warm_s": _slowest(same, "ckptd"),
           "memory_restore_s": _slowest(same, "memory"), "other_tp_warm_s": _slowest(tp, "ckptd"),
           "other_buckets_warm_s": _slowest(buckets, "ckptd"),
           # the growth of the rank's peak RSS in a warm load (the largest rank's): what a load allocates beyond
           # the live model and optimizer
           "same_peak_growth_mib": _largest(same, "ckptd:peak_growth_mib"),
           "other_tp_peak_growth_mib": _largest(tp, "ckptd:peak_growth_mib"),
           "other_buckets_peak_growth_mib": _largest(buckets, "ckptd:peak_growth_mib"),
           # what one warm load read from storage (the largest rank's): chunks are read and checked whole
           "same_read_mib": _largest(same, "ckptd:read_mib"), "other_tp_read_mib": _largest(tp, "ckptd:read_mib"),
           "other_buckets_read_mib": _largest(buckets, "ckptd:read_mib")}
    row["ratio_ckptd_vs_raw_warm"] = round(row["ckptd_warm_s"] / row["raw_read_warm_s"], 3)
    row["ratio_ckptd_vs_raw_place_warm"] = round(row["ckptd_warm_s"] / row["raw_place_warm_s"], 3)
    row["ratio_other_tp_vs_same_warm"] = round(row["other_tp_warm_s"] / row["ckptd_warm_s"], 3)
    row["ratio_other_buckets_vs_same_warm"] = round(row["other_buckets_warm_s"] / row["ckptd_warm_s"], 3)
    row["ckptd_cold_s"] = _slowest(same, "cold")
    row["ratio_cold_over_memory"] = round(row["ckptd_cold_s"] / row["memory_restore_s"], 3)
    row["ckptd_fresh_states_s"] = _slowest(same, "fresh")
    row["ratio_fresh_states_vs_same_warm"] = round(row["ckptd_fresh_states_s"] / row["ckptd_warm_s"], 3)
    # CPU time a rank spent in a warm load (the larger rank's median, all threads): with both ranks on two
    # cores, where the wall time cannot fall below it
    for mode in ("raw_place", "ckptd", "memory"):
        row[f"{mode}_cpu_s"] = _largest(same, f"{mode}:cpu_s", 4)
    print(json.dumps(row), flush=True)
    for label, results in (("same", same), ("tp2", tp), ("buckets", buckets)):
        for r, res in enumerate(results):
            print(label, r, {k: round(v[0], 4) for k, v in res.items() if ":" in k and v[0] > 0.0005})


if __name__ == "__main__":
    main()
