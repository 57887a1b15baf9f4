"""Megatron-core integration: model and distributed-optimizer state as ckptd shards, and the way back.

Entry points: :func:`save_checkpoint` (every rank; returns the ``SaveHandle`` once the data is staged,
the static plan cached after the first call) and :func:`load_checkpoint` (every rank; same TP/PP, any
DP; everything checked before a live tensor is written). See docs/megatron.md.

They build on three pure-ish pieces:

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
function needs its classes. The CPU shim (``ckptd.testing.cpu_shim``) is test-only and never imported.

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
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

import torch

from ckptd.client.state import Plan, Shard, dtype_name, plan_state, torch_dtype
from ckptd.writer.errors import InvalidRequestError, LayoutMismatchError, ShardLayoutError, StateMismatchError
from ckptd.writer.format import sidecar_name, validate_key

__all__ = [
    "CHECKPOINT_VERSION",
    "LAYOUT_VERSION",
    "MAIN_PARAM",
    "MODEL_PREFIX",
    "OPTIM_META",
    "OPTIM_PREFIX",
    "BucketLayout",
    "BucketSliceShard",
    "BufferLayout",
    "LoadedCheckpoint",
    "MegatronLayout",
    "ModelPiece",
    "ParamLayout",
    "apply_optimizer_state",
    "get_layout",
    "load_checkpoint",
    "model_state",
    "optimizer_read_regions",
    "optimizer_shards",
    "optimizer_state",
    "save_checkpoint",
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


# --- staging bucket slices straight from the optimizer ------------------------------------------------
@dataclass(frozen=True, eq=False)
class BucketSliceShard(Shard):
    """This DP rank's slice of one padded bucket for one state, assembled while it is staged.

    :meth:`stage_into` copies every owned param's tensor (the main param, or the inner optimizer's state
    of that name, looked up at staging time) into its place in the staging slot and zeroes the padding:
    one copy per byte, no intermediate buffer. ``data`` is a zero-stride placeholder that only carries
    the slice's shape, dtype and device; it holds no memory and must not be read (use
    :meth:`materialize` for a real tensor).
    """

    entries: tuple[_Owned, ...] = ()
    state: str = MAIN_PARAM
    gaps: tuple[tuple[int, int], ...] = ()

    def stage_into(self, dst: torch.Tensor, non_blocking: bool = False) -> None:
        for lo, hi in self.gaps:
            dst[lo:hi].zero_()
        for o in self.entries:
            t = o.main if self.state == MAIN_PARAM else o.get(self.state)
            if not isinstance(t, torch.Tensor):
                raise StateMismatchError(f"{self.key}: no {self.state!r} state for {o.param.name}")
            dst[o.lo : o.hi].copy_(t.detach().view(-1), non_blocking=non_blocking)

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.data.shape, dtype=self.data.dtype, device=self.data.device)
        self.stage_into(out)
        return out


def _gaps(entries: Sequence[_Owned], numel: int) -> tuple[tuple[int, int], ...]:
    gaps, pos = [], 0
    for o in sorted(entries, key=lambda e: e.lo):
        if o.lo > pos:
            gaps.append((pos, o.lo))
        pos = max(pos, o.hi)
    if pos < numel:
        gaps.append((pos, numel))
    return tuple(gaps)


def optimizer_shards(optimizer: Any, layout: MegatronLayout) -> dict[str, BucketSliceShard]:
    """The shards of :func:`optimizer_state` without its copy: each one stages itself from the live state.

    Same keys, global shapes, offsets and chunk grids as :func:`optimizer_state`; the data is read from
    the optimizer when the client copies the shard into the daemon's staging slot, so the save's only
    copy is that one. Plain data (:data:`OPTIM_META`) is not included. No communication.
    """
    bound = _bind(optimizer, layout)
    elem_names, _scalar = _state_names(bound)
    out: dict[str, BucketSliceShard] = {}
    for buf, bucket in layout.buckets():
        s = buf.slice_numel(bucket)
        entries = tuple(bound.owned[(buf.index, bucket.index)])
        gaps = _gaps(entries, s)
        for name in (MAIN_PARAM, *elem_names):
            key = layout.bucket_key(buf, bucket, name)
            ref = _state_ref(entries, name) if entries else _any_main(bound)
            placeholder = torch.empty((), dtype=ref.dtype, device=ref.device).expand(s)
            out[key] = BucketSliceShard(
                key, placeholder, (bucket.padded_numel,), (buf.dp_rank * s,), buf.replica_id, (s,),
                entries=entries, state=name, gaps=gaps,
            )
    return out


def _state_ref(entries: Sequence[_Owned], name: str) -> torch.Tensor:
    for o in entries:
        t = o.main if name == MAIN_PARAM else o.get(name)
        if isinstance(t, torch.Tensor):
            return t
    raise StateMismatchError(f"no {name!r} state for {', '.join(o.param.name for o in entries)}")


# --- checkpoint entry points ---------------------------------------------------------------------------
CHECKPOINT_VERSION = 1
MEGATRON_RECORD = "megatron"  # per-rank plain data: layout sidecar name, parallel ranks and sizes
RNG_PREFIX = "rng/"
EXTRA = "extra"


@dataclass
class _SavePlan:
    """What does not change between saves of one (model, optimizer): computed once, then reused."""

    chunk_ids: tuple[int, ...]
    signature: tuple[int, ...]  # storage addresses of every param: a moved param invalidates the plan
    elem_names: tuple[str, ...]
    layout_json: str
    record: dict[str, Any]
    shards: list[Shard]  # model and optimizer shards this rank writes (main replicas), validated


_SAVE_PLANS: weakref.WeakKeyDictionary[Any, _SavePlan] = weakref.WeakKeyDictionary()


def _param_signature(model_chunks: Sequence[torch.nn.Module]) -> tuple[int, ...]:
    return tuple(p.data_ptr() for c in model_chunks for p in c.parameters())


def _save_plan(
    model_chunks: Sequence[torch.nn.Module], optimizer: Any, rank: int, elem_names: Sequence[str] | None = None
) -> _SavePlan:
    layout = get_layout(model_chunks, optimizer)
    bound = _bind(optimizer, layout)
    elem_names = tuple(_state_names(bound)[0] if elem_names is None else elem_names)
    chunk_ids = tuple(id(c) for c in model_chunks)
    signature = _param_signature(model_chunks)
    plan = _SAVE_PLANS.get(optimizer)
    if plan is not None and (plan.chunk_ids, plan.signature, plan.elem_names) == (chunk_ids, signature, elem_names):
        return plan
    model = model_state(model_chunks)
    objects = {k: v for k, v in model.items() if not isinstance(v, Shard)}
    if objects:  # e.g. Transformer Engine's _extra_state: not stored yet (see docs/megatron.md)
        logger.warning("rank %d: model ShardedObjects %s are not saved by ckptd", rank, sorted(objects)[:5])
    # detached views: staging reads them after the optimizer has updated the params in place
    state: dict[str, Shard] = {k: replace(v, data=v.data.detach()) for k, v in model.items() if isinstance(v, Shard)}
    state.update(optimizer_shards(optimizer, layout))
    shards = plan_state(state, rank).shards  # validates keys, dtypes and chunk grids; drops replicas
    layout_json = layout.to_json()
    record: dict[str, Any] = {
        "version": CHECKPOINT_VERSION,
        "layout": sidecar_name(layout_json),
        "tp": layout.tp_rank,
        "tp_size": layout.tp_size,
        "pp": layout.pp_rank,
        "pp_size": layout.pp_size,
        "dp": layout.dp_rank,
        "dp_size": layout.dp_size,
        "megatron_core": layout.megatron_core_version,
    }
    plan = _SavePlan(chunk_ids, signature, elem_names, layout_json, record, shards)
    _SAVE_PLANS[optimizer] = plan
    logger.info(
        "rank %d: planned Megatron save: %d shards, %.1f MiB, layout %s",
        rank, len(shards), sum(s.nbytes for s in shards) / 2**20, record["layout"][:12],
    )
    return plan


def save_checkpoint(
    client: Any,
    step: int,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    *,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> Any:
    """Stage this rank's model shards, DP-local optimizer slices, RNG state and ``extra`` for ``step``.

    Call it on every rank, like Megatron-LM's ``save_checkpoint(iteration, model, optimizer, ...)``
    (``model_chunks`` is its ``model`` list of DDP-wrapped chunks, ``optimizer`` what
    ``get_megatron_optimizer`` returned). Returns the :class:`~ckptd.client.client.SaveHandle` as soon as
    the data is in the daemon's shared memory; training may go on and overwrite its tensors at once.
    ``handle.wait()`` blocks until the step committed (or raises why it did not).

    - model: ``sharded_state_dict()`` in model space (``model/<key>``), DP-replicated tensors split
      across DP ranks;
    - optimizer: one contiguous slice per (buffer, bucket, state) of the padded bucket
      (``optim/<mp>/buf<g>/bucket<b>/<state>``), copied straight from the optimizer into the slot, plus
      its plain data (param groups, ``step``, grad scaler);
    - RNG (``rng=True``): torch (and CUDA, and Megatron's CUDA RNG tracker) states as per-rank arrays,
      Python's and NumPy's as plain data;
    - ``extra``: plain data (dict/list/str/int/float/bool/None): iteration, scheduler ``state_dict()``,
      consumed samples...;
    - the :class:`MegatronLayout` as a content-addressed sidecar, named in this rank's ``megatron``
      record (sent once per connection, stored once per root).

    Everything static (keys, shapes, bucket layout, the planned shard list) is computed on the first
    call and reused; a later call does the copy and two short socket round trips. No collective.
    """
    p = client.placement
    bound = _bind(optimizer, get_layout(model_chunks, optimizer))
    elem_names, scalar_names = _state_names(bound)
    plan = _save_plan(model_chunks, optimizer, p.rank, elem_names)
    objects: dict[str, Any] = {
        MEGATRON_RECORD: plan.record,
        OPTIM_META: _optimizer_meta(bound, bound.layout, scalar_names),
    }
    if extra is not None:
        objects[EXTRA] = dict(extra)
    shards = list(plan.shards)
    if rng:
        rng_shards, objects["rng"] = _rng_state(p.rank, p.world_size)
        shards += rng_shards
    return client.save_plan(step, Plan(shards, objects), sidecars=[plan.layout_json])


def _rng_state(rank: int, world: int) -> tuple[list[Shard], dict[str, Any]]:
    import random

    import numpy as np

    shards = [Shard.per_rank(f"{RNG_PREFIX}torch", torch.get_rng_state(), rank, world)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        shards.append(Shard.per_rank(f"{RNG_PREFIX}cuda", torch.cuda.get_rng_state(), rank, world))
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        for name, st in sorted(get_cuda_rng_tracker().get_states().items()):
            if isinstance(st, torch.Tensor):
                key = validate_key(f"{RNG_PREFIX}cuda_tracker/{name}")
                shards.append(Shard.per_rank(key, st.cpu(), rank, world))
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    plain = {
        "python": [version, list(internal), gauss],
        "numpy": [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    return shards, plain


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored besides the tensors it filled in place."""

    step: int
    extra: Any  # the ``extra`` plain data given to save_checkpoint (None if there was none)
    source_rank: int  # the saved rank whose RNG state and ``extra`` were restored


def _root_of(root_or_client: Any, storage_options: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any] | None]:
    if isinstance(root_or_client, str):
        return root_or_client, storage_options
    return str(root_or_client.root), storage_options or getattr(root_or_client, "storage_options", None)


