"""Which committed step the daemon keeps for an in-memory restore: the newest by commit order, not the
largest step number. After a rollback (newer steps deleted, training resumed from an older one) the
resumed steps' commits replace the larger kept step; a step that was in flight while a larger one
committed (steps may commit out of order) does not replace it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ckptd.client.protocol import ShardMeta
from ckptd.daemon.arena import ALIGN, Arena
from ckptd.daemon.restore import Retention

META = ShardMeta("w", "uint8", [ALIGN], [0], [ALIGN], [ALIGN], 0)


async def _keep(kept: Retention, step: int) -> None:
    lease = await kept.arena.lease(1, [ALIGN], timeout=0)
    assert kept.keep(step, META, lease)


def _held(kept: Retention) -> dict[int, int]:
    """Shards each kept step would serve now (only the kept commit serves any)."""
    return {s: len(kept.reply(s).shards) for s in sorted(kept.kept)}


def test_after_a_rollback_the_resumed_steps_are_kept(tmp_path: Path) -> None:
    async def go() -> list[object]:
        arena = Arena(1 << 20, shm_dir=str(tmp_path), prefault=False)
        kept = Retention(arena)
        seen: list[object] = []
        try:
            for step in (10, 20):
                started = time.monotonic()
                await _keep(kept, step)
                kept.step_committed(step, started)
            seen += [kept.held, _held(kept)]
            for step in (11, 12):  # step 20 deleted from storage; training resumed from 10
                started = time.monotonic()
                await _keep(kept, step)
                kept.step_committed(step, started)
                seen += [kept.held, _held(kept)]
            started = time.monotonic()  # step 20 saved again
            kept.step_failed(20)  # what the service does when a job of a step starts
            await _keep(kept, 20)
            kept.step_committed(20, started)
            seen += [kept.held, _held(kept), arena.free_bytes == arena.size - ALIGN]
        finally:
            arena.close()
        return seen

    assert asyncio.run(go()) == [20, {20: 1}, 11, {11: 1}, 12, {12: 1}, 20, {20: 1}, True]


def test_a_step_that_lagged_behind_a_larger_commit_does_not_replace_it(tmp_path: Path) -> None:
    async def go() -> list[object]:
        arena = Arena(1 << 20, shm_dir=str(tmp_path), prefault=False)
        kept = Retention(arena)
        try:
            early = time.monotonic()  # step 5 starts, then step 6; 6 commits first
            await _keep(kept, 5)
            await _keep(kept, 6)
            kept.step_committed(6, time.monotonic())
            after_6 = [kept.held, _held(kept)]
            await _keep(kept, 5)  # 5's last shard written after 6 committed
            kept.step_committed(5, early)
            return [*after_6, kept.held, _held(kept), arena.free_bytes == arena.size - ALIGN]
        finally:
            arena.close()

    assert asyncio.run(go()) == [6, {6: 1}, 6, {6: 1}, True]


def test_a_kept_step_evicted_for_a_save_is_held_no_more(tmp_path: Path) -> None:
    async def go() -> tuple[int | None, int | None]:
        arena = Arena(1 << 20, shm_dir=str(tmp_path), prefault=False)
        kept = Retention(arena)
        try:
            await _keep(kept, 3)
            kept.step_committed(3)
            before = kept.held
            kept.evict()
            return before, kept.held
        finally:
            arena.close()

    assert asyncio.run(go()) == (3, None)
