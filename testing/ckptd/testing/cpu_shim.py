"""Run megatron-core on CPU with gloo: a shim for tests and demos only.

megatron-core assumes CUDA everywhere (``torch.cuda.current_device()``, ``device='cuda'``, stream
syncs, CUDA RNG trackers, ``param.type() == 'torch.cuda.FloatTensor'`` checks in the optimizer).
:func:`install_cpu_shim` patches exactly those spots so a small ``GPTModel`` with
``DistributedDataParallel(use_distributed_optimizer=True)`` and ``DistributedOptimizer`` trains on a
CPU-only torch build. The ckptd library never imports this module; a process that installs the shim
cannot use a real GPU afterwards.

What it does (all idempotent; the second call is a no-op):

- ``torch.cuda.current_device`` returns 0; ``synchronize``, ``empty_cache``, ``set_device`` and the
  memory queries are no-ops; ``torch.cuda.Stream`` and ``torch.cuda.Event`` stay *classes* (Megatron
  subclasses and ``isinstance``-checks them) whose methods do nothing; ``torch.cuda.stream(s)`` is a
  null context.
- A process-wide :class:`~torch.overrides.TorchFunctionMode` maps ``device='cuda'``/``'cuda:N'``/``N``
  to CPU in every call, makes ``Tensor.cuda()`` and ``Tensor.record_stream()`` identities, drops
  ``pin_memory=True``, and makes ``Tensor.type()`` (no arguments) report ``torch.cuda.*Tensor`` so the
  distributed optimizer's dtype checks pass. The mode is pushed on the calling thread's mode stack
  (torch keeps that stack per thread): install the shim in the thread that trains.
- ``CudaRNGStatesTracker.add`` only records the name and ``fork`` is a null context: with
  ``use_cpu_initialization=True`` weights come from the CPU generator seeded by
  ``torch.manual_seed``, and the toy models run with dropout 0.

Adam's per-parameter ``step``: the shim does **not** touch it. Without TE/Apex, megatron-core falls back
to ``torch.optim.AdamW``, which keeps ``state[p]['step']`` as one scalar tensor per parameter;
Megatron's own ``load_state_dict`` then raises ``KeyError: 'step'`` on param groups and, on the
dp_reshardable path, installs one shared step tensor for every parameter. ckptd never goes through
those paths: :mod:`ckptd.client.megatron` saves scalar per-parameter state (``step``) as plain data and
restores one fresh tensor per parameter, so it behaves the same with torch Adam on CPU and with fused
optimizers on GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install_cpu_shim", "is_installed", "suspended"]

_lock = threading.Lock()
_installed = False
_mode: _CudaToCpuMode | None = None

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def _is_cuda_device(dev: object) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    # a bare int device index means a CUDA device
    return isinstance(dev, int) and not isinstance(dev, bool)


def _cpu_if_cuda(dev: object) -> object:
    return torch.device("cpu") if _is_cuda_device(dev) else dev


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made while it is active."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not kwargs and func not in _SPECIAL:  # the common case: nothing to rewrite, pass it through
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], torch.device("cpu"), *args[2:])
            return func(*args)
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.record_stream:
            return args[0] if func is torch.Tensor.cuda else None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


_SPECIAL = frozenset({torch.Tensor.cuda, torch.Tensor.record_stream, torch.Tensor.type})


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Take the shim's mode off this thread's stack for a block that needs no rewriting (a ckptd save on
    CPU), so its torch calls cost what they cost without the shim; a no-op when the shim is not installed."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if _mode is None or _get_current_function_mode() is not _mode:  # type: ignore[no-untyped-call]
        yield
        return
    with _pop_mode_temporarily():
        yield


class _Stream:
    """Stand-in for ``torch.cuda.Stream``: a class, so ``isinstance`` and subclassing keep working."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Event:
    """Stand-in for ``torch.cuda.Event``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_DEFAULT_STREAM = _Stream()


@contextlib.contextmanager
def _null_stream_ctx(stream: Any = None) -> Iterator[None]:
    yield


def _patch_torch_cuda() -> None:
    # Every patched name gets its own function object: torch._dynamo indexes torch.cuda's functions
    # by identity and rejects one object registered under two names.
    cuda = torch.cuda

    def current_device() -> int:
        return 0

    def synchronize(device: Any = None) -> None:
        return None

    def empty_cache() -> None:
        return None

    def set_device(device: Any) -> None:
        return None

    def current_stream(device: Any = None) -> _Stream:
        return _DEFAULT_STREAM

    def default_stream(device: Any = None) -> _Stream:
        return _DEFAULT_STREAM

    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    patches: dict[str, Any] = {
        "current_device": current_device,
        "synchronize": synchronize,
        "empty_cache": empty_cache,
        "set_device": set_device,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "stream": _null_stream_ctx,
        "reset_peak_memory_stats": reset_peak_memory_stats,
    }
    for name, value in patches.items():
        setattr(cuda, name, value)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, _zero_fn(name))


def _zero_fn(name: str) -> Callable[..., int]:
    def zero(device: Any = None) -> int:
        return 0

    zero.__name__ = name
    return zero


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def add(self: Any, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = None
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self: Any, name: str = "model-parallel-rng") -> Iterator[None]:
        yield

    setattr(mrandom.CudaRNGStatesTracker, "add", add)  # noqa: B010 - patching a class on purpose
    setattr(mrandom.CudaRNGStatesTracker, "fork", fork)  # noqa: B010


def _patch_backward() -> None:
    """Custom autograd functions' ``backward`` runs without the thread's function modes (the engine does not
    carry them over), yet megatron allocates there too (``device=torch.cuda.current_device()`` in the
    all-gather of the MoE token dispatcher's backward): run each ``backward`` under the shim's mode."""
    from torch.autograd.function import BackwardCFunction
    from torch.overrides import _get_current_function_mode_stack

    original: Any = BackwardCFunction.apply

    def apply(self: Any, *args: Any) -> Any:
        if _mode is None or _mode in _get_current_function_mode_stack():  # type: ignore[no-untyped-call]
            return original(self, *args)
        with _mode:
            return original(self, *args)

    BackwardCFunction.apply = apply  # type: ignore[method-assign]


def install_cpu_shim() -> None:
    """Make megatron-core run on CPU in this process (and this thread). Idempotent."""
    global _installed, _mode
    with _lock:
        if _installed:
            return
        _patch_torch_cuda()
        _patch_megatron_rng()
        _patch_backward()
        _mode = _CudaToCpuMode()
        _mode.__enter__()  # type: ignore[no-untyped-call]  # stays pushed for the thread's life
        _installed = True


def is_installed() -> bool:
    return _installed
