"""ckptd benchmarks. Each one measures ckptd against a baseline in the same run and prints JSON lines.

    python benchmarks/run.py [--smoke] [--only NAME[,NAME]] [--root DIR] [--repeat N]

Benchmarks are not tests: they assert nothing about speed. ``--smoke`` runs tiny sizes (CI does this to
keep the code working); the full sizes are what ``docs/benchmarks.md`` reports.

The noisy figures (``merge``, ``s3_drain``) are measured ``--repeat`` times, each run alternating with its
baseline; their keys hold the median over the runs, with ``<key>_min``, ``<key>_max`` and ``runs`` beside.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ckptd.client import CheckpointClient, Placement, Shard  # noqa: E402
from ckptd.testing.launch import DaemonProcess, run_ranks, socket_dir  # noqa: E402

MiB = 1 << 20


def machine() -> dict[str, Any]:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "mem_gib": round(mem / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "kernel": platform.release()}


def emit(row: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(row), flush=True)
    return row


def runs(args: argparse.Namespace, full: int = 3) -> int:
    """How many times a repeated benchmark measures: ``--repeat``, else 1 at smoke size and ``full`` otherwise."""
    repeat: int | None = getattr(args, "repeat", None)
    return repeat if repeat else (1 if args.smoke else full)


def spread(key: str, values: Sequence[float], ndigits: int = 3) -> dict[str, float]:
    """``key`` (the median over the runs), ``key_min`` and ``key_max``, rounded, for a result row."""
    return {key: round(statistics.median(values), ndigits),
            f"{key}_min": round(min(values), ndigits), f"{key}_max": round(max(values), ndigits)}


def rss_sampler(pid: int) -> tuple[Callable[[], dict[str, int]], threading.Event]:
    """Poll /proc/PID/status every 10 ms; returns (peaks, stop). Peaks in bytes: ``anon``, ``file``, ``shmem``
    (RssAnon+RssFile = memory outside the shm arena) and ``hwm`` (VmHWM, the kernel's own peak RSS)."""
    fields = (("anon", "RssAnon:"), ("file", "RssFile:"), ("shmem", "RssShmem:"), ("hwm", "VmHWM:"))
    peaks = {key: 0 for key, _field in fields}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                with open(f"/proc/{pid}/status") as fh:
                    for line in fh:
                        for key, field in fields:
                            if line.startswith(field):
                                peaks[key] = max(peaks[key], int(line.split()[1]) * 1024)
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.01)

    threading.Thread(target=loop, daemon=True).start()
    return (lambda: dict(peaks)), stop


# --- ranks --------------------------------------------------------------------------------------


def _rank_stall(
    rank: int, world: int, socket_path: str, nbytes: int, repeats: int, raw_dir: str
) -> dict[str, list[float]]:
    """Per repeat: a bare copy of the same bytes into a pre-faulted buffer; ckptd's save() stall and drain
    (save until committed); then, alternating with the drain so both see the same device state, rank 0
    writes the whole step's bytes raw with fsync (the drain baseline)."""
    torch.manual_seed(rank)
    numel = nbytes // 4
    state = {"w": torch.randn(numel)}
    shard = {"w": Shard("w", state["w"], (numel * world,), (numel * rank,))}
    dst = torch.empty(numel)
    dst.fill_(1.0)  # pre-faulted
    client = CheckpointClient(socket_path, placement=Placement(rank, world, world, 0))
    memcpy, stall, drain, raw = [], [], [], []
    for i in range(repeats):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        dst.copy_(state["w"])
        memcpy.append(time.perf_counter() - t0)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        handle = client.save(i + 1, shard)
        stall.append(handle.stall_s)
        handle.wait(600)
        drain.append(time.perf_counter() - t0)
        torch.distributed.barrier()
        if rank == 0:
            raw.append(raw_write(os.path.join(raw_dir, "raw.bin"), nbytes * world))
        state["w"].add_(1.0)
    client.close()
    return {"memcpy": memcpy, "stall": stall, "drain": drain, "raw": raw}


