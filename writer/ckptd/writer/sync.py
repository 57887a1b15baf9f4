"""The one bridge from synchronous callers to ckptd's async readers.

Every synchronous read entry point (``load``, ``read_commit``, the Megatron loader...) runs its async core
through :func:`run_sync`. Without a running event loop in the calling thread that is an ``asyncio.Runner``
(``asyncio.run``'s own) on a new loop whose default executor is the process's shared worker pool
(:class:`~ckptd.writer.fanout.SharedExecutor`). ``asyncio.run``'s loop would start threads for the first
``asyncio.to_thread`` calls of each run (fsspec's local filesystem makes one per object it reads) and one
more at its end to join them: ~0.5 ms a call on the idle 2-core machine, ~3.5 ms of a load there with both
ranks loading (py-spy; docs/benchmarks-log.md). Inside a running loop (a
notebook, an async server that calls a sync API) a second loop cannot run on the same thread, so the
coroutine runs on a private loop in a short-lived worker thread while the caller blocks — as a synchronous
call does anyway. Storage clients are opened and closed inside the coroutine, so they
always belong to the loop that runs them. Nothing starts at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ckptd.writer.fanout import SharedExecutor

T = TypeVar("T")


class _Loop(asyncio.SelectorEventLoop):
    """A loop whose default executor is the shared pool, so closing it joins no threads."""

    def __init__(self) -> None:
        super().__init__()
        self.set_default_executor(SharedExecutor())

    async def shutdown_default_executor(self, timeout: float | None = None) -> None:
        """Nothing to join: the shared pool outlives the loop (``asyncio.Runner`` calls this at close)."""


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` (the same cancellation, Ctrl-C and async-generator handling) on a :class:`_Loop`."""
    with asyncio.Runner(loop_factory=_Loop) as runner:
        return runner.run(coro)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion and return its result (or raise its exception) from sync code."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run(coro)
    return _run_in_thread(coro)


def _run_in_thread(coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` on a private loop in a worker thread. An interrupt of the waiting caller (Ctrl-C lands in its
    wait, unless the running loop's own SIGINT handler, as ``asyncio.run``'s, takes it first) cancels the
    coroutine there and waits for it to end, as ``asyncio.run`` does in one thread: a
    caller that goes on does not run beside the coroutine still at work (a load's collectives, its writes);
    a second interrupt stops that wait."""
    outcome: list[T] = []
    failure: list[BaseException] = []
    started: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[T]]] = []
    ready = threading.Event()

    async def tracked() -> T:
        task = asyncio.current_task()
        assert task is not None
        started.append((asyncio.get_running_loop(), task))
        ready.set()
        return await coro

    def target() -> None:
        try:
            outcome.append(_run(tracked()))
        except BaseException as exc:  # handed to the caller's thread below
            failure.append(exc)
        finally:
            ready.set()
            done.set()

    done = threading.Event()  # waited on, not the thread: an interrupted join() marks a live thread ended
    thread = threading.Thread(target=target, name="ckptd-sync", daemon=True)  # (CPython's bpo-45274 handling)
    try:
        thread.start()
        done.wait()
    except BaseException:
        if not thread.is_alive() and not done.is_set():  # interrupted before it started: nothing runs
            coro.close()
            raise
        ready.wait()
        for loop, task in started:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the coroutine ended
                loop.call_soon_threadsafe(task.cancel)
        done.wait()  # the coroutine's own end (a second interrupt stops this wait too)
        raise
    if failure:
        raise failure[0]
    return outcome[0]
