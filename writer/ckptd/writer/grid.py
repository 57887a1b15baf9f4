"""Chunk grids: how an array is cut into chunks, so that no chunk has two writers (part of the format,
re-exported by :mod:`ckptd.writer.format`). Pure functions (:func:`plan_chunks` remembers its grids)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Literal

from ckptd.writer.errors import ShardLayoutError

DEFAULT_CHUNK_BYTES = 16 << 20


def plan_chunks(base: Sequence[int], item: int, target_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[int, ...]:
    """Chunk shape for an array whose writers own blocks of shape ``base``.

    Every writer's region is a whole number of chunks, so no chunk has two writers (two writers of one
    chunk lose updates). Large blocks are split along their leading axes by the smallest divisor that
    brings a chunk under ``target_bytes``; the result depends only on its arguments, so every rank and
    node derives the same grid without talking to the others. The divisor search takes O(sqrt n) trials
    on an axis of extent n (:func:`plan_chunks_within` bounds them).
    """
    return plan_chunks_within(base, item, target_bytes)[0]


def plan_chunks_within(
    base: Sequence[int], item: int, target_bytes: int = DEFAULT_CHUNK_BYTES, max_trials: int | None = None
) -> tuple[tuple[int, ...], int]:
    """:func:`plan_chunks` and the divisor trials it took; :class:`ShardLayoutError` rather than more than
    ``max_trials`` (None: no limit). Planned grids are remembered, so a block planned once costs no trials
    again (the count returned is still what planning it took)."""
    key = (tuple(max(1, int(n)) for n in base), int(item), int(target_bytes))
    planned = _PLANNED.get(key)
    if planned is None:
        try:
            planned = _plan(*key, max_trials)
        except _OverBudget:
            planned = None
        else:
            if len(_PLANNED) >= _PLANNED_MAX:
                _PLANNED.clear()
            _PLANNED[key] = planned
    if planned is None or (max_trials is not None and planned[1] > max_trials):
        raise ShardLayoutError(
            f"the chunk grid of block {key[0]} ({item}-byte items) takes more than {max_trials} divisor trials "
            "to plan: choose a block (chunk_shape) whose extents have small divisors"
        )
    return planned


_PLANNED: dict[tuple[tuple[int, ...], int, int], tuple[tuple[int, ...], int]] = {}
_PLANNED_MAX = 4096
_SCAN_BLOCK = 1 << 16  # candidates tried per numpy call: ~15x faster than a Python loop on a long search


class _OverBudget(Exception):
    pass


def _plan(base: tuple[int, ...], item: int, target: int, max_trials: int | None) -> tuple[tuple[int, ...], int]:
    chunks = list(base)
    trials = 0
    for axis, n in enumerate(chunks):
        rest = math.prod(chunks[axis + 1 :]) * item
        if math.prod(chunks) * item <= target:
            break
        left = None if max_trials is None else max_trials - trials
        # the smallest k >= 2 dividing n with n // k * rest <= target: the largest divisor of n up to
        # target // rest (n is above it here); none (one element of the rest is over the target): 1
        chunks[axis], spent = _largest_divisor(n, target // rest, left)
        trials += spent
    return tuple(chunks), trials


def _largest_divisor(n: int, limit: int, max_trials: int | None) -> tuple[int, int]:
    """The largest divisor of ``n`` not above ``limit`` (1 if ``limit`` < 1) and the trials it took.

    Divisors pair up as (k, n // k) with k <= isqrt(n): the large ones n // k are tried first, largest
    first (k upwards from the smallest cofactor that fits ``limit``), then the small ones downwards from
    min(limit, isqrt(n)); 1 always divides, so the search ends within 2 * isqrt(n) trials."""
    if limit < 1:
        return 1, 0
    root = math.isqrt(n)
    trials = 0
    for candidates, large in ((range(-(-n // limit), root + 1), True), (range(min(limit, root), 0, -1), False)):
        found, spent = _first_divisor(n, candidates, None if max_trials is None else max_trials - trials)
        trials += spent
        if found is not None:
            return (n // found if large else found), trials
    return 1, trials


def _first_divisor(n: int, candidates: range, max_trials: int | None) -> tuple[int | None, int]:
    """The first of ``candidates`` that divides ``n`` (None if none does) and the trials it took."""
    capped = max_trials is not None and len(candidates) > max_trials
    if capped:
        candidates = candidates[:max_trials]
    for lo in range(0, len(candidates), _SCAN_BLOCK):
        part = candidates[lo : lo + _SCAN_BLOCK]
        if len(part) < 64 or n >= 1 << 63:
            hit = next((i for i, k in enumerate(part) if n % k == 0), None)
        else:
            import numpy as np  # here, not at import: the client's save path imports this module

            zeros = np.flatnonzero(np.int64(n) % np.arange(part.start, part.stop, part.step, dtype=np.int64) == 0)
            hit = int(zeros[0]) if zeros.size else None
        if hit is not None:
            return part[hit], lo + hit + 1
    if capped:
        raise _OverBudget
    return None, len(candidates)


def check_region(
    key: str, shape: Sequence[int], offset: Sequence[int], local: Sequence[int], chunks: Sequence[int]
) -> None:
    """A writer's region must lie inside the array and start and end on chunk boundaries."""
    if not (len(shape) == len(offset) == len(local) == len(chunks)):
        raise ShardLayoutError(
            f"{key}: rank mismatch: global_shape {tuple(shape)}, global_offset {tuple(offset)}, "
            f"local shape {tuple(local)}"
        )
    for axis, (n, o, m, c) in enumerate(zip(shape, offset, local, chunks, strict=True)):
        if c < 1:
            raise ShardLayoutError(f"{key}: chunk grid {tuple(chunks)} has an extent below 1 on axis {axis}")
        if o < 0 or m < 0 or o + m > n:
            raise ShardLayoutError(
                f"{key}: region [{o}, {o + m}) on axis {axis} lies outside global shape {tuple(shape)}"
            )
        if o % c or ((o + m) % c and o + m != n):
            raise ShardLayoutError(
                f"{key}: region [{o}, {o + m}) on axis {axis} does not follow the chunk grid {tuple(chunks)}; "
                "shards of one tensor must be equal blocks (the last one along an axis may be shorter)"
            )


def region_chunks(offset: Sequence[int], local: Sequence[int], chunks: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Chunk coordinates covered by an aligned region, in C order."""
    ranges = [range(o // c, -(-(o + m) // c)) for o, m, c in zip(offset, local, chunks, strict=True)]
    yield from _product(ranges)


def _product(ranges: list[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head, *tail)


def chunk_selection_of(
    coords: Sequence[int], chunks: Sequence[int], shape: Sequence[int], origin: Sequence[int]
) -> tuple[slice, ...]:
    """A chunk's extent, relative to a region of the array that starts at ``origin``."""
    return tuple(
        slice(c * n - o, min((c + 1) * n, s) - o) for c, n, s, o in zip(coords, chunks, shape, origin, strict=True)
    )


def chunk_count(shape: Sequence[int], chunks: Sequence[int]) -> int:
    return math.prod(-(-n // c) for n, c in zip(shape, chunks, strict=True)) if shape else 1


ChunkSeparator = Literal["/", "."]
#: The chunk key separator of arrays written now (format 4): ``c.<i>.<j>``, every chunk a file in its array's
#: folder. Formats 1-3 wrote ``c/<i>/<j>`` (zarr v3's default): a folder per chunk coordinate but the last,
#: which on a local filesystem made a 700-layer model's step create ~12,000 folders for ~9,900 chunks, and
#: each new folder costs more than the chunk file in it (~0.3 ms against ~0.04 ms on ext4).
CHUNK_SEPARATOR: ChunkSeparator = "."


def chunk_key(coords: Sequence[int], separator: str) -> str:
    """A chunk's key in its array's folder: zarr v3's ``default`` chunk key encoding with ``separator``
    (the array's :attr:`~ckptd.writer.format.ArrayRecord.separator`): ``c`` then each coordinate."""
    return "c" + "".join(f"{separator}{c}" for c in coords)
