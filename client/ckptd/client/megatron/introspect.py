"""Everything ckptd reads from (or calls on) megatron-core's internals, in one place.

The grad buffers (``buffers``, ``param_index_map``, ``bucket_indices``, ``gbuf_ranges``), the inner
optimizer and its param-group map, ``parallel_state``, the walk over ``sharded_state_dict()`` and the
CUDA RNG tracker: when a megatron-core release changes one of them, this module is the one to adapt.
Megatron is untyped, so its objects are ``Any`` here (and only here); megatron is imported lazily.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple, Protocol

import torch

from ckptd.client.state import dtype_name
from ckptd.writer.errors import InvalidRequestError, LayoutMismatchError
from ckptd.writer.format import optim_mp
from ckptd.writer.layout import BucketLayout, BufferLayout, MegatronLayout, ModelPiece, ParamLayout

logger = logging.getLogger(__name__)

DistOpt = Any  # a megatron ``DistributedOptimizer`` (untyped)


class MegatronOptimizer(Protocol):
    """What ``get_megatron_optimizer`` returns: a ``ChainedOptimizer`` of ``DistributedOptimizer``\\ s, or one
    ``DistributedOptimizer``. ckptd reads its grad buffers and inner optimizer (this module) and never
    calls ``step``; the protocol only names the shape callers pass."""

    def step(self) -> object: ...

    def state_dict(self) -> object: ...


class ParallelRanks(NamedTuple):
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int  # with context parallelism, as the distributed optimizer shards
    dp_size: int


class Owned(NamedTuple):
    """A param slice this DP rank owns: where it sits in the rank's bucket slice, and its main shard."""

    param: ParamLayout
    lo: int  # [lo, hi) in this rank's slice of the bucket
    hi: int
    main: torch.Tensor  # the fp32 main param shard the inner optimizer steps
    inner: torch.optim.Optimizer  # its ``state`` is looked up at use: load_state_dict replaces it
    group: int

    @property
    def state(self) -> dict[str, object]:
        return self.inner.state[self.main]  # type: ignore[no-any-return]

    def get(self, name: str) -> object:
        return self.inner.state.get(self.main, {}).get(name)


# --- versions and parallel state ------------------------------------------------------------------------
def megatron_version() -> str:
    try:
        from megatron.core import __version__

        return str(__version__)
    except ImportError:  # pragma: no cover - megatron is required by every caller
        return ""


def parallel_ranks() -> ParallelRanks:
    from megatron.core import parallel_state as ps

    return ParallelRanks(
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_rank(with_context_parallel=True),
        ps.get_data_parallel_world_size(with_context_parallel=True),
    )


def expert_ranks() -> dict[str, int]:
    """This rank's expert-parallel and expert-tensor-parallel ranks and sizes (1 and 0 without experts), as the
    per-rank ``megatron`` record holds them."""
    from megatron.core import parallel_state as ps

    return {"ep": ps.get_expert_model_parallel_rank() or 0, "ep_size": ps.get_expert_model_parallel_world_size() or 1,
            "etp": ps.get_expert_tensor_parallel_rank() or 0,
            "etp_size": ps.get_expert_tensor_parallel_world_size() or 1}


def dense_dp() -> tuple[int, int]:
    """(size, rank) of the data-parallel group (with context parallelism) dense params replicate over."""
    from megatron.core import parallel_state as ps

    size = ps.get_data_parallel_world_size(with_context_parallel=True)
    return size, ps.get_data_parallel_rank(with_context_parallel=True)


def expert_dp() -> tuple[int, int]:
    """(size, rank) of the expert-data-parallel group expert params replicate over."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank()


# --- optimizers -----------------------------------------------------------------------------------------
def distributed_optimizers(optimizer: object) -> list[DistOpt]:
    """The DistributedOptimizers of a (chained) optimizer, in order; typed errors for what is unsupported."""
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
        if cpu_offloaded(opt):
            raise InvalidRequestError(
                "optimizer CPU offload (optimizer_cpu_offload, Megatron's HybridDeviceOptimizer) is not supported: "
                "it rebuilds its state dict at every step, split between host and GPU copies of the main params"
            )
        out.append(opt)
    return out


def cpu_offloaded(optimizer: object) -> bool:
    """Whether a (chained) DistributedOptimizer steps its state through Megatron's CPU offload."""
    opts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    return any(getattr(getattr(o, "config", None), "optimizer_cpu_offload", False)
               or type(getattr(o, "optimizer", None)).__name__ == "HybridDeviceOptimizer" for o in opts)


def inner_optimizer(opt: DistOpt) -> torch.optim.Optimizer:
    """The torch optimizer a DistributedOptimizer steps (its param groups hold the fp32 main shards)."""
    return opt.optimizer  # type: ignore[no-any-return]


