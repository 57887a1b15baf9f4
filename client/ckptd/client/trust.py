"""What a client trusts: a socket in a directory of its own user's, a daemon of that user, an arena only it can read.

The socket and the staging arena belong to the job's user only. A client connects only through a socket
directory that is a real directory (not a symbolic link) owned by its effective uid with no group or other
access (the daemon makes a missing one ``0700``), hands tensors only to a peer whose uid (``SO_PEERCRED``) is
its own, and maps only an arena file that is a regular file of its own with no group or other access. Anything
else is someone else's: a :class:`~ckptd.writer.errors.ConfigError` naming the path and what is wrong, never a
lost daemon (which ``on_daemon_lost="warn"`` would let training run on past).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct

from ckptd.writer.errors import ConfigError, DaemonUnavailableError

_FIX = "point CKPTD_SOCKET (or XDG_RUNTIME_DIR, or --socket) at a directory of this user's"


def _private(st: os.stat_result, what: str, fix: str) -> None:
    """Raise :class:`ConfigError` unless ``st`` (of ``what``) is this user's with no group or other access."""
    me, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if st.st_uid != me:
        raise ConfigError(f"{what} belongs to uid {st.st_uid}, not to this user (uid {me}): refusing it; {fix}")
    if mode & 0o077:
        raise ConfigError(f"{what} has mode {mode:#o}: group or others may access it, ckptd uses it only when it is "
                          f"this user's alone (no group or other permission bits): refusing it; {fix}")


def check_socket_dir(d: str) -> None:
    """Refuse the socket directory ``d`` unless it is a real directory of this user's with no group or other
    access (:class:`ConfigError`). A missing one raises :class:`FileNotFoundError`: no daemon made it yet."""
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"socket directory {d} is a symbolic link (to {os.readlink(d)}): refusing it; {_FIX}")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket directory {d} is not a directory: refusing it; {_FIX}")
    _private(st, f"socket directory {d}", _FIX)


def make_socket_dir(d: str) -> None:
    """Create the socket directory ``d`` ``0700`` if it is missing, then :func:`check_socket_dir` it."""
    try:
        with contextlib.suppress(FileExistsError):  # whatever is there is checked below
            os.makedirs(d, mode=0o700)
        check_socket_dir(d)
    except OSError as exc:
        raise ConfigError(f"cannot create or inspect the socket directory {d}: {exc}; {_FIX}") from exc


def connect_own(path: str, timeout_s: float) -> socket.socket:
    """A connection to the daemon socket at ``path``, checked to be this user's: its directory passes
    :func:`check_socket_dir` and the listening process runs as this effective uid (root: root's only).

    Nothing there (no directory, no socket, refused): :class:`DaemonUnavailableError`; anything not this
    user's: :class:`ConfigError`."""
    d = os.path.dirname(path) or "."
    try:
        check_socket_dir(d)
    except FileNotFoundError as exc:
        raise DaemonUnavailableError(f"no ckptd daemon at {path}: its directory {d} does not exist") from exc
    except OSError as exc:
        raise ConfigError(f"cannot inspect the socket directory {d} of {path}: {exc}") from exc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)  # no socket file, refused, or its accept backlog full (EAGAIN)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError as exc:
        sock.close()
        raise DaemonUnavailableError(f"no ckptd daemon at {path}: {exc}") from exc
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.geteuid():
        sock.close()
        raise ConfigError(f"the process listening on {path} (pid {pid or 'unknown'}) runs as uid {uid}, not as this "
                          f"user (uid {os.geteuid()}): refusing to hand it tensors; {_FIX}")
    return sock


def open_arena(path: str) -> int:
    """A read-write descriptor of the daemon's arena file ``path``, checked to be a regular file of this user's
    with no group or other access (not followed if a symbolic link): else :class:`ConfigError`. A missing file
    raises :class:`OSError` (the caller's: a daemon it cannot use)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"the daemon's staging arena {path} is a symbolic link: refusing to map it") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"the daemon's staging arena {path} is not a regular file: refusing to map it")
        _private(st, f"the daemon's staging arena {path}", "a daemon of this user's makes it 0600")
    except BaseException:
        os.close(fd)
        raise
    return fd
