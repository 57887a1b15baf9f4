"""The embedded daemon: ``CheckpointClient(start_daemon=True)`` starts the node's ``ckptd serve`` itself.

The first rank of a node that finds no daemon for its root starts one (the other ranks wait on a lock
file next to the socket, then connect to it). The daemon runs in its own session, so a Ctrl-C to the
job does not cut its drain short. It belongs to the job: it is started with ``--job-id`` and
``--owner-pid`` (:mod:`ckptd.client.ownership`) and ends by itself when either

- the owner process (the ranks' launcher, or the rank itself without one) is gone: it stops taking
  saves, drains what is in flight (committed steps stay) and exits; or
- ``--exit-when-idle``: no client has been connected and every step it holds is committed or failed
  for that long; while it keeps a committed step for an in-memory restore and its owner is a launcher
  (restarted ranks may come back to it), for ``--restore-hold`` (default 300 s) instead.

Reuse is safe by construction: the socket is per root (:func:`ckptd.client.paths.default_socket_path`)
and the client checks the daemon's root and job on connect, so a live daemon found on the socket serves
this root and this job and is reused; one of another job that is over is waited for (it drains) and then
replaced; one of another job still running is refused; a socket file left by a dead daemon is removed
and a fresh daemon started.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from ckptd.client.daemon_lost import DaemonUnresponsiveError
from ckptd.client.ownership import pid_alive
from ckptd.client.trust import make_socket_dir
from ckptd.writer.errors import ConfigError, DaemonUnavailableError

log = logging.getLogger(__name__)

DEFAULT_IDLE_EXIT_S = 30.0
ACCEPT_WAIT_S = 5.0  # how long a listener whose accept queue is full may take to make room (a live one: ms)
_STARTED: list[subprocess.Popen[bytes]] = []  # held so they are reaped (poll) once they exit, not left zombies


def _answers(path: str, timeout_s: float = ACCEPT_WAIT_S) -> bool:
    """Whether a daemon listens on ``path``: True once it takes a connection, False when nothing listens there
    (no socket file, or refused: a dead daemon's). A listener whose accept queue stays full for ``timeout_s``
    (stopped or stuck) raises :class:`DaemonUnresponsiveError`: it is neither waited for without end (the
    caller holds the node's lock) nor replaced (a second daemon would write the same root)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(max(0.01, min(1.0, deadline - time.monotonic())))  # never blocks: EAGAIN when full
            try:
                s.connect(path)
                return True
            except (BlockingIOError, TimeoutError):
                pass  # it listens, its queue is full: it may be busy accepting a burst of ranks
            except OSError:
                return False
        if time.monotonic() >= deadline:
            raise DaemonUnresponsiveError(
                f"the daemon at {path} accepts no connection (its accept queue stayed full for {timeout_s:g}s: "
                "stopped or stuck?); not starting another one for its root"
            )
        time.sleep(0.05)


def ensure_daemon(
    socket_path: str,
    root: str,
    daemon_args: Sequence[str] = (),
    *,
    idle_exit_s: float = DEFAULT_IDLE_EXIT_S,
    timeout_s: float = 60.0,
    rank: int = 0,
    job_id: str = "",
    owner_pid: int = 0,
    replacing: int = 0,
) -> int | None:
    """Make sure a daemon for ``root`` listens on ``socket_path``; start one if none answers.

    Returns the pid of the daemon this call started, or None when one already answered. Ranks of one
    node serialize on ``<socket>.lock``, so exactly one of them starts it. ``idle_exit_s``, ``job_id``
    and ``owner_pid`` are passed as ``--exit-when-idle``, ``--job-id`` and ``--owner-pid`` unless
    ``daemon_args`` already sets them. ``replacing``: the pid of another job's daemon on the socket that
    is exiting; it is waited for (up to ``timeout_s``) before a new one starts. The socket's directory is
    made ``0700`` if missing; one that is not this user's and private is refused before anything in it is
    touched (:func:`ckptd.client.trust.make_socket_dir`: :class:`ConfigError`).
    """
    make_socket_dir(os.path.dirname(socket_path) or ".")  # this user's and private, before anything inside it
    try:  # never through a symbolic link, never truncating
        fd = os.open(socket_path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot open the lock file {socket_path}.lock (a symbolic link is refused): {exc}") from exc
    with os.fdopen(fd, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank per node starts it; the others wait here
        if replacing:
            _wait_gone(replacing, timeout_s, rank)
        _STARTED[:] = [p for p in _STARTED if p.poll() is None]
        if _answers(socket_path, min(timeout_s, ACCEPT_WAIT_S)):
            return None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)  # a dead daemon's socket: never mistaken for a live one below
        args = list(daemon_args)
        for flag, value in (("--exit-when-idle", idle_exit_s), ("--job-id", job_id), ("--owner-pid", owner_pid)):
            if value and not any(a.startswith(flag) for a in args):
                args += [flag, str(value)]
        cmd = [sys.executable, "-m", "ckptd.daemon.cli", "serve", "--root", root, "--socket", socket_path, *args]
        log.info("rank %d: starting an embedded daemon: %s", rank, " ".join(cmd))
        proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)
        _STARTED.append(proc)
        deadline = time.monotonic() + timeout_s
        while not _answers(socket_path, max(0.0, min(deadline - time.monotonic(), ACCEPT_WAIT_S))):
            if proc.poll() is not None:
                raise DaemonUnavailableError(f"the embedded daemon exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                proc.kill()
                raise DaemonUnavailableError(f"the embedded daemon did not start within {timeout_s}s")
            time.sleep(0.05)
        return int(proc.pid)


def _wait_gone(pid: int, timeout_s: float, rank: int) -> None:
    """Wait for another job's exiting daemon to finish its drain (its committed steps stay)."""
    log.info("rank %d: waiting for the exiting daemon of another job (pid %d) to finish", rank, pid)
    deadline = time.monotonic() + timeout_s
    while True:
        _STARTED[:] = [p for p in _STARTED if p.poll() is None]  # reap it if this process started it
        if not pid_alive(pid):
            return
        if time.monotonic() > deadline:
            raise DaemonUnavailableError(
                f"the daemon of another job (pid {pid}) on this root's socket is still draining after {timeout_s}s"
            )
        time.sleep(0.1)
