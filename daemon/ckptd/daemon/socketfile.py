"""The daemon's socket path: its private directory, one daemon per socket, and removing only its own socket.

The directory is created ``0700`` when missing; an existing one must be a real directory (not a link) of
this user's that no other user can enter, and is never changed: a folder the daemon did not make is not
its to fix. While a daemon runs it holds an exclusive ``flock`` on ``<socket>.daemon.lock`` (released by
the kernel when the process ends, ``kill -9`` included), so a second daemon on the same socket fails at
start instead of taking the socket, and the journal beside it, over. Before binding, a file at the
socket path is removed only if it is a socket nothing answers on; at exit the socket is removed only if
it is still the one this daemon bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import stat

from ckptd.writer.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".daemon.lock"  # not the embedded starter's "<socket>.lock", held while a daemon starts
STALE_WAIT_S = 3.0  # a killed daemon's socket may accept connections for a moment: how long to re-probe
_PROBE_EVERY_S = 0.1


def prepare_socket_dir(path: str) -> None:
    """Create the socket's directory ``0700`` (and its missing parents, also ``0700``), or insist that the
    existing one is a real directory of this user's closed to others; anything else is a
    :class:`ConfigError` saying what to give ``--socket`` instead. Only a directory made here is chmodded."""
    d = os.path.dirname(path) or "."
    try:
        created = _make_missing(d)
        st = os.lstat(d)
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(
                f"socket directory {d} is a symbolic link (to {os.readlink(d)}): the daemon follows no link to its "
                "socket's directory; give --socket (or CKPTD_SOCKET) a path in the real directory, or in a missing "
                "one it creates (0700)"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"socket directory {d} (--socket {path}) exists but is not a directory")
        if st.st_uid != os.getuid():
            raise ConfigError(
                f"socket directory {d} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): give "
                "--socket (or CKPTD_SOCKET) a path in a directory of this user's, or one the daemon may create "
                "(it makes a missing one 0700)"
            )
        mode = stat.S_IMODE(st.st_mode)
        if created and mode != 0o700:  # a umask that took the owner's own bits: the daemon's folder, fixed
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
            mode = 0o700
    except OSError as exc:
        raise ConfigError(f"cannot prepare the socket directory {d} (--socket {path}): {exc}") from exc
    if mode & 0o077:
        example = os.path.join(d, "ckptd", os.path.basename(path))
        raise ConfigError(
            f"socket directory {d} is open to other users (mode {mode:04o}) and the daemon changes no directory it "
            "did not create: put the socket in a private folder (mode 0700) of this user's, or let ckptd create one "
            f"(a --socket in a directory that does not exist yet, e.g. {example})"
        )


def _make_missing(d: str) -> bool:
    """Create ``d`` and its missing parents, each ``0700``; True if ``d`` itself was made here."""
    missing: list[str] = []
    p = os.path.abspath(d)
    while not os.path.lexists(p) and p not in missing:
        missing.append(p)
        p = os.path.dirname(p)
    made = False
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
            made = p == missing[0]
        except FileExistsError:  # made meanwhile (another rank's embedded start): checked like any other
            made = False
    return made


async def claim_socket(path: str, stale_wait_s: float = STALE_WAIT_S) -> SocketClaim:
    """This daemon's hold on ``path`` (its directory prepared): the lock taken, and a dead daemon's socket
    removed. :class:`ConfigError` when another daemon holds the lock or answers on ``path``, or when
    something other than a socket sits there."""
    claim = SocketClaim(path, _lock(path + LOCK_SUFFIX, path))
    try:
        await claim.clear(stale_wait_s)
    except BaseException:
        claim.release()
        raise
    return claim


class SocketClaim:
    """The lock on a socket path, held from before the daemon binds until it exits, and what it bound."""

    def __init__(self, path: str, lock_fd: int) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket this daemon bound

    async def clear(self, stale_wait_s: float = STALE_WAIT_S) -> None:
        """Make ``path`` free for bind: nothing there, or a socket no one answers on (removed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + stale_wait_s
        while True:
            try:
                st = os.lstat(self.path)
            except FileNotFoundError:
                return
            if not stat.S_ISSOCK(st.st_mode):
                raise ConfigError(
                    f"--socket {self.path} is {_kind(st.st_mode)}, not a socket: the daemon removes nothing at its "
                    "socket path but a dead daemon's socket; give --socket a free path"
                )
            if not _answers(self.path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                log.info("removed the socket of a daemon that is gone: %s", self.path)
                return
            if loop.time() >= deadline:
                raise ConfigError(
                    f"a daemon already listens on {self.path}: stop it first, or give this one another --socket"
                )
            await asyncio.sleep(_PROBE_EVERY_S)

    def bound(self) -> None:
        """Record the socket just bound at ``path``: :meth:`unlink_socket` removes that one only."""
        st = os.lstat(self.path)
        self._bound = (st.st_dev, st.st_ino)

    def unlink_socket(self) -> None:
        """Remove the socket this daemon bound, if it still sits at ``path`` (never another's)."""
        if self._bound is None:
            return
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        else:
            log.warning("%s is no longer the socket this daemon bound: left in place", self.path)
        self._bound = None

    def release(self) -> None:
        """Remove the lock file (while still holding it: a daemon starting meanwhile retries) and let go."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path + LOCK_SUFFIX):
                os.unlink(self.path + LOCK_SUFFIX)
        except OSError as exc:
            log.warning("cannot remove the daemon's lock file %s: %s", self.path + LOCK_SUFFIX, exc)
        finally:
            os.close(fd)


def _lock(lock_path: str, socket_path: str) -> int:
    """An open descriptor of ``lock_path`` under this process's exclusive ``flock``, the pid written in it."""
    for _ in range(10):  # a file its holder removed between our open and our lock: open the new one
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open the daemon's lock file {lock_path}: {exc}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"the daemon's lock file {lock_path} is not a regular file: remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise ConfigError(
                    f"a daemon already listens on {socket_path} (pid {holder} holds {lock_path}): stop it first, "
                    "or give this one another --socket"
                ) from None
            if _same_file(fd, lock_path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise ConfigError(f"cannot take the daemon's lock file {lock_path}: it keeps being replaced")


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _answers(path: str) -> bool:
    """Whether a process listens on the socket at ``path`` (a connection is accepted or queued)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except BlockingIOError:  # its accept queue is full: a listener, busy
        return True
    except OSError as exc:
        raise ConfigError(f"cannot tell whether a daemon listens on {path}: {exc}") from exc
    finally:
        probe.close()
    return True


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a file"),
                       (stat.S_ISFIFO, "a FIFO")):
        if test(mode):
            return name
    return "a special file"
