"""The client's side of "the socket and the shared memory belong to the job's user only" (review 47, items 1-2):
the staging arena it maps and the lock file the embedded mode opens next to the socket. The connection's own
checks (socket directory, the daemon's uid) run against real daemons in ``tests/integration/test_socket_trust.py``."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.client import embedded
from ckptd.client.staging import StagingArena
from ckptd.writer.errors import ConfigError, DaemonUnavailableError

pytestmark = pytest.mark.timeout(60)
OTHER_UID = 2002  # a uid nobody here runs as; only root can give it a file
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid (chown) needs root")
N = 1 << 16


def _file(path: Path, mode: int = 0o600, content: bytes = b"\0" * N) -> Path:
    path.write_bytes(content)
    os.chmod(path, mode)
    return path


def _mapped(path: str) -> StagingArena:
    arena = StagingArena()
    arena.map(path, N)
    return arena


def test_a_private_arena_of_this_user_is_mapped(tmp_path: Path) -> None:
    path = _file(tmp_path / "arena")
    arena = _mapped(str(path))
    assert arena.mm is not None
    arena.mm[:4] = b"ckpt"
    arena.close()
    assert path.read_bytes()[:4] == b"ckpt"  # shared with the file: what the daemon reads


def test_an_arena_behind_a_symlink_is_refused(tmp_path: Path) -> None:
    target = _file(tmp_path / "elsewhere")
    (tmp_path / "arena").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link") as err:
        _mapped(str(tmp_path / "arena"))
    assert str(tmp_path / "arena") in str(err.value)
    assert not isinstance(err.value, DaemonUnavailableError)  # refused, not a lost daemon to warn about


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o606])
def test_an_arena_others_may_access_is_refused(tmp_path: Path, mode: int) -> None:
    path = _file(tmp_path / "arena", mode)
    with pytest.raises(ConfigError, match=f"mode {mode:#o}") as err:
        _mapped(str(path))
    assert str(path) in str(err.value)


def test_an_arena_that_is_no_regular_file_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "arena", 0o600)  # opened read-write without blocking, then refused
    with pytest.raises(ConfigError, match="not a regular file"):
        _mapped(str(tmp_path / "arena"))


@needs_root
def test_an_arena_of_another_user_is_refused(tmp_path: Path) -> None:
    path = _file(tmp_path / "arena")
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"belongs to uid {OTHER_UID}"):
        _mapped(str(path))


def test_a_missing_arena_is_still_a_lost_daemon(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailableError, match="stale-arena cleanup"):
        _mapped(str(tmp_path / "gone"))


# --- the embedded mode's lock file -----------------------------------------------------------------------
@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the user's that a lock file planted as a symlink must never truncate."""
    return _file(tmp_path / "precious.txt", 0o644, b"precious")


@pytest.fixture
def no_new_daemons() -> Iterator[None]:
    """Fail a test whose ensure_daemon started a daemon (and kill it: on the code before the fix it does)."""
    before = list(embedded._STARTED)
    yield
    new = [p for p in embedded._STARTED if p not in before]
    for p in new:
        with contextlib.suppress(OSError):
            p.kill()
            p.wait(10)
    assert new == [], "ensure_daemon started a daemon"


def _plant_lock(d: str, victim: Path) -> str:
    sock = os.path.join(d, "x.sock")
    os.symlink(victim, sock + ".lock")
    return sock


def _ensure(sock: str, tmp_path: Path) -> None:
    embedded.ensure_daemon(sock, str(tmp_path / "ckpt"), ["--arena-size", "4MiB", "--no-prefault"], timeout_s=5)


@pytest.mark.usefixtures("no_new_daemons")
def test_a_lock_symlink_in_a_shared_socket_dir_is_refused_untouched(sockdir: str, tmp_path: Path, victim: Path) -> None:
    shared = os.path.join(sockdir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)  # what another user could have made first
    sock = _plant_lock(shared, victim)
    with pytest.raises(ConfigError, match="mode 0o777") as err:
        _ensure(sock, tmp_path)
    assert f"socket directory {shared}" in str(err.value)
    assert victim.read_bytes() == b"precious"
    assert stat.S_IMODE(os.lstat(shared).st_mode) == 0o777  # not "fixed" by a chmod either


@pytest.mark.usefixtures("no_new_daemons")
def test_a_lock_symlink_in_the_users_own_dir_is_not_followed(sockdir: str, tmp_path: Path, victim: Path) -> None:
    sock = _plant_lock(sockdir, victim)
    with pytest.raises(ConfigError, match="lock file") as err:
        _ensure(sock, tmp_path)
    assert sock + ".lock" in str(err.value)
    assert victim.read_bytes() == b"precious"


@pytest.mark.usefixtures("no_new_daemons")
def test_a_symlinked_socket_dir_is_refused(sockdir: str, tmp_path: Path, victim: Path) -> None:
    real = os.path.join(sockdir, "real")
    os.mkdir(real, 0o700)
    link = os.path.join(sockdir, "link")
    os.symlink(real, link)
    with pytest.raises(ConfigError, match="symbolic link"):
        _ensure(os.path.join(link, "x.sock"), tmp_path)
    assert os.listdir(real) == []  # nothing made in it


@needs_root
@pytest.mark.usefixtures("no_new_daemons")
def test_a_socket_dir_of_another_user_is_refused(sockdir: str, tmp_path: Path, victim: Path) -> None:
    theirs = os.path.join(sockdir, "theirs")
    os.mkdir(theirs, 0o700)
    sock = _plant_lock(theirs, victim)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    try:
        with pytest.raises(ConfigError, match=f"belongs to uid {OTHER_UID}"):
            _ensure(sock, tmp_path)
        assert victim.read_bytes() == b"precious"
        assert os.listdir(theirs) == ["x.sock.lock"]  # only what was planted
    finally:
        shutil.rmtree(theirs, ignore_errors=True)


def test_the_lock_file_is_private_and_never_truncated(sockdir: str, tmp_path: Path) -> None:
    sock = os.path.join(sockdir, "live.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock)
    srv.listen(8)  # a daemon already answers: ensure_daemon only takes the lock and returns
    lock = _file(Path(sock + ".lock"), 0o600, b"held")
    old_umask = os.umask(0o022)
    try:
        assert embedded.ensure_daemon(sock, str(tmp_path / "ckpt"), timeout_s=5) is None
        assert lock.read_bytes() == b"held"  # opened, not truncated
        lock.unlink()
        assert embedded.ensure_daemon(sock, str(tmp_path / "ckpt"), timeout_s=5) is None
    finally:
        os.umask(old_umask)
        srv.close()
    st = os.lstat(lock)  # made anew: 0600 whatever the umask lets through
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
