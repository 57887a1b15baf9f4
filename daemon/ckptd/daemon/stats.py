"""What a running daemon has done, for operators: counters behind ``ckptd status`` and the metrics.

:class:`DaemonStats` is fed by the service (each accepted save's stall as the client measured it, each
finished step) and read by :func:`status_report`; the Prometheus exporter (metrics.py) subclasses it
to observe the same events. No I/O here.
"""

from __future__ import annotations

import os
import time

from ckptd.client.protocol import PROTOCOL_VERSION, StatusReport, StepReport, StepState
from ckptd.daemon.arena import Arena
from ckptd.daemon.job import StepJob
from ckptd.writer.backends import Backend


class DaemonStats:
    """Counters since the daemon started. Subclasses may observe more (see metrics.py)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.commits = 0
        self.failures = 0
        self.bytes_written = 0
        self.bytes_per_s = 0.0
        self.last_error = ""
        self.metrics_url = ""  # where the Prometheus endpoint serves, once bound (metrics.py); "" = off

    def on_save(self, stall_s: float) -> None:
        """A rank's save was accepted; ``stall_s`` is how long the rank was blocked (client-measured)."""

    def on_step_end(self, job: StepJob, took_s: float) -> None:
        """A step reached a final state on this node, ``took_s`` after its first rank saved."""
        if job.state is StepState.COMMITTED:
            self.commits += 1
            self.bytes_written += job.nbytes
            self.bytes_per_s = job.nbytes / took_s if took_s > 0 else 0.0
        elif job.state is StepState.FAILED:
            self.failures += 1
            if job.durable_at:  # the node's data reached storage before the step failed
                self.bytes_written += job.nbytes
            self.last_error = f"step {job.step}: {type(job.error).__name__}: {job.error}"


def status_report(
    stats: DaemonStats, jobs: dict[int, StepJob], arena: Arena, backend: Backend, *, root: str, draining: bool,
    retained: int = 0,
    retain: bool = True,
    job_id: str = "",
    owner_pid: int = 0,
    socket: str = "",
) -> StatusReport:
    """The reply to ``ckptd status``: every step the daemon holds a record of, newest first."""
    now = time.monotonic()
    steps = [
        StepReport(
            step=j.step, state=j.state, node=j.node, ranks_saved=len(j.saves),
            local_world_size=j.where.local_world_size, nbytes=j.nbytes, age_s=now - j.started,
            error=str(j.error) if j.error else "",
        )
        for j in sorted(jobs.values(), key=lambda j: -j.step)
    ]
    return StatusReport(
        v=PROTOCOL_VERSION, daemon_pid=os.getpid(), root=root, uptime_s=now - stats.started, draining=draining,
        arena_bytes=arena.size, arena_free_bytes=arena.free_bytes, leases=arena.leases,
        in_flight=sum(1 for j in jobs.values() if not j.final), steps=steps, commits=stats.commits,
        failures=stats.failures, bytes_written=stats.bytes_written, bytes_per_s=stats.bytes_per_s,
        retries=backend.metrics.retries if backend.metrics is not None else 0, last_error=stats.last_error,
        arena_retained_bytes=retained, retain=retain, job_id=job_id, owner_pid=owner_pid, socket=socket,
        arena_ahead_bytes=arena.ahead_bytes, arena_waiting=arena.waiting, metrics_url=stats.metrics_url,
    )
