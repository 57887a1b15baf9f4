"""What the commit protocol does when storage answers ambiguously or another coordinator is late: a marker
write whose answer was lost but whose bytes landed is a commit; a coordinator that finds the step committed
while it waited for parts rewrites none of its metadata; a step whose marker survived its delete is left
whole, not emptied under a marker that still says committed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from ckptd.writer import format as fmt
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import StepCommittedError, StorageError


def _part(step: int, node: int, num_nodes: int = 1, attempt: str = "") -> fmt.PartManifest:
    return fmt.PartManifest(format=fmt.FORMAT_VERSION, step=step, node=node, num_nodes=num_nodes, world_size=num_nodes,
                            ranks=[node], arrays=[], objects={}, nbytes=0, written_at=0.0, attempt=attempt)


def test_a_marker_whose_answer_was_lost_but_landed_is_a_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            real = backend.create

            async def landed_then_lost(key: str, data: bytes) -> bool:
                await real(key, data)
                raise StorageError(f"{key}: read timeout (every retry)")

            await w.write_part(_part(1, 0))
            monkeypatch.setattr(backend, "create", landed_then_lost)
            assert (await w.commit(1, 1, timeout=1.0)).step == 1
            assert await w.is_committed(1) and await w.latest() == 1

            async def lost(key: str, data: bytes) -> bool:  # this time it did not land
                raise StorageError(f"{key}: read timeout (every retry)")

            await w.write_part(_part(2, 0))
            monkeypatch.setattr(backend, "create", lost)
            with pytest.raises(StorageError, match="read timeout"):
                await w.commit(2, 1, timeout=1.0)
            assert not await w.is_committed(2)

    asyncio.run(go())


def test_a_coordinator_that_finds_the_step_committed_while_it_waited_rewrites_nothing(tmp_path: Path) -> None:
    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            await w.write_part(_part(3, 0, num_nodes=2))
            late = asyncio.create_task(w.commit(3, 2, timeout=5.0))  # waits for node 1's part
            await asyncio.sleep(0.2)
            await backend.put(f"{fmt.step_dir(3)}/zarr.json", b"the winner's")
            assert await backend.create(fmt.commit_marker(3), b"{}")  # another coordinator committed it
            await w.write_part(_part(3, 1, num_nodes=2))
            with pytest.raises(StepCommittedError, match="committed by another coordinator"):
                await late
            assert await backend.get(f"{fmt.step_dir(3)}/zarr.json") == b"the winner's"

    asyncio.run(go())


def test_a_marker_that_survives_its_delete_leaves_the_step_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            await backend.put(f"{fmt.step_dir(4)}/x/c.0", b"chunk")
            await w.write_part(_part(4, 0))
            await w.commit(4, 1, timeout=1.0)
            real = backend.delete

            async def keeps_markers(key: str) -> None:  # a store that answers the delete and keeps the object
                if not key.endswith(fmt.COMMIT_MARKER):
                    await real(key)

            monkeypatch.setattr(backend, "delete", keeps_markers)
            with pytest.raises(StorageError, match="still there after its delete"):
                await w.delete_step(4)
            assert await w.is_committed(4) and await backend.get(f"{fmt.step_dir(4)}/x/c.0") == b"chunk"

    asyncio.run(go())


def test_a_deletion_cut_short_leaves_a_step_zarr_does_not_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The markers go first, then the step's ``zarr.json``: a deletion stopped before the chunks (a daemon killed
    mid-rmtree) leaves a step that is neither committed nor listed as a group, never one zarr reads as zeros."""
    import zarr

    root = tmp_path / "root"

    async def go() -> None:
        async with await open_backend(str(root), None, create=True) as backend:
            w = CheckpointWriter(backend)
            for step in (5, 6):
                await w.write_part(_part(step, 0))
                await w.commit(step, 1, timeout=1.0)

            async def killed(prefix: str) -> None:
                raise StorageError(f"{prefix}: the daemon was killed here")

            monkeypatch.setattr(backend, "delete_prefix", killed)
            with pytest.raises(StorageError, match="killed here"):
                await w.delete_step(5)
            assert not await w.is_committed(5) and await w.is_committed(6)

    asyncio.run(go())
    with pytest.warns(UserWarning, match="step_5 is not recognized"):  # what zarr says of a folder without one
        assert sorted(name for name, _ in zarr.open_group(str(root), mode="r").groups()) == ["step_6"]
    assert (root / "step_5").is_dir()  # the rest is left for the next retention


