"""Cheap per-save checks that what a save plan was made for is still there, and lookups that reuse their order.

A reused plan copies from views of live memory and from tensors looked up in an optimizer's ``state``; both are
correct only while the tensors are the ones planned. These checks run at every save, so each is a few ``map``s
over C callables across all tensors (no Python call per tensor, no ``torch.Size`` built):

- :class:`TensorGuard`: a list of tensors is still the same objects, each with the same dtype, address,
  shape and strides. A param whose ``.data`` was replaced, cast, reshaped, transposed or resized, or
  ``set_`` to other memory, fails it;
- :class:`ShapeGuard`: a list of tensors, whatever objects they are, still has the same dtypes, shapes and
  devices (a plain save's state dict, :mod:`ckptd.client.skeleton`);
- :class:`ModuleWatch`: a module tree still holds the same submodules and params (one held list each, compared
  by identity), and the params pass a :class:`TensorGuard`;
- :class:`StateIndex`: an optimizer's per-param state dicts for a list of params, read positionally from
  ``state.values()`` while ``state`` holds the same keys in the same order (``Tensor.__hash__`` is a Python
  call: one ``state.get`` per param costs ~0.5 µs, this ~0.05 µs).

Identity is compared against held objects, never against ids alone: a held object cannot be freed, so no
new object can take its id.

Two of torch's own guard primitives (the ones ``torch.compile`` checks its graphs with) make the common
case cheaper where they are there and pass a self-test at import; without them the checks above run as
described:

- ``dict_version``: a dict's version tag, which CPython changes at every write to it. A module's param and
  submodule dicts whose tags are all as last seen were not written to, so their values are not walked
  (in a trained process ~250 ns a dict instead of ~375 ns for the walk; 11,910 modules, two dicts each,
  in the deepest ``stall_scale`` model). A changed tag walks them as above: a write that left the same
  objects in place is not a change;
- ``TensorGuards``: dtype, device, shape and strides of a list of tensors in one C++ loop, instead of one
  ``map`` each building a ``torch.Size`` or a tuple per tensor. It also compares what does not matter
  here (``requires_grad``; the dispatch keys, which a ``TorchDispatchMode`` active at one save and not
  at planning changes); when it fails, the ``map``s decide, and where they find no change it is built
  anew, so a difference that stays costs one slow check, not one a save.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")


def _probe_dict_version() -> Callable[[dict[Any, Any]], int] | None:
    """torch's ``dict_version`` when it tells a write to a dict (a value replaced, a key added or removed)."""
    try:
        from torch._C._dynamo.guards import dict_version
    except ImportError:
        return None
    probe: dict[str, object] = {"a": object()}
    try:
        seen = [dict_version(probe)]
        probe["a"] = object()
        seen.append(dict_version(probe))
        probe["b"] = None
        seen.append(dict_version(probe))
        del probe["a"]
        seen.append(dict_version(probe))
    except Exception:  # any failure of a private primitive: the plain walk serves
        return None
    return dict_version if len(set(seen)) == len(seen) else None


_DICT_VERSION = _probe_dict_version()


