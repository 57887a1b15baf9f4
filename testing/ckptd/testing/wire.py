"""A raw connection to a daemon, speaking the wire protocol directly: to send what the real client never
would (malformed frames, hostile values, requests out of order) and read the daemon's answers."""

from __future__ import annotations

import socket
import time

from ckptd.client.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    ErrorReply,
    LeaseGranted,
    LeaseRequest,
    StatusRequest,
    StepState,
    StepStatus,
    decode_reply,
    encode,
)
from ckptd.writer.errors import error_classes

__all__ = ["RawPeer", "refused"]


class RawPeer:
    """One connection to the daemon at ``path``; each method returns the decoded reply."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)

    def send_raw(self, data: bytes) -> object:
        """Send ``data`` as it is (frame headers included) and read one reply."""
        self.sock.sendall(data)
        return self.recv()

    def send(self, body: bytes) -> object:
        """Send one message body, framed here, and read the reply."""
        return self.send_raw(HEADER.pack(len(body)) + body)

    def call(self, msg: object) -> object:
        """Send a protocol message (any size: the daemon's limit is what is tested) and read the reply."""
        return self.send_raw(encode(msg, 1 << 31))  # type: ignore[arg-type]

    def expect_error(self, msg: object, cls: type[Exception]) -> str:
        """Send ``msg``; its reply must be an error of ``cls`` (or a subclass): its message."""
        return refused(self.call(msg), cls)

    def lease(self, *sizes: int, step: int = 9, timeout_s: float = 1.0) -> LeaseGranted:
        """Staging space for rank 0's save of ``step``: one slot of each size (granted, or the test fails)."""
        reply = self.call(LeaseRequest(v=PROTOCOL_VERSION, step=step, rank=0, sizes=list(sizes), timeout_s=timeout_s))
        assert isinstance(reply, LeaseGranted), reply
        return reply

    def final_status(self, step: int, timeout: float = 60.0) -> StepStatus:
        """The status of ``step`` once it committed or failed, asked again until ``timeout``: the daemon holds a
        status request back at most ``MAX_STATUS_WAIT_S`` (5 s), however long ``wait_s`` asks for."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.call(StatusRequest(v=PROTOCOL_VERSION, step=step, wait_s=5.0))
            assert isinstance(status, StepStatus), status
            if StepState(status.state).final or time.monotonic() > deadline:
                return status

    def recv(self) -> object:
        (n,) = HEADER.unpack(self._exactly(HEADER.size))
        return decode_reply(self._exactly(n))

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            part = self.sock.recv(n - len(buf))
            if not part:
                raise ConnectionResetError("closed by the daemon")
            buf += part
        return buf

    def close(self) -> None:
        self.sock.close()


def refused(reply: object, cls: type[Exception]) -> str:
    """``reply`` must be an :class:`ErrorReply` of ``cls`` (or a subclass): its message."""
    assert isinstance(reply, ErrorReply), reply
    assert issubclass(error_classes()[reply.code], cls), (reply.code, reply.message)
    return reply.message
