"""Megatron-core integration: model and distributed-optimizer state as ckptd shards, and the way back.

Three pure-ish pieces the client's ``save()``/``load()`` build on:

- :class:`MegatronLayout` — static facts about the model chunks and the ``DistributedOptimizer``'s
  grad buffers (buffer -> bucket -> param ranges, model ``ShardedTensor`` placement of every param),
  computed once per run (:func:`get_layout` caches it) and JSON-serialisable: it is the sidecar the
  offline merge needs, because Megatron's checkpoints do not record it.
- :func:`model_state` — the model's ``sharded_state_dict()`` as :class:`~ckptd.client.state.Shard`\\ s,
  with tensors replicated over data parallelism split 1/DP per rank (no collective: every rank decides
  from the same static metadata).
- :func:`optimizer_state` / :func:`apply_optimizer_state` — this DP rank's contiguous slice of every
  padded bucket, one 1-D shard per (model-parallel rank, buffer, bucket, state), assembled from the
  optimizer's per-param tensors without any gather; and its inverse, which also accepts slices saved at
  another DP size (same TP/PP).

Nothing here imports megatron, zarr or fsspec at module import; megatron is imported lazily where a
function needs its classes. The CPU shim (``ckptd.daemon.megatron_cpu``) is test-only and never imported.

Storage names (validated by :func:`ckptd.writer.format.validate_key`):

- model: ``model/<ShardedTensor key>``, e.g. ``model/decoder.layers.mlp.linear_fc1.weight``;
- optimizer: ``optim/<mp>/buf<g>/bucket<b>/<state>`` where ``<mp>`` is ``tp<t>.pp<p>`` (dense
  params) or ``tp<t>.ep<e>.pp<p>`` (expert params, expert-TP rank), ``g`` numbers the grad buffers of
  every ``DistributedOptimizer`` in the (chained) optimizer in order, ``b`` is the bucket index in that
  buffer and ``<state>`` is ``param`` (the fp32 main param) or the inner optimizer's per-element state
  name (``exp_avg``, ``exp_avg_sq`` for Adam; whatever the inner optimizer keeps);
- plain data (param groups, scalar per-param state such as Adam's ``step``, grad scaler):
  under :data:`OPTIM_META` in the dict :func:`optimizer_state` returns.

Adam's ``step``: torch Adam(W) (megatron-core's fallback without TE/Apex) keeps ``state[p]['step']`` as
one scalar tensor per param, which Megatron's own load paths mishandle (``KeyError: 'step'``, one shared
tensor after load). Here every 0-dim tensor (and every non-tensor) entry of a param's state is saved as
plain data — one value when all params agree, per param otherwise — and restored as a *fresh* tensor
per param with the original dtype. Per-element state (same shape as the main param) goes to the bucket
slices.
"""

from __future__ import annotations

import io
import json
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch

from ckptd.client.state import Shard, dtype_name, torch_dtype
from ckptd.writer.errors import InvalidRequestError, LayoutMismatchError, ShardLayoutError, StateMismatchError
from ckptd.writer.format import validate_key

__all__ = [
    "LAYOUT_VERSION",
    "MAIN_PARAM",
    "MODEL_PREFIX",
    "OPTIM_META",
    "OPTIM_PREFIX",
    "BucketLayout",
    "BufferLayout",
    "MegatronLayout",
    "ModelPiece",
    "ParamLayout",
    "apply_optimizer_state",
    "get_layout",
    "model_state",
    "optimizer_read_regions",
    "optimizer_state",
]

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 1
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
OPTIM_META = "optim_meta"
MAIN_PARAM = "param"
DEFAULT_MIN_SPLIT_BYTES = 1 << 20


# --- layout records ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelPiece:
    """Where (part of) a param lives in model space: one built ``ShardedTensor`` of the model.

    The piece is ``param.as_strided(view_shape, view_stride, view_offset)`` (offsets in elements
    relative to the param's first element), reshaped to ``(1,) * prepend_axis_num + view_shape`` and
    placed at ``global_offset`` of the array ``key`` of shape ``global_shape``. A factory such as
    SwiGLU's ``linear_fc1`` yields two pieces of one param.
    """

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend_axis_num: int
    view_offset: int
    view_shape: tuple[int, ...]
    view_stride: tuple[int, ...]
    replica_id: tuple[int, ...]

    def view_of(self, param: torch.Tensor) -> torch.Tensor:
        """This piece of ``param`` (any contiguous tensor of the param's shape, e.g. a merged state)."""
        if not param.is_contiguous():
            raise InvalidRequestError(f"{self.key}: view_of needs a contiguous tensor")
        return param.as_strided(self.view_shape, self.view_stride, param.storage_offset() + self.view_offset)

    def region(self) -> tuple[slice, ...]:
        """The piece's region in the global array (``prepend_axis_num`` leading axes of extent 1)."""
        shape = (1,) * self.prepend_axis_num + self.view_shape
        return tuple(slice(o, o + n) for o, n in zip(self.global_offset, shape, strict=True))


