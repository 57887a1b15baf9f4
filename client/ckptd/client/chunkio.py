"""One stored chunk's I/O for :mod:`ckptd.client.fastread`: a planned read (:class:`Job`), its local read
(``preadv`` straight into place, or piece by piece for a chunk that regions hold parts of), its checks
(size, the stored trailer and the commit manifest's crc32c) and the copy of its elements into place. Runs in
the read pool's worker threads; nothing here plans or awaits."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ckptd.client.gather import Strided, blocks, scatter
from ckptd.writer import checksum
from ckptd.writer.checksum import crc32c
from ckptd.writer.errors import CkptdError, CorruptCheckpointError, StorageError, StoragePermissionError
from ckptd.writer.format import ChunkRecord

CRC_BYTES = 4  # a raw chunk's crc32c trailer
PIECE = 1 << 20  # read + checksum granularity (fits the CPU cache)


@dataclass
class Job:
    """One stored chunk to read, and where its bytes go: whole into one run (``direct``), a block of it
    into a destination through a scratch chunk (``dst``, ``src``), or elements of it for several regions
    (``gather``)."""

    path: str  # the chunk object's key, relative to the root
    chunk: ChunkRecord
    direct: np.ndarray | None  # uint8 view of the destination run the whole chunk fills, or None
    dst: np.ndarray | None = None  # scratch case: the destination block (typed view) ...
    src: tuple[slice, ...] = ()  # ... and the part of the chunk that lands there
    chunk_shape: tuple[int, ...] = ()
    item: int = 1
    # gather case (ChunkReader.add_gather): the chunk's first element in its 1-D array, and the (region,
    # destination) pairs it holds elements of; read piece by piece through a scratch buffer
    start: int = 0
    gather: list[tuple[Strided, np.ndarray]] | None = None
    # ... of which (local reads) the long runs read straight into place: (first byte, end, destination bytes)
    runs: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    scattered: list[tuple[Strided, np.ndarray]] = field(default_factory=list)  # ... and the rest
    # ... and, where the chunk's record has piece checksums, the pieces holding any of those (the only ones
    # read: :func:`needed_pieces`, set when the job is planned); None: the chunk is read and checked whole
    pieces: list[int] | None = None


def copy_crc(dst: np.ndarray, src: np.ndarray, start: int, stop: int) -> int:
    """Copy bytes ``[start, stop)`` of ``src`` into ``dst`` and return the crc32c of the copy, computed piece
    by piece while each copied piece is still in the CPU cache."""
    crc = 0
    for a in range(start, stop, PIECE):
        b = min(a + PIECE, stop)
        dst[a:b] = src[a:b]
        crc = crc32c(dst[a:b].data, crc)
    return int(crc)


def contiguous_run(rel: Sequence[slice], shape: Sequence[int]) -> tuple[int, int] | None:
    """``(first element, count)`` when the block ``rel`` of a C-ordered ``shape`` is one contiguous run."""
    n = len(shape)
    k = 0
    while k < n - 1 and rel[k].stop - rel[k].start == 1:
        k += 1
    if any(rel[j].start != 0 or rel[j].stop != shape[j] for j in range(k + 1, n)):
        return None
    start = 0
    for s, dim in zip(rel, shape, strict=True):
        start = start * dim + s.start
    return start, math.prod(s.stop - s.start for s in rel)


def stored_shape(path: str, nbytes: int, chunks: Sequence[int], ext: Sequence[slice], item: int) -> tuple[int, ...]:
    """The shape a raw chunk is stored in, by its manifest's ``nbytes``: the whole chunk (every chunk since
    format 3; an edge chunk padded), or its extent ``ext`` in the array (an edge chunk stored cut by format
    2). :class:`CorruptCheckpointError` when ``nbytes`` is neither: its bytes would land at wrong offsets."""
    if math.prod(chunks) * item == nbytes:
        return tuple(chunks)
    cut = tuple(s.stop - s.start for s in ext)
    if math.prod(cut) * item == nbytes:
        return cut
    raise CorruptCheckpointError(
        f"{path}: the manifest records {nbytes} bytes, neither a whole chunk of {tuple(chunks)} nor its part {cut} "
        f"inside the array ({item}-byte items)"
    )


def _check(job: Job, data: memoryview, trailer: bytes, crc: int | None = None) -> None:
    want = job.chunk.nbytes
    if data.nbytes != want or len(trailer) != CRC_BYTES:
        raise CorruptCheckpointError(
            f"{job.path}: chunk holds {data.nbytes + len(trailer)} bytes, the manifest recorded {want} + {CRC_BYTES}"
        )
    _check_crc(job, int(crc32c(data)) if crc is None else crc, trailer)


def _check_crc(job: Job, crc: int, trailer: bytes) -> None:
    stored = int.from_bytes(trailer, "little")
    if crc != stored or crc != job.chunk.crc32c:
        raise CorruptCheckpointError(
            f"{job.path}: stored bytes have crc32c {crc:#010x}; the chunk's trailer says {stored:#010x} and the "
            f"manifest {job.chunk.crc32c:#010x}"
        )


def _check_piece(job: Job, i: int, crc: int) -> None:
    """Piece ``i`` of the chunk read has crc32c ``crc``: it must be the manifest's value of that piece."""
    want = checksum.piece_value(job.chunk.pieces, i)
    if crc != want:
        a = i * checksum.PIECE_BYTES
        b = min(a + checksum.PIECE_BYTES, job.chunk.nbytes)
        raise CorruptCheckpointError(
            f"{job.path}: bytes [{a}, {b}) (piece {i}) have crc32c {crc:#010x}; the manifest recorded {want:#010x}"
        )


