"""The Megatron save's per-run cache: a registered :class:`~ckptd.client.plan.StagePlan` and the optimizer's
plain data, with the :class:`Structure` that says when either must be planned again.

Checked on every save, in ``map``s over C callables and torch's own guard primitives
(:mod:`ckptd.client.guard`; no Python call per tensor, ~2 µs a model param with the module dicts and the
optimizer's params included, most of it cache misses: 14-16.5 ms for the 700-layer ``stall_scale``
model's 8,404 params on one rank of the 2-core machine, 22-24 ms with both ranks checking at once): every
model param and every tensor in the inner optimizers' param groups is the same object with the same
dtype, address, shape and strides (a param replaced, cast, reshaped or resized; a resized bucket moves
them all), the groups' membership (a new param group), how many states each owned param keeps (a state
that appeared after the first step), and the RNG keys. Any difference plans the save again; sources looked
up per save (optimizer states) are also checked against the plan before the lease.

The optimizer's plain data (``optim_meta``) changes every step (``step``, the learning rate), so it is
recomputed per save, but in bulk: the per-param scalar states (Adam's ``step``) are re-homed into one 1-D
tensor per (optimizer, name) (:mod:`.rehome`), checked by address with one ``map`` and read with one
``.tolist()``, instead of one ``.item()`` and one JSON dump each.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ckptd.client.guard import ModuleWatch, StateIndex, TensorGuard, same_objects
from ckptd.client.megatron import introspect
from ckptd.client.megatron.introspect import Owned
from ckptd.client.megatron.layout import Binding
from ckptd.client.megatron.optimizer import OptimizerMeta, _param_id, _plain, optimizer_meta
from ckptd.client.megatron.rehome import home_scalars
from ckptd.client.plan import StagePlan
from ckptd.client.state import dtype_name
from ckptd.writer.format import MEGATRON_LAYOUT_VERSION
from ckptd.writer.layout import MegatronLayout


@dataclass
class StagedSave:
    """One optimizer's registered plan and what the per-save plain data walks."""

    structure: Structure
    states: OwnedStates  # the owned params' state dicts, looked up at each save
    plan: StagePlan
    layout_json: str
    record: dict[str, Any]
    scalar_names: list[str]
    # per DistributedOptimizer index: its owned params (and their ids in optim_meta)
    owned: dict[int, list[tuple[str, Owned]]] = field(default_factory=dict)
    chunk_ids: tuple[int, ...] = ()
    # modules with an _extra_state (read every save; the list is covered by the structure's module watch)
    extra_modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    frozen: Any = None  # a constant.Frozen: what saves under assume_constant_structure read, captured once
    # (DistributedOptimizer index, scalar state name) -> the 1-D tensor its per-param values are re-homed
    # into, and their addresses (one .tolist() a save while every value is still there)
    scalar_flats: dict[tuple[int, str], tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
    served: int = 0  # saves made through it


_STAGED: weakref.WeakKeyDictionary[object, StagedSave] = weakref.WeakKeyDictionary()


def cached(optimizer: object) -> StagedSave | None:
    return _STAGED.get(optimizer)


def remember(optimizer: object, staged: StagedSave) -> None:
    _STAGED[optimizer] = staged


_MOVES: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()


def forget(optimizer: object) -> None:
    """Drop the optimizer's plan, which went stale. A plan whose re-homed states the optimizer let go before
    a second save (it replaces its state tensors between saves: moved to the host and back, as verl's
    optimizer offload does) marks it as one that moves them; a plan that served more saves clears the mark,
    and one that held no re-homed states leaves it as it was."""
    staged = _STAGED.pop(optimizer, None)
    released = staged.plan.released() if staged is not None else None
    if staged is not None and released is not None:
        _MOVES[optimizer] = released and staged.served <= 1


def moves_states(optimizer: object) -> bool:
    """Whether the optimizer let its re-homed states go before (:func:`forget`): re-homing them again would
    copy every state once more at each save, for a plan the next move makes stale."""
    return _MOVES.get(optimizer, False)


def thaw(optimizer: object) -> None:
    """Drop what saves under ``assume_constant_structure`` hold (a load replaced state tensors in place of
    the held ones); the plan stays."""
    staged = _STAGED.get(optimizer)
    if staged is not None:
        staged.frozen = None


def owned_by_optimizer(binding: Binding, layout: MegatronLayout) -> dict[int, list[tuple[str, Owned]]]:
    out: dict[int, list[tuple[str, Owned]]] = {oi: [] for oi in binding.dist}
    for buf in layout.buffers:
        for bucket in buf.buckets:
            for o in binding.owned[(buf.index, bucket.index)]:
                out[buf.optimizer_index].append((_param_id(buf, o.param), o))
    return out


class Structure:
    """What a staged plan was made for, captured when planned; :meth:`holds` checks it at every save: the
    model's modules and params (:class:`~ckptd.client.guard.ModuleWatch`), each inner optimizer (the same
    object, its groups' sizes, every param in them the same tensor unchanged: a new group, a param moved,
    replaced, cast or resized), how many states each owned param keeps (a state that appeared after the
    first step), and the RNG keys. In ``map``s over C callables: ~2 µs a model param, all included (module
    docstring)."""

    def __init__(
        self, model_chunks: Sequence[torch.nn.Module], binding: Binding, states: StateDicts, rng_keys: object
    ) -> None:
        self.watch = ModuleWatch(model_chunks)
        self._inner = inner_optimizers(binding)
        self._group_sizes = [list(map(len, map(_PARAMS, o.param_groups))) for o in self._inner]
        self._members = [TensorGuard(group_members(o)) for o in self._inner]
        self._counts = state_counts(states)
        self._rng_keys = rng_keys

    def holds(self, binding: Binding, states: StateDicts, rng_keys: object) -> bool:
        inner = inner_optimizers(binding)
        return (
            rng_keys == self._rng_keys
            and same_objects(inner, self._inner)
            and [list(map(len, map(_PARAMS, o.param_groups))) for o in inner] == self._group_sizes
            and all(guard.holds(group_members(o)) for guard, o in zip(self._members, inner, strict=True))
            and self.watch.holds()
            and state_counts(states) == self._counts
        )


def inner_optimizers(binding: Binding) -> list[torch.optim.Optimizer]:
    return [introspect.inner_optimizer(opt) for _, opt in sorted(binding.dist.items())]


def group_members(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))