def raw_write(path: str, nbytes: int, block: int = 16 * MiB) -> float:
    """Baseline: one sequential write of nbytes plus fsync, in one process."""
    buf = os.urandom(block)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(block, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


# --- benchmarks ---------------------------------------------------------------------------------


def bench_pipeline(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    """stall (save vs memcpy), drain (daemon vs raw write+fsync) and daemon RSS at two sizes 4x apart."""
    per_rank = (16 if args.smoke else 256) * MiB
    world = 2
    rows = []
    rss_rows = []
    for size in (per_rank // 4, per_rank):
        root = os.path.join(workdir, f"pipeline-{size // MiB}")
        sock = os.path.join(args.sockets, f"p{size // MiB}.sock")
        arena = f"{2 * world * size // MiB + 64}MiB"
        daemon = DaemonProcess(root, sock, "--arena-size", arena, log_path=os.path.join(workdir, "daemon.log"))
        daemon.wait_ready(120)
        peaks, stop = rss_sampler(daemon.pid)
        repeats = 2 if args.smoke else 5
        results = run_ranks(_rank_stall, world, sock, size, repeats, workdir, timeout_s=1800)
        stop.set()
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
        total = size * world
        raw = statistics.median(results[0]["raw"])
        memcpy = statistics.median(x for r in results for x in r["memcpy"])
        stall = statistics.median(x for r in results for x in r["stall"])
        drain = statistics.median(max(r["drain"][i] for r in results) for i in range(repeats))
        peak = peaks()
        rss_rows.append((size, peak))
        if size == per_rank:
            rows.append(emit({"bench": "stall", "ratio_vs_memcpy": round(stall / memcpy, 3),
                              "stall_s": round(stall, 4), "memcpy_s": round(memcpy, 4),
                              "stall_s_each": [[round(x, 4) for x in r["stall"]] for r in results],
                              "memcpy_s_each": [[round(x, 4) for x in r["memcpy"]] for r in results],
                              "bytes_per_rank": size, "ranks": world}))
            rows.append(emit({"bench": "drain", "ratio_vs_raw_write": round(raw / drain, 3),
                              "daemon_mib_s": round(total / drain / MiB, 1),
                              "raw_write_fsync_mib_s": round(total / raw / MiB, 1),
                              "bytes": total, "target": "local", "root_fs": _fs_type(workdir)}))
    (small, p_small), (big, p_big) = rss_rows
    outside_small = p_small["anon"] + p_small["file"]
    outside_big = p_big["anon"] + p_big["file"]
    rows.append(emit({"bench": "daemon_rss", "ratio_4x_data": round(outside_big / outside_small, 3),
                      "peak_outside_arena_mib": [round(outside_small / MiB, 1), round(outside_big / MiB, 1)],
                      "checkpoint_bytes": [small * world, big * world],
                      "arena_shmem_peak_mib": [round(p_small["shmem"] / MiB, 1), round(p_big["shmem"] / MiB, 1)]}))
    return rows


def _fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as fh:
        for line in fh:
            _dev, mnt, fstype, *_ = line.split()
            if os.path.abspath(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


BENCHES: dict[str, Callable[[argparse.Namespace, str], list[dict[str, Any]]]] = {
    "pipeline": bench_pipeline,
}
ALIASES = {"stall": "pipeline", "drain": "pipeline", "daemon_rss": "pipeline"}


def register_optional() -> None:
    """Benchmarks that need extras register themselves when their module imports."""
    for module in ("bench_megatron", "bench_merge", "bench_s3", "bench_s3_load", "bench_stall_scale", "bench_load",
                   "bench_staged_load", "bench_gpu", "bench_plain_many"):
        try:
            mod = __import__(module)
        except ImportError as exc:
            if exc.name != module:
                print(f"# {module} unavailable: {exc}", file=sys.stderr)
            continue
        BENCHES.update(mod.BENCHES)
        ALIASES.update(getattr(mod, "ALIASES", {}))


def main(argv: list[str] | None = None) -> int:
    register_optional()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the benchmarks run")
    parser.add_argument("--only", default="",
                        help=f"comma-separated subset of {sorted(BENCHES)} (or {sorted(ALIASES)})")
    parser.add_argument("--root", default=None,
                        help="working directory on the storage to measure, made if missing (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=None, metavar="N",
                        help="runs of each repeated benchmark (merge per size, s3_drain); reported as median, "
                             "min and max (default: 1 with --smoke, else 3 for merge and 5 for s3_drain)")
    args = parser.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        parser.error("--repeat must be at least 1")
    wanted = [ALIASES.get(n, n) for n in args.only.split(",") if n] or list(BENCHES)
    unknown = [n for n in wanted if n not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHES)}")
    if args.root is not None:
        os.makedirs(args.root, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="ckptd-bench-", dir=args.root)
    emit({"bench": "machine", **machine(), "smoke": args.smoke, "workdir_fs": _fs_type(workdir)})
    rows: list[dict[str, Any]] = []
    try:
        with socket_dir("ckptd-bench-") as args.sockets:  # the daemons' sockets: not under a deep --root
            for name in dict.fromkeys(wanted):
                print(f"bench {name}: running", file=sys.stderr, flush=True)
                began = time.perf_counter()
                rows += BENCHES[name](args, workdir)
                print(f"bench {name}: done in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(rows), file=sys.stderr)
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    """The headline figures as a Markdown table: every ratio, and every repeated figure that is not a time
    (times are in the JSON); a repeated one shows its median, min and max over ``runs``."""
    lines = ["", "| bench | figure | value (median) | min | max | runs |", "|---|---|---|---|---|---|"]
    for row in rows:
        label = row["bench"] + (f" ({row['model_params']:,} params)" if "model_params" in row else "")
        for key, value in row.items():
            if key.endswith(("_min", "_max")) or isinstance(value, (list, dict, str, bool)):
                continue
            repeated = f"{key}_min" in row
            if "ratio" in key or (repeated and not key.endswith("_s")):
                low, high = (row[f"{key}_min"], row[f"{key}_max"]) if repeated else ("", "")
                lines.append(f"| {label} | {key} | {value} | {low} | {high} | {row.get('runs', '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
