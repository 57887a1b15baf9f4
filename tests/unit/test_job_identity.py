"""Job identity and daemon ownership rules (ckptd.client.ownership), and the additive Welcome fields."""

from __future__ import annotations

import os
import subprocess
import time

import msgspec
import pytest

from ckptd.client.ownership import (
    check_daemon_job,
    job_identity,
    owner_pid,
    pid_alive,
    process_start_time,
)
from ckptd.client.protocol import PROTOCOL_VERSION, Welcome, decode_reply, encode
from ckptd.writer.errors import JobMismatchError, StaleDaemonError


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"CKPTD_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "7"}, "mine"),
        ({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "7", "RAY_JOB_ID": "01000000"}, "torchelastic:abc"),
        ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7"}, "slurm:7"),  # torchrun's default run id
        ({"RAY_JOB_ID": "01000000", "RANK": "3"}, "ray:01000000"),
    ],
)
def test_job_identity_from_launchers(env: dict[str, str], want: str) -> None:
    assert job_identity(env) == want


def test_job_identity_without_a_launcher_is_the_owner_process() -> None:
    alone = job_identity({})
    assert alone == f"pid:{os.getpid()}@{process_start_time(os.getpid())}"
    ranked = job_identity({"RANK": "1", "LOCAL_RANK": "1"})  # ranks of one launcher share its id
    assert ranked == f"pid:{os.getppid()}@{process_start_time(os.getppid())}" != alone


def test_owner_is_the_launcher_unless_there_is_none_or_it_is_rays_raylet() -> None:
    assert owner_pid({}) == os.getpid()
    assert owner_pid({"RANK": "0"}) == owner_pid({"SLURM_PROCID": "0"}) == os.getppid()
    assert owner_pid({"RANK": "0", "RAY_RAYLET_PID": str(os.getppid())}) == os.getpid()


def test_pid_alive_and_start_time_see_a_dead_process_as_gone() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        started = process_start_time(child.pid)
        mine = process_start_time(os.getpid())
        assert pid_alive(child.pid) and started is not None and mine is not None and started >= mine
        child.kill()
        deadline = time.monotonic() + 5
        while pid_alive(child.pid) and time.monotonic() < deadline:  # a zombie (not yet reaped) counts as gone
            time.sleep(0.02)
        assert not pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid) and process_start_time(child.pid) is None
    assert not pid_alive(0) and not pid_alive(-5)


def test_check_daemon_job_refuses_another_job_naming_both() -> None:
    kw = {"daemon_pid": 42, "socket_path": "/s.sock"}
    check_daemon_job("job-b", "", owner=0, draining=False, **kw)  # an operator's daemon: any job
    check_daemon_job("job-b", "job-b", owner=os.getpid(), draining=False, **kw)  # our own
    with pytest.raises(JobMismatchError) as err:
        check_daemon_job("job-b", "job-a", owner=os.getpid(), draining=False, **kw)
    assert not isinstance(err.value, StaleDaemonError)
    assert "'job-a'" in str(err.value) and "'job-b'" in str(err.value) and "pid 42" in str(err.value)
    with pytest.raises(StaleDaemonError) as stale:  # its job is over: it drains and exits
        check_daemon_job("job-b", "job-a", owner=os.getpid(), draining=True, **kw)
    assert stale.value.daemon_pid == 42 and "'job-a'" in str(stale.value)
    dead = subprocess.Popen(["true"])
    dead.wait()
    with pytest.raises(StaleDaemonError):  # its owner is gone (the daemon may not have noticed yet)
        check_daemon_job("job-b", "job-a", owner=dead.pid, draining=False, **kw)


def test_welcome_ownership_fields_are_additive() -> None:
    old = msgspec.msgpack.encode({"type": "welcome", "v": PROTOCOL_VERSION, "daemon_pid": 1, "arena_path": "/a",
                                  "arena_bytes": 8, "root": "/r"})
    got = decode_reply(old)  # a daemon that predates ownership
    assert isinstance(got, Welcome) and (got.job_id, got.owner_pid, got.draining) == ("", 0, False)
    new = Welcome(v=PROTOCOL_VERSION, daemon_pid=1, arena_path="/a", arena_bytes=8, root="/r", job_id="slurm:7",
                  owner_pid=99, draining=True)
    assert decode_reply(encode(new)[4:]) == new
