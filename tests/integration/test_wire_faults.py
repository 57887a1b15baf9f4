"""Messages the daemon cannot use get a typed answer, and cost only that request or that connection (review 47,
item 10 and the frame-level findings): a message nested deeper than the decoder goes is a ``ProtocolError`` on a
connection that keeps working; a frame whose header stops half-way times out like one whose body does; an
answer above ``max_frame_bytes`` becomes a ``ProtocolError`` answer; a bug while handling a request is an
``InternalError`` answer, the connection kept."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgspec
import pytest
import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.client.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    ReportRequest,
    StatusRequest,
    StepState,
    Welcome,
)
from ckptd.daemon.config import load_config
from ckptd.daemon.server import serve
from ckptd.daemon.service import CheckpointService
from ckptd.testing.wire import RawPeer

pytestmark = pytest.mark.timeout(120)
V = PROTOCOL_VERSION
ONE = Placement(0, 1, 1, 0)


def deep_save(levels: int) -> bytes:
    """A SaveRequest whose ``objects`` hold a value nested ``levels`` lists deep."""
    placeholder = msgspec.msgpack.encode("PLACEHOLDER")
    body = msgspec.msgpack.encode({
        "v": V, "type": "save", "step": 1, "rank": 0, "world_size": 1, "node": 0, "num_nodes": 1,
        "local_world_size": 1, "lease_id": 1, "shards": [], "objects": {"x": "PLACEHOLDER"},
    })
    return body.replace(placeholder, b"\x91" * levels + b"\xc0")


def test_a_deeply_nested_message_is_a_protocol_error_and_the_connection_goes_on(start_daemon, tmp_path: Path) -> None:
    d = start_daemon(str(tmp_path / "ckpt"))
    peer = RawPeer(d.socket)
    reply = peer.send(deep_save(200_000))
    assert isinstance(reply, ErrorReply) and reply.code == "ProtocolError", reply
    assert "recursion" in reply.message, reply.message
    welcome = peer.call(Hello(v=V, pid=1, rank=0))  # the frame was whole: the same connection still works
    assert isinstance(welcome, Welcome) and welcome.daemon_pid == d.pid
    client = CheckpointClient(d.socket, placement=ONE, timeout_s=30)
    assert client.save(1, {"w": torch.arange(4.0)}).wait(30).state is StepState.COMMITTED
    client.close()


def test_a_frame_header_cut_short_times_out(start_daemon, tmp_path: Path) -> None:
    d = start_daemon(str(tmp_path / "ckpt"), env={"CKPTD_READ_TIMEOUT_S": "1"})
    idle = RawPeer(d.socket)  # a client quiet between requests: no timeout for it
    peer = RawPeer(d.socket, timeout=15)
    t0 = time.monotonic()
    peer.sock.sendall(HEADER.pack(16)[:2])  # then silence
    reply = peer.recv()
    assert isinstance(reply, ErrorReply) and reply.code == "ProtocolError" and "incomplete frame" in reply.message
    assert time.monotonic() - t0 < 10
    with pytest.raises(ConnectionResetError):
        peer.recv()  # and then the connection is closed
    time.sleep(1.5)
    assert isinstance(idle.call(Hello(v=V, pid=1, rank=0)), Welcome)


def test_an_answer_above_the_frame_limit_is_a_typed_error(start_daemon, tmp_path: Path) -> None:
    d = start_daemon(str(tmp_path / "ckpt"), env={"CKPTD_MAX_FRAME_BYTES": "320"})
    peer = RawPeer(d.socket)
    reply = peer.call(ReportRequest(v=V))  # a StatusReport is well above 320 bytes
    assert isinstance(reply, ErrorReply) and reply.code == "ProtocolError", reply
    assert "StatusReport" in reply.message and "320-byte limit" in reply.message, reply.message
    assert isinstance(peer.call(Hello(v=V, pid=1, rank=0)), Welcome)  # a Welcome fits: the connection goes on


def test_a_bug_handling_a_request_is_an_internal_error_and_the_connection_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process (a bug has to be planted): the daemon's status lookup raises something no ckptd code raises."""

    async def broken(*_args: object, **_kwargs: object) -> None:
        raise KeyError("planted bug")

    monkeypatch.setattr(CheckpointService, "status", broken)
    cfg = load_config({"root": str(tmp_path / "ckpt"), "socket": str(tmp_path / "run" / "d.sock"),
                       "arena_size": "8MiB", "prefault": False, "nice": 0}, {})

    def talk() -> tuple[object, object]:
        peer = RawPeer(cfg.socket)
        return peer.call(StatusRequest(v=V, step=1, wait_s=0)), peer.call(Hello(v=V, pid=1, rank=0))

    async def scenario() -> tuple[object, object]:
        shutdown, ready = asyncio.Event(), asyncio.Event()
        server = asyncio.create_task(serve(cfg, shutdown=shutdown, ready=ready, handle_signals=False))
        await asyncio.wait_for(ready.wait(), 30)
        try:
            return await asyncio.to_thread(talk)
        finally:
            shutdown.set()
            assert await asyncio.wait_for(server, 30) == 0

    status, welcome = asyncio.run(scenario())
    assert isinstance(status, ErrorReply) and status.code == "InternalError", status
    assert "KeyError" in status.message and "planted bug" in status.message, status.message
    assert isinstance(welcome, Welcome) and welcome.daemon_pid == os.getpid()
