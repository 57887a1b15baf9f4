"""The merge-free read (``plan_dp_slices``): a rank's optimizer slices rebuilt straight from the stored DP
bucket slices of another bucket layout and DP size, bit-exact against slices built by hand.

The saved run (DP 2) and the loading one (DP 1, 2, 4) hold the same params (whole-chunk, column-cut,
stacked-layer and two-piece params, test_merged_read's) in other places of their buckets, so at DP 2 and 4
params straddle the loading rank's slice edges, mid-row. Of such a param a rank reads only the part inside
its slice, straight into place: no scratch param, and the gathers it plans hold exactly the elements its
slices need. Also the geometry behind it: a flat range of a param as boxes, and a piece's elements in it.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_merged_read import DATA, PARAMS, STATES

from ckptd.client.gather import Strided
from ckptd.client.megatron.reshard import (
    SliceRead,
    _cover,
    _param_read_specs,
    _param_reads,
    _saved_elements,
    _SavedIndex,
    _spec,
    plan_dp_slices,
)
from ckptd.testing.fixtures import commit_one_node
from ckptd.writer import format as fmt
from ckptd.writer.arrays import ChunkSink
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.layout import BucketLayout, BufferLayout, MegatronLayout, ModelPiece, ParamLayout
from ckptd.writer.root import open_root

SAVED_AT = {"w": 0, "b": 64, "l": 100, "c": 181}  # test_merged_read's places, bucket of 256, DP 2
# the loading run's places: bucket of 160; at DP 4 (slices of 40) "c" straddles 40 at row 4, column 3 (both
# of its pieces), "l" 80 at row 3, column 6, "w" 120 at row 2, column 2; at DP 2 "l" straddles 80
LOADED_AT = {"c": 5, "l": 50, "b": 95, "w": 110}
CHUNK = 32
Data = dict[tuple[str, str], torch.Tensor]  # (state, model key) -> the model-space array


def _layout(places: dict[str, int], padded: int, dp_rank: int, dp_size: int) -> MegatronLayout:
    params = sorted((ParamLayout(p.name, places[p.name], places[p.name] + math.prod(p.shape), 0, p.shape,
                                 p.model_pieces) for p in PARAMS), key=lambda p: p.start)
    bucket = BucketLayout(0, 0, padded, max(p.end for p in params), tuple(params))
    buf = BufferLayout(0, 0, 0, 0, "float32", "float32", False, "tp0.pp0", dp_size, dp_rank, 0, (bucket,))
    return MegatronLayout(0, 1, 0, 1, dp_rank, dp_size, (buf,))


def _bucket(state: str, layout: MegatronLayout, data: Data = DATA) -> torch.Tensor:
    """The whole padded bucket of ``state`` in ``layout``, built by hand from the model-space data."""
    bucket = layout.buffers[0].buckets[0]
    full = torch.zeros(bucket.padded_numel)
    for p in bucket.params:
        value = torch.empty(p.shape)
        for piece in p.model_pieces:
            block = data[(state, piece.key)][tuple(piece.region())].reshape(piece.view_shape)
            value.as_strided(piece.view_shape, piece.view_stride, piece.view_offset).copy_(block)
        full[p.start : p.end] = value.reshape(-1)
    return full


def _write(root: str, saved: MegatronLayout, data: Data = DATA) -> None:
    """The saved run's bucket slices as the daemon stores them: one 1-D array per state, a shard per DP rank."""
    async def go() -> None:
        async with await open_backend(root, None, create=True) as backend:
            ckpt, sink = CheckpointWriter(backend), ChunkSink(backend)
            buf, bucket = saved.buffers[0], saved.buffers[0].buckets[0]
            records = []
            for state in STATES:
                name, full = saved.bucket_key(buf, bucket, state), _bucket(state, saved, data)
                shards = []
                for dp in range(buf.dp_size):
                    s = buf.slice_numel(bucket)
                    done = []
                    for c in range(dp * s // CHUNK, (dp + 1) * s // CHUNK):
                        block = full[c * CHUNK : (c + 1) * CHUNK].numpy()
                        crc, pieces = await sink.put(f"step_1/{name}/{fmt.chunk_key((c,), fmt.CHUNK_SEPARATOR)}", block)
                        done.append(fmt.ChunkRecord([c], CHUNK * 4, crc, pieces))
                    shards.append(fmt.ShardRecord(dp, [dp * s], [s], done))
                records.append(fmt.ArrayRecord(name, "float32", [bucket.padded_numel], [CHUNK], shards,
                                               separator=fmt.CHUNK_SEPARATOR))
            await commit_one_node(ckpt, 1, records)

    asyncio.run(go())


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_dp_slices_of_another_bucket_layout_read_only_what_the_slice_holds(tmp_path: Path, dp_size: int) -> None:
    root = str(tmp_path / "ckpt")
    saved = _layout(SAVED_AT, 256, 0, 2)
    _write(root, saved)

    async def go(dp_rank: int) -> dict[str, torch.Tensor]:
        live = _layout(LOADED_AT, 160, dp_rank, dp_size)
        async with open_root(root, None, create=False) as ckpt:
            planned = plan_dp_slices(await ckpt.read_commit(1), [saved], live)
            s = 160 // dp_size
            lo, hi = dp_rank * s, (dp_rank + 1) * s
            held = sum(max(0, min(p.end, hi) - max(p.start, lo)) for p in live.buffers[0].buckets[0].params)
            assert not planned.straddling
            planned_elements = sum(dst.numel() for _k, dst, _r in planned.gathers) + sum(
                math.prod(spec[0]) * len(keys) for keys, _outs, spec, _r in planned.states
            )
            assert planned_elements == held * len(STATES)
            return await planned.read(ckpt)

    for dp_rank in range(dp_size):
        got = asyncio.run(go(dp_rank))
        s = 160 // dp_size
        for state in STATES:
            want = _bucket(state, _layout(LOADED_AT, 160, dp_rank, dp_size))[dp_rank * s : (dp_rank + 1) * s]
            assert torch.equal(got[f"optim/tp0.pp0/buf0/bucket0/{state}"], want), (state, dp_rank)


def test_a_param_whose_piece_scrambles_its_elements_is_read_through_a_scratch_copy(tmp_path: Path) -> None:
    """No Megatron piece does so, but a piece view that does not keep the param's element order (here a
    param of shape (4, 6) held in model space as its transpose) cannot be cut into boxes: a rank whose slice
    cuts it reads it whole into a scratch copy per state and copies its part in. Bit-exact at DP 2 and 4."""
    g = torch.Generator().manual_seed(1)
    data = {(state, "tr"): torch.randn(6, 4, generator=g) for state in STATES}
    piece = ModelPiece("tr", (6, 4), (0, 0), 0, 0, (6, 4), (1, 6), (0, 0, 0))

    def layout(start: int, dp_rank: int, dp_size: int) -> MegatronLayout:
        param = ParamLayout("t", start, start + 24, 0, (4, 6), (piece,))
        bucket = BucketLayout(0, 0, 64, start + 24, (param,))
        buf = BufferLayout(0, 0, 0, 0, "float32", "float32", False, "tp0.pp0", dp_size, dp_rank, 0, (bucket,))
        return MegatronLayout(0, 1, 0, 1, dp_rank, dp_size, (buf,))

    root = str(tmp_path / "ckpt")
    saved = layout(0, 0, 2)  # wholly in DP rank 0's slice when saved
    _write(root, saved, data)
    for dp_size in (2, 4):
        for dp_rank in range(dp_size):
            live = layout(20, dp_rank, dp_size)  # cut at 32 (DP 2), at 32 and 48 (DP 4)

            async def go(live: MegatronLayout = live) -> tuple[dict[str, torch.Tensor], int]:
                async with open_root(root, None, create=False) as ckpt:
                    planned = plan_dp_slices(await ckpt.read_commit(1), [saved], live)
                    return await planned.read(ckpt), len(planned.straddling)

            got, scratch = asyncio.run(go())
            s = 64 // dp_size
            cut = 20 < (dp_rank + 1) * s < 44 or 20 < dp_rank * s < 44
            assert scratch == (len(STATES) if cut else 0)
            for state in STATES:
                want = _bucket(state, live, data)[dp_rank * s : (dp_rank + 1) * s]
                assert torch.equal(got[f"optim/tp0.pp0/buf0/bucket0/{state}"], want), (state, dp_size, dp_rank)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_the_read_plan_in_integers_matches_torch_view_arithmetic(dp_size: int) -> None:
    """The reads of a TP/bucket change are planned once per param in integers (a deep model has thousands):
    every destination view and source region equals what torch's own view arithmetic on a meta slice gives,
    for whole, cut, stacked (prepended axes) and two-piece params, inside a slice and across its edges."""
    saved = _layout(SAVED_AT, 256, 0, 2)
    index = _SavedIndex.of([saved])
    checked = 0
    for dp_rank in range(dp_size):
        live = _layout(LOADED_AT, 160, dp_rank, dp_size)
        bucket = live.buffers[0].buckets[0]
        s = 160 // dp_size
        lo, hi = dp_rank * s, (dp_rank + 1) * s
        meta = torch.empty(s, device="meta")
        for p in bucket.params:
            if not (p.start < hi and p.end > lo):
                continue
            sources = [(piece, sp, inter) for piece in p.model_pieces
                       for sp, inter in _cover(piece, index.overlapping(piece))]
            by_torch = [(prefix, _spec(dst), src)
                        for prefix, dst, src in _param_reads(p, sources, meta, 0, lo, hi, SliceRead(None))]  # type: ignore[arg-type]
            assert _param_read_specs(p, sources, meta, 0, lo, hi, SliceRead(None)) == by_torch  # type: ignore[arg-type]
            for _piece, sp, inter in sources:  # where the saved elements sit in their bucket
                assert _saved_elements(sp, inter) == _saved_by_torch(sp, inter)
            checked += len(by_torch)
    assert checked >= len(PARAMS)


def _saved_by_torch(sp: Any, region: tuple[tuple[int, int], ...]) -> Strided:
    """The saved piece's elements ``region`` located in its bucket by torch: its view of a meta param,
    with the leading axes unsqueezed, indexed."""
    piece = sp.piece
    view = torch.empty(sp.param.shape, device="meta").as_strided(piece.view_shape, piece.view_stride,
                                                                 piece.view_offset)
    for _ in range(piece.prepend_axis_num):
        view = view.unsqueeze(0)
    src = view[tuple(slice(x - o, y - o) for (x, y), o in zip(region, piece.global_offset, strict=True))]
    return Strided(sp.lo + int(src.storage_offset()), tuple(src.shape), tuple(src.stride()))
