"""Where a node's daemon listens, agreed by client and daemon without talking."""

from __future__ import annotations

import os
from collections.abc import Mapping


def default_socket_path(env: Mapping[str, str]) -> str:
    """``$CKPTD_SOCKET``, else ``$XDG_RUNTIME_DIR/ckptd/daemon.sock``, else ``/tmp/ckptd-<uid>/daemon.sock``.

    The directory is created ``0700`` by the daemon, so only its user can reach the socket.
    """
    if env.get("CKPTD_SOCKET"):
        return env["CKPTD_SOCKET"]
    runtime = env.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "ckptd") if runtime else f"/tmp/ckptd-{os.getuid()}"
    return os.path.join(base, "daemon.sock")
