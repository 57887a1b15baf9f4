"""Training survives its checkpointer: a lost daemon fails the save's handle (typed, with a warning) instead
of raising into the training loop; the embedded mode starts a new daemon on the next save; a restarted
daemon never commits its predecessor's unfinished step, and nothing committed is touched."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

from ckptd.client import CheckpointClient, DaemonUnavailableError, Placement, StepState
from ckptd.client.reader import load

pytestmark = pytest.mark.timeout(120)
SLOW = ("--chunk-bytes", "128KiB", "--write-concurrency", "1")
BIG = 24 << 18  # 24 MiB of float32 in ~190 chunks: the kill lands mid-write


def _loads(root: str, step: int, state: dict[str, torch.Tensor]) -> None:
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    load(root, step, template)
    for k, v in state.items():
        assert torch.equal(template[k], v), (step, k)


def test_lost_daemon_fails_the_handle_not_the_training_loop(start_daemon, tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0", *SLOW, arena="128MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=5)
    first = {"x": torch.arange(10.0)}
    client.save(1, first).wait(30)

    pending = client.save(2, {"x": torch.arange(10.0) + 2, "big": torch.randn(BIG)})
    time.sleep(0.1)
    d.kill()  # kill -9 mid-write
    with caplog.at_level(logging.WARNING, logger="ckptd.client.client"):
        assert pending.wait(10) is pending  # no raise under the default on_daemon_lost="warn"
        assert pending.state is StepState.FAILED and isinstance(pending.exception(), DaemonUnavailableError)
        lost = client.save(3, {"x": torch.arange(10.0) + 3})  # no daemon at all: still no raise
        assert lost.state is StepState.FAILED and isinstance(lost.exception(), DaemonUnavailableError)
        assert lost.wait(1) is lost
    warned = [r.getMessage() for r in caplog.records if "training goes on" in r.getMessage()]
    assert [("step 2" in m, "step 3" in m) for m in warned] == [(True, False), (False, True)]  # once each

    # an operator restarts the daemon: the same client saves again, the killed step never commits
    start_daemon(root, "d0", arena="128MiB")
    fourth = {"x": torch.arange(10.0) + 4}
    client.save(4, fourth).wait(30)
    assert not (tmp_path / "ckpt" / "step_2" / "COMMITTED").exists()
    _loads(root, 1, first)
    _loads(root, 4, fourth)
    client.close()


def test_strict_policy_raises(start_daemon, tmp_path):
    d = start_daemon(str(tmp_path / "ckpt"), "d0")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=5, on_daemon_lost="raise")
    client.save(1, {"x": torch.zeros(4)}).wait(30)
    d.kill()
    with pytest.raises(DaemonUnavailableError):
        client.save(2, {"x": torch.ones(4)})
    client.close()


def test_embedded_daemon_restarts_on_the_next_save(tmp_path, sockdir):
    root = str(tmp_path / "ckpt")
    sock = os.path.join(sockdir, "emb.sock")
    args = ["--arena-size", "128MiB", "--no-prefault", *SLOW]
    client = CheckpointClient(sock, root=root, start_daemon=True, placement=Placement(0, 1, 1, 0), timeout_s=10,
                              daemon_args=args)
    pids = []
    try:
        first = {"x": torch.arange(10.0)}
        client.save(1, first).wait(30)
        assert client._welcome is not None
        pids.append(client._welcome.daemon_pid)
        pending = client.save(2, {"x": torch.arange(10.0) + 2, "big": torch.randn(BIG)})
        time.sleep(0.1)
        os.kill(pids[0], signal.SIGKILL)
        time.sleep(0.2)
        third = {"x": torch.arange(10.0) + 3}
        handle = client.save(3, third)  # a new daemon starts here; the training loop never sees an error
        pids.append(client._welcome.daemon_pid)
        handle.wait(30)
        assert pids[1] != pids[0]
        # the new daemon has no record of step 2: lost, never committed
        assert pending.wait(5).state is StepState.FAILED
        assert isinstance(pending.exception(), DaemonUnavailableError)
        assert not (tmp_path / "ckpt" / "step_2" / "COMMITTED").exists()
        _loads(root, 1, first)
        _loads(root, 3, third)
    finally:
        client.close()
        for pid in pids[1:]:
            os.kill(pid, signal.SIGTERM)
