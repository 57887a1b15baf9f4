"""One chunk of a load from an object store (:class:`~ckptd.client.fastread.ChunkReader` on S3): the chunk and
its crc32c trailer in ranged GETs of at most ``part_bytes``, each body read straight into the destination run
(or a scratch chunk), then the checks and the copy into place (:func:`~ckptd.client.chunkio.verify`) in a
read-pool thread. A gather job with ``pieces`` (:func:`~ckptd.client.chunkio.needed_pieces`) GETs only those
pieces, and the trailer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ckptd.client.chunkio import CRC_BYTES, Job, verify
from ckptd.writer import checksum
from ckptd.writer.backends import Backend
from ckptd.writer.errors import CorruptCheckpointError, StorageNotFoundError
from ckptd.writer.fanout import bounded_map


async def read_ranged(
    backend: Backend, job: Job, part_bytes: int, gets: asyncio.Semaphore,
    in_thread: Callable[..., Awaitable[Any]],
) -> None:
    """Read and check ``job``; ``gets`` bounds the GETs in flight across chunks, ``in_thread`` runs the
    checks (in threads a failed load waits for before it raises)."""
    nbytes, size = job.chunk.nbytes, job.chunk.nbytes + CRC_BYTES
    scratch = job.direct if job.direct is not None else np.empty(nbytes, dtype=np.uint8)
    body, trailer = scratch.data, bytearray(CRC_BYTES)
    tail = memoryview(trailer)

    async def part(span: tuple[int, int]) -> int | None:
        """Bytes ``[lo, hi)`` of the object: the body's part of it, then the trailer's; the object's size
        (-1 when it was shorter)."""
        lo, hi = span
        views = [body[min(lo, nbytes) : min(hi, nbytes)], tail[max(lo - nbytes, 0) : max(hi - nbytes, 0)]]
        views = [v for v in views if v.nbytes]
        async with gets:
            try:
                got, total = await backend.read_into(job.path, lo, views)
            except StorageNotFoundError:
                raise CorruptCheckpointError(f"{job.path}: chunk missing") from None
        return total if got == hi - lo else -1

    pieces = job.pieces
    spans = [(0, size)] if pieces is None else _piece_spans(pieces, nbytes, size)
    parts = [(lo, min(lo + part_bytes, hi)) for a, hi in spans for lo in range(a, hi, part_bytes)]
    sizes = await bounded_map(part, parts, limit=len(parts))  # the bound is ``gets``; first error cancels
    held = next((n for n in sizes if n is not None and n != size), None)
    if held is not None:
        what = "fewer" if held < 0 else str(held)
        raise CorruptCheckpointError(
            f"{job.path}: chunk holds {what} bytes, the manifest recorded {nbytes}+{CRC_BYTES}"
        )
    await in_thread(verify, job, body, bytes(trailer), pieces)


def _piece_spans(pieces: list[int], nbytes: int, size: int) -> list[tuple[int, int]]:
    """Byte ranges of the object covering ``pieces`` (neighbours joined) and the trailer at ``[nbytes, size)``."""
    step = checksum.PIECE_BYTES
    spans: list[tuple[int, int]] = []
    for i in pieces:
        lo, hi = i * step, min((i + 1) * step, nbytes)
        if spans and spans[-1][1] == lo:
            spans[-1] = (spans[-1][0], hi)
        else:
            spans.append((lo, hi))
    if spans and spans[-1][1] == nbytes:
        spans[-1] = (spans[-1][0], size)
    else:
        spans.append((nbytes, size))
    return spans
