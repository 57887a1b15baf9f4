"""Shared fixtures: real daemon subprocesses on a temporary root, short socket paths."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping

import pytest

from ckptd.daemon.launch import DaemonProcess


@pytest.fixture
def sockdir() -> Iterator[str]:
    # AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="ckt-", dir="/tmp")
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


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
