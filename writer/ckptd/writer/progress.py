"""Progress of long, byte-bound work: ``ckptd merge``, ``ckptd verify``, a load.

On a terminal a tqdm bar (bytes, rate, ETA); elsewhere (a job's log, many ranks sharing one stderr) a log
line at most every ``every_s`` seconds, the first after ``every_s`` (work shorter than that logs nothing),
and one when it ends if any was written. Thread-safe: a load's read threads advance it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, TextIO

log = logging.getLogger(__name__)


class ByteProgress:
    """Bytes done of ``total`` for ``what`` (``total`` may grow: :meth:`expect`)."""

    def __init__(self, what: str, total: int = 0, *, out: TextIO | None = None, every_s: float = 30.0,
                 logger: logging.Logger = log) -> None:
        self.what, self.total, self.done, self.every_s, self.logger = what, total, 0, every_s, logger
        self.t0 = self._last = time.monotonic()
        self._logged = False
        self._lock = threading.Lock()
        self.bar: Any = None
        if out is not None and out.isatty():
            from tqdm import tqdm  # imported only for a terminal: a rank's loads never draw a bar

            self.bar = tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024, file=out,
                            dynamic_ncols=True)

    def expect(self, nbytes: int) -> None:
        """``nbytes`` more to do (work planned in rounds)."""
        with self._lock:
            self.total += nbytes
            if self.bar is not None:
                self.bar.total = self.total
                self.bar.refresh()

    def advance(self, nbytes: int, note: str = "") -> None:
        with self._lock:
            self.done += nbytes
            if self.bar is not None:
                self.bar.update(nbytes)
                return
            now = time.monotonic()
            if now - self._last >= self.every_s:
                self._last, self._logged = now, True
                self._log(now, note)

    def close(self, done: bool = True) -> None:
        """The end: ``done`` False when the work failed (the last line says "stopped", not "finished")."""
        with self._lock:
            if self.bar is not None:
                self.bar.close()
            elif self._logged:
                self._log(time.monotonic(), "finished" if done else "stopped")

    def _log(self, now: float, note: str) -> None:
        elapsed = now - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 and self.total > self.done else 0.0
        pct = 100.0 * self.done / self.total if self.total else 100.0
        self.logger.info("%s: %s%.1f%% (%.0f of %.0f MiB, %.0f MiB/s, %.0fs, ETA %.0fs)", self.what,
                         f"{note}, " if note else "", pct, self.done / 2**20, self.total / 2**20, rate / 2**20,
                         elapsed, eta)
