"""A stage plan's copy runs: which copies one ``torch.cat`` can make (CPU), across zero-filled padding.

On CPU ``_foreach_copy_`` costs ~0.35 µs a tensor plus the bytes; ``torch.cat(..., out=run)`` ~0.1 µs a
tensor. Megatron lays a bucket's params back to back (padded to 64 elements under the distributed
optimizer), so a bucket slice's per-param states — separate tensors — fill one slot run with only zeroed
padding between them: one concatenation per (bucket, state).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

import torch

MAX_GAP = 4096  # a gap up to this many bytes is mirrored in the layout (or zero-filled in a run): one copy


class Dst(NamedTuple):
    """Where a copy lands: ``rel`` bytes into the span, as ``dtype`` of ``shape``."""

    rel: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class Gaps:
    """The span's zero-filled ranges (bucket padding), merged: a concatenation may cross one, writing the
    zeros the fill writes again after every copy; nothing else lands there."""

    def __init__(self, zeros: Sequence[Dst]) -> None:
        merged: list[list[int]] = []
        for d in sorted(zeros, key=lambda d: d.rel):
            lo, hi = d.rel, d.rel + numel(d.shape) * d.dtype.itemsize
            if merged and merged[-1][1] >= lo:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._starts = [m[0] for m in merged]
        self._ends = [m[1] for m in merged]
        self._zeros: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def filler(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Zeros of ``dtype`` for the bytes ``[lo, hi)`` if they are padding (and not too many), else None."""
        n, odd = divmod(hi - lo, dtype.itemsize)
        i = bisect.bisect_right(self._starts, lo) - 1
        if odd or not 0 < hi - lo <= MAX_GAP or i < 0 or self._ends[i] < hi:
            return None
        return self._zeros.setdefault((dtype, n), torch.zeros(n, dtype=dtype))

    def leading(self, hi: int, floor: int, dtype: torch.dtype) -> tuple[int, torch.Tensor] | None:
        """(start, zeros) for the padding that ends at byte ``hi`` and starts at or after ``floor`` (what an
        earlier run wrote is not written again), if any (a DP rank's slice that starts mid-bucket)."""
        i = bisect.bisect_left(self._ends, hi)
        if i >= len(self._ends) or self._ends[i] != hi or self._starts[i] < floor:
            return None
        fill = self.filler(self._starts[i], hi, dtype)
        return None if fill is None else (self._starts[i], fill)

    def trailing(self, lo: int, dtype: torch.dtype) -> tuple[int, torch.Tensor] | None:
        """(end, zeros) for the padding that starts at byte ``lo``, if any (a run's last param's)."""
        i = bisect.bisect_right(self._starts, lo) - 1
        if i < 0 or not self._starts[i] <= lo < self._ends[i]:
            return None
        fill = self.filler(lo, self._ends[i], dtype)
        return None if fill is None else (self._ends[i], fill)


def cat_runs(
    srcs: Sequence[Dst], dsts: Sequence[Dst], gaps: Gaps
) -> tuple[list[tuple[list[int | torch.Tensor], Dst]], list[int]]:
    """Runs of two or more copies one ``torch.cat`` can make — 1-D sources of the slot's dtype into 1-D
    slots back to back, or apart by padding (filled from a zeros tensor) — as (source indices and zeros,
    the run's slot); and the indices of every other copy."""
    runs: list[tuple[list[int | torch.Tensor], Dst]] = []
    rest: list[int] = []
    i, n = 0, len(dsts)
    written = 0  # where the last run ended: padding before it is not absorbed twice
    while i < n:
        items: list[int | torch.Tensor] = [i]
        start, dtype = dsts[i].rel, dsts[i].dtype
        end = _end(dsts[i])
        head = gaps.leading(start, written, dtype) if _flat(srcs[i], dsts[i]) else None
        if head is not None:  # the padding before the run: zeroed by it
            start = head[0]
            items.insert(0, head[1])
        j = i + 1
        while _flat(srcs[i], dsts[i]) and j < n and _flat(srcs[j], dsts[j]) and dsts[j].dtype == dtype:
            if dsts[j].rel != end:
                fill = gaps.filler(end, dsts[j].rel, dtype)
                if fill is None:
                    break
                items.append(fill)
            items.append(j)
            end = _end(dsts[j])
            j += 1
        tail = gaps.trailing(end, dtype) if _flat(srcs[i], dsts[i]) else None
        if tail is not None:  # the padding after the run: zeroed by it, not by a fill of its own
            end, fill = tail
            items.append(fill)
        if len(items) > 1:
            runs.append((items, Dst(start, dtype, ((end - start) // dtype.itemsize,))))
            written = max(written, end)
        else:
            rest.append(i)
        i = j
    return runs, rest


def uncovered(zeros: Sequence[Dst], runs: Sequence[Dst]) -> list[Dst]:
    """The zero fills no run writes already (a run writes the padding it crosses)."""
    spans = sorted((r.rel, _end(r)) for r in runs)
    starts = [lo for lo, _ in spans]
    out = []
    for z in zeros:
        i = bisect.bisect_right(starts, z.rel) - 1
        if i < 0 or _end(z) > spans[i][1]:
            out.append(z)
    return out


def _flat(src: Dst, dst: Dst) -> bool:
    return src.dtype == dst.dtype and len(src.shape) == 1 and len(dst.shape) == 1


def _end(d: Dst) -> int:
    return d.rel + d.dtype.itemsize * numel(d.shape)


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


