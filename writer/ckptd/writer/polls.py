"""The storage reads of a node that waits: for the commit, for the other nodes' parts.

A storage failure other than a refusal (``EIO``, a stale NFS handle, a request that outlived its retries) is
"nothing yet": the waiter polls on until its deadline and decides there as it would, so a failure that passes
never has a node report failed a step that then commits. One that lasts ends the wait at the deadline, named
in its message (:meth:`Polls.why`); it is logged at most every :data:`LOG_EVERY_S`. A permission refusal ends
the wait at once. A read that must succeed once its answer is known to exist (the commit manifest after the
marker was seen, the node's verdict claim) is retried the same way (:meth:`Polls.retried`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ckptd.writer.errors import StorageError, StoragePermissionError

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0
RETRY_S = 30.0  # how long a read whose answer exists is retried past the wait's own deadline

_T = TypeVar("_T")


class Polls:
    """The reads of one wait for ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.error: StorageError | None = None  # the last failure, for the timeout's message
        self._logged = -math.inf

    async def read(self, probe: Awaitable[_T], otherwise: _T) -> _T:
        """``probe``'s answer, or ``otherwise`` where storage failed (not refused)."""
        try:
            return await probe
        except StoragePermissionError:
            raise
        except StorageError as exc:
            self.error = exc
            if time.monotonic() - self._logged >= LOG_EVERY_S:
                self._logged = time.monotonic()
                log.warning("step=%d: a storage read while waiting failed; polling on: %s", self.step, exc)
            return otherwise

    async def retried(self, make: Callable[[], Awaitable[_T]], until: float | None = None) -> _T:
        """``make()``'s answer, tried again each second on a failure that is not a refusal, until ``until``
        (monotonic; default :data:`RETRY_S` from now), then its error."""
        until = time.monotonic() + RETRY_S if until is None else until
        while True:
            try:
                return await make()
            except StoragePermissionError:
                raise
            except StorageError as exc:
                self.error = exc
                if time.monotonic() >= until:
                    raise
            await asyncio.sleep(1.0)

    def why(self) -> str:
        """A suffix for the timeout's message: the storage failure met meanwhile, if any."""
        return "" if self.error is None else f" (storage reads failed meanwhile, the last: {self.error})"
