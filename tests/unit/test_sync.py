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


async def _to_thread_names() -> list[str]:
    return list(await asyncio.gather(*(asyncio.to_thread(lambda: threading.current_thread().name) for _ in range(4))))


def test_to_thread_runs_on_the_shared_pool_and_no_call_starts_or_joins_threads() -> None:
    """What a library runs with ``asyncio.to_thread`` inside ``run_sync`` (fsspec's local filesystem) runs on
    the process's shared pool: after the first call, later calls start no thread (``asyncio.run`` would
    start its own executor's threads each call, and one more to join them), and the pool outlives every
    loop."""
    from ckptd.writer.fanout import POOL_THREADS, shared_pool

    assert all(name.startswith("ckptd-io") for name in run_sync(_to_thread_names()))
    everyone = threading.Barrier(POOL_THREADS)  # the pool grown to its bound: it starts no thread after
    for f in [shared_pool().submit(everyone.wait, 10) for _ in range(POOL_THREADS)]:
        f.result()
    started = []
    real_start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    pool = shared_pool()
    threading.Thread.start = counted  # type: ignore[method-assign]
    try:
        for _ in range(3):
            assert all(name.startswith("ckptd-io") for name in run_sync(_to_thread_names()))
            with pytest.raises(FileNotFoundError, match="unchanged"):
                run_sync(_fail())
    finally:
        threading.Thread.start = real_start  # type: ignore[method-assign]
    assert started == [] and shared_pool() is pool
    assert pool.submit(lambda: 7).result() == 7  # not shut down by any loop's close


def test_an_interrupted_caller_inside_a_running_loop_cancels_the_coroutine_and_waits_for_it() -> None:
    """Ctrl-C while the caller waits for the worker thread: the coroutine is cancelled there and its cleanup
    (a load's last collective, say) ends before the interrupt reaches the caller, which then never runs
    beside it."""
    import os
    import signal

    ended: list[str] = []

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # cleanup that still takes a moment
            ended.append("cleaned up")
            raise

    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))

    async def caller() -> list[str]:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            run_sync(work())  # the caller's thread blocks here, in a running loop
        return list(ended)

    # Ctrl-C as Python's own handler delivers it (a test runner's worker may have set SIGINT aside), and a
    # loop whose run_until_complete installs no handler of its own: the interrupt lands in the caller's wait
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(caller()) == ["cleaned up"]
    finally:
        loop.close()
        timer.cancel()  # (had run_sync returned early, no interrupt may come after the handler is back)
        timer.join()
        signal.signal(signal.SIGINT, before)
