"""A client connects only to its own user's daemon, through its own user's private socket directory (review 47,
item 1): anything else is a ConfigError naming the path and what is wrong, raised into the caller even under
``on_daemon_lost="warn"`` (it is someone else's socket, not a lost daemon); the normal placements still work:
``$XDG_RUNTIME_DIR`` unset, a Kubernetes-style subfolder the daemon creates, an embedded start."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, Placement, embedded
from ckptd.client.paths import default_socket_path
from ckptd.client.protocol import PROTOCOL_VERSION, StepState, Welcome, encode
from ckptd.testing.fixtures import unavailable
from ckptd.testing.launch import DaemonProcess
from ckptd.writer.errors import ConfigError

pytestmark = pytest.mark.timeout(120)
ONE = Placement(0, 1, 1, 0)
OTHER_UID = 2002
PEER_PY = "/usr/bin/python3"  # the venv's interpreter may sit where another uid cannot reach it (/root)


def _save_commits(client: CheckpointClient, step: int) -> None:
    assert client.save(step, {"w": torch.full((4,), float(step))}).wait(60).state is StepState.COMMITTED


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o1777])
def test_a_socket_dir_others_may_access_is_refused(start_daemon, sockdir: str, tmp_path: Path, mode: int) -> None:
    d = start_daemon(str(tmp_path / "ck"))
    os.chmod(sockdir, mode)
    try:
        with pytest.raises(ConfigError, match=f"mode {mode:#o}") as err:
            CheckpointClient(d.socket, placement=ONE, timeout_s=10)
        assert f"socket directory {sockdir}" in str(err.value)
    finally:
        os.chmod(sockdir, 0o700)
    client = CheckpointClient(d.socket, placement=ONE, timeout_s=10)  # private again: connects
    _save_commits(client, 1)
    client.close()


def test_a_symlinked_socket_dir_is_refused(start_daemon, sockdir: str, tmp_path: Path) -> None:
    d = start_daemon(str(tmp_path / "ck"))
    link = str(tmp_path / "link")
    os.symlink(sockdir, link)
    with pytest.raises(ConfigError, match="symbolic link") as err:
        CheckpointClient(os.path.join(link, os.path.basename(d.socket)), placement=ONE, timeout_s=10)
    assert f"socket directory {link} is a symbolic link (to {sockdir})" in str(err.value)


def test_a_reconnect_into_a_bad_socket_dir_raises_even_under_warn(start_daemon, sockdir: str, tmp_path: Path) -> None:
    d = start_daemon(str(tmp_path / "ck"))
    client = CheckpointClient(d.socket, placement=ONE, timeout_s=10, on_daemon_lost="warn")
    _save_commits(client, 1)
    d.stop(timeout=20)
    os.chmod(sockdir, 0o777)  # its socket dir is no longer private when the client reconnects
    try:
        with pytest.raises(ConfigError, match="mode 0o777"):
            client.save(2, {"w": torch.zeros(4)})  # not a FAILED handle and a warning: the caller is told
    finally:
        os.chmod(sockdir, 0o700)
        client.close()


@pytest.fixture
def foreign_peer(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A process of uid 2002 listening on a socket it bound in a directory of its own, that directory then given
    to this user (``0700``: it passes the client's directory check); it answers the first request with a Welcome
    whose arena is a file of its own, ``0666`` (the reviewer's fake daemon). Yields the socket path and the
    process, which prints how many bytes it received. Where it cannot run: :func:`unavailable` (a skip on a
    developer's machine, a failure in CI, whose setup runs as root)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists(PEER_PY):
        unavailable(f"a peer of another uid needs root, setpriv and {PEER_PY} to run it as uid {OTHER_UID}")
    base = tempfile.mkdtemp(prefix="ckpt-trust-", dir="/var/tmp")  # /tmp may be closed to other uids
    try:
        os.chmod(base, 0o711)
        sub = os.path.join(base, "s")
        os.mkdir(sub, 0o700)
        arena, sock = os.path.join(sub, "arena"), os.path.join(sub, "d.sock")
        with open(arena, "wb") as f:
            f.truncate(1 << 20)
        os.chmod(arena, 0o666)
        for p in (sub, arena):
            os.chown(p, OTHER_UID, OTHER_UID)
        welcome = encode(Welcome(v=PROTOCOL_VERSION, daemon_pid=1, arena_path=arena, arena_bytes=1 << 20,
                                 root=str(tmp_path / "ck")))
        cmd = ["setpriv", "--reuid", str(OTHER_UID), "--regid", str(OTHER_UID), "--clear-groups",
               PEER_PY, "-c", _FAKE, sock, welcome.hex()]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            unavailable(f"could not run a listener as uid {OTHER_UID}: {proc.communicate(timeout=10)[1][-500:]}")
        os.chown(sub, os.geteuid(), os.getegid())  # now a directory that passes the client's check
        assert stat.S_IMODE(os.lstat(sub).st_mode) == 0o700
        yield sock, proc
        proc.kill()
        proc.wait(10)
    finally:
        shutil.rmtree(base, ignore_errors=True)


_FAKE = r"""
import os, socket, sys
path, reply = sys.argv[1], bytes.fromhex(sys.argv[2])
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
os.chmod(path, 0o777)
srv.listen(1)
srv.settimeout(60)
print("ready", flush=True)
c, _ = srv.accept()
c.settimeout(30)
total = 0
while True:
    try:
        b = c.recv(65536)
    except OSError:
        break
    if not b:
        break
    if not total:
        c.sendall(reply)
    total += len(b)
