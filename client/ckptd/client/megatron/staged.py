"""The Megatron save's per-run cache: a registered :class:`~ckptd.client.plan.StagePlan` and the optimizer's
plain data, with the fingerprint that says when either must be planned again.

Checked on every save, without a torch op: the address, dtype and shape of every model param and of every
tensor in the inner optimizers' param groups (a param replaced, cast or resized; a resized bucket moves
them all), the groups' membership (a new param group), how many states each owned param keeps (a state
that appeared after the first step), and the RNG keys. Any difference plans the save again; sources looked
up per save (optimizer states) are also checked against the plan before the lease.

The optimizer's plain data (``optim_meta``) changes every step (``step``, the learning rate), so it is
recomputed per save, but in bulk: one ``torch.stack`` per scalar state over every owned param instead of
one ``.item()`` and one JSON dump each.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.client.megatron import introspect
from ckptd.client.megatron.introspect import Owned
from ckptd.client.megatron.layout import Binding
from ckptd.client.megatron.optimizer import OptimizerMeta, _param_id, _plain, optimizer_meta
from ckptd.client.plan import ModuleWatch, StagePlan, groups_fingerprint, params_fingerprint
from ckptd.client.state import dtype_name
from ckptd.writer.format import MEGATRON_LAYOUT_VERSION
from ckptd.writer.layout import MegatronLayout


@dataclass
class StagedSave:
    """One optimizer's registered plan and what the per-save plain data walks."""

    fingerprint: tuple[Any, ...]
    watch: ModuleWatch
    plan: StagePlan
    layout_json: str
    record: dict[str, Any]
    scalar_names: list[str]
    # per DistributedOptimizer index: its owned params (and their ids in optim_meta)
    owned: dict[int, list[tuple[str, Owned]]] = field(default_factory=dict)
    chunk_ids: tuple[int, ...] = ()


_STAGED: weakref.WeakKeyDictionary[object, StagedSave] = weakref.WeakKeyDictionary()


def cached(optimizer: object) -> StagedSave | None:
    return _STAGED.get(optimizer)


def remember(optimizer: object, staged: StagedSave) -> None:
    _STAGED[optimizer] = staged


def forget(optimizer: object) -> None:
    _STAGED.pop(optimizer, None)


def owned_by_optimizer(binding: Binding, layout: MegatronLayout) -> dict[int, list[tuple[str, Owned]]]:
    out: dict[int, list[tuple[str, Owned]]] = {oi: [] for oi in binding.dist}
    for buf in layout.buffers:
        for bucket in buf.buckets:
            for o in binding.owned[(buf.index, bucket.index)]:
                out[buf.optimizer_index].append((_param_id(buf, o.param), o))
    return out


def structure(watch: ModuleWatch, binding: Binding) -> tuple[Any, ...]:
    """The part of the fingerprint read from the model (through ``watch``) and the optimizers' groups."""
    inner = [introspect.inner_optimizer(opt) for _, opt in sorted(binding.dist.items())]
    return (
        watch.fingerprint(),
        tuple(groups_fingerprint(o) for o in inner),
        tuple(params_fingerprint(p for g in o.param_groups for p in g["params"]) for o in inner),
    )


def owned_states(owned: dict[int, list[tuple[str, Owned]]]) -> dict[int, list[dict[str, Any] | None]]:
    """Each owned param's state dict, looked up once per save (``Tensor.__hash__`` is a Python call)."""
    return {oi: [o.inner.state.get(o.main) for _, o in entries] for oi, entries in owned.items()}


def state_counts(states: dict[int, list[dict[str, Any] | None]]) -> tuple[int, ...]:
    """How many states each owned param keeps: a state that appeared (or went) changes it."""
    return tuple(len(d) if d else 0 for ds in states.values() for d in ds)


def optim_meta(
    staged: StagedSave,
    optimizer: object,
    binding: Binding,
    layout: MegatronLayout,
    owned_states: dict[int, list[dict[str, Any] | None]],
) -> OptimizerMeta:
    """:func:`~ckptd.client.megatron.optimizer.optimizer_meta`'s value, computed in bulk."""
    meta: OptimizerMeta = {"layout_version": MEGATRON_LAYOUT_VERSION, "optimizers": {}}
    for oi, opt in sorted(binding.dist.items()):
        groups = [
            {k: _plain(v, f"param_groups[{i}].{k}") for k, v in g.items() if k != "params"}
            for i, g in enumerate(introspect.inner_optimizer(opt).param_groups)
        ]
        entries = staged.owned[oi]
        states = owned_states[oi]
        scalars: dict[str, Any] = {}
        for name in staged.scalar_names:
            found = [(pid, d[name]) for (pid, _), d in zip(entries, states, strict=True) if d and name in d]
            if not found:
                continue
            spec = _bulk(found)
            if spec is None:  # not all 0-dim tensors of one dtype: the general path
                return optimizer_meta(optimizer, layout, staged.scalar_names)
            scalars[name] = spec
        entry: dict[str, Any] = {"param_groups": groups, "scalar_state": scalars}
        scaler = introspect.grad_scaler(opt)
        if scaler is not None:
            entry["grad_scaler"] = _plain(scaler.state_dict(), "grad_scaler")
        meta["optimizers"][str(oi)] = entry
    return meta


def _bulk(found: list[tuple[str, object]]) -> dict[str, Any] | None:
    values = [v for _, v in found]
    first = values[0]
    if not isinstance(first, torch.Tensor):
        return None
    dtype = first.dtype
    if not all(isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == dtype for v in values):
        return None
    plain = torch.stack(values).tolist()  # type: ignore[arg-type]
    if len(set(plain)) == 1:
        return {"dtype": dtype_name(dtype), "value": plain[0]}
    return {"dtype": dtype_name(dtype), "by_param": {pid: v for (pid, _), v in zip(found, plain, strict=True)}}