def _check_trailer(job: Job, trailer: bytes) -> None:
    """A chunk read in pieces (each checked against its own crc32c): its stored trailer must be the
    manifest's crc32c of the whole chunk (a chunk another save wrote in its place has another)."""
    stored = int.from_bytes(trailer, "little")
    if stored != job.chunk.crc32c:
        raise CorruptCheckpointError(
            f"{job.path}: the chunk's trailer says crc32c {stored:#010x}, the manifest {job.chunk.crc32c:#010x}"
        )


def read_local(path: str, job: Job) -> None:
    """Read the chunk at ``path`` (a local file) into ``job``'s destinations and check it: its size, then its
    crc32c against the stored trailer and the manifest (:class:`CorruptCheckpointError` names it). The
    file system's errors are typed as the local backend types them."""
    try:
        _read_local(path, job)
    except CkptdError:
        raise
    except PermissionError as exc:
        raise StoragePermissionError(f"{path}: {exc}") from exc
    except OSError as exc:
        raise StorageError(f"{path}: the chunk could not be read: {exc}") from exc


def _read_local(path: str, job: Job) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: chunk missing") from None
    try:
        size = os.fstat(fd).st_size
        if size != job.chunk.nbytes + CRC_BYTES:
            raise CorruptCheckpointError(
                f"{path}: chunk holds {size} bytes, the manifest recorded {job.chunk.nbytes} + {CRC_BYTES}"
            )
        trailer = bytearray(CRC_BYTES)
        _preadv_all(fd, [memoryview(trailer)], path, job.chunk.nbytes)
        if job.gather is not None:
            crc = _read_gather(fd, path, job)
            if crc is None:  # read and checked piece by piece
                _check_trailer(job, bytes(trailer))
            else:
                _check_crc(job, crc, bytes(trailer))
            return
        scratch = job.direct if job.direct is not None else np.empty(job.chunk.nbytes, dtype=np.uint8)
        body = scratch.data
        # read and checksum piece by piece: each piece is checksummed while it is still in the CPU cache
        crc, pos = 0, 0
        while pos < body.nbytes:
            piece = body[pos : pos + PIECE]
            _preadv_all(fd, [piece], path, pos)
            crc = crc32c(piece, crc)
            pos += piece.nbytes
    finally:
        os.close(fd)
    _check(job, body, bytes(trailer), crc)
    if job.direct is None:
        _scatter_chunk(job, body)


_local = threading.local()  # each worker thread's scratch piece, kept: its pages stay touched and cached


