"""The model's ``sharded_state_dict()`` as ckptd shards, split 1/DP where Megatron replicates over DP."""

from __future__ import annotations

import io
import operator
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from ckptd.client.megatron import introspect
from ckptd.client.megatron.introspect import replica_tuple
from ckptd.client.state import Shard
from ckptd.writer.errors import InvalidRequestError, ShardLayoutError
from ckptd.writer.format import MODEL_PREFIX, model_key

DEFAULT_MIN_SPLIT_BYTES = 1 << 20

def model_state(
    model_chunks: Sequence[torch.nn.Module],
    *,
    prefix: str | None = None,
    split_replicas: bool = True,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
) -> dict[str, object]:
    """The model's ``sharded_state_dict()`` as ckptd shards: ``{path: Shard | plain data}``.

    - ``ShardedTensorFactory`` entries (e.g. SwiGLU's ``linear_fc1``) are built; each resulting
      ``ShardedTensor`` becomes one :class:`Shard` named ``prefix + key`` (``prefix`` defaults to
      :data:`ckptd.writer.format.MODEL_PREFIX`) with ``prepend_axis_num`` leading axes of extent 1 (the
      per-layer stacking axis). Shard data are views of the live params: nothing is copied here.
    - Tensors replicated over DP (Megatron's ``replica_id`` ends with the DP rank) are split along their
      first splittable axis into ``ceil(n/DP)``-row blocks, one per DP rank, with ``chunk_shape`` equal to
      the block so each rank's region is whole chunks; DP ranks past the last block get nothing. The
      split is decided from shapes and DP size alone, identically on every rank, without a collective.
      Tensors smaller than ``min_split_bytes`` per rank's copy, or without an axis whose blocks align
      with the chunk grid, stay whole (written by DP rank 0, the main replica).
    - ``_extra_state`` ``ShardedObject``\\ s are skipped (:mod:`.extra_state` saves them per rank); other
      ``ShardedObject``\\ s with ``None`` data too; ``BytesIO`` data are kept as ``bytes`` and other plain
      data as is, under ``prefix + unique_key`` (main replicas only).

    Non-main replicas are returned too (their Shard's ``replica_id`` is nonzero); the planner drops them.
    """
    prefix = MODEL_PREFIX if prefix is None else prefix
    out: dict[str, object] = {}
    dense = introspect.dense_dp()
    for chunk in model_chunks:
        experts = introspect.expert_params(chunk)
        for leaf in introspect.sharded_leaves(chunk):
            if introspect.is_sharded_tensor(leaf):
                if leaf.flattened_range is not None:
                    raise InvalidRequestError(f"{leaf.key}: flattened model ShardedTensors are not supported")
                base = replace(Shard.from_sharded_tensor(leaf), key=model_key(leaf.key, prefix))
                if split_replicas:
                    dp = introspect.expert_dp() if _views_any(leaf.data, experts) else dense
                    shards = _split_replicated(base, dp[0], dp[1], min_split_bytes)
                else:
                    shards = [base]
                for s in shards:
                    path = f"{s.key}@{','.join(str(o) for o in s.global_offset)}"
                    seen = out.get(path)
                    if isinstance(seen, Shard) and replica_tuple(s.replica_id) == replica_tuple(seen.replica_id):
                        raise ShardLayoutError(f"{s.key}: region at {s.global_offset} appears twice in the model")
                    out[path] = s
            elif introspect.is_sharded_object(leaf):
                if leaf.data is None or any(replica_tuple(leaf.replica_id)) or leaf.key.endswith("_extra_state"):
                    continue  # _extra_state: saved per rank from the modules themselves (extra_state.py)
                data = leaf.data
                if isinstance(data, io.BytesIO):
                    data = data.getvalue()
                    if not data:
                        continue
                elif isinstance(data, torch.Tensor):
                    raise InvalidRequestError(f"{leaf.key}: tensor-valued ShardedObjects are not supported")
                out[prefix + leaf.unique_key] = data
            else:
                raise InvalidRequestError(f"unexpected sharded state dict leaf {type(leaf).__name__}")
    return out


