"""The sync bridge: ``asyncio.run`` semantics without a loop, a private loop in a worker thread inside one."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ckptd.writer.sync import run_sync


async def _where() -> tuple[int, int]:
    await asyncio.sleep(0)
    return threading.get_ident(), id(asyncio.get_running_loop())


async def _fail() -> None:
    await asyncio.sleep(0)
    raise FileNotFoundError("typed errors cross the bridge unchanged")


def test_without_a_running_loop_runs_in_this_thread() -> None:
    thread, _loop = run_sync(_where())
    assert thread == threading.get_ident()
    with pytest.raises(FileNotFoundError, match="unchanged"):
        run_sync(_fail())


async def test_inside_a_running_loop_uses_a_private_loop() -> None:
    outer = id(asyncio.get_running_loop())
    thread, loop = run_sync(_where())  # a sync API called from async code: must not raise "loop running"
    assert thread != threading.get_ident() and loop != outer
    with pytest.raises(FileNotFoundError, match="unchanged"):
        run_sync(_fail())
