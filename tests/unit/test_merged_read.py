"""The merged-layout read (``merged_optimizer_slices``) goes through the fast read path: every model piece of
every param a rank's bucket slices touch is read from its merged array, bit-exact against the slice built
independently here (whole chunks read straight into the slice, chunks a column piece cuts, a piece with a
prepended layer axis, non-contiguous pieces, params that straddle a DP slice boundary, of which only the
part inside the slice is read, straight into place, at DP 1, 2 and 4); a corrupted,
truncated or missing merged chunk raises CorruptCheckpointError naming it, locally and on S3 (moto). The
merged step is written by the real writer (ChunkSink + CheckpointWriter, no daemon) from a hand-made layout.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from ckptd.client.megatron.reshard import merged_optimizer_slices, plan_merged_slices
from ckptd.testing.fixtures import BUCKET, commit_one_node
from ckptd.testing.s3server import S3Server
from ckptd.writer import format as fmt
from ckptd.writer.arrays import ChunkSink
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import CorruptCheckpointError
from ckptd.writer.layout import BucketLayout, BufferLayout, MegatronLayout, ModelPiece, ParamLayout
from ckptd.writer.root import open_root

STATES = ("param", "exp_avg")
G = torch.Generator().manual_seed(0)
# model key -> (global shape, chunk shape); every shape a multiple of its chunks
MERGED = {"w": ((6, 8), (3, 8)), "b": ((10,), (5,)), "layers": ((2, 5, 8), (1, 5, 8)), "c0": ((5, 4), (5, 4)),
          "c1": ((10, 4), (5, 4))}
DATA = {(state, key): torch.randn(shape, generator=G) for state in STATES for key, (shape, _c) in MERGED.items()}


def _piece(key: str, offset: tuple[int, ...], shape: tuple[int, ...], stride: tuple[int, ...], view_offset: int = 0,
           prepend: int = 0) -> ModelPiece:
    return ModelPiece(key, MERGED[key][0], offset, prepend, view_offset, shape, stride, (0,) * 3)


PARAMS = (
    # the right column half of "w" (a TP split): chunks of full rows, each cut by the piece
    ParamLayout("w", 0, 24, 0, (6, 4), (_piece("w", (0, 4), (6, 4), (4, 1)),)),
    ParamLayout("b", 64, 74, 0, (10,), (_piece("b", (0,), (10,), (1,)),)),  # two whole chunks, read in place
    # layer 1 of a stacked array; straddles the DP boundary at 128
    ParamLayout("l", 100, 140, 0, (5, 8), (_piece("layers", (1, 0, 0), (5, 8), (8, 1), prepend=1),)),
    # two non-contiguous column pieces of one param (a factory such as SwiGLU's, along columns); at DP 4 it
    # straddles the boundary at 192 mid-row
    ParamLayout("c", 181, 221, 0, (5, 8), (_piece("c0", (0, 0), (5, 4), (8, 1)),
                                           _piece("c1", (5, 0), (5, 4), (8, 1), view_offset=4))),
)


def _layout(dp_rank: int, dp_size: int = 2) -> MegatronLayout:
    bucket = BucketLayout(0, 0, 256, 221, PARAMS)
    buf = BufferLayout(0, 0, 0, 0, "float32", "float32", False, "tp0.pp0", dp_size, dp_rank, 0, (bucket,))
    return MegatronLayout(0, 1, 0, 1, dp_rank, dp_size, (buf,))


def _expected(state: str, dp_rank: int, dp_size: int = 2) -> torch.Tensor:
    """The rank's slice of the padded bucket, built by hand from the merged arrays."""
    full = torch.zeros(256)
    for p in PARAMS:
        value = torch.empty(p.shape)
        for piece in p.model_pieces:
            block = DATA[(state, piece.key)][tuple(piece.region())].reshape(piece.view_shape)
            value.as_strided(piece.view_shape, piece.view_stride, piece.view_offset).copy_(block)
        full[p.start : p.end] = value.reshape(-1)
    s = 256 // dp_size
    return full[dp_rank * s : (dp_rank + 1) * s]


