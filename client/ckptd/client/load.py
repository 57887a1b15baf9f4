"""Load a committed step into a template state dict, in place; each rank reads only its own regions.

The whole template is checked against the commit manifest before a single tensor is overwritten, so a
mismatch (missing key, other global shape, other dtype) leaves the caller's state untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch

from ckptd.client.state import Shard, dtype_name, iter_leaves, to_shard, torch_dtype
from ckptd.writer.arrays import open_array, read_region
from ckptd.writer.commit import CheckpointRoot
from ckptd.writer.errors import StateMismatchError
from ckptd.writer.format import ArrayRecord, CommitManifest, step_dir, validate_key
from ckptd.writer.store import close_store, normalize_root, open_store

READ_CONCURRENCY = 8


def load(
    root: str,
    step: int | Literal["latest"],
    template: Mapping[str, Any],
    *,
    rank: int = 0,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Fill ``template``'s tensors from ``step`` under ``root`` and return the state with plain data.

    Tensor leaves (plain tensors, :class:`Shard`, Megatron ``ShardedTensor``) are filled in place with
    the region they describe. Plain-data leaves come back from the checkpoint (this rank's copy, or rank
    0's when this rank did not exist at save time). Raises :class:`UncommittedStepError` for a step that
    never committed and :class:`StateMismatchError` (naming the key) when the template does not fit.
    """
    return asyncio.run(load_async(root, step, template, rank=rank, storage_options=storage_options))


async def load_async(
    root: str,
    step: int | Literal["latest"],
    template: Mapping[str, Any],
    *,
    rank: int = 0,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    url = normalize_root(root)
    store = await open_store(url, storage_options, create=False)
    try:
        return await _load(CheckpointRoot(store, url), step, template, rank)
    finally:
        await close_store(store)


async def _load(
    ckpt: CheckpointRoot, step: int | Literal["latest"], template: Mapping[str, Any], rank: int
) -> dict[str, Any]:
    store = ckpt.store
    commit = await ckpt.read_commit(await ckpt.resolve(step))
    targets = plan_reads(commit, template)
    sem = asyncio.Semaphore(READ_CONCURRENCY)
    prefix = step_dir(commit.step)

    async def one(shard: Shard) -> None:
        async with sem:
            arr = await open_array(store, f"{prefix}/{shard.key}")
            data = await read_region(arr, shard.global_offset, tuple(shard.data.shape))
            copy_into(shard.data, data)

    async with asyncio.TaskGroup() as tg:
        for shard in targets:
            tg.create_task(one(shard))
    objects = commit.objects.get(str(rank), commit.objects.get("0", {}))
    return _with_objects(template, objects)


def read_commit(
    root: str, step: int | Literal["latest"], *, storage_options: Mapping[str, Any] | None = None
) -> CommitManifest:
    """The commit manifest of a committed step (``"latest"`` resolves to the newest committed step)."""

    async def go() -> CommitManifest:
        url = normalize_root(root)
        ckpt = CheckpointRoot(await open_store(url, storage_options, create=False), url)
        return await ckpt.read_commit(await ckpt.resolve(step))

    return asyncio.run(go())


def read_flat(
    root: str,
    commit: CommitManifest,
    regions: Mapping[str, tuple[int, int]],
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Elements ``[start, stop)`` of 1-D arrays of a committed step, clipped to each array's length.

    Returns fresh tensors of the stored torch dtype (shorter than ``stop - start``, possibly empty,
    where the array ends earlier). Raises :class:`StateMismatchError` for an array the step does not
    hold or one that is not 1-D. Used to read DP slices when the DP size changed since the save.
    """
    arrays = {rec.name: rec for rec in commit.arrays}
    clipped: dict[str, tuple[int, int, str]] = {}
    for key, (start, stop) in regions.items():
        rec = arrays.get(validate_key(key))
        if rec is None:
            raise StateMismatchError(f"{key}: not in checkpoint step {commit.step}")
        if len(rec.shape) != 1:
            raise StateMismatchError(f"{key}: expected a 1-D array, the checkpoint has shape {tuple(rec.shape)}")
        lo = min(max(0, start), rec.shape[0])
        clipped[key] = (lo, max(lo, min(stop, rec.shape[0])), rec.torch_dtype)
    out = {k: torch.empty(hi - lo, dtype=torch_dtype(dt)) for k, (lo, hi, dt) in clipped.items()}

    async def go() -> None:
        url = normalize_root(root)
        store = await open_store(url, storage_options, create=False)
        sem = asyncio.Semaphore(READ_CONCURRENCY)
        prefix = step_dir(commit.step)

        async def one(key: str, lo: int, hi: int) -> None:
            if hi == lo:
                return
            async with sem:
                arr = await open_array(store, f"{prefix}/{key}")
                copy_into(out[key], await read_region(arr, (lo,), (hi - lo,)))

        async with asyncio.TaskGroup() as tg:
            for key, (lo, hi, _dt) in clipped.items():
                tg.create_task(one(key, lo, hi))

    asyncio.run(go())
    return out


def read_sidecar(root: str, name: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """A content-addressed document stored with :meth:`CheckpointClient.save` (``sidecars=``)."""

    async def go() -> str:
        store = await open_store(normalize_root(root), storage_options, create=False)
        try:
            return await CheckpointRoot(store, root).read_sidecar(name)
        finally:
            await close_store(store)

    return asyncio.run(go())


def plan_reads(commit: CommitManifest, template: Mapping[str, Any]) -> list[Shard]:
    """Every region the template asks for, checked against the manifest first. Pure."""
    arrays: dict[str, ArrayRecord] = {rec.name: rec for rec in commit.arrays}
    reads = []
    for path, leaf in iter_leaves(template):
        shard = to_shard(path, leaf, rank=0)  # every rank reads, replica or not
        if shard is None:
            continue
        validate_key(shard.key)
        rec = arrays.get(shard.key)
        if rec is None:
            raise StateMismatchError(f"{shard.key}: not in checkpoint step {commit.step}")
        if tuple(rec.shape) != tuple(shard.global_shape):
            raise StateMismatchError(
                f"{shard.key}: checkpoint has global shape {tuple(rec.shape)}, the template {shard.global_shape}"
            )
        if rec.torch_dtype != dtype_name(shard.data.dtype):
            raise StateMismatchError(
                f"{shard.key}: checkpoint has dtype {rec.torch_dtype}, the template {shard.data.dtype}"
            )
        end = [o + n for o, n in zip(shard.global_offset, shard.data.shape, strict=True)]
        if any(o < 0 or e > g for o, e, g in zip(shard.global_offset, end, rec.shape, strict=True)):
            raise StateMismatchError(f"{shard.key}: region {shard.global_offset}..{end} outside {rec.shape}")
        reads.append(shard)
    return reads


def copy_into(dst: torch.Tensor, data: np.ndarray) -> None:
    src = torch.from_numpy(np.ascontiguousarray(data))
    if src.dtype != dst.dtype:
        src = src.view(dst.dtype)  # raw-bit storage (bfloat16, float8)
    dst.copy_(src.view(dst.shape))


def _with_objects(template: Mapping[str, Any], objects: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in template.items():
        stored = objects.get(key) if isinstance(objects, Mapping) else None
        if isinstance(value, Mapping):
            out[key] = _with_objects(value, stored if isinstance(stored, Mapping) else {})
        elif to_shard(key, value, 0) is not None:
            out[key] = value
        else:
            out[key] = stored if key in objects else value
    for key, value in objects.items():
        out.setdefault(key, value)
    return out