def _saved_records(commit: Any) -> dict[int, dict[str, Any]]:
    out = {}
    for rank, objects in commit.objects.items():
        rec = objects.get(MEGATRON_RECORD) if isinstance(objects, Mapping) else None
        if isinstance(rec, Mapping):
            if rec.get("version") != CHECKPOINT_VERSION:
                raise InvalidRequestError(f"step {commit.step}: unsupported Megatron record {rec.get('version')!r}")
            out[int(rank)] = dict(rec)
    if not out:
        raise StateMismatchError(f"step {commit.step} was not written by save_checkpoint: no Megatron layout record")
    return out


def load_checkpoint(
    root_or_client: Any,
    step: int | str,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    *,
    strict: bool = True,
    rng: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> LoadedCheckpoint:
    """Restore model, optimizer and RNG state saved by :func:`save_checkpoint`, in place, on every rank.

    ``root_or_client`` is the checkpoint root (path or URL) or a ``CheckpointClient``; ``step`` an int
    or ``"latest"``. The tensor-parallel and pipeline-parallel sizes must equal the saving run's; the
    data-parallel size may differ (each rank reads its own slice of every stored bucket, clipped to the
    stored padding). No collective.

    Everything is checked before any live tensor is written: another TP/PP raises
    :class:`LayoutMismatchError` (such a checkpoint needs the merged layout: ``ckptd merge``); a model
    key missing from the checkpoint, another global shape or dtype, a param that sits elsewhere in the
    grad buffers, or (``strict``) a checkpoint key the model lacks raises :class:`StateMismatchError`
    naming it. Model params come from the model arrays; the optimizer's fp32 main params and states
    from the bucket slices. RNG state (``rng``) and ``extra`` come from the saved rank with this rank's
    TP/PP/DP coordinates (the same TP/PP and DP rank 0 when that DP rank did not exist).
    """
    from ckptd.client.reader import load, plan_reads, read_commit, read_flat, read_sidecar

    root, opts = _root_of(root_or_client, storage_options)
    commit = read_commit(root, step if step == "latest" else int(step), storage_options=opts)  # type: ignore[arg-type]
    layout = get_layout(model_chunks, optimizer)
    records = _saved_records(commit)
    try:
        _check_parallel_sizes(commit.step, records, layout)
    except LayoutMismatchError:
        if not _is_merged(root, commit.step, opts):
            raise
        return _load_merged(root, commit, records, model_chunks, optimizer, layout, opts)
    same_mp = {r: rec for r, rec in records.items() if (rec["tp"], rec["pp"]) == (layout.tp_rank, layout.pp_rank)}
    if not same_mp:
        raise LayoutMismatchError(
            f"step {commit.step} holds no rank with TP rank {layout.tp_rank} and PP rank {layout.pp_rank}"
        )
    source = next((r for r, rec in sorted(same_mp.items()) if rec["dp"] == layout.dp_rank), min(same_mp))
    saved_layout = MegatronLayout.from_json(read_sidecar(root, records[source]["layout"], opts))

    # 1. check everything (pure), so a mismatch leaves the live model and optimizer untouched
    template = _model_template(model_chunks)
    plan_reads(commit, template)
    if strict:
        _check_no_extra_keys(commit, saved_layout, template)
    _check_structure(saved_layout, layout)
    regions = _optimizer_regions(commit, layout, optimizer)
    rng_template = _rng_template(commit, source) if rng else {}

    # 2. read the optimizer slices into fresh tensors, then fill the model (and RNG buffers) in place
    slices: dict[str, Any] = dict(read_flat(root, commit, regions, storage_options=opts))
    slices[OPTIM_META] = [commit.objects[str(r)][OPTIM_META] for r in sorted(same_mp)]
    load(root, commit.step, {**template, **rng_template}, storage_options=opts)
    _drop_unsaved_state(optimizer, layout, slices)
    apply_optimizer_state(optimizer, layout, slices, copy_to_model=False)
    source_objects = commit.objects[str(source)]
    if rng:
        _restore_rng(rng_template, source_objects.get("rng"))
    logger.info(
        "loaded step %d (tp%d pp%d dp%d/%d, saved at DP %d)",
        commit.step, layout.tp_rank, layout.pp_rank, layout.dp_rank, layout.dp_size, records[source]["dp_size"],
    )
    return LoadedCheckpoint(commit.step, source_objects.get(EXTRA), source)


def _is_merged(root: str, step: int, opts: Mapping[str, Any] | None) -> bool:
    from ckptd.client.reshard import merged_manifest

    return merged_manifest(root, step, opts) is not None


def _load_merged(
    root: str,
    commit: Any,
    records: Mapping[int, Mapping[str, Any]],
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    layout: MegatronLayout,
    opts: Mapping[str, Any] | None,
) -> LoadedCheckpoint:
    """Load a step saved with another TP/PP from its merged (fully reshardable) layout.

    Model tensors are in model space already, so each rank reads its new regions of them; the optimizer
    state of each of this rank's buckets is rebuilt from the per-parameter merged arrays. Plain optimizer
    data (param groups, scalar state such as Adam's step) comes from saved rank 0. RNG state is not
    restored: the saved ranks' generators belong to another parallel layout.
    """
    from ckptd.client.reader import load, plan_reads
    from ckptd.client.reshard import merged_slices

    template = _model_template(model_chunks)
    plan_reads(commit, template)  # every model key and shape checked before anything is written
    slices: dict[str, Any] = dict(merged_slices(root, commit.step, layout, opts))
    source = min(records)
    meta = commit.objects[str(source)][OPTIM_META]
    slices[OPTIM_META] = [_uniform_scalars(meta)]
    load(root, commit.step, template, storage_options=opts)
    _drop_unsaved_state(optimizer, layout, slices)
    apply_optimizer_state(optimizer, layout, slices, copy_to_model=False)
    saved = records[source]
    logger.info(
        "loaded step %d from its merged layout (saved TP=%d PP=%d DP=%d; now tp%d pp%d dp%d of TP=%d PP=%d DP=%d)",
        commit.step, saved["tp_size"], saved["pp_size"], saved["dp_size"], layout.tp_rank, layout.pp_rank,
        layout.dp_rank, layout.tp_size, layout.pp_size, layout.dp_size,
    )
    return LoadedCheckpoint(commit.step, commit.objects[str(source)].get(EXTRA), source)


def _uniform_scalars(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    """Scalar per-param state must be one value for all params to carry over to another layout."""
    for opt in meta.get("optimizers", {}).values():
        for name, value in opt.get("scalar_state", {}).items():
            if isinstance(value, Mapping) and "by_param" in value:
                raise LayoutMismatchError(
                    f"scalar optimizer state {name!r} differs between params; it cannot be mapped onto another "
                    "parallel layout"
                )
    return meta


def _check_parallel_sizes(step: int, records: Mapping[int, Mapping[str, Any]], layout: MegatronLayout) -> None:
    sizes = {(rec["tp_size"], rec["pp_size"]) for rec in records.values()}
    if sizes != {(layout.tp_size, layout.pp_size)}:
        saved = ", ".join(f"TP={t} PP={p}" for t, p in sorted(sizes))
        raise LayoutMismatchError(
            f"step {step} was saved with {saved}; this model runs TP={layout.tp_size} PP={layout.pp_size}. Its "
            "optimizer state is in the DP layout, which loads only with the same TP/PP (any DP). To change TP/PP, "
            f"build the merged (fully reshardable) layout first: `ckptd merge ROOT --step {step}`, then load that"
        )


def _model_template(model_chunks: Sequence[torch.nn.Module]) -> dict[str, Shard]:
    """Every model tensor of this rank as a Shard whose data is a view of the live tensor (no copy)."""
    modules = [_unwrap(c) for c in model_chunks]  # (DDP's ``buffers`` attribute shadows Module.buffers)
    storages = {
        t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *torch.nn.Module.buffers(m))
    }
    template = {}
    for path, leaf in model_state(model_chunks, split_replicas=False).items():
        if not isinstance(leaf, Shard):
            continue
        if leaf.data.untyped_storage().data_ptr() not in storages:
            raise InvalidRequestError(f"{leaf.key}: the model's ShardedTensor is a copy; it cannot be loaded in place")
        template[path] = replace(leaf, data=leaf.data.detach())  # filled in place, outside autograd
    return template


def _check_no_extra_keys(commit: Any, saved: MegatronLayout, template: Mapping[str, Shard]) -> None:
    have = {s.key for s in template.values()}
    expected = {saved.model_key(piece.key) for _b, bucket in saved.buckets() for p in bucket.params
                for piece in p.model_pieces}
    if saved.pp_size == 1 and not any(b.is_expert for b in saved.buffers):
        expected |= {rec.name for rec in commit.arrays if rec.name.startswith(saved.model_prefix)}
    extra = sorted(expected - have)
    if extra:
        raise StateMismatchError(
            f"{extra[0]}: in checkpoint step {commit.step} but not in the model"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
            + "; pass strict=False to ignore checkpoint keys the model lacks"
        )


def _check_structure(saved: MegatronLayout, live: MegatronLayout) -> None:
    """Same buffers, buckets and params at the same bucket-relative offsets (the DP size may differ)."""
    if len(saved.buffers) != len(live.buffers):
        raise StateMismatchError(f"the checkpoint has {len(saved.buffers)} grad buffers, the model {len(live.buffers)}")
    for sb, lb in zip(saved.buffers, live.buffers, strict=True):
        what = ("optimizer_index", "gbuf_index", "param_dtype", "grad_dtype", "is_expert", "mp")
        s_attrs, l_attrs = ([getattr(b, a) for a in what] for b in (sb, lb))
        if s_attrs != l_attrs:
            raise StateMismatchError(f"grad buffer {lb.index}: checkpoint {s_attrs} vs model {l_attrs} ({what})")
        if len(sb.buckets) != len(lb.buckets):
            raise StateMismatchError(
                f"grad buffer {lb.index}: the checkpoint has {len(sb.buckets)} buckets, the model {len(lb.buckets)} "
                "(another bucket_size or overlap_grad_reduce setting?)"
            )
        for sk, lk in zip(sb.buckets, lb.buckets, strict=True):
            s_params = [(p.name, p.start - sk.start, p.end - sk.start, p.shape) for p in sk.params]
            l_params = [(p.name, p.start - lk.start, p.end - lk.start, p.shape) for p in lk.params]
            for sp, lp in zip(s_params, l_params, strict=False):
                if sp != lp:
                    raise StateMismatchError(
                        f"{lp[0]}: buffer {lb.index} bucket {lk.index} has it at {lp[1:]} (offset, end, shape); "
                        f"the checkpoint has {sp[0]} at {sp[1:]}"
                    )
            if len(s_params) != len(l_params):
                longer = s_params if len(s_params) > len(l_params) else l_params
                raise StateMismatchError(
                    f"{longer[min(len(s_params), len(l_params))][0]}: buffer {lb.index} bucket {lk.index} holds "
                    f"{len(s_params)} params in the checkpoint, {len(l_params)} in the model"
                )


def _optimizer_regions(commit: Any, layout: MegatronLayout, optimizer: Any) -> dict[str, tuple[int, int]]:
    """Every stored state of every bucket of this rank, with the region this rank reads."""
    arrays = {rec.name: rec for rec in commit.arrays}
    bound = _bind(optimizer, layout)
    regions: dict[str, tuple[int, int]] = {}
    for buf, bucket in layout.buckets():
        prefix = _bucket_prefix(layout, buf, bucket)
        start, stop = buf.dp_rank * buf.slice_numel(bucket), (buf.dp_rank + 1) * buf.slice_numel(bucket)
        names = [n for n in arrays if n.startswith(prefix) and "/" not in n[len(prefix) :]]
        main_key = prefix + MAIN_PARAM
        if main_key not in arrays:
            raise StateMismatchError(f"{main_key}: not in checkpoint step {commit.step}")
        for name in names:
            rec = arrays[name]
            if len(rec.shape) != 1 or rec.shape[0] < bucket.numel_unpadded:
                raise StateMismatchError(
                    f"{name}: the checkpoint holds shape {tuple(rec.shape)}, the model's bucket has "
                    f"{bucket.numel_unpadded} elements"
                )
            entries = bound.owned[(buf.index, bucket.index)]
            if name == main_key and entries and rec.torch_dtype != dtype_name(entries[0].main.dtype):
                raise StateMismatchError(
                    f"{name}: the checkpoint has dtype {rec.torch_dtype}, the main params {entries[0].main.dtype}"
                )
            regions[name] = (start, stop)
    return regions


def _drop_unsaved_state(optimizer: Any, layout: MegatronLayout, slices: Mapping[str, Any]) -> None:
    """Forget per-param state the checkpoint does not have (saved before the first step, say)."""
    bound = _bind(optimizer, layout)
    saved_elem = {k.rpartition("/")[2] for k in slices if k != OPTIM_META}
    metas = slices.get(OPTIM_META) or []
    saved_scalar = {n for m in metas for e in m.get("optimizers", {}).values() for n in e.get("scalar_state", {})}
    keep = saved_elem | saved_scalar
    for entries in bound.owned.values():
        for o in entries:
            state = o.inner.state.get(o.main)
            if state:
                for name in [n for n in state if n not in keep]:
                    del state[name]


def _rng_template(commit: Any, source: int) -> dict[str, Shard]:
    out = {}
    for rec in commit.arrays:
        if rec.name.startswith(RNG_PREFIX) and len(rec.shape) == 2 and source < rec.shape[0]:
            data = torch.empty((1, rec.shape[1]), dtype=torch_dtype(rec.torch_dtype))
            out[rec.name] = Shard(rec.name, data, (rec.shape[0], rec.shape[1]), (source, 0))
    return out


def _restore_rng(tensors: Mapping[str, Shard], plain: Any) -> None:
    import random

    import numpy as np

    if f"{RNG_PREFIX}torch" in tensors:
        torch.set_rng_state(tensors[f"{RNG_PREFIX}torch"].data[0].clone())
    if torch.cuda.is_available() and f"{RNG_PREFIX}cuda" in tensors:
        torch.cuda.set_rng_state(tensors[f"{RNG_PREFIX}cuda"].data[0].clone())
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        prefix = f"{RNG_PREFIX}cuda_tracker/"
        states = {k[len(prefix) :]: s.data[0].clone() for k, s in tensors.items() if k.startswith(prefix)}
        if states:
            tracker = get_cuda_rng_tracker()
            tracker.set_states({**tracker.get_states(), **states})
    if isinstance(plain, Mapping):
        if "python" in plain:
            version, internal, gauss = plain["python"]
            random.setstate((version, tuple(internal), gauss))
        if "numpy" in plain:
            name, keys, pos, has_gauss, cached = plain["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
