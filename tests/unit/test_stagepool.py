"""The load's host staging pool (ckptd.client.stagepool): a round's regions never overlap and each has its
destination's shape and dtype; the next round reuses the same memory; a region beyond the bound gets memory
of its own; the buffer goes with release()."""

from __future__ import annotations

import itertools

import torch

from ckptd.client.stagepool import ALIGN, StagingPool


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_a_rounds_regions_are_disjoint_typed_and_reused_by_the_next_round() -> None:
    pool = StagingPool(1 << 16)
    dsts = [torch.zeros(3, 5)[:, ::2], torch.zeros(7, dtype=torch.bfloat16), torch.zeros((), dtype=torch.int64),
            torch.zeros(4, 4, dtype=torch.uint8).t()]
    first = [pool.take(d) for d in dsts]
    for got, dst in zip(first, dsts, strict=True):
        assert got.shape == dst.shape and got.dtype == dst.dtype and got.is_contiguous()
        assert got.data_ptr() % ALIGN == 0
    spans = sorted(_span(t) for t in first)
    assert all(a_end <= b_start for (_a, a_end), (b_start, _b) in itertools.pairwise(spans))
    for i, t in enumerate(first):  # written through, each keeps its own bytes
        t.copy_(torch.full(t.shape, i + 1, dtype=t.dtype))
    assert [int(t.reshape(-1)[0]) for t in first] == [1, 2, 3, 4]
    pool.reset()
    again = [pool.take(d) for d in dsts]
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]
    assert pool.allocations == 1


def test_a_region_beyond_the_bound_gets_memory_of_its_own_and_release_frees_the_buffer() -> None:
    pool = StagingPool(64)
    small = pool.take(torch.zeros(8))
    big = pool.take(torch.zeros(1 << 19))  # 2 MiB: beyond the bound and the slack
    assert pool.allocations == 2 and big.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()
    pool.release()
    again = pool.take(torch.zeros(8))
    assert pool.allocations == 3  # a new buffer after release (the old one lives while a region of it is held)
    assert again.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()
