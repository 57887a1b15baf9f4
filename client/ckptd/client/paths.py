"""Where a node's daemon listens, agreed by client and daemon without talking: one socket per root."""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Mapping

from ckptd.writer.errors import DaemonUnavailableError
from ckptd.writer.urls import normalize_root


def socket_dir(env: Mapping[str, str]) -> str:
    """``$XDG_RUNTIME_DIR/ckptd``, else ``/tmp/ckptd-<uid>`` (created ``0700`` by whoever binds first)."""
    runtime = env.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "ckptd") if runtime else f"/tmp/ckptd-{os.getuid()}"


def default_socket_path(env: Mapping[str, str], root: str | None = None) -> str:
    """``$CKPTD_SOCKET``, else a socket per root: ``<socket_dir>/<uid>-<sha256(root)[:16]>.sock``.

    ``root`` defaults to ``$CKPTD_ROOT``; with neither, ``<socket_dir>/daemon.sock``. Two roots on one
    node therefore never share a daemon unless ``CKPTD_SOCKET`` forces it (then the client's root check
    refuses the wrong one). The daemon (``daemon/config.py``) and the client both call this.
    """
    if env.get("CKPTD_SOCKET"):
        return env["CKPTD_SOCKET"]
    root = root or env.get("CKPTD_ROOT")
    if not root:
        return os.path.join(socket_dir(env), "daemon.sock")
    digest = hashlib.sha256(normalize_root(root).encode()).hexdigest()[:16]
    return os.path.join(socket_dir(env), f"{os.getuid()}-{digest}.sock")


def client_socket_path(env: Mapping[str, str], root: str | None = None) -> str:
    """The socket a client uses: :func:`default_socket_path`, except that a client told no root (no
    ``root=``, ``$CKPTD_ROOT`` or ``$CKPTD_SOCKET``) takes the one per-root socket of this user on the node
    when there is exactly one; with several it cannot choose and raises :class:`DaemonUnavailableError`."""
    path = default_socket_path(env, root)
    if root or env.get("CKPTD_SOCKET") or env.get("CKPTD_ROOT"):
        return path
    found = sorted(glob.glob(os.path.join(socket_dir(env), f"{os.getuid()}-*.sock")))
    if len(found) > 1:
        raise DaemonUnavailableError(
            f"{len(found)} ckptd daemons (one per root) listen in {socket_dir(env)}: pass root= (or set CKPTD_ROOT) "
            "to pick one"
        )
    return found[0] if found else path
