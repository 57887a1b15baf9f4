"""Stored manifests as readers take them: the checks before a byte of one is trusted.

A manifest's bytes must match their crc32c (:func:`~ckptd.writer.checksum.check_seal`), and its chunk records
must fit their arrays' geometry (:func:`check_chunk_records`): readers place chunk bytes by these records, so
a damaged record would put checked bytes at the wrong offsets. Pure: :class:`~ckptd.writer.root.CheckpointRoot`
reads the bytes. ``docs/format.md`` ("Manifest checksums") is the prose version.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ckptd.writer.checksum import check_seal, pieces_fit
from ckptd.writer.errors import CorruptCheckpointError, UnsupportedDtypeError
from ckptd.writer.format import (
    ArrayRecord,
    ChunkRecord,
    CommitManifest,
    PartManifest,
    decode_commit,
    decode_part,
    itemsize,
)


def decode_part_checked(data: bytes, what: str) -> PartManifest:
    """A node's part manifest as stored, its seal checked (:class:`CorruptCheckpointError` names ``what``).
    Its chunk records are the coordinator's to check (:func:`~ckptd.writer.parts.merge_parts`: in the grid,
    one writer each, no gap), and every reader checks the commit's (:func:`decode_commit_checked`)."""
    check_seal(data, what)
    return decode_part(data)


def decode_commit_checked(data: bytes, what: str) -> CommitManifest:
    """A commit (or merge) manifest as stored (``COMMITTED``, ``MERGED``), its seal and chunk records checked:
    what readers do before they trust a byte of it (:class:`CorruptCheckpointError` names ``what``)."""
    check_seal(data, what)
    manifest = decode_commit(data)
    check_chunk_records(manifest.arrays, what)
    return manifest


def check_chunk_records(arrays: Sequence[ArrayRecord], what: str) -> None:
    """Check the chunk records of a manifest's arrays against their geometry: each chunk's coordinates in
    the chunk grid, no chunk twice, its ``nbytes`` the whole chunk's (formats 3 and 4) or, for an edge chunk,
    its part inside the array (formats 1 and 2 stored them cut; compressed records say so too), and its
    ``pieces`` one crc32c per :data:`~ckptd.writer.checksum.PIECE_BYTES`. Readers place bytes by these
    records: a damaged one would put checked bytes at the wrong offsets. :class:`CorruptCheckpointError`
    names the array and chunk.

    A manifest may list ~100,000 chunks, and every loading rank reads it: each test runs over all of an
    array's records at once in builtins (min/max per axis, one set), and only a failure is looked at chunk
    by chunk (:func:`_bad_chunk`)."""
    for rec in arrays:
        shape, chunks = rec.shape, rec.chunks
        if len(chunks) != len(shape) or any(c < 1 for c in chunks) or any(n < 0 for n in shape):
            raise CorruptCheckpointError(f"{what}: array {rec.name}: chunk shape {chunks} does not fit shape {shape}")
        records = [ch for shard in rec.shards for ch in shard.chunks]
        if not records:
            continue
        grid = [-(-n // c) for n, c in zip(shape, chunks, strict=True)]
        try:
            item = itemsize(rec.torch_dtype)
        except UnsupportedDtypeError:  # a newer dtype: its sizes unknown here (a load of it is refused anyway)
            item = 0
        full = math.prod(chunks) * item
        coords = [ch.coords for ch in records]
        ok = set(map(len, coords)) == {len(grid)}
        flat: list[int] = [0] * len(coords)  # each chunk's index in the grid, C order: distinct iff the chunks are
        for axis, g in enumerate(grid):
            if not ok:
                break
            along = [c[axis] for c in coords]
            ok = min(along) >= 0 and max(along) < g
            flat = along if axis == 0 else [i * g + x for i, x in zip(flat, along, strict=True)]
        ok = ok and len(set(flat)) == len(coords)
        odd = [ch for ch in records if ch.nbytes != full] if item else []  # edge chunks (stored cut), or damage
        ok = ok and all(ch.nbytes == _edge_bytes(ch.coords, chunks, shape, item) for ch in odd)
        ok = ok and all(pieces_fit(ch.pieces, ch.nbytes) for ch in [ch for ch in records if ch.pieces])
        if not ok:
            raise CorruptCheckpointError(f"{what}: array {rec.name}: {_bad_chunk(records, grid, chunks, shape, item)}")


def _bad_chunk(
    records: Sequence[ChunkRecord], grid: Sequence[int], chunks: Sequence[int], shape: Sequence[int], item: int
) -> str:
    """What is wrong with the first bad one of an array's chunk records (:func:`check_chunk_records`)."""
    seen: set[tuple[int, ...]] = set()
    full = math.prod(chunks) * item
    for ch in records:
        coords = tuple(ch.coords)
        if len(coords) != len(grid) or not all(0 <= x < g for x, g in zip(coords, grid, strict=True)):
            return f"chunk {list(coords)} lies outside the chunk grid {list(grid)}"
        if coords in seen:
            return f"chunk {list(coords)} is listed twice"
        seen.add(coords)
        if item and ch.nbytes != full and ch.nbytes != (cut := _edge_bytes(coords, chunks, shape, item)):
            inside = f" ({cut} inside the array)" if cut != full else ""
            return (f"chunk {list(coords)} records {ch.nbytes} bytes; a chunk of {list(chunks)} in shape "
                    f"{list(shape)} holds {full}{inside}")
        if ch.pieces and not pieces_fit(ch.pieces, ch.nbytes):
            return f"chunk {list(coords)} records {len(ch.pieces) / 4:g} piece checksums for {ch.nbytes} bytes"
    return "its chunk records do not fit its geometry"


def _edge_bytes(coords: Sequence[int], chunks: Sequence[int], shape: Sequence[int], item: int) -> int:
    """The bytes of a chunk's part inside the array (an edge chunk cut to the array's end)."""
    return math.prod(min(c, n - x * c) for x, c, n in zip(coords, chunks, shape, strict=True)) * item
