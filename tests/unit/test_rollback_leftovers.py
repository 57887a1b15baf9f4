"""What a rollback leaves when something between its steps went wrong: a rollback cut short after its deletes
(the ``latest`` hint not yet written) is finished by running it again, hint included; a step's folder left
without files is as old as the folder, not forever new; and a rank whose daemon is gone reads the
coordinator's failure note with the same slack for the nodes' clocks as a live daemon."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from ckptd.client.reader import stored_fate
from ckptd.testing.fixtures import commit_one_node
from ckptd.writer import format as fmt
from ckptd.writer.commit import CLOCK_SKEW_S, CheckpointWriter
from ckptd.writer.root import open_root


def test_a_rollback_cut_short_before_its_hint_is_finished_by_running_it_again(tmp_path: Path) -> None:
    async def go() -> None:
        async with open_root(str(tmp_path / "root"), None, create=True) as ckpt:
            w = CheckpointWriter(ckpt.backend)
            for step in (1, 2, 3):
                await commit_one_node(w, step, [])
            assert await w.latest_hint() == 3
            for step in (3, 2):  # the first `gc --after 1`: its deletes, then it was stopped
                await w.delete_step(step)
            assert await w.latest_hint() == 3  # names a step that is gone
            assert await w.drop_after(1) == []  # run again: nothing left to delete...
            assert await w.latest_hint() == 1  # ...and the hint set right
            await w.backend.delete(fmt.latest_key())
            assert await w.drop_after(1) == [] and await w.latest_hint() == 1  # a hint gone is written again

    asyncio.run(go())


def test_a_step_folder_without_files_is_as_old_as_the_folder(tmp_path: Path) -> None:
    async def go() -> None:
        async with open_root(str(tmp_path / "root"), None, create=True) as ckpt:
            w = CheckpointWriter(ckpt.backend)
            await commit_one_node(w, 1, [])
            folder = tmp_path / "root" / fmt.step_dir(2)
            folder.mkdir()  # a save of step 2 began here and wrote nothing
            assert await w.written_lately(60, after=1) == [2]  # just made: maybe still being written
            old = time.time() - 3600
            os.utime(folder, (old, old))
            assert await w.written_lately(60, after=1) == []  # an hour old: gc --after may remove it
            assert await w.drop_after(1) == [2] and not folder.exists()

    asyncio.run(go())


def test_a_failure_note_from_a_coordinator_whose_clock_is_behind_is_read(tmp_path: Path) -> None:
    """An unnamed attempt's note counts from the save's start; the coordinator's clock may be behind the
    rank's by up to ``CLOCK_SKEW_S``, as a live daemon's wait allows."""
    root = str(tmp_path / "root")
    since = time.time()

    async def go() -> None:
        async with open_root(root, None, create=True) as ckpt:
            w = CheckpointWriter(ckpt.backend)
            await w.write_part(fmt.PartManifest(fmt.FORMAT_VERSION, 7, 1, 2, 2, [1], [], {}, 0, since))
            note = {"step": 7, "code": "StorageFullError", "message": "disk full on node 0", "attempt": "",
                    "at": since - CLOCK_SKEW_S / 2}  # the coordinator's clock behind the rank's
            await w.backend.put(fmt.failed_marker(7), fmt.encode_json(note))

    asyncio.run(go())
    fate, note = stored_fate(root, 7, 1, "", since)
    assert fate == "failed" and note is not None and note["code"] == "StorageFullError"
    assert stored_fate(root, 7, 1, "", since + 2 * CLOCK_SKEW_S) == ("part", None)  # an earlier attempt's note
