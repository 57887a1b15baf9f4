"""``ckptd merge``: build the fully-reshardable optimizer layout offline from the stored DP shards.

Megatron makes its fully-reshardable optimizer checkpoint by gathering every DP rank's optimizer state
inside the training job (~12 bytes per parameter of host memory per rank). ckptd rebuilds the same
layout afterwards from what the daemons already stored, one bucket at a time:

    state(param) = bucket_full[start - bucket_start : end - bucket_start].view(param.shape)

then placed into model space at each of the param's model pieces (key, global shape, global offset,
prepended layer axes, factory views such as SwiGLU's halves). The stored layout sidecars say where every
param lives; Megatron's own checkpoints do not record it.

Output, next to the step's model arrays (which are in model space already):

    step_N/merged/optimizer.state.<state>.<model key>   zarr v3, the model array's global shape and grid
    step_N/merged/_ckptd/_progress/<task>.<tag>.json     one per finished bucket (makes reruns resume)
    step_N/merged/_ckptd/MERGED                          manifest, written last: the merge's commit

Memory is bounded by the work in flight: each worker holds one bucket's state array (plus the few chunks
being read into it and the chunk being written), whatever the model size. Workers run over
(model-parallel rank, buffer, bucket).
Re-running a killed merge skips finished buckets and rewrites the rest identically.

This module reads and writes storage only: the layouts are data (:mod:`ckptd.writer.layout`), every
stored name comes from :mod:`ckptd.writer.format`, and the arithmetic is numpy (no torch, no Megatron).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import sys
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import msgspec
import numpy as np

from ckptd.writer.arrays import (
    ChunkSink,
    array_metadata,
    read_bucket,
    write_control_doc,
    write_group,
    write_metadata,
)
from ckptd.writer.backends import Backend
from ckptd.writer.errors import (
    CheckpointNotFoundError,
    CkptdError,
    CorruptCheckpointError,
    ShardLayoutError,
    first_leaf,
)
from ckptd.writer.format import (
    CHUNK_SEPARATOR,
    CONTROL_LAYOUTS,
    FORMAT_VERSION,
    LAYOUT_FIELD,
    MERGED_CONTENT,
    MERGED_DIR,
    MERGED_SOURCE_FIELD,
    ArrayRecord,
    ChunkRecord,
    ChunkSeparator,
    CommitManifest,
    ShardRecord,
    bucket_states,
    check_region,
    chunk_key,
    chunk_selection_of,
    encode_json,
    itemsize,
    merged_array_name,
    merged_control_dir,
    merged_marker,
    merged_progress_dir,
    merged_state_of,
    model_key,
    region_chunks,
    step_dir,
)
from ckptd.writer.layout import MegatronLayout, ModelPiece, ParamLayout, decode_layout
from ckptd.writer.progress import ByteProgress
from ckptd.writer.root import CheckpointRoot, open_root
from ckptd.writer.sync import run_sync

log = logging.getLogger(__name__)

_SIDECAR_RE = re.compile(r"^[0-9a-f]{64}\.json$")


# --- reading the merged layout ----------------------------------------------------------------------
def merged_states(manifest: CommitManifest) -> dict[str, str]:
    """state name -> torch dtype of the merged arrays."""
    out: dict[str, str] = {}
    for rec in manifest.arrays:
        state = merged_state_of(rec.name)
        if state is not None:
            out[state] = rec.torch_dtype
    return out


# --- planning (pure) ------------------------------------------------------------------------------
@dataclass(frozen=True)
class MergedArray:
    name: str  # relative to the step: merged/optimizer.state.<state>.<model key>
    torch_dtype: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Write param state ``[start, end)`` of a bucket, viewed through ``piece``, into ``array``."""

    array: str
    start: int  # relative to the bucket
    end: int
    shape: tuple[int, ...]
    piece: ModelPiece


@dataclass(frozen=True)
class MergeTask:
    """One bucket of one model-parallel rank: read each state once, write all its params' pieces."""

    name: str  # e.g. tp0.pp1.buf0.bucket2
    source_prefix: str  # optim/<mp>/buf<g>/bucket<b>/
    padded_numel: int
    itemsize: int
    states: tuple[str, ...]
    placements: dict[str, tuple[Placement, ...]] = field(default_factory=dict)  # state -> placements

    @property
    def nbytes(self) -> int:
        return self.padded_numel * self.itemsize * len(self.states)


