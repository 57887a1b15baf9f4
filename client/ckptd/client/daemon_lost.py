"""What a rank does when its daemon is gone: the ``on_daemon_lost`` policy and dead-connection checks.

A checkpointer must never be the reason training stops. Under ``"warn"`` (the default) a save whose
daemon died or restarted ends ``FAILED`` with :class:`~ckptd.writer.errors.DaemonUnavailableError`
and one warning, and nothing raises into the training loop; ``"raise"`` is the strict choice.

A daemon that is there but does not answer (stopped, stuck in the kernel, its accept queue full) is lost
the same way once the client's ``timeout_s`` has passed: :class:`DaemonUnresponsiveError`, a
:class:`~ckptd.writer.errors.DaemonUnavailableError` (and a ``TimeoutError``). The connection is closed and
the arena unmapped; the next save connects again.
"""

from __future__ import annotations

import logging
import select
import socket
from typing import Literal

from ckptd.writer.errors import CkptdError, DaemonUnavailableError

log = logging.getLogger("ckptd.client.client")  # the client's logger: users filter one name

DaemonLostPolicy = Literal["warn", "raise"]
DAEMON_LOST_POLICIES: tuple[DaemonLostPolicy, ...] = ("warn", "raise")


class DaemonUnresponsiveError(DaemonUnavailableError, TimeoutError):
    """The daemon took the connection but did not answer within the client's ``timeout_s``, or accepts no
    connection at all (a stopped or stuck daemon): treated as lost. If it resumes, a step it accepted may
    still commit (``ckptd ls`` tells); the client's handle of it says ``FAILED`` all the same."""


def must_raise(error: CkptdError | None, policy: DaemonLostPolicy) -> bool:
    """Whether ``error`` goes up into the caller: always, unless it is a lost daemon under ``"warn"``."""
    return not isinstance(error, DaemonUnavailableError) or policy == "raise"


def warn_lost(rank: int, step: int, error: CkptdError | None) -> None:
    log.warning("rank %d: step %d not saved, training goes on (on_daemon_lost='warn'): %s", rank, step, error)


def peer_hung_up(sock: socket.socket) -> bool:
    """Whether the daemon closed this idle connection (it died or restarted).

    Between requests a live daemon sends nothing: readable means it hung up (EOF) or sent an unsolicited
    frame; either way the connection is done. ``select`` with a zero timeout never blocks (a ``recv``
    with ``MSG_PEEK`` would wait out the socket's timeout).
    """
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True
