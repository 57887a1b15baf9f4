"""The daemon's step journal (daemon/journal.py): what a successor reads, and whose entry an end removes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ckptd.daemon.journal import JournalDoc, StepJournal, journal_path


def test_started_and_ended_mirror_the_steps_in_flight(tmp_path):
    j = StepJournal(journal_path(str(tmp_path / "d.sock")), "/ckpt")
    first = j.started(5, 0, 2)
    j.started(6, 0, 2)
    doc = json.loads((tmp_path / "d.sock.steps.json").read_text())
    assert doc["pid"] == os.getpid() and doc["root"] == "/ckpt" and [e["step"] for e in doc["steps"]] == [5, 6]
    retry = j.started(5, 0, 2)  # a failed step saved again: a new attempt with its own entry
    j.ended(first)  # the old attempt's end must not drop the new attempt
    assert [e["step"] for e in json.loads((tmp_path / "d.sock.steps.json").read_text())["steps"]] == [5, 6]
    j.ended(retry)
    j.remove()  # still one step in flight: the journal stays
    assert [e["step"] for e in json.loads((tmp_path / "d.sock.steps.json").read_text())["steps"]] == [6]


def test_a_successor_reads_only_a_dead_daemons_journal(tmp_path):
    path = journal_path(str(tmp_path / "d.sock"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    j = StepJournal(path, "/ckpt")
    j.started(3, 1, 2)
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    from ckptd.client.ownership import process_start_time

    parent = (os.getppid(), process_start_time(os.getppid()))
    # a running daemon's journal is its own; a live process of a dead daemon's pid is not that daemon
    for (pid, started), readable in (((dead_pid, 0), True), (parent, False), ((parent[0], 1), True)):
        doc["pid"], doc["started"] = pid, started
        with open(path, "w") as f:
            json.dump(doc, f)
        found = StepJournal(path, "/ckpt").read_predecessor()
        assert (found is not None) == readable
        if found is not None:
            assert isinstance(found, JournalDoc) and [(e.step, e.node) for e in found.steps] == [(3, 1)]
    with open(path, "w") as f:
        f.write("{not json")
    assert StepJournal(path, "/ckpt").read_predecessor() is None  # unreadable: ignored, with a warning


def test_a_part_of_another_attempt_does_not_spare_the_dead_daemons_step(tmp_path):
    """A non-coordinator's dead daemon leaves its step to the coordinator only when the part on storage is
    that attempt's own; a part left by an earlier attempt does not make it committable, so the step is
    abandoned at once (the other nodes stop waiting) instead of at --commit-timeout."""
    import asyncio

    from ckptd.daemon.journal import abandon_predecessor_steps
    from ckptd.writer import format as fmt
    from ckptd.writer.backends import open_backend
    from ckptd.writer.commit import CheckpointWriter

    path = journal_path(str(tmp_path / "d.sock"))
    root = str(tmp_path / "ckpt")

    def part(step: int, attempt: str) -> fmt.PartManifest:
        return fmt.PartManifest(format=fmt.FORMAT_VERSION, step=step, node=1, num_nodes=2, world_size=2, ranks=[1],
                                arrays=[], objects={}, nbytes=0, written_at=0.0, attempt=attempt)

    async def go() -> tuple[list[int], dict[int, str]]:
        async with await open_backend(root, None, create=True) as backend:
            w = CheckpointWriter(backend)
            await w.write_part(part(1, "A.1"))  # an earlier attempt's
            await w.write_part(part(2, "B.1"))  # this attempt's own: the coordinator may still commit it
            j = StepJournal(path, root)
            j.started(1, 1, 2, "B.1")
            j.started(2, 1, 2, "B.1")
            with open(path) as f:
                doc = json.load(f)
            doc["pid"], doc["started"] = dead_pid, 0
            with open(path, "w") as f:
                json.dump(doc, f)
            abandoned = await abandon_predecessor_steps(StepJournal(path, root), w)
            notes = {s: str((await w.read_failed(s, "B.1") or {}).get("message", "")) for s in (1, 2)}
            return abandoned, notes

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    abandoned, notes = asyncio.run(go())
    assert abandoned == [1], (abandoned, notes)
    assert "abandoned" in notes[1] and notes[2] == ""


def test_a_successor_given_another_spelling_of_the_root_abandons_the_steps(tmp_path):
    """``ckpt/`` then ``file://.../ckpt`` (an embedded relaunch passes the user's spelling): the same root,
    so the dead daemon's unfinished step is marked failed at once, not left for ``--commit-timeout``."""
    import asyncio

    from ckptd.daemon.journal import abandon_predecessor_steps
    from ckptd.writer.backends import open_backend
    from ckptd.writer.commit import CheckpointWriter

    path = journal_path(str(tmp_path / "d.sock"))
    root = str(tmp_path / "ckpt")
    StepJournal(path, root + "/").started(2, 0, 1)
    with open(path) as f:
        doc = json.load(f)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    doc["pid"], doc["started"] = int(dead.stdout), 0
    with open(path, "w") as f:
        json.dump(doc, f)

    async def go() -> tuple[list[int], dict[str, object] | None]:
        async with await open_backend(root, None, create=True) as backend:
            w = CheckpointWriter(backend)
            return await abandon_predecessor_steps(StepJournal(path, "file://" + root), w), await w.read_failed(2)

    abandoned, note = asyncio.run(go())
    assert abandoned == [2] and note is not None and note.get("abandoned"), (abandoned, note)
