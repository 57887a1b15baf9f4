"""The embedded daemon: ``CheckpointClient(start_daemon=True)`` starts the node's ``ckptd serve`` itself.

The first rank of a node that finds no daemon for its root starts one (the other ranks wait on a lock
file next to the socket, then connect to it). The daemon runs in its own session, so a Ctrl-C to the
job does not cut its drain short, and with ``--exit-when-idle`` it ends by itself once no client is
connected and every step it holds is committed or failed: it never outlives its job by more than the
idle time.

Reuse is safe by construction: the socket is per root (:func:`ckptd.client.paths.default_socket_path`)
and the client checks the daemon's root on connect, so a live daemon found on the socket serves this
root and is reused; a socket file left by a dead daemon is removed and a fresh daemon started.
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

from ckptd.writer.errors import DaemonUnavailableError

log = logging.getLogger(__name__)

DEFAULT_IDLE_EXIT_S = 30.0
_STARTED: list[subprocess.Popen[bytes]] = []  # held so they are reaped (poll) once they exit, not left zombies


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
        return True


def ensure_daemon(
    socket_path: str,
    root: str,
    daemon_args: Sequence[str] = (),
    *,
    idle_exit_s: float = DEFAULT_IDLE_EXIT_S,
    timeout_s: float = 60.0,
    rank: int = 0,
) -> int | None:
    """Make sure a daemon for ``root`` listens on ``socket_path``; start one if none answers.

    Returns the pid of the daemon this call started, or None when one already answered. Ranks of one
    node serialize on ``<socket>.lock``, so exactly one of them starts it. ``idle_exit_s`` is passed as
    ``--exit-when-idle`` unless ``daemon_args`` already sets it.
    """
    _STARTED[:] = [p for p in _STARTED if p.poll() is None]
    os.makedirs(os.path.dirname(socket_path) or ".", mode=0o700, exist_ok=True)
    with open(socket_path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank per node starts it; the others wait here
        if _answers(socket_path):
            return None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)  # a dead daemon's socket: never mistaken for a live one below
        args = list(daemon_args)
        if not any(a.startswith("--exit-when-idle") for a in args):
            args += ["--exit-when-idle", str(idle_exit_s)]
        cmd = [sys.executable, "-m", "ckptd.daemon.cli", "serve", "--root", root, "--socket", socket_path, *args]
        log.info("rank %d: starting an embedded daemon: %s", rank, " ".join(cmd))
        proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)
        _STARTED.append(proc)
        deadline = time.monotonic() + timeout_s
        while not _answers(socket_path):
            if proc.poll() is not None:
                raise DaemonUnavailableError(f"the embedded daemon exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                proc.kill()
                raise DaemonUnavailableError(f"the embedded daemon did not start within {timeout_s}s")
            time.sleep(0.05)
        return int(proc.pid)
