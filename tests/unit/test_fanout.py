"""The bounded fan-out and the process-wide worker pool the read path runs on."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from ckptd.writer.fanout import POOL_THREADS, bounded_map, in_thread


def _thread() -> int:
    return threading.get_ident()


def test_pool_threads_outlive_one_event_loop() -> None:
    """Each synchronous load runs its own loop; the pool's threads outlive it (none is started and joined
    per load), and the process never has more than POOL_THREADS of them."""

    async def idents() -> set[int]:
        return set(await asyncio.gather(*(in_thread(_thread) for _ in range(64))))

    first = asyncio.run(idents())
    alive = {t.ident for t in threading.enumerate()}
    assert first <= alive  # its loop has ended; a loop's default pool would have joined them
    second = asyncio.run(idents())
    pool = {t.ident for t in threading.enumerate() if t.name.startswith("ckptd-io")}
    assert first | second <= pool and len(pool) <= POOL_THREADS
    assert threading.get_ident() not in first


def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    """A child forked after the parent's pool started has none of its threads: its reads must not wait on
    them forever."""
    asyncio.run(in_thread(_thread))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one read through the pool, its answer down the pipe
        try:
            os.write(w, str(asyncio.run(asyncio.wait_for(in_thread(lambda: 41 + 1), 10))).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as fh:
            assert fh.read() == b"42"
    finally:
        os.waitpid(pid, 0)


def test_bounded_map_keeps_order_and_raises_the_first_error_itself() -> None:
    async def slow_square(x: int) -> int:
        await asyncio.sleep(0.001 * (5 - x % 5))
        if x == 7:
            raise KeyError(x)
        return x * x

    assert asyncio.run(bounded_map(slow_square, range(7), limit=3)) == [x * x for x in range(7)]
    with pytest.raises(KeyError):
        asyncio.run(bounded_map(slow_square, range(10), limit=3))


def test_a_cancelled_write_returns_once_its_thread_is_done_with_the_memory() -> None:
    """``in_thread_settled`` (the chunk writes out of the arena): a caller cancelled while its thread runs
    (a step's part timeout, shutdown) is cancelled only after the thread ended, so the arena slot it reads
    is not freed under it."""
    import time

    from ckptd.writer.fanout import in_thread_settled

    done = threading.Event()

    def write() -> int:
        time.sleep(0.3)
        done.set()
        return 1

    async def go() -> bool:
        task = asyncio.create_task(in_thread_settled(write))
        await asyncio.sleep(0.05)  # the thread runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return done.is_set()

    assert asyncio.run(go())
    assert asyncio.run(in_thread_settled(lambda: 7)) == 7
