"""Python's cyclic garbage collector held off while a save or a load runs.

A trainer's process holds millions of Python objects: a Megatron model's modules, params and their
attributes, the optimizer's state dicts, the data loader. Planning a save (or a load) allocates tens of
thousands of small objects; every 700 net allocations start a young-generation collection, and after a
hundred of those, once enough objects have outlived them, the oldest-generation pass walks every tracked
object in the process, the model's included. Such a full pass, started at a random point of a save, is paid
by the rank that hit it and so by the whole job. Measured on the toy GPT
(2 ranks, ``benchmarks/bench_stall_scale.py``'s sizes): the first save of 96 layers (1,352 shards a rank)
took 0.71 s with the collector on and 0.24 s with it held off (docs/benchmarks-log.md).

:func:`collector_paused` disables the collector for the length of the call and enables it again after, if
it was enabled when the outermost paused call began (nested and concurrent calls count, so the last one
to leave restores it). Reference counting still frees every object that is not in a cycle at once; cycles
made during the call wait for the first collection after it.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

_lock = threading.Lock()
_depth = 0  # paused calls running now, in any thread
_was_enabled = False  # the collector's state when the outermost of them began


@contextmanager
def collector_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector inside the block (see the module docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run under :func:`collector_paused`."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with collector_paused():
            return fn(*args, **kwargs)

    return run
