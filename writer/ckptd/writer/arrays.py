"""Array I/O through zarr's async API: encode and write whole chunks, read regions back.

Writers hold the array metadata in memory and write only chunk objects; the commit coordinator writes
each array's ``zarr.json`` once all chunks are in (so there is a single writer of every object, and an
array without metadata is visibly unfinished). Every chunk carries zarr v3's standard ``crc32c`` codec,
so any zarr v3 reader verifies it on decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import zarr
import zarr.api.asynchronous as zasync
from zarr.abc.store import Store
from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.array import AsyncArray
from zarr.core.buffer import default_buffer_prototype
from zarr.core.metadata import ArrayV3Metadata
from zarr.storage import MemoryStore, StorePath

from ckptd.writer.backends import Backend
from ckptd.writer.checksum import ChunkSum, chunk_sum, crc32c, piece_value, pieces_fit
from ckptd.writer.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidRequestError
from ckptd.writer.fanout import bounded_map, in_thread_settled
from ckptd.writer.format import (
    ARRAY_ATTR,
    CHUNK_SEPARATOR,
    ArrayRecord,
    ChunkRecord,
    chunk_key,
    itemsize,
    storage_dtype,
)

CODECS = ("raw", "zstd")
CHUNKS_IN_FLIGHT = 4  # chunks of one array read and checked at once (each decoded copy held meanwhile)
_meta_cache: dict[tuple[Any, ...], ArrayV3Metadata] = {}
T = TypeVar("T")
_CRC_THREAD_MIN = 4 << 20


async def array_metadata(
    torch_dtype: str, shape: Sequence[int], chunks: Sequence[int], *, codec: str = "raw", separator: str,
    extra_attrs: dict[str, Any] | None = None,
) -> ArrayV3Metadata:
    """zarr v3 metadata for a ckptd array: little-endian bytes, optional zstd, crc32c on every chunk, chunk
    keys joined by ``separator`` (the array record's)."""
    key = (torch_dtype, tuple(shape), tuple(chunks), codec, separator, repr(sorted((extra_attrs or {}).items())))
    meta = _meta_cache.get(key)
    if meta is None:
        if codec not in CODECS:
            raise InvalidRequestError(f"unknown codec {codec!r}; choose one of {CODECS}")
        codecs: list[Any] = [ZstdCodec(level=1)] if codec == "zstd" else []
        tmp = await zasync.create_array(
            MemoryStore(),
            shape=tuple(shape),
            chunks=tuple(chunks),
            dtype=storage_dtype(torch_dtype),
            serializer=BytesCodec(endian="little"),
            compressors=[*codecs, Crc32cCodec()],
            fill_value=0,
            chunk_key_encoding={"name": "default", "separator": separator},
            attributes={ARRAY_ATTR: {"torch_dtype": torch_dtype, **(extra_attrs or {})}},
        )
        meta = tmp.metadata
        _meta_cache[key] = meta
    return meta


def open_for_write(store: Store, path: str, meta: ArrayV3Metadata) -> AsyncArray[ArrayV3Metadata]:
    return AsyncArray(meta, StorePath(store, path), config={"write_empty_chunks": True})


async def checksum(data: np.ndarray) -> int:
    """crc32c of an array's raw bytes (the decoded chunk, as the manifest records it)."""
    return int(await _over_bytes(crc32c, data))


async def checksums(data: np.ndarray) -> ChunkSum:
    """:func:`chunk_sum` of an array's raw bytes: the whole chunk's crc32c and its pieces'."""
    return await _over_bytes(chunk_sum, data)


async def _over_bytes(fn: Callable[[memoryview], T], data: np.ndarray) -> T:
    """``fn`` of an array's raw bytes, in a worker thread when they are many (never blocking the loop long)."""
    view = np.ascontiguousarray(data).data.cast("B")
    if view.nbytes >= _CRC_THREAD_MIN:
        return await asyncio.to_thread(fn, view)
    return fn(view)


class ChunkSink:
    """Writes encoded chunks of the ``raw`` codec (zarr v3 ``bytes`` little-endian + ``crc32c``).

    The encoding is exactly what zarr's codec pipeline produces — the data bytes followed by their
    crc32c, little-endian — so any zarr v3 reader decodes and verifies it. Doing it here lets one pass
    compute the checksum the manifest records and the one the codec stores, and lets local roots write
    straight from the staging arena (``writev``, no intermediate copy) and ``fsync`` in the same worker
    thread. Other backends get one buffer (:meth:`Backend.put_body`).
    """

    def __init__(self, backend: Backend, *, fsync_each: bool = True, aside: bool = False) -> None:
        """``fsync_each=False`` leaves durability to the caller (:meth:`Backend.sync_all`): cheaper
        when many small chunks are written, as the merge does. Ignored where writes need no fsync.
        ``aside=True``: a local chunk is written under a temporary name and renamed over its key, so a reader
        (or a writer killed mid-write) never leaves a torn chunk where another writer's whole one stood; the
        merge, which two runs may write at once, uses it (an object store's PUT is whole anyway)."""
        self.backend = backend
        self.local_root = backend.local_root
        self.fsync_each = fsync_each and backend.capabilities.needs_fsync
        self.aside = aside

    async def put(
        self, key: str, block: np.ndarray, chunks: Sequence[int] | None = None, *, fsync: bool = True
    ) -> ChunkSum:
        """Write one chunk; returns the checksums of its (decoded) bytes, whole and by piece
        (:func:`chunk_sum`). With ``chunks`` (the array's chunk shape) an edge chunk — ``block`` cut by the
        array's end — is stored whole (:func:`full_chunk`): its stored size is then ``prod(chunks)`` elements.
        ``fsync=False`` leaves this chunk's durability to the caller (:meth:`Backend.sync_all`), as
        ``fsync_each=False`` does for every chunk.

        Padding, checksumming and copying run in worker threads, never in the event loop that serves the
        ranks. A cancelled write returns once its thread is done with ``block`` (an arena slot the caller
        frees next).
        """
        if self.local_root is not None:
            path = os.path.join(self.local_root, key)
            return await in_thread_settled(_put_local, path, block, self.fsync_each and fsync, chunks, self.aside)
        body, sums = await in_thread_settled(_encode, block, chunks)
        await self.backend.put_body(key, body)
        return sums

    async def put_local_unsynced(self, items: Sequence[tuple[str, np.ndarray, Sequence[int]]]) -> list[ChunkSum]:
        """Write many small chunks (``key, block, chunks`` as :meth:`put` takes them) on a local root in one
        worker-thread call, none of them fsynced (the caller makes them durable with
        :meth:`Backend.sync_all`); their checksums in order. One hand-off to a thread instead of one per
        chunk: a chunk of a few KiB costs ~40 µs to write and more than that to hand over."""
        root = self.local_root
        if root is None:
            raise ValueError("put_local_unsynced writes to a local root only")
        return await in_thread_settled(
            lambda: [_put_local(os.path.join(root, key), block, False, chunks) for key, block, chunks in items]
        )


def _little_endian(block: np.ndarray) -> np.ndarray:
    block = np.ascontiguousarray(block)
    if sys.byteorder != "little" and block.dtype.itemsize > 1:
        block = block.byteswap()
    return block


def _encode(block: np.ndarray, chunks: Sequence[int] | None = None) -> tuple[bytearray, ChunkSum]:
    """The chunk object: the one copy out of the arena (an edge chunk padded to ``chunks``), with the crc32c
    appended."""
    view = _stored_bytes(block, chunks)
    sums = chunk_sum(view)
    body = bytearray(view)
    body.extend(sums.crc32c.to_bytes(4, "little"))
    return body, sums


def _stored_bytes(block: np.ndarray, chunks: Sequence[int] | None) -> memoryview:
    """The chunk's bytes as stored: little-endian, an edge chunk padded to ``chunks`` when given."""
    return _little_endian(block if chunks is None else full_chunk(block, chunks)).data.cast("B")


def _put_local(
    path: str, block: np.ndarray, sync: bool = True, chunks: Sequence[int] | None = None, aside: bool = False
) -> ChunkSum:
    view = _stored_bytes(block, chunks)
    sums = chunk_sum(view)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    parts = [view, memoryview(sums.crc32c.to_bytes(4, "little"))]
    if not aside:
        _write_file(path, parts, sync)
        return sums
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"  # readers skip such names
    try:
        _write_file(tmp, parts, sync)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return sums


def _write_file(path: str, parts: list[memoryview], sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while parts:
            n = os.writev(fd, parts)
            while parts and n >= parts[0].nbytes:
                n -= parts[0].nbytes
                parts.pop(0)
            if parts and n:
                parts[0] = parts[0][n:]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def full_chunk(block: np.ndarray, chunks: Sequence[int]) -> np.ndarray:
    """``block`` as its stored chunk: an edge chunk (cut by the array's end) padded with the fill value 0 to
    the full chunk shape, since zarr v3 stores every chunk whole (zarr-python and tensorstore refuse a
    shorter one). Other blocks come back as they are. Since format 3; format 2 stored edge chunks cut."""
    if tuple(block.shape) == tuple(chunks):
        return block
    full = np.zeros(tuple(chunks), dtype=block.dtype)
    full[tuple(slice(0, n) for n in block.shape)] = block
    return full


def chunk_selection(coords: Sequence[int], chunks: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(
        slice(c * n, min((c + 1) * n, s)) for c, n, s in zip(coords, chunks, shape, strict=True)
    )


async def write_metadata(store: Store, path: str, meta: ArrayV3Metadata) -> None:
    bufs = meta.to_buffer_dict(default_buffer_prototype())
    await store.set(f"{path}/zarr.json", bufs["zarr.json"])


async def write_array_doc(store: Store, path: str, rec: ArrayRecord) -> None:
    """The ``zarr.json`` of a committed array, from its record."""
    meta = await array_metadata(rec.torch_dtype, rec.shape, rec.chunks, codec=rec.codec, separator=rec.separator)
    await write_metadata(store, path, meta)


async def group_doc(attributes: dict[str, Any] | None = None) -> bytes:
    """The bytes of a zarr v3 group document."""
    group = await zasync.create_group(store=MemoryStore(), attributes=attributes or {})
    return group.metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


async def write_group(store: Store, path: str, attributes: dict[str, Any] | None = None) -> None:
    """A zarr v3 group document at ``path`` (``""`` is the root)."""
    doc = default_buffer_prototype().buffer.from_bytes(await group_doc(attributes))
    await store.set(f"{path}/zarr.json" if path else "zarr.json", doc)


async def control_doc() -> bytes:
    """The document that declares a control folder (``ckptd.writer.format.control_dir``) a zero-size
    ``uint8`` array, so zarr readers list it as an empty array instead of warning about the objects inside."""
    meta = await array_metadata("uint8", (0,), (1,), separator=CHUNK_SEPARATOR, extra_attrs={"control": True})
    return meta.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


async def write_control_doc(store: Store, path: str) -> None:
    """:func:`control_doc` at the control folder ``path``."""
    await store.set(f"{path}/zarr.json", default_buffer_prototype().buffer.from_bytes(await control_doc()))


async def open_array(store: Store, path: str) -> AsyncArray[Any]:
    try:
        return await zasync.open_array(store=store, path=path, mode="r")
    except (FileNotFoundError, KeyError, zarr.errors.NodeTypeValidationError) as exc:
        raise CheckpointNotFoundError(f"array {path} not found in the checkpoint") from exc


async def read_region(arr: AsyncArray[Any], offset: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    sel = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    try:
        out = await arr.getitem(sel)
    except ValueError as exc:  # the crc32c codec raises ValueError on mismatch
        raise CorruptCheckpointError(f"{arr.path}: stored bytes fail their checksum: {exc}") from exc
    return np.asarray(out)


async def verify_array(
    store: Store,
    prefix: str,
    rec: ArrayRecord,
    on_chunk: Callable[[int], None] | None = None,
    on_corrupt: Callable[[CorruptCheckpointError], None] | None = None,
) -> int:
    """Re-read every chunk of one committed array; raise on a missing chunk or a checksum mismatch, or,
    given ``on_corrupt``, tell it each such chunk and go on with the others (a storage error still raises).

    Returns the bytes verified; ``on_chunk`` is told each chunk's bytes once it checked out. Bounded: one
    chunk in memory at a time per array.
    """
    try:
        arr = await open_array(store, f"{prefix}/{rec.name}")
    except CheckpointNotFoundError as exc:  # the manifest says it was committed: its document is damage
        raise CorruptCheckpointError(f"{rec.name}: its zarr.json is missing or not an array's") from exc
    except (ValueError, TypeError) as exc:  # cut short, not JSON, not zarr metadata (storage errors pass)
        raise CorruptCheckpointError(f"{rec.name}: its zarr.json does not decode: {exc}") from exc
    check_metadata(arr, rec)
    total = 0
    for shard in rec.shards:
        for ch in shard.chunks:
            try:
                await read_chunk_checked(store, arr, prefix, rec, ch)
            except CorruptCheckpointError as exc:
                if on_corrupt is None:
                    raise
                on_corrupt(exc)
                continue
            total += ch.nbytes
            if on_chunk is not None:
                on_chunk(ch.nbytes)
    return total


def check_metadata(arr: AsyncArray[Any], rec: ArrayRecord) -> None:
    """The array's ``zarr.json`` says what the commit manifest records: storage dtype, shape, chunks and
    chunk key separator (another array's document in its place would have zarr readers misread the bytes)."""
    meta = arr.metadata
    sep = getattr(getattr(meta, "chunk_key_encoding", None), "separator", rec.separator)
    found = (str(arr.dtype), tuple(arr.shape), tuple(arr.chunks), sep)
    want = (storage_dtype(rec.torch_dtype), tuple(rec.shape), tuple(rec.chunks), rec.separator)
    if found != want:
        raise CorruptCheckpointError(
            f"{rec.name}: its zarr.json says dtype {found[0]}, shape {found[1]}, chunks {found[2]}, separator "
            f"{found[3]!r}; the commit manifest records {want[0]}, {want[1]}, {want[2]}, {want[3]!r}"
        )


async def read_chunk_checked(
    store: Store, arr: AsyncArray[Any], prefix: str, rec: ArrayRecord, ch: ChunkRecord
) -> np.ndarray | None:
    """One stored chunk through zarr, checked against the manifest: it must exist (zarr would read a missing
    chunk as the fill value) and its decoded bytes must have the recorded size and crc32c (which catches a
    valid chunk of another step in its place). Returns its elements inside the array (an edge chunk cut to
    the array's end), or None for a format-2 raw edge chunk stored cut, checked as stored (zarr refuses it)."""
    key = f"{prefix}/{rec.name}/{chunk_key(ch.coords, rec.separator)}"
    if not await store.exists(key):
        raise CorruptCheckpointError(f"{rec.name}: chunk {ch.coords} missing ({key})")
    item = itemsize(rec.torch_dtype)
    full = math.prod(rec.chunks) * item
    sel = chunk_selection(ch.coords, rec.chunks, rec.shape)
    if ch.nbytes != full and ch.nbytes != math.prod(s.stop - s.start for s in sel) * item:
        raise CorruptCheckpointError(
            f"{rec.name}: chunk {ch.coords}: the manifest records {ch.nbytes} bytes, neither the whole chunk's "
            f"({full}) nor its part inside the array's"
        )
    if rec.codec == "raw" and ch.nbytes != full:  # a format-2 edge chunk stored cut: zarr refuses it
        await _verify_cut_chunk(store, key, rec.name, ch)
        return None
    try:
        data = await read_region(arr, [s.start for s in sel], [s.stop - s.start for s in sel])
    except CorruptCheckpointError as exc:  # the codec's own crc32c: say which chunk (once)
        raise CorruptCheckpointError(
            f"{rec.name}: chunk {ch.coords} ({key}): stored bytes fail their crc32c ({exc.__cause__ or exc})"
        ) from exc
    stored = full_chunk(data, rec.chunks) if data.nbytes != ch.nbytes and ch.nbytes == full else data  # format 3
    # piece values are compared where they fit this version's pieces (as a partial read uses them)
    fits = pieces_fit(ch.pieces, ch.nbytes)
    crc, pieces = await checksums(stored) if fits else (await checksum(stored), ch.pieces)
    if crc != ch.crc32c or stored.nbytes != ch.nbytes:
        raise CorruptCheckpointError(
            f"{rec.name}: chunk {ch.coords} holds {stored.nbytes} bytes with crc32c {crc:#010x}; the "
            f"manifest recorded {ch.nbytes} bytes with crc32c {ch.crc32c:#010x}"
        )
    if pieces != ch.pieces:  # what a partial read checks against must match the bytes too
        bad = next(i for i in range(len(pieces) // 4) if piece_value(pieces, i) != piece_value(ch.pieces, i))
        raise CorruptCheckpointError(
            f"{rec.name}: chunk {ch.coords}: the manifest's crc32c of piece {bad} (of {len(ch.pieces) // 4}) does "
            f"not match its bytes"
        )
    return data


async def read_bucket(backend: Backend, prefix: str, rec: ArrayRecord, numel: int) -> np.ndarray:
    """The first ``numel`` elements of a stored 1-D array, every chunk checked against the commit manifest: it
    exists, with the recorded size and crc32c (zarr alone reads a missing chunk as zeros, and accepts a valid
    chunk of another step). A whole raw chunk is read straight into the result and checked there (its crc32c
    trailer too); others go through zarr (:func:`read_chunk_checked`)."""
    store = backend.store
    arr = await open_array(store, f"{prefix}/{rec.name}")
    grid = {tuple(ch.coords): ch for shard in rec.shards for ch in shard.chunks}
    step = rec.chunks[0]
    flat = np.empty(numel, dtype=arr.dtype)
    whole = step * flat.itemsize  # a whole chunk's bytes
    raw = rec.codec == "raw" and sys.byteorder == "little"

    async def one(i: int) -> None:
        ch = grid.get((i,))
        lo, hi = i * step, min((i + 1) * step, numel)
        if ch is not None and raw and ch.nbytes == whole and hi - lo == step:
            await _read_raw_chunk(backend, f"{prefix}/{rec.name}/{chunk_key(ch.coords, rec.separator)}", rec.name,
                                  ch, flat[lo:hi].data.cast("B"))
            return
        data = None if ch is None else await read_chunk_checked(store, arr, prefix, rec, ch)
        if data is None:  # not in the manifest, or a format-2 edge chunk stored cut (zarr cannot decode it)
            raise CorruptCheckpointError(f"{rec.name}: chunk [{i}] under {prefix} cannot be read through zarr (not "
                                         "in the manifest, or stored cut by format 2)")
        flat[lo:hi] = data.reshape(-1)[: hi - lo]

    await bounded_map(one, range(-(-numel // step)), limit=CHUNKS_IN_FLIGHT)
    return flat


async def _read_raw_chunk(backend: Backend, key: str, name: str, ch: ChunkRecord, dst: memoryview) -> None:
    """A whole raw chunk (its bytes, then their crc32c) read into ``dst``, checked against ``ch``."""
    trailer = bytearray(4)
    root = backend.local_root
    size: int | None
    try:
        if root is not None:
            got, size = await in_thread_settled(_pread_whole, os.path.join(root, key), [dst, memoryview(trailer)])
        else:
            got, size = await backend.read_into(key, 0, [dst, memoryview(trailer)])
    except FileNotFoundError as exc:  # StorageNotFoundError too
        raise CorruptCheckpointError(f"{name}: chunk {ch.coords} missing ({key})") from exc
    except OSError as exc:
        raise backend.error(exc) from exc
    if got != dst.nbytes + 4:  # a short read: what it did not fill is not the chunk's
        raise CorruptCheckpointError(f"{name}: chunk {ch.coords}: read {got} of {dst.nbytes + 4} bytes of {key}")
    crc = await in_thread_settled(crc32c, dst) if dst.nbytes >= _CRC_THREAD_MIN else crc32c(dst)
    stored = got if size is None else size
    if stored != ch.nbytes + 4 or crc != ch.crc32c or crc != int.from_bytes(trailer, "little"):
        raise CorruptCheckpointError(
            f"{name}: chunk {ch.coords} holds {stored - 4} bytes with crc32c {crc:#010x}; the manifest recorded "
            f"{ch.nbytes} bytes with crc32c {ch.crc32c:#010x}"
        )


def _pread_whole(path: str, bufs: list[memoryview]) -> tuple[int, int]:
    """``preadv`` of a file from its start into ``bufs``; (bytes read, the file's size)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        got, want = 0, sum(b.nbytes for b in bufs)
        while got < want:
            n = os.preadv(fd, _after(bufs, got), got)
            if n == 0:
                break
            got += n
        return got, size
    finally:
        os.close(fd)


def _after(bufs: list[memoryview], skip: int) -> list[memoryview]:
    """``bufs`` less their first ``skip`` bytes."""
    out = []
    for b in bufs:
        if skip >= b.nbytes:
            skip -= b.nbytes
            continue
        out.append(b[skip:])
        skip = 0
    return out


async def _verify_cut_chunk(store: Store, key: str, name: str, ch: ChunkRecord) -> None:
    """A raw chunk that is not of the full chunk size (format 2 cut edge chunks to the array): check the
    stored object itself — its size, its crc32c trailer and the manifest's record."""
    buf = await store.get(key, prototype=default_buffer_prototype())
    raw = b"" if buf is None else buf.to_bytes()
    body, trailer = raw[:-4], raw[-4:]
    crc = int(crc32c(body))
    if len(raw) != ch.nbytes + 4 or crc != int.from_bytes(trailer, "little") or crc != ch.crc32c:
        raise CorruptCheckpointError(
            f"{name}: chunk {ch.coords} holds {len(raw)} bytes with crc32c {crc:#010x}; the manifest recorded "
            f"{ch.nbytes} + 4 bytes with crc32c {ch.crc32c:#010x}"
        )
