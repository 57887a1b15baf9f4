"""The daemon's work: validate saves, write staged shards as zarr chunks, write the node part, commit.

One :class:`StepJob` per step on this node. Each accepted rank save becomes a task that writes its
shards chunk by chunk (a daemon-wide semaphore bounds chunks in flight) and frees each shard's arena slot
as soon as its chunks are written. When every local rank's save is written the node part manifest goes
to storage; node 0's daemon then commits the step, the others wait for the marker. Nothing here touches
the training process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from ckptd.client.protocol import SaveRequest, ShardMeta
from ckptd.daemon.arena import Arena, Lease
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.packing import HeldBlock, assemble, covers_whole, packable
from ckptd.writer.arrays import ChunkSink, array_metadata, checksum, chunk_selection, open_for_write
from ckptd.writer.backends import Backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import (
    CkptdError,
    DaemonShuttingDownError,
    DuplicateSaveError,
    InvalidRequestError,
    LeaseError,
    SaveTimeoutError,
    ShardLayoutError,
    StepCommittedError,
    StepFailedError,
)
from ckptd.writer.format import (
    FORMAT_VERSION,
    ArrayRecord,
    ChunkRecord,
    PartManifest,
    ShardRecord,
    check_region,
    check_sidecar,
    chunk_key,
    chunk_selection_of,
    itemsize,
    plan_chunks,
    region_chunks,
    step_dir,
    storage_dtype,
    validate_key,
)

log = logging.getLogger(__name__)

FINAL_STATES = ("committed", "failed")
KEEP_FINISHED_JOBS = 64
CLOCK_SKEW_S = 5.0  # failure notes older than a step's start (less this) are an earlier attempt's
PACK_BUDGET_BYTES = 256 << 20  # small-array copies held per step while waiting for the node's ranks


@dataclass
class RankSave:
    request: SaveRequest
    lease: Lease
    records: list[tuple[ShardMeta, ShardRecord]] = field(default_factory=list)


@dataclass
class StepJob:
    step: int
    node: int
    num_nodes: int
    world_size: int
    local_world_size: int
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    saves: dict[int, RankSave] = field(default_factory=dict)
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    written_keys: list[str] = field(default_factory=list)
    state: str = "pending"
    error: CkptdError | None = None
    nbytes: int = 0
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    all_staged: asyncio.Event = field(default_factory=asyncio.Event)  # every local rank handed its data over
    durable_at: float = 0.0
    held: dict[str, list[HeldBlock]] = field(default_factory=dict)  # small arrays waiting to be packed
    held_bytes: int = 0
    retries_before: Any = None  # the backend's retry counters when the step began

    def fail(self, error: CkptdError) -> None:
        if self.state in FINAL_STATES:
            return
        self.state, self.error = "failed", error
        self.held, self.held_bytes = {}, 0  # small-array copies that will never be written
        self.finished.set()


class CheckpointService:
    """Everything the daemon does with saves, independent of the socket that delivers them."""

    def __init__(self, config: DaemonConfig, arena: Arena, backend: Backend) -> None:
        self.config = config
        self.arena = arena
        self.root = CheckpointWriter(backend)
        self.jobs: dict[int, StepJob] = {}
        self.draining = False
        self._chunk_slots = asyncio.Semaphore(config.write_concurrency)
        self._job_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self._sidecars_stored: set[str] = set()
        self._sink = ChunkSink(backend)
        # small arrays packed into one object only where each object costs a request (not on local disks)
        local = backend.local_root is not None
        pack = config.pack_bytes if config.pack_bytes is not None else (0 if local else 1 << 20)
        self._pack_bytes = min(pack, config.chunk_bytes)
        self._pack_budget = min(PACK_BUDGET_BYTES, config.arena_size // 4)

    # --- accepting saves --------------------------------------------------------------------------
    async def accept(self, req: SaveRequest, owner: int) -> int:
        """Validate a rank's save and start writing it. Returns the bytes accepted."""
        if self.draining:
            raise DaemonShuttingDownError("the daemon is shutting down and accepts no new saves")
        lease = self.arena.get(req.lease_id, owner)
        if lease is None:
            raise LeaseError(f"lease {req.lease_id} was never granted to this connection (or is already used)")
        self._validate(req, lease)
        for name, text in req.sidecars.items():
            check_sidecar(name, text)
        with self._typed_storage_errors():
            job = await self._job_for(req)
        if req.rank in job.saves:
            raise DuplicateSaveError(f"rank {req.rank} already saved step {req.step}")
        if job.state != "pending":
            raise StepFailedError(f"step {req.step} is already {job.state} on this node: {job.error}")
        for name, text in req.sidecars.items():
            if name not in self._sidecars_stored:
                with self._typed_storage_errors():
                    await self.root.write_sidecar(name, text)
                self._sidecars_stored.add(name)
        self.arena.adopt(lease)
        save = RankSave(req, lease)
        job.saves[req.rank] = save
        nbytes = sum(lease.sizes[s.slot] for s in req.shards)
        job.nbytes += nbytes
        job.tasks[req.rank] = self._spawn(self._write_rank(job, save), f"write step={req.step} rank={req.rank}")
        if len(job.saves) == job.local_world_size:
            job.all_staged.set()
            self._spawn(self._finish_node(job), f"finish step={req.step}")
        return nbytes

    def _validate(self, req: SaveRequest, lease: Lease) -> None:
        if not (0 <= req.rank < req.world_size and 0 <= req.node < req.num_nodes):
            raise InvalidRequestError(
                f"rank {req.rank}/world {req.world_size}, node {req.node}/{req.num_nodes} is not a valid placement"
            )
        if req.local_world_size < 1 or req.local_world_size > req.world_size:
            raise InvalidRequestError(f"local_world_size {req.local_world_size} outside [1, {req.world_size}]")
        used: set[int] = set()
        seen: set[tuple[str, tuple[int, ...]]] = set()
        for meta in req.shards:
            validate_key(meta.key)
            if not 0 <= meta.slot < len(lease.sizes) or meta.slot in used:
                raise LeaseError(f"{meta.key}: slot {meta.slot} is not a free slot of lease {req.lease_id}")
            used.add(meta.slot)
            size = math.prod(meta.shape) * itemsize(meta.dtype)
            if size > lease.sizes[meta.slot]:
                raise LeaseError(
                    f"{meta.key}: {size} bytes do not fit slot {meta.slot} of {lease.sizes[meta.slot]} bytes"
                )
            if any(c <= 0 for c in meta.chunk_shape) or len(meta.chunk_shape) != len(meta.global_shape):
                raise ShardLayoutError(f"{meta.key}: invalid chunk grid {meta.chunk_shape}")
            check_region(meta.key, meta.global_shape, meta.global_offset, meta.shape, meta.chunk_shape)
            where = (meta.key, tuple(meta.global_offset))
            if where in seen:
                raise ShardLayoutError(f"{meta.key}: region at {meta.global_offset} given twice")
            seen.add(where)

    async def _job_for(self, req: SaveRequest) -> StepJob:
        async with self._job_lock:
            job = self.jobs.get(req.step)
            if job is not None and job.state == "committed":
                raise StepCommittedError(f"step {req.step} already committed under {self.config.root}")
            if job is None or job.state == "failed":  # a failed step may be saved again
                if await self.root.is_committed(req.step):
                    raise StepCommittedError(f"step {req.step} already committed under {self.config.root}")
                await self.root.discard_part(req.step, req.node)
                if req.node == 0:
                    await self.root.clear_failed(req.step)
                job = StepJob(req.step, req.node, req.num_nodes, req.world_size, req.local_world_size)
                metrics = self.root.backend.metrics
                job.retries_before = metrics.snapshot() if metrics is not None else None
                self.jobs[req.step] = job
                self._forget_old_jobs()
                self._spawn(self._watch_part_timeout(job), f"timeout step={req.step}")
            placement = (job.node, job.num_nodes, job.world_size, job.local_world_size)
            if placement != (req.node, req.num_nodes, req.world_size, req.local_world_size):
                raise InvalidRequestError(
                    f"step {req.step}: rank {req.rank} says node {req.node}/{req.num_nodes}, world "
                    f"{req.world_size}, local world {req.local_world_size}; earlier ranks said node "
                    f"{job.node}/{job.num_nodes}, world {job.world_size}, local world {job.local_world_size}"
                )
            return job

    def _forget_old_jobs(self) -> None:
        """Keep the records of the newest finished steps only (status of older ones comes from storage)."""
        finished = sorted(s for s, j in self.jobs.items() if j.state in FINAL_STATES)
        for step in finished[:-KEEP_FINISHED_JOBS]:
            del self.jobs[step]

    # --- writing ----------------------------------------------------------------------------------
    async def _write_rank(self, job: StepJob, save: RankSave) -> None:
        lease = save.lease
        # Let the node's other ranks finish their copies before disk writes compete with them for CPU and
        # memory bandwidth: the data is safe in the arena already, and the stall is what training feels.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(job.all_staged.wait(), self.config.stage_grace_s)
        try:
            async with asyncio.TaskGroup() as tg:
                for meta in save.request.shards:
                    tg.create_task(self._write_shard(job, save, meta))
        except* Exception as group:
            job.fail(self.root.backend.error(_first_leaf(group)))
        finally:
            self.arena.release(lease)

    async def _write_shard(self, job: StepJob, save: RankSave, meta: ShardMeta) -> None:
        lease = save.lease
        numel = math.prod(meta.shape)
        offset = lease.offsets[meta.slot]
        data = np.frombuffer(self.arena.mm, dtype=storage_dtype(meta.dtype), count=numel, offset=offset)
        data = data.reshape(meta.shape)
        if self._hold_for_packing(job, save, meta, data):
            self.arena.release_slot(lease, meta.slot)
            return
        await self._write_block(job, save, meta, data)
        self.arena.release_slot(lease, meta.slot)

    def _hold_for_packing(self, job: StepJob, save: RankSave, meta: ShardMeta, data: np.ndarray) -> bool:
        """Keep a copy of a small array's block until the node's other ranks arrived (see packing.py)."""
        if job.state != "pending" or not packable(meta, self._pack_bytes):
            return False
        if job.held_bytes + data.nbytes > self._pack_budget:
            return False
        job.held.setdefault(meta.key, []).append(HeldBlock(save.request.rank, meta, data.copy()))
        job.held_bytes += data.nbytes
        return True

    async def _write_held(self, job: StepJob) -> None:
        """Write the held small-array blocks: one object per array the node holds whole, else as they came."""
        held, job.held, job.held_bytes = job.held, {}, 0
        async with asyncio.TaskGroup() as tg:
            for blocks in held.values():
                if covers_whole(blocks):
                    first = min(blocks, key=lambda b: b.rank)
                    shape = list(first.meta.global_shape)
                    whole = msgspec.structs.replace(
                        first.meta, global_offset=[0] * len(shape), shape=shape, chunk_shape=shape
                    )
                    tg.create_task(self._write_block(job, job.saves[first.rank], whole, assemble(blocks)))
                else:
                    for b in blocks:
                        tg.create_task(self._write_block(job, job.saves[b.rank], b.meta, b.data))

    async def _write_block(self, job: StepJob, save: RankSave, meta: ShardMeta, data: np.ndarray) -> None:
        """Write one block (whole chunks of its array) and record it for the node part."""
        chunks = plan_chunks(meta.chunk_shape, itemsize(meta.dtype), self.config.chunk_bytes)
        check_region(meta.key, meta.global_shape, meta.global_offset, meta.shape, chunks)
        path = f"{step_dir(job.step)}/{meta.key}"
        arr = None
        if self.config.codec != "raw":  # compressed chunks go through zarr's codec pipeline
            arr_meta = await array_metadata(meta.dtype, meta.global_shape, chunks, codec=self.config.codec)
            arr = open_for_write(self.root.store, path, arr_meta)
        coords_list = list(region_chunks(meta.global_offset, meta.shape, chunks))
        records: list[ChunkRecord | None] = [None] * len(coords_list)

        async def one(i: int, coords: tuple[int, ...]) -> None:
            block = data[chunk_selection_of(coords, chunks, meta.global_shape, meta.global_offset)]
            key = f"{path}/{chunk_key(coords)}"
            async with self._chunk_slots:
                if arr is None:
                    crc = await self._sink.put(key, block)
                else:
                    crc = await checksum(block)
                    await arr.setitem(chunk_selection(coords, chunks, meta.global_shape), block)
            records[i] = ChunkRecord(list(coords), block.nbytes, crc)
            job.written_keys.append(key)

        async with asyncio.TaskGroup() as tg:
            for i, coords in enumerate(coords_list):
                tg.create_task(one(i, coords))
        rec = ShardRecord(save.request.rank, list(meta.global_offset), list(meta.shape), [r for r in records if r])
        save.records.append((meta, rec))

    async def _finish_node(self, job: StepJob) -> None:
        await asyncio.gather(*job.tasks.values(), return_exceptions=True)
        if job.state != "pending":
            if job.state == "failed":  # a write failed
                if job.node == 0 and job.error is not None:
                    await self._note_failure(job, job.error)
                self._log_step(job)
            return
        try:
            try:
                await self._write_held(job)
            except* Exception as group:
                raise _first_leaf(group) from group
            written = time.monotonic()
            await self.root.make_durable(job.written_keys, synced=self.config.codec == "raw")
            part = self._part(job)
            await self.root.write_part(part)
            job.state, job.durable_at = "durable", time.monotonic()
            log.debug("step=%d node=%d data written %.3fs after the first save, durable %.3fs later",
                      job.step, job.node, written - job.started, job.durable_at - written)
            if job.node == 0:
                await self.root.commit(job.step, job.num_nodes, self.config.commit_timeout_s)
                if self.config.keep:
                    await self.root.retain(self.config.keep)
            else:
                await self.root.wait_committed(
                    job.step, self.config.commit_timeout_s, since=job.started_wall - CLOCK_SKEW_S
                )
        except Exception as exc:
            err = self.root.backend.error(exc)
            job.fail(err)
            if job.node == 0:
                await self._note_failure(job, err)
        else:
            job.state = "committed"
            job.finished.set()
        self._log_step(job)

    async def _note_failure(self, job: StepJob, exc: CkptdError) -> None:
        try:
            await self.root.mark_failed(job.step, exc)
        except Exception as note_exc:
            log.warning("step=%d node=%d: could not record the failure: %s", job.step, job.node, note_exc)

    def _part(self, job: StepJob) -> PartManifest:
        # One record per (rank, array): the coordinator's merge checks that all ranks agree on each array.
        arrays = [
            ArrayRecord(
                meta.key, meta.dtype, list(meta.global_shape),
                list(plan_chunks(meta.chunk_shape, itemsize(meta.dtype), self.config.chunk_bytes)), [rec],
                self.config.codec,
            )
            for save in job.saves.values()
            for meta, rec in save.records
        ]
        return PartManifest(
            format=FORMAT_VERSION,
            step=job.step,
            node=job.node,
            num_nodes=job.num_nodes,
            world_size=job.world_size,
            ranks=sorted(job.saves),
            arrays=sorted(arrays, key=lambda a: (a.name, a.shards[0].rank)),
            objects={str(r): s.request.objects for r, s in sorted(job.saves.items()) if s.request.objects},
            nbytes=job.nbytes,
            written_at=time.time(),
        )

    async def _watch_part_timeout(self, job: StepJob) -> None:
        timeout = self.config.part_timeout_s
        staged = asyncio.ensure_future(job.all_staged.wait())
        ended = asyncio.ensure_future(job.finished.wait())  # failed for another reason meanwhile
        try:
            await asyncio.wait((staged, ended), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            staged.cancel()
            ended.cancel()
        if job.state == "pending" and not job.all_staged.is_set():
            missing = job.local_world_size - len(job.saves)
            err = SaveTimeoutError(
                f"step {job.step} node {job.node}: {missing} of {job.local_world_size} local ranks never saved "
                f"within {timeout:.0f}s; the step is abandoned (staged data of the others is released)"
            )
            job.fail(err)
            for task in job.tasks.values():
                task.cancel()
            if job.node == 0:
                await self._note_failure(job, err)
            self._log_step(job)

    # --- status -----------------------------------------------------------------------------------
    async def status(self, step: int, wait_s: float) -> tuple[str, CkptdError | None]:
        job = self.jobs.get(step)
        if job is None:
            with self._typed_storage_errors():
                committed = await self.root.is_committed(step)
            if committed:
                return "committed", None
            return "unknown", None
        if wait_s > 0 and not job.finished.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job.finished.wait(), wait_s)
        return job.state, job.error

    # --- lifecycle --------------------------------------------------------------------------------
    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def in_flight(self) -> list[StepJob]:
        return [j for j in self.jobs.values() if j.state not in FINAL_STATES]

    async def drain(self, grace: float) -> bool:
        """Stop accepting saves; wait up to ``grace`` seconds for in-flight steps. True if all finished."""
        self.draining = True
        pending = [j.finished.wait() for j in self.in_flight()]
        if not pending:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*pending), grace)
            return True
        except TimeoutError:
            return False

    def _log_step(self, job: StepJob) -> None:
        took = time.monotonic() - job.started
        mib = job.nbytes / 2**20
        retries = ""
        metrics = self.root.backend.metrics
        if metrics is not None and job.retries_before is not None:  # S3: retried requests during the step
            retries = f" s3_retries={metrics.since(job.retries_before).describe()}"
        log.info(
            "step=%d node=%d state=%s bytes=%.1fMiB took=%.2fs throughput=%.0fMiB/s queue=%d arena_free=%.0fMiB%s%s",
            job.step, job.node, job.state, mib, took, mib / took if took > 0 else 0.0, len(self.in_flight()),
            self.arena.free_bytes / 2**20, retries, f" error={job.error}" if job.error else "",
        )

    @contextlib.contextmanager
    def _typed_storage_errors(self) -> Iterator[None]:
        """Storage failures outside a step's own writes (lookups while accepting a save, status) reach the
        client as typed errors instead of breaking its connection."""
        try:
            yield
        except CkptdError:
            raise
        except Exception as exc:
            raise self.root.backend.error(exc) from exc


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