def model_template(model_chunks: Sequence[torch.nn.Module]) -> dict[str, Shard]:
    """Every model tensor of this rank as a Shard whose data is a view of the live tensor (no copy).

    Built once per set of chunks and kept while every param and buffer is the tensor it was (the same
    objects, addresses, shapes and dtypes; the kept views hold the old tensors, so no new one can take an
    old address): Megatron's ``sharded_state_dict()`` walk is milliseconds of every load."""
    modules = [introspect.unwrap(c) for c in model_chunks]  # (DDP's ``buffers`` attribute shadows Module.buffers)
    tensors = [t for m in modules for t in (*m.parameters(), *torch.nn.Module.buffers(m))]
    signature = (tuple(map(id, model_chunks)), tuple(map(id, tensors)), tuple(map(torch.Tensor.data_ptr, tensors)),
                 tuple(map(_SHAPE, tensors)), tuple(map(_DTYPE, tensors)))
    held = _TEMPLATES.get(model_chunks[0]) if model_chunks else None
    if held is not None and held[0] == signature:
        return dict(held[1])
    template = _build_template(model_chunks, {t.untyped_storage().data_ptr() for t in tensors})
    if model_chunks:
        _TEMPLATES[model_chunks[0]] = (signature, template)
    return dict(template)


def refuse_copies(model_chunks: Sequence[torch.nn.Module], shards: Mapping[str, Shard]) -> None:
    """Refuse model shards whose memory is no param's or buffer's of the chunks: tensors the modules'
    ``sharded_state_dict()`` made anew (megatron-core's legacy ``GroupedMLP`` transposes its experts' weights
    into copies). A save plan reads its sources at every save, so it would store such a tensor's values of the
    first save forever; and a load cannot write into it (:func:`model_template`)."""
    modules = [introspect.unwrap(c) for c in model_chunks]  # (DDP's ``buffers`` attribute shadows Module.buffers)
    held = {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *torch.nn.Module.buffers(m))}
    copies = sorted(s.key for s in shards.values()
                    if s.data.numel() and s.data.untyped_storage().data_ptr() not in held)
    if copies:
        raise InvalidRequestError(
            f"{len(copies)} model tensor(s) of sharded_state_dict() are copies, not views of a param or buffer "
            f"({', '.join(copies[:3])}): ckptd saves and loads model tensors in place, so it cannot checkpoint "
            "them (megatron-core's legacy GroupedMLP makes such copies: use SequentialMLP or TEGroupedMLP)"
        )


_TEMPLATES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[object, dict[str, Shard]]] = weakref.WeakKeyDictionary()
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def _build_template(model_chunks: Sequence[torch.nn.Module], storages: set[int]) -> dict[str, Shard]:
    template = {}
    for path, leaf in model_state(model_chunks, split_replicas=False).items():
        if not isinstance(leaf, Shard):
            continue
        if leaf.data.untyped_storage().data_ptr() not in storages:
            raise InvalidRequestError(f"{leaf.key}: the model's ShardedTensor is a copy; it cannot be loaded in place")
        template[path] = replace(leaf, data=leaf.data.detach())  # filled in place, outside autograd
    return template


def _views_any(t: torch.Tensor, spans: introspect.ParamSpans) -> bool:
    """Whether ``t`` starts inside one of the params ``spans`` holds."""
    off = int(t.storage_offset())
    return spans.owner(t.untyped_storage().data_ptr(), off, off + 1) is not None


def _split_replicated(shard: Shard, dp_size: int, dp_rank: int, min_split_bytes: int) -> list[Shard]:
    """Split a DP-replicated block 1/DP per rank along its first splittable axis (see model_state)."""
    rid = replica_tuple(shard.replica_id)
    if dp_size <= 1 or len(rid) < 2 or rid[-1] != dp_rank or shard.nbytes < max(1, min_split_bytes):
        return [shard]
    local = tuple(shard.data.shape)
    grid = shard.grid
    for axis, (n, g, o, c) in enumerate(zip(local, shard.global_shape, shard.global_offset, grid, strict=True)):
        if n < 2:
            continue
        k = -(-n // dp_size)  # rows per DP rank
        # blocks of k must tile this rank's region on the array-wide grid: k divides the block grid,
        # or the region is the whole axis (the last block may then be shorter)
        if not (c % k == 0 and n % k == 0 and o % k == 0) and not (o == 0 and n == g):
            continue
        pieces = -(-n // k)
        base_rid = (*rid[:-1], 0)
        new_grid = tuple(k if a == axis else x for a, x in enumerate(grid))
        if dp_rank >= pieces:
            return []
        lo = dp_rank * k
        hi = min(n, lo + k)
        off = tuple(x + lo if a == axis else x for a, x in enumerate(shard.global_offset))
        return [Shard(shard.key, shard.data.narrow(axis, lo, hi - lo), shard.global_shape, off, base_rid, new_grid)]
    return [shard]
