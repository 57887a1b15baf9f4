"""The load's host staging pool (ckptd.client.stagepool): a round's regions never overlap and each has its
destination's shape and dtype; the next round reuses the same memory; the buffer is sized to the load's
largest round, never past the bound (a pinned one within torch's power-of-two rounding too); a region beyond
it gets memory of its own; the buffer goes with release()."""

from __future__ import annotations

import itertools

import torch

from ckptd.client.stagepool import ALIGN, SLACK, StagingPool, host_buffer


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_a_rounds_regions_are_disjoint_typed_and_reused_by_the_next_round() -> None:
    pool = StagingPool(1 << 16)
    dsts = [torch.zeros(3, 5)[:, ::2], torch.zeros(7, dtype=torch.bfloat16), torch.zeros((), dtype=torch.int64),
            torch.zeros(4, 4, dtype=torch.uint8).t()]
    pool.reserve(sum(d.numel() * d.element_size() for d in dsts), len(dsts), pin=False)
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
    pool.reserve(1 << 16, 1, pin=False)  # a later round keeps the buffer
    again = [pool.take(d) for d in dsts]
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]
    assert pool.allocations == 1


def test_a_region_beyond_the_buffer_gets_memory_of_its_own_and_release_frees_the_buffer() -> None:
    pool = StagingPool(64)
    pool.reserve(32, 1, pin=False)
    small = pool.take(torch.zeros(8))
    big = pool.take(torch.zeros(1 << 19))  # 2 MiB: beyond the buffer
    assert pool.allocations == 2 and big.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()
    pool.release()
    again = pool.take(torch.zeros(8))
    assert pool.allocations == 3  # memory of its own after release (the old buffer lives while a region of it is held)
    assert again.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()


def test_the_buffer_is_the_largest_round_within_the_bound(host_buffers: list[tuple[int, bool]]) -> None:
    """A load that stages 3 MiB gets a buffer of 3 MiB (and the alignment of its regions), not of the 1 GiB
    bound; one that stages more gets the bound."""
    small = StagingPool(1 << 30)
    small.reserve(3 << 20, 10, pin=False)
    big = StagingPool(1 << 20)
    big.reserve(5 << 20, 1 << 20, pin=False)
    assert host_buffers == [((3 << 20) + 10 * ALIGN, False), ((1 << 20) + SLACK, False)]


def test_a_pinned_buffer_stays_within_the_bound_after_rounding(host_buffers: list[tuple[int, bool]]) -> None:
    """Torch's pinned allocator rounds a request up to a power of two: a pinned buffer is asked at that power
    where it fits the bound, else at the power of two below the bound. Without CUDA it is pageable memory
    (no error), and the pool says so."""
    fits = StagingPool(1000)
    fits.reserve(1000, 100, pin=True)
    cut = StagingPool((1 << 20) - 100)
    cut.reserve(1 << 30, 1 << 20, pin=True)
    assert host_buffers == [(8192, True), (1 << 20, True)]
    assert fits.pinned == cut.pinned == torch.cuda.is_available()
    assert host_buffer(16, pin=True).is_pinned() == torch.cuda.is_available()