_PARAMS = operator.itemgetter("params")


class OwnedStates:
    """Each owned param's state dict, per DistributedOptimizer index, looked up at every save (its inner
    optimizer's ``state`` is read there: ``load_state_dict`` replaces it): by position while the ``state``
    keeps its keys (:class:`~ckptd.client.guard.StateIndex`), one ``state.get`` per param otherwise."""

    def __init__(self, owned: dict[int, list[tuple[str, Owned]]]) -> None:
        self._runs: dict[int, list[tuple[torch.optim.Optimizer, list[torch.Tensor], StateIndex]]] = {}
        for oi, entries in owned.items():
            runs = itertools.groupby((o for _, o in entries), key=operator.attrgetter("inner"))
            self._runs[oi] = [(inner, [o.main for o in run], StateIndex()) for inner, run in runs]

    def lookup(self) -> StateDicts:
        """Now (not kept: a ``state`` that ``load_state_dict`` replaced is not held alive here)."""
        return {
            oi: list(itertools.chain.from_iterable(index.lookup(inner.state, mains, _NO_STATE)
                                                   for inner, mains, index in runs))
            for oi, runs in self._runs.items()
        }


StateDicts = dict[int, list[Mapping[str, Any]]]  # per DistributedOptimizer index: each owned param's state


def state_counts(states: StateDicts) -> list[int]:
    """How many states each owned param keeps: a state that appeared (or went) changes it."""
    return list(itertools.chain.from_iterable(map(len, ds) for ds in states.values()))


_NO_STATE: Mapping[str, Any] = MappingProxyType({})  # a param without state (read-only: shared)