@dataclass(frozen=True)
class ParamLayout:
    """One param in a grad buffer.

    ``start``/``end``/``bucket_id`` are Megatron's ``param_index_map`` (whole-buffer coordinates).
    ``group_index``/``group_order`` locate the param's main shard in the inner optimizer's param groups
    on *this* DP rank (None where this rank holds no slice of the param).
    """

    name: str
    start: int
    end: int
    bucket_id: int
    shape: tuple[int, ...]
    model_pieces: tuple[ModelPiece, ...]
    group_index: int | None = None
    group_order: int | None = None


@dataclass(frozen=True)
class BucketLayout:
    index: int
    start: int  # buffer coordinates; end - start is the padded bucket numel
    end: int
    numel_unpadded: int
    params: tuple[ParamLayout, ...]  # ordered by start

    @property
    def padded_numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BufferLayout:
    index: int  # global buffer number g across the chained optimizer
    optimizer_index: int  # which DistributedOptimizer of the chain
    gbuf_index: int  # index in that optimizer's ``buffers``
    model_chunk: int
    param_dtype: str
    grad_dtype: str
    is_expert: bool
    mp: str  # model-parallel tag used in keys: tp<t>.pp<p> or tp<t>.ep<e>.pp<p>
    dp_size: int
    dp_rank: int
    replica_id: int  # distributed optimizer instance id; only instance 0 is the main replica
    buckets: tuple[BucketLayout, ...]

    def slice_numel(self, bucket: BucketLayout) -> int:
        """S: each DP rank's share of the padded bucket."""
        return bucket.padded_numel // self.dp_size


