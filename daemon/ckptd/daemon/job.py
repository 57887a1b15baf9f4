"""One step on this node as a typed state machine: no I/O, every transition in one table.

::

    PENDING --mark_durable--> DURABLE --mark_committed--> COMMITTED
       |                         |
       +--------fail-------------+-----> FAILED

``COMMITTED`` and ``FAILED`` are final: a job never leaves them (a failed step saved again gets a new
job). A transition the table does not allow raises :class:`StepStateError`, except :meth:`StepJob.fail`
on a job that already ended, which is ignored: the first outcome stands (a write failure and the
part timeout may race).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

import msgspec

from ckptd.client.protocol import SaveRequest, ShardMeta, StepState
from ckptd.daemon.arena import Lease
from ckptd.daemon.packing import HeldBlock
from ckptd.writer.backends import RetryMetrics
from ckptd.writer.errors import CkptdError, DuplicateSaveError, StepStateError
from ckptd.writer.format import ShardRecord

__all__ = ["TRANSITIONS", "HeldBlocks", "NodeStep", "RankSave", "StepJob"]

TRANSITIONS: Mapping[StepState, frozenset[StepState]] = {
    StepState.PENDING: frozenset({StepState.DURABLE, StepState.FAILED}),
    StepState.DURABLE: frozenset({StepState.COMMITTED, StepState.FAILED}),
    StepState.COMMITTED: frozenset(),
    StepState.FAILED: frozenset(),
}


@dataclass(frozen=True)
class NodeStep:
    """Which step, on which node, of which job shape: fixed by the first rank that saves it."""

    step: int
    node: int
    num_nodes: int
    world_size: int
    local_world_size: int


@dataclass
class RankSave:
    """One local rank's accepted save: its request, its staging lease, and the shards written so far."""

    request: SaveRequest
    lease: Lease
    records: list[tuple[ShardMeta, ShardRecord]] = field(default_factory=list)
    staged: int = 0  # the arena bytes its lease took (a plan save: its span)


@dataclass
class HeldBlocks:
    """Copies of small arrays' blocks held until the node's other ranks arrived (see packing.py)."""

    blocks: dict[str, list[HeldBlock]] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, block: HeldBlock) -> None:
        self.blocks.setdefault(block.meta.key, []).append(block)
        self.nbytes += block.data.nbytes

    def take(self) -> dict[str, list[HeldBlock]]:
        """Hand over every held block and forget them."""
        blocks, self.blocks, self.nbytes = self.blocks, {}, 0
        return blocks


