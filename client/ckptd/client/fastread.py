"""The fast read path: raw-codec chunks read straight into the destination tensor's memory.

zarr's codec pipeline decodes every chunk into a fresh buffer, which numpy and then torch copy again;
for the ``raw`` codec (zarr ``bytes`` little-endian + ``crc32c``) the stored object *is* the data
followed by its checksum. So a chunk whose extent is a contiguous run of the destination is read with
one ``preadv`` (local roots: :attr:`~ckptd.writer.backends.Backend.local_root`) straight into that run,
the 4-byte checksum into a small buffer beside it; on object stores ranged GETs (parts of at most
:data:`PART_BYTES`, at most ``concurrency`` requests in flight) whose bodies are read piece by piece straight
into that run (:meth:`~ckptd.writer.backends.Backend.read_into`: the one copy left is out of the HTTP
client's receive buffer). A chunk that a region holds only part of (a TP half, a DP slice's edge) is
read once for all the regions in it, piece by piece: long runs straight into place, the rest through a
cached scratch piece (:mod:`ckptd.client.gather`); strided regions of 1-D arrays (a TP half of a
row-parallel param in a bucket slice) are added by :meth:`ChunkReader.add_gather`. Every chunk's crc32c is
checked against the stored trailer and the commit manifest's record, in worker threads, before the load
returns; :class:`~ckptd.writer.errors.CorruptCheckpointError` names the chunk otherwise. A destination that cannot
be read into (a GPU tensor, a non-contiguous view) is read into host staging and copied into place after:
at most :data:`STAGE_BYTES` of staging at once (larger regions split into blocks of rows, the rest read in
later rounds; every round in one buffer, :mod:`ckptd.client.stagepool`). Compressed arrays (and big-endian
hosts) keep going through zarr, chunk by chunk, each checked against the manifest (:mod:`.zarrpath`).

    reader = ChunkReader(root, commit)
    reader.add(key, dst_tensor, global_offset)   # any number of regions
    await reader.run()                            # bounded concurrency over all chunks at once
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

from ckptd.client.chunkio import Job, contiguous_run, needed_pieces, read_bytes, read_local, stored_shape
from ckptd.client.gather import Strided, merge_dims, normalize
from ckptd.client.protocol import RestoreShard
from ckptd.client.ranged import read_ranged
from ckptd.client.restore import ArenaSource
from ckptd.client.stagepool import StagingPool, pinnable
from ckptd.client.state import dtype_name
from ckptd.client.zarrpath import read_through_zarr
from ckptd.writer.arrays import chunk_selection
from ckptd.writer.errors import CorruptCheckpointError, StateMismatchError
from ckptd.writer.fanout import bounded_map, in_thread_settled, shared_pool
from ckptd.writer.format import (
    ArrayRecord,
    ChunkRecord,
    CommitManifest,
    ShardRecord,
    chunk_key,
    itemsize,
    step_dir,
)
from ckptd.writer.progress import ByteProgress
from ckptd.writer.root import CheckpointRoot

R = TypeVar("R")

#: chunks in flight at once (each holds a worker thread while it reads and checksums); on object stores
#: also the bound on ranged GETs in flight
CHUNK_CONCURRENCY = 8
#: the largest ranged GET on object stores: a chunk is fetched in parts of this size, concurrently
PART_BYTES = 8 << 20
#: host memory a load stages at once for destinations it cannot read into (another device's tensors, a
#: non-contiguous view): regions beyond it are read in later rounds, each round's staging copied into place
#: and freed before the next (a GPU rank's whole state is never staged in host memory at once)
STAGE_BYTES = 1 << 30
_RUN = 64 << 10  # a gathered region's contiguous run at least this long is read straight into place


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_uints(t: torch.Tensor, item: int) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of unsigned ints of its ``item`` size, in its shape and strides
    (the raw codec's bytes, whatever the dtype: numpy has no bfloat16)."""
    return t.detach().view(_INTS[item]).numpy().view(f"u{item}" if item > 1 else "u1")


