"""Decoding a message nested deeper than msgspec goes is a ProtocolError on either side, never a RecursionError;
plain nesting within reason still decodes."""

from __future__ import annotations

import msgspec
import pytest

from ckptd.client import protocol as p
from ckptd.writer.errors import ProtocolError

V = p.PROTOCOL_VERSION
HOLE = "PLACEHOLDER"
SAVE = {"v": V, "type": "save", "step": 1, "rank": 0, "world_size": 1, "node": 0, "num_nodes": 1,
        "local_world_size": 1, "lease_id": 1, "shards": [], "objects": {"x": HOLE}}


def nested(msg: dict[str, object], levels: int) -> bytes:
    """``msg`` encoded, with a value ``levels`` lists deep where it holds :data:`HOLE`."""
    return msgspec.msgpack.encode(msg).replace(msgspec.msgpack.encode(HOLE), b"\x91" * levels + b"\xc0")


def test_a_request_nested_too_deep_is_a_protocol_error() -> None:
    req = p.decode_request(nested(SAVE, 200))  # within reason: decoded as sent
    assert isinstance(req, p.SaveRequest)
    value = req.objects["x"]
    for _ in range(200):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value is None
    for levels in (100_000, 2_000_000):
        with pytest.raises(ProtocolError, match="recursion"):
            p.decode_request(nested(SAVE, levels))
        with pytest.raises(ProtocolError):  # in a field the message does not have, or in its version field
            p.decode_request(nested({"v": V, "type": "hello", "pid": 1, "rank": 0, "extra": HOLE}, levels))
        with pytest.raises(ProtocolError):
            p.decode_request(nested({"v": HOLE, "type": "hello", "pid": 1, "rank": 0}, levels))


def test_a_reply_nested_too_deep_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="recursion"):
        p.decode_reply(nested({"v": V, "type": "error", "code": "X", "message": HOLE}, 100_000))
