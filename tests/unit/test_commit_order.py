"""The commit's order on a local root: the step's zarr metadata documents are written and made durable (one
sync of the filesystem) before ``COMMITTED`` is created, and ``latest`` moves only after the marker."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.writer import format as fmt
from ckptd.writer.arrays import ChunkSink
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter


def test_metadata_is_synced_before_the_marker_and_latest_moves_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path / "ckpt")
    events: list[tuple[str, Any]] = []

    async def go() -> None:
        async with await open_backend(root, None, create=True) as backend:
            t = torch.arange(8, dtype=torch.float32)
            crc, pieces = await ChunkSink(backend).put(f"step_1/w/{fmt.chunk_key([0], '.')}", t.numpy())
            rec = fmt.ArrayRecord("w", "float32", [8], [8], [fmt.ShardRecord(0, [0], [8], [
                fmt.ChunkRecord([0], 32, crc, pieces)])], separator=".")
            writer = CheckpointWriter(backend)
            await writer.write_part(fmt.PartManifest(fmt.FORMAT_VERSION, 1, 0, 1, 1, [0], [rec], {}, 0, 0.0))
            real_sync, real_create, real_replace = backend.sync_all, backend.create, backend.replace

            async def sync_all(*args: Any, **kwargs: Any) -> Any:
                out = await real_sync(*args, **kwargs)
                docs = {p.relative_to(root).as_posix() for p in Path(root).rglob("zarr.json")}
                events.append(("sync_all", docs))
                return out

            async def create(key: str, data: bytes) -> Any:
                events.append(("create", key))
                return await real_create(key, data)

            async def replace(key: str, data: bytes) -> Any:
                events.append(("replace", key))
                return await real_replace(key, data)

            monkeypatch.setattr(backend, "sync_all", sync_all)
            monkeypatch.setattr(backend, "create", create)
            monkeypatch.setattr(backend, "replace", replace)
            await writer.commit(1, 1, timeout=5)

    asyncio.run(go())
    kinds = [(kind, what if kind != "sync_all" else None) for kind, what in events]
    marker = kinds.index(("create", fmt.commit_marker(1)))
    synced = [i for i, (kind, _) in enumerate(events) if kind == "sync_all" and i < marker]
    assert synced, events  # the metadata was made durable before the marker
    docs = events[synced[-1]][1]
    assert {"step_1/w/zarr.json", "step_1/zarr.json", "zarr.json"} <= docs, docs
    latest = [i for i, (kind, what) in enumerate(kinds) if kind == "replace" and what == fmt.latest_key()]
    assert latest and min(latest) > marker, events  # latest only after the marker
    assert Path(root, fmt.latest_key()).read_text().strip() == "1"
    assert os.path.exists(os.path.join(root, fmt.commit_marker(1)))
