"""Page-locking the staging arena for the CUDA path: D2H copies then go straight into shared memory."""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

log = logging.getLogger(__name__)


def pin_host_memory(buf: mmap.mmap) -> bool:
    """Register ``buf`` as pinned host memory with CUDA; on failure warn (copies stay pageable) and return
    False."""
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves cudart() unannotated
    err = cudart.cudaHostRegister(ptr, len(buf), 0)
    if int(err) != 0:
        log.warning("cudaHostRegister failed (%s); D2H copies into the arena will be pageable", err)
        return False
    return True


def unpin_host_memory(buf: mmap.mmap) -> None:
    """Undo :func:`pin_host_memory` before ``buf`` is unmapped: a mapping made later at the same address (the
    arena of a restarted daemon) is then registered anew, and the old pages are not kept locked."""
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostUnregister(ptr)
    if int(err) != 0:
        log.warning("cudaHostUnregister failed (%s)", err)
