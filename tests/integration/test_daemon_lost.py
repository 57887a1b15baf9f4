"""Training survives its checkpointer: a lost daemon fails the save's handle (typed, with a warning) instead
of raising into the training loop; the embedded mode starts a new daemon on the next save; a restarted
daemon never commits its predecessor's unfinished step, and nothing committed is touched.

No sleep stands for synchronisation: the kill waits until the step's first chunks are on disk (so it lands
mid-write however loaded the machine), the embedded restart until the dead daemon's socket refuses
connections, and client timeouts are generous (a daemon at nice 10 on a busy 2-core runner is slow to
start and to answer).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, DaemonUnavailableError, Placement, StepState
from ckptd.client.daemon_lost import DaemonUnresponsiveError
from ckptd.client.reader import load
from ckptd.testing.daemon_kill import socket_refuses
from ckptd.testing.fixtures import wait_for
from ckptd.writer.format import commit_marker, failed_marker

pytestmark = pytest.mark.timeout(120)
SLOW = ("--chunk-bytes", "128KiB", "--write-concurrency", "1")
BIG = 24 << 18  # 24 MiB of float32 in ~190 chunks: the kill lands mid-write


TIMEOUT_S = 60.0  # client request timeouts, and the embedded daemon's start: generous on a loaded runner




def _writing(root: Path, step: int) -> Callable[[], bool]:
    """True once the daemon wrote some chunks of ``step``'s big array (and so has not finished it)."""
    return lambda: any((root / f"step_{step}" / "big").glob("c.*"))


def _loads(root: str, step: int, state: dict[str, torch.Tensor]) -> None:
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    load(root, step, template)
    for k, v in state.items():
        assert torch.equal(template[k], v), (step, k)


def test_lost_daemon_fails_the_handle_not_the_training_loop(start_daemon, tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0", *SLOW, arena="128MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=TIMEOUT_S)
    first = {"x": torch.arange(10.0)}
    client.save(1, first).wait(60)

    pending = client.save(2, {"x": torch.arange(10.0) + 2, "big": torch.randn(BIG)})
    wait_for(_writing(tmp_path / "ckpt", 2), "step 2's first chunks")
    d.kill()  # kill -9 mid-write
    with caplog.at_level(logging.WARNING, logger="ckptd.client.client"):
        assert pending.wait(60) is pending  # no raise under the default on_daemon_lost="warn"
        assert pending.state is StepState.FAILED and isinstance(pending.exception(), DaemonUnavailableError)
        lost = client.save(3, {"x": torch.arange(10.0) + 3})  # no daemon at all: still no raise
        assert lost.state is StepState.FAILED and isinstance(lost.exception(), DaemonUnavailableError)
        assert lost.wait(1) is lost
    warned = [r.getMessage() for r in caplog.records if "training goes on" in r.getMessage()]
    assert [("step 2" in m, "step 3" in m) for m in warned] == [(True, False), (False, True)]  # once each

    # an operator restarts the daemon: the same client saves again, the killed step never commits
    start_daemon(root, "d0", arena="128MiB")
    fourth = {"x": torch.arange(10.0) + 4}
    client.save(4, fourth).wait(60)
    assert not (tmp_path / "ckpt" / commit_marker(2)).exists()
    assert (tmp_path / "ckpt" / failed_marker(2)).exists()  # abandoned by the restarted daemon
    _loads(root, 1, first)
    _loads(root, 4, fourth)
    client.close()


def test_strict_policy_raises(start_daemon, tmp_path):
    d = start_daemon(str(tmp_path / "ckpt"), "d0")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=TIMEOUT_S, on_daemon_lost="raise")
    client.save(1, {"x": torch.zeros(4)}).wait(60)
    d.kill()
    with pytest.raises(DaemonUnavailableError):
        client.save(2, {"x": torch.ones(4)})
    client.close()


@pytest.mark.parametrize("restarted", [False, True], ids=["dead", "restarted"])
def test_a_daemon_lost_after_its_commit_reports_the_step_committed(start_daemon, tmp_path, restarted):
    """A daemon killed after the step's marker and ``latest`` landed, before the rank asked: the step is
    committed, and the handle says so (it reads the commit from storage) instead of a lost save that raises
    under ``"raise"``; a save that did not commit is still lost (the test above, and the kill matrix)."""
    root = tmp_path / "ckpt"
    d = start_daemon(str(root), "d0")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=TIMEOUT_S, on_daemon_lost="raise")
    state = {"x": torch.arange(1000.0)}
    handle = client.save(1, state)
    wait_for(lambda: (root / "_ckptd" / "latest").exists(), "step 1's latest")  # after its marker
    assert (root / commit_marker(1)).exists()
    d.kill()
    if restarted:
        start_daemon(str(root), "d0")
    assert handle.wait(30) is handle and handle.state is StepState.COMMITTED and handle.exception() is None
    _loads(str(root), 1, state)
    client.close()


