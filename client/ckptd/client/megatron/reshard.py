"""Read the merged (fully-reshardable) optimizer layout into any TP/PP/DP layout.

``ckptd merge`` (:mod:`ckptd.writer.merge`) stores each optimizer state per parameter in model space
(``step_N/merged/optimizer.state.<state>.<model key>``, the model's global shapes). A rank of any new
parallel layout rebuilds its contiguous slice of each of its padded buckets from there: for every param
that overlaps the slice, assemble the param's state from its model pieces (each piece is a region of a
merged array) and copy the overlapping elements. The result has the shape
:func:`~ckptd.client.megatron.optimizer.apply_optimizer_state` takes, so loading is the same code either
way. Each rank reads only the params its slices touch. Nothing here imports megatron.
"""

from __future__ import annotations

import asyncio

import torch

from ckptd.client.megatron.layout import view_of
from ckptd.client.state import torch_dtype
from ckptd.writer.arrays import open_array, read_region
from ckptd.writer.errors import StateMismatchError
from ckptd.writer.format import CommitManifest, merged_array_name, step_dir
from ckptd.writer.layout import MegatronLayout, ParamLayout
from ckptd.writer.merge import merged_states
from ckptd.writer.root import CheckpointRoot

READ_CONCURRENCY = 8


async def merged_optimizer_slices(
    root: CheckpointRoot, step: int, manifest: CommitManifest, layout: MegatronLayout
) -> dict[str, torch.Tensor]:
    """This rank's ``{optim/<mp>/buf<g>/bucket<b>/<state>: 1-D slice}`` rebuilt from the merged layout.

    ``manifest`` is the step's merge manifest (:meth:`ckptd.writer.root.CheckpointRoot.read_merged_manifest`).
    """
    arrays = {rec.name: rec for rec in manifest.arrays}
    states = merged_states(manifest)
    prefix = step_dir(step)
    sem = asyncio.Semaphore(READ_CONCURRENCY)

    async def param_state(param: ParamLayout, state: str) -> torch.Tensor:
        out = torch.empty(param.shape, dtype=torch_dtype(states[state]))
        for piece in param.model_pieces:
            name = merged_array_name(state, piece.key)
            rec = arrays.get(name)
            if rec is None or tuple(rec.shape) != piece.global_shape:
                raise StateMismatchError(
                    f"{piece.key}: the merged checkpoint has {'no' if rec is None else rec.shape} state "
                    f"'{state}' for it (the model wants global shape {piece.global_shape})"
                )
            region = piece.region()
            async with sem:
                arr = await open_array(root.store, f"{prefix}/{name}")
                data = await read_region(arr, [r.start for r in region], [r.stop - r.start for r in region])
            view_of(piece, out).copy_(torch.from_numpy(data).reshape(piece.view_shape))
        return out

    slices: dict[str, torch.Tensor] = {}
    for buf, bucket in layout.buckets():
        s = buf.slice_numel(bucket)
        lo, hi = buf.dp_rank * s, (buf.dp_rank + 1) * s
        touched = [p for p in bucket.params if p.start - bucket.start < hi and p.end - bucket.start > lo]
        for state, dtype in states.items():
            out = torch.zeros(s, dtype=torch_dtype(dtype))
            values = await asyncio.gather(*(param_state(p, state) for p in touched))
            for p, value in zip(touched, values, strict=True):
                a, b = p.start - bucket.start, p.end - bucket.start
                i, j = max(a, lo), min(b, hi)
                out[i - lo : j - lo] = value.reshape(-1)[i - a : j - a]
            slices[layout.bucket_key(buf, bucket, state)] = out
    return slices
