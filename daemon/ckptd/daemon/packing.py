"""Small-array packing: an array the node holds entirely, and that is small, is written as one object.

Every writer's region is a whole number of chunks, so a small tensor split over k ranks (a TP-sharded
bias, a per-rank counter) becomes k tiny objects. On object storage each costs a request, its latency
and a per-request price, whatever its size. But all ranks of a node hand their shards to one daemon,
which is a single writer: when the blocks it received of an array tile the whole array, no other node
writes that array, and the daemon may choose any chunk grid for it — here one chunk, the whole array.

Consistency without talking to other nodes: a node that holds only part of an array (the array spans
nodes) never packs it and writes the rank-derived grid, as does every other node holding a part, so
all writers of a multi-node array agree. A node packs only arrays nobody else writes. (Were another
node to write blocks of a packed array too, the shards would overlap: the commit's merge rejects it.)

The shards are copied out of the staging arena while they wait for the node's other ranks (they are
small, and the copies are capped by a byte budget: beyond it, shards are written unpacked), so
packing never holds arena space longer than an unpacked write would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ckptd.client.protocol import ShardMeta
from ckptd.writer.format import chunk_count, itemsize, region_chunks


@dataclass(frozen=True)
class HeldBlock:
    """One rank's block of a small array, copied out of the arena, waiting for the node's other ranks."""

    rank: int
    meta: ShardMeta
    data: np.ndarray


def array_nbytes(meta: ShardMeta) -> int:
    return math.prod(meta.global_shape) * itemsize(meta.dtype)


def packable(meta: ShardMeta, limit_bytes: int) -> bool:
    """Whether a block may wait to be packed: its array is small, and the block is not already all of it."""
    return 0 < array_nbytes(meta) <= limit_bytes and list(meta.shape) != list(meta.global_shape)


def covers_whole(blocks: Sequence[HeldBlock]) -> bool:
    """True if the blocks agree on the array and tile it exactly once (each grid cell held by one block).

    Pure. Blocks that disagree on global shape, dtype or grid are never packed: they are written as
    they came, and the commit reports the disagreement.
    """
    if not blocks:
        return False
    first = blocks[0].meta
    shape, grid = tuple(first.global_shape), tuple(first.chunk_shape)
    seen: set[tuple[int, ...]] = set()
    for block in blocks:
        m = block.meta
        if (tuple(m.global_shape), tuple(m.chunk_shape), m.dtype) != (shape, grid, first.dtype):
            return False
        for coords in region_chunks(m.global_offset, m.shape, grid):
            if coords in seen:
                return False
            seen.add(coords)
    return len(seen) == chunk_count(shape, grid)


def assemble(blocks: Sequence[HeldBlock]) -> np.ndarray:
    """The whole array from blocks that :func:`covers_whole`."""
    first = blocks[0].meta
    out = np.empty(tuple(first.global_shape), dtype=blocks[0].data.dtype)
    for block in blocks:
        region = tuple(
            slice(o, o + n) for o, n in zip(block.meta.global_offset, block.meta.shape, strict=True)
        )
        out[region] = block.data
    return out
