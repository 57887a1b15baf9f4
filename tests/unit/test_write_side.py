"""The daemon's write side where a failure meets a save: a save refused because its step failed meanwhile
gives its staging space back; retention never removes a step the daemon is still writing (steps may commit
out of order); a commit makes its metadata durable before the marker; an attempt given up ends without holding
up other steps' saves, and a retried attempt's bytes are never overwritten by the failed one's late writes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptd.client.protocol import PROTOCOL_VERSION, PrepareStep, SaveRequest, ShardMeta, StepState
from ckptd.daemon.arena import Arena
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.job import InFlightSteps, NodeStep, StepJob
from ckptd.daemon.service import CheckpointService
from ckptd.writer import arrays
from ckptd.writer import format as fmt
from ckptd.writer.arrays import ChunkSink
from ckptd.writer.backends import open_backend
from ckptd.writer.checksum import crc32c
from ckptd.writer.commit import CheckpointWriter, plan_retention
from ckptd.writer.errors import CkptdError, StepFailedError, StorageError


@contextlib.asynccontextmanager
async def _service(tmp_path: Path, **config: Any) -> AsyncIterator[tuple[CheckpointService, Arena]]:
    """A daemon's service over a local root and a 1 MiB arena under ``tmp_path``, in this process."""
    (tmp_path / "shm").mkdir()
    cfg = DaemonConfig(root=str(tmp_path / "root"), socket=str(tmp_path / "s.sock"), arena_size=1 << 20,
                       retain=False, **config)
    arena = Arena(cfg.arena_size, shm_dir=str(tmp_path / "shm"), prefault=False)
    try:
        yield CheckpointService(cfg, arena, await open_backend(cfg.root, None, create=True)), arena
    finally:
        arena.close()


def test_a_save_refused_because_its_step_failed_meanwhile_gives_its_lease_back(tmp_path: Path) -> None:
    """The step fails (another rank's write, the part timeout) while this save's accept writes the layout
    sidecar; the save is refused, and its lease, already adopted by the step, is freed, not leaked."""
    async def go() -> tuple[int, int, int]:
        async with _service(tmp_path) as (svc, arena):
            write_sidecar = svc.root.write_sidecar
            writing, failed = asyncio.Event(), asyncio.Event()

            async def slow_sidecar(name: str, text: str) -> None:  # an S3 round trip or two, lasting until ...
                writing.set()
                await failed.wait()  # ... the step failed meanwhile
                await write_sidecar(name, text)

            svc.root.write_sidecar = slow_sidecar  # type: ignore[method-assign]
            lease = await arena.lease(7, [4096], 1.0)
            text = '{"layout": 1}'
            req = SaveRequest(v=PROTOCOL_VERSION, lease_id=lease.lease_id, step=5, rank=0, world_size=2, node=0,
                              num_nodes=1, local_world_size=2, objects={}, sidecars={fmt.sidecar_name(text): text},
                              shards=[ShardMeta("w", "float32", [1024], [0], [1024], [1024], 0)])
            accept = asyncio.create_task(svc.accept(req, 7))
            await asyncio.wait_for(writing.wait(), 60)  # the accept is writing the sidecar
            svc.jobs[5].fail(StorageError("rank 1's write failed"))
            failed.set()
            with pytest.raises(CkptdError):
                await accept
            return arena.free_bytes, arena.size, arena.leases

    free, size, leases = asyncio.run(go())
    assert (free, leases) == (size, 0)


def test_retention_never_removes_a_step_still_being_written(tmp_path: Path) -> None:
    """Step 11 is still being written when step 12 commits (a chunk of 11 in retry backoff): ``--keep``
    removes older unfinished steps, but not one the daemon has in flight."""
    assert plan_retention([10, 12], [10, 11, 12], 2) == [11]  # an unfinished step left by a crash
    assert plan_retention([10, 12], [10, 11, 12], 2, busy={11}) == []
    assert plan_retention([10, 12], [10, 11, 12], 1, busy={11}) == [10]
    # 11 then commits, after 12: its own commit's retention (11 still in flight there) does not remove it
    assert plan_retention([10, 11, 12], [10, 11, 12], 1, busy={11}) == [10]

    async def go() -> tuple[list[int], bool]:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            writer, sink = CheckpointWriter(backend), ChunkSink(backend)
            for step in (10, 11, 12):
                await sink.put(f"{fmt.step_dir(step)}/x/c.0", np.zeros(4, "float32"))
            for step in (10, 12):
                await writer.write_marker(step, b"{}")
            removed = await writer.retain(2, busy={11})
            return removed, await backend.exists(f"{fmt.step_dir(11)}/x/c.0")

    removed, kept = asyncio.run(go())
    assert removed == [] and kept


