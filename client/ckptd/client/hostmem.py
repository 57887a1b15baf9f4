"""New host memory for a load's destinations, faulted in as huge pages where the kernel allows it.

A resumed job loads before its first step, so its optimizer has no state yet: the load allocates the state
tensors and the read is the first write to them. Every 4 KiB page of that memory is then faulted in (and
zeroed by the kernel) inside the read: 640 MB read from the page cache into new tensors took 0.29 s on
the 2-core dev machine, against 0.06-0.07 s with the same tensors advised ``MADV_HUGEPAGE`` first (one
fault per 2 MiB; docs/benchmarks.md). :func:`host_empty` allocates through torch as usual and gives that
advice for the 2 MiB-aligned part of a large allocation. It only advises: where transparent huge pages
are off (``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``never``), or the call is refused, or
the host is not Linux, the memory is plain pages, as before; ``CKPTD_HUGE_PAGES=0`` in the environment (or
:data:`enabled` set to False) turns the advice off. The memory stays torch's (its allocator frees it); the
advice only changes how its pages are faulted in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from collections.abc import Callable

import torch

HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 with 4 KiB base pages
ADVISE_BYTES = 4 * HUGE  # smaller allocations are left as they are (at most one huge page inside)
ENV = "CKPTD_HUGE_PAGES"
#: whether :func:`advise_huge` advises at all (``CKPTD_HUGE_PAGES=0``: never)
enabled = os.environ.get(ENV, "1").strip() != "0"


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    advise: Callable[[int, int, int], int] = fn
    return advise


_MADVISE = _madvise()


def advise_huge(t: torch.Tensor) -> bool:
    """Advise the kernel to back ``t``'s memory (a CPU tensor not yet written to) with huge pages; True when
    the advice was taken (pages already faulted in stay as they are)."""
    nbytes = t.numel() * t.element_size()
    if not enabled or _MADVISE is None or t.device.type != "cpu" or nbytes < ADVISE_BYTES:
        return False
    start = t.data_ptr()
    lo, hi = -(-start // HUGE) * HUGE, (start + nbytes) // HUGE * HUGE
    return hi > lo and _MADVISE(lo, hi - lo, mmap.MADV_HUGEPAGE) == 0


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype)``, advised to be faulted in as huge pages when it is large."""
    t = torch.empty(numel, dtype=dtype)
    advise_huge(t)
    return t


def host_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(numel, dtype=dtype)``, its pages faulted in as huge pages (advised before the fill)."""
    return host_empty(numel, dtype).zero_()
