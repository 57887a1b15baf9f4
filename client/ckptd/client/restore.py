"""In-memory restore, client side: copy the newest committed step back from the daemon's arena.

The daemon keeps the staged bytes of its newest committed step (``ckptd.daemon.restore``). A load on the
same node asks for them (:class:`~ckptd.client.protocol.RestoreRequest`): the reply lists, per shard its
ranks staged, the key, region and arena range. :class:`ArenaSource` answers the loader's lookups; the
loader (:class:`~ckptd.client.fastread.ChunkReader`) copies a region from the arena only when it is
exactly a staged shard (:meth:`ArenaSource.copy_checked`), and checks every chunk's crc32c in the copy
against the commit manifest read from storage, so a stale copy (another step's bytes, a range evicted and
reused by a save) is caught; such regions, and everything the arena does not hold, are read from storage.

A destination in host memory gets the bytes straight from the arena. One elsewhere (a GPU tensor) gets them
chunk by chunk through host buffers the worker threads reuse (:class:`~ckptd.client.stagepool.BouncePool`):
the chunk is copied and checksummed there, and the checked bytes go on to the device (from page-locked
memory for a CUDA tensor); a new host tensor of the shard's size each time would fault in every page of it
first.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ckptd.client.chunkio import contiguous_run, copy_crc
from ckptd.client.protocol import PROTOCOL_VERSION, RestoreReply, RestoreRequest, RestoreShard
from ckptd.client.stagepool import BouncePool, pinnable
from ckptd.writer.arrays import chunk_selection, full_chunk
from ckptd.writer.checksum import crc32c
from ckptd.writer.errors import CkptdError
from ckptd.writer.format import ArrayRecord, ChunkRecord, ShardRecord, itemsize

if TYPE_CHECKING:
    from ckptd.client.client import CheckpointClient

log = logging.getLogger(__name__)

Where = tuple[str, tuple[int, ...], tuple[int, ...]]  # (key, global offset, shape)


def host_addressable(dst: torch.Tensor) -> bool:
    """Whether numpy can copy into ``dst``'s memory (a CPU tensor); else its bytes go through a bounce."""
    return dst.device.type == "cpu"


@dataclass
class ArenaSource:
    """The arena ranges holding one step's staged shards, and what a load took from them."""

    step: int
    view: memoryview  # the whole arena, mapped by this process
    shards: dict[Where, RestoreShard]
    served_bytes: int = 0  # copied from memory and verified
    rejected: list[str] = field(default_factory=list)  # keys whose copy failed its checksum
    bounces: BouncePool = field(default_factory=BouncePool)

    def find(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> RestoreShard | None:
        return self.shards.get((key, offset, shape))

    def copy_checked(
        self, rec: ArrayRecord, dst: torch.Tensor, offset: tuple[int, ...], hit: RestoreShard, stored: ShardRecord
    ) -> bool:
        """Copy one kept shard of array ``rec`` out of the arena into ``dst``; True only if every chunk's
        crc32c matches the commit manifest's ``stored`` record. The checksum is of the copy, never of the
        arena, so a range the daemon reuses meanwhile cannot slip through. Runs in a worker thread."""
        item = itemsize(rec.torch_dtype)
        src = np.frombuffer(self.view[hit.offset : hit.offset + hit.nbytes], dtype=np.uint8)
        rels = [(ch, tuple(slice(s.start - o, s.stop - o) for s, o in
                           zip(chunk_selection(ch.coords, rec.chunks, rec.shape), offset, strict=True)))
                for ch in stored.chunks]
        if not _covers(rels, tuple(dst.shape)):  # bytes no chunk checks would be handed over: read storage
            return False
        runs = [contiguous_run(rel, tuple(dst.shape)) for _ch, rel in rels]
        spans = [(ch, run[0] * item, (run[0] + run[1]) * item) for (ch, _rel), run in zip(rels, runs, strict=True)
                 if run is not None and run[1] * item == ch.nbytes]
        if len(spans) == len(rels) and dst.is_contiguous():  # each chunk one run of dst: piece by piece, in cache
            out = dst.detach().view(-1).view(torch.uint8)
            if host_addressable(dst):
                flat = out.numpy()
                return all(copy_crc(flat, src, start, stop) == ch.crc32c for ch, start, stop in spans)
            pin = pinnable(dst)
            for ch, start, stop in spans:
                with self.bounces.buffer(stop - start, pin=pin) as buf:
                    if copy_crc(buf, src[start:stop], 0, stop - start) != ch.crc32c:
                        return False
                    out[start:stop].copy_(torch.from_numpy(buf))
            return True
        # chunks that are not runs of dst (cut along an inner axis), or a non-contiguous dst: the whole shard
        # into host memory, then each chunk's block checked there
        target = dst if host_addressable(dst) and dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype)
        flat = target.detach().view(-1).view(torch.uint8).numpy()
        flat[:] = src
        typed = flat.view(f"u{item}" if item > 1 else "u1").reshape(tuple(dst.shape))
        whole = math.prod(rec.chunks) * item
        for ch, rel in rels:
            block = typed[rel]
            if block.nbytes != ch.nbytes and ch.nbytes == whole:  # an edge chunk, stored whole (format 3)
                block = full_chunk(block, rec.chunks)
            block = np.ascontiguousarray(block)
            if block.nbytes != ch.nbytes or int(crc32c(block.data.cast("B"))) != ch.crc32c:
                return False
        if target is not dst:
            dst.copy_(target)
        return True


def _covers(rels: Sequence[tuple[ChunkRecord, tuple[slice, ...]]], shape: tuple[int, ...]) -> bool:
    """Whether chunk blocks (relative to a region of ``shape``) lie inside it and their sizes sum to it: the
    shard record's chunks (distinct, as the manifest's check ensures) check every byte copied."""
    inside = all(len(rel) == len(shape) and all(0 <= s.start <= s.stop <= n for s, n in zip(rel, shape, strict=True))
                 for _ch, rel in rels)
    return inside and sum(math.prod(s.stop - s.start for s in rel) for _ch, rel in rels) == math.prod(shape)


def arena_source(client: CheckpointClient, step: int) -> ArenaSource | None:
    """What the client's daemon holds of ``step`` in memory; None when nothing (or no daemon answers)."""
    try:
        reply = client._request(RestoreRequest(v=PROTOCOL_VERSION, step=step))
    except CkptdError as exc:  # an older daemon, or none: storage serves the load
        log.info("in-memory restore of step %d unavailable: %s", step, exc)
        return None
    arena = client._staging.mm
    if not isinstance(reply, RestoreReply) or not reply.shards or arena is None:
        return None
    view = memoryview(arena)
    shards = {
        (s.key, tuple(s.global_offset), tuple(s.shape)): s
        for s in reply.shards
        if s.offset >= 0 and s.offset + s.nbytes <= view.nbytes
    }
    return ArenaSource(step, view, shards) if shards else None