def _held(dp_rank: int, dp_size: int) -> int:
    """Elements of params in the rank's slice: all a load there needs to read of each state."""
    s = 256 // dp_size
    lo, hi = dp_rank * s, (dp_rank + 1) * s
    return sum(max(0, min(p.end, hi) - max(p.start, lo)) for p in PARAMS)


def _write(root: str, options: dict[str, object] | None = None) -> None:
    async def go() -> None:
        async with await open_backend(root, options, create=True) as backend:
            ckpt, sink = CheckpointWriter(backend), ChunkSink(backend)
            records = []
            for (state, key), t in DATA.items():
                shape, chunks = MERGED[key]
                name = fmt.merged_array_name(state, key)
                done = []
                for coords in itertools.product(*(range(n // c) for n, c in zip(shape, chunks, strict=True))):
                    block = t[tuple(slice(i * c, (i + 1) * c) for i, c in zip(coords, chunks, strict=True))]
                    key = f"step_1/{name}/{fmt.chunk_key(coords, fmt.CHUNK_SEPARATOR)}"
                    crc, pieces = await sink.put(key, block.contiguous().numpy())
                    done.append(fmt.ChunkRecord(list(coords), block.numel() * 4, crc, pieces))
                shard = fmt.ShardRecord(0, [0] * len(shape), list(shape), done)
                records.append(fmt.ArrayRecord(name, "float32", list(shape), list(chunks), [shard],
                                               separator=fmt.CHUNK_SEPARATOR))
            await commit_one_node(ckpt, 1, records)

    asyncio.run(go())


def _read(
    url: str, dp_rank: int, options: dict[str, object] | None = None, dp_size: int = 2
) -> dict[str, torch.Tensor]:
    async def go() -> dict[str, torch.Tensor]:
        async with open_root(url, options, create=False) as ckpt:
            manifest = await ckpt.read_commit(1)  # stands in for the merge manifest: same records
            planned = plan_merged_slices(1, manifest, _layout(dp_rank, dp_size))
            # a param cut by the slice's edge: only its part inside is read, straight into place
            assert not planned.straddling
            assert sum(dst.numel() for _k, dst, _o in planned.regions) == _held(dp_rank, dp_size) * len(STATES)
            return await merged_optimizer_slices(ckpt, 1, manifest, _layout(dp_rank, dp_size))

    return asyncio.run(go())


def _check(url: str, options: dict[str, object] | None = None, dp_size: int = 2) -> None:
    for dp_rank in range(dp_size):
        got = _read(url, dp_rank, options, dp_size)
        for state in STATES:
            want = _expected(state, dp_rank, dp_size)
            assert torch.equal(got[f"optim/tp0.pp0/buf0/bucket0/{state}"], want), (state, dp_rank)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("merged") / "ckpt")
    _write(path)
    return path


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_merged_slices_are_bit_exact(root: str, dp_size: int) -> None:
    _check(root, dp_size=dp_size)


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_merged_chunk_raises(root: str, tmp_path: Path, damage: str) -> None:
    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    # chunk 1 of "layers" holds layer 1 (param "l", rank 0's slice and rank 1's)
    path = os.path.join(copy, "step_1", fmt.merged_array_name("exp_avg", "layers"), "c.1.0.0")
    data = bytearray(Path(path).read_bytes())
    if damage == "flip":
        data[7] ^= 0x01
        Path(path).write_bytes(bytes(data))
    elif damage == "truncate":
        Path(path).write_bytes(bytes(data[:-3]))
    else:
        os.remove(path)
    chunk = re.escape(f"step_1/{fmt.merged_array_name('exp_avg', 'layers')}/c.1.0.0")
    for dp_rank in (0, 1):
        with pytest.raises(CorruptCheckpointError, match=chunk):
            _read(copy, dp_rank)


@pytest.mark.s3
def test_s3_merged_slices_and_a_truncated_chunk(s3_options: dict[str, object], s3: S3Server) -> None:
    url = f"s3://{BUCKET}/merged-read"
    _write(url, s3_options)
    _check(url, s3_options)
    chunk = f"step_1/{fmt.merged_array_name('param', 'w')}/c.1.0"
    key = f"merged-read/{chunk}"
    client = s3.client()
    data = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=data[:-1])
    with pytest.raises(CorruptCheckpointError, match=re.escape(chunk)):
        _read(url, 0, s3_options)
