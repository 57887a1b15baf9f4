"""A load through host staging: the GPU path's rounds, on a CPU (``--only staged_load``).

A destination the reader cannot read into (a GPU tensor; on this machine a non-contiguous view, which takes
the same path) is read into host staging, at most ``stage_bytes`` a round, and copied into place after each
round (:class:`ckptd.client.fastread.ChunkReader`). One array (1 GiB fp32, 16 MiB chunks; smoke: 4 MiB) is
written by the writer, then loaded into a row-strided view with 128 MiB rounds (smoke: 1 MiB), warm, the modes
taking turns:

- ``pool``: the loader as it is: every round's staging carved from one buffer for the whole load
  (:mod:`ckptd.client.stagepool`), so its pages are faulted in once;
- ``fresh``: the same load with a new host tensor for every staged region (the loader before 2026-12-03):
  every round's staging is new memory, faulted in page by page as it is read into;
- ``raw_place``: each file of the step ``readinto`` its own part of one pre-faulted buffer (no checksum, no
  copy into place; :func:`bench_load.raw_readers`): what any loader of those bytes must at least do.

Prints one JSON line: medians of 5 (smoke: 1), ``ratio_fresh_over_pool`` and ``ratio_pool_vs_raw_place``,
and the staging allocations each mode made.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import torch
from bench_load import raw_readers

from ckptd.client import stagepool
from ckptd.client.fastread import ChunkReader
from ckptd.writer import format as fmt
from ckptd.writer.arrays import ChunkSink
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.root import open_root

MiB = 1 << 20
FULL = {"rows": 16384, "cols": 16384, "chunk_rows": 256, "stage_bytes": 128 * MiB}
SMOKE = {"rows": 1024, "cols": 1024, "chunk_rows": 256, "stage_bytes": 1 * MiB}


class FreshStaging(stagepool.StagingPool):
    """The baseline: a new host tensor for every staged region."""

    def reserve(self, nbytes: int, regions: int, *, pin: bool) -> None:
        pass  # no buffer of the load's

    def take(self, dst: torch.Tensor) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(dst.shape, dtype=dst.dtype)


def _write(root: str, t: torch.Tensor, chunk_rows: int) -> None:
    rows, cols = t.shape

    async def go() -> None:
        async with await open_backend(root, None, create=True) as backend:
            ckpt, sink = CheckpointWriter(backend), ChunkSink(backend)
            chunks = []
            for i in range(-(-rows // chunk_rows)):
                block = t[i * chunk_rows : (i + 1) * chunk_rows]
                crc, pieces = await sink.put(f"step_1/w/{fmt.chunk_key([i, 0], '.')}", block.numpy())
                chunks.append(fmt.ChunkRecord([i, 0], block.numel() * block.element_size(), crc, pieces))
            shard = fmt.ShardRecord(0, [0, 0], [rows, cols], chunks)
            rec = fmt.ArrayRecord("w", "float32", [rows, cols], [chunk_rows, cols], [shard], separator=".")
            await ckpt.write_part(fmt.PartManifest(fmt.FORMAT_VERSION, 1, 0, 1, 1, [0], [rec], {}, 0, 0.0))
            await ckpt.commit(1, 1, timeout=60)

    asyncio.run(go())


def _load(root: str, dst: torch.Tensor, stage_bytes: int, pool: type[stagepool.StagingPool]) -> int:
    async def go() -> int:
        async with open_root(root, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1), stage_bytes=stage_bytes)
            reader.staging = pool(reader.stage_bytes)
            reader.add("w", dst, (0, 0))
            await reader.run()
            return reader.staging.allocations

    return asyncio.run(go())


def bench_staged_load(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    from run import emit

    cfg = SMOKE if args.smoke else FULL
    repeats = 1 if args.smoke else 5
    root = os.path.join(workdir, "staged-load")
    src = torch.randn(cfg["rows"], cfg["cols"], generator=torch.Generator().manual_seed(0))
    _write(root, src, cfg["chunk_rows"])
    dst = torch.zeros(cfg["rows"], cfg["cols"] + 16)[:, : cfg["cols"]]  # row-strided: staged, as a GPU tensor
    _reused, raw = raw_readers(root, 0, 1)  # bench_load's: every file of the step into one pre-faulted buffer
    modes = {"pool": lambda: _load(root, dst, cfg["stage_bytes"], stagepool.StagingPool),
             "fresh": lambda: _load(root, dst, cfg["stage_bytes"], FreshStaging), "raw_place": raw}
    allocations: dict[str, Any] = {}
    for name, run in modes.items():  # warm the page cache and the destination, and check the bytes
        allocations[name] = run()
        if name != "raw_place" and not torch.equal(dst, src):
            raise AssertionError(f"{name}: the staged load did not read back what was written")
        dst.zero_()
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(repeats):
        for name, run in modes.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    row: dict[str, Any] = {"bench": "staged_load", "bytes": src.numel() * src.element_size(),
                           "stage_bytes": cfg["stage_bytes"], "rounds": -(-src.numel() * 4 // cfg["stage_bytes"]),
                           "runs": repeats, **{f"{name}_s": round(v, 4) for name, v in med.items()},
                           "pool_allocations": allocations["pool"], "fresh_allocations": allocations["fresh"],
                           "ratio_fresh_over_pool": round(med["fresh"] / med["pool"], 3),
                           "ratio_pool_vs_raw_place": round(med["pool"] / med["raw_place"], 3)}
    return [emit(row)]


BENCHES = {"staged_load": bench_staged_load}