def _over(make: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """A ``TensorGuards`` (``make``) over ``tensors`` as they are now: their shapes and strides, all static."""
    return make(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                dynamic_dims_strides=[list(t.stride()) for t in tensors])


def _probe_tensor_guards() -> Any | None:
    """torch's ``TensorGuards`` class when it takes a list of tensors the way this module calls it, passes
    them unchanged and fails them cast or reshaped."""
    try:
        from torch._C._dynamo import guards

        make: Any = guards.TensorGuards  # its stub says keywords only; it takes the tensors first
        a, b = torch.zeros(2, 3), torch.zeros(4)
        guard = _over(make, [a, b])
        works = guard.check(a, b) and not guard.check(a.double(), b) and not guard.check(a.view(3, 2), b)
    except Exception:  # a private primitive whose signature moved: compare in Python
        return None
    return make if works else None


_TENSOR_GUARDS = _probe_tensor_guards()


def _shape_guard(tensors: Sequence[torch.Tensor]) -> Any | None:
    """A ``TensorGuards`` over ``tensors`` as they are now, when torch has one that works (and it passes
    them); None otherwise (the caller compares dtypes, shapes and strides itself)."""
    if _TENSOR_GUARDS is None:
        return None
    try:
        guard = _over(_TENSOR_GUARDS, tensors)
        return guard if guard.check(*tensors) else None
    except Exception:  # tensors it does not take (another subclass, a device it does not know)
        return None


def same_objects(now: Sequence[object], held: Sequence[object]) -> bool:
    """The same objects in the same order."""
    return len(now) == len(held) and all(map(operator.is_, now, held))


class ShapeGuard:
    """What a list of tensors looked like (by default each one's dtype, shape and device), whatever objects
    hold them: :meth:`matches` says whether a list still looks the same (a plain save's state dict may hand
    over new tensor objects at every save). torch's ``TensorGuards`` in one C++ pass where it works; it
    compares more (strides, ``requires_grad``, dispatch keys), and where it fails the ``map`` calls over
    ``getters`` decide (a difference that does not matter here is taken in, once: one slow check, not one a
    save). Holds no tensor."""

    __slots__ = ("_getters", "_seen", "_torch_guard")

    def __init__(
        self, tensors: Sequence[torch.Tensor], getters: tuple[Callable[[Any], Any], ...] = (_DTYPE, _SHAPE, _DEVICE)
    ) -> None:
        self._getters = getters
        self._torch_guard = _shape_guard(tensors)
        self._seen = [list(map(g, tensors)) for g in self._getters]

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        if len(tensors) != len(self._seen[0]):
            return False
        if self._torch_guard is not None and self._torch_guard.check(*tensors):
            return True
        same = all(list(map(g, tensors)) == seen for g, seen in zip(self._getters, self._seen, strict=True))
        if same and self._torch_guard is not None:
            self._torch_guard = _shape_guard(tensors)
        return same


class TensorGuard:
    """A list of tensors as captured: :meth:`holds` says whether a list is still them, unchanged in structure.

    Values may change (training updates them in place); the objects, their dtype, address, shape and
    strides may not (a ``.data`` replaced, cast, reshaped, transposed or resized; ``set_`` to other memory).
    One ``map`` of addresses and a :class:`ShapeGuard` of dtypes, shapes and strides (~0.7-1.2 µs a tensor
    in a trained model where torch's ``TensorGuards`` is missing or fails, most of it building each
    ``torch.Size`` and strides tuple; ``Tensor.is_set_to``, which compares the same in one call, measured
    slower there); and one identity pass. Holding the tensors keeps their memory alive until the guard is
    dropped, which a plan made for them does anyway."""

    __slots__ = ("_held", "_ptrs", "_shapes")

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        held = list(tensors)
        self._held = held
        self._ptrs = list(map(torch.Tensor.data_ptr, held))
        self._shapes = ShapeGuard(held, (_DTYPE, _SHAPE, torch.Tensor.stride))

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """``tensors`` are the captured ones, unchanged."""
        return same_objects(tensors, self._held) and self.unchanged()

    def unchanged(self) -> bool:
        """The captured tensors still have the dtype, address, shape and strides they had."""
        held = self._held
        return list(map(torch.Tensor.data_ptr, held)) == self._ptrs and self._shapes.matches(held)


class ModuleWatch:
    """Whether a module tree still holds what it held when watched: each module's param and submodule dicts
    (a param or submodule replaced, added or removed) and a :class:`TensorGuard` over its params. Built once;
    :meth:`holds` walks no generator (``Module.parameters()`` costs ~10 µs per param through
    ``named_modules``)."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        mods = list(dict.fromkeys(m for c in modules for m in c.modules()))
        self._params = [m._parameters for m in mods]
        self._subs = [m._modules for m in mods]
        self._dicts: list[dict[Any, Any]] = [*self._params, *self._subs]
        self._slots = self._param_slots()  # registered params, None included: held for identity
        self._held_subs = self._sub_slots()
        self._versions = self._dict_versions()
        self._guard = TensorGuard(p for p in self._slots if p is not None)

    def _dict_versions(self) -> list[int] | None:
        return None if _DICT_VERSION is None else list(map(_DICT_VERSION, self._dicts))

    def _param_slots(self) -> list[Any]:
        return list(itertools.chain.from_iterable(map(dict.values, self._params)))

    def _sub_slots(self) -> list[Any]:
        return list(itertools.chain.from_iterable(map(dict.values, self._subs)))

    def params(self) -> list[torch.nn.Parameter]:
        """Every param the modules hold now, in module order."""
        return [p for p in self._param_slots() if p is not None]

    def holds(self) -> bool:
        if self._versions is None or self._dict_versions() != self._versions:  # a dict written to: walk them
            if not (same_objects(self._param_slots(), self._slots)
                    and same_objects(self._sub_slots(), self._held_subs)):
                return False
            self._versions = self._dict_versions()  # the same objects: the writes changed nothing
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