def grad_scaler(opt: DistOpt) -> Any:
    return getattr(opt, "grad_scaler", None)


def copy_main_params_to_model(opt: DistOpt, sync_params: bool) -> None:
    """Main params -> this rank's model params, as Megatron does after a step; optionally all-gather them."""
    opt._copy_main_params_to_model_params()
    if sync_params:
        for chunk in opt.model_chunks:
            chunk.start_param_sync(force_sync=True)


def bind_owned(
    optimizer: object, layout: MegatronLayout
) -> tuple[dict[tuple[int, int], list[Owned]], dict[int, DistOpt]]:
    """The slices this rank owns per (buffer, bucket), found in the live optimizer, and the optimizers."""
    opts = distributed_optimizers(optimizer)
    owned: dict[tuple[int, int], list[Owned]] = {}
    dist: dict[int, DistOpt] = {}
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
                r = buf.owned_range(bucket, p)
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
                entries.append(Owned(p, lo, hi, main, opt.optimizer, gi))
            owned[(buf.index, bucket.index)] = entries
    return owned, dist


# --- model chunks and their sharded state dicts ----------------------------------------------------------
def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(module)  # type: ignore[no-any-return]


def param_names(chunk: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    return {p: n for n, p in unwrap(chunk).named_parameters()}


def _iter_sharded(obj: object) -> Iterator[Any]:
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


_LEAVES: ContextVar[dict[int, tuple[torch.nn.Module, list[Any]]] | None] = ContextVar("ckptd_leaves", default=None)


@contextmanager
def leaves_reused() -> Iterator[None]:
    """Inside the block each chunk's ``sharded_state_dict()`` is built once: planning a save or a load needs
    its leaves twice (the grad-buffer layout, the model shards), and Megatron builds every ShardedTensor anew
    at each call (~25 µs a tensor: 0.25 s of a first save at ~20,000 of them)."""
    token = _LEAVES.set({})
    try:
        yield
    finally:
        _LEAVES.reset(token)


def sharded_leaves(chunk: torch.nn.Module) -> list[Any]:
    """The ``ShardedTensor``/``ShardedObject`` leaves of a chunk's ``sharded_state_dict()``, factories built
    (the same list again for the same chunk inside :func:`leaves_reused`; callers only read it)."""
    memo = _LEAVES.get()
    held = memo.get(id(chunk)) if memo is not None else None
    if held is not None and held[0] is chunk:
        return held[1]
    module: Any = unwrap(chunk)
    leaves = list(_iter_sharded(module.sharded_state_dict()))
    if memo is not None:
        memo[id(chunk)] = (chunk, leaves)
    return leaves


def is_sharded_tensor(obj: object) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return isinstance(obj, ShardedTensor)


def is_sharded_object(obj: object) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return isinstance(obj, ShardedObject)


def replica_tuple(rid: int | Sequence[int]) -> tuple[int, ...]:
    return (int(rid),) if isinstance(rid, int) else tuple(int(r) for r in rid)


def storage_span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first element, one past the last element) of a contiguous tensor."""
    off = int(t.storage_offset())
    return t.untyped_storage().data_ptr(), off, off + t.numel()


def expert_params(chunk: torch.nn.Module) -> ParamSpans:
    """The spans of the expert params (``allreduce=False``), which replicate over the expert-DP group."""
    return ParamSpans([p for p in unwrap(chunk).parameters() if getattr(p, "allreduce", True) is False])


class ParamSpans:
    """Which param's memory holds an element range of a storage: the first param (in ``parameters()``
    order) whose span contains it. A storage whose params' spans do not overlap (Megatron's grad buffers
    hold every param of a chunk in one storage, back to back) is searched by bisection, not param by param:
    a chunk of ~8,400 params has ~20,000 ShardedTensors to place."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        by_storage: dict[int, list[tuple[int, int, int, torch.nn.Parameter]]] = {}
        for i, p in enumerate(params):
            ptr, lo, hi = storage_span(p)
            if hi > lo:  # an empty param holds no element
                by_storage.setdefault(ptr, []).append((lo, hi, i, p))
        self._spans = {ptr: sorted(spans, key=lambda s: (s[0], s[2])) for ptr, spans in by_storage.items()}
        self._starts = {ptr: [s[0] for s in spans] for ptr, spans in self._spans.items()}
        self._disjoint = {
            ptr: all(a[1] <= b[0] for a, b in itertools.pairwise(spans)) for ptr, spans in self._spans.items()
        }

    def owner(self, ptr: int, lo: int, hi: int) -> tuple[torch.nn.Parameter, int] | None:
        """(param, its first element in the storage) whose span holds elements ``[lo, hi)``, or None."""
        spans = self._spans.get(ptr)
        if spans is None:
            return None
        if self._disjoint[ptr]:  # the one span starting at or before lo, if it reaches hi
            i = bisect.bisect_right(self._starts[ptr], lo) - 1
            found = spans[i] if i >= 0 and hi <= spans[i][1] else None
        else:
            found = min((s for s in spans if s[0] <= lo and hi <= s[1]), key=lambda s: s[2], default=None)
        return None if found is None else (found[3], found[0])


