"""Distributed-optimizer state as bucket slices: one save path (:func:`optimizer_shards`) and its inverse.

Each DP rank owns the contiguous slice ``[d*S, (d+1)*S)`` of every padded bucket (``S = padded/DP``). For
every (buffer, bucket, state) :func:`optimizer_shards` returns one 1-D :class:`BucketSliceShard` stored as
``optim/<mp>/buf<g>/bucket<b>/<state>`` (:func:`ckptd.writer.format.bucket_key`); ``state`` is ``param``
(the fp32 main param) or a per-element state of the inner optimizer (``exp_avg``, ``exp_avg_sq``...).
The shard copies the optimizer's per-param tensors into the staging slot itself, so a save copies each
byte once and gathers nothing. :func:`apply_optimizer_state` writes loaded slices back, also from slices
saved at another DP size (same TP/PP).

Plain data (:func:`optimizer_meta`, stored under ``optim_meta``): per DistributedOptimizer its
``param_groups`` (without ``params``), scalar per-param state and grad-scaler state. Adam's ``step``:
torch Adam(W) (megatron-core's fallback without TE/Apex) keeps one scalar tensor per param, which
Megatron's own load paths mishandle (``KeyError: 'step'``, one shared tensor after load). Every 0-dim
tensor (and non-tensor) entry of a param's state is saved as plain data — one value when all params
agree, per param otherwise — and restored as a *fresh* tensor per param with the original dtype.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.client.megatron import introspect
from ckptd.client.megatron.introspect import Owned
from ckptd.client.megatron.layout import Binding, bind
from ckptd.client.plan import Fetch, Piece
from ckptd.client.state import Shard, dtype_name, torch_dtype
from ckptd.writer.errors import InvalidRequestError, ShardLayoutError, StateMismatchError
from ckptd.writer.format import MAIN_PARAM, MEGATRON_LAYOUT_VERSION, OPTIM_META, split_bucket_key
from ckptd.writer.layout import BufferLayout, MegatronLayout, ParamLayout

OptimizerMeta = dict[str, Any]  # plain data: dicts, lists, numbers, strings, None


@dataclass(frozen=True, eq=False)
class BucketSliceShard(Shard):
    """This DP rank's slice of one padded bucket for one state, assembled while it is staged.

    :meth:`stage_into` copies every owned param's tensor (the main param, or the inner optimizer's state
    of that name, looked up at staging time) into its place in the staging slot and zeroes the padding:
    one copy per byte, no intermediate buffer. ``data`` is a zero-stride placeholder that only carries
    the slice's shape, dtype and device; it holds no memory and must not be read (use
    :meth:`materialize` for a real tensor).
    """

    entries: tuple[Owned, ...] = ()
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

    def stage_pieces(self) -> list[Piece]:
        """What :meth:`stage_into` copies, for a compiled :class:`~ckptd.client.plan.StagePlan`: each owned
        param's main shard (static) or state (looked up per save), and the padding to zero. A state whose
        per-param tensors are views of one flat tensor laid out like the slice (re-homed by
        :mod:`~ckptd.client.megatron.rehome`, or left so by a load) is one static piece over that tensor,
        padding included (zeroed when it was made; the optimizer writes only the views), holding the
        lookups: each save's check finds every state still at its place, else the save plans again."""
        from ckptd.client.megatron.targets import flat_alias  # targets imports this module

        isz = self.data.element_size()
        if self.state != MAIN_PARAM and self.entries:
            live = [o.get(self.state) for o in self.entries]
            flat = flat_alias(live, self.entries, self.data.shape[0], self.data.dtype)
            if flat is not None:
                held = tuple(Fetch(o.inner, o.main, self.state) for o in self.entries)
                return [Piece(0, src=flat, held=held)]
        out = [Piece(lo * isz, nbytes=(hi - lo) * isz) for lo, hi in self.gaps]
        for o in self.entries:
            if self.state == MAIN_PARAM:
                out.append(_main_piece(o.main, o.lo * isz))
            else:
                out.append(Piece(o.lo * isz, fetch=Fetch(o.inner, o.main, self.state)))
        return out

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.data.shape, dtype=self.data.dtype, device=self.data.device)
        self.stage_into(out)
        return out


def _main_piece(main: torch.Tensor, lo: int) -> Piece:
    """A main param's copy. One with memory of its own (a copy in fp32 of a bf16 param's shard) is copied
    from as the tensor itself: a trainer that moves it to the host and back (``main.data = ...``) must not
    find its old memory kept alive by a view in the cached plan. One that is a view of the param buffer
    (fp32 training) joins that buffer's byte runs."""
    if main._base is None and main.dim() == 1 and main.is_contiguous():
        return Piece(lo, src=main, live=True)
    return Piece(lo, src=main.detach().view(-1))


