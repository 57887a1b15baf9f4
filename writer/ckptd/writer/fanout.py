"""Bounded fan-out: run one coroutine per item, a fixed number at a time; the first failure cancels the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

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
