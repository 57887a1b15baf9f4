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
    for pid, readable in ((dead_pid, True), (os.getppid(), False)):  # a running daemon's journal is its own
        doc["pid"] = pid
        with open(path, "w") as f:
            json.dump(doc, f)
        found = StepJournal(path, "/ckpt").read_predecessor()
        assert (found is not None) == readable
        if found is not None:
            assert isinstance(found, JournalDoc) and [(e.step, e.node) for e in found.steps] == [(3, 1)]
    with open(path, "w") as f:
        f.write("{not json")
    assert StepJournal(path, "/ckpt").read_predecessor() is None  # unreadable: ignored, with a warning
