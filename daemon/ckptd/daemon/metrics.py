"""Opt-in Prometheus metrics (``ckptd serve --metrics-port N``), served by ``prometheus-client``.

The exporter is a :class:`~ckptd.daemon.stats.DaemonStats` that also observes into its own registry
(not the process-global one, so tests and embedded uses never collide): the save stall as each client
measured it, each step's drain time, bytes written, commits and failures; arena use, steps in flight
and storage retries are read at scrape time. ``prometheus_client`` is imported only when enabled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ckptd.client.protocol import StepState
from ckptd.daemon.arena import Arena
from ckptd.daemon.job import StepJob
from ckptd.daemon.stats import DaemonStats
from ckptd.writer.backends import Backend
from ckptd.writer.errors import ConfigError

log = logging.getLogger(__name__)

STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DRAIN_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class PrometheusStats(DaemonStats):
    """The daemon's counters, also exported as Prometheus metrics."""

    def __init__(self, registry: CollectorRegistry, arena: Arena, backend: Backend) -> None:
        super().__init__()
        self.registry = registry
        self.stall = Histogram("ckptd_save_stall_seconds", "Time a rank was blocked in save(), as the client "
                               "measured it up to handing the save over", buckets=STALL_BUCKETS, registry=registry)
        self.drain = Histogram("ckptd_step_drain_seconds", "From a step's first save on this node to its commit",
                               buckets=DRAIN_BUCKETS, registry=registry)
        self.written = Counter(
            "ckptd_bytes_written", "Bytes written by this node for steps that reached storage (durable or committed)",
            registry=registry,
        )
        self.committed = Counter("ckptd_steps_committed", "Steps committed", registry=registry)
        self.failed = Counter("ckptd_steps_failed", "Steps that failed on this node", registry=registry)
        registry.register(_LiveCollector(self, arena, backend))

    def on_save(self, stall_s: float) -> None:
        if stall_s > 0:
            self.stall.observe(stall_s)

    def on_step_end(self, job: StepJob, took_s: float) -> None:
        before = self.bytes_written
        super().on_step_end(job, took_s)
        self.written.inc(self.bytes_written - before)
        if job.state is StepState.COMMITTED:
            self.committed.inc()
            self.drain.observe(took_s)
        elif job.state is StepState.FAILED:
            self.failed.inc()


class _LiveCollector(Collector):
    """Values read at scrape time: arena use, steps in flight, storage retries."""

    def __init__(self, stats: PrometheusStats, arena: Arena, backend: Backend) -> None:
        self._stats = stats
        self._arena = arena
        self._backend = backend

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        arena = self._arena
        yield GaugeMetricFamily("ckptd_arena_bytes", "Size of the staging arena", value=arena.size)
        yield GaugeMetricFamily("ckptd_arena_used_bytes", "Staging arena bytes held by saves",
                                value=arena.size - arena.free_bytes)
        yield GaugeMetricFamily("ckptd_arena_leases", "Staging leases held", value=arena.leases)
        yield GaugeMetricFamily("ckptd_arena_ahead_bytes", "Staging arena bytes granted ahead for clients' next saves",
                                value=arena.ahead_bytes)
        yield GaugeMetricFamily("ckptd_arena_waiting", "Lease requests waiting for staging space", value=arena.waiting)
        metrics = self._backend.metrics
        yield CounterMetricFamily("ckptd_storage_retries", "Storage requests retried (S3)",
                                  value=metrics.retries if metrics is not None else 0)


def serve_metrics(port: int, host: str, arena: Arena, backend: Backend) -> PrometheusStats:
    """Start the HTTP endpoint (a daemon thread of prometheus-client) and return the stats feeding it."""
    registry = CollectorRegistry(auto_describe=True)
    stats = PrometheusStats(registry, arena, backend)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # port taken, address not local: say which option is wrong
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    where = f"[{host}]" if ":" in host else host
    stats.metrics_url = f"http://{where}:{server.server_port}/metrics"
    log.info("metrics on %s", stats.metrics_url)
    return stats
