"""Where a node's daemon listens, agreed by client and daemon without talking: one socket per root."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def normalize_root(root: str) -> str:
    """The one spelling of a checkpoint root: an absolute, normalized path, or a URL without a trailing ``/``.

    Client and daemon compare roots (and derive the socket name) from this form, so ``./ck``, ``ck/``
    and ``/abs/ck`` name the same root.
    """
    if root.lower().startswith("file:"):
        root = root[len("file:"):].removeprefix("//")
    elif _URL.match(root):
        scheme, rest = root.split("://", 1)
        return f"{scheme.lower()}://{rest.rstrip('/')}"
    return os.path.normpath(os.path.abspath(os.path.expanduser(root)))


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
