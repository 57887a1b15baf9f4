"""``ckptd serve`` and what it finds at its socket path (review 47, items 3-5), with real daemon processes.

The daemon changes no directory it did not create: a shared, group-readable or symlinked socket directory is a
``ConfigError`` (exit 2) and is left exactly as it was, while a missing folder inside a shared one (the
Kubernetes ``emptyDir`` example) is created ``0700``. It removes nothing at its socket path but a dead daemon's
socket: a file, a directory, a link, a FIFO or a socket something still listens on is a ``ConfigError`` and
stays. A second daemon on a live daemon's socket fails at start; a daemon removes, at exit, only the socket it
bound itself."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.client.protocol import PROTOCOL_VERSION, Hello, StepState, Welcome
from ckptd.daemon.commands import request
from ckptd.daemon.socketfile import LOCK_SUFFIX
from ckptd.testing.launch import DaemonProcess

pytestmark = pytest.mark.timeout(240)


def refused(sock: str, root: str) -> tuple[int, str]:
    """Run ``ckptd serve`` on ``sock``, which must refuse at start: (exit code, its last stderr line). One that
    starts serving instead is killed by the timeout: the test fails."""
    cmd = [sys.executable, "-m", "ckptd.daemon.cli", "serve", "--root", root, "--socket", sock, "--arena-size", "4MiB",
           "--no-prefault", "--nice", "0"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckptd serve --socket {sock} started serving instead of refusing")
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, out.stderr.strip().splitlines()[-1]


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def hello(path: str) -> int:
    welcome = request(path, Hello(v=PROTOCOL_VERSION, pid=os.getpid(), rank=-1), 10)
    assert isinstance(welcome, Welcome)
    return welcome.daemon_pid


def test_socket_directories_the_daemon_did_not_create_are_refused_and_left_alone(sockdir: str, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    shared = os.path.join(sockdir, "shared")  # like /tmp, or a Kubernetes emptyDir's own directory
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    rc, line = refused(os.path.join(shared, "d.sock"), root)
    assert rc == 2 and line.startswith("ckptd serve: ConfigError: socket directory") and "open to other users" in line
    assert "private folder" in line and "let ckptd create one" in line, line
    assert mode(shared) == 0o1777 and os.listdir(shared) == []

    group = os.path.join(sockdir, "group")  # of this user's, but the group may list it
    os.mkdir(group, 0o750)
    os.chmod(group, 0o750)
    rc, line = refused(os.path.join(group, "d.sock"), root)
    assert rc == 2 and "open to other users (mode 0750)" in line, line
    assert mode(group) == 0o750 and os.listdir(group) == []

    private = os.path.join(sockdir, "private")  # 0700 and this user's, reached through a link: refused too
    os.mkdir(private, 0o700)
    link = os.path.join(sockdir, "link")
    os.symlink(private, link)
    rc, line = refused(os.path.join(link, "d.sock"), root)
    assert rc == 2 and "is a symbolic link" in line, line
    assert os.listdir(private) == [] and stat.S_ISLNK(os.lstat(link).st_mode)

    # the documented Kubernetes shape: a missing subfolder of the shared volume, which the daemon creates 0700
    sock = os.path.join(shared, "sock", "d.sock")
    d = DaemonProcess(root, sock, "--arena-size", "8MiB", "--no-prefault", "--nice", "0",
                      log_path=str(tmp_path / "k8s.log")).wait_ready()
    try:
        assert mode(os.path.dirname(sock)) == 0o700 and mode(shared) == 0o1777
        client = CheckpointClient(sock, placement=Placement(0, 1, 1, 0), timeout_s=30)
        assert client.save(1, {"w": torch.arange(8.0)}).wait(30).state is StepState.COMMITTED
        client.close()
    finally:
        assert d.stop(20) == 0
    assert mode(shared) == 0o1777 and not os.path.exists(sock)


def _listener(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(64)
    return s


def test_only_a_dead_daemons_socket_is_removed_from_the_socket_path(sockdir: str, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    link_target = tmp_path / "precious.txt"
    link_target.write_text("keep me")
    fifo = os.path.join(sockdir, "fifo.sock")
    os.mkfifo(fifo)
    setups: dict[str, tuple[str, Callable[[str], object]]] = {
        "file.sock": ("a file", lambda p: Path(p).write_text("not a socket")),
        "dir.sock": ("a directory", os.mkdir),
        "link.sock": ("a symbolic link", lambda p: os.symlink(link_target, p)),
        "listens.sock": ("a socket something listens on", _listener),
    }
    kept = []
    for name, (what, make) in setups.items():
        path = os.path.join(sockdir, name)
        kept.append(make(path))
        before = os.lstat(path)
        rc, line = refused(path, root)
        assert rc == 2 and line.startswith("ckptd serve: ConfigError: "), (what, line)
        if name == "listens.sock":
            assert f"a daemon already listens on {path}" in line, line
        else:
            assert f"is {what}, not a socket" in line, line
        after = os.lstat(path)
        assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode), what
    rc, line = refused(fifo, root)
    assert rc == 2 and "is a FIFO, not a socket" in line and stat.S_ISFIFO(os.lstat(fifo).st_mode), line
    assert Path(sockdir, "file.sock").read_text() == "not a socket" and link_target.read_text() == "keep me"
    for s in kept:
        if isinstance(s, socket.socket):
            s.close()

    # a socket nothing listens on any more (that listener's, closed): a dead daemon's, replaced
    path = os.path.join(sockdir, "listens.sock")
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    d = DaemonProcess(root, path, "--arena-size", "8MiB", "--no-prefault", "--nice", "0",
                      log_path=str(tmp_path / "d.log")).wait_ready()
    assert hello(path) == d.pid
    assert d.stop(20) == 0 and not os.path.exists(path)


def test_a_second_daemon_on_a_live_socket_fails_and_the_first_keeps_it(sockdir: str, tmp_path: Path) -> None:
    sock = os.path.join(sockdir, "d.sock")
    first = DaemonProcess(str(tmp_path / "a"), sock, "--arena-size", "8MiB", "--no-prefault", "--nice", "0",
                          log_path=str(tmp_path / "a.log")).wait_ready()
    try:
        rc, line = refused(sock, str(tmp_path / "b"))
        assert rc == 2 and line.startswith(f"ckptd serve: ConfigError: a daemon already listens on {sock}"), line
        assert f"pid {first.pid}" in line, line
        assert hello(sock) == first.pid and first.proc.poll() is None
        assert os.path.exists(sock + LOCK_SUFFIX)
        first.kill()  # kill -9: its socket stays behind, nothing answers on it; a new daemon replaces it
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
        second = DaemonProcess(str(tmp_path / "b"), sock, "--arena-size", "8MiB", "--no-prefault", "--nice", "0",
                               log_path=str(tmp_path / "b.log")).wait_ready()
        assert hello(sock) == second.pid
        assert second.stop(20) == 0
        assert not os.path.exists(sock) and not os.path.exists(sock + LOCK_SUFFIX)
    finally:
        first.stop(20)


def test_a_daemon_removes_at_exit_only_the_socket_it_bound(sockdir: str, tmp_path: Path) -> None:
    sock = os.path.join(sockdir, "d.sock")
    d = DaemonProcess(str(tmp_path / "ckpt"), sock, "--arena-size", "8MiB", "--no-prefault", "--nice", "0",
                      log_path=str(tmp_path / "d.log")).wait_ready()
    os.unlink(sock)  # its socket replaced by another's while it runs
    other = _listener(sock)
    try:
        ino = os.lstat(sock).st_ino
        assert d.stop(20) == 0
        assert os.lstat(sock).st_ino == ino, "the daemon removed a socket it did not bind"
        assert "no longer the socket this daemon bound" in d.log_tail()
    finally:
        other.close()
