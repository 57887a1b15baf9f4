"""A load's regions of compressed arrays (``--codec zstd``; any array on a big-endian host): through zarr's
codec pipeline chunk by chunk (a few at once), each checked against the commit manifest before its part is
copied into place (:func:`~ckptd.writer.arrays.read_chunk_checked`: the chunk exists, and its decoded bytes
have the recorded size and crc32c). zarr alone would read a missing chunk as zeros and accept a valid chunk
of another step."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np
import torch
from zarr.abc.store import Store

from ckptd.writer.arrays import CHUNKS_IN_FLIGHT, chunk_selection, open_array, read_chunk_checked
from ckptd.writer.errors import CorruptCheckpointError
from ckptd.writer.fanout import bounded_map
from ckptd.writer.format import ArrayRecord, ChunkRecord


async def read_through_zarr(
    store: Store, prefix: str, rec: ArrayRecord, grid: Mapping[tuple[int, ...], ChunkRecord], dst: torch.Tensor,
    offset: tuple[int, ...],
) -> None:
    """Fill ``dst`` with the region of ``rec`` at ``offset``; ``grid``: the array's chunks by coords. The first
    chunk that fails its check is raised and the others are cancelled (a chunk is copied into ``dst`` by its
    own task after its check, so nothing lands after the error)."""
    arr = await open_array(store, f"{prefix}/{rec.name}")
    ends = [o + n for o, n in zip(offset, dst.shape, strict=True)]
    spans = (range(o // c, -(-e // c)) for o, e, c in zip(offset, ends, rec.chunks, strict=True))

    async def one(coords: tuple[int, ...]) -> None:
        ch = grid.get(coords)
        data = None if ch is None else await read_chunk_checked(store, arr, prefix, rec, ch)
        if data is None:  # not in the manifest, or a format-2 edge chunk stored cut (zarr cannot decode it)
            raise CorruptCheckpointError(f"{rec.name}: chunk {list(coords)} under {prefix} cannot be read through "
                                         "zarr (not in the manifest, or stored cut by format 2)")
        sel = chunk_selection(coords, rec.chunks, rec.shape)
        lo = [max(c.start, o) for c, o in zip(sel, offset, strict=True)]
        hi = [min(c.stop, e) for c, e in zip(sel, ends, strict=True)]
        piece = data[tuple(slice(a - c.start, b - c.start) for a, b, c in zip(lo, hi, sel, strict=True))]
        part = dst[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))]
        src = torch.from_numpy(np.ascontiguousarray(piece).reshape(tuple(part.shape)))  # 0-d stays 0-d
        part.copy_(src.view(dst.dtype) if src.dtype != dst.dtype else src)

    await bounded_map(one, itertools.product(*spans), limit=CHUNKS_IN_FLIGHT)