class ChunkReader:
    """Reads regions of a committed step's arrays into tensors; one instance per load."""

    def __init__(
        self, ckpt: CheckpointRoot, commit: CommitManifest, *, concurrency: int = CHUNK_CONCURRENCY,
        memory: ArenaSource | None = None, part_bytes: int = PART_BYTES, stage_bytes: int = STAGE_BYTES,
    ) -> None:
        self.ckpt = ckpt
        self.commit = commit
        self.prefix = step_dir(commit.step)
        self.arrays = {rec.name: rec for rec in commit.arrays}
        self.local_root = ckpt.backend.local_root
        self.concurrency = concurrency
        self.part_bytes = max(1, part_bytes)
        self._gets: asyncio.Semaphore | None = None  # ranged GETs in flight (object stores), made in run()
        self.jobs: list[Job] = []
        self.slow: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staging, caller's tensor)
        self.stage_bytes = max(1, stage_bytes)
        self.staging = StagingPool(self.stage_bytes)  # every round's staging, one buffer for the whole load
        self.staged_bytes = 0  # staging planned in this round
        self.peak_staged_bytes = 0
        self.staged: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []  # staged regions of this round
        self.deferred: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []  # staged regions of later rounds
        self.fast_bytes = 0
        # in-memory restore: regions that are exactly a shard the daemon kept are copied from its arena
        self.memory = memory if memory is not None and memory.step == commit.step else None
        self.from_memory: list[tuple[str, torch.Tensor, tuple[int, ...], RestoreShard, ShardRecord]] = []
        self.gathers: dict[str, Job] = {}  # chunk path -> the regions it holds elements of
        self._grid: dict[str, dict[tuple[int, ...], ChunkRecord]] = {}  # array -> its chunks by coords
        self._stored: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], ShardRecord]] = {}  # by region
        self._gather_by_chunk: dict[tuple[str, int], Job] = {}  # (1-D array, chunk) -> its gather job
        self._bases: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # add_gathers' slices as flat numpy arrays
        dist = torch.distributed
        rank = f"rank {dist.get_rank()}: " if dist.is_available() and dist.is_initialized() else ""
        self.progress = ByteProgress(f"{rank}load of step {commit.step}")  # logged once a load passes 30 s

    def add(self, key: str, dst: torch.Tensor, offset: Sequence[int]) -> None:
        """Fill ``dst`` with the region of array ``key`` that starts at ``offset`` (shape: ``dst.shape``).

        The caller has checked key, shape and dtype (:func:`ckptd.client.reader.plan_reads`)."""
        rec = self.arrays[key]
        if dst.numel() == 0:
            return
        if self.memory is not None:
            hit = self.memory.find(key, tuple(offset), tuple(dst.shape))
            by_region = self._stored.get(key)
            if by_region is None:
                by_region = self._stored[key] = {(tuple(s.offset), tuple(s.shape)): s for s in reversed(rec.shards)}
            stored = by_region.get((tuple(offset), tuple(dst.shape)))
            if hit is not None and stored is not None and hit.dtype == rec.torch_dtype and \
                    hit.nbytes == dst.numel() * itemsize(rec.torch_dtype):
                self.from_memory.append((key, dst, tuple(offset), hit, stored))
                return
        if rec.codec != "raw" or sys.byteorder != "little":
            self.slow.append((key, dst, tuple(offset)))
            return
        if self._whole_chunk(rec, dst, offset):
            return
        if len(rec.shape) == 1 and dst.dim() == 1 and dst.device.type == "cpu" and \
                dtype_name(dst.dtype) == rec.torch_dtype:  # a bucket slice: its partial chunks (a slice at
            # another DP) through the cached scratch piece rather than a fresh buffer of a whole chunk each
            self.add_gather(key, dst, Strided(offset[0], (dst.numel(),), (1,)))
            return
        if dst.device.type != "cpu" or not dst.is_contiguous():
            self._staging(key, dst, tuple(offset))
            return
        self._plan_into(rec, dst, tuple(offset))

    def _whole_chunk(self, rec: ArrayRecord, dst: torch.Tensor, offset: Sequence[int]) -> bool:
        """Plan ``dst`` as one direct read when it is the whole of an array stored as one chunk (a plain
        tensor saved whole: most of a plain state's arrays), else False. What the general paths would plan
        for it, without their per-chunk geometry (~20 µs a region)."""
        shards, nbytes = rec.shards, dst.numel() * dst.element_size()
        if len(shards) != 1 or len(shards[0].chunks) != 1 or rec.chunks != rec.shape or any(offset):
            return False
        ch = shards[0].chunks[0]
        if list(dst.shape) != rec.shape or dst.device.type != "cpu" or not dst.is_contiguous() or \
                dtype_name(dst.dtype) != rec.torch_dtype or ch.nbytes != nbytes:
            return False
        path = f"{self.prefix}/{rec.name}/{chunk_key(ch.coords, rec.separator)}"
        self.jobs.append(Job(path, ch, dst.detach().view(-1).view(torch.uint8).numpy()))
        self.fast_bytes += nbytes
        return True

    def _plan_into(self, rec: ArrayRecord, target: torch.Tensor, offset: tuple[int, ...]) -> None:
        item = itemsize(rec.torch_dtype)
        flat = target.detach().view(-1).view(torch.uint8).numpy()
        typed = flat.view(f"u{item}" if item > 1 else "u1").reshape(tuple(target.shape))
        self._plan(rec, typed, flat, offset, item)

    def _staging(self, key: str, dst: torch.Tensor, offset: tuple[int, ...]) -> None:
        """Stage ``dst``'s region in this round (its host staging is carved when the round starts,
        :meth:`_carve_staged`), or leave it to a later round (this round's staging is full), or split it into
        blocks of rows that each fit :attr:`stage_bytes` (added again one by one)."""
        nbytes = dst.numel() * dst.element_size()
        if nbytes > self.stage_bytes and dst.dim() > 0 and dst.shape[0] > 1:
            rows = max(1, self.stage_bytes * dst.shape[0] // nbytes)
            for a in range(0, dst.shape[0], rows):
                self.add(key, dst[a : a + rows], (offset[0] + a, *offset[1:]))
            return
        if self.staged_bytes and self.staged_bytes + nbytes > self.stage_bytes:
            self.deferred.append((key, dst, offset))
            return
        self.staged_bytes += nbytes
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)
        self.staged.append((key, dst, offset))

    def _carve_staged(self) -> None:
        """Give this round's staged regions their host tensors and plan their reads into them; each is copied
        into place after the round's reads. The staging buffer is made with the first round, the size of the
        largest round the load can have (this one, or all the later ones together), page-locked where a
        destination is a CUDA tensor (:mod:`ckptd.client.stagepool`)."""
        staged, self.staged = self.staged, []
        if not staged:
            return
        later = sum(dst.numel() * dst.element_size() for _key, dst, _offset in self.deferred)
        pin = any(pinnable(dst) for _key, dst, _offset in staged + self.deferred)
        self.staging.reserve(max(self.staged_bytes, later), len(staged) + len(self.deferred), pin=pin)
        for key, dst, offset in staged:
            target = self.staging.take(dst)
            self.copies.append((target, dst))
            self._plan_into(self.arrays[key], target, offset)

    def add_gather(self, key: str, dst: torch.Tensor, region: Strided) -> None:
        """Fill ``dst`` (a CPU tensor of shape ``region.sizes``, any strides, the array's dtype) with the
        elements ``region`` locates in the 1-D array ``key``.

        Every stored chunk holding any of them is read once for all the regions added before :meth:`run`
        (and checksummed: whole, or where the manifest has the crc32c of each of its 1 MiB pieces, just
        the pieces holding elements of a region, each against its own); a chunk that one contiguous region
        fills entirely is read straight into the destination, any other piece by piece through a scratch
        buffer of :data:`~ckptd.client.chunkio.PIECE` bytes that stays in the CPU cache, from which
        :func:`~ckptd.client.gather.scatter` copies each region's elements into place. Chunks holding none
        are not read."""
        rec = self.arrays[key]
        if len(rec.shape) != 1 or region.offset < 0 or region.stop > rec.shape[0]:
            raise StateMismatchError(f"{key}: elements [{region.offset}, {region.stop}) lie outside {tuple(rec.shape)}")
        if rec.torch_dtype != dtype_name(dst.dtype):
            raise StateMismatchError(f"{key}: stored as {rec.torch_dtype}, the destination is {dst.dtype}")
        if tuple(dst.shape) != region.sizes:
            raise StateMismatchError(f"{key}: the destination has shape {tuple(dst.shape)}, the region {region.sizes}")
        if region.numel == 0:
            return
        item = itemsize(rec.torch_dtype)
        norm = None
        if rec.codec == "raw" and sys.byteorder == "little" and dst.device.type == "cpu":
            norm = normalize(region, _as_uints(dst, item))
        if norm is None:  # compressed, another device or an odd view: read its span, then copy the elements
            span = torch.empty(region.stop - region.offset, dtype=dst.dtype)
            self.add(key, span, (region.offset,))
            self.copies.append((span.as_strided(region.sizes, region.strides, 0), dst))
            return
        self._add_normalized(rec, norm, item)

    def add_gathers(
        self, keys: Sequence[str], slices: Sequence[torch.Tensor], view: tuple[tuple[int, ...], tuple[int, ...], int],
        region: Strided,
    ) -> None:
        """:meth:`add_gather` of one region of several arrays, each into the same view of its own 1-D slice:
        ``keys[i]``'s elements ``region`` into ``slices[i].as_strided(shape, strides, first + at)`` for
        ``view = (shape, strides, at)`` (a TP-change load reads each param's part of every optimizer state
        this way). The geometry is worked out once for all of them; the destinations are numpy views made
        straight over each slice's memory. A slice that is not a contiguous CPU tensor of its array's raw
        dtype goes through :meth:`add_gather`."""
        shape, strides, at = view
        merged: tuple[Strided, tuple[int, ...]] | None = None
        for key, out in zip(keys, slices, strict=True):
            rec = self.arrays[key]
            base = self._flat(rec, out)
            if base is not None and merged is None and region.numel:
                merged = merge_dims(region, strides)
            if base is None or merged is None or tuple(shape) != region.sizes or at < 0:
                self.add_gather(key, out.as_strided(shape, strides, out.storage_offset() + at), region)
                continue
            if region.offset < 0 or region.stop > rec.shape[0]:
                raise StateMismatchError(
                    f"{key}: elements [{region.offset}, {region.stop}) lie outside {tuple(rec.shape)}"
                )
            norm, dst_strides = merged
            item = base.itemsize
            dst = np.ndarray(norm.sizes, base.dtype, base, at * item, tuple(d * item for d in dst_strides))
            self._add_normalized(rec, (norm, dst), item)

    def _flat(self, rec: ArrayRecord, out: torch.Tensor) -> np.ndarray | None:
        """``out`` (a 1-D contiguous CPU tensor of ``rec``'s dtype, ``rec`` raw) as a flat numpy array of
        unsigned ints of its item size, made once per tensor; None otherwise."""
        got = self._bases.get(id(out))
        if got is not None and got[0] is out:
            return got[1]
        if not (rec.codec == "raw" and sys.byteorder == "little" and len(rec.shape) == 1 and out.dim() == 1
                and out.device.type == "cpu" and out.is_contiguous() and rec.torch_dtype == dtype_name(out.dtype)):
            return None
        flat = _as_uints(out, itemsize(rec.torch_dtype))
        self._bases[id(out)] = (out, flat)  # the tensor held: its id cannot be reused meanwhile
        return flat

    def _add_normalized(self, rec: ArrayRecord, norm: tuple[Strided, np.ndarray], item: int) -> None:
        """Add a normalized region of the 1-D array ``rec`` to the gather job of every chunk holding any of its
        elements."""
        region = norm[0]
        chunks = self._chunk_grid(rec)
        size = rec.chunks[0]
        for c in range(region.offset // size, (region.stop - 1) // size + 1):
            job = self._gather_by_chunk.get((rec.name, c))
            if job is None:
                ch = chunks.get((c,))
                if ch is None:
                    raise CorruptCheckpointError(f"{rec.name}: chunk {c} is not in the manifest")
                path = f"{self.prefix}/{rec.name}/{chunk_key(ch.coords, rec.separator)}"
                stored_shape(path, ch.nbytes, rec.chunks, chunk_selection(ch.coords, rec.chunks, rec.shape), item)
                job = self.gathers.get(path)
                if job is None:
                    job = self.gathers[path] = Job(path, ch, None, item=item, start=c * size, gather=[])
                self._gather_by_chunk[(rec.name, c)] = job
            job.gather.append(norm)  # type: ignore[union-attr]
        self.fast_bytes += region.numel * item

    def _gather_jobs(self) -> list[Job]:
        """The gather jobs: a chunk that one contiguous region fills whole becomes a direct read; in the
        others, a region's long contiguous run that no other region's span touches is read straight into
        place (``runs``), the rest goes through the scratch piece (``scattered``). A chunk that one region
        fills whole (a direct read) and others hold parts of is read once, as a gather job whose regions
        include the whole-chunk one."""
        whole = [job for job in self.jobs if job.direct is not None and job.path in self.gathers]
        for job in whole:
            g = self.gathers[job.path]
            dst = job.direct.view(f"u{g.item}" if g.item > 1 else "u1")  # type: ignore[union-attr]
            g.gather.append((Strided(g.start, (len(dst),), (1,)), dst))  # type: ignore[union-attr]
        if whole:
            self.jobs = [job for job in self.jobs if not any(job is w for w in whole)]
        jobs = []
        for job in self.gathers.values():
            targets = job.gather or []
            end = job.start + job.chunk.nbytes // job.item
            for i, (region, dst) in enumerate(targets):
                lo, hi = max(region.offset, job.start), min(region.stop, end)
                long = (hi - lo) * job.item >= _RUN or (lo, hi) == (job.start, end)
                if not (region.is_run() and dst.flags.c_contiguous and long) or any(
                    other.offset < hi and other.stop > lo for k, (other, _d) in enumerate(targets) if k != i
                ):
                    job.scattered.append((region, dst))
                    continue
                run = dst.reshape(-1)[lo - region.offset : hi - region.offset].view(np.uint8)
                if (lo, hi) == (job.start, end):  # the whole chunk
                    job = Job(job.path, job.chunk, run)
                    break
                job.runs.append(((lo - job.start) * job.item, (hi - job.start) * job.item, run))
            job.runs.sort(key=lambda r: r[0])
            job.pieces = needed_pieces(job)
            jobs.append(job)
        self.gathers, self._gather_by_chunk, self._bases = {}, {}, {}
        return jobs

    def _plan(self, rec: ArrayRecord, typed: np.ndarray, flat: np.ndarray, offset: tuple[int, ...], item: int) -> None:
        local = typed.shape
        end = tuple(o + n for o, n in zip(offset, local, strict=True))
        grid = self._chunk_grid(rec)  # a region visits only the chunks it overlaps
        spans = (range(o // c, -(-e // c)) for o, e, c in zip(offset, end, rec.chunks, strict=True))
        for coords in itertools.product(*spans):
            ch = grid.get(coords)
            if ch is None:  # the manifest covers every array whole (checked at commit): a damaged one
                raise CorruptCheckpointError(f"{rec.name}: chunk {coords} is not in the manifest")
            ext = chunk_selection(ch.coords, rec.chunks, rec.shape)
            lo = tuple(max(s.start, o) for s, o in zip(ext, offset, strict=True))
            hi = tuple(min(s.stop, e) for s, e in zip(ext, end, strict=True))
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            path = f"{self.prefix}/{rec.name}/{chunk_key(ch.coords, rec.separator)}"
            whole = all(a == s.start and b == s.stop for a, b, s in zip(lo, hi, ext, strict=True))
            rel = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))
            run = contiguous_run(rel, local) if whole else None
            if run is not None and run[1] * item == ch.nbytes:
                start, count = run
                self.jobs.append(Job(path, ch, flat[start * item : (start + count) * item]))
            else:
                src = tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, ext, strict=True))
                shape = stored_shape(path, ch.nbytes, rec.chunks, ext, item)
                first = ext[0].start if len(rec.shape) == 1 else 0  # a 1-D chunk's first element in the array
                if not self._gather_part(path, ch, typed[rel], src, shape, item, first):
                    self.jobs.append(Job(path, ch, None, typed[rel], src, shape, item))
            self.fast_bytes += math.prod(b - a for a, b in zip(lo, hi, strict=True)) * item

    def _chunk_grid(self, rec: ArrayRecord) -> dict[tuple[int, ...], ChunkRecord]:
        """The array's chunks by coords, indexed once per array (a deep model's stacked arrays have
        hundreds of chunks, and a load hundreds of regions in each)."""
        grid = self._grid.get(rec.name)
        if grid is None:
            grid = self._grid[rec.name] = {tuple(ch.coords): ch for shard in rec.shards for ch in shard.chunks}
        return grid

    def _gather_part(
        self, path: str, ch: ChunkRecord, dst: np.ndarray, src: tuple[slice, ...], shape: tuple[int, ...], item: int,
        start: int,
    ) -> bool:
        """Plan the block ``src`` of an N-d chunk (stored as ``shape``, C order) as a gather job: read piece by
        piece, its long runs straight into ``dst``, the rest through the thread's scratch piece (no buffer of
        a whole chunk; other regions in the chunk share the read). Positions count the chunk's elements from
        ``start``: 0, or for a 1-D array the chunk's first element in the array, the numbering of the gather
        jobs :meth:`add_gather` plans, so both kinds of region can share one chunk's read. False where
        ``dst``'s strides rule that out."""
        strides = [1] * len(shape)
        for k in range(len(shape) - 2, -1, -1):
            strides[k] = strides[k + 1] * shape[k + 1]
        first = start + sum(s.start * st for s, st in zip(src, strides, strict=True))
        norm = normalize(Strided(first, tuple(s.stop - s.start for s in src), tuple(strides)), dst)
        if norm is None:
            return False
        job = self.gathers.get(path)
        if job is None:
            job = self.gathers[path] = Job(path, ch, None, item=item, start=start, gather=[])
        job.gather.append(norm)  # type: ignore[union-attr]
        return True

    async def run(self) -> None:
        """Copy what memory holds (checked), then read every planned chunk (bounded concurrency), then the
        zarr-decoded remainder; then the staged regions left to later rounds, one round of at most
        :attr:`stage_bytes` of staging at a time."""
        kept, done = self.memory, False
        try:
            if self.from_memory and self.memory is not None:
                ok = await bounded_map(self._copy_from_memory, self.from_memory, limit=self.concurrency)
                missed = [item for item, good in zip(self.from_memory, ok, strict=True) if not good]
                pairs = list(zip(self.from_memory, ok, strict=True))
                self.memory.served_bytes += sum(item[3].nbytes for item, good in pairs if good)
                self.from_memory, memory, self.memory = [], self.memory, None
                for key, dst, offset, _hit, _stored in missed:  # stale or damaged: read from storage
                    memory.rejected.append(key)
                    self.add(key, dst, offset)
                self.memory = memory
            self.memory = None  # a deferred region was not in memory when it was added
            await self._read_planned()
            while self.deferred:  # later rounds of staged regions, each within stage_bytes
                todo, self.deferred = self.deferred, []  # (_read_planned took the last round's staging back)
                for key, dst, offset in todo:
                    self.add(key, dst, offset)
                await self._read_planned()
            done = True
        finally:
            self.memory = kept
            self.staging.release()
            self.progress.close(done)

    async def _read_planned(self) -> None:
        """Read every chunk planned so far (bounded concurrency), then the zarr-decoded remainder, then copy
        the staged regions into place (their staging is freed with the plan)."""
        self._carve_staged()
        self._gets = asyncio.Semaphore(self.concurrency)
        gathered = self._gather_jobs()  # first: it takes over the direct reads of chunks it reads anyway
        self.progress.expect(sum(map(read_bytes, (*self.jobs, *gathered))))
        if self.local_root is not None:
            await self._read_local_all(self.jobs + gathered)
        else:
            await bounded_map(self._read_ranged, self.jobs + gathered, limit=self.concurrency)
        for key, dst, offset in self.slow:  # compressed: through zarr, every chunk checked
            rec = self.arrays[key]
            await read_through_zarr(self.ckpt.store, self.prefix, rec, self._chunk_grid(rec), dst, offset)
        for staging, dst in self.copies:
            dst.copy_(staging)
        self.jobs, self.slow, self.copies, self.staged_bytes = [], [], [], 0
        self.staging.reset()

    async def _copy_from_memory(
        self, item: tuple[str, torch.Tensor, tuple[int, ...], RestoreShard, ShardRecord]
    ) -> bool:
        return await self._settled(self._copy_checked, *item)

    def _copy_checked(
        self, key: str, dst: torch.Tensor, offset: tuple[int, ...], hit: RestoreShard, stored: ShardRecord
    ) -> bool:
        """One kept shard out of the arena into ``dst``, checked (:meth:`ArenaSource.copy_checked`)."""
        return self.memory is not None and self.memory.copy_checked(self.arrays[key], dst, offset, hit, stored)

    async def _read_local_all(self, jobs: list[Job]) -> None:
        """Local roots: ``concurrency`` pool threads each read jobs off one shared list until it is empty,
        one fails or the load is cancelled (the event loop wakes once per thread, not once per chunk). A
        failure is raised once every thread has stopped: no read lands after the load has failed."""
        root, todo, lock, stop = self.local_root or "", iter(jobs), threading.Lock(), threading.Event()

        def drain() -> None:
            while not stop.is_set():
                with lock:
                    job = next(todo, None)
                if job is None:
                    return
                try:
                    read_local(os.path.join(root, job.path), job)
                except BaseException:
                    stop.set()
                    raise
                self.progress.advance(read_bytes(job))

        threads = [shared_pool().submit(drain) for _ in range(min(self.concurrency, len(jobs)))]
        try:
            done = await asyncio.gather(*map(asyncio.wrap_future, threads), return_exceptions=True)
        finally:
            stop.set()  # cancelled: the threads end their chunks before it goes on (none writes after it returned)
            await asyncio.gather(*map(asyncio.wrap_future, threads), return_exceptions=True)
        failed = next((r for r in done if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed

    async def _read_ranged(self, job: Job) -> None:
        """Object stores: one chunk in ranged GETs (:func:`~ckptd.client.ranged.read_ranged`)."""
        if self._gets is None:
            self._gets = asyncio.Semaphore(self.concurrency)
        await read_ranged(self.ckpt.backend, job, self.part_bytes, self._gets, self._settled)
        self.progress.advance(read_bytes(job))

    @staticmethod
    async def _settled(fn: Callable[..., R], /, *args: object) -> R:
        """``fn`` in a read-pool thread that a failed load waits for (:func:`~ckptd.writer.fanout.in_thread_settled`):
        the load raises once no check or copy still writes into the caller's tensors or the staging."""
        return await in_thread_settled(fn, *args, pool=shared_pool())
