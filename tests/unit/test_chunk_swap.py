"""A raw chunk replaced by another valid chunk of the same size (its own bytes and its own crc32c trailer, as
a chunk of another step or another coordinate is) agrees with its trailer but not with the manifest: a load
of the region it holds raises and names it, whole or partial, and ``verify_array`` refuses it too."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch

from ckptd.client import Shard
from ckptd.client.reader import load, read_commit
from ckptd.testing.fixtures import commit_one_node
from ckptd.writer import format as fmt
from ckptd.writer.arrays import ChunkSink, verify_array
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import CorruptCheckpointError

W = torch.randn(6, 5, generator=torch.Generator().manual_seed(11))  # three whole chunks of 2 rows


def _write(root: str) -> None:
    async def go() -> None:
        async with await open_backend(root, None, create=True) as backend:
            sink, chunks = ChunkSink(backend), []
            for i in range(3):
                block = W[2 * i : 2 * i + 2]
                crc, pieces = await sink.put(f"step_1/w/{fmt.chunk_key([i, 0], '.')}", block.numpy())
                chunks.append(fmt.ChunkRecord([i, 0], block.numel() * 4, crc, pieces))
            rec = fmt.ArrayRecord("w", "float32", [6, 5], [2, 5], [fmt.ShardRecord(0, [0, 0], [6, 5], chunks)],
                                  separator=".")
            writer = CheckpointWriter(backend)
            await commit_one_node(writer, 1, [rec])

    asyncio.run(go())


def test_a_valid_chunk_of_other_bytes_in_a_chunks_place_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    _write(root)
    assert torch.equal(load(root, 1, {"w": torch.zeros(6, 5)})["w"], W)
    chunk = os.path.join(root, "step_1", "w", "c.1.0")
    shutil.copy(os.path.join(root, "step_1", "w", "c.0.0"), chunk)  # same size, its own valid trailer
    with pytest.raises(CorruptCheckpointError, match=r"c\.1\.0"):
        load(root, 1, {"w": torch.zeros(6, 5)})
    part = torch.zeros(2, 5)
    with pytest.raises(CorruptCheckpointError, match=r"c\.1\.0"):
        load(root, 1, {"w": Shard("w", part, (6, 5), (2, 0))})
    rest = torch.zeros(2, 5)
    load(root, 1, {"w": Shard("w", rest, (6, 5), (4, 0))})  # chunk 2 is intact
    assert torch.equal(rest, W[4:6])

    async def verify() -> None:
        async with await open_backend(root, None) as backend:
            rec = next(a for a in read_commit(root, 1).arrays if a.name == "w")
            with pytest.raises(CorruptCheckpointError, match=r"chunk \[1, 0\]"):
                await verify_array(backend.store, "step_1", rec)

    asyncio.run(verify())
