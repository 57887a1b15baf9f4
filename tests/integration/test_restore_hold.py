"""The idle exit of an embedded daemon waits for restarted ranks while it keeps a committed step for an
in-memory restore (``--restore-hold``); a daemon that keeps nothing, or whose owner is a rank itself (no
launcher to restart ranks), exits after ``--exit-when-idle`` as before."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.client.protocol import StepState
from ckptd.client.restore import arena_source
from ckptd.testing.launch import DaemonProcess

IDLE_S, HOLD_S = 1.0, 5.0


def _save_and_leave(daemon: DaemonProcess, step: int) -> float:
    """A rank saves ``step`` and dies; returns when it was gone."""
    client = CheckpointClient(daemon.socket, placement=Placement(0, 1, 1, 0), timeout_s=20)
    try:
        assert client.save(step, {"x": torch.arange(1000.0)}).wait(30).state is StepState.COMMITTED
    finally:
        client.close()
    return time.monotonic()


def _exit_after(daemon: DaemonProcess, since: float, timeout: float = 30.0) -> float:
    """Seconds from ``since`` until the daemon exited (by itself, with status 0)."""
    assert daemon.proc.wait(timeout) == 0, daemon.log_tail()
    return time.monotonic() - since


def test_a_daemon_holding_a_kept_step_waits_for_the_restart(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    launcher = subprocess.Popen(["sleep", "120"])  # the owner: torchrun's agent, say, which restarts the ranks
    try:
        daemon = start_daemon(str(tmp_path / "ckpt"), "d0", "--exit-when-idle", str(IDLE_S),
                              "--restore-hold", str(HOLD_S), "--owner-pid", str(launcher.pid))
        _hold_then_exit(daemon)
    finally:
        launcher.kill()
        launcher.wait()


def _hold_then_exit(daemon: DaemonProcess) -> None:
    _save_and_leave(daemon, 7)
    time.sleep(IDLE_S + 1.5)  # the ranks restart (a torchrun restart, imports, the model built again)
    assert daemon.proc.poll() is None, daemon.log_tail()
    client = CheckpointClient(daemon.socket, placement=Placement(0, 1, 1, 0), timeout_s=20)
    try:
        source = arena_source(client, 7)
        assert source is not None and len(source.shards) == 1  # restored from memory
    finally:
        gone = time.monotonic()  # taken before the close: the daemon cannot start counting the hold earlier
        client.close()
    took = _exit_after(daemon, gone)  # the hold counts from the last client's leaving again
    assert HOLD_S - 0.5 <= took < HOLD_S + 10, (took, daemon.log_tail())
    assert "holding step 7 for an in-memory restore" in daemon.log_tail()


@pytest.mark.parametrize("why", ["nothing kept", "owner is the rank"])
def test_a_daemon_exits_after_the_idle_time(start_daemon: Callable[..., DaemonProcess], tmp_path: Path,
                                            why: str) -> None:
    flags = ["--no-retain"] if why == "nothing kept" else ["--owner-pid", str(os.getpid())]  # this process saves
    daemon = start_daemon(str(tmp_path / "ckpt"), "d0", "--exit-when-idle", str(IDLE_S), "--restore-hold", "60",
                          *flags)
    took = _exit_after(daemon, _save_and_leave(daemon, 7))
    assert took < 10, (took, daemon.log_tail())
