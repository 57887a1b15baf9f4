"""A daemon restarted on a killed one's socket is ready only once it answers, not once ``connect()`` works.

After ``kill -9`` the dead daemon's listening socket can go on accepting connections for a moment after
its clients saw their connections die (the kernel releases the dead process's files one by one; on this
loaded 2-core VM the listener trailed them by up to ~0.2 s) and then resets every connection it accepted,
without a reply. A successor's readiness check that only connects can land there; the first client then
gets ``ECONNRESET`` on its ``Hello`` (``DaemonUnavailableError``): the flaky
``test_pipeline.py::test_daemon_kill_9_mid_save`` under load. The dying socket here is a listener that
accepts nothing and closes after a while: the kernel state a killed daemon leaves for that moment.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.client.protocol import StepState
from ckptd.testing.launch import DaemonProcess
from ckptd.writer.errors import DaemonUnavailableError


def test_ready_waits_past_a_dead_predecessors_socket(sockdir, tmp_path):
    path = os.path.join(sockdir, "d0.sock")
    dying = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dying.bind(path)
    dying.listen(8)  # accepts connections into its backlog, answers none
    closer = threading.Timer(1.0, dying.close)  # then released: what it accepted is reset
    closer.start()
    d = DaemonProcess(str(tmp_path / "ckpt"), path, "--arena-size", "8MiB", "--no-prefault",
                      log_path=str(tmp_path / "d0.log"))
    try:
        d.wait_ready(60)
        client = CheckpointClient(path, placement=Placement(0, 1, 1, 0), timeout_s=30)
        assert client._welcome is not None and client._welcome.daemon_pid == d.pid
        assert client.save(1, {"x": torch.arange(4.0)}).wait(30).state is StepState.COMMITTED
        client.close()
    finally:
        closer.join()
        d.stop(20)


def test_a_full_accept_backlog_is_daemon_unavailable(sockdir):
    """A daemon whose accept backlog is full (its loop stalled, or it is dying) refuses connections with
    EAGAIN: a typed DaemonUnavailableError, not a raw BlockingIOError out of the client."""
    path = os.path.join(sockdir, "busy.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as busy:
        busy.bind(path)
        busy.listen(0)
        queued = []
        for _ in range(8):  # fill its backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            queued.append(s)
            try:
                s.connect(path)
            except BlockingIOError:
                break
        else:
            raise AssertionError("the backlog never filled")
        with pytest.raises(DaemonUnavailableError, match="Resource temporarily unavailable"):
            CheckpointClient(path, placement=Placement(0, 1, 1, 0), timeout_s=2)
        for s in queued:
            s.close()
