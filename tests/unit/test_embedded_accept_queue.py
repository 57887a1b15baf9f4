"""The embedded mode's check for a live daemon (``embedded._answers``) never blocks on a listener that accepts
nothing (a stopped daemon whose accept queue is full), and never replaces it with a second daemon."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ckptd.client import embedded
from ckptd.client.daemon_lost import DaemonUnresponsiveError
from ckptd.writer.errors import DaemonUnavailableError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def full_listener(sockdir: str) -> Iterator[str]:
    """A socket whose listener never accepts, its accept queue filled (what a SIGSTOPped daemon's becomes)."""
    path = os.path.join(sockdir, "hung.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    queued: list[socket.socket] = []
    try:
        for _ in range(64):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                break
            queued.append(c)
        else:
            pytest.fail("the accept queue never filled")
        yield path
    finally:
        for c in queued:
            c.close()
        srv.close()


def _in_thread(fn: Callable[[], object], limit_s: float) -> list[object]:
    """Run ``fn`` in a thread; its result or exception, or a failure if it is still blocked after ``limit_s``."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still blocked after {limit_s}s"
    return out


def test_answers_nothing_listening(sockdir: str) -> None:
    path = os.path.join(sockdir, "none.sock")
    assert embedded._answers(path, 1.0) is False  # no socket file
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # a dead daemon's socket file: connections refused
    try:
        assert embedded._answers(path, 1.0) is False
        s.listen(8)
        assert embedded._answers(path, 1.0) is True
    finally:
        s.close()


def test_answers_a_full_accept_queue_raises_in_time(full_listener: str) -> None:
    t0 = time.monotonic()
    [err] = _in_thread(lambda: embedded._answers(full_listener, 0.5), 10)
    assert isinstance(err, DaemonUnresponsiveError) and isinstance(err, DaemonUnavailableError), err
    assert "accept queue" in str(err)
    assert time.monotonic() - t0 < 5


def test_ensure_daemon_neither_blocks_on_nor_replaces_a_hung_daemon(full_listener: str, tmp_path) -> None:
    started = list(embedded._STARTED)
    [err] = _in_thread(lambda: embedded.ensure_daemon(full_listener, str(tmp_path / "ckpt"), timeout_s=0.5), 10)
    assert isinstance(err, DaemonUnresponsiveError), err
    assert os.path.exists(full_listener)  # its socket is not unlinked ...
    assert [p for p in embedded._STARTED if p not in started] == []  # ... and no second daemon is started