def model_pieces(chunk: torch.nn.Module) -> dict[torch.nn.Parameter, list[ModelPiece]]:
    """Map each param to the built ShardedTensors that view it (by storage and element range)."""
    spans = ParamSpans(list(unwrap(chunk).parameters()))
    out: dict[torch.nn.Parameter, list[ModelPiece]] = {}
    for st in sharded_leaves(chunk):
        if not is_sharded_tensor(st) or st.flattened_range is not None:
            continue
        t = st.data
        if t.numel() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        lo = t.storage_offset()
        hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        owner = spans.owner(ptr, lo, hi)
        if owner is None:
            continue  # not a param (a buffer) or a copy: model_state still saves it
        param, start = owner
        out.setdefault(param, []).append(
            ModelPiece(
                key=st.key,
                global_shape=tuple(int(n) for n in st.global_shape),
                global_offset=tuple(int(o) for o in st.global_offset),
                prepend_axis_num=int(st.prepend_axis_num),
                view_offset=lo - start,
                view_shape=tuple(int(n) for n in t.shape),
                view_stride=tuple(int(s) for s in t.stride()),
                replica_id=replica_tuple(st.replica_id),
            )
        )
    return out


# --- grad buffers -----------------------------------------------------------------------------------------
def buffer_layouts(model_chunks: Sequence[torch.nn.Module], optimizer: object) -> list[BufferLayout]:
    """Every grad buffer of the (chained) optimizer, cross-checked against Megatron's own ``gbuf_ranges``."""
    chunks = list(model_chunks)
    names = [param_names(c) for c in chunks]
    pieces = [model_pieces(c) for c in chunks]
    buffers: list[BufferLayout] = []
    for oi, opt in enumerate(distributed_optimizers(optimizer)):
        for gi, buffer in enumerate(opt.buffers):
            c = _owning_chunk(chunks, buffer)
            buf = _buffer_layout(len(buffers), oi, gi, opt, buffer, chunks, c, names[c], pieces[c])
            _check_against_megatron(opt, gi, buffer, buf)
            buffers.append(buf)
    return buffers


def _owning_chunk(chunks: Sequence[torch.nn.Module], buffer: Any) -> int:
    for c, chunk in enumerate(chunks):
        for attr in ("buffers", "expert_parallel_buffers"):
            if any(buffer is b for b in getattr(chunk, attr, None) or []):
                return c
    raise InvalidRequestError("a DistributedOptimizer buffer belongs to none of the given model chunks")


def _buffer_layout(
    index: int,
    optimizer_index: int,
    gbuf_index: int,
    opt: DistOpt,
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
        mp = optim_mp(ps.get_expert_tensor_parallel_rank(), pp, ps.get_expert_model_parallel_rank())
    else:
        mp = optim_mp(ps.get_tensor_model_parallel_rank(), pp)
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


def _check_against_megatron(opt: DistOpt, gi: int, buffer: Any, buf: BufferLayout) -> None:
    """Our per-rank ranges must equal the DistributedOptimizer's own ``gbuf_ranges``."""
    key = (buffer.param_dtype, buffer.grad_dtype)
    for bucket in buf.buckets:
        param_map = opt.gbuf_ranges[gi][key][bucket.index]["param_map"]
        mine = {}
        for p in bucket.params:
            r = buf.owned_range(bucket, p)
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


# --- RNG -------------------------------------------------------------------------------------------------
def cuda_rng_tracker_states() -> dict[str, object]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return dict(get_cuda_rng_tracker().get_states())


def update_cuda_rng_tracker_states(states: Mapping[str, torch.Tensor], tracker: Any = None) -> None:
    """Megatron's CUDA RNG tracker gets ``states``: a graph-safe tracker's generators (CUDA graphs hold
    them) are set in place, a plain tracker's states replaced."""
    if tracker is None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
    now = dict(tracker.get_states())
    graph_safe = bool(getattr(tracker, "use_cudagraphable_rng", False)) or any(
        isinstance(v, torch.Generator) for v in now.values()
    )
    for name, state in states.items():
        if isinstance(now.get(name), torch.Generator):
            now[name].set_state(state)
        elif graph_safe and name not in now:  # one it lacks: a generator of its own, as Megatron-LM makes
            from megatron.core.tensor_parallel.random import convert_cuda_rng_state

            now[name] = convert_cuda_rng_state(state, to_graphable=True)
        else:
            now[name] = state
    tracker.set_states(now)