@dataclass(frozen=True)
class MergePlan:
    step: int
    tasks: tuple[MergeTask, ...]
    arrays: dict[str, MergedArray]
    # the merged arrays' chunk key separator: the step's own (a merge of an older step, killed and resumed
    # by a newer ckptd, writes the keys its first run did)
    separator: ChunkSeparator = CHUNK_SEPARATOR

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tasks)


def layout_names(objects: Mapping[str, Any]) -> dict[str, str]:
    """rank -> the layout sidecar each saving rank referenced (``...{"layout": "<sha256>.json"}``)."""
    found: dict[str, str] = {}

    def walk(rank: str, obj: Any) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                if k == LAYOUT_FIELD and isinstance(v, str) and _SIDECAR_RE.match(v):
                    found[rank] = v
                else:
                    walk(rank, v)

    for rank, obj in objects.items():
        walk(rank, obj)
    return found


def _is_main(piece: ModelPiece) -> bool:
    # The merged state covers all DP ranks, so the DP component of the replica id does not matter.
    rid = piece.replica_id
    return all(r == 0 for r in rid[:-1]) if len(rid) > 1 else True


def plan_merge(commit: CommitManifest, layouts: Iterable[MegatronLayout]) -> MergePlan:
    """Turn the stored DP layout plus the layouts into bucket tasks and merged array shapes. Pure."""
    stored = {rec.name: rec for rec in commit.arrays}
    per_mp: dict[str, MegatronLayout] = {}
    for layout in layouts:
        for buf in layout.buffers:
            if buf.replica_id == 0:
                per_mp.setdefault(buf.mp, layout)
    if not per_mp:
        raise CheckpointNotFoundError(f"step {commit.step} has no Megatron layout: nothing to merge")
    arrays: dict[str, MergedArray] = {}
    tasks: list[MergeTask] = []
    for mp in sorted(per_mp):
        layout = per_mp[mp]
        for buf, bucket in layout.buckets():
            if buf.mp != mp or buf.replica_id != 0:
                continue
            prefix = layout.bucket_prefix(buf, bucket)
            states = bucket_states(list(stored), prefix)
            if not states:
                raise CheckpointNotFoundError(f"step {commit.step}: no stored optimizer state under {prefix}")
            first = stored[prefix + states[0]]
            if first.shape != [bucket.padded_numel]:
                raise ShardLayoutError(
                    f"{prefix}: stored bucket has shape {first.shape}, the layout says {bucket.padded_numel}"
                )
            placements: dict[str, list[Placement]] = {s: [] for s in states}
            for param in bucket.params:
                if (gap := param.uncovered()) is not None:  # that state would land in no merged array
                    raise ShardLayoutError(f"{param.name} ({prefix}): its model pieces leave elements [{gap[0]}, "
                                           f"{gap[1]}) of the flattened param (shape {param.shape}) uncovered")
                for piece in param.model_pieces:
                    if not _is_main(piece):
                        continue
                    for state in states:
                        rec = stored[prefix + state]
                        name = merged_array_name(state, piece.key)
                        arrays[name] = _merged_array(
                            name, rec.torch_dtype, piece, stored, arrays.get(name), layout.model_prefix
                        )
                        placements[state].append(_placement(name, param, bucket.start, piece))
            tasks.append(MergeTask(
                name=f"{mp}.buf{buf.index}.bucket{bucket.index}",
                source_prefix=prefix,
                padded_numel=bucket.padded_numel,
                itemsize=itemsize(first.torch_dtype),
                states=tuple(states),
                placements={s: tuple(p) for s, p in placements.items()},
            ))
    for arr in arrays.values():
        for task in tasks:
            for pls in task.placements.values():
                for p in pls:
                    if p.array == arr.name:
                        check_region(arr.name, arr.shape, p.piece.global_offset, p.piece.stored_shape, arr.chunks)
    separators = {rec.separator for rec in commit.arrays}
    separator = separators.pop() if len(separators) == 1 else CHUNK_SEPARATOR
    return MergePlan(commit.step, tuple(tasks), arrays, separator)


def _placement(array: str, param: ParamLayout, bucket_start: int, piece: ModelPiece) -> Placement:
    return Placement(array, param.start - bucket_start, param.end - bucket_start, param.shape, piece)