def test_embedded_daemon_restarts_on_the_next_save(tmp_path, sockdir):
    root = str(tmp_path / "ckpt")
    sock = os.path.join(sockdir, "emb.sock")
    args = ["--arena-size", "128MiB", "--no-prefault", *SLOW]
    client = CheckpointClient(sock, root=root, start_daemon=True, placement=Placement(0, 1, 1, 0),
                              timeout_s=TIMEOUT_S, daemon_args=args)
    pids = []
    try:
        first = {"x": torch.arange(10.0)}
        client.save(1, first).wait(60)
        assert client._welcome is not None
        pids.append(client._welcome.daemon_pid)
        pending = client.save(2, {"x": torch.arange(10.0) + 2, "big": torch.randn(BIG)})
        wait_for(_writing(tmp_path / "ckpt", 2), "step 2's first chunks")
        os.kill(pids[0], signal.SIGKILL)
        wait_for(lambda: socket_refuses(sock), "the killed daemon's socket to refuse connections")
        third = {"x": torch.arange(10.0) + 3}
        handle = client.save(3, third)  # a new daemon starts here; the training loop never sees an error
        pids.append(client._welcome.daemon_pid)
        assert handle.wait(60).state is StepState.COMMITTED
        assert pids[1] != pids[0]
        # the new daemon has no record of step 2: lost, never committed, abandoned
        assert pending.wait(60).state is StepState.FAILED
        assert isinstance(pending.exception(), DaemonUnavailableError)
        assert not (tmp_path / "ckpt" / commit_marker(2)).exists()
        assert (tmp_path / "ckpt" / failed_marker(2)).exists()
        _loads(root, 1, first)
        _loads(root, 3, third)
    finally:
        client.close()
        for pid in pids[1:]:
            os.kill(pid, signal.SIGTERM)


def _maps(path: str) -> bool:
    """Whether this process (the rank) maps the file at ``path`` (deleted or not)."""
    with open("/proc/self/maps") as f:
        return any(path in line for line in f)


