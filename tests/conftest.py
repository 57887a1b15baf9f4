"""Shared fixtures: real daemon subprocesses on a temporary root, short socket paths, and the S3
server and fault proxy of the S3 tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

from ckptd.testing.fixtures import BUCKET
from ckptd.testing.launch import DaemonProcess, socket_dir

# No time limit per generated example: the suite runs two tests at a time (pytest-xdist, bootstrap.sh) on
# 2-core machines, where one example's wall time says nothing. Each test's example count stays its own.
settings.register_profile("ckptd", deadline=None)
settings.load_profile("ckptd")

if TYPE_CHECKING:
    from ckptd.testing.faultproxy import FaultProxy
    from ckptd.testing.s3server import S3Server


@pytest.fixture
def sockdir() -> Iterator[str]:
    with socket_dir("ckt-") as d:
        yield d


@pytest.fixture(scope="module")
def module_sockdir() -> Iterator[str]:
    """:func:`sockdir` for module-scoped daemons."""
    with socket_dir("ckm-") as d:
        yield d


@pytest.fixture
def start_daemon(sockdir: str, tmp_path: os.PathLike[str]) -> Iterator[Callable[..., DaemonProcess]]:
    """``start_daemon(root, name="d0", *flags, env=None)`` starts ``ckptd serve`` and waits until it listens."""
    started: list[DaemonProcess] = []

    def start(
        root: str, name: str = "d0", *flags: str, arena: str = "64MiB", env: Mapping[str, str] | None = None
    ) -> DaemonProcess:
        d = DaemonProcess(
            root, os.path.join(sockdir, f"{name}.sock"), "--arena-size", arena, "--no-prefault", *flags,
            env=env, log_path=os.path.join(str(tmp_path), f"{name}.log"),
        )
        started.append(d)
        return d.wait_ready()

    yield start
    for d in started:
        d.stop(timeout=20)


# --- S3 -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """A moto server (no auth: any credentials work) with the bucket ``ckptd.testing.fixtures.BUCKET``."""
    from ckptd.testing.s3server import S3Server

    with S3Server() as server:
        server.make_bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def s3_options(s3: S3Server) -> Iterator[dict[str, object]]:
    """fsspec storage options for :func:`s3`, with its credentials in the environment for the module."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env().items():
            mp.setenv(key, value)
        yield {"endpoint_url": s3.endpoint_url, "region": "us-east-1", "addressing_style": "path"}


@pytest.fixture(scope="module")
def s3_auth() -> Iterator[S3Server]:
    """Like :func:`s3`, but checking signatures: only ``s3_auth.credentials`` are accepted."""
    from ckptd.testing.s3server import S3Server

    with S3Server(auth=True) as server:
        server.make_bucket(BUCKET)
        yield server


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of :func:`s3` (no faults until a test sets some)."""
    from ckptd.testing.faultproxy import FaultProxy

    with FaultProxy(s3.endpoint_url) as p:
        yield p


@pytest.fixture
def host_buffers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Every host buffer a load's stage pool makes (:func:`ckptd.client.stagepool.host_buffer`): its size and
    whether it was asked page-locked. A buffer asked so where CUDA is up must be pinned, and no other."""
    import torch

    from ckptd.client import stagepool

    made: list[tuple[int, bool]] = []
    real = stagepool.host_buffer

    def recorded(nbytes: int, *, pin: bool = False) -> torch.Tensor:
        made.append((nbytes, pin))
        buf = real(nbytes, pin=pin)
        assert buf.is_pinned() == (pin and torch.cuda.is_available())
        return buf

    monkeypatch.setattr(stagepool, "host_buffer", recorded)
    return made
