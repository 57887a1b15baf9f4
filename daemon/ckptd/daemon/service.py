"""The daemon's work: validate saves, have their shards written, write the node part, commit.

One :class:`~ckptd.daemon.job.StepJob` per step on this node (its states live in job.py). Each accepted rank save
becomes a task of the :class:`~ckptd.daemon.writes.ShardWriter`, which writes its shards chunk by chunk and frees
each arena slot as soon as its chunks are written. When every local rank's save is written the node part manifest
goes to storage; node 0's daemon then commits the step, the others wait for the marker. No process group here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeGuard

import msgspec

from ckptd.client.protocol import PrepareStep, SaveRequest, StepState
from ckptd.daemon.arena import Arena, Lease
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.job import InFlightSteps, NodeStep, RankSave, StepJob
from ckptd.daemon.journal import JournalEntry, StepJournal
from ckptd.daemon.plans import PlanRegistry, check_placement, check_save, check_steps_in_flight
from ckptd.daemon.replicas import node_replicas
from ckptd.daemon.restore import Retention
from ckptd.daemon.stats import DaemonStats
from ckptd.daemon.writes import ShardWriter
from ckptd.writer.backends import Backend
from ckptd.writer.commit import CLOCK_SKEW_S, CheckpointWriter
from ckptd.writer.errors import (
    CkptdError,
    DaemonShuttingDownError,
    DuplicateSaveError,
    InvalidRequestError,
    LeaseError,
    SaveTimeoutError,
    StepCommittedError,
    StepFailedError,
    first_leaf,
)
from ckptd.writer.format import (
    CHUNK_SEPARATOR,
    FORMAT_VERSION,
    ArrayRecord,
    PartManifest,
    check_sidecar,
    itemsize,
    other_attempt,
    part_key,
    plan_chunks,
)

log = logging.getLogger(__name__)

KEEP_FINISHED_JOBS = 64
SUPERSEDE_WAIT_S = 20.0  # a new attempt's rank waits this long for its node's earlier attempt to end

Task = asyncio.Task[None]
Tasks = set[Task]
# Starts a background task of the service (the server passes its task group's); the name is for logs.
Spawn = Callable[[Coroutine[Any, Any, None], str], Task]


class CheckpointService:
    """Everything the daemon does with saves, independent of the socket that delivers them.

    ``spawn`` starts its background tasks (writes, step completion, timeouts): the server passes one that
    puts them in its task group, so shutdown can cancel them; by default they are plain loop tasks.
    """

    def __init__(
        self, config: DaemonConfig, arena: Arena, backend: Backend, spawn: Spawn | None = None,
        stats: DaemonStats | None = None,
    ) -> None:
        self.config = config
        self.stats = stats or DaemonStats()
        self.arena = arena
        self.root = CheckpointWriter(backend)
        self.jobs: dict[int, StepJob] = {}
        self.draining = False
        self.writer = ShardWriter(config, arena, backend)
        self._job_lock = asyncio.Lock()
        self._background: Tasks = set()
        self._spawn: Spawn = spawn or self._spawn_detached
        self._sidecars_stored: set[str] = set()
        self.plans = PlanRegistry(chunk_bytes=config.chunk_bytes)
        # in-memory restore of the newest committed step, unless turned off (``retain = false``)
        self.retention = Retention(arena, enabled=config.retain)
        self.writer.retention = self.retention
        self.journal: StepJournal | None = None  # set by the server: steps in flight, for a successor

    # --- accepting saves --------------------------------------------------------------------------
    async def accept(self, req: SaveRequest, owner: int, since: float = 0.0) -> int:
        """Validate a rank's save and start writing it. Returns the bytes accepted.

        ``since`` is when the rank's connection began: a rank connected before its node's attempt at the
        step failed, and not part of that attempt yet, is a late member of it and gets its error (once);
        a rank that saved in it, or connected after it failed (a restarted rank), starts a new attempt.
        """
        if self.draining:
            raise DaemonShuttingDownError("the daemon is shutting down and accepts no new saves")
        lease = self.arena.get(req.lease_id, owner)
        if lease is None:
            raise LeaseError(f"lease {req.lease_id} was never granted to this connection (or is already used)")
        span: Lease | None = None
        if req.plan_id:  # a registered plan: its shards were validated when it was registered
            self._validate(msgspec.structs.replace(req, shards=[]), lease)
            span = lease
            req, lease = self.plans.expand(req, lease)
        else:
            self._validate(req, lease)
        for name, text in req.sidecars.items():
            check_sidecar(name, text)
        job = await self._open_job(req, since)
        for name, text in req.sidecars.items():
            if name not in self._sidecars_stored:
                with self._typed_storage_errors():
                    await self.root.write_sidecar(name, text)
                self._sidecars_stored.add(name)
        self.arena.adopt(span or lease)
        save = RankSave(req, lease, staged=(span or lease).nbytes)
        nbytes = sum(lease.sizes[s.slot] for s in req.shards)
        try:
            last = job.add_save(save, nbytes)  # refused if the step failed while the sidecar was written
        except BaseException:
            self.arena.release(span or lease)  # adopted, and no job took it: nothing else would free it
            raise
        self.stats.on_save(req.stall_s)
        write = self.writer.write_rank(job, save) if span is None else self._write_span(job, save, span)
        job.tasks[req.rank] = self._spawn(write, f"write step={req.step} rank={req.rank}")
        if last:
            job.aside.append(self._spawn(self._finish_node(job), f"finish step={req.step}"))
        return nbytes

    async def _write_span(self, job: StepJob, save: RankSave, span: Lease) -> None:
        """A plan save's write: its per-shard lease frees nothing; the span goes at the end (or stays, whole)."""
        kept = False
        try:
            await self.writer.write_rank(job, save)
            kept = job.state is StepState.PENDING and self.retention.keep_span(job.step, span)
        finally:
            if not kept:
                self.arena.release(span)

    async def prepare(self, req: PrepareStep, since: float = 0.0) -> None:
        """Start ``req.step`` on this node ahead of the rank's save (its copy runs meanwhile): the checks
        :meth:`accept` makes before it takes the data, with the same typed errors. The job it starts is
        the one the save joins; a rank that never saves after it fails the step by ``--part-timeout``,
        as a rank that never saves at all does."""
        if self.draining:
            raise DaemonShuttingDownError("the daemon is shutting down and accepts no new saves")
        check_placement(req)
        await self._open_job(req, since)

    async def _open_job(self, req: SaveRequest | PrepareStep, since: float) -> StepJob:
        """The step's job on this node, started if it has none, that ``req.rank`` may still save into."""
        with self._typed_storage_errors():
            job = await self._job_for(req, since)
        if req.rank in job.saves:
            raise DuplicateSaveError(f"rank {req.rank} already saved step {req.step}")
        if job.state is not StepState.PENDING:
            raise StepFailedError(f"step {req.step} is already {job.state} on this node: {job.error}")
        return job

    def _validate(self, req: SaveRequest, lease: Lease) -> None:
        check_placement(req)
        check_save(req, lease.sizes, self.config.chunk_bytes)  # shards, replicas, plain data: plans.py

    async def _job_for(self, req: SaveRequest | PrepareStep, since: float = 0.0) -> StepJob:
        waited = False
        while not isinstance(job := await self._job_locked(req, since, waited), StepJob):
            if job is not None:  # a failed attempt's writes and note end first, outside the lock
                await asyncio.wait(job)
                continue
            waited = True  # another attempt, all its ranks saved, may still commit: wait a while, outside the lock
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.jobs[req.step].finished.wait(), SUPERSEDE_WAIT_S)
        return job

    async def _job_locked(self, req: SaveRequest | PrepareStep, since: float, waited: bool) -> StepJob | Tasks | None:
        """:meth:`_job_for` under the lock. None: another attempt in flight, all its ranks saved, not waited
        for; tasks: a failed attempt at the step still ending (cancelled writes returning from storage, its
        note): the new one, writing the same keys, starts once they ended."""
        async with self._job_lock:
            job = self.jobs.get(req.step)
            if _another_in_flight(job, req):
                if not _waits_for_ranks(job):
                    if not waited:
                        return None
                    raise self._busy(job, req)
                self._give_up(job, req)
            if (job is not None and job.state is StepState.FAILED and job.error is not None
                    and req.rank not in job.saves and req.rank not in job.told and _late(job, req, since)):
                # A new attempt would wait for ranks that already heard of the failure (until --part-timeout)
                job.told.add(req.rank)
                raise job.error
            if job is not None and job.state is StepState.FAILED and (busy := job.unsettled()):
                return busy
            # A failed step may be saved again; one committed here, once its marker is gone (deleted: a rollback)
            if job is None or job.state in (StepState.FAILED, StepState.COMMITTED):
                check_steps_in_flight([s for s, j in self.jobs.items() if j.state is StepState.PENDING], req.step)
                left = await self.root.leftovers(req.step, req.node)
                if left.committed:
                    raise StepCommittedError(f"step {req.step} already committed under {self.config.root} (a "
                                             "rollback? `ckptd gc ROOT --after STEP` removes the abandoned steps)")
                if left.part:
                    await self.root.discard_part(req.step, req.node)
                if left.failed and req.node == 0 and not req.attempt:  # a named attempt ignores others' notes
                    await self.root.clear_failed(req.step)
                self.retention.step_failed(req.step)  # what a failed attempt kept serves no restore of this one
                metrics = self.root.backend.metrics
                job = StepJob(
                    NodeStep(req.step, req.node, req.num_nodes, req.world_size, req.local_world_size),
                    retries_before=metrics.snapshot() if metrics is not None else None, attempt=req.attempt,
                )
                job.earlier, self.jobs[req.step] = self.jobs.get(req.step), job  # its status stays askable
                if job.earlier is not None:
                    job.earlier.earlier = None
                self._forget_old_jobs()
                job.aside.append(self._spawn(self._watch_part_timeout(job), f"timeout step={req.step}"))
                if self.journal is not None:
                    entry = self.journal.started(req.step, req.node, req.num_nodes, req.attempt)
                    self._spawn(self._journal_until_final(job, self.journal, entry), f"journal step={req.step}")
            w = job.where
            if NodeStep(req.step, req.node, req.num_nodes, req.world_size, req.local_world_size) != w:
                raise InvalidRequestError(
                    f"step {req.step}: rank {req.rank} says node {req.node}/{req.num_nodes}, world "
                    f"{req.world_size}, local world {req.local_world_size}; earlier ranks said node "
                    f"{w.node}/{w.num_nodes}, world {w.world_size}, local world {w.local_world_size}"
                )
            return job

    def _give_up(self, job: StepJob, req: SaveRequest | PrepareStep) -> None:
        """A rank saves ``job``'s step in another attempt than ``job``'s while ``job`` still waits for ranks
        of its own: its processes were restarted, or the save is retried, so the missing ranks will never
        save into it. It fails at once (not after ``--part-timeout``); its writes in flight are cancelled;
        a note tells the other nodes' daemons, still in that attempt, to stop waiting for it. Both end in
        ``job.aside``, outside the job lock (a storage call stuck, a note in retry backoff delays no other
        step's saves); the new attempt starts, writing the same keys, once it ended. (An attempt whose ranks
        all saved may still commit: the rank waits :data:`SUPERSEDE_WAIT_S` for it, then gets :meth:`_busy`'s.)"""
        err = StepFailedError(
            f"step {job.step} node {job.node}: attempt {job.attempt} given up: rank {req.rank} started "
            f"attempt {req.attempt} of the step while {job.missing_ranks} of its ranks had not saved"
        )
        job.superseded = True  # the part-timeout watch leaves the note and the log to this
        if not job.fail(err):
            return
        for task in job.tasks.values():
            task.cancel()
        job.aside.append(self._spawn(self._end_given_up(job, err), f"give up step={job.step}"))

    async def _end_given_up(self, job: StepJob, err: StepFailedError) -> None:
        await asyncio.gather(*job.tasks.values(), return_exceptions=True)
        self.retention.step_failed(job.step)
        await self._note_failure(job, err, superseded=True)
        self._log_step(job)

    def _busy(self, job: StepJob, req: SaveRequest | PrepareStep) -> StepFailedError:
        return StepFailedError(
            f"step {req.step}: attempt {job.attempt} of it is still {job.state} on node {job.node} (all its "
            f"ranks saved; it commits or fails by --commit-timeout, {self.config.commit_timeout_s:.0f}s): "
            f"attempt {req.attempt} cannot start before it ended; save under another step number meanwhile"
        )

    @staticmethod
    async def _journal_until_final(job: StepJob, journal: StepJournal, entry: JournalEntry) -> None:
        await job.finished.wait()
        journal.ended(entry)

    def _forget_old_jobs(self) -> None:
        """Keep the records of the newest finished steps only (status of older ones comes from storage)."""
        finished = sorted(s for s, j in self.jobs.items() if j.final)
        for step in finished[:-KEEP_FINISHED_JOBS]:
            del self.jobs[step]

    # --- finishing a step -------------------------------------------------------------------------
    async def _finish_node(self, job: StepJob) -> None:
        await asyncio.gather(*job.tasks.values(), return_exceptions=True)
        if job.state is not StepState.PENDING:
            if job.state is StepState.FAILED:  # a write failed
                self.retention.step_failed(job.step)
                if job.error is not None:
                    await self._note_failure(job, job.error)
                self._log_step(job)
            return
        sent = False  # this node's part: once sent, the coordinator may commit it (no note contradicts that)
        try:
            try:
                await self.writer.write_held(job)
            except* Exception as group:
                raise first_leaf(group) from group
            written = time.monotonic()
            await self.root.make_durable(job.written_keys, synced=self.config.codec == "raw",
                                         whole_filesystem=job.unsynced)
            part, sent = self._part(job), True
            await self.root.write_part(part)
            job.mark_durable()
            log.debug("step=%d node=%d data written %.3fs after the first save, durable %.3fs later%s",
                      job.step, job.node, written - job.started, job.durable_at - written,
                      " (by one filesystem sync)" if job.unsynced else "")
            if job.node == 0:
                await self.root.commit(job.step, job.where.num_nodes, self.config.commit_timeout_s,
                                       attempt=job.attempt, since=job.started_wall - CLOCK_SKEW_S)
                if self.config.keep:
                    await self._retain()
            else:
                await self.root.wait_committed(job.step, self.config.commit_timeout_s, attempt=job.attempt,
                                               since=job.started_wall - CLOCK_SKEW_S, node=job.node)
        except Exception as exc:
            err = self.root.backend.error(exc)
            job.fail(err)
            if sent and not job.durable_at:  # its write failed: whether the part landed all the same
                sent = await self._part_there(job)
            await self._note_failure(job, err, part_sent=sent)
        else:
            job.mark_committed()
            self.retention.step_committed(job.step, job.started)
        if job.error is not None:  # failed: its kept slots serve no restore
            self.retention.step_failed(job.step)
        self._log_step(job)

    async def _retain(self) -> None:
        """Delete the steps ``--keep`` no longer keeps. A store that refuses deletes (a bucket policy, Object
        Lock) or fails one leaves them and a warning (never fails the commit); the next commit tries again."""
        try:  # never a step this node still writes (asked before each delete): steps may commit out of order
            await self.root.retain(self.config.keep, busy=InFlightSteps(self.jobs, self.config.commit_timeout_s))
        except Exception as exc:
            log.warning("retention (--keep %d): could not delete an older step, the next commit tries again: %s",
                        self.config.keep, self.root.backend.error(exc))

    async def _part_there(self, job: StepJob) -> bool:  # a failure to look counts as yes: never contradicted
        with contextlib.suppress(Exception):
            return await self.root.backend.exists(part_key(job.step, job.node))
        return True

    async def _note_failure(self, job: StepJob, exc: CkptdError, *, part_sent: bool = False, **extra: object) -> None:
        """Tell the other nodes: the coordinator always; another node while its part was never sent (the
        coordinator waiting for it stops at once, not at its timeout), as ``part_missing``."""
        if job.node != 0 and part_sent:
            if not job.attempt:  # unnamed: its part left there would pair with the next attempt's parts
                with contextlib.suppress(Exception):
                    await self.root.discard_part(job.step, job.node)
            return
        if job.node != 0:
            extra["part_missing"] = True
        try:
            await self.root.mark_failed(job.step, exc, attempt=job.attempt, node=job.node, **extra)
        except Exception as note_exc:
            log.warning("step=%d node=%d: could not record the failure: %s", job.step, job.node, note_exc)

    def _part(self, job: StepJob) -> PartManifest:
        # One record per (rank, array): the coordinator's merge checks that all ranks agree on each array.
        arrays = [
            ArrayRecord(
                meta.key, meta.dtype, list(meta.global_shape),
                list(plan_chunks(meta.chunk_shape, itemsize(meta.dtype), self.config.chunk_bytes)), [rec],
                self.config.codec, CHUNK_SEPARATOR,
            )
            for save in job.saves.values()
            for meta, rec in save.records
        ]
        return PartManifest(
            format=FORMAT_VERSION,
            step=job.step,
            node=job.node,
            num_nodes=job.where.num_nodes,
            world_size=job.where.world_size,
            ranks=sorted(job.saves),
            arrays=sorted(arrays, key=lambda a: (a.name, a.shards[0].rank)),
            objects={str(r): s.request.objects for r, s in sorted(job.saves.items()) if s.request.objects},
            nbytes=job.nbytes,
            written_at=time.time(),
            replicas=node_replicas(job.saves.values()),
            attempt=job.attempt,
            started_at=job.started_wall,
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
        if job.state is StepState.PENDING and not job.all_staged.is_set():
            local = job.where.local_world_size
            err = SaveTimeoutError(
                f"step {job.step} node {job.node}: {job.missing_ranks} of {local} local ranks never saved "
                f"within {timeout:.0f}s; the step is abandoned (staged data of the others is released)"
            )
            job.fail(err)
            for task in job.tasks.values():
                task.cancel()
            self.retention.step_failed(job.step)
            await self._note_failure(job, err)
            self._log_step(job)
        elif job.state is StepState.FAILED and not job.all_staged.is_set() and not job.superseded:
            # A write failed before the node's last rank arrived (later ones are refused): _finish_node
            # never runs for this step, so its failure is recorded (and told to the other nodes) here.
            self.retention.step_failed(job.step)
            if job.error is not None:
                await self._note_failure(job, job.error)
            self._log_step(job)

    # --- status -----------------------------------------------------------------------------------
    async def status(self, step: int, wait_s: float, attempt: str = "") -> tuple[StepState, CkptdError | None]:
        """The step's state on this node (waiting up to ``wait_s`` for a final one) and its error; with
        ``attempt``, that attempt's (an earlier one of the step, replaced by a newer, has failed)."""
        job = self.jobs.get(step)
        if job is not None and other_attempt(job.attempt, attempt):
            if job.earlier is None or other_attempt(job.earlier.attempt, attempt):
                return StepState.FAILED, StepFailedError(
                    f"step {step}: attempt {attempt} ended on node {job.node}; attempt {job.attempt} replaced it")
            job = job.earlier
        if job is None:
            with self._typed_storage_errors():
                committed = await self.root.is_committed(step)
            if committed:
                return StepState.COMMITTED, None
            return StepState.UNKNOWN, None
        if wait_s > 0 and not job.finished.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job.finished.wait(), wait_s)
        return job.state, job.error

    # --- lifecycle --------------------------------------------------------------------------------
    def _spawn_detached(self, coro: Coroutine[Any, Any, None], name: str) -> Task:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def in_flight(self) -> list[StepJob]:
        return [j for j in self.jobs.values() if not j.final]

    def due_slots(self, rank: int) -> list[int]:
        """The arena slots the node's other ranks' saves of the steps in flight still need: what a lease
        granted ahead for ``rank``'s next save must leave room for (:meth:`StepJob.due_slots`)."""
        spans = self.plans.spans()
        return [n for job in self.in_flight() for n in job.due_slots(rank, spans)]

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
        """Account for a step that ended (committed or failed) and shed what only its writing needed."""
        job.shed()
        took = time.monotonic() - job.started
        self.stats.on_step_end(job, took)
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


def _another_in_flight(job: StepJob | None, req: SaveRequest | PrepareStep) -> TypeGuard[StepJob]:
    """``job`` is an attempt at ``req``'s step other than ``req``'s, and has not ended on this node."""
    return job is not None and not job.final and other_attempt(job.attempt, req.attempt)


def _waits_for_ranks(job: StepJob) -> bool:
    """Still waiting for some of its node's ranks: an attempt restarted ranks may give up (it cannot commit
    without them)."""
    return job.state is StepState.PENDING and not job.all_staged.is_set()


def _late(job: StepJob, req: SaveRequest | PrepareStep, since: float) -> bool:
    """Whether a rank that did not save in ``job``'s failed attempt was meant to: the same named attempt,
    else (unnamed) connected before the failure."""
    return job.attempt == req.attempt if job.attempt and req.attempt else since < job.failed_at
