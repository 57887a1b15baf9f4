"""A restarted daemon abandons what its ``kill -9``-ed predecessor left (daemon/journal.py).

Real daemons on a local root: the one writing a step is killed mid-write, a new one starts on the same
socket and root. The dead daemon's step never commits and carries a ``FAILED`` note (``abandoned``) that
``ckptd ls`` and ``ckptd verify`` report; the other node stops waiting for it at once (not after the
commit timeout); committed steps are byte-for-byte untouched; retention removes the abandoned step once
a newer one committed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard, StepState
from ckptd.client.reader import load
from ckptd.daemon.journal import journal_path
from ckptd.testing.fixtures import tree_digest, wait_for
from ckptd.writer.errors import StepAbandonedError

pytestmark = pytest.mark.timeout(120)

SLOW = ("--chunk-bytes", "64KiB", "--write-concurrency", "1", "--stage-grace", "0")
CLI = [sys.executable, "-m", "ckptd.daemon.cli"]


def _state(step: int, rank: int = 0, big: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    n = (32 << 20) // 4 if big else 4096  # big: 32 MiB in 512 chunks written one by one, each synced
    return {f"r{rank}/w": torch.randn(n, generator=g)}


def _own(state: dict[str, torch.Tensor]) -> dict[str, Shard]:
    """Each key as a whole array this rank writes (a plain tensor is a replica that rank 0 writes)."""
    return {k: Shard(k, v, tuple(v.shape), (0,) * v.dim()) for k, v in state.items()}




def _chunks_written(step_path: Path) -> bool:
    return any(step_path.glob("r*/w/c.*"))


def _failed_note(root: Path, step: int) -> dict[str, object]:
    return dict(json.loads((root / f"step_{step}" / "_ckptd" / "FAILED").read_text()))


def test_restarted_daemon_abandons_the_dead_daemons_step(start_daemon, tmp_path):
    root = tmp_path / "ckpt"
    d0 = start_daemon(str(root), "d0", *SLOW, "--keep", "2", arena="128MiB")
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0), timeout_s=10)
    client.save(1, _state(1)).wait(30)
    before = tree_digest(str(root / "step_1"))

    handle = client.save(2, _state(2, big=True))
    wait_for(lambda: _chunks_written(root / "step_2"), "the first chunks of step 2", 30)
    d0.kill()
    assert not (root / "step_2" / "_ckptd" / "COMMITTED").exists()
    journal = json.loads(Path(journal_path(d0.socket)).read_text())
    assert [e["step"] for e in journal["steps"]] == [2] and journal["pid"] == d0.pid
    assert handle.wait(10) is handle and handle.state is StepState.FAILED  # training goes on

    d0b = start_daemon(str(root), "d0", *SLOW, "--keep", "2", arena="128MiB")  # same socket, same root
    note = _failed_note(root, 2)
    assert note["code"] == "StepAbandonedError" and note["abandoned"] is True
    assert f"pid {d0.pid}" in str(note["message"])
    assert not (root / "step_2" / "_ckptd" / "COMMITTED").exists()  # never commits
    assert tree_digest(str(root / "step_1")) == before  # nothing committed is touched
    assert "abandoned" in d0b.log_tail()

    ls = subprocess.run([*CLI, "ls", str(root), "--json"], check=True, capture_output=True, text=True)
    rows = {r["step"]: r for r in json.loads(ls.stdout)}
    assert rows[1]["committed"] and not rows[2]["committed"]
    assert rows[2]["failed"].startswith("StepAbandonedError: step 2: abandoned")
    text = subprocess.run([*CLI, "ls", str(root)], check=True, capture_output=True, text=True).stdout
    assert any(line.split()[:2] == ["2", "failed"] for line in text.splitlines()), text
    verify = subprocess.run([*CLI, "verify", str(root)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr  # a failed step is reported, not corruption
    assert "step 2: FAILED, not a checkpoint" in verify.stdout and "step 1: OK" in verify.stdout
    verified = subprocess.run([*CLI, "verify", str(root), "--json"], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr
    rows = {r["step"]: r for r in json.loads(verified.stdout)}  # every row has a state and its errors
    assert (rows[1]["state"], rows[1]["errors"]) == ("ok", [])
    assert (rows[2]["state"], rows[2]["errors"], rows[2]["ok"]) == ("failed", [], True)
    assert rows[2]["failed"].startswith("StepAbandonedError")

    template = {k: torch.zeros_like(v) for k, v in _state(1).items()}
    load(str(root), "latest", template)
    assert all(torch.equal(template[k], v) for k, v in _state(1).items())
    # the next step commits; retention then removes the abandoned step (older than the newest commit)
    client.save(3, _state(3)).wait(30)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_1", "step_3"]
    assert tree_digest(str(root / "step_1")) == before
    client.close()
    d0b.stop(timeout=20)
    assert not os.path.exists(journal_path(d0b.socket))  # a clean stop with nothing in flight leaves none


@pytest.mark.parametrize("killed", [0, 1], ids=["coordinator", "other-node"])
def test_other_node_stops_waiting_when_a_restarted_daemon_abandons(killed, start_daemon, tmp_path):
    """Two nodes; one node's daemon dies mid-write while the other's part is durable. Restarted, it
    abandons the step, and the surviving node's rank gets :class:`StepAbandonedError` at once."""
    root = tmp_path / "ckpt"
    flags = {n: SLOW if n == killed else ("--stage-grace", "0") for n in (0, 1)}
    daemons = {n: start_daemon(str(root), f"n{n}", *flags[n], arena="128MiB") for n in (0, 1)}
    clients = {r: CheckpointClient(daemons[r].socket, placement=Placement(r, 2, 1, r), timeout_s=10) for r in (0, 1)}
    first = [clients[r].save(1, _own(_state(1, r))) for r in (0, 1)]  # a committed step: it must stay intact
    for h in first:
        h.wait(30)
    survivor = 1 - killed
    # One chunk of the killed node's array is a named pipe: its write blocks, so that node's part can never
    # land before the kill, however the machine's load orders the two nodes' writes.
    chunks = root / "step_2" / f"r{killed}" / "w"
    chunks.mkdir(parents=True)
    os.mkfifo(chunks / "c.5")
    handles = {r: clients[r].save(2, _own(_state(2, r, big=r == killed))) for r in (0, 1)}
    wait_for(lambda: (root / "step_2" / "_ckptd" / "_parts" / f"node-{survivor}.json").exists(),
             "the surviving node's part", 30)
    wait_for(lambda: any(p.is_file() for p in chunks.iterdir()), "the killed node's first chunks", 30)
    daemons[killed].kill()
    assert not (root / "step_2" / "_ckptd" / "_parts" / f"node-{killed}.json").exists()
    before = tree_digest(str(root / "step_1"))

    t0 = time.monotonic()
    start_daemon(str(root), f"n{killed}", *flags[killed], arena="128MiB")
    with pytest.raises(StepAbandonedError, match="abandoned"):
        handles[survivor].wait(60)
    assert time.monotonic() - t0 < 30  # not the 600 s commit timeout
    assert handles[killed].wait(10).state is StepState.FAILED
    assert not (root / "step_2" / "_ckptd" / "COMMITTED").exists()
    assert tree_digest(str(root / "step_1")) == before
    for c in clients.values():
        c.close()
