"""Edge chunks (cut by the array's end): format 3 stores them whole, padded with the fill value, so zarr-python
reads them; ckptd's load, in-memory restore and ``verify`` read them; and edge chunks of format 2 (stored cut,
which zarr-python refuses) still load and verify. Steps are written by the real writer (no daemon)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from ckptd.client.fastread import ChunkReader
from ckptd.client.protocol import RestoreShard
from ckptd.client.reader import load
from ckptd.client.restore import ArenaSource
from ckptd.testing.fixtures import commit_one_node
from ckptd.writer import format as fmt
from ckptd.writer.arrays import ChunkSink, full_chunk, verify_array
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import CorruptCheckpointError
from ckptd.writer.root import open_root

# name -> (tensor, chunk shape): cut along one axis, along both, and a 1-D bfloat16 one
G = torch.Generator().manual_seed(3)
ARRAYS = {
    "rows": (torch.randn(10, 3, generator=G), (4, 3)),
    "both": (torch.randn(5, 7, generator=G), (2, 3)),
    "b16": (torch.randn(9, generator=G).to(torch.bfloat16), (4,)),
}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _write(root: str, *, whole: bool, arrays: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = ARRAYS) -> None:
    """Step 1 with every array one shard of rank 0; ``whole=False`` writes edge chunks cut, and chunk keys
    ``c/<i>/<j>`` (format 2)."""

    async def go() -> None:
        async with await open_backend(root, None, create=True) as backend:
            ckpt, sink = CheckpointWriter(backend), ChunkSink(backend)
            records = []
            separator = fmt.CHUNK_SEPARATOR if whole else "/"
            for key, (t, grid) in arrays.items():
                data, shape = _bits(t), list(t.shape)
                chunks = []
                for coords in fmt.region_chunks([0] * len(shape), shape, grid):
                    block = data[fmt.chunk_selection_of(coords, grid, shape, [0] * len(shape))]
                    if whole:
                        block = full_chunk(block, grid)
                    crc, pieces = await sink.put(f"step_1/{key}/{fmt.chunk_key(coords, separator)}", block)
                    chunks.append(fmt.ChunkRecord(list(coords), block.nbytes, crc, pieces))
                shard = fmt.ShardRecord(0, [0] * len(shape), shape, chunks)
                records.append(fmt.ArrayRecord(key, str(t.dtype).removeprefix("torch."), shape, list(grid), [shard],
                                               separator=separator))
            await commit_one_node(ckpt, 1, records)

    asyncio.run(go())


async def _verify(root: str) -> int:
    async with open_root(root) as ckpt:
        commit = await ckpt.read_commit(1)
        return sum([await verify_array(ckpt.store, "step_1", rec) for rec in commit.arrays])


def _template() -> dict[str, torch.Tensor]:
    return {key: torch.zeros_like(t) for key, (t, _grid) in ARRAYS.items()}


def _assert_loaded(out: dict[str, torch.Tensor]) -> None:
    for key, (t, _grid) in ARRAYS.items():
        assert np.array_equal(_bits(out[key]), _bits(t)), key


def test_full_chunk_pads_only_edge_blocks() -> None:
    block = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert full_chunk(block, (2, 3)) is block
    padded = full_chunk(block[:1, :2], (2, 3))
    assert padded.tolist() == [[0, 1, 0], [0, 0, 0]]


@pytest.mark.parametrize("whole", [True, False], ids=["format3-whole", "format2-cut"])
def test_edge_chunks_load_and_verify(tmp_path: Path, whole: bool) -> None:
    root = str(tmp_path / "ckpt")
    _write(root, whole=whole)
    _assert_loaded(load(root, 1, _template()))
    # verify re-reads what is stored: whole chunks (10x3 in 4x3: 36 elements, 5x7 in 2x3: 54, 9 in 4: 12)
    stored = (36 + 54) * 4 + 12 * 2 if whole else (30 + 35) * 4 + 9 * 2
    assert asyncio.run(_verify(root)) == stored
    arr = zarr.open_array(root, path="step_1/rows", mode="r")
    if whole:  # a plain zarr v3 reader decodes them
        assert np.array_equal(arr[...], ARRAYS["rows"][0].numpy())
    else:  # format 2's cut chunks are not zarr v3 (why format 3 pads them)
        with pytest.raises(ValueError):
            arr[...]


def test_a_corrupted_cut_chunk_fails_verify(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _write(str(root), whole=False)
    chunk = root / "step_1" / "rows" / "c" / "2" / "0"  # rows 8..9: the cut chunk
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"rows: chunk \[2, 0\]"):
        asyncio.run(_verify(str(root)))


def _arena(arrays: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> tuple[bytearray, dict[Any, RestoreShard]]:
    """The arena as the daemon keeps a step: each array's block of rank 0, back to back, unpadded."""
    arena, shards = bytearray(), {}
    for key, (t, _grid) in arrays.items():
        raw = _bits(t).tobytes()
        shards[(key, (0,) * t.dim(), tuple(t.shape))] = RestoreShard(
            key, str(t.dtype).removeprefix("torch."), [0] * t.dim(), list(t.shape), len(arena), len(raw)
        )
        arena += raw
    return arena, shards