def state_names(binding: Binding) -> tuple[list[str], list[str]]:
    """(per-element tensor state names, scalar state names) over every main param of this rank."""
    elem: dict[str, None] = {}
    scalar: dict[str, None] = {}
    for entries in binding.owned.values():
        for o in entries:
            for name, v in o.inner.state.get(o.main, {}).items():
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(o.main.shape):
                    elem[name] = None
                else:
                    scalar[name] = None
    if MAIN_PARAM in elem:
        raise InvalidRequestError(f"the inner optimizer keeps a state named {MAIN_PARAM!r}, which ckptd reserves")
    return list(elem), list(scalar)


def optimizer_shards(
    optimizer: object, layout: MegatronLayout, elem_names: Sequence[str] | None = None
) -> dict[str, BucketSliceShard]:
    """This DP rank's share of the distributed optimizer's tensors: one shard per (buffer, bucket, state).

    Each shard is 1-D with ``global_shape=(padded_bucket_numel,)``, ``global_offset=(dp_rank * S,)`` and
    ``chunk_shape=(S,)``; its data is read from the optimizer when the client copies the shard into the
    daemon's staging slot (padding zeroed), so the save's only copy is that one. ``elem_names`` are the
    per-element states to include (default: every one the inner optimizer keeps). Plain data is
    :func:`optimizer_meta`. No communication.
    """
    binding = bind(optimizer, layout)
    names = state_names(binding)[0] if elem_names is None else list(elem_names)
    out: dict[str, BucketSliceShard] = {}
    for buf, bucket in layout.buckets():
        s = buf.slice_numel(bucket)
        entries = tuple(binding.owned[(buf.index, bucket.index)])
        gaps = padding_gaps(entries, s)
        for name in (MAIN_PARAM, *names):
            key = layout.bucket_key(buf, bucket, name)
            ref = _state_ref(entries, name) if entries else _any_main(binding)
            placeholder = torch.empty((), dtype=ref.dtype, device=ref.device).expand(s)
            out[key] = BucketSliceShard(
                key, placeholder, (bucket.padded_numel,), (buf.dp_rank * s,), buf.replica_id, (s,),
                entries=entries, state=name, gaps=gaps,
            )
    return out


def padding_gaps(entries: Sequence[Owned], numel: int) -> tuple[tuple[int, int], ...]:
    """The ``[lo, hi)`` ranges of a bucket slice of ``numel`` elements that no owned param covers (padding)."""
    gaps, pos = [], 0
    for o in sorted(entries, key=lambda e: e.lo):
        if o.lo > pos:
            gaps.append((pos, o.lo))
        pos = max(pos, o.hi)
    if pos < numel:
        gaps.append((pos, numel))
    return tuple(gaps)


def _state_ref(entries: Sequence[Owned], name: str) -> torch.Tensor:
    for o in entries:
        t = o.main if name == MAIN_PARAM else o.get(name)
        if isinstance(t, torch.Tensor):
            return t
    raise StateMismatchError(f"no {name!r} state for {', '.join(o.param.name for o in entries)}")


def _any_main(binding: Binding) -> torch.Tensor:
    for entries in binding.owned.values():
        for o in entries:
            return o.main
    return torch.zeros(0, dtype=torch.float32)


def _param_id(buf: BufferLayout, p: ParamLayout) -> str:
    return f"buf{buf.index}/{p.name}"


def _plain(obj: object, where: str) -> Any:
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


def optimizer_meta(
    optimizer: object, layout: MegatronLayout, scalar_names: Sequence[str] | None = None
) -> OptimizerMeta:
    """The optimizer's plain data (stored under ``optim_meta``): param groups, scalar state, grad scaler."""
    binding = bind(optimizer, layout)
    names = state_names(binding)[1] if scalar_names is None else scalar_names
    meta: OptimizerMeta = {"layout_version": MEGATRON_LAYOUT_VERSION, "optimizers": {}}
    for oi, opt in sorted(binding.dist.items()):
        groups = [
            {k: _plain(v, f"param_groups[{i}].{k}") for k, v in g.items() if k != "params"}
            for i, g in enumerate(introspect.inner_optimizer(opt).param_groups)
        ]
        scalars: dict[str, Any] = {}
        for name in names:
            values: dict[str, Any] = {}
            dtype: str | None = None
            for buf in (b for b in layout.buffers if b.optimizer_index == oi):
                for bucket in buf.buckets:
                    for o in binding.owned[(buf.index, bucket.index)]:
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
        scaler = introspect.grad_scaler(opt)
        if scaler is not None:
            entry["grad_scaler"] = _plain(scaler.state_dict(), "grad_scaler")
        meta["optimizers"][str(oi)] = entry
    return meta


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
        out[layout.bucket_prefix(buf, bucket)] = (buf.dp_rank * s, (buf.dp_rank + 1) * s)
    return out