def _merged_array(
    name: str,
    torch_dtype: str,
    piece: ModelPiece,
    stored: Mapping[str, ArrayRecord],
    seen: MergedArray | None,
    model_prefix: str | None = None,
) -> MergedArray:
    model = stored.get(model_key(piece.key, model_prefix))
    own = piece.stored_shape
    if model is not None and tuple(model.shape) == piece.global_shape and _whole_chunks(piece, own, model.chunks):
        chunks = tuple(model.chunks)  # the model's own grid: any TP/PP reads its region by whole chunks
    else:  # no model array, or one coarser than the pieces (a small array packed into one object on S3)
        chunks = own
    arr = MergedArray(name, torch_dtype, piece.global_shape, chunks)
    if seen is not None and seen != arr:
        raise ShardLayoutError(f"{name}: pieces disagree on the merged array ({seen} vs {arr})")
    return arr


def _whole_chunks(piece: ModelPiece, shape: tuple[int, ...], chunks: Sequence[int]) -> bool:
    """Whether the piece's region starts and ends on the chunk grid (so it is written by whole chunks)."""
    return all(
        o % c == 0 and ((o + n) % c == 0 or o + n == g)
        for o, n, c, g in zip(piece.global_offset, shape, chunks, piece.global_shape, strict=True)
    )


# --- execution ------------------------------------------------------------------------------------
class MergeSummary(msgspec.Struct, frozen=True):
    step: int
    arrays: int
    tasks: int
    tasks_skipped: int
    bytes_read: int
    bytes_written: int
    seconds: float
    already_merged: bool = False


def merge(root: str, step: int | str = "latest", *, workers: int = 2,
          storage_options: Mapping[str, Any] | None = None, progress: bool = True) -> MergeSummary:
    """Synchronous entry point: merge one committed step under ``root``."""

    async def go() -> MergeSummary:
        async with open_root(root, storage_options) as ckpt:
            return await run_merge(ckpt, step, workers=workers, progress=progress)

    return run_sync(go())


async def run_merge(
    ckpt: CheckpointRoot, step: int | str = "latest", *, workers: int = 2, progress: bool = True,
    bar_out: TextIO | None = sys.stderr,
) -> MergeSummary:
    """Merge one committed step; ``progress`` reports the bytes done (a bar on ``bar_out`` when it is a
    terminal, else log lines)."""
    t0 = time.monotonic()
    backend = ckpt.backend
    n = await ckpt.resolve(step)
    commit = await ckpt.read_commit(n)
    prefix = step_dir(n)
    if (done := await ckpt.read_merged_manifest(n, source=commit)) is not None:
        return MergeSummary(n, len(done.arrays), 0, 0, 0, 0, time.monotonic() - t0, already_merged=True)
    if await ckpt.read_merged_manifest(n) is not None:  # of an earlier commit of this step number: merged anew
        for version in CONTROL_LAYOUTS:
            await backend.delete(merged_marker(n, version))
    names = layout_names(commit.objects)
    layouts = [decode_layout(await ckpt.read_sidecar(s)) for s in sorted(set(names.values()))]
    plan = plan_merge(commit, layouts)
    tag = source_tag(commit)
    finished = await _finished_tasks(backend, n, tag, {t.name for t in plan.tasks})
    todo = [t for t in plan.tasks if t.name not in finished]
    bar = ByteProgress(f"merge of step {n}", sum(t.nbytes for t in todo), out=bar_out, every_s=0.0,
                       logger=log) if progress else None
    # many small pieces: one filesystem sync per bucket instead; each chunk whole (another run may write it)
    sink = ChunkSink(backend, fsync_each=False, aside=True)
    sources = {rec.name: rec for rec in commit.arrays}
    sem = asyncio.Semaphore(max(1, workers))
    records: dict[str, list[ShardRecord]] = {name: list(recs) for name, recs in _records_of(finished).items()}
    written = 0
    overtaken = False  # another merge of the step committed while this one ran

    async def one(task: MergeTask) -> None:
        nonlocal written, overtaken
        async with sem:
            if overtaken or await backend.exists(merged_marker(n)):
                overtaken = True
                return
            try:
                out = await _merge_task(backend, sink, prefix, task, plan, sources, bar)
            except CkptdError:
                await _still_committed(ckpt, n)  # a step deleted meanwhile: say so, not what went missing
                raise
        doc = {name: [msgspec.to_builtins(r) for r in recs] for name, recs in out.items()}
        await backend.sync_all()  # the bucket's chunks are durable before its progress note claims them
        # created whole or not at all (a merge killed mid-write leaves no torn note)
        await backend.create(f"{merged_progress_dir(n)}/{task.name}.{tag}.json", encode_json(doc))
        for name, recs in out.items():
            records.setdefault(name, []).extend(recs)
            written += sum(c.nbytes for r in recs for c in r.chunks)

    merged_all = False
    try:
        async with asyncio.TaskGroup() as tg:
            for task in todo:
                tg.create_task(one(task))
        merged_all = True
    except* CkptdError as group:
        raise first_leaf(group) from None
    finally:
        if bar is not None:
            bar.close(merged_all)
    if overtaken and (theirs := await ckpt.read_merged_manifest(n, source=commit)) is not None:
        return MergeSummary(n, len(theirs.arrays), 0, 0, 0, 0, time.monotonic() - t0, already_merged=True)
    await _still_committed(ckpt, n)  # retention or gc may have deleted the step meanwhile
    manifest = await _commit_merge(backend, commit, plan, records)
    return MergeSummary(n, len(manifest.arrays), len(todo), len(plan.tasks) - len(todo),
                        sum(t.nbytes for t in todo), written, time.monotonic() - t0)


