"""The Megatron save under ``assume_constant_structure=True``: what a save reads, captured once.

The promise (Megatron-LM's ``--ckpt-assume-constant-structure``): between saves the model keeps the same
param tensors and the optimizer the same param groups and state tensors; values change (training updates
them in place). Under it a save skips the per-tensor structure check and the per-param state lookups
(:mod:`.staged`): the optimizer's state tensors and per-param scalar states (``step``) are captured after
a checked save and read straight from there. The planning save re-homed the per-element states into one
flat tensor per (bucket slice, state) (:mod:`.rehome`: the plan stages each in one byte copy and holds it,
so nothing is captured for them) and the capture re-homes each per-param scalar state into one 1-D tensor
per (optimizer, name) (read with one ``.tolist()``).

Still read at every save, whatever the promise: every value staged (the copy reads the live tensors), the
per-param ``step`` (all of them, in one ``.tolist()`` once re-homed), the param groups' plain data
(learning rate, weight decay...), the grad scaler, the ``_extra_state`` of the modules that can have one
(:func:`~.extra_state.extra_state_modules`), the RNG states and ``extra``.

Still checked at every save, cheaply (:meth:`Frozen.holds`, ~0.25-0.6 µs a param: 2-3 ms for 8,404 params on
one rank of the 2-core machine, ~4.9 ms with both ranks at once; most of it the addresses' cache misses): the
model params' addresses (a param whose ``.data`` was replaced, cast or resized), each inner optimizer's
``state`` dict by identity and size (``load_state_dict`` replaces it; a param that gained state), its param
groups by count and the identity of every param in them (a new group, a param replaced or moved), the model
chunks and the RNG keys. A difference saves through the checked path, which plans again when the structure
changed, and captures anew: such a save is correct, only not faster. Not checked: a state tensor of an
unchanged ``state`` dict replaced one by one (``state[p]["exp_avg"] = t``), or a module's param swapped for
another Parameter that the optimizer does not hold (Megatron's DDP would not train it either); the save would
stage the tensors captured before; the next checked save catches the first by address. Two cases are safe
all the same, as the plan holds no memory the optimizer let go of (:mod:`ckptd.client.planbuild`): every
state of a re-homed flat tensor replaced (an optimizer moved off the device and back) lets that tensor go, and
the save plans again (:class:`~ckptd.client.plan.StalePlanError`); a main param given new memory
(``main.data = ...``) is copied from as it is now. A held state tensor resized in place fails its copy, and the
save plans again.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.client.guard import same_objects
from ckptd.client.megatron.layout import Binding
from ckptd.client.megatron.optimizer import OptimizerMeta
from ckptd.client.megatron.rehome import home_scalars
from ckptd.client.megatron.staged import StagedSave, group_members, inner_optimizers, optimizer_entry, scalar_spec
from ckptd.writer.format import MEGATRON_LAYOUT_VERSION

_DTYPE = operator.attrgetter("dtype")


@dataclass
class _Scalar:
    """One per-param scalar state of one optimizer: the params' ids and their 0-dim state tensors."""

    name: str
    dtype: torch.dtype
    pids: list[str]
    tensors: list[torch.Tensor]
    flat: torch.Tensor | None = None  # the tensors are its elements, in order (re-homed): one .tolist()


@dataclass
class Frozen:
    """A checked save's sources and scalar states, and what :meth:`holds` compares at each save."""

    fetched: list[torch.Tensor]
    scalars: dict[int, list[_Scalar]]
    params: list[torch.Tensor]
    ptrs: list[int]
    states: list[dict[Any, Any]]  # each inner optimizer's state dict (held: its identity is compared)
    sizes: list[int]
    alive: list[list[torch.Tensor]]  # every param of each inner optimizer's groups, group by group
    group_counts: list[int]
    rng_keys: object

    def holds(self, binding: Binding, rng_keys: object) -> bool:
        """Whether the structure still looks as captured (see the module docstring): no torch op, C-level
        maps only."""
        if rng_keys != self.rng_keys or list(map(torch.Tensor.data_ptr, self.params)) != self.ptrs:
            return False
        inner = inner_optimizers(binding)
        return (
            len(inner) == len(self.states)
            and all(o.state is s for o, s in zip(inner, self.states, strict=True))
            and [len(o.state) for o in inner] == self.sizes
            and [len(o.param_groups) for o in inner] == self.group_counts
            and all(map(same_objects, map(group_members, inner), self.alive))
        )

    def optim_meta(self, binding: Binding) -> OptimizerMeta:
        """The optimizer's plain data, as :func:`~ckptd.client.megatron.staged.optim_meta` stores it, with
        every per-param scalar read from its captured tensor."""
        meta: OptimizerMeta = {"layout_version": MEGATRON_LAYOUT_VERSION, "optimizers": {}}
        for oi, opt in sorted(binding.dist.items()):
            scalars = {
                s.name: scalar_spec(
                    s.dtype, s.pids, s.flat.tolist() if s.flat is not None else list(map(torch.Tensor.item, s.tensors))
                )
                for s in self.scalars.get(oi, ())
            }
            meta["optimizers"][str(oi)] = optimizer_entry(opt, scalars)
        return meta


def capture(
    staged: StagedSave, binding: Binding, states: Mapping[int, Sequence[Mapping[str, Any]]], rng_keys: object
) -> Frozen | None:
    """What later saves under the promise read, taken after a checked save; None when a per-param scalar
    state is not a 0-dim tensor of one dtype (those saves stay on the checked path)."""
    scalars: dict[int, list[_Scalar]] = {}
    for oi, entries in staged.owned.items():
        scalars[oi] = []
        for name in staged.scalar_names:
            found = [(pid, o, d[name]) for (pid, o), d in zip(entries, states[oi], strict=True) if d and name in d]
            if not found:
                continue
            tensors = [v for _, _, v in found]
            if not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in tensors):
                return None
            dtypes = set(map(_DTYPE, tensors))
            if len(dtypes) != 1:
                return None
            # one 1-D tensor of them all (their views become the params' state): one .tolist() a save
            flat = home_scalars([o for _, o, _ in found], tensors, name)
            if flat is not None:
                tensors = [o.state[name] for _, o, _ in found]
            scalars[oi].append(_Scalar(name, dtypes.pop(), [pid for pid, _, _ in found], tensors, flat))
    params = staged.structure.watch.params()
    inner = inner_optimizers(binding)
    return Frozen(
        fetched=staged.plan.fetch(), scalars=scalars, params=list(params),
        ptrs=list(map(torch.Tensor.data_ptr, params)), states=[o.state for o in inner],
        sizes=[len(o.state) for o in inner], alive=[group_members(o) for o in inner],
        group_counts=[len(o.param_groups) for o in inner], rng_keys=rng_keys,
    )
