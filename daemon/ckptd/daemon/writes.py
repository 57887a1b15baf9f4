"""Writing staged shards: each rank save's shards, chunk by chunk, from the arena to storage.

A daemon-wide semaphore bounds the chunks in flight; each shard's arena slot is freed as soon as its
chunks are written. Small arrays a node holds whole are held back and written as one object once the
node's ranks have all arrived (see packing.py). A failed write fails the step's job; the service
decides what happens next.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import operator
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import msgspec
import numpy as np

from ckptd.client.protocol import ShardMeta, StepState
from ckptd.daemon.arena import Arena
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.job import RankSave, StepJob
from ckptd.daemon.packing import HeldBlock, assemble, covers_whole, packable
from ckptd.daemon.restore import Retention
from ckptd.writer.arrays import ChunkSink, array_metadata, checksum, chunk_selection, open_for_write
from ckptd.writer.backends import Backend
from ckptd.writer.errors import first_leaf
from ckptd.writer.format import (
    CHUNK_SEPARATOR,
    ChunkRecord,
    ShardRecord,
    check_region,
    chunk_key,
    chunk_selection_of,
    itemsize,
    plan_chunks,
    region_chunks,
    step_dir,
    storage_dtype,
)

_T = TypeVar("_T")

PACK_BUDGET_BYTES = 256 << 20  # small-array copies held per step while waiting for the node's ranks
# blocks of one small chunk each written per worker-thread call on a local root (one hand-off per chunk cost
# more than the chunk's write: a 9,808-shard rank's step spent 4.7-6.2 s writing, the same files 0.4 s by hand)
BATCH_CHUNKS = 64
# local chunks smaller than this get no fsync of their own (nor their folders): the step is made durable by
# one sync of the filesystem instead. One fsync per file and folder cost ~2 s of a 9,808-tensor rank's
# 8-9 s commit on ext4 (docs/benchmarks-log.md)
FSYNC_EACH_BYTES = 1 << 20


class ShardWriter:
    """Writes the shards of accepted saves into the step's zarr arrays and records what it wrote."""

    def __init__(self, config: DaemonConfig, arena: Arena, backend: Backend) -> None:
        self.config = config
        self.arena = arena
        self.backend = backend
        self._chunk_slots = asyncio.Semaphore(config.write_concurrency)
        self.retention: Retention | None = None  # set by the service: keeps written slots for a restore
        self._sink = ChunkSink(backend)
        # small arrays packed into one object only where each object costs a request (not on local disks)
        local = backend.local_root is not None
        pack = config.pack_bytes if config.pack_bytes is not None else (0 if local else 1 << 20)
        self._pack_bytes = min(pack, config.chunk_bytes)
        self._pack_budget = min(PACK_BUDGET_BYTES, config.arena_size // 4)

    async def write_rank(self, job: StepJob, save: RankSave) -> None:
        """Write one rank's shards (or hold the small ones); release its lease whatever happens."""
        lease = save.lease
        # Let the node's other ranks finish their copies before disk writes compete with them for CPU and
        # memory bandwidth: the data is safe in the arena already, and the stall is what training feels.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(job.all_staged.wait(), self.config.stage_grace_s)
        # write_concurrency workers take the shards in turn: as many coroutines, not one task per shard (a
        # rank of ~10,000 shards made ~10,000 tasks at once, each with its own objects for every collection
        # of the daemon's garbage collector to walk); the chunk slots still bound the writes across ranks
        shards = iter(save.request.shards)

        async def worker() -> None:
            batch: list[tuple[ShardMeta, np.ndarray, tuple[int, ...]]] = []
            for meta in shards:
                data = self._block(save, meta)
                if self._hold_for_packing(job, save, meta, data):
                    self.arena.release_slot(save.lease, meta.slot)
                    continue
                chunks = self._one_small_chunk(meta, data)
                if chunks is None:
                    await self._write_block(job, save, meta, data)
                    self._done_with(job, save, meta)
                    continue
                batch.append((meta, data, chunks))
                if len(batch) == BATCH_CHUNKS:
                    await self._write_batch(job, save, batch)
                    batch = []
            if batch:
                await self._write_batch(job, save, batch)

        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(min(self.config.write_concurrency, len(save.request.shards))):
                    tg.create_task(worker())
        except* Exception as group:
            if job.fail(self.backend.error(first_leaf(group))):  # the node's other writes serve no commit now
                for task in job.tasks.values():
                    if task is not asyncio.current_task():
                        task.cancel()
        finally:
            self.arena.release(lease)

    def _block(self, save: RankSave, meta: ShardMeta) -> np.ndarray:
        """The shard's block: a view of its slot in the arena."""
        offset = save.lease.offsets[meta.slot]
        data = np.frombuffer(self.arena.mm, dtype=storage_dtype(meta.dtype), count=math.prod(meta.shape),
                             offset=offset)
        return data.reshape(meta.shape)

    def _done_with(self, job: StepJob, save: RankSave, meta: ShardMeta) -> None:
        """The shard is written: its slot stays for an in-memory restore (retention's choice) or is freed."""
        keep = self.retention is not None and job.state is StepState.PENDING
        if not (keep and self.retention is not None and self.retention.keep(job.step, meta, save.lease)):
            self.arena.release_slot(save.lease, meta.slot)

    def _one_small_chunk(self, meta: ShardMeta, data: np.ndarray) -> tuple[int, ...] | None:
        """The chunk shape of a block that is one raw chunk under :data:`FSYNC_EACH_BYTES` on a local root
        (written in a batch, :meth:`_write_batch`), else None."""
        if self._sink.local_root is None or self.config.codec != "raw" or not 0 < data.nbytes < FSYNC_EACH_BYTES:
            return None
        chunks = plan_chunks(meta.chunk_shape, itemsize(meta.dtype), self.config.chunk_bytes)
        check_region(meta.key, meta.global_shape, meta.global_offset, meta.shape, chunks)
        if math.prod(chunks) * data.itemsize >= FSYNC_EACH_BYTES or any(map(operator.gt, meta.shape, chunks)):
            return None  # (a region starts on the grid: it is one chunk when no wider than one)
        return chunks

    async def _write_batch(
        self, job: StepJob, save: RankSave, batch: list[tuple[ShardMeta, np.ndarray, tuple[int, ...]]]
    ) -> None:
        """Blocks of one small chunk each, written by one worker-thread call (none fsynced: the step is made
        durable by one filesystem sync) and recorded as :meth:`_write_block` records them."""
        where = [[o // c for o, c in zip(meta.global_offset, chunks, strict=True)] for meta, _, chunks in batch]
        items = [(f"{step_dir(job.step)}/{meta.key}/{chunk_key(coords, CHUNK_SEPARATOR)}", data, chunks)
                 for (meta, data, chunks), coords in zip(batch, where, strict=True)]
        async with self._chunk_slots:
            sums = await self._sink.put_local_unsynced(items)
        job.unsynced = True
        for (meta, data, chunks), coords, (key, _, _), one in zip(batch, where, items, sums, strict=True):
            chunk = ChunkRecord(coords, math.prod(chunks) * data.itemsize, one.crc32c, one.pieces)
            save.records.append((meta, ShardRecord(save.request.rank, list(meta.global_offset), list(meta.shape),
                                                   [chunk])))
            job.written_keys.append(key)
            self._done_with(job, save, meta)

    def _hold_for_packing(self, job: StepJob, save: RankSave, meta: ShardMeta, data: np.ndarray) -> bool:
        """Keep a copy of a small array's block until the node's other ranks arrived (see packing.py)."""
        if job.state is not StepState.PENDING or not packable(meta, self._pack_bytes):
            return False
        if job.held.nbytes + data.nbytes > self._pack_budget:
            return False
        job.held.add(HeldBlock(save.request.rank, meta, data.copy()))
        return True

    async def write_held(self, job: StepJob) -> None:
        """Write the held small-array blocks: one object per array the node holds whole, else as they came."""
        todo: list[tuple[RankSave, ShardMeta, np.ndarray]] = []
        for blocks in job.held.take().values():
            if covers_whole(blocks):
                first = min(blocks, key=lambda b: b.rank)
                shape = list(first.meta.global_shape)
                whole = msgspec.structs.replace(first.meta, global_offset=[0] * len(shape), shape=shape,
                                                chunk_shape=shape)
                todo.append((job.saves[first.rank], whole, assemble(blocks)))
            else:
                todo.extend((job.saves[b.rank], b.meta, b.data) for b in blocks)
        await self._bounded(todo, lambda one: self._write_block(job, *one))

    async def _bounded(self, items: Sequence[_T], write: Callable[[_T], Awaitable[None]]) -> None:
        """``write`` each item, by at most ``write_concurrency`` coroutines taking them in turn: never one
        task per item (a grid of tiny chunks made a task per element, all at once)."""
        todo = iter(items)

        async def worker() -> None:
            for item in todo:
                await write(item)

        async with asyncio.TaskGroup() as tg:
            for _ in range(min(self.config.write_concurrency, len(items))):
                tg.create_task(worker())

    async def _write_block(self, job: StepJob, save: RankSave, meta: ShardMeta, data: np.ndarray) -> None:
        """Write one block (whole chunks of its array) and record it for the node part."""
        chunks = plan_chunks(meta.chunk_shape, itemsize(meta.dtype), self.config.chunk_bytes)
        check_region(meta.key, meta.global_shape, meta.global_offset, meta.shape, chunks)
        path = f"{step_dir(job.step)}/{meta.key}"
        arr = None
        if self.config.codec != "raw":  # compressed chunks go through zarr's codec pipeline
            arr_meta = await array_metadata(
                meta.dtype, meta.global_shape, chunks, codec=self.config.codec, separator=CHUNK_SEPARATOR
            )
            arr = open_for_write(self.backend.store, path, arr_meta)
        coords_list = list(region_chunks(meta.global_offset, meta.shape, chunks))
        records: list[ChunkRecord | None] = [None] * len(coords_list)

        async def one(at: tuple[int, tuple[int, ...]]) -> None:
            i, coords = at
            block = data[chunk_selection_of(coords, chunks, meta.global_shape, meta.global_offset)]
            key = f"{path}/{chunk_key(coords, CHUNK_SEPARATOR)}"
            async with self._chunk_slots:
                if arr is None:  # an edge chunk is stored whole (zarr v3), padded in the sink's worker thread
                    nbytes = math.prod(chunks) * block.itemsize
                    own = nbytes >= FSYNC_EACH_BYTES or not self._sink.fsync_each  # (S3: nothing to sync)
                    crc, pieces = await self._sink.put(key, block, chunks, fsync=own)
                    job.unsynced |= not own
                else:  # compressed: read whole, so checksummed whole
                    crc, pieces = await checksum(block), b""
                    await arr.setitem(chunk_selection(coords, chunks, meta.global_shape), block)
                    nbytes = block.nbytes
            records[i] = ChunkRecord(list(coords), nbytes, crc, pieces)
            job.written_keys.append(key)

        await self._bounded(list(enumerate(coords_list)), one)
        rec = ShardRecord(save.request.rank, list(meta.global_offset), list(meta.shape), [r for r in records if r])
        save.records.append((meta, rec))

