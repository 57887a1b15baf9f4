"""A plain ``save(state)`` of a state dict shaped like the last one, recognised without planning it again.

:func:`~ckptd.client.state.plan_state` walks the dict leaf by leaf and builds a :class:`~ckptd.client.state.Shard`
per tensor (~2.5 µs a tensor: 25 ms a save at 10,000 tensors, where a copy of 32 KiB tensors takes ~30 ms),
and the plan cache then compares the shards' structure (:func:`~ckptd.client.reuse.shards_fingerprint`). Once a
structure has a plan, a :class:`Skeleton` of the dict that planned it takes its place: per nested dict, its
keys and the type of each value, compared as lists (one C-level comparison each), the tensors taken as
slices of the values, and their dtype, shape and device compared in one pass (torch's ``TensorGuards``
where it works, else three ``map`` calls). A dict that matches plans to the same shards in the same order,
so it is staged through the same plan; anything else (a key added, removed, renamed or moved, a value of
another type, a tensor of another dtype, shape or device) is planned from scratch, as before.

What a skeleton stands for is kept narrow, so that "same keys, same types" decides the plan: nested dicts
are ``dict`` or ``OrderedDict``; tensors are exactly ``torch.Tensor`` or ``torch.nn.Parameter`` (a subclass
may stage itself); plain leaves are of types that carry no attributes a state dict could read as a
shard (``int``, ``float``, ``bool``, ``str``, ``bytes``, ``None``, ``list``, ``tuple``); the keys are
strings. A dict with any other leaf (a :class:`~ckptd.client.state.Shard`, a Megatron ``ShardedTensor``)
has no skeleton and is planned at every save.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ckptd.client.guard import ShapeGuard
from ckptd.client.plan import Checked, StagePlan
from ckptd.client.state import set_path

_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_NESTED = frozenset({dict, OrderedDict})
_PLAIN = frozenset({int, float, bool, str, bytes, type(None), list, tuple})
_RUN, _SUB, _LEAF = 0, 1, 2  # a slice of tensor values; a nested dict; a plain leaf


class _Level(NamedTuple):
    """One dict of the state: its keys, its values' types, and what to take from its values, in order:
    ``(_RUN, lo, hi)`` tensors ``values[lo:hi]``, ``(_SUB, i, level)``, ``(_LEAF, i, path)``."""

    keys: list[str]
    types: list[type]
    steps: list[tuple[int, int, Any]]


def _level(state: Mapping[str, Any], prefix: str) -> _Level | None:
    keys, values = list(state), list(state.values())
    types = list(map(type, values))
    steps: list[tuple[int, int, Any]] = []
    lo = -1  # where the current run of tensors began
    for i, (k, v, t) in enumerate(zip(keys, values, types, strict=True)):
        if type(k) is not str:
            return None
        if t in _TENSORS:
            lo = i if lo < 0 else lo
            continue
        if lo >= 0:
            steps.append((_RUN, lo, i))
            lo = -1
        path = f"{prefix}/{k}" if prefix else k
        if t in _NESTED:
            sub = _level(v, path)
            if sub is None:
                return None
            steps.append((_SUB, i, sub))
        elif t in _PLAIN:
            steps.append((_LEAF, i, path))
        else:
            return None
    if lo >= 0:
        steps.append((_RUN, lo, len(values)))
    return _Level(keys, types, steps)


def _take(level: _Level, state: Mapping[str, Any], tensors: list[torch.Tensor], objects: dict[str, Any]) -> bool:
    """Append ``state``'s tensors to ``tensors`` and set its plain leaves in ``objects``, in the order
    :func:`~ckptd.client.state.plan_state` meets them; False as soon as ``state`` is not shaped as ``level``."""
    if list(state) != level.keys:
        return False
    values = list(state.values())
    if list(map(type, values)) != level.types:
        return False
    for kind, i, x in level.steps:
        if kind == _RUN:
            tensors += values[i:x]
        elif kind == _SUB:
            if not _take(x, values[i], tensors, objects):
                return False
        else:
            set_path(objects, x, values[i])
    return True


class Skeleton:
    """The shape of a state dict that has a plan, and that plan."""

    __slots__ = ("_guard", "_root", "plan")

    def __init__(self, root: _Level, tensors: list[torch.Tensor], plan: StagePlan) -> None:
        self._root = root
        self._guard = ShapeGuard(tensors)
        self.plan = plan

    @classmethod
    def of(cls, state: Mapping[str, Any], plan: StagePlan) -> Skeleton | None:
        """The skeleton of ``state`` (planned as ``plan``), or None when ``state`` has leaves it does not stand
        for (module docstring)."""
        if type(state) not in _NESTED:
            return None
        root = _level(state, "")
        if root is None:
            return None
        tensors: list[torch.Tensor] = []
        _take(root, state, tensors, {})
        return cls(root, tensors, plan)

    def match(self, state: Mapping[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]] | None:
        """``state``'s tensors (in plan order; :class:`~ckptd.client.plan.Checked`: the plan need not compare
        them again) and plain-data tree when it is shaped as the skeleton's dict, else None."""
        tensors: list[torch.Tensor] = Checked()
        objects: dict[str, Any] = {}
        if type(state) not in _NESTED or not _take(self._root, state, tensors, objects):
            return None
        return (tensors, objects) if self._guard.matches(tensors) else None