def apply_optimizer_state(
    optimizer: object,
    layout: MegatronLayout,
    slices: Mapping[str, Any],
    *,
    copy_to_model: bool = True,
    sync_params: bool = False,
    in_place: Collection[str] = (),
) -> None:
    """Write loaded bucket slices and plain data back into the optimizer; inverse of :func:`optimizer_shards`.

    ``slices`` maps each optimizer key (``optim/<mp>/buf<g>/bucket<b>/<state>``) to a 1-D tensor holding
    the stored array's elements from ``d*S`` on, where ``d``/``S`` are this (loading) rank's — see
    :func:`optimizer_read_regions`. A tensor shorter than ``S`` (checkpoint saved at another DP size,
    clipped to its shorter padded bucket) is fine: the missing tail is padding. Every bucket needs its
    ``param`` entry; the per-element states present for a bucket are restored, allocating them when the
    optimizer has no state yet. ``slices["optim_meta"]`` is the plain data :func:`optimizer_meta` returned,
    or a list of them (one per saving DP rank: one-value scalar state comes from the first, per-param values
    are looked up over all). ``load_checkpoint`` passes one: this rank's saved rank's at the saved layout,
    else one whose scalar state every saved rank agrees on (:func:`~.checks.uniform_scalars`).

    Afterwards main params are copied into the model params this rank owns (``copy_to_model``), as
    Megatron does after a step; with ``sync_params`` the model chunks' param all-gather runs too (a DP
    collective), otherwise the other ranks' slices of the model params must come from the model
    checkpoint. Keys in ``in_place`` were read straight into the optimizer's tensors
    (:mod:`~ckptd.client.megatron.targets`): checked, not copied again.
    """
    binding = bind(optimizer, layout)
    meta_in = slices.get(OPTIM_META)
    metas: list[Mapping[str, Any]] = (
        [] if meta_in is None else list(meta_in) if isinstance(meta_in, (list, tuple)) else [meta_in]
    )
    by_bucket: dict[str, dict[str, torch.Tensor]] = {p: {} for p in optimizer_read_regions(layout)}
    for key, value in slices.items():
        if key == OPTIM_META:
            continue
        prefix, state = split_bucket_key(key)
        if prefix not in by_bucket:
            raise StateMismatchError(f"{key}: no such optimizer bucket in this rank's layout")
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            raise InvalidRequestError(f"{key}: expected a 1-D tensor slice")
        by_bucket[prefix][state] = value
    with torch.no_grad():
        for buf, bucket in layout.buckets():
            prefix = layout.bucket_prefix(buf, bucket)
            loaded = by_bucket[prefix]
            entries = binding.owned[(buf.index, bucket.index)]
            if entries and MAIN_PARAM not in loaded:
                raise StateMismatchError(f"{prefix}{MAIN_PARAM}: missing from the loaded optimizer state")
            for name, src in loaded.items():
                copy = prefix + name not in in_place
                for o in entries:
                    if o.hi > src.numel():
                        raise ShardLayoutError(
                            f"{prefix}{name}: {o.param.name} needs elements [{o.lo}, {o.hi}) of this rank's "
                            f"slice, but only {src.numel()} were loaded"
                        )
                    if not copy:
                        continue
                    piece = src[o.lo : o.hi]
                    if name == MAIN_PARAM:
                        o.main.copy_(piece)
                        continue
                    dst = o.get(name)
                    if not isinstance(dst, torch.Tensor) or tuple(dst.shape) != tuple(o.main.shape):
                        dst = torch.zeros_like(o.main, dtype=src.dtype)
                        o.state[name] = dst
                    dst.copy_(piece)
        _apply_meta(binding, layout, metas)
        if copy_to_model:
            for opt in binding.dist.values():
                introspect.copy_main_params_to_model(opt, sync_params)
    from ckptd.client.megatron.staged import thaw  # staged imports this module

    thaw(optimizer)  # fresh scalar tensors replaced the ones a constant-structure save holds


def check_optimizer_meta(optimizer: object, layout: MegatronLayout, metas: Sequence[Mapping[str, Any]]) -> None:
    """Raise what :func:`apply_optimizer_state` would raise about the saved plain data ``metas`` (one per
    saving DP rank), without changing anything: a load calls it before it reads into live tensors."""
    _check_meta(bind(optimizer, layout), layout, metas)


