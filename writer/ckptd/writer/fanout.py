"""Bounded fan-out: run one coroutine per item, a fixed number at a time; the first failure cancels the rest."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


async def bounded_map(fn: Callable[[T], Awaitable[R]], items: Iterable[T], *, limit: int) -> list[R]:
    """``[await fn(x) for x in items]`` with at most ``limit`` calls in flight, results in input order.

    ``limit`` workers pull from the items (no task per item is created up front). The first failure
    cancels the calls still running and is raised as itself (not wrapped in an exception group), so
    callers see the typed error they would see from a sequential loop.
    """
    todo = list(enumerate(items))
    results: dict[int, R] = {}
    queue = iter(todo)

    async def worker() -> None:
        for i, item in queue:
            results[i] = await fn(item)

    error: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(min(max(1, limit), len(todo))):
                tg.create_task(worker())
    except BaseExceptionGroup as group:
        error = first_error(group)
    if error is not None:
        raise error  # outside the handler: keeps the error's own cause chain, no group as context
    return [results[i] for i in range(len(todo))]


def first_error(exc: BaseException) -> BaseException:
    """The first real exception inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


#: worker threads of the process-wide pool :func:`in_thread` runs on
POOL_THREADS = 8
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: none of the parent's threads exist there (nor can its lock be held by one)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def shared_pool() -> ThreadPoolExecutor:
    """The process's pool of :data:`POOL_THREADS` worker threads, made on first use and kept for the
    process's life (idle threads cost nothing; they end with the interpreter)."""
    global _pool
    pool = _pool
    if pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="ckptd-io")
            pool = _pool
    return pool


async def in_thread(fn: Callable[..., R], /, *args: object) -> R:
    """``await asyncio.to_thread(fn, *args)`` on :func:`shared_pool`. A synchronous load runs its own event
    loop (:func:`~ckptd.writer.sync.run_sync`), whose own default pool would start its threads on the load's
    first reads and join them at its end: milliseconds of every load on a busy host."""
    return await asyncio.get_running_loop().run_in_executor(shared_pool(), functools.partial(fn, *args))


async def in_thread_settled(fn: Callable[..., R], /, *args: object, pool: Executor | None = None) -> R:
    """``fn(*args)`` in a thread (of ``pool``, else the loop's default executor) for a call that touches
    memory its caller frees or reports on once it returns (an arena slot; a load's tensors): a running thread
    cannot be stopped, so a cancelled caller still waits for it to end before its cancellation goes on (a
    failed ``bounded_map`` then raises once no such thread runs)."""
    future = asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])  # the thread is done with the memory; then the cancellation goes on
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller gets
        raise


class SharedExecutor(ThreadPoolExecutor):
    """An event loop's default executor that hands every call to :func:`shared_pool` and is never shut down
    by the loop: what a library runs with ``asyncio.to_thread`` (fsspec's wrapper of the local filesystem)
    then starts no threads of its own in each short-lived loop of :func:`~ckptd.writer.sync.run_sync`."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)  # never used: no thread of its own is ever started

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        return shared_pool().submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to do: the shared pool outlives every loop."""