def test_retention_spares_a_step_started_while_it_deletes(tmp_path: Path) -> None:
    """The daemon's steps in flight are asked for again before each delete: an old step number saved
    again (a retry, a rollback) while retention removes older steps is spared."""
    jobs: dict[int, StepJob] = {}

    async def go() -> tuple[list[int], bool]:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            writer, sink = CheckpointWriter(backend), ChunkSink(backend)
            for step in (9, 10, 11, 12):
                await sink.put(f"{fmt.step_dir(step)}/x/c.0", np.zeros(4, "float32"))
            await writer.write_marker(12, b"{}")
            delete_step = writer.delete_step

            async def delete_and_meanwhile(step: int) -> None:
                await delete_step(step)
                jobs[10] = StepJob(NodeStep(10, 0, 1, 1, 1))  # a rank saves step 10 again meanwhile

            writer.delete_step = delete_and_meanwhile  # type: ignore[method-assign]
            removed = await writer.retain(1, busy=InFlightSteps(jobs))
            return removed, await backend.exists(f"{fmt.step_dir(10)}/x/c.0")

    removed, kept = asyncio.run(go())
    assert removed == [9, 11] and kept


def test_retention_spares_a_step_that_failed_while_other_nodes_may_still_wait_for_its_note(tmp_path: Path) -> None:
    """A step the coordinator failed is kept for the commit timeout: another node still waiting for its
    commit learns the cause only from the failure note (deleted, it would wait out its timeout and report
    a timeout). Older failures, and failed steps this daemon no longer tracks, go as before."""
    jobs: dict[int, StepJob] = {step: StepJob(NodeStep(step, 0, 1, 1, 1)) for step in (10, 11)}
    for step in (10, 11):
        jobs[step].fail(StepFailedError(f"step {step}: a node's part did not arrive"))
    jobs[10].failed_at -= 601.0  # failed longer ago than the commit timeout

    async def go() -> tuple[list[int], bool, bool]:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            writer, sink = CheckpointWriter(backend), ChunkSink(backend)
            for step in (9, 10, 11, 12):
                await sink.put(f"{fmt.step_dir(step)}/x/c.0", np.zeros(4, "float32"))
            await writer.mark_failed(11, StepFailedError("step 11: a node's part did not arrive"))
            await writer.write_marker(12, b"{}")
            removed = await writer.retain(1, busy=InFlightSteps(jobs, failed_grace_s=600.0))
            note, old = fmt.failed_marker(11), f"{fmt.step_dir(10)}/x/c.0"
            return removed, await backend.exists(note), await backend.exists(old)

    removed, note_kept, old_kept = asyncio.run(go())
    assert removed == [9, 10] and note_kept and not old_kept
    assert 11 in InFlightSteps(jobs, failed_grace_s=600.0) and 11 not in InFlightSteps(jobs)


