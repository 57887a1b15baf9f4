"""The daemon's staging arena as one client maps it: the shared memory a save copies its shards into.

The daemon owns the arena file (mode 0600, the job's user only: a client maps no other); a client maps it
once per connection, faults its pages in up front so ``save()`` does not pay for that, and registers it as
pinned host memory the first time a CUDA tensor is staged, so device-to-host copies land in it directly.

A plan's static sources copied ahead of a save's checks (:mod:`ckptd.client.early`) are, on a GPU, queued
device-to-host transfers; on a CPU with a core to spare for this rank (:func:`spare_core`) the memcpy runs on
a worker thread while the checks run on the caller's (torch releases the GIL inside the copy). Either way
:meth:`StagingArena.settle` waits for it before the span is given back, and the save's own copy waits for
it before it writes the same span.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from ckptd.client.pinned import pin_host_memory, unpin_host_memory
from ckptd.client.plan import StalePlanError, sync_streams
from ckptd.client.trust import open_arena
from ckptd.writer.errors import ConfigError, DaemonUnavailableError

if TYPE_CHECKING:
    from ckptd.client.plan import StagePlan
    from ckptd.client.state import Shard

_MADV_POPULATE_WRITE = 23
THREADED_STATIC_BYTES = 4 << 20  # static sources smaller than this are copied on the caller's thread

log = logging.getLogger(__name__)


def spare_core(local_world_size: int) -> bool:
    """Whether this rank has a second core to itself: then a plan's static copy runs beside the save's checks
    rather than before them. A process bound to some of the node's cores (a launcher's binding) has those;
    one that may run on all of them shares them with the node's other ranks."""
    total = os.cpu_count() or 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = total
    return (cores if cores < total else cores / local_world_size) >= 2


class StagingArena:
    """One mapping of the daemon's arena; :meth:`map` again after a reconnect, :meth:`close` when done."""

    def __init__(self, threaded: bool = False) -> None:
        self.mm: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None
        self.pinned = False  # page-locking tried for this mapping
        self._registered = False  # ... and done: undone before the unmap
        # the devices with copies into the arena queued on their current streams and not waited for (sync_streams)
        self._queued: tuple[torch.device, ...] | None = None
        self.threaded = threaded  # copy CPU static sources on a worker thread (:func:`spare_core`)
        self._worker: ThreadPoolExecutor | None = None
        self._copying: Future[None] | None = None  # a static copy running on the worker, not waited for

    def map(self, path: str, nbytes: int) -> None:
        """Map the arena file at ``path`` (dropping an earlier mapping) and fault its pages in.

        An arena that cannot be mapped (its file removed: another daemon's stale-arena cleanup; shorter than
        the daemon said) is a daemon this client cannot use: :class:`DaemonUnavailableError`. One that is not
        this user's private regular file (a symbolic link, another owner, group or other access) is refused:
        :class:`~ckptd.writer.errors.ConfigError` (:func:`ckptd.client.trust.open_arena`)."""
        self.close()
        try:
            fd = open_arena(path)
            try:
                self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except ConfigError:  # not this user's: no lost daemon
            raise
        except (OSError, ValueError) as exc:  # ValueError: the file is shorter than ``nbytes``
            raise DaemonUnavailableError(
                f"cannot map the daemon's staging arena {path} ({nbytes} bytes): {exc}; if the file is gone, "
                "another daemon's stale-arena cleanup may have removed it: restart this daemon"
            ) from exc
        with contextlib.suppress(OSError, AttributeError):
            self.mm.madvise(_MADV_POPULATE_WRITE)  # map the daemon's pages now, not during save()
        self._tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pinned = False

    def close(self) -> None:
        """Drop the mapping (when the client closes, or loses its daemon: a dead daemon's tmpfs pages are
        freed only once no rank maps them), after the copies queued into it; a no-op when none."""
        self.settle()  # no queued device copy (or worker's copy) may land in memory unmapped (or mapped anew)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._tensor = None
        if self.mm is not None:
            if self._registered:  # before the unmap: the driver must not keep the old pages locked and registered
                unpin_host_memory(self.mm)
                self._registered = False
            with contextlib.suppress(BufferError):  # a view still exported: the GC unmaps it later
                self.mm.close()
            self.mm = None

    def _bytes(self, cuda: bool) -> torch.Tensor:
        if self._tensor is None or self.mm is None:
            raise DaemonUnavailableError("no staging arena mapped: the client is closed or lost its daemon")
        if cuda and not self.pinned:
            self._registered = pin_host_memory(self.mm)  # once per mapping (a failure warned: pageable copies)
            self.pinned = True
        return self._tensor

    def stage(self, shards: list[Shard], offsets: list[int]) -> None:
        """Copy every shard into its slot: one memcpy each (or one D2H copy, then one stream sync)."""
        cuda = any(s.data.is_cuda for s in shards)
        arena = self._bytes(cuda)
        try:
            for shard, off in zip(shards, offsets, strict=True):
                dst = arena[off : off + shard.nbytes].view(shard.data.dtype).view(shard.data.shape)
                shard.stage_into(dst, non_blocking=cuda)
        finally:  # on a failure too: slots given back must not receive a queued device copy afterwards
            if cuda:
                sync_streams(tuple({s.data.device for s in shards if s.data.is_cuda}))

    def stage_plan(self, plan: StagePlan, base: int, sources: list[torch.Tensor], static: bool = True) -> None:
        """Copy a registered plan's sources into its span at ``base`` (``static=False``: its static sources
        were copied there already by :meth:`stage_static`)."""
        copying, self._copying = self._copying, None
        if copying is not None:
            copying.result()  # the static bytes (their padding zeroed) are in place, or its error is raised
        try:
            plan.stage(self._bytes(plan.cuda), base, sources, static)
        finally:
            self._queued = None  # stage() synchronized the stream

    def stage_static(self, plan: StagePlan, base: int) -> None:
        """Start copying a plan's static sources into its span at ``base``; on a GPU (queued transfers) or on
        the worker thread (:attr:`threaded`, at least :data:`THREADED_STATIC_BYTES` of them) not waited for:
        the :meth:`stage_plan` that follows waits, or :meth:`settle`."""
        arena = self._bytes(plan.cuda)
        if self.threaded and not plan.cuda and plan.static_bytes >= THREADED_STATIC_BYTES:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckptd-stage")
            started = threading.Event()

            def copy() -> None:
                started.set()
                plan.stage_static(arena, base)

            self._copying = self._worker.submit(copy)
            # the checks that follow hold the GIL for milliseconds at a time (C-level maps): let the worker
            # reach the copy, where torch releases it, before they start
            started.wait()
            return
        plan.stage_static(arena, base)
        if plan.cuda:
            self._queued = plan.devices

    def settle(self) -> None:
        """Wait for the copies :meth:`stage_static` started and did not wait for (before their span is given
        back); a worker's copy that failed is logged (the span is given up anyway)."""
        queued, self._queued = self._queued, None
        if queued is not None:
            sync_streams(queued)
        copying, self._copying = self._copying, None
        if copying is not None and (err := copying.exception()) is not None:
            # a stale plan (the optimizer let a re-homed state go) is what the save's checks found too: it plans again
            level = logging.DEBUG if isinstance(err, StalePlanError) else logging.WARNING
            log.log(level, "a static copy made ahead of a save failed (its span is given up): %r", err)
