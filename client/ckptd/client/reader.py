"""Read committed checkpoints straight from storage: one async core, thin synchronous wrappers.

Every async reader takes either a root URL (it then opens the storage backend, and closes it before it
returns) or a :class:`~ckptd.writer.root.CheckpointRoot` the caller opened (used as is, left open), so a
caller that reads several things opens storage once::

    async with open_root(url, storage_options) as root:
        commit = await read_commit_async(root, "latest")
        await load_async(root, commit.step, template)

The synchronous functions (:func:`load`, :func:`read_commit`, :func:`read_flat`, :func:`read_sidecar`)
take a URL and run the async core through :func:`ckptd.writer.sync.run_sync`, so they also work from a
thread that runs an event loop.

``load`` fills a template in place; the whole template is checked against the commit manifest before a
single tensor is overwritten, so a mismatch (missing key, other global shape, other dtype) leaves the
caller's state untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

import numpy as np
import torch

from ckptd.client.collector import paused
from ckptd.client.fastread import ChunkReader
from ckptd.client.restore import ArenaSource
from ckptd.client.state import Shard, dtype_name, iter_leaves, to_shard, torch_dtype
from ckptd.writer.commit import CLOCK_SKEW_S
from ckptd.writer.errors import CheckpointNotFoundError, StateMismatchError
from ckptd.writer.format import ArrayRecord, CommitManifest, note_of, other_attempt, validate_key
from ckptd.writer.root import CheckpointRoot, open_root
from ckptd.writer.sync import run_sync

__all__ = [
    "READ_CONCURRENCY",
    "copy_into",
    "fill_async",
    "load",
    "load_async",
    "opened",
    "plan_reads",
    "read_commit",
    "read_commit_async",
    "read_flat",
    "read_flat_async",
    "read_sidecar",
    "read_sidecar_async",
]

READ_CONCURRENCY = 8

Step = int | Literal["latest"]


@contextlib.asynccontextmanager
async def opened(
    root: str | CheckpointRoot, storage_options: Mapping[str, Any] | None = None
) -> AsyncIterator[CheckpointRoot]:
    """``root`` itself if already opened (left open), else the root at that URL, closed on exit."""
    if isinstance(root, CheckpointRoot):
        yield root
        return
    async with open_root(root, storage_options, create=False) as ckpt:
        yield ckpt


# --- async core -----------------------------------------------------------------------------------
Fate = Literal["committed", "other", "failed", "part", "none"]


async def stored_fate_async(
    root: str | CheckpointRoot, step: int, node: int, attempt: str, since: float = 0.0, *,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[Fate, Mapping[str, Any] | None]:
    """What storage says of one node's attempt at a step, for a rank whose daemon is gone: ``"committed"``
    (with this attempt), ``"other"`` (committed with another attempt's part), ``"none"`` (this node's part of
    this attempt is not written: the save died with the daemon), ``"failed"`` (the part is written and a
    failure note of this attempt says the step will not commit; returned with it; ``since``: the save's
    wall-clock start, for unnamed attempts, less the slack between nodes' clocks as a live daemon allows it),
    or ``"part"`` (the part is written, the step not decided yet)."""
    async with opened(root, storage_options) as ckpt:
        try:
            commit = await ckpt.read_commit(step)
        except CheckpointNotFoundError:
            pass
        else:
            return ("other" if any(other_attempt(a, attempt) for a in commit.attempts) else "committed"), None
        part = (await ckpt.read_parts(step)).get(node)
        if part is None or other_attempt(part.attempt, attempt):
            return "none", None
        note = await ckpt.read_failed(step, attempt)
        if note is not None and note_of(note, attempt, since - CLOCK_SKEW_S if since else 0.0):
            return "failed", note
        return "part", None


async def stop_waiting_async(
    root: str | CheckpointRoot, step: int, node: int, attempt: str, *, storage_options: Mapping[str, Any] | None = None,
) -> Mapping[str, Any] | None:
    """A rank whose daemon is gone stops waiting for a multi-node step of a named ``attempt`` as that daemon
    would have at its commit timeout: it claims the attempt's ``"timeout"`` verdict for ``node``. None: this
    claim decided it (the coordinator will not commit the step); else the verdict that stands (``"commit"``:
    the coordinator's marker is its next write). Storage without an atomic create cannot decide between
    two claims: nothing is claimed there; the verdict that stands is returned, ``{"verdict": "unknown"}``
    where none does."""
    async with opened(root, storage_options) as ckpt:
        if not ckpt.backend.capabilities.atomic_create:
            return await ckpt.read_verdict(step, attempt) or {"verdict": "unknown"}
        return await ckpt.claim_verdict(step, attempt, "timeout", node=node)


async def load_async(
    root: str | CheckpointRoot,
    step: Step,
    template: Mapping[str, Any],
    *,
    rank: int = 0,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Async :func:`load`; ``root`` may be an opened :class:`CheckpointRoot`."""
    async with opened(root, storage_options) as ckpt:
        commit = await ckpt.read_commit(await ckpt.resolve(step))
        await fill_async(ckpt, commit, template)
    objects = commit.objects.get(str(rank), commit.objects.get("0", {}))
    return _with_objects(template, objects)


async def fill_async(
    ckpt: CheckpointRoot, commit: CommitManifest, template: Mapping[str, Any], *, memory: ArenaSource | None = None
) -> None:
    """Fill the template's tensors in place from ``commit``'s arrays, everything checked first
    (:func:`plan_reads`); raw chunks are read straight into the tensors, crc32c checked
    (:class:`~ckptd.client.fastread.ChunkReader`). ``memory``: shards the daemon kept in its arena
    (in-memory restore), used where they match exactly and pass their checksums."""
    targets = plan_reads(commit, template)
    reader = ChunkReader(ckpt, commit, memory=memory)
    for shard in targets:
        reader.add(shard.key, shard.data, shard.global_offset)
    await reader.run()


async def read_commit_async(
    root: str | CheckpointRoot, step: Step, *, storage_options: Mapping[str, Any] | None = None
) -> CommitManifest:
    """Async :func:`read_commit`; ``root`` may be an opened :class:`CheckpointRoot`."""
    async with opened(root, storage_options) as ckpt:
        return await ckpt.read_commit(await ckpt.resolve(step))


async def read_flat_async(
    root: str | CheckpointRoot,
    commit: CommitManifest,
    regions: Mapping[str, tuple[int, int]],
    *,
    storage_options: Mapping[str, Any] | None = None,
    memory: ArenaSource | None = None,
) -> dict[str, torch.Tensor]:
    """Async :func:`read_flat`; ``root`` may be an opened :class:`CheckpointRoot`; ``memory`` as in
    :func:`fill_async`."""
    clipped = _clip_flat(commit, regions)
    out = {k: torch.empty(hi - lo, dtype=torch_dtype(dt)) for k, (lo, hi, dt) in clipped.items()}
    async with opened(root, storage_options) as ckpt:
        reader = ChunkReader(ckpt, commit, memory=memory)
        for key, (lo, hi, _dt) in clipped.items():
            if hi > lo:
                reader.add(key, out[key], (lo,))
        await reader.run()
    return out


async def read_sidecar_async(
    root: str | CheckpointRoot, name: str, *, storage_options: Mapping[str, Any] | None = None
) -> str:
    """Async :func:`read_sidecar`; ``root`` may be an opened :class:`CheckpointRoot`."""
    async with opened(root, storage_options) as ckpt:
        return await ckpt.read_sidecar(name)


# --- synchronous entry points ---------------------------------------------------------------------
@paused
def load(
    root: str,
    step: Step,
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
    return run_sync(load_async(root, step, template, rank=rank, storage_options=storage_options))


def stored_fate(
    root: str, step: int, node: int, attempt: str, since: float = 0.0, *,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[Fate, Mapping[str, Any] | None]:
    """Sync :func:`stored_fate_async`."""
    return run_sync(stored_fate_async(root, step, node, attempt, since, storage_options=storage_options))


def stop_waiting(
    root: str, step: int, node: int, attempt: str, *, storage_options: Mapping[str, Any] | None = None,
) -> Mapping[str, Any] | None:
    """Sync :func:`stop_waiting_async`."""
    return run_sync(stop_waiting_async(root, step, node, attempt, storage_options=storage_options))


def read_commit(root: str, step: Step, *, storage_options: Mapping[str, Any] | None = None) -> CommitManifest:
    """The commit manifest of a committed step (``"latest"`` resolves to the newest committed step)."""
    return run_sync(read_commit_async(root, step, storage_options=storage_options))


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
    return run_sync(read_flat_async(root, commit, regions, storage_options=storage_options))


def read_sidecar(root: str, name: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """A content-addressed document stored with :meth:`CheckpointClient.save` (``sidecars=``)."""
    return run_sync(read_sidecar_async(root, name, storage_options=storage_options))


# --- pure parts -----------------------------------------------------------------------------------
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
        if shard.data.dim() != len(shard.global_offset):
            raise StateMismatchError(f"{shard.key}: the template's tensor has {shard.data.dim()} dimension(s), "
                                     f"its offset {tuple(shard.global_offset)} {len(shard.global_offset)}")
        end = [o + n for o, n in zip(shard.global_offset, shard.data.shape, strict=True)]
        if any(o < 0 or e > g for o, e, g in zip(shard.global_offset, end, rec.shape, strict=True)):
            raise StateMismatchError(f"{shard.key}: region {shard.global_offset}..{end} outside {rec.shape}")
        reads.append(shard)
    return reads


def copy_into(dst: torch.Tensor, data: np.ndarray) -> None:
    """Copy a region read from storage into ``dst`` (raw-bit dtypes such as bfloat16 reinterpreted)."""
    src = torch.from_numpy(np.ascontiguousarray(data))
    if src.dtype != dst.dtype:
        src = src.view(dst.dtype)  # raw-bit storage (bfloat16, float8)
    dst.copy_(src.view(dst.shape))


def _clip_flat(commit: CommitManifest, regions: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int, str]]:
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
    return clipped


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
