"""S3 drain benchmark: daemon throughput to an S3 server vs a raw s3fs put of the same bytes, same endpoint.

A moto S3 server runs on 127.0.0.1 in its own process (``ckptd.testing.s3server``). Two gloo ranks save
``per_rank`` bytes each through a ``ckptd serve --root s3://...`` daemon; the drain is the time from the
first ``save()`` to the commit. Baseline in the same run: one process putting the same number of bytes,
as objects of the daemon's chunk size with the daemon's concurrency, through a plain
``s3fs.S3FileSystem``. The local server is the bottleneck on this machine, so the ratio is the figure,
not the absolute rates. moto keeps objects in memory (~2x): steps are deleted between repeats.

Each run is one save paired with one baseline put (``--repeat``; 5 at full size, 1 at smoke size); the order
within the pair alternates from run to run, so drift in the machine's speed favours neither. The row holds
the median over the runs of each figure (the ratio is taken per pair), with its min and max.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

MiB = 1 << 20
BUCKET = "bench"
CHUNK_MIB = 16
CONCURRENCY = 8
DAEMON_NICE = 10  # the daemon's default niceness; the baseline runs at the same one (see _raw_put_niced)


def _rank_save(rank: int, world: int, socket_path: str, nbytes: int, step: int) -> float:
    """One save of ``nbytes`` by this rank; returns the seconds from ``save()`` to the commit."""
    import torch

    from ckptd.client import CheckpointClient, Placement, Shard

    numel = nbytes // 4
    data = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))
    shard = {"w": Shard("w", data, (numel * world,), (numel * rank,))}
    client = CheckpointClient(socket_path, placement=Placement(rank, world, world, 0), timeout_s=120)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    client.save(step, shard).wait(1200)
    drain = time.perf_counter() - t0
    client.close()
    return drain


async def _raw_put(endpoint: str, prefix: str, total: int) -> float:
    """Baseline: ``total`` bytes as CHUNK_MIB objects, CONCURRENCY at a time, through plain s3fs."""
    import s3fs

    fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, endpoint_url=endpoint,
                           config_kwargs={"s3": {"addressing_style": "path"}})
    await fs.set_session()
    block = os.urandom(CHUNK_MIB * MiB)
    sizes = [min(CHUNK_MIB * MiB, total - off) for off in range(0, total, CHUNK_MIB * MiB)]
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int, n: int) -> None:
        async with sem:
            await fs._pipe_file(f"{BUCKET}/{prefix}/obj-{i}", block[:n])

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, n) for i, n in enumerate(sizes)))
    dt = time.perf_counter() - t0
    await fs._rm(f"{BUCKET}/{prefix}", recursive=True)
    await fs._s3.close()
    return dt


def _raw_put_niced(endpoint: str, prefix: str, total: int) -> float:
    """:func:`_raw_put` in a child process at the daemon's niceness: the S3 server shares this machine's
    CPUs, so a baseline at a higher priority than the daemon would measure the scheduler, not ckptd."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_raw_put_child, args=(endpoint, prefix, total, child))
    proc.start()
    child.close()
    seconds = float(parent.recv())
    proc.join()
    return seconds


def _raw_put_child(endpoint: str, prefix: str, total: int, conn: Any) -> None:
    os.nice(DAEMON_NICE)
    conn.send(asyncio.run(_raw_put(endpoint, prefix, total)))
    conn.close()


def _empty(server: Any, prefix: str) -> None:
    client = server.client()
    keys = server.list_keys(BUCKET, f"{prefix}/")
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})


def bench_s3_drain(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    from run import emit, runs, spread

    from ckptd.testing.launch import DaemonProcess, run_ranks
    from ckptd.testing.s3server import S3Server

    per_rank = (4 if args.smoke else 128) * MiB
    world = 2
    repeats = runs(args, full=5)
    total = per_rank * world
    with S3Server() as server:
        server.make_bucket(BUCKET)
        env = server.env()
        os.environ.update(env)  # the baseline and the ranks use the same credential chain as the daemon
        sock = os.path.join(args.sockets, "s3.sock")
        daemon = DaemonProcess(
            f"s3://{BUCKET}/run", sock, "--arena-size", f"{2 * total // MiB + 64}MiB",
            "--chunk-bytes", f"{CHUNK_MIB}MiB", "--write-concurrency", str(CONCURRENCY),
            "--endpoint-url", server.endpoint_url, "--addressing-style", "path", "--nice", str(DAEMON_NICE),
            env=env, log_path=os.path.join(workdir, "daemon-s3.log"),
        )
        daemon.wait_ready(120)
        drains, raws = [], []
        try:
            for step in range(1, repeats + 1):  # interleaved, so both see the same machine noise
                if step % 2:
                    raws.append(_raw_put_niced(server.endpoint_url, "raw", total))
                drains.append(max(run_ranks(_rank_save, world, sock, per_rank, step, env=env, timeout_s=1800)))
                _empty(server, "run")
                if not step % 2:
                    raws.append(_raw_put_niced(server.endpoint_url, "raw", total))
        finally:
            daemon.stop()
    return [emit({
        "bench": "s3_drain",
        **spread("ratio_vs_raw_put", [raw / drain for raw, drain in zip(raws, drains, strict=True)]),
        **spread("daemon_mib_s", [total / drain / MiB for drain in drains], 1),
        **spread("raw_put_mib_s", [total / raw / MiB for raw in raws], 1),
        "runs": repeats,
        "bytes": total, "ranks": world, "chunk_mib": CHUNK_MIB, "concurrency": CONCURRENCY, "repeats": repeats,
        "nice": DAEMON_NICE, "daemon_s": [round(x, 3) for x in drains], "raw_put_s": [round(x, 3) for x in raws],
        "endpoint": "moto ThreadedMotoServer on 127.0.0.1",
    })]


BENCHES = {"s3_drain": bench_s3_drain}