def source_tag(commit: CommitManifest) -> str:
    """The commit a merge's progress notes belong to, for their names: its ``committed_at`` in microseconds."""
    return f"{round(commit.committed_at * 1e6):x}"


async def _still_committed(ckpt: CheckpointRoot, step: int) -> None:
    if not await ckpt.is_committed(step):
        raise CheckpointNotFoundError(
            f"step {step} was deleted while it was being merged (retention --keep or `ckptd gc`): nothing merged; "
            f"what the merge wrote under {step_dir(step)}/{MERGED_DIR}/ is left for `ckptd gc` to remove"
        )


def piece_of(flat: np.ndarray, pl: Placement) -> np.ndarray:
    """The placement's piece of a bucket's state, shaped as stored (a view: no copy)."""
    param = flat[pl.start : pl.end]
    p = pl.piece
    numel = math.prod(p.view_shape)
    last = p.view_offset + sum((n - 1) * s for n, s in zip(p.view_shape, p.view_stride, strict=True))
    if param.size != math.prod(pl.shape) or p.view_offset < 0 or (numel > 0 and last >= param.size):
        raise ShardLayoutError(f"{p.key}: model piece lies outside its param of shape {pl.shape}")
    view = np.lib.stride_tricks.as_strided(
        param[p.view_offset :],
        shape=p.view_shape,
        strides=tuple(s * param.itemsize for s in p.view_stride),
        writeable=False,
    )
    return view.reshape(p.stored_shape)


async def _merge_task(
    backend: Backend, sink: ChunkSink, prefix: str, task: MergeTask, plan: MergePlan,
    sources: Mapping[str, ArrayRecord], bar: ByteProgress | None,
) -> dict[str, list[ShardRecord]]:
    out: dict[str, list[ShardRecord]] = {}
    for state in task.states:
        name = f"{task.source_prefix}{state}"
        rec = sources.get(name)
        if rec is None:
            raise CorruptCheckpointError(f"{prefix}: the commit manifest has no array {name}")
        flat = await read_bucket(backend, prefix, rec, task.padded_numel)  # one bucket in memory
        await _place_state(sink, prefix, flat, task.placements[state], plan, out)
        del flat  # freed before the next state's bucket is read (no view of it outlives _place_state)
        if bar is not None:
            bar.advance(task.padded_numel * task.itemsize, f"{task.name} {state}")
    return out