def optim_meta(
    staged: StagedSave,
    optimizer: object,
    binding: Binding,
    layout: MegatronLayout,
    owned_states: dict[int, list[Mapping[str, Any]]],
) -> OptimizerMeta:
    """:func:`~ckptd.client.megatron.optimizer.optimizer_meta`'s value, computed in bulk."""
    meta: OptimizerMeta = {"layout_version": MEGATRON_LAYOUT_VERSION, "optimizers": {}}
    for oi, opt in sorted(binding.dist.items()):
        entries = staged.owned[oi]
        states = owned_states[oi]
        scalars: dict[str, Any] = {}
        for name in staged.scalar_names:
            try:  # the common case: every owned param keeps the state
                values = list(map(operator.itemgetter(name), states))
                keep = entries
            except (KeyError, TypeError):
                keep = [e for e, d in zip(entries, states, strict=True) if d and name in d]
                values = [d[name] for d in states if d and name in d]
            if not values:
                continue
            spec = _bulk(staged, (oi, name), keep, values)
            if spec is None:  # not all 0-dim tensors of one dtype: the general path
                return optimizer_meta(optimizer, layout, staged.scalar_names)
            scalars[name] = spec
        meta["optimizers"][str(oi)] = optimizer_entry(opt, scalars)
    return meta


def optimizer_entry(opt: object, scalars: dict[str, Any]) -> dict[str, Any]:
    """One optimizer's plain data: its param groups (less the params), ``scalars``, its grad scaler."""
    groups = [
        {k: _plain(v, f"param_groups[{i}].{k}") for k, v in g.items() if k != "params"}
        for i, g in enumerate(introspect.inner_optimizer(opt).param_groups)
    ]
    entry: dict[str, Any] = {"param_groups": groups, "scalar_state": scalars}
    scaler = introspect.grad_scaler(opt)
    if scaler is not None:
        entry["grad_scaler"] = _plain(scaler.state_dict(), "grad_scaler")
    return entry


def scalar_spec(dtype: torch.dtype, pids: list[str], plain: list[Any]) -> dict[str, Any]:
    """How one scalar state is stored: one value when every param has it, else each param's."""
    if len(set(plain)) == 1:
        return {"dtype": dtype_name(dtype), "value": plain[0]}
    return {"dtype": dtype_name(dtype), "by_param": dict(zip(pids, plain, strict=True))}


_PID = operator.itemgetter(0)


def _bulk(
    staged: StagedSave, where: tuple[int, str], owned: list[tuple[str, Owned]], values: list[Any]
) -> dict[str, Any] | None:
    """One scalar state over every param that keeps it, when all are 0-dim tensors of one dtype: one
    ``map`` per check and one ``.tolist()`` of the 1-D tensor they are elements of (checked by address:
    re-homed there, :func:`~ckptd.client.megatron.rehome.home_scalars`, when they are not: a load made
    fresh ones), else one ``.item()`` each. While every value is still its element of the held tensor (one
    ``map`` of addresses) nothing more is compared."""
    try:
        ptrs = list(map(torch.Tensor.data_ptr, values))
    except (AttributeError, TypeError):  # not all tensors
        return None
    held = staged.scalar_flats.get(where)
    if held is None or held[1] != ptrs:  # not each at its element of the held tensor (nothing else can sit there)
        dtypes = set(map(_DTYPE, values))
        if len(dtypes) != 1 or set(map(torch.Tensor.dim, values)) != {0}:
            return None
        flat = home_scalars([o for _, o in owned], values, where[1])
        held = None if flat is None else (flat, list(map(torch.Tensor.data_ptr, flat.unbind())))
        if held is None:
            staged.scalar_flats.pop(where, None)
            return scalar_spec(dtypes.pop(), list(map(_PID, owned)), list(map(torch.Tensor.item, values)))
        staged.scalar_flats[where] = held
    return scalar_spec(held[0].dtype, list(map(_PID, owned)), held[0].tolist())


_DTYPE = operator.attrgetter("dtype")