@dataclass(frozen=True)
class MegatronLayout:
    """Static buffer/bucket/param facts of one rank; JSON round-trips through :meth:`to_json`."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    buffers: tuple[BufferLayout, ...]
    megatron_core_version: str = ""
    model_prefix: str = MODEL_PREFIX
    optim_prefix: str = OPTIM_PREFIX
    version: int = LAYOUT_VERSION

    # keys ----------------------------------------------------------------------------------------
    def bucket_key(self, buffer: BufferLayout, bucket: BucketLayout, state: str) -> str:
        return validate_key(f"{self.optim_prefix}{buffer.mp}/buf{buffer.index}/bucket{bucket.index}/{state}")

    def model_key(self, sharded_key: str) -> str:
        return validate_key(f"{self.model_prefix}{sharded_key}")

    def buckets(self) -> Iterator[tuple[BufferLayout, BucketLayout]]:
        for buf in self.buffers:
            for bucket in buf.buckets:
                yield buf, bucket

    # JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MegatronLayout:
        if d.get("version") != LAYOUT_VERSION:
            raise InvalidRequestError(f"unsupported Megatron layout version {d.get('version')!r}")

        def piece(p: Mapping[str, Any]) -> ModelPiece:
            return ModelPiece(
                key=p["key"],
                global_shape=tuple(p["global_shape"]),
                global_offset=tuple(p["global_offset"]),
                prepend_axis_num=int(p["prepend_axis_num"]),
                view_offset=int(p["view_offset"]),
                view_shape=tuple(p["view_shape"]),
                view_stride=tuple(p["view_stride"]),
                replica_id=tuple(p["replica_id"]),
            )

        def param(p: Mapping[str, Any]) -> ParamLayout:
            return ParamLayout(
                name=p["name"],
                start=int(p["start"]),
                end=int(p["end"]),
                bucket_id=int(p["bucket_id"]),
                shape=tuple(p["shape"]),
                model_pieces=tuple(piece(x) for x in p["model_pieces"]),
                group_index=p["group_index"],
                group_order=p["group_order"],
            )

        buffers = tuple(
            BufferLayout(
                **{k: v for k, v in b.items() if k != "buckets"},
                buckets=tuple(
                    BucketLayout(
                        index=int(k["index"]),
                        start=int(k["start"]),
                        end=int(k["end"]),
                        numel_unpadded=int(k["numel_unpadded"]),
                        params=tuple(param(p) for p in k["params"]),
                    )
                    for k in b["buckets"]
                ),
            )
            for b in d["buffers"]
        )
        fields = {k: v for k, v in d.items() if k != "buffers"}
        return cls(buffers=buffers, **fields)

    @classmethod
    def from_json(cls, text: str) -> MegatronLayout:
        return cls.from_dict(json.loads(text))

    # construction --------------------------------------------------------------------------------
    @classmethod
    def build(cls, model_chunks: Sequence[torch.nn.Module], optimizer: Any) -> MegatronLayout:
        """Compute the layout from live model chunks (DDP-wrapped) and a (chained) DistributedOptimizer.

        No communication. Cross-checks Megatron's own per-rank ranges (``gbuf_ranges``) against the
        ranges this module derives from ``param_index_map``/``bucket_indices``, so a megatron-core
        version that changes the buffer layout fails loudly here rather than writing wrong slices.
        """
        from megatron.core import parallel_state as ps

        chunks = list(model_chunks)
        names = [_param_names(c) for c in chunks]
        pieces = [_model_pieces(c) for c in chunks]
        buffers: list[BufferLayout] = []
        for oi, opt in enumerate(_distributed_optimizers(optimizer)):
            for gi, buffer in enumerate(opt.buffers):
                c = _owning_chunk(chunks, buffer)
                buf = _buffer_layout(len(buffers), oi, gi, opt, buffer, chunks, c, names[c], pieces[c])
                _check_against_megatron(opt, gi, buffer, buf)
                buffers.append(buf)
        layout = cls(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            dp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
            buffers=tuple(buffers),
            megatron_core_version=_megatron_version(),
        )
        for _buf, bucket in layout.buckets():
            for p in bucket.params:
                for piece in p.model_pieces:
                    layout.model_key(piece.key)
        logger.debug(
            "megatron layout tp%d pp%d dp%d/%d: %d buffers, %d buckets",
            layout.tp_rank,
            layout.pp_rank,
            layout.dp_rank,
            layout.dp_size,
            len(layout.buffers),
            sum(len(b.buckets) for b in layout.buffers),
        )
        return layout


_LAYOUT_CACHE: weakref.WeakKeyDictionary[Any, MegatronLayout] = weakref.WeakKeyDictionary()


def get_layout(model_chunks: Sequence[torch.nn.Module], optimizer: Any) -> MegatronLayout:
    """:meth:`MegatronLayout.build`, computed once per optimizer object and cached."""
    layout = _LAYOUT_CACHE.get(optimizer)
    if layout is None:
        layout = MegatronLayout.build(model_chunks, optimizer)
        _LAYOUT_CACHE[optimizer] = layout
    return layout


# --- megatron plumbing ---------------------------------------------------------------------------------
def _megatron_version() -> str:
    try:
        from megatron.core import __version__

        return str(__version__)
    except ImportError:  # pragma: no cover - megatron is required by every caller
        return ""


def _distributed_optimizers(optimizer: Any) -> list[Any]:
    opts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    out = []
    for opt in opts:
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if not hasattr(opt, "buffers") or not hasattr(opt, "gbuf_ranges"):
            raise InvalidRequestError(
                f"{type(opt).__name__} is not a megatron DistributedOptimizer: ckptd's Megatron integration "
                "needs DistributedDataParallel(use_distributed_optimizer=True) with DistributedOptimizer"
            )
        if getattr(opt.ddp_config, "use_megatron_fsdp", False):
            raise InvalidRequestError("Megatron FSDP buffers are not supported")
        if getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            raise InvalidRequestError("precision-aware optimizers (TE FusedAdam master weights) are not supported")
        out.append(opt)
    return out


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(module)  # type: ignore[no-any-return]


def _param_names(chunk: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    return {p: n for n, p in _unwrap(chunk).named_parameters()}


def _owning_chunk(chunks: Sequence[torch.nn.Module], buffer: Any) -> int:
    for c, chunk in enumerate(chunks):
        for attr in ("buffers", "expert_parallel_buffers"):
            if any(buffer is b for b in getattr(chunk, attr, None) or []):
                return c
    raise InvalidRequestError("a DistributedOptimizer buffer belongs to none of the given model chunks")


def _iter_sharded(obj: Any) -> Iterator[Any]:
    """Leaves of a (nested) sharded state dict, with ShardedTensorFactory builds applied."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(obj, Mapping):
        for v in obj.values():
            yield from _iter_sharded(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _iter_sharded(v)
    elif isinstance(obj, ShardedTensorFactory):
        yield from _iter_sharded(obj.build())
    else:
        yield obj


def _sharded_leaves(chunk: torch.nn.Module) -> list[Any]:
    module: Any = _unwrap(chunk)
    return list(_iter_sharded(module.sharded_state_dict()))


def _is_sharded_tensor(obj: Any) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return isinstance(obj, ShardedTensor)


def _replica_tuple(rid: Any) -> tuple[int, ...]:
    return (int(rid),) if isinstance(rid, int) else tuple(int(r) for r in rid)


def _model_pieces(chunk: torch.nn.Module) -> dict[torch.nn.Parameter, list[ModelPiece]]:
    """Map each param to the built ShardedTensors that view it (by storage and element range)."""
    params = list(_unwrap(chunk).parameters())
    spans = [(*_storage_span(p), p) for p in params]
    out: dict[torch.nn.Parameter, list[ModelPiece]] = {}
    for st in _sharded_leaves(chunk):
        if not _is_sharded_tensor(st) or st.flattened_range is not None:
            continue
        t = st.data
        if t.numel() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        lo = t.storage_offset()
        hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        owner = next((sp for sp in spans if sp[0] == ptr and sp[1] <= lo and hi <= sp[2]), None)
        if owner is None:
            continue  # not a param (a buffer) or a copy: model_state still saves it
        out.setdefault(owner[3], []).append(
            ModelPiece(
                key=st.key,
                global_shape=tuple(int(n) for n in st.global_shape),
                global_offset=tuple(int(o) for o in st.global_offset),
                prepend_axis_num=int(st.prepend_axis_num),
                view_offset=lo - owner[1],
                view_shape=tuple(int(n) for n in t.shape),
                view_stride=tuple(int(s) for s in t.stride()),
                replica_id=_replica_tuple(st.replica_id),
            )
        )
    return out


def _buffer_layout(
    index: int,
    optimizer_index: int,
    gbuf_index: int,
    opt: Any,
    buffer: Any,
    chunks: Sequence[torch.nn.Module],
    chunk: int,
    names: Mapping[torch.nn.Parameter, str],
    pieces: Mapping[torch.nn.Parameter, list[ModelPiece]],
) -> BufferLayout:
    from megatron.core import parallel_state as ps

    is_expert = any(buffer is b for b in getattr(chunks[chunk], "expert_parallel_buffers", None) or [])
    dp_group = buffer.data_parallel_group
    dp_size, dp_rank = dp_group.size(), dp_group.rank()
    by_start = sorted(buffer.param_index_map.items(), key=lambda kv: kv[1][0])
    buckets: list[BucketLayout] = []
    for bi, bucket in enumerate(buffer.buckets):
        start, end = (int(x) for x in buffer.bucket_indices[bi])
        padded = int(bucket.grad_data.numel())
        if (start, end - start) != (int(bucket.offset), padded) or padded % dp_size:
            raise LayoutMismatchError(
                f"buffer {index} bucket {bi}: bucket_indices {(start, end)} disagree with bucket offset "
                f"{bucket.offset} / padded numel {padded} (DP {dp_size}); unsupported megatron-core"
            )
        params = []
        for param, (p_start, p_end, p_bucket) in by_start:
            if p_bucket != bi:
                continue
            group_index, group_order = opt.model_param_group_index_map.get(param, (None, None))
            params.append(
                ParamLayout(
                    name=names[param],
                    start=int(p_start),
                    end=int(p_end),
                    bucket_id=int(p_bucket),
                    shape=tuple(int(n) for n in param.shape),
                    model_pieces=tuple(pieces.get(param, ())),
                    group_index=group_index,
                    group_order=group_order,
                )
            )
        buckets.append(BucketLayout(bi, start, end, int(bucket.numel_unpadded), tuple(params)))
    pp = ps.get_pipeline_model_parallel_rank()
    if is_expert:
        mp = f"tp{ps.get_expert_tensor_parallel_rank()}.ep{ps.get_expert_model_parallel_rank()}.pp{pp}"
    else:
        mp = f"tp{ps.get_tensor_model_parallel_rank()}.pp{pp}"
    return BufferLayout(
        index=index,
        optimizer_index=optimizer_index,
        gbuf_index=gbuf_index,
        model_chunk=chunk,
        param_dtype=dtype_name(buffer.param_dtype),
        grad_dtype=dtype_name(buffer.grad_dtype),
        is_expert=is_expert,
        mp=mp,
        dp_size=dp_size,
        dp_rank=dp_rank,
        replica_id=int(getattr(opt, "distributed_optimizer_instance_id", 0)),
        buckets=tuple(buckets),
    )


def _check_against_megatron(opt: Any, gi: int, buffer: Any, buf: BufferLayout) -> None:
    """Our per-rank ranges must equal the DistributedOptimizer's own ``gbuf_ranges``."""
    key = (buffer.param_dtype, buffer.grad_dtype)
    for bucket in buf.buckets:
        param_map = opt.gbuf_ranges[gi][key][bucket.index]["param_map"]
        mine = {}
        for p in bucket.params:
            r = _owned_range(buf, bucket, p)
            if r is not None:
                mine[(p.start, p.end)] = r
        theirs = {}
        for param, ranges in param_map.items():
            s, e, _ = buffer.param_index_map[param]
            theirs[(int(s), int(e))] = (
                (ranges["gbuf_local"].start, ranges["gbuf_local"].end),
                (ranges["param"].start, ranges["param"].end),
            )
        if mine != theirs:
            raise LayoutMismatchError(
                f"buffer {buf.index} bucket {bucket.index}: slice ranges derived from param_index_map "
                "differ from DistributedOptimizer.gbuf_ranges; unsupported megatron-core version"
            )


def _owned_range(
    buf: BufferLayout, bucket: BucketLayout, p: ParamLayout
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """((lo, hi) in this rank's bucket slice, (lo, hi) in the flattened param), or None if not owned."""
    s = buf.slice_numel(bucket)
    r0 = buf.dp_rank * s
    p0, p1 = p.start - bucket.start, p.end - bucket.start
    lo, hi = max(p0, r0), min(p1, r0 + s)
    if hi <= lo:
        return None
    return (lo - r0, hi - r0), (lo - p0, hi - p0)


# --- model state ---------------------------------------------------------------------------------------
def model_state(
    model_chunks: Sequence[torch.nn.Module],
    *,
    prefix: str = MODEL_PREFIX,
    split_replicas: bool = True,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
) -> dict[str, Any]:
    """The model's ``sharded_state_dict()`` as ckptd shards: ``{path: Shard | plain data}``.

    - ``ShardedTensorFactory`` entries (e.g. SwiGLU's ``linear_fc1``) are built; each resulting
      ``ShardedTensor`` becomes one :class:`Shard` named ``prefix + key`` with ``prepend_axis_num``
      leading axes of extent 1 (the per-layer stacking axis). Shard data are views of the live params:
      nothing is copied here.
    - Tensors replicated over DP (Megatron's ``replica_id`` ends with the DP rank) are split along their
      first splittable axis into ``ceil(n/DP)``-row blocks, one per DP rank, with ``chunk_shape`` equal to
      the block so each rank's region is whole chunks; DP ranks past the last block get nothing. The
      split is decided from shapes and DP size alone, identically on every rank, without a collective.
      Tensors smaller than ``min_split_bytes`` per rank's copy, or without an axis whose blocks align
      with the chunk grid, stay whole (written by DP rank 0, the main replica).
    - ``ShardedObject``\\ s (``_extra_state``) with ``None`` data are skipped; ``BytesIO`` data are kept
      as ``bytes`` and other plain data as is, under ``prefix + unique_key`` (main replicas only).

    Non-main replicas are returned too (their Shard's ``replica_id`` is nonzero); the planner drops them.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out: dict[str, Any] = {}
    dense = (
        ps.get_data_parallel_world_size(with_context_parallel=True),
        ps.get_data_parallel_rank(with_context_parallel=True),
    )
    for chunk in model_chunks:
        expert_ptrs = _expert_storage_spans(chunk)
        for leaf in _sharded_leaves(chunk):
            if _is_sharded_tensor(leaf):
                if leaf.flattened_range is not None:
                    raise InvalidRequestError(f"{leaf.key}: flattened model ShardedTensors are not supported")
                base = Shard.from_sharded_tensor(leaf)
                base = Shard(
                    validate_key(prefix + leaf.key),
                    base.data,
                    base.global_shape,
                    base.global_offset,
                    base.replica_id,
                    base.chunk_shape,
                )
                if split_replicas:
                    if _views_any(leaf.data, expert_ptrs):
                        dp = (ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank())
                    else:
                        dp = dense
                    shards = _split_replicated(base, dp[0], dp[1], min_split_bytes)
                else:
                    shards = [base]
                for s in shards:
                    path = f"{s.key}@{','.join(str(o) for o in s.global_offset)}"
                    if path in out and _replica_tuple(s.replica_id) == _replica_tuple(out[path].replica_id):
                        raise ShardLayoutError(f"{s.key}: region at {s.global_offset} appears twice in the model")
                    out[path] = s
            elif isinstance(leaf, ShardedObject):
                if leaf.data is None or any(_replica_tuple(leaf.replica_id)):
                    continue
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


def _expert_storage_spans(chunk: torch.nn.Module) -> list[tuple[int, int, int]]:
    """Storage spans of expert params (``allreduce=False``), which replicate over the expert-DP group."""
    return [_storage_span(p) for p in _unwrap(chunk).parameters() if getattr(p, "allreduce", True) is False]


def _storage_span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first element, one past the last element) of a contiguous tensor."""
    off = int(t.storage_offset())
    return t.untyped_storage().data_ptr(), off, off + t.numel()


def _views_any(t: torch.Tensor, spans: list[tuple[int, int, int]]) -> bool:
    if not spans:
        return False
    ptr, off = t.untyped_storage().data_ptr(), t.storage_offset()
    return any(ptr == p and lo <= off < hi for p, lo, hi in spans)


def _split_replicated(shard: Shard, dp_size: int, dp_rank: int, min_split_bytes: int) -> list[Shard]:
    """Split a DP-replicated block 1/DP per rank along its first splittable axis (see model_state)."""
    rid = _replica_tuple(shard.replica_id)
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


# --- optimizer state -----------------------------------------------------------------------------------
class _Owned(NamedTuple):
    """A param slice this DP rank owns: where it sits in the rank's bucket slice, and its main shard."""

    param: ParamLayout
    lo: int  # [lo, hi) in this rank's slice of the bucket
    hi: int
    main: torch.Tensor  # the fp32 main param shard the inner optimizer steps
    inner: Any  # the inner torch optimizer (its ``state`` is looked up at use: load_state_dict replaces it)
    group: int

    @property
    def state(self) -> Any:
        return self.inner.state[self.main]

    def get(self, name: str) -> Any:
        return self.inner.state.get(self.main, {}).get(name)


@dataclass
class _Bound:
    """A layout bound to a live (chained) DistributedOptimizer, cached per optimizer object."""

    layout: MegatronLayout
    owned: dict[tuple[int, int], list[_Owned]]  # (buffer.index, bucket.index) -> owned slices
    dist: dict[int, Any]  # optimizer_index -> DistributedOptimizer
    staging: dict[str, torch.Tensor] = field(default_factory=dict)  # reused bucket slices, by key


_BOUND: weakref.WeakKeyDictionary[Any, _Bound] = weakref.WeakKeyDictionary()


def _bind(optimizer: Any, layout: MegatronLayout) -> _Bound:
    bound = _BOUND.get(optimizer)
    if bound is not None and bound.layout is layout:
        return bound
    opts = _distributed_optimizers(optimizer)
    owned: dict[tuple[int, int], list[_Owned]] = {}
    dist: dict[int, Any] = {}
    for buf in layout.buffers:
        if buf.optimizer_index >= len(opts) or buf.gbuf_index >= len(opts[buf.optimizer_index].buffers):
            raise LayoutMismatchError(f"layout buffer {buf.index} does not exist in this optimizer")
        opt = opts[buf.optimizer_index]
        dist[buf.optimizer_index] = opt
        buffer = opt.buffers[buf.gbuf_index]
        group = buffer.data_parallel_group
        if (group.rank(), group.size()) != (buf.dp_rank, buf.dp_size):
            raise LayoutMismatchError(f"layout buffer {buf.index} was computed for another DP rank/size")
        by_range = {(int(s), int(e)): p for p, (s, e, _b) in buffer.param_index_map.items()}
        for bucket in buf.buckets:
            entries = []
            for p in bucket.params:
                r = _owned_range(buf, bucket, p)
                if r is None:
                    continue
                (lo, hi), _ = r
                model_param = by_range.get((p.start, p.end))
                if model_param is None or tuple(model_param.shape) != p.shape:
                    raise LayoutMismatchError(f"{p.name}: not at [{p.start}, {p.end}) of buffer {buf.index}")
                gi, go = opt.model_param_group_index_map[model_param]
                main = opt.optimizer.param_groups[gi]["params"][go]
                if main.numel() != hi - lo:
                    raise LayoutMismatchError(
                        f"{p.name}: main shard has {main.numel()} elements, layout expects {hi - lo}"
                    )
                entries.append(_Owned(p, lo, hi, main, opt.optimizer, gi))
            owned[(buf.index, bucket.index)] = entries
    bound = _Bound(layout, owned, dist)
    _BOUND[optimizer] = bound
    return bound


def _state_names(bound: _Bound) -> tuple[list[str], list[str]]:
    """(per-element tensor state names, scalar state names) over every main param of this rank."""
    elem: dict[str, None] = {}
    scalar: dict[str, None] = {}
    for entries in bound.owned.values():
        for o in entries:
            for name, v in o.inner.state.get(o.main, {}).items():
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(o.main.shape):
                    elem[name] = None
                else:
                    scalar[name] = None
    if MAIN_PARAM in elem:
        raise InvalidRequestError(f"the inner optimizer keeps a state named {MAIN_PARAM!r}, which ckptd reserves")
    return list(elem), list(scalar)


def optimizer_state(optimizer: Any, layout: MegatronLayout) -> dict[str, Any]:
    """This DP rank's share of the distributed optimizer state, as ckptd shards plus plain data.

    For every (buffer, bucket, state) one 1-D :class:`Shard`: ``global_shape=(padded_bucket_numel,)``,
    ``global_offset=(dp_rank * S,)``, ``chunk_shape=(S,)`` with ``S = padded / DP``; ``state`` is
    ``param`` (the fp32 main param) and every per-element tensor state of the inner optimizer. The data
    is one tensor per (bucket, state), allocated once per optimizer on the state's device and reused by
    later calls (so copy it before the next call); padding stays zero. No communication.

    Plain data lives under :data:`OPTIM_META`: per DistributedOptimizer its ``param_groups`` (without
    ``params``), scalar per-param state (``step``) and grad-scaler state. Everything in it is
    dicts/lists/numbers/strings/None.
    """
    bound = _bind(optimizer, layout)
    elem_names, scalar_names = _state_names(bound)
    out: dict[str, Any] = {}
    for buf, bucket in layout.buckets():
        s = buf.slice_numel(bucket)
        entries = bound.owned[(buf.index, bucket.index)]
        for name in (MAIN_PARAM, *elem_names):
            key = layout.bucket_key(buf, bucket, name)
            pieces = [(o, o.main if name == MAIN_PARAM else o.get(name)) for o in entries]
            missing = [o.param.name for o, t in pieces if t is None]
            if missing:
                raise StateMismatchError(f"{key}: no {name!r} state for {', '.join(missing)}")
            staging = bound.staging.get(key)
            if staging is None:
                ref = pieces[0][1] if pieces else _any_main(bound)
                staging = torch.zeros(s, dtype=ref.dtype, device=ref.device)
                bound.staging[key] = staging
            for o, t in pieces:
                staging[o.lo : o.hi].copy_(t.detach().view(-1))
            out[key] = Shard(key, staging, (bucket.padded_numel,), (buf.dp_rank * s,), buf.replica_id, (s,))
    out[OPTIM_META] = _optimizer_meta(bound, layout, scalar_names)
    return out


def _any_main(bound: _Bound) -> torch.Tensor:
    for entries in bound.owned.values():
        for o in entries:
            return o.main
    return torch.zeros(0, dtype=torch.float32)


def _param_id(buf: BufferLayout, p: ParamLayout) -> str:
    return f"buf{buf.index}/{p.name}"


def _plain(obj: Any, where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, (list, tuple)):
        return [_plain(x, where) for x in obj]
    if isinstance(obj, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, torch.dtype):
        return dtype_name(obj)
    raise InvalidRequestError(f"{where}: cannot store {type(obj).__name__} as plain optimizer data")


def _optimizer_meta(bound: _Bound, layout: MegatronLayout, scalar_names: list[str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"layout_version": LAYOUT_VERSION, "optimizers": {}}
    for oi, opt in sorted(bound.dist.items()):
        groups = [
            {k: _plain(v, f"param_groups[{i}].{k}") for k, v in g.items() if k != "params"}
            for i, g in enumerate(opt.optimizer.param_groups)
        ]
        scalars: dict[str, Any] = {}
        for name in scalar_names:
            values: dict[str, Any] = {}
            dtype: str | None = None
            for buf in (b for b in layout.buffers if b.optimizer_index == oi):
                for bucket in buf.buckets:
                    for o in bound.owned[(buf.index, bucket.index)]:
                        v = o.get(name)
                        if v is None:
                            continue
                        if isinstance(v, torch.Tensor):
                            dtype = dtype_name(v.dtype)
                        values[_param_id(buf, o.param)] = _plain(v, f"state.{name}")
            if len({json.dumps(v, sort_keys=True) for v in values.values()}) == 1:
                scalars[name] = {"dtype": dtype, "value": next(iter(values.values()))}
            elif values:
                scalars[name] = {"dtype": dtype, "by_param": values}
        entry: dict[str, Any] = {"param_groups": groups, "scalar_state": scalars}
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            entry["grad_scaler"] = _plain(scaler.state_dict(), "grad_scaler")
        meta["optimizers"][str(oi)] = entry
    return meta


def _bucket_prefix(layout: MegatronLayout, buf: BufferLayout, bucket: BucketLayout) -> str:
    return layout.bucket_key(buf, bucket, MAIN_PARAM)[: -len(MAIN_PARAM)]


def optimizer_read_regions(layout: MegatronLayout) -> dict[str, tuple[int, int]]:
    """What this rank loads: ``{bucket key prefix: (start, stop)}`` of each stored 1-D bucket array.

    The prefix is ``optim/<mp>/buf<g>/bucket<b>/``; read every state stored under it (``param`` plus the
    inner optimizer's). The region is this rank's slice ``[d*S, (d+1)*S)`` of its *own* padded bucket. A
    checkpoint saved at another DP size was padded differently (to ``lcm(DP, 128)``), so clip ``stop`` to
    the stored length: what lies beyond is padding (no param sits there), and
    :func:`apply_optimizer_state` treats it as zero.
    """
    out: dict[str, tuple[int, int]] = {}
    for buf, bucket in layout.buckets():
        s = buf.slice_numel(bucket)
        out[_bucket_prefix(layout, buf, bucket)] = (buf.dp_rank * s, (buf.dp_rank + 1) * s)
    return out


def apply_optimizer_state(
    optimizer: Any,
    layout: MegatronLayout,
    slices: Mapping[str, Any],
    *,
    copy_to_model: bool = True,
    sync_params: bool = False,
) -> None:
    """Write loaded bucket slices and plain data back into the optimizer; inverse of :func:`optimizer_state`.

    ``slices`` maps each optimizer key (``optim/<mp>/buf<g>/bucket<b>/<state>``) to a 1-D tensor holding
    the stored array's elements from ``d*S`` on, where ``d``/``S`` are this (loading) rank's — see
    :func:`optimizer_read_regions`. A tensor shorter than ``S`` (checkpoint saved at another DP size,
    clipped to its shorter padded bucket) is fine: the missing tail is padding. Every bucket needs its
    ``param`` entry; the per-element states present for a bucket are restored, allocating them when the
    optimizer has no state yet. ``slices[OPTIM_META]`` is the plain data :func:`optimizer_state` returned,
    or a list of them (one per saving DP rank) when the DP size changed and scalar state differs per param.

    Afterwards main params are copied into the model params this rank owns (``copy_to_model``), as
    Megatron does after a step; with ``sync_params`` the model chunks' param all-gather runs too (a DP
    collective), otherwise the other ranks' slices of the model params must come from the model
    checkpoint.
    """
    bound = _bind(optimizer, layout)
    meta_in = slices.get(OPTIM_META)
    metas: list[Mapping[str, Any]] = (
        [] if meta_in is None else list(meta_in) if isinstance(meta_in, (list, tuple)) else [meta_in]
    )
    by_bucket: dict[str, dict[str, torch.Tensor]] = {p: {} for p in optimizer_read_regions(layout)}
    for key, value in slices.items():
        if key == OPTIM_META:
            continue
        prefix, _, state = key.rpartition("/")
        if prefix + "/" not in by_bucket:
            raise StateMismatchError(f"{key}: no such optimizer bucket in this rank's layout")
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            raise InvalidRequestError(f"{key}: expected a 1-D tensor slice")
        by_bucket[prefix + "/"][state] = value
    with torch.no_grad():
        for buf, bucket in layout.buckets():
            prefix = _bucket_prefix(layout, buf, bucket)
            loaded = by_bucket[prefix]
            entries = bound.owned[(buf.index, bucket.index)]
            if entries and MAIN_PARAM not in loaded:
                raise StateMismatchError(f"{prefix}{MAIN_PARAM}: missing from the loaded optimizer state")
            for name, src in loaded.items():
                for o in entries:
                    if o.hi > src.numel():
                        raise ShardLayoutError(
                            f"{prefix}{name}: {o.param.name} needs elements [{o.lo}, {o.hi}) of this rank's "
                            f"slice, but only {src.numel()} were loaded"
                        )
                    piece = src[o.lo : o.hi]
                    if name == MAIN_PARAM:
                        o.main.copy_(piece)
                        continue
                    dst = o.get(name)
                    if not isinstance(dst, torch.Tensor) or tuple(dst.shape) != tuple(o.main.shape):
                        dst = torch.zeros_like(o.main, dtype=src.dtype)
                        o.state[name] = dst
                    dst.copy_(piece)
        _apply_meta(bound, layout, metas)
        if copy_to_model:
            for opt in bound.dist.values():
                opt._copy_main_params_to_model_params()
                if sync_params:
                    for chunk in opt.model_chunks:
                        chunk.start_param_sync(force_sync=True)


def _apply_meta(bound: _Bound, layout: MegatronLayout, metas: Sequence[Mapping[str, Any]]) -> None:
    if not metas:
        return
    for m in metas:
        if m.get("layout_version") != LAYOUT_VERSION:
            raise InvalidRequestError(f"unsupported optimizer metadata version {m.get('layout_version')!r}")
    saved = metas[0]["optimizers"]
    for oi, opt in bound.dist.items():
        entry = saved.get(str(oi))
        if entry is None:
            raise StateMismatchError(f"no saved optimizer metadata for DistributedOptimizer {oi}")
        groups = opt.optimizer.param_groups
        if len(entry["param_groups"]) != len(groups):
            raise StateMismatchError(
                f"optimizer {oi}: {len(entry['param_groups'])} saved param groups, {len(groups)} live"
            )
        for g, sg in zip(groups, entry["param_groups"], strict=True):
            for k, v in sg.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v
        for name, spec in entry["scalar_state"].items():
            by_param: dict[str, Any] = {}
            for m in metas:
                found = m["optimizers"].get(str(oi), {}).get("scalar_state", {}).get(name, {})
                by_param.update(found.get("by_param", {}))
            dtype = torch_dtype(spec["dtype"]) if spec.get("dtype") else None
            for buf in (b for b in layout.buffers if b.optimizer_index == oi):
                for bucket in buf.buckets:
                    for o in bound.owned[(buf.index, bucket.index)]:
                        pid = _param_id(buf, o.param)
                        if "value" in spec:
                            value = spec["value"]
                        elif pid in by_param:
                            value = by_param[pid]
                        else:
                            raise StateMismatchError(f"{name}: no saved value for {pid}")
                        o.state[name] = value if dtype is None else _scalar_tensor(o, name, value, dtype)
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None and "grad_scaler" in entry:
            live = scaler.state_dict()
            scaler.load_state_dict(
                {
                    k: torch.tensor(v, dtype=live[k].dtype, device=live[k].device)
                    if isinstance(live.get(k), torch.Tensor)
                    else v
                    for k, v in entry["grad_scaler"].items()
                }
            )


def _scalar_tensor(o: _Owned, name: str, value: Any, dtype: torch.dtype) -> torch.Tensor:
    """A fresh scalar tensor per param (never one shared by all params), where the optimizer keeps it."""
    old = o.get(name)
    if isinstance(old, torch.Tensor):
        device = old.device
    else:  # torch Adam: on the param's device only when capturable or fused, else on the CPU
        group = o.inner.param_groups[o.group]
        device = o.main.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
    return torch.tensor(value, dtype=dtype, device=device)