def _check_meta(binding: Binding, layout: MegatronLayout, metas: Sequence[Mapping[str, Any]]) -> None:
    if not metas:
        return
    for m in metas:
        if m.get("layout_version") != MEGATRON_LAYOUT_VERSION:
            raise InvalidRequestError(f"unsupported optimizer metadata version {m.get('layout_version')!r}")
    saved = metas[0]["optimizers"]
    for oi, opt in binding.dist.items():
        entry = saved.get(str(oi))
        if entry is None:
            raise StateMismatchError(
                f"no saved optimizer metadata for DistributedOptimizer {oi}: the checkpoint was saved with "
                f"{len(saved)} distributed optimizer(s), the model has {len(binding.dist)} (Megatron keeps the "
                "expert params in an optimizer of their own only under expert parallelism: a step saved at EP=1 "
                "does not load at a larger EP)"
            )
        groups = introspect.inner_optimizer(opt).param_groups
        if len(entry["param_groups"]) != len(groups):
            raise StateMismatchError(
                f"optimizer {oi}: {len(entry['param_groups'])} saved param groups, {len(groups)} live"
            )
        scaler = introspect.grad_scaler(opt)
        if scaler is not None and "grad_scaler" in entry:  # restored last: refused here, before any write
            missing = sorted(set(scaler.state_dict()) - set(entry["grad_scaler"]))
            if missing:
                raise StateMismatchError(
                    f"optimizer {oi}: the live {type(scaler).__name__} needs {missing}, the checkpoint's grad "
                    f"scaler holds {sorted(entry['grad_scaler'])} (saved with another loss scaling)"
                )
        for name, spec in entry["scalar_state"].items():
            if "value" in spec:
                continue
            by_param = _saved_by_param(metas, oi, name)
            for pid, _o in _owned(binding, layout, oi):
                if pid not in by_param:
                    raise StateMismatchError(f"{name}: no saved value for {pid}")


def _saved_by_param(metas: Sequence[Mapping[str, Any]], oi: int, name: str) -> dict[str, Any]:
    """Scalar state ``name`` of optimizer ``oi`` by param id, over every saving DP rank's plain data."""
    by_param: dict[str, Any] = {}
    for m in metas:
        found = m["optimizers"].get(str(oi), {}).get("scalar_state", {}).get(name, {})
        by_param.update(found.get("by_param", {}))
    return by_param


def _owned(binding: Binding, layout: MegatronLayout, oi: int) -> Iterator[tuple[str, Owned]]:
    """Every param of optimizer ``oi`` this rank owns, with its id in the saved plain data."""
    for buf in (b for b in layout.buffers if b.optimizer_index == oi):
        for bucket in buf.buckets:
            for o in binding.owned[(buf.index, bucket.index)]:
                yield _param_id(buf, o.param), o


def _apply_meta(binding: Binding, layout: MegatronLayout, metas: Sequence[Mapping[str, Any]]) -> None:
    _check_meta(binding, layout, metas)
    if not metas:
        return
    saved = metas[0]["optimizers"]
    for oi, opt in binding.dist.items():
        entry = saved[str(oi)]
        groups = introspect.inner_optimizer(opt).param_groups
        for g, sg in zip(groups, entry["param_groups"], strict=True):
            for k, v in sg.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v
        for name, spec in entry["scalar_state"].items():
            by_param = {} if "value" in spec else _saved_by_param(metas, oi, name)
            dtype = torch_dtype(spec["dtype"]) if spec.get("dtype") else None
            for pid, o in _owned(binding, layout, oi):
                value = spec["value"] if "value" in spec else by_param[pid]
                o.state[name] = value if dtype is None else _scalar_tensor(o, name, value, dtype)
        scaler = introspect.grad_scaler(opt)
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


def _scalar_tensor(o: Owned, name: str, value: object, dtype: torch.dtype) -> torch.Tensor:
    """A fresh scalar tensor per param (never one shared by all params), where the optimizer keeps it."""
    old = o.get(name)
    if isinstance(old, torch.Tensor):
        device = old.device
    else:  # torch Adam: on the param's device only when capturable or fused, else on the CPU
        group = o.inner.param_groups[o.group]
        device = o.main.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
    return torch.tensor(value, dtype=dtype, device=device)


def drop_unsaved_state(optimizer: object, layout: MegatronLayout, slices: Mapping[str, Any]) -> None:
    """Forget per-param state the checkpoint does not have (saved before the first step, say)."""
    binding = bind(optimizer, layout)
    saved_elem = {split_bucket_key(k)[1] for k in slices if k != OPTIM_META}
    metas = slices.get(OPTIM_META) or []
    saved_scalar = {n for m in metas for e in m.get("optimizers", {}).values() for n in e.get("scalar_state", {})}
    keep = saved_elem | saved_scalar
    for entries in binding.owned.values():
        for o in entries:
            state = o.inner.state.get(o.main)
            if state:
                for name in [n for n in state if n not in keep]:
                    del state[name]