def _restore(root: str, memory: ArenaSource, out: dict[str, torch.Tensor]) -> None:
    async def go() -> None:
        async with open_root(root) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1), memory=memory)
            for key, dst in out.items():
                reader.add(key, dst, (0,) * dst.dim())
            await reader.run()

    asyncio.run(go())


def test_in_memory_restore_checks_whole_edge_chunks(tmp_path: Path) -> None:
    """The arena holds the rank's block (no padding); its edge chunks are checked against the manifest's
    record of the padded chunk, so the copy is served from memory, not rejected."""
    root = str(tmp_path / "ckpt")
    _write(root, whole=True)
    arena, shards = _arena(ARRAYS)
    memory = ArenaSource(1, memoryview(bytes(arena)), shards)
    out = _template()
    _restore(root, memory, out)
    _assert_loaded(out)
    assert memory.rejected == [] and memory.served_bytes == len(arena)


# chunks that are runs of the shard (rows of 2; a 1-D array in 4s), and one cut along both axes
EVEN = {
    "rows": (torch.randn(8, 3, generator=G), (2, 3)),
    "b16": (torch.randn(12, generator=G).to(torch.bfloat16), (4,)),
    "both": (torch.randn(4, 6, generator=G), (2, 3)),
}


@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged"])
@pytest.mark.parametrize("dst", ["host", "device", "strided", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_in_memory_restore_into_each_kind_of_destination(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_buffers: list[tuple[int, bool]], dst: str, damaged: bool
) -> None:
    """Bit-exact from the arena into a host tensor (copied and checked in place), a tensor outside host
    memory (through the reused bounce buffers: a CPU tensor stands in for a GPU's here, the one difference
    being the last ``copy_``; ``-m gpu`` runs it with CUDA tensors) and a non-contiguous view (through a
    host copy of the shard). A damaged byte fails that shard's check in each, and the shard is read from
    storage instead."""
    root = str(tmp_path / "ckpt")
    _write(root, whole=True, arrays=EVEN)
    arena, shards = _arena(EVEN)
    if damaged:
        hit = shards[("rows", (0, 0), (8, 3))]
        arena[hit.offset + hit.nbytes - 5] ^= 0x10  # in the last chunk: the first three pass their checks
    if dst == "device":
        monkeypatch.setattr("ckptd.client.restore.host_addressable", lambda t: False)
        monkeypatch.setattr("ckptd.client.restore.pinnable", lambda t: True)
    memory = ArenaSource(1, memoryview(bytes(arena)), shards)
    if dst == "cuda":
        out = {key: torch.zeros_like(t, device="cuda") for key, (t, _grid) in EVEN.items()}
    elif dst == "strided":
        out = {key: torch.zeros(*t.shape, 2, dtype=t.dtype)[..., 0] for key, (t, _grid) in EVEN.items()}
        assert not any(o.is_contiguous() for o in out.values())
    else:
        out = {key: torch.zeros_like(t) for key, (t, _grid) in EVEN.items()}
    _restore(root, memory, out)
    for key, (t, _grid) in EVEN.items():
        assert np.array_equal(_bits(out[key].cpu().contiguous()), _bits(t)), key
    assert memory.rejected == (["rows"] if damaged else [])
    assert memory.served_bytes == len(arena) - (96 if damaged else 0)
    # the bounce buffers: only for the device's destinations, one per worker thread at most, reused
    assert (memory.bounces.allocations > 0) == (dst in ("device", "cuda"))
    assert memory.bounces.allocations <= 8
    # ... asked page-locked (pinned where CUDA is up: the copy to the GPU is then a DMA from them), as is the
    # staging of a CUDA tensor's shard read from storage instead; host destinations never ask
    pinned = [n for n, pin in host_buffers if pin]
    expected = {"device": memory.bounces.allocations, "cuda": memory.bounces.allocations + damaged}
    assert len(pinned) == expected.get(dst, 0)


def test_zero_size_blocks_have_a_grid_and_zero_extents_are_typed_errors() -> None:
    from ckptd.client.state import Shard, validate_shard
    from ckptd.writer.errors import ShardLayoutError

    empty = Shard("e", torch.zeros(0, 4), (0, 4), (0, 0))
    assert empty.grid == (1, 4)
    validate_shard(empty)  # was a ZeroDivisionError
    with pytest.raises(ShardLayoutError, match="extent below 1"):
        fmt.check_region("w", (8,), (0,), (8,), (0,))
