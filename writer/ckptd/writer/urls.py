"""The one spelling of a checkpoint root (pure; no storage library imported).

Client and daemon compare roots and derive the socket name from this form, and the backends open it, so
``./ck``, ``ck/``, ``file:///abs/ck`` and ``/abs/ck`` all name the same root.
"""

from __future__ import annotations

import os
import re

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def normalize_root(root: str) -> str:
    """An absolute, normalized local path, or a URL with a lower-case scheme and no trailing ``/``."""
    if root.lower().startswith("file:"):
        root = root[len("file:"):].removeprefix("//")
    elif _URL.match(root):
        scheme, rest = root.split("://", 1)
        return f"{scheme.lower()}://{rest.rstrip('/')}"
    return os.path.normpath(os.path.abspath(os.path.expanduser(root)))


def is_local(root: str) -> bool:
    """Whether ``root`` names a local directory."""
    return _URL.match(normalize_root(root)) is None