print("received", total, flush=True)
"""


def test_a_daemon_of_another_uid_is_refused_before_any_byte(foreign_peer, tmp_path: Path) -> None:
    sock, proc = foreign_peer
    with pytest.raises(ConfigError, match=f"runs as uid {OTHER_UID}, not as this user") as err:
        CheckpointClient(sock, root=str(tmp_path / "ck"), placement=ONE, timeout_s=10)
    assert sock in str(err.value) and f"pid {proc.pid}" in str(err.value)
    out, _ = proc.communicate(timeout=30)
    assert out.split() == ["received", "0"]  # not even the Hello: nothing of this job reached it


def test_without_xdg_runtime_dir_the_embedded_daemon_serves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("XDG_RUNTIME_DIR", "CKPTD_SOCKET", "CKPTD_ROOT"):
        monkeypatch.delenv(var, raising=False)
    root = str(tmp_path / "ck")
    client = CheckpointClient(root=root, start_daemon=True, placement=ONE, timeout_s=30,
                              daemon_args=["--arena-size", "8MiB", "--no-prefault", "--exit-when-idle", "1"])
    assert client.socket_path == default_socket_path({}, root)
    assert os.path.dirname(client.socket_path) == f"/tmp/ckptd-{os.getuid()}"
    _save_commits(client, 1)
    assert client._welcome is not None
    pid = client._welcome.daemon_pid
    client.close()
    [proc] = [p for p in embedded._STARTED if p.pid == pid]
    assert proc.wait(30) == 0


def test_a_kubernetes_style_subfolder_the_daemon_creates(sockdir: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    volume = os.path.join(sockdir, "run")  # an emptyDir: root's, 0777
    os.mkdir(volume)
    os.chmod(volume, 0o777)
    sock = os.path.join(volume, "sock", "daemon.sock")
    d = DaemonProcess(str(tmp_path / "ck"), sock, "--arena-size", "8MiB", "--no-prefault",
                      log_path=str(tmp_path / "d.log"))
    try:
        d.wait_ready()
        assert stat.S_IMODE(os.lstat(os.path.dirname(sock)).st_mode) == 0o700
        monkeypatch.setenv("CKPTD_SOCKET", sock)
        client = CheckpointClient(root=str(tmp_path / "ck"), placement=ONE, timeout_s=30)
        _save_commits(client, 1)
        client.close()
    finally:
        assert d.stop(timeout=30) == 0
