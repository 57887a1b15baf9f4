"""Strided regions of a stored 1-D array, and the copies that move one read range of it into place (pure).

A load at another TP reads, from a saved bucket (1-D, params back to back), each param's half along some
dimension: a contiguous run for a column-parallel param, every row's half for a row-parallel one. Such a
region is ``offset + sum(i_k * strides[k])`` over ``sizes``: a :class:`Strided`. The reader
(:meth:`~ckptd.client.fastread.ChunkReader.add_gather`) reads each stored chunk that holds any element of
a region once, piece by piece into a small scratch buffer that stays in the CPU cache (every piece it reads
is checksummed; a chunk whose manifest record has its pieces' checksums is read only in the pieces that
hold elements of a region), and :func:`scatter` copies the piece's elements of each region straight into
the destination: a few strided numpy copies per piece, whatever the number of rows.

:func:`blocks` does the index arithmetic: the elements of a region that fall in a range ``[a, b)`` of the
array are, in C order, a head of partial rows, a block of whole rows and a tail, so at most
``2 * ndim + 1`` blocks, each one numpy copy. It needs a *monotone* region (positive strides, each larger
than everything inside it spans: what slicing a C-ordered tensor gives); :func:`normalize` says whether a
region is one, after dropping unit dimensions and merging dimensions contiguous on both sides.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

Index = tuple[int | slice, ...]


@dataclass(frozen=True)
class Strided:
    """Elements ``offset + sum(i_k * strides[k])`` (``0 <= i_k < sizes[k]``) of a 1-D array, in elements."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @cached_property
    def stop(self) -> int:
        """One past the last element the region touches (``offset`` when it is empty)."""
        if any(n == 0 for n in self.sizes):
            return self.offset
        return self.offset + 1 + sum((n - 1) * s for n, s in zip(self.sizes, self.strides, strict=True))

    @property
    def numel(self) -> int:
        """How many elements the region holds."""
        n = 1
        for size in self.sizes:
            n *= size
        return n

    def is_run(self) -> bool:
        """Whether the region is one contiguous run of the array."""
        return self.stop - self.offset == self.numel


def normalize(region: Strided, dst: np.ndarray) -> tuple[Strided, np.ndarray] | None:
    """``region`` and its destination ``dst`` (shape ``region.sizes``) with unit dimensions dropped and
    neighbours merged where both sides are contiguous across them; None when the region is not monotone
    (:func:`blocks` would not apply). An empty region comes back with ``sizes == (0,)``."""
    if tuple(dst.shape) != region.sizes:
        raise ValueError(f"destination shape {dst.shape} is not the region's {region.sizes}")
    if region.numel == 0:
        return Strided(region.offset, (0,), (1,)), dst.reshape(0)
    item = dst.itemsize
    if any(d % item for d in dst.strides):
        return None  # a destination stride that is not a whole number of elements
    merged = merge_dims(region, tuple(d // item for d in dst.strides))
    if merged is None:
        return None
    norm, dst_strides = merged
    return norm, np.lib.stride_tricks.as_strided(dst, norm.sizes, tuple(d * item for d in dst_strides))


def merge_dims(region: Strided, dst_strides: tuple[int, ...]) -> tuple[Strided, tuple[int, ...]] | None:
    """:func:`normalize`'s arithmetic alone: ``region`` (non-empty) with unit dimensions dropped and
    neighbours merged where the region and a destination of strides ``dst_strides`` (in elements) are both
    contiguous across them, and the destination's strides to match; None when the result is not monotone.
    Pure integers: a plan of many regions of one geometry works it out once."""
    dims = [(n, s, d) for n, s, d in zip(region.sizes, region.strides, dst_strides, strict=True) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, s, d in reversed(dims):
        if merged and s == merged[-1][0] * merged[-1][1] and d == merged[-1][0] * merged[-1][2]:
            inner_n, inner_s, inner_d = merged[-1]
            merged[-1] = (n * inner_n, inner_s, inner_d)
        else:
            merged.append((n, s, d))
    merged.reverse()
    sizes = tuple(n for n, _s, _d in merged)
    strides = tuple(s for _n, s, _d in merged)
    if not monotone(sizes, strides):
        return None
    return Strided(region.offset, sizes, strides), tuple(d for _n, _s, d in merged)


def monotone(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether C order visits increasing positions: every stride (of a dimension longer than 1) positive
    and at least what the dimensions inside it span."""
    span = 1
    for n, s in zip(reversed(sizes), reversed(strides), strict=True):
        if n != 1:
            if s <= 0 or s < span:
                return False
            span += (n - 1) * s
    return True


def boxes(region: Strided, a: int, b: int) -> list[tuple[tuple[slice, ...], Strided]]:
    """:func:`blocks`, each index as one slice per dimension of the region (a dimension kept whole, or a
    single row, is still a dimension), for selecting from tensors of the region's shape."""
    out = []
    for index, block in blocks(region, a, b):
        sel = [slice(i, i + 1) if isinstance(i, int) else i for i in index]
        out.append(((*sel, *(slice(0, n) for n in region.sizes[len(sel) :])), block))
    return out


def blocks(region: Strided, a: int, b: int) -> Iterator[tuple[Index, Strided]]:
    """The elements of a monotone ``region`` at array positions ``[a, b)``, as blocks: ``(index, block)``
    where ``index`` selects the block's elements in the region's own shape (``dst[index]``) and ``block``
    locates them in the array. At most ``2 * len(sizes) + 1`` blocks."""
    yield from _blocks((), region.offset, region.sizes, region.strides, a, b)


def _blocks(
    prefix: Index, off: int, sizes: tuple[int, ...], strides: tuple[int, ...], a: int, b: int
) -> Iterator[tuple[Index, Strided]]:
    if not sizes:
        if a <= off < b:
            yield prefix, Strided(off, (), ())
        return
    n, s = sizes[0], strides[0]
    inner = 1 + sum((m - 1) * t for m, t in zip(sizes[1:], strides[1:], strict=True))
    first = max(0, (a - off - inner) // s + 1)  # the first row that ends after a
    end = min(n, -((off - b) // s))  # one past the last row that starts before b
    if first >= end:
        return
    full_lo = max(first, -((off - a) // s))  # rows wholly inside [a, b)
    full_hi = min(end, (b - off - inner) // s + 1)
    if full_lo >= full_hi:  # no whole row: the rows holding a and b, partly
        full_lo = full_hi = end
    for i in range(first, full_lo):  # at most one (monotone): the row holding a
        yield from _blocks((*prefix, i), off + i * s, sizes[1:], strides[1:], a, b)
    if full_lo < full_hi:
        yield (*prefix, slice(full_lo, full_hi)), Strided(off + full_lo * s, (full_hi - full_lo, *sizes[1:]), strides)
    for i in range(full_hi, end):  # at most one: the row holding b
        yield from _blocks((*prefix, i), off + i * s, sizes[1:], strides[1:], a, b)


def scatter(targets: Sequence[tuple[Strided, np.ndarray]], piece: np.ndarray, a: int) -> None:
    """Copy the elements of each ``(region, destination)`` (normalized, :func:`normalize`) that lie in
    ``piece`` — array positions ``[a, a + len(piece))``, typed like the destinations — into place."""
    b = a + len(piece)
    item = piece.itemsize
    for region, dst in targets:
        if region.stop <= a or region.offset >= b:
            continue
        for index, block in blocks(region, a, b):  # a view of the piece: ndarray() costs far less than as_strided
            dst[index] = np.ndarray(block.sizes, piece.dtype, piece, (block.offset - a) * item,
                                    tuple(t * item for t in block.strides))
