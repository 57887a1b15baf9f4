"""Page-locking the staging arena for the CUDA path: D2H copies then go straight into shared memory."""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

log = logging.getLogger(__name__)


def pin_host_memory(buf: mmap.mmap) -> None:
    """Register ``buf`` as pinned host memory with CUDA; on failure warn once (copies stay pageable)."""
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves cudart() unannotated
    err = cudart.cudaHostRegister(ptr, len(buf), 0)
    if int(err) != 0:
        log.warning("cudaHostRegister failed (%s); D2H copies into the arena will be pageable", err)
