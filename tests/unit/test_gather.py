"""Strided regions of a 1-D array (ckptd.client.gather, pure): for any box of a C-ordered param at any offset,
copying each read piece's elements (pieces cut anywhere) rebuilds the box exactly, into a non-contiguous
destination too, and writes nothing else; a view that is not monotone is refused."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptd.client.gather import Strided, blocks, boxes, monotone, normalize, scatter

Case = tuple[tuple[int, ...], int, tuple[slice, ...], list[int]]  # param shape, its offset, the box, piece cuts


@st.composite
def cases(draw: st.DrawFn) -> Case:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    offset = draw(st.integers(0, 40))
    sel = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        sel.append(slice(a, draw(st.integers(a + 1, n))))
    total = offset + int(np.prod(shape)) + 10
    cuts = draw(st.lists(st.integers(0, total), max_size=6))
    return shape, offset, tuple(sel), sorted({0, total, *cuts})


@given(cases())
def test_pieces_rebuild_the_box_and_nothing_else(case: Case) -> None:
    shape, offset, sel, cuts = case
    array = np.arange(cuts[-1], dtype=np.uint32) * 7 + 1
    param = torch.from_numpy(array)[offset : offset + int(np.prod(shape))].view(shape)
    want = param[sel]
    region = Strided(int(want.storage_offset()), tuple(want.shape), tuple(want.stride()))
    canvas = np.zeros((2, *want.shape, 3), dtype=np.uint32)
    norm = normalize(region, canvas[1, ..., 1])  # a destination strided on every axis
    assert norm is not None
    for a, b in itertools.pairwise(cuts):
        scatter([norm], array[a:b].copy(), a)
    assert np.array_equal(canvas[1, ..., 1], want.numpy())
    canvas[1, ..., 1] = 0
    assert not canvas.any()  # nothing outside the destination was written
    # the blocks of one range hold exactly its elements, and stay few
    a, b = cuts[len(cuts) // 2 - 1], cuts[len(cuts) // 2]
    found = sorted(int(e) for _i, blk in blocks(norm[0], a, b) for e in _elements(blk))
    assert found == sorted(int(e) for e in _elements(norm[0]) if a <= e < b)
    assert len(list(blocks(norm[0], a, b))) <= 2 * len(norm[0].sizes) + 1


def _elements(region: Strided) -> np.ndarray:
    grid = np.indices(region.sizes).reshape(len(region.sizes), -1) if region.sizes else np.zeros((0, 1), int)
    return region.offset + (np.array(region.strides, dtype=int)[:, None] * grid).sum(axis=0)


def test_a_transposed_view_is_refused_and_unit_axes_merge() -> None:
    t = torch.empty(4, 6, device="meta").t()
    assert normalize(Strided(0, tuple(t.shape), tuple(t.stride())), np.zeros((6, 4), np.uint32)) is None
    # (1, 3, 4) whole rows of a (5, 4) param from row 2: one run of 12 elements
    norm = normalize(Strided(8, (1, 3, 4), (20, 4, 1)), np.zeros((1, 3, 4), np.uint32))
    assert norm is not None and norm[0] == Strided(8, (12,), (1,)) and norm[0].is_run()


@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_a_flat_range_as_boxes_of_the_params_shape(shape: list[int], data: st.DataObject) -> None:
    """``boxes``: the elements of a param at flat positions ``[a, b)``, each box one slice per axis, in
    order: together exactly those elements."""
    n = int(np.prod(shape))
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    index = np.arange(n).reshape(shape)
    region = Strided(0, tuple(shape), tuple(int(s) // index.itemsize for s in index.strides))
    found = boxes(region, a, b)
    got = [int(x) for sel, _block in found for x in index[sel].reshape(-1)]
    assert got == list(range(a, b))
    assert all(len(sel) == len(shape) for sel, _block in found)
    assert all(block.offset == index[sel].reshape(-1)[0] for sel, block in found)


def test_a_pieces_elements_in_a_flat_range_as_boxes() -> None:
    # the right column half of a (5, 8) param: its elements at param positions [13, 30)
    half = Strided(4, (5, 4), (8, 1))
    assert [(tuple((s.start, s.stop) for s in sel), blk.offset) for sel, blk in boxes(half, 13, 30)] == [
        (((1, 2), (1, 4)), 13), (((2, 3), (0, 4)), 20), (((3, 4), (0, 2)), 28)]
    assert monotone((5, 4), (8, 1)) and monotone((3, 1, 4), (4, 99, 1)) and monotone((), ())
    assert not monotone((8, 5), (1, 8)) and not monotone((2, 3), (2, 1)) and not monotone((3,), (0,))
