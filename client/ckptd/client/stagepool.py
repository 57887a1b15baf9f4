"""Host staging for a load's destinations that cannot be read into, one buffer for all of a load's rounds;
and the bounce buffers an in-memory restore copies a GPU tensor's chunks through.

A load stages a GPU tensor's region (or a non-contiguous view's) in host memory, reads into it, and copies it
into place after the round (:class:`~ckptd.client.fastread.ChunkReader`: at most ``stage_bytes`` a round).
A new ``torch.empty`` a region made every round's staging new memory, and on the first write the kernel
faults in and zeroes each of its 4 KiB pages: on the 2-core dev machine 1 GiB staged in 128 MiB rounds took
0.61 s that way, against 0.21 s through one buffer (``benchmarks/run.py --only staged_load``,
docs/benchmarks-log.md). A GPU rank loading 20 GiB of optimizer state in 1 GiB rounds paid it twenty times.
:class:`StagingPool` carves every round's regions out of one buffer that stays for the whole load: its pages
are faulted in by the first round that uses them, and later rounds reuse them. The buffer is made when the
first round starts, the size of the largest round the load can have (at most the round's bound), and freed
when the load ends (:meth:`release`).

Where a staged destination is a CUDA tensor the buffer is page-locked (:func:`host_buffer`): the copy into
place after a round is then a DMA from it, where from pageable memory the driver first copies every byte
through pinned buffers of its own. Torch's pinned-memory allocator rounds a request up to a power of two and
keeps the block for the process's next load; a pinned buffer is therefore never asked larger than the
largest power of two within the round's bound, and the few regions of a full round beyond it get host
tensors of their own.

An in-memory restore into a GPU tensor copies each chunk out of the daemon's arena into a host buffer, checks
it there and sends it on (:meth:`~ckptd.client.restore.ArenaSource.copy_checked`): :class:`BouncePool` keeps
those buffers, one per worker thread at a time, for the whole restore (page-locked, as the staging).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

log = logging.getLogger(__name__)

ALIGN = 64  # each region starts on a cache line (and on a multiple of any dtype's size)
SLACK = 1 << 20  # room for that alignment beyond a round's bound: 16,384 regions a round
_unpinned_warned = False


def pinnable(dst: torch.Tensor) -> bool:
    """Whether bytes bound for ``dst`` are best staged in page-locked host memory (``dst`` is a CUDA tensor)."""
    return dst.device.type == "cuda"


def host_buffer(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """``nbytes`` of host memory (uint8); page-locked when ``pin`` and CUDA is available (a failure to pin
    warns once and gives pageable memory: the copies still land, more slowly)."""
    global _unpinned_warned
    if pin and torch.cuda.is_available():
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # out of lockable memory (ulimit -l, a container's limit)
            if not _unpinned_warned:
                _unpinned_warned = True
                log.warning("pinned host memory unavailable (%s); a load's host-to-GPU copies stay pageable", exc)
    return torch.empty(nbytes, dtype=torch.uint8)


def _pinned_size(nbytes: int, bound: int) -> int:
    """The size to ask torch's pinned allocator for ``nbytes`` of staging: it rounds up to a power of two, so
    a request whose rounding would pass ``bound`` is cut to the power of two below it."""
    up = 1 << max(nbytes - 1, 0).bit_length()
    return up if up <= bound else 1 << (bound.bit_length() - 1)


class StagingPool:
    """Regions of one host buffer of at most ``capacity`` (+ alignment) bytes, handed out in order and taken
    back all at once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._buf: torch.Tensor | None = None
        self._used = 0
        self.allocations = 0  # host buffers made for staging, the pool's own included (tests read it)
        self.pinned = False  # whether the buffer is page-locked

    def reserve(self, nbytes: int, regions: int, *, pin: bool) -> None:
        """Make the buffer, once a load, for rounds of at most ``nbytes`` (capped at the capacity) in at most
        ``regions`` regions each; page-locked when ``pin`` (:func:`host_buffer`). Later calls keep it."""
        if self._buf is not None:
            return
        size = min(self.capacity, max(1, nbytes)) + min(SLACK, ALIGN * max(1, regions))
        if pin:
            size = _pinned_size(size, self.capacity + SLACK)
        self._buf = host_buffer(size, pin=pin)
        self.pinned = self._buf.is_pinned() if pin else False
        self.allocations += 1

    def take(self, dst: torch.Tensor) -> torch.Tensor:
        """A host tensor of ``dst``'s shape and dtype (contiguous) to stage ``dst``'s region in, valid until
        :meth:`reset`. A region that does not fit what is left of the buffer gets a tensor of its own."""
        nbytes = dst.numel() * dst.element_size()
        start = -(-self._used // ALIGN) * ALIGN
        if self._buf is None or start + nbytes > self._buf.numel():
            self.allocations += 1
            return host_buffer(nbytes, pin=pinnable(dst)).view(dst.dtype).view(dst.shape)
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
    per worker thread at a time, each reused by the next chunk (a chunk is at most the writer's chunk size);
    page-locked for a CUDA destination (:func:`host_buffer`)."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.allocations = 0  # buffers made (tests read it)

    @contextmanager
    def buffer(self, nbytes: int, *, pin: bool = False) -> Iterator[np.ndarray]:
        """``nbytes`` of a free buffer (a new one, page-locked when ``pin``, where none free is large
        enough), free again on exit."""
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            buf = np.empty(0, dtype=np.uint8)
        if buf.nbytes < nbytes:
            buf = host_buffer(nbytes, pin=pin).numpy()  # the array keeps its tensor (and its memory) alive
            with self._lock:
                self.allocations += 1
        try:
            yield buf[:nbytes]
        finally:
            self._free.put(buf)
