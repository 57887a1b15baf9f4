"""A param's model pieces must cover the whole param, and a live piece's region the saved pieces it is read
from: else a load at another layout or a merge leaves those elements unwritten (stale, or zero) without a
word. Each plan refuses such a gap before anything is read or written, naming the param (or model key) and
the missing range: the merged-layout read and the merge-free read (``StateMismatchError``, as for a param no
saved state covers) and the merge's planner (``ShardLayoutError``, as for its other layout inconsistencies).

The geometry is checked against brute force: ``ParamLayout.uncovered`` against a mask of the elements each
piece views (contiguous, column-cut, transposed and stepped views; few runs and many), ``missing_box`` against
a mask of the cells each box covers. The planners run on test_merged_read's and test_dp_slice_read's params
(a column-cut, a stacked-layer and a two-piece param), stored by the real writer.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dp_slice_read import LOADED_AT, SAVED_AT
from test_dp_slice_read import _layout as dp_layout
from test_dp_slice_read import _write as write_dp
from test_merged_read import _layout as merged_layout
from test_merged_read import _write as write_merged

from ckptd.client.megatron.coverage import missing_box
from ckptd.client.megatron.reshard import _cover, plan_dp_slices, plan_merged_slices
from ckptd.writer.errors import ShardLayoutError, StateMismatchError
from ckptd.writer.layout import MegatronLayout, ModelPiece, ParamLayout
from ckptd.writer.merge import plan_merge
from ckptd.writer.root import open_root

Box = tuple[tuple[int, int], ...]


# --- the geometry, against brute force --------------------------------------------------------------------
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


@st.composite
def _params(draw: st.DrawFn) -> ParamLayout:
    """A param of 1-3 axes (up to 40 rows: a column piece then has more runs than the pure-Python path
    takes) and 0-4 pieces, each a box of it, viewed as is, transposed or every other element of an axis."""
    shape = tuple(draw(st.integers(1, 40 if i == 0 else 6)) for i in range(draw(st.integers(1, 3))))
    strides = _strides(shape)
    pieces = []
    for _ in range(draw(st.integers(0, 4))):
        box = [sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2, unique=True))) for n in shape]
        offset = sum(lo * s for (lo, _hi), s in zip(box, strides, strict=True))
        view = [(hi - lo, s) for (lo, hi), s in zip(box, strides, strict=True)]
        step = draw(st.integers(-1, len(shape) - 1))  # an axis taken every other element, or none
        if step >= 0:
            n, s = view[step]
            view[step] = ((n + 1) // 2, 2 * s)
        if draw(st.booleans()):
            view.reverse()  # a transposed view: the same elements in another order
        pieces.append(ModelPiece("k", shape, (0,) * len(shape), 0, offset, tuple(n for n, _ in view),
                                 tuple(s for _, s in view), (0, 0, 0)))
    return ParamLayout("p", 0, math.prod(shape), 0, shape, tuple(pieces))


def _first_gap(p: ParamLayout) -> tuple[int, int] | None:
    """By brute force: mark every element each piece views, return the first unmarked run."""
    mask = np.zeros(math.prod(p.shape), dtype=bool)
    for piece in p.model_pieces:
        index = np.full((), piece.view_offset, dtype=np.int64)
        for n, s in zip(piece.view_shape, piece.view_stride, strict=True):
            index = index[..., None] + np.arange(n) * s
        mask[index.reshape(-1)] = True
    missing = np.flatnonzero(~mask)
    if missing.size == 0:
        return None
    lo = int(missing[0])
    covered_after = np.flatnonzero(mask[lo:])
    return lo, lo + int(covered_after[0]) if covered_after.size else mask.size


@settings(max_examples=300, deadline=None)
@given(_params())
def test_uncovered_is_the_first_element_run_no_piece_views(p: ParamLayout) -> None:
    assert p.uncovered() == _first_gap(p)


def test_uncovered_names_the_gap_of_the_usual_pieces() -> None:
    def piece(offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> ModelPiece:
        return ModelPiece("k", (64, 64), (0, 0), 0, offset, shape, stride, (0, 0, 0))

    rows = (piece(0, (8, 16), (16, 1)), piece(128, (8, 16), (16, 1)))  # SwiGLU's halves of fc1
    cols = (piece(0, (100, 4), (8, 1)), piece(4, (100, 4), (8, 1)))  # column halves: 200 runs (numpy's path)
    assert ParamLayout("fc1", 0, 256, 0, (16, 16), rows).uncovered() is None
    assert ParamLayout("fc1", 0, 256, 0, (16, 16), rows[:1]).uncovered() == (128, 256)
    assert ParamLayout("fc1", 0, 256, 0, (16, 16), rows[1:]).uncovered() == (0, 128)
    assert ParamLayout("w", 0, 800, 0, (100, 8), cols).uncovered() is None
    assert ParamLayout("w", 0, 800, 0, (100, 8), cols[:1]).uncovered() == (4, 8)
    assert ParamLayout("w", 0, 800, 0, (100, 8), ()).uncovered() == (0, 800)  # no piece at all


@st.composite
def _boxes(draw: st.DrawFn) -> tuple[Box, list[Box]]:
    need = tuple(sorted(draw(st.lists(st.integers(0, 9), min_size=2, max_size=2, unique=True)))
                 for _ in range(draw(st.integers(1, 3))))
    have = []
    for _ in range(draw(st.integers(0, 5))):
        have.append(tuple(tuple(sorted(draw(st.lists(st.integers(lo, hi), min_size=2, max_size=2, unique=True))))
                          for lo, hi in need))
    return need, have


@settings(max_examples=300, deadline=None)
@given(_boxes())
def test_missing_box_is_a_cell_no_box_covers(case: tuple[Box, list[Box]]) -> None:
    need, have = case
    grid = np.zeros([hi - lo for lo, hi in need], dtype=bool)
    shift = [lo for lo, _hi in need]
    for box in have:
        grid[tuple(slice(x - o, y - o) for (x, y), o in zip(box, shift, strict=True))] = True
    gap = missing_box(need, have)
    if grid.all():
        assert gap is None
        return
    assert gap is not None
    cell = tuple(slice(x - o, y - o) for (x, y), o in zip(gap, shift, strict=True))
    assert grid[cell].size and not grid[cell].any(), (need, have, gap)  # a region none of them holds


def test_overlapping_saved_pieces_that_add_up_still_leave_a_gap() -> None:
    """Two saved regions of a 4x4 piece: 12 + 9 elements, more than its 16, yet the corner is in neither.
    Counting elements passed it; the exact union names the corner."""
    piece = ModelPiece("x", (4, 4), (0, 0), 0, 0, (4, 4), (4, 1), (0, 0, 0))
    found = [(object(), ((0, 3), (0, 4))), (object(), ((1, 4), (0, 3)))]
    corner = r"x: no saved optimizer state holds its region \(\(3, 4\), \(3, 4\)\)"
    with pytest.raises(StateMismatchError, match=corner):
        _cover(piece, found)  # type: ignore[arg-type]
    assert len(_cover(piece, [*found, (object(), ((3, 4), (3, 4)))])) == 3  # type: ignore[arg-type]


# --- the planners ------------------------------------------------------------------------------------------
def _dropping(layout: MegatronLayout, name: str, keep: int) -> MegatronLayout:
    """``layout`` with param ``name`` left its first ``keep`` model pieces (a piece missing from the plan)."""
    buffers = []
    for buf in layout.buffers:
        buckets = []
        for bucket in buf.buckets:
            params = tuple(msgspec.structs.replace(p, model_pieces=p.model_pieces[:keep]) if p.name == name else p
                           for p in bucket.params)
            buckets.append(msgspec.structs.replace(bucket, params=params))
        buffers.append(msgspec.structs.replace(buf, buckets=tuple(buckets)))
    return msgspec.structs.replace(layout, buffers=tuple(buffers))


# "c" is a (5, 8) param in two column pieces (c0: columns 0-3, c1: columns 4-7); without c1 the first element
# no piece views is row 0's column 4
GAP = r"c: its model pieces \(c0\) leave elements \[4, 8\) of the flattened param \(shape \(5, 8\)\) uncovered"


def test_the_merge_free_read_refuses_a_live_param_its_pieces_do_not_cover(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = dp_layout(SAVED_AT, 256, 0, 2)
    write_dp(root, saved)

    async def plan(live: MegatronLayout) -> None:
        async with open_root(root, None, create=False) as ckpt:
            plan_dp_slices(await ckpt.read_commit(1), [saved], live)

    for dp_size in (1, 2):
        live = dp_layout(LOADED_AT, 160, 0, dp_size)
        asyncio.run(plan(live))  # the normal case plans
        with pytest.raises(StateMismatchError, match=GAP):
            asyncio.run(plan(_dropping(live, "c", 1)))


def test_the_merged_read_refuses_a_live_param_its_pieces_do_not_cover(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    write_merged(root)

    async def plan(live: MegatronLayout) -> None:
        async with open_root(root, None, create=False) as ckpt:
            plan_merged_slices(1, await ckpt.read_commit(1), live)

    for dp_size in (1, 2):
        live = merged_layout(dp_size - 1, dp_size)  # the rank whose slice holds "c"
        asyncio.run(plan(live))
        with pytest.raises(StateMismatchError, match=GAP):
            asyncio.run(plan(_dropping(live, "c", 1)))


def test_the_merge_refuses_a_saved_param_its_pieces_do_not_cover(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = dp_layout(SAVED_AT, 256, 0, 1)
    write_dp(root, saved)

    async def commit() -> object:
        async with open_root(root, None, create=False) as ckpt:
            return await ckpt.read_commit(1)

    stored = asyncio.run(commit())
    plan = plan_merge(stored, [saved])  # type: ignore[arg-type]
    assert {p.array for t in plan.tasks for p in t.placements["param"]} == {
        "merged/optimizer.state.param.w", "merged/optimizer.state.param.b", "merged/optimizer.state.param.layers",
        "merged/optimizer.state.param.c0", "merged/optimizer.state.param.c1"}
    with pytest.raises(ShardLayoutError, match=r"c \(optim/tp0.pp0/buf0/bucket0/\): its model pieces leave "
                                               r"elements \[4, 8\) of the flattened param \(shape \(5, 8\)\)"):
        plan_merge(stored, [_dropping(saved, "c", 1)])  # type: ignore[arg-type]