def _read_gather(fd: int, path: str, job: Job) -> int | None:
    """Read a gather job's chunk piece by piece — its long runs straight into place, the rest into this
    thread's scratch piece — checksum each piece's parts in order and copy the other regions' elements out
    of the scratch; returns the chunk's crc32c. The destinations are written before the chunk's checksum
    is compared (as a direct read's are): a mismatch fails the whole load.

    A job with ``pieces`` (its chunk's record has the crc32c of each piece) reads only those pieces, each
    checked against its own crc32c (:class:`CorruptCheckpointError` names it), and returns None."""
    nbytes = job.chunk.nbytes
    wanted = None if job.pieces is None else set(job.pieces)  # None: read and checked whole
    size = PIECE if wanted is None else checksum.PIECE_BYTES
    scratch: np.ndarray | None = getattr(_local, "piece", None)
    if scratch is None or len(scratch) < size:
        scratch = _local.piece = np.empty(size, dtype=np.uint8)
    dtype = f"u{job.item}" if job.item > 1 else "u1"
    crc, pos = 0, 0
    runs, r = job.runs, 0
    while pos < nbytes:
        end = min(pos + size, nbytes)
        if wanted is not None and pos // size not in wanted:
            pos = end
            continue
        parts, at = [], pos
        while at < end:  # the piece's bytes in order: runs into place, gaps into the scratch at their offset
            while r < len(runs) and runs[r][1] <= at:
                r += 1
            if r < len(runs) and runs[r][0] <= at:
                lo, hi, dst = runs[r]
                stop = min(hi, end)
                parts.append(dst[at - lo : stop - lo].data)
            else:
                stop = min(runs[r][0], end) if r < len(runs) else end
                parts.append(scratch[at - pos : stop - pos].data)
            at = stop
        _preadv_all(fd, list(parts), path, pos)
        if wanted is not None:
            crc = 0
        for part in parts:
            crc = crc32c(part, crc)
        if wanted is not None:
            _check_piece(job, pos // size, crc)
        if job.scattered:
            scatter(job.scattered, scratch[: end - pos].view(dtype), job.start + pos // job.item)
        pos = end
    return int(crc) if wanted is None else None


def _needed(job: Job, a: int, b: int) -> bool:
    """Whether bytes ``[a, b)`` of a gather job's chunk hold any element one of its regions needs."""
    if any(lo < b and hi > a for lo, hi, _dst in job.runs):
        return True
    ea, eb = job.start + a // job.item, job.start + -(-b // job.item)
    return any(region.offset < eb and region.stop > ea and next(blocks(region, ea, eb), None) is not None
               for region, _dst in job.scattered)


def _preadv_all(fd: int, bufs: list[memoryview], path: str, pos: int = 0) -> None:
    while bufs:
        n = os.preadv(fd, bufs, pos)
        if n == 0:
            raise CorruptCheckpointError(f"{path}: chunk shorter than recorded")
        pos += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]


def needed_pieces(job: Job) -> list[int] | None:
    """The pieces of a gather job's chunk that hold elements it needs (its ``runs`` and ``scattered``
    regions), when its manifest record has their checksums in a form this reader uses
    (:func:`~ckptd.writer.checksum.pieces_fit`); None otherwise (the chunk is read and checked whole)."""
    if job.gather is None or not checksum.pieces_fit(job.chunk.pieces, job.chunk.nbytes):
        return None
    size, nbytes = checksum.PIECE_BYTES, job.chunk.nbytes
    return [i for i in range(len(job.chunk.pieces) // 4) if _needed(job, i * size, min((i + 1) * size, nbytes))]


def read_bytes(job: Job) -> int:
    """The bytes of the chunk ``job`` reads: all of them, or those of its ``pieces``."""
    if job.pieces is None:
        return job.chunk.nbytes
    size = checksum.PIECE_BYTES
    return sum(min(size, job.chunk.nbytes - i * size) for i in job.pieces)


def verify(job: Job, body: memoryview, trailer: bytes, pieces: list[int] | None = None) -> None:
    """Check a chunk read from an object store (``body`` and its ``trailer``), then copy its elements into
    place unless it was read there. ``pieces``: only these pieces of the body were read
    (:func:`needed_pieces`): each is checked against its own crc32c, the trailer against the manifest's."""
    if pieces is None:
        _check(job, body, trailer)
    else:
        size = checksum.PIECE_BYTES
        for i in pieces:
            _check_piece(job, i, crc32c(body[i * size : (i + 1) * size]))
        _check_trailer(job, trailer)
    if job.direct is None:
        _scatter_chunk(job, body)


def _scatter_chunk(job: Job, body: memoryview) -> None:
    if job.gather is not None:
        scatter(job.gather, np.frombuffer(body, dtype=f"u{job.item}" if job.item > 1 else "u1"), job.start)
        return
    if job.dst is None:  # the scratch case always has a destination
        raise CorruptCheckpointError(f"{job.path}: no destination for a partial chunk")
    src = np.frombuffer(body, dtype=job.dst.dtype).reshape(job.chunk_shape)
    job.dst[...] = src[job.src]