def test_latest_moves_back_past_a_deleted_step(tmp_path: Path) -> None:
    """A rollback deletes step 20 and training resumes from 10: the next commit (11) is the newest committed
    step, and the ``latest`` hint says so instead of naming the deleted 20 for good."""

    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            for step in (10, 20):
                await w.write_part(_part(step, 0))
                await w.commit(step, 1, timeout=1.0)
            await w.delete_step(20)
            assert await w.latest_hint() == 20 and await w.latest() == 10  # the markers decide meanwhile
            await w.write_part(_part(11, 0))
            await w.commit(11, 1, timeout=1.0)
            assert await w.latest_hint() == 11 and await w.latest() == 11
            for step in (15, 30):  # a step between: a late commit of an older step after a rollback names it
                await w.write_part(_part(step, 0))
                await w.commit(step, 1, timeout=1.0)
            await w.delete_step(30)
            await w.write_part(_part(12, 0))
            await w.commit(12, 1, timeout=1.0)
            assert await w.latest_hint() == 15 and await w.latest() == 15

    asyncio.run(go())


def test_two_commits_at_once_leave_latest_on_the_newer_step(tmp_path: Path) -> None:
    """Steps commit out of order and at once in one coordinator: step 11's ``latest`` update reads the hint
    (10) and is slow to replace it while step 12 commits. The updates take turns, so the hint ends on 12,
    not on 11 replaced last."""

    async def go() -> int | None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            await w.write_part(_part(10, 0))
            await w.commit(10, 1, timeout=1.0)
            real, delays = w.latest_hint, [0.2, 0.0]

            async def slow_first_read() -> int | None:
                value = await real()
                await asyncio.sleep(delays.pop(0))  # the first reader holds a stale value a while
                return value

            w.latest_hint = slow_first_read  # type: ignore[method-assign]
            await asyncio.gather(w.write_marker(11, b"{}"), w.write_marker(12, b"{}"))
            return await real()

    assert asyncio.run(go()) == 12


def test_a_step_deleted_while_it_was_saved_again_is_not_committed(tmp_path: Path) -> None:
    """After a rollback an old step number is saved again while retention deletes the old one: the delete
    may remove the new save's files, so the coordinator refuses to commit it (the save fails and can be made
    again) instead of committing a manifest whose chunks are gone. A delete that ended before the new save
    began (less the clock slack) refuses nothing; nor does another step's."""
    import time as clock

    from ckptd.writer.commit import CLOCK_SKEW_S
    from ckptd.writer.errors import StepFailedError

    def part(step: int, started_at: float) -> fmt.PartManifest:
        return msgspec.structs.replace(_part(step, 0), started_at=started_at)

    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            await w.write_part(part(15, clock.time()))  # the new save began, then the old 15 was deleted
            await w.delete_step(15)
            await w.write_part(part(15, clock.time() - 60))
            with pytest.raises(StepFailedError, match="was being deleted"):
                await w.commit(15, 1, timeout=1.0)
            assert not await w.is_committed(15)
            await w.write_part(part(15, clock.time() + CLOCK_SKEW_S + 1))  # saved again after the delete
            await w.commit(15, 1, timeout=1.0)
            await w.write_part(part(16, 0.0))  # another step (an older daemon's part: no start time)
            await w.commit(16, 1, timeout=1.0)
            # a commit while the delete is still under way is refused too
            gate, real = asyncio.Event(), backend.delete_prefix

            async def held(prefix: str) -> None:
                await gate.wait()
                await real(prefix)

            backend.delete_prefix = held  # type: ignore[method-assign]
            await w.write_part(part(20, clock.time() + CLOCK_SKEW_S + 1))  # whatever the clocks say
            deleting = asyncio.create_task(w.delete_step(20))  # held before it removes the files
            await asyncio.sleep(0.05)
            with pytest.raises(StepFailedError, match="was being deleted"):
                await w.commit(20, 1, timeout=1.0)
            gate.set()
            await deleting

    asyncio.run(go())


def test_a_commit_waits_out_every_delete_of_its_step_under_way(tmp_path: Path) -> None:
    """Two commits' retentions at once (steps commit out of order) delete the same old unfinished step 20; the
    second ends first. A save of 20 begun after that end (and the slack) is still refused while the first
    delete runs: it may yet remove the new files."""
    import time as clock

    from ckptd.writer.commit import CLOCK_SKEW_S
    from ckptd.writer.errors import StepFailedError

    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            for step in (10, 30, 31):
                await w.write_part(_part(step, 0))
                await w.commit(step, 1, timeout=1.0)
            await w.write_part(_part(20, 0))  # a rollback's leftover, unfinished
            gate, real, calls = asyncio.Event(), backend.delete_prefix, []

            async def first_held(prefix: str) -> None:
                calls.append(prefix)
                if len(calls) == 1:  # the first retention's delete is slow (many objects)
                    await gate.wait()
                await real(prefix)

            backend.delete_prefix = first_held  # type: ignore[method-assign]
            slow = asyncio.create_task(w.retain(5))
            await asyncio.sleep(0.05)
            assert await w.retain(5) == [20]  # the second retention deletes 20 too, and ends first
            part = msgspec.structs.replace(_part(20, 0), started_at=clock.time() + CLOCK_SKEW_S + 1)
            await w.write_part(part)
            with pytest.raises(StepFailedError, match="was being deleted"):
                await w.commit(20, 1, timeout=1.0)
            gate.set()
            assert await slow == [20]

    asyncio.run(go())
