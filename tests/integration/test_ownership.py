"""An embedded daemon belongs to its job (real daemon processes): it drains and exits once its owner
process is gone, keeping what committed; a client of another job refuses it while that job runs and
replaces it once that job is over; clients of the same job share it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from test_pipeline import expected_state, tensors, zero_template
from test_placement import EMBEDDED, _reaped

from ckptd.client import CheckpointClient, JobMismatchError, Placement
from ckptd.client.ownership import pid_alive
from ckptd.client.reader import load, read_commit
from ckptd.writer.errors import CheckpointNotFoundError, StaleDaemonError

pytestmark = pytest.mark.timeout(90)


def _owner() -> subprocess.Popen[bytes]:
    """Stands in for a job's launcher (torchrun's agent, slurmstepd): the process whose end ends the job."""
    return subprocess.Popen(["sleep", "60"])


def test_owner_gone_daemon_drains_exits_and_keeps_committed_steps(
    sockdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, sock = str(tmp_path / "ck"), os.path.join(sockdir, "own.sock")
    owner = _owner()
    try:
        client = CheckpointClient(sock, root=root, start_daemon=True, job_id="job-a", placement=Placement(0, 1, 1, 0),
                                  daemon_args=[*EMBEDDED, "--owner-pid", str(owner.pid), "--exit-when-idle", "60"])
        welcome = client._welcome
        assert welcome is not None
        assert (welcome.job_id, welcome.owner_pid, welcome.draining) == ("job-a", owner.pid, False)
        monkeypatch.setenv("CKPTD_JOB_ID", "job-a")  # another rank of the job, its id from the environment
        other = CheckpointClient(sock, root=root, placement=Placement(0, 1, 1, 0))
        assert other.job_id == "job-a" and other._welcome is not None
        assert other._welcome.daemon_pid == welcome.daemon_pid
        other.close()
        client.save(1, {"w": torch.full((64,), 1.0)}).wait(timeout=30)
        client.save(2, {"w": torch.arange(64, dtype=torch.float32)})  # accepted, still in flight when the job ends
    finally:
        owner.kill()
        owner.wait()
    # the client is still connected and the idle exit is 60s away: the owner's end alone stops the daemon
    assert _reaped(welcome.daemon_pid, 20)
    assert not os.path.exists(sock)
    out = torch.zeros(64)
    load(root, 2, {"w": out})  # the in-flight step was drained to a commit, not cut off
    assert torch.equal(out, torch.arange(64, dtype=torch.float32))
    assert read_commit(root, 1).step == 1
    client.close()


def test_another_jobs_daemon_refused_while_it_runs_and_replaced_once_it_is_over(sockdir: str, tmp_path: Path) -> None:
    root, sock = str(tmp_path / "ck"), os.path.join(sockdir, "jobs.sock")
    owner = _owner()
    a_args = [*EMBEDDED, "--owner-pid", str(owner.pid), "--drain-grace", "1.5"]
    ranks = [CheckpointClient(sock, root=root, start_daemon=True, job_id="job-a", placement=Placement(r, 2, 2, 0),
                              daemon_args=a_args) for r in range(2)]
    pids = {c._welcome.daemon_pid for c in ranks if c._welcome is not None}
    assert len(pids) == 1  # same job: one daemon, shared
    old = pids.pop()
    for h in [c.save(1, expected_state(c.placement.rank, 2, 1)) for c in ranks]:
        h.wait(timeout=30)
    b_args = [*EMBEDDED, "--exit-when-idle", "1"]
    for start in (False, True):  # job A still runs: never reused, never replaced
        with pytest.raises(JobMismatchError) as err:
            CheckpointClient(sock, root=root, start_daemon=start, job_id="job-b", placement=Placement(0, 1, 1, 0),
                             daemon_args=b_args)
        assert not isinstance(err.value, StaleDaemonError)
        assert "'job-a'" in str(err.value) and "'job-b'" in str(err.value) and f"pid {old}" in str(err.value)
    ranks[0].save(2, expected_state(0, 2, 2))  # rank 1 never saves step 2: the drain can only cut it off
    owner.kill()
    owner.wait()
    with pytest.raises(StaleDaemonError):  # job A is over; its daemon is draining: not ours to use
        CheckpointClient(sock, root=root, job_id="job-b", placement=Placement(0, 1, 1, 0))
    b = CheckpointClient(sock, root=root, start_daemon=True, job_id="job-b", placement=Placement(0, 1, 1, 0),
                         daemon_args=b_args)  # waits for job A's daemon to finish, then starts its own
    assert b._welcome is not None and b._welcome.daemon_pid != old and b._welcome.job_id == "job-b"
    assert not pid_alive(old)  # gone before ours started (reaped by the wait, as this process started it)
    b.save(3, {"w": torch.full((8,), 3.0)}).wait(timeout=30)
    for c in (*ranks, b):
        c.close()
    assert _reaped(b._welcome.daemon_pid, 15)
    template = zero_template(1, 2)
    load(root, 1, template, rank=1)  # job A's committed step survived the replacement
    want, have = tensors(expected_state(1, 2, 1)), tensors(template)
    assert all(torch.equal(want[k], have[k]) for k in want)
    with pytest.raises(CheckpointNotFoundError):
        read_commit(root, 2)
    assert read_commit(root, "latest").step == 3