async def _place_state(
    sink: ChunkSink, prefix: str, flat: np.ndarray, placements: Sequence[Placement], plan: MergePlan,
    out: dict[str, list[ShardRecord]],
) -> None:
    """Write each placement's piece of one state's bucket into its merged array."""
    for pl in placements:
        merged = plan.arrays[pl.array]
        piece = piece_of(flat, pl)
        chunks: list[ChunkRecord] = []
        for coords in region_chunks(pl.piece.global_offset, piece.shape, merged.chunks):
            sel = chunk_selection_of(coords, merged.chunks, merged.shape, pl.piece.global_offset)
            # an edge chunk is stored whole (zarr v3), padded in the sink's worker thread
            key = f"{prefix}/{pl.array}/{chunk_key(coords, plan.separator)}"
            crc, pieces = await sink.put(key, piece[sel], merged.chunks)
            chunks.append(ChunkRecord(list(coords), math.prod(merged.chunks) * piece.itemsize, crc, pieces))
        out.setdefault(pl.array, []).append(ShardRecord(-1, list(pl.piece.global_offset), list(piece.shape), chunks))


async def _finished_tasks(
    backend: Backend, step: int, tag: str, tasks: Collection[str]
) -> dict[str, dict[str, list[ShardRecord]]]:
    """The progress notes of this commit's merge (``<task>.<tag>.json``; ``<task>.json`` from a release that
    did not tag them) of tasks in this plan; notes of another commit of the step number are not this one's."""
    folder = merged_progress_dir(step)
    done: dict[str, dict[str, list[ShardRecord]]] = {}
    for name in await backend.list_dir(folder):
        stem = name.removesuffix(".json")
        task = stem.removesuffix(f".{tag}") if stem.endswith(f".{tag}") else stem
        if stem == name or task not in tasks:
            continue
        data = await backend.get(f"{folder}/{name}")
        if data is None:
            continue
        try:
            raw = msgspec.json.decode(data, type=dict[str, list[ShardRecord]])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # a torn note (written in place by an earlier release, killed mid-write): the task runs again
            log.warning("step %d: merge progress note %s is unreadable (%s); its bucket is merged again", step,
                        name, exc)
            await backend.delete(f"{folder}/{name}")
            continue
        done[task] = raw
    return done


def _records_of(finished: Mapping[str, Mapping[str, list[ShardRecord]]]) -> dict[str, list[ShardRecord]]:
    out: dict[str, list[ShardRecord]] = {}
    for recs in finished.values():
        for name, shards in recs.items():
            out.setdefault(name, []).extend(shards)
    return out


async def _commit_merge(
    backend: Backend, commit: CommitManifest, plan: MergePlan, records: Mapping[str, list[ShardRecord]]
) -> CommitManifest:
    prefix = step_dir(commit.step)
    arrays = []
    for name in sorted(plan.arrays):
        spec = plan.arrays[name]
        shards = sorted(records.get(name, []), key=lambda r: r.offset)
        covered = sum(len(s.chunks) for s in shards)
        want = math.prod(-(-n // c) for n, c in zip(spec.shape, spec.chunks, strict=True))
        if covered != want:
            raise ShardLayoutError(f"{name}: merged pieces cover {covered} of {want} chunks")
        arrays.append(
            ArrayRecord(name, spec.torch_dtype, list(spec.shape), list(spec.chunks), shards, "raw", plan.separator)
        )
        meta = await array_metadata(spec.torch_dtype, spec.shape, spec.chunks, codec="raw", separator=plan.separator)
        await write_metadata(backend.store, f"{prefix}/{name}", meta)
    attrs = {"ckptd": {"content": MERGED_CONTENT, "step": commit.step}}
    await write_group(backend.store, f"{prefix}/{MERGED_DIR}", attrs)
    await write_control_doc(backend.store, merged_control_dir(commit.step))
    manifest = CommitManifest(
        format=FORMAT_VERSION, step=commit.step, num_nodes=commit.num_nodes, world_size=commit.world_size,
        arrays=arrays,
        objects={"content": MERGED_CONTENT, "source": "dp_layout", MERGED_SOURCE_FIELD: commit.committed_at},
        nbytes=sum(c.nbytes for a in arrays for s in a.shards for c in s.chunks), committed_at=time.time(),
    )
    await backend.sync_all()  # metadata durable before the marker
    # created whole or not at all: a torn marker would make the step unreadable as merged; False only when a
    # concurrent merge of the step committed first (the same arrays: the merge is deterministic)
    if not await asyncio.shield(backend.create(merged_marker(commit.step), encode_json(manifest))):
        log.info("step %d: another merge committed first; its manifest stands", commit.step)
    return manifest
