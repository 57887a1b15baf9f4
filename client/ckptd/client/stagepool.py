"""Host staging for a load's destinations that cannot be read into, one buffer for all of a load's rounds;
and the bounce buffers an in-memory restore copies a GPU tensor's chunks through.

A load stages a GPU tensor's region (or a non-contiguous view's) in host memory, reads into it, and copies it
into place after the round (:class:`~ckptd.client.fastread.ChunkReader`: at most ``stage_bytes`` a round).
A new ``torch.empty`` a region made every round's staging new memory, and on the first write the kernel
faults in and zeroes each of its 4 KiB pages: on the 2-core dev machine 1 GiB staged in 128 MiB rounds took
0.61 s that way, against 0.21 s through one buffer (``benchmarks/run.py --only staged_load``,
docs/benchmarks.md). A GPU rank loading 20 GiB of optimizer state in 1 GiB rounds paid it twenty times.
:class:`StagingPool` carves every round's regions out of one buffer that stays for the whole load: its pages
are faulted in by the first round that uses them, and later rounds reuse them. The buffer is reserved at the
round's bound but only what a round writes becomes resident; it is freed when the load ends (:meth:`release`).

An in-memory restore into a GPU tensor copies each chunk out of the daemon's arena into a host buffer, checks
it there and sends it on (:meth:`~ckptd.client.restore.ArenaSource.copy_checked`): :class:`BouncePool` keeps
those buffers, one per worker thread at a time, for the whole restore.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

ALIGN = 64  # each region starts on a cache line (and on a multiple of any dtype's size)
SLACK = 1 << 20  # room for that alignment beyond a round's bound: 16,384 regions a round (virtual until used)


class StagingPool:
    """Regions of one host buffer of ``capacity`` bytes, handed out in order and taken back all at once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._buf: torch.Tensor | None = None
        self._used = 0
        self.allocations = 0  # host buffers made for staging, the pool's own included (tests read it)

    def take(self, dst: torch.Tensor) -> torch.Tensor:
        """A host tensor of ``dst``'s shape and dtype (contiguous) to stage ``dst``'s region in, valid until
        :meth:`reset`. A region that does not fit what is left gets a tensor of its own."""
        nbytes = dst.numel() * dst.element_size()
        start = -(-self._used // ALIGN) * ALIGN
        if start + nbytes > self.capacity + SLACK:  # a region larger than a round's bound (or the slack used up)
            self.allocations += 1
            return torch.empty(dst.shape, dtype=dst.dtype)
        if self._buf is None:  # reserved; resident as it is written
            self._buf = torch.empty(self.capacity + SLACK, dtype=torch.uint8)
            self.allocations += 1
        self._used = start + nbytes
        return self._buf[start : start + nbytes].view(dst.dtype).view(dst.shape)

    def reset(self) -> None:
        """Every region handed out is done with (the round was copied into place): hand them out again."""
        self._used = 0

    def release(self) -> None:
        """Free the buffer (the load is over)."""
        self._buf, self._used = None, 0


class BouncePool:
    """Host buffers a chunk is copied and checked in on its way to a destination outside host memory: one
    per worker thread at a time, each reused by the next chunk (a chunk is at most the writer's chunk size)."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.allocations = 0  # buffers made (tests read it)

    @contextmanager
    def buffer(self, nbytes: int) -> Iterator[np.ndarray]:
        """``nbytes`` of a free buffer (a new one where none free is large enough), free again on exit."""
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            buf = np.empty(0, dtype=np.uint8)
        if buf.nbytes < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            with self._lock:
                self.allocations += 1
        try:
            yield buf[:nbytes]
        finally:
            self._free.put(buf)
