"""The embedded daemon's tie to its job: wait for the owner process to end (``--owner-pid``).

Linux's ``pidfd_open`` makes the wait an fd that turns readable when the process exits, watched by the
event loop at no cost; without it (old kernels, other systems) the pid is polled once a second. The
process need not be a child of the daemon (the embedded daemon runs in its own session).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from ckptd.client.ownership import pid_alive

POLL_S = 1.0


async def wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` has exited (at once if it is already gone)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):  # no pidfd here: poll
        while pid_alive(pid):
            await asyncio.sleep(POLL_S)
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        if pid_alive(pid):  # a zombie's pidfd is readable too; this only skips the wait when it is gone
            await exited
    finally:
        loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
