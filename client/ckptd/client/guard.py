"""Cheap per-save checks that what a save plan was made for is still there, and lookups that reuse their order.

A reused plan copies from views of live memory and from tensors looked up in an optimizer's ``state``; both are
correct only while the tensors are the ones planned. These checks run at every save, so each is a few ``map``s
over C callables across all tensors (no Python call per tensor, no ``torch.Size`` built):

- :class:`TensorGuard`: a list of tensors is still the same objects, each with the same dtype, address and
  shape. A param whose ``.data`` was replaced, cast, reshaped or resized, or ``set_`` to other memory,
  fails it;
- :class:`ModuleWatch`: a module tree still holds the same submodules and params (one held list each, compared
  by identity), and the params pass a :class:`TensorGuard`;
- :class:`StateIndex`: an optimizer's per-param state dicts for a list of params, read positionally from
  ``state.values()`` while ``state`` holds the same keys in the same order (``Tensor.__hash__`` is a Python
  call: one ``state.get`` per param costs ~0.5 µs, this ~0.05 µs).

Identity is compared against held objects, never against ids alone: a held object cannot be freed, so no
new object can take its id.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def same_objects(now: Sequence[object], held: Sequence[object]) -> bool:
    """The same objects in the same order."""
    return len(now) == len(held) and all(map(operator.is_, now, held))


class TensorGuard:
    """A list of tensors as captured: :meth:`holds` says whether a list is still them, unchanged in structure.

    Values may change (training updates them in place); the objects, their dtype, address and shape may not
    (a ``.data`` replaced, cast, reshaped or resized; ``set_`` to other memory). Three ``map``s over C
    getters and one identity pass: ~0.6-1 µs a tensor in a trained model, most of it building each
    ``torch.Size`` (``Tensor.is_set_to``, which compares strides too, measured slower there). Holding the
    tensors keeps their memory alive until the guard is dropped, which a plan made for them does anyway."""

    __slots__ = ("_dtypes", "_held", "_ptrs", "_shapes")

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        held = list(tensors)
        self._held = held
        self._ptrs = list(map(torch.Tensor.data_ptr, held))
        self._dtypes = list(map(_DTYPE, held))
        self._shapes = list(map(_SHAPE, held))

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """``tensors`` are the captured ones, unchanged."""
        return same_objects(tensors, self._held) and self.unchanged()

    def unchanged(self) -> bool:
        """The captured tensors still have the dtype, address and shape they had."""
        held = self._held
        return (
            list(map(torch.Tensor.data_ptr, held)) == self._ptrs
            and list(map(_DTYPE, held)) == self._dtypes
            and list(map(_SHAPE, held)) == self._shapes
        )


class ModuleWatch:
    """Whether a module tree still holds what it held when watched: each module's param and submodule dicts
    (a param or submodule replaced, added or removed) and a :class:`TensorGuard` over its params. Built once;
    :meth:`holds` walks no generator (``Module.parameters()`` costs ~10 µs per param through
    ``named_modules``)."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        mods = list(dict.fromkeys(m for c in modules for m in c.modules()))
        self._params = [m._parameters for m in mods]
        self._subs = [m._modules for m in mods]
        self._slots = self._param_slots()  # registered params, None included: held for identity
        self._held_subs = self._sub_slots()
        self._guard = TensorGuard(p for p in self._slots if p is not None)

    def _param_slots(self) -> list[Any]:
        return list(itertools.chain.from_iterable(map(dict.values, self._params)))

    def _sub_slots(self) -> list[Any]:
        return list(itertools.chain.from_iterable(map(dict.values, self._subs)))

    def params(self) -> list[torch.nn.Parameter]:
        """Every param the modules hold now, in module order."""
        return [p for p in self._param_slots() if p is not None]

    def holds(self) -> bool:
        if not (same_objects(self._param_slots(), self._slots) and same_objects(self._sub_slots(), self._held_subs)):
            return False
        return self._guard.unchanged()  # the same param objects (just checked): their structure


class StateIndex:
    """The state dicts of ``keys`` in an optimizer's ``state``, looked up by position.

    :meth:`lookup` reads ``state.values()`` at the positions the keys had the last time, while ``state``
    iterates over the same key objects in the same order (a step that adds a param's first state changes
    that); otherwise one ``state.get`` per key, and the positions are taken anew. A key without state gives
    ``default``, as ``state.get`` does. Holding the key objects holds no state: a ``state`` replaced by
    ``load_state_dict`` is not kept alive."""

    __slots__ = ("_order", "_positions")

    def __init__(self) -> None:
        self._order: list[object] = []  # the keys of ``state`` last seen, held
        self._positions: list[int] = []

    def lookup(self, state: Mapping[Any, Any], keys: Sequence[object], default: Any = None) -> list[Any]:
        """``[state.get(k, default) for k in keys]``; one index serves one ``keys`` list."""
        if self._order and same_objects(list(state), self._order):
            values: list[Any] = list(state.values())
            values.append(default)
            return list(map(values.__getitem__, self._positions))
        found = list(map(state.get, keys, itertools.repeat(default)))
        self._order = list(state)
        where = {id(k): i for i, k in enumerate(self._order)}
        missing = len(self._order)
        self._positions = [where.get(id(k), missing) for k in keys]
        return found