def test_a_commit_makes_its_metadata_durable_before_the_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a local root the arrays' and groups' ``zarr.json`` are written in place: one sync of the filesystem
    makes them durable before ``COMMITTED`` is written (else a crash could leave a marker over empty docs)."""
    order: list[str] = []

    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            writer, sink = CheckpointWriter(backend), ChunkSink(backend)
            block = np.arange(4, dtype=np.float32)
            crc, _ = await sink.put(f"{fmt.step_dir(1)}/x/{fmt.chunk_key([0], fmt.CHUNK_SEPARATOR)}", block)
            rec = fmt.ArrayRecord("x", "float32", [4], [4],
                                  [fmt.ShardRecord(0, [0], [4], [fmt.ChunkRecord([0], 16, crc)])],
                                  separator=fmt.CHUNK_SEPARATOR)
            await writer.write_part(fmt.PartManifest(fmt.FORMAT_VERSION, 1, 0, 1, 1, [0], [rec], {}, 0, 0.0))
            sync_all, write_marker = backend.sync_all, writer.write_marker

            async def synced() -> None:
                order.append("sync")
                await sync_all()

            async def marker(step: int, data: bytes) -> None:
                order.append("marker")
                await write_marker(step, data)

            monkeypatch.setattr(backend, "sync_all", synced)
            monkeypatch.setattr(writer, "write_marker", marker)
            await writer.commit(1, 1, timeout=5)
            assert await writer.is_committed(1)

    asyncio.run(go())
    assert order == ["sync", "marker"]


def test_an_attempt_given_up_ends_outside_the_job_lock(tmp_path: Path) -> None:
    """Restarted ranks give an unfinished attempt at step 3 up while its failure note is slow to write (a
    storage call in retry backoff): another step's saves go on meanwhile (the job lock is not held), and the
    new attempt at step 3 starts only once the note is written."""
    events: list[str] = []

    def prep(step: int, rank: int, attempt: str) -> PrepareStep:
        return PrepareStep(v=PROTOCOL_VERSION, step=step, rank=rank, world_size=2, node=0, num_nodes=1,
                           local_world_size=2, attempt=attempt)

    async def go() -> StepJob:
        async with _service(tmp_path) as (svc, _arena):
            mark_failed = svc.root.mark_failed
            note_started, step_4_prepared = asyncio.Event(), asyncio.Event()

            async def slow_note(step: int, error: BaseException, **kw: object) -> None:
                events.append("note started")
                note_started.set()
                await step_4_prepared.wait()  # slow storage: still writing while step 4 is prepared
                await mark_failed(step, error, **kw)
                events.append("note written")

            svc.root.mark_failed = slow_note  # type: ignore[method-assign]
            await svc.prepare(prep(3, 0, "runA.1"))  # run A's rank 1 never saves step 3
            old = svc.jobs[3]

            async def prepared(step: int, rank: int) -> None:
                await svc.prepare(prep(step, rank, "runB.1"))
                events.append(f"step {step} rank {rank} prepared")

            new = asyncio.create_task(prepared(3, 1))
            await asyncio.wait_for(note_started.wait(), 60)  # the give-up's note is being written
            await asyncio.wait_for(prepared(4, 0), 60)  # not behind the note (which waits for this)
            step_4_prepared.set()
            await new
            assert old.state is StepState.FAILED and old.superseded
            return svc.jobs[3]

    job = asyncio.run(go())
    assert events == ["note started", "step 4 rank 0 prepared", "note written", "step 3 rank 1 prepared"]
    assert job.attempt == "runB.1" and job.state is StepState.PENDING


def test_a_failed_attempts_late_write_never_lands_over_the_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt A of step 5 fails on rank 0's write while rank 1's write of A is still in a slow storage call;
    both ranks retry at once (attempt B, other values). B starts only once A's write returned, so the step
    commits B's bytes under B's manifest (before: A's chunk landed after B's commit, a committed step whose
    chunk held the failed attempt's data)."""
    put = arrays._put_local
    calls: dict[str, int] = {}

    def storage(path: str, block: Any, *args: Any, **kwargs: Any) -> Any:
        name = "w" if "/w/" in path else "v"
        calls[name] = calls.get(name, 0) + 1
        if calls[name] == 1 and name == "w":
            raise OSError(errno.EIO, "injected: rank 0's write in attempt A")
        if calls[name] == 1:
            time.sleep(0.5)  # rank 1's write in attempt A: slow storage
        return put(path, block, *args, **kwargs)

    monkeypatch.setattr(arrays, "_put_local", storage)

    async def go() -> tuple[list[StepState], bytes, int]:
        async with _service(tmp_path, stage_grace_s=0.0) as (svc, arena):
            async def save(rank: int, key: str, value: float, attempt: str, owner: int) -> None:
                lease = await arena.lease(owner, [4096], 1.0)
                np.frombuffer(arena.mm, np.float32, 1024, lease.offsets[0])[:] = value
                await svc.accept(SaveRequest(
                    v=PROTOCOL_VERSION, lease_id=lease.lease_id, step=5, rank=rank, world_size=2, node=0,
                    num_nodes=1, local_world_size=2, objects={}, attempt=attempt,
                    shards=[ShardMeta(key, "float32", [1024], [0], [1024], [1024], 0)]), owner)

            states = []
            for n, value in ((1, 1.0), (2, 2.0)):
                await save(0, "w", value, f"run.{n}", 2 * n)
                await save(1, "v", value, f"run.{n}", 2 * n + 1)
                states.append((await svc.status(5, 10.0, f"run.{n}"))[0])
            await asyncio.sleep(0.7)  # attempt A's write, were it still running, would have landed by now
            commit = await svc.root.read_commit(5)
            record = next(a for a in commit.arrays if a.name == "v")
            return states, (tmp_path / "root" / "step_5" / "v" / "c.0").read_bytes(), record.shards[0].chunks[0].crc32c

    states, stored, crc = asyncio.run(go())
    assert states == [StepState.FAILED, StepState.COMMITTED]
    assert int(crc32c(stored[:-4])) == crc
    assert np.all(np.frombuffer(stored[:-4], np.float32) == 2.0)
