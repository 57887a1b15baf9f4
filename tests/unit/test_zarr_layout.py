"""The stored hierarchy is plain zarr v3: zarr-python alone lists committed steps as groups and opens every
array without a warning (ckptd's control objects live in ``_ckptd`` folders, declared empty arrays), and
checkpoints of format 1 (control objects beside the arrays) still load.

Steps are written by the real writer (chunk sink, part manifest, coordinator commit), without a daemon.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import warnings
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zarr

from ckptd.client.reader import load
from ckptd.writer import format as fmt
from ckptd.writer.arrays import ChunkSink
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.root import open_root


def _tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"model/w": torch.randn(6, 4, generator=g), "x": torch.arange(10, dtype=torch.int64) * step}


def _write_step(root: str, step: int) -> None:
    async def go() -> None:
        async with await open_backend(root, None, create=True) as backend:
            ckpt = CheckpointWriter(backend)
            sink = ChunkSink(backend)
            records = []
            for key, t in _tensors(step).items():
                shape = list(t.shape)
                grid = [shape[0] // 2, *shape[1:]]
                shards = []
                for i in range(2):
                    lo = i * grid[0]
                    coords = [i] + [0] * (len(shape) - 1)
                    block = t[lo : lo + grid[0]].numpy()
                    path = f"{fmt.step_dir(step)}/{key}/{fmt.chunk_key(coords, fmt.CHUNK_SEPARATOR)}"
                    crc, pieces = await sink.put(path, block)
                    chunk = fmt.ChunkRecord(coords, block.nbytes, crc, pieces)
                    shards.append(fmt.ShardRecord(i, [lo] + [0] * (len(shape) - 1), [grid[0], *shape[1:]], [chunk]))
                records.append(fmt.ArrayRecord(key, str(t.dtype).removeprefix("torch."), shape, grid, shards,
                                               separator=fmt.CHUNK_SEPARATOR))
            await ckpt.write_sidecar(fmt.sidecar_name("{}"), "{}")
            part = fmt.PartManifest(fmt.FORMAT_VERSION, step, 0, 1, 2, [0, 1], records, {"0": {"n": step}}, 0, 0.0)
            await ckpt.write_part(part)
            await ckpt.commit(step, 1, timeout=5)

    asyncio.run(go())


def _to_format_1(root: Path, step: int) -> None:
    """Rewrite a step (and the root's control objects) the way format 1 stored them."""
    ctl = root / f"step_{step}" / fmt.CONTROL_DIR
    for name in (fmt.COMMIT_MARKER, fmt.PARTS_DIR):
        shutil.move(ctl / name, root / f"step_{step}" / name)
    shutil.rmtree(ctl)
    (root / f"step_{step}" / "zarr.json").unlink()  # format 1 never wrote the step's group document
    marker = root / f"step_{step}" / fmt.COMMIT_MARKER
    commit = fmt.decode_commit(marker.read_bytes())
    marker.write_bytes(fmt.encode_json(msgspec.structs.replace(commit, format=1)))
    top = root / fmt.CONTROL_DIR
    if top.exists():
        for name in (fmt.LATEST, fmt.SIDECAR_DIR):
            if (top / name).exists() and not (root / name).exists():
                shutil.move(top / name, root / name)
        shutil.rmtree(top)


def test_zarr_python_lists_steps_and_opens_every_array_without_warnings(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        _write_step(root, step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a control object in a group's folder would warn here
        group = zarr.open_group(root, mode="r")
        assert sorted(group.group_keys()) == ["step_1", "step_2"]
        members = dict(group.members(max_depth=None))
        arrays = {k: v for k, v in members.items() if isinstance(v, zarr.Array)}
        for step in (1, 2):
            for key, t in _tensors(step).items():
                assert np.array_equal(arrays[f"step_{step}/{key}"][...], t.numpy())
        for arr in arrays.values():  # control folders are empty arrays, readable too
            arr[...]
        assert arrays[fmt.CONTROL_DIR].shape == (0,)
        step_group = zarr.open_group(os.path.join(root, "step_2"), mode="r")
        assert sorted(dict(step_group.members(max_depth=None))) == [
            fmt.CONTROL_DIR, "model", "model/w", "x"
        ]
        assert group.attrs["ckptd"]["format"] == fmt.FORMAT_VERSION


def test_format_1_steps_still_load_and_delete(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _write_step(str(root), 1)
    _to_format_1(root, 1)
    assert sorted(os.listdir(root)) == ["_sidecars", "latest", "step_1", "zarr.json"]
    assert (root / "step_1" / "COMMITTED").exists()
    template = {"model/w": torch.zeros(6, 4), "x": torch.zeros(10, dtype=torch.int64)}
    out = load(str(root), "latest", template)
    assert torch.equal(out["model/w"], _tensors(1)["model/w"]) and torch.equal(out["x"], _tensors(1)["x"])
    assert out["n"] == 1

    async def check() -> None:
        async with open_root(str(root)) as ckpt:
            assert await ckpt.committed_steps() == [1]
            assert await ckpt.latest_hint() == 1
            assert await ckpt.read_sidecar(fmt.sidecar_name("{}")) == "{}"
            assert (await ckpt.read_commit(1)).format == 1

    asyncio.run(check())
    # a new step written next to the old one: both load; retention removes the old one marker first
    _write_step(str(root), 2)
    assert torch.equal(load(str(root), 1, template)["x"], _tensors(1)["x"])

    async def retain() -> list[int]:
        async with await open_backend(str(root), None) as backend:
            return await CheckpointWriter(backend).retain(1)

    assert asyncio.run(retain()) == [1]
    assert not (root / "step_1").exists()
    assert torch.equal(load(str(root), "latest", template)["x"], _tensors(2)["x"])


@pytest.mark.parametrize("version", [1, 2])
def test_control_names(version: int) -> None:
    prefix = "step_3/_ckptd/" if version == 2 else "step_3/"
    assert fmt.commit_marker(3, version) == prefix + "COMMITTED"
    assert fmt.part_key(3, 1, version) == prefix + "_parts/node-1.json"
    assert fmt.latest_key(version) == ("_ckptd/latest" if version == 2 else "latest")
    assert fmt.merged_marker(3, version) == ("step_3/merged/_ckptd/MERGED" if version == 2 else "step_3/merged/MERGED")
