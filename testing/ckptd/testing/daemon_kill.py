"""Killing a real daemon at a chosen moment, for the tests of what a lost daemon leaves behind."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any


def socket_refuses(path: str) -> bool:
    """Whether nothing accepts connections on the Unix socket at ``path`` (its daemon is gone)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return True
    return False


def kill_after_staging(module: Any, caught: dict[int, bool], killed: list[int]) -> None:
    """Wrap ``module.save_checkpoint`` (the ckptd Megatron save an adapter calls) for one call: once the step
    is staged, stop its daemon; if the step has not committed (``caught[step]``), SIGKILL the daemon (its pid
    into ``killed``), else let it go on (the race was lost: the caller tries the next step)."""
    real = module.save_checkpoint

    def staged_then_killed(client: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        from ckptd.writer.format import commit_marker

        handle = real(client, step, *args, **kwargs)
        pid = client._welcome.daemon_pid
        os.kill(pid, signal.SIGSTOP)  # from here on the step commits never, or it already has
        caught[step] = not os.path.exists(os.path.join(client.root, commit_marker(step)))
        killed.extend([pid] if caught[step] else [])
        os.kill(pid, signal.SIGKILL if caught[step] else signal.SIGCONT)
        module.save_checkpoint = real
        return handle

    module.save_checkpoint = staged_then_killed