def test_lost_daemon_arena_is_unmapped_and_a_restarted_daemon_serves(start_daemon, tmp_path):
    """The connection lost, the dead daemon's arena is unmapped at once (its tmpfs pages are freed: a restarted
    daemon's free-space check must not count them); the plan's views of the old mapping are not used."""
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0", arena="64MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=TIMEOUT_S)
    base = torch.arange(4096.0)
    for step in (1, 2, 3):  # the structure repeats: steps 2 and 3 go through a registered plan (views cached)
        client.save(step, {"x": base + step}).wait(60)
    assert client._welcome is not None
    old = client._welcome.arena_path
    assert _maps(old)
    d.kill()
    lost = client.save(4, {"x": base + 4})  # the daemon is gone: no raise, and the old arena is let go
    assert lost.state is StepState.FAILED and isinstance(lost.exception(), DaemonUnavailableError)
    assert client._sock is None and client._staging.mm is None
    assert not _maps(old)

    start_daemon(root, "d0", arena="64MiB")  # the same size: its mapping may land where the old one was
    for step in (5, 6):
        client.save(step, {"x": base + step}).wait(60)
    assert client._welcome.arena_path != old and _maps(client._welcome.arena_path) and not _maps(old)
    for step in (1, 5, 6):
        _loads(root, step, {"x": base + step})
    client.close()
    assert not _maps(client._welcome.arena_path)


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_missing_arena_file_is_a_lost_daemon(start_daemon, tmp_path, policy):
    """An arena file removed under a live daemon (another daemon's stale-arena cleanup) cannot be mapped on
    the next connect: a typed DaemonUnavailableError under the policy, never a raw FileNotFoundError."""
    d = start_daemon(str(tmp_path / "ckpt"), "d0")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=TIMEOUT_S, on_daemon_lost=policy)
    client.save(1, {"x": torch.zeros(4)}).wait(60)
    assert client._welcome is not None
    path = client._welcome.arena_path
    os.unlink(path)
    client._close_socket()  # the connection drops: the next save connects and maps the arena again
    if policy == "warn":
        lost = client.save(2, {"x": torch.ones(4)})
        assert lost.state is StepState.FAILED
        assert isinstance(lost.exception(), DaemonUnavailableError) and path in str(lost.exception())
    else:
        with pytest.raises(DaemonUnavailableError, match="cannot map the daemon's staging arena"):
            client.save(2, {"x": torch.ones(4)})
    assert client._sock is None  # not left connected to a daemon whose arena it has not mapped
    with pytest.raises(DaemonUnavailableError, match="stale-arena cleanup"):
        CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=TIMEOUT_S)
    client.close()


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_hung_daemon_is_a_lost_daemon(start_daemon, tmp_path, caplog, monkeypatch, policy):
    """A daemon that does not answer within the client's timeout_s (SIGSTOPped) is lost: the connection is
    closed, the arena unmapped, the handle FAILED with DaemonUnresponsiveError and a warning (``"warn"``) or
    that error raised (``"raise"``); a hung daemon is not replaced by an embedded one; once it resumes, the
    next save connects again."""
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0", *SLOW, arena="128MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=TIMEOUT_S, lease_timeout_s=1,
                              on_daemon_lost=policy)
    client.save(1, {"x": torch.arange(10.0)}).wait(60)
    pending = client.save(2, {"x": torch.arange(10.0) + 2, "big": torch.randn(BIG)})
    wait_for(_writing(tmp_path / "ckpt", 2), "step 2's first chunks")
    spawned: list[int] = []
    monkeypatch.setattr(client, "_start_daemon", True)  # as the embedded mode: a hung daemon must not be replaced
    monkeypatch.setattr(client, "_spawn_daemon", lambda replacing=0: spawned.append(replacing))
    os.kill(d.pid, signal.SIGSTOP)
    try:
        assert client._sock is not None
        client.timeout_s = 1.0  # short from here on (the setup above ran with a generous one)
        client._sock.settimeout(1.0)
        with caplog.at_level(logging.WARNING, logger="ckptd.client.client"):
            if policy == "warn":
                assert pending.wait(60) is pending
                assert pending.state is StepState.FAILED and isinstance(pending.exception(), DaemonUnresponsiveError)
                lost = client.save(3, {"x": torch.arange(10.0) + 3})  # connects again: no answer to its Hello
                assert lost.state is StepState.FAILED and isinstance(lost.exception(), DaemonUnresponsiveError)
                assert "did not answer within 1s" in str(lost.exception())
            else:
                with pytest.raises(DaemonUnresponsiveError, match="did not answer within"):
                    pending.wait(60)
                with pytest.raises(DaemonUnavailableError):
                    client.save(3, {"x": torch.arange(10.0) + 3})
        assert client._sock is None and client._staging.mm is None
        assert spawned == []
        warned = [r.getMessage() for r in caplog.records if "training goes on" in r.getMessage()]
        assert len(warned) == (2 if policy == "warn" else 0), warned
    finally:
        os.kill(d.pid, signal.SIGCONT)
    client.timeout_s = TIMEOUT_S
    fourth = {"x": torch.arange(10.0) + 4}
    assert client.save(4, fourth).wait(60).state is StepState.COMMITTED
    _loads(root, 4, fourth)
    client.close()


def test_a_hung_daemon_costs_each_later_save_a_short_probe(start_daemon, tmp_path, caplog):
    """Once the daemon left a request unanswered, each later save asks it again (it may have resumed) but
    gives its Hello ``PROBE_S``, not ``timeout_s``: under ``"warn"`` training loses seconds a save, not
    ``timeout_s`` each, while the daemon stays stopped; once it answers, saves go through again."""
    from ckptd.client.client import PROBE_S

    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0", arena="64MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=2 * PROBE_S + 2)
    client.save(1, {"x": torch.arange(10.0)}).wait(60)
    os.kill(d.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptd.client.client"):
            t0 = time.monotonic()
            first = client.save(2, {"x": torch.arange(10.0) + 2})  # its request waits timeout_s
            waited = time.monotonic() - t0
            t0 = time.monotonic()
            second = client.save(3, {"x": torch.arange(10.0) + 3})  # a reconnect: its Hello waits PROBE_S
            probed = time.monotonic() - t0
        for h in (first, second):
            assert h.state is StepState.FAILED and isinstance(h.exception(), DaemonUnresponsiveError), h
        assert waited >= client.timeout_s and probed < client.timeout_s - 1, (waited, probed)
        assert f"did not answer within {PROBE_S:g}s" in str(second.exception())
    finally:
        os.kill(d.pid, signal.SIGCONT)
    fourth = {"x": torch.arange(10.0) + 4}
    assert client.save(4, fourth).wait(60).state is StepState.COMMITTED  # answered: full timeouts again
    assert client._unanswered is False
    _loads(root, 4, fourth)
    client.close()