class StepJob:
    """A step's life on this node: its rank saves, what was written, and its state.

    ``finished`` is set on entering a final state; ``all_staged`` once every local rank's save was
    accepted. Both are plain events: waiting on them is the caller's business.
    """

    def __init__(self, where: NodeStep, retries_before: RetryMetrics | None = None, attempt: str = "") -> None:
        self.where = where
        self.attempt = attempt  # the ranks' attempt token (client/attempts.py); "" when unknown
        self.superseded = False  # given up for a newer attempt of the same step by restarted ranks
        self.earlier: StepJob | None = None  # the attempt at the step this one replaced (failed)
        # the node's work for the step beside its rank writes: the part-timeout watch, the finish, a give-up's end
        self.aside: list[asyncio.Task[None]] = []
        # timing
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.durable_at = 0.0
        self.retries_before = retries_before  # the backend's retry counters when the step began
        # the node's ranks and their writes
        self.saves: dict[int, RankSave] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.nbytes = 0
        self.written_keys: list[str] = []
        self.unsynced = False  # small chunks written without their own fsync: one filesystem sync makes them durable
        self.held = HeldBlocks()
        # state
        self._state = StepState.PENDING
        self._error: CkptdError | None = None
        self.finished = asyncio.Event()
        self.failed_at = 0.0  # monotonic time of the failure
        self.told: set[int] = set()  # late ranks of this failed attempt that were given its error
        self.all_staged = asyncio.Event()

    # --- identity ---------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.where.step

    @property
    def node(self) -> int:
        return self.where.node

    # --- state ------------------------------------------------------------------------------------
    @property
    def state(self) -> StepState:
        return self._state

    @property
    def error(self) -> CkptdError | None:
        """Why the step failed (``None`` unless :attr:`state` is ``FAILED``)."""
        return self._error

    @property
    def final(self) -> bool:
        return self._state.final

    def _move(self, to: StepState) -> None:
        if to not in TRANSITIONS[self._state]:
            raise StepStateError(f"step {self.step} node {self.node}: no transition {self._state} -> {to}")
        self._state = to
        if to.final:
            self.finished.set()

    def mark_durable(self) -> None:
        """The node's data and part manifest are on storage."""
        self._move(StepState.DURABLE)
        self.durable_at = time.monotonic()

    def mark_committed(self) -> None:
        """The step's commit marker is on storage."""
        self._move(StepState.COMMITTED)

    def fail(self, error: CkptdError) -> bool:
        """End the step with ``error``; False (and nothing changes) if it had already ended."""
        if self.final:
            return False
        self._error = error  # before the move: waiters woken by it find the error in place
        self.failed_at = time.monotonic()
        self._move(StepState.FAILED)
        self.held.take()  # small-array copies that will never be written
        return True

    def shed(self) -> None:
        """Drop what only writing the step needed, once it ended: the shard metas of each rank's request,
        its per-chunk records and the keys written. The daemon keeps its newest finished jobs for status
        (:data:`~ckptd.daemon.service.KEEP_FINISHED_JOBS`); at ~10,000 shards a rank these were ~70,000
        objects a step, kept alive, that every full garbage collection of the daemon walks again (each
        pause grew by ~50 ms a step kept, on the event loop that answers the ranks). What status reports
        (the ranks that saved, bytes, state, times, error) stays."""
        for save in self.saves.values():
            save.records = []
            save.request = msgspec.structs.replace(save.request, shards=[], replicas=[], objects={}, sidecars={})
        self.written_keys = []

    def unsettled(self) -> set[asyncio.Task[None]]:
        """Its tasks still running: rank writes (a cancelled one runs until its storage call returns), the
        finish, the part-timeout watch, a give-up's end. Another attempt at the step writes the same keys
        and notes: it starts once these ended."""
        return {t for t in (*self.tasks.values(), *self.aside) if not t.done()}

    # --- rank saves -------------------------------------------------------------------------------
    def add_save(self, save: RankSave, nbytes: int) -> bool:
        """Record an accepted rank save; True when it was the node's last local rank."""
        if self._state is not StepState.PENDING:
            raise StepStateError(f"step {self.step} node {self.node}: a save arrived in state {self._state}")
        rank = save.request.rank
        if rank in self.saves:  # two connections saying one rank, both past the check before their awaits
            raise DuplicateSaveError(f"rank {rank} already saved step {self.step} (two processes say rank {rank}?)")
        self.saves[rank] = save
        self.nbytes += nbytes
        if len(self.saves) == self.where.local_world_size:
            self.all_staged.set()
            return True
        return False

    @property
    def missing_ranks(self) -> int:
        """Local ranks that have not saved yet."""
        return self.where.local_world_size - len(self.saves)

    def due_slots(self, rank: int, spans: Mapping[int, int]) -> list[int]:
        """One arena slot for each local save still due for this step (``rank``'s aside): the span of the
        rank's registered plan (``spans``: rank -> bytes), else the largest save or plan seen; none once the
        step left PENDING."""
        due = self.missing_ranks - (rank not in self.saves)
        if self._state is not StepState.PENDING or not self.saves or due <= 0:
            return []
        known = [n for r, n in sorted(spans.items()) if r != rank and r not in self.saves][:due]
        largest = max(max(s.staged for s in self.saves.values()), max(spans.values(), default=0))
        return known + [largest] * (due - len(known))


class InFlightSteps(Collection[int]):
    """The steps of ``jobs`` (step -> its job on this node) that retention must spare, read at each use:
    those not final yet (retention asks again before each delete, so a step started while it lists and
    deletes is spared too), and those that failed within ``failed_grace_s``: another node may still be
    waiting for the step's commit, and only its failure note tells it the step failed (deleted, the node
    would wait out its commit timeout and report a timeout instead of the cause)."""

    def __init__(self, jobs: Mapping[int, StepJob], failed_grace_s: float = 0.0) -> None:
        self._jobs = jobs
        self._grace_s = failed_grace_s

    def _spared(self, job: StepJob) -> bool:
        return not job.final or (job.state is StepState.FAILED and time.monotonic() - job.failed_at < self._grace_s)

    def __contains__(self, step: object) -> bool:
        job = self._jobs.get(step) if isinstance(step, int) else None
        return job is not None and self._spared(job)

    def __iter__(self) -> Iterator[int]:
        return iter([step for step, job in self._jobs.items() if self._spared(job)])

    def __len__(self) -> int:
        return sum(1 for _ in self)
