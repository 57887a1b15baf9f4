"""A plain ``save(state)`` of a state dict shaped like the one its plan was made from, recognised without
planning it again.

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
may stage itself) or exactly :class:`~ckptd.client.state.Shard`, whose key, global shape and offset,
replica id and chunk grid are compared too (one ``attrgetter`` pass); plain leaves are of types that carry
no attributes a state dict could read as a shard (``int``, ``float``, ``bool``, ``str``, ``bytes``,
``None``, ``list``, ``tuple``); the keys are strings. A dict with any other leaf (a Megatron
``ShardedTensor``, a ``Shard`` subclass) has no skeleton and is planned at every save. Which leaves the rank
writes and which it holds as non-main replicas is read off the plan the skeleton was made with.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ckptd.client.guard import ShapeGuard
from ckptd.client.plan import Checked, StagePlan
from ckptd.client.state import Shard, set_path

_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter, Shard})  # what a run of values may hold
_NESTED = frozenset({dict, OrderedDict})
_PLAIN = frozenset({int, float, bool, str, bytes, type(None), list, tuple})
_RUN, _SUB, _LEAF = 0, 1, 2  # a slice of tensor values; a nested dict; a plain leaf
_META = operator.attrgetter("key", "global_shape", "global_offset", "replica_id", "chunk_shape")
_DATA = operator.attrgetter("data")


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


def _take(level: _Level, state: Mapping[str, Any], leaves: list[Any], objects: dict[str, Any]) -> bool:
    """Append ``state``'s tensor and ``Shard`` leaves to ``leaves`` and set its plain leaves in ``objects``, in
    the order :func:`~ckptd.client.state.plan_state` meets them; False as soon as ``state`` is not shaped as
    ``level``."""
    if list(state) != level.keys:
        return False
    values = list(state.values())
    if list(map(type, values)) != level.types:
        return False
    for kind, i, x in level.steps:
        if kind == _RUN:
            leaves += values[i:x]
        elif kind == _SUB:
            if not _take(x, values[i], leaves, objects):
                return False
        else:
            set_path(objects, x, values[i])
    return True


class Skeleton:
    """The shape of a state dict that has a plan, and that plan."""

    __slots__ = ("_guard", "_main", "_metas", "_root", "_shards", "plan")

    def __init__(self, root: _Level, leaves: list[Any], main: list[int] | None, plan: StagePlan) -> None:
        self._root = root
        self._shards = [i for i, leaf in enumerate(leaves) if type(leaf) is Shard]  # where the Shard leaves are
        shards = list(map(leaves.__getitem__, self._shards))
        self._metas = list(map(_META, shards))
        self._guard = ShapeGuard(self._data(leaves, shards))
        self._main = main  # where the leaves this rank writes are, in plan order; None: all of them
        self.plan = plan

    @classmethod
    def of(
        cls, state: Mapping[str, Any], plan: StagePlan, shards: Sequence[Shard], replicas: Sequence[Shard]
    ) -> Skeleton | None:
        """The skeleton of ``state``, planned as ``shards`` (this rank writes them) and ``replicas`` (it holds
        them as non-main replicas), staged through ``plan``; None when ``state`` has leaves it does not stand
        for (module docstring) or its leaves' tensors are not those, in order."""
        if type(state) not in _NESTED:
            return None
        root = _level(state, "")
        if root is None:
            return None
        leaves: list[Any] = []
        _take(root, state, leaves, {})
        main = _split(leaves, shards, replicas)
        if main is None:
            return None
        return cls(root, leaves, None if len(main) == len(leaves) else main, plan)

    def _data(self, leaves: list[Any], shards: list[Shard]) -> list[torch.Tensor]:
        """The leaves' tensors: Shard leaves' data, the others as they are."""
        if not shards:
            return leaves
        if len(shards) == len(leaves):
            return list(map(_DATA, shards))
        data = list(leaves)
        for i, shard in zip(self._shards, shards, strict=True):
            data[i] = shard.data
        return data

    def match(self, state: Mapping[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]] | None:
        """The tensors this rank writes (in plan order; :class:`~ckptd.client.plan.Checked`: the plan need
        not compare them again) and the plain-data tree, when ``state`` is shaped as the skeleton's dict;
        else None."""
        leaves: list[Any] = []
        objects: dict[str, Any] = {}
        if type(state) not in _NESTED or not _take(self._root, state, leaves, objects):
            return None
        shards = list(map(leaves.__getitem__, self._shards))
        if shards and list(map(_META, shards)) != self._metas:
            return None
        data = self._data(leaves, shards)
        if not self._guard.matches(data):
            return None
        return Checked(data if self._main is None else map(data.__getitem__, self._main)), objects


def _split(leaves: list[Any], shards: Sequence[Shard], replicas: Sequence[Shard]) -> list[int] | None:
    """Where ``shards`` are among ``leaves`` (in order), the rest being ``replicas`` in order; None when the
    leaves are not that. Each leaf is matched to the shard :func:`~ckptd.client.state.plan_state` made of it,
    never by its tensor alone (one tensor under two keys, written under one and held as a replica under the
    other, must map each key to its own position): a ``Shard`` leaf is that shard itself, a tensor leaf a
    shard of that tensor that is no ``Shard`` leaf (all of those are written, or all held, on a rank)."""
    own = {id(leaf) for leaf in leaves if type(leaf) is Shard}

    def made_of(shard: Shard, leaf: Any) -> bool:
        return shard is leaf if type(leaf) is Shard else shard.data is leaf and id(shard) not in own

    main: list[int] = []
    si = ri = 0
    for i, leaf in enumerate(leaves):
        if si < len(shards) and made_of(shards[si], leaf):
            main.append(i)
            si += 1
        elif ri < len(replicas) and made_of(replicas[ri], leaf):
            ri += 1
        else:
            return None
    return main if si == len(shards) and ri == len(replicas) else None
