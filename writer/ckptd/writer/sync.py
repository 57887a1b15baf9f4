"""The one bridge from synchronous callers to ckptd's async readers.

Every synchronous read entry point (``load``, ``read_commit``, the Megatron loader...) runs its async core
through :func:`run_sync`. Without a running event loop in the calling thread that is ``asyncio.run``.
Inside one (a notebook, an async server that calls a sync API) a second loop cannot run on the same
thread, so the coroutine runs on a private loop in a short-lived worker thread while the caller blocks —
as a synchronous call does anyway. Storage clients are opened and closed inside the coroutine, so they
always belong to the loop that runs them. Nothing starts at import.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion and return its result (or raise its exception) from sync code."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    return _run_in_thread(coro)


def _run_in_thread(coro: Coroutine[Any, Any, T]) -> T:
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(asyncio.run(coro))
        except BaseException as exc:  # handed to the caller's thread below
            failure.append(exc)

    thread = threading.Thread(target=target, name="ckptd-sync", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
