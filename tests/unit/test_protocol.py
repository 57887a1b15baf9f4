"""The wire protocol, without sockets: round trips, version checks, malformed frames, plain-data objects."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.client import protocol as p
from ckptd.writer.errors import CkptdError, ProtocolError, ProtocolVersionError

V = p.PROTOCOL_VERSION

i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
finite = st.floats(allow_nan=False, allow_infinity=True)
text = st.text(max_size=40)
plain = st.recursive(
    st.none() | st.booleans() | i64 | finite | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=10,
)

shard_meta = st.builds(
    p.ShardMeta,
    key=text,
    dtype=st.sampled_from(["float32", "bfloat16", "int64"]),
    global_shape=st.lists(u32, max_size=4),
    global_offset=st.lists(u32, max_size=4),
    shape=st.lists(u32, max_size=4),
    chunk_shape=st.lists(u32, max_size=4),
    slot=u32,
)

requests = st.one_of(
    st.builds(p.Hello, v=st.just(V), pid=i64, rank=i64),
    st.builds(
        p.LeaseRequest, v=st.just(V), step=i64, rank=i64, sizes=st.lists(u32, max_size=8), timeout_s=finite
    ),
    st.builds(
        p.SaveRequest,
        v=st.just(V),
        lease_id=i64,
        step=i64,
        rank=i64,
        world_size=i64,
        node=i64,
        num_nodes=i64,
        local_world_size=i64,
        shards=st.lists(shard_meta, max_size=4),
        objects=st.dictionaries(text, plain, max_size=4),
        stall_s=finite,
    ),
    st.builds(p.ReleaseRequest, v=st.just(V), lease_id=i64),
    st.builds(p.StatusRequest, v=st.just(V), step=i64, wait_s=finite),
    st.builds(p.RestoreRequest, v=st.just(V), step=i64),
    st.builds(p.ReportRequest, v=st.just(V)),
    st.builds(p.PrepareStep, v=st.just(V), step=i64, rank=i64, world_size=i64, node=i64, num_nodes=i64,
              local_world_size=i64),
)

replies = st.one_of(
    st.builds(p.Welcome, v=st.just(V), daemon_pid=i64, arena_path=text, arena_bytes=i64, root=text),
    st.builds(p.LeaseGranted, v=st.just(V), lease_id=i64, offsets=st.lists(u32, max_size=8)),
    st.builds(p.SaveAccepted, v=st.just(V), step=i64, nbytes=i64),
    st.builds(p.StepPrepared, v=st.just(V), step=i64),
    st.builds(
        p.StepStatus,
        v=st.just(V),
        step=i64,
        state=st.sampled_from(p.STEP_STATES),
        error_code=text,
        error=text,
    ),
    st.builds(p.Released, v=st.just(V), lease_id=i64),
    st.builds(p.ErrorReply, v=st.just(V), code=text, message=text),
    st.builds(
        p.RestoreReply, v=st.just(V), step=i64,
        shards=st.lists(st.builds(p.RestoreShard, key=text, dtype=text, global_offset=st.lists(u32, max_size=4),
                                  shape=st.lists(u32, max_size=4), offset=u32, nbytes=u32), max_size=3),
    ),
    st.builds(
        p.StatusReport, v=st.just(V), daemon_pid=i64, root=text, uptime_s=finite, draining=st.booleans(),
        arena_bytes=i64, arena_free_bytes=i64, leases=i64, in_flight=i64,
        steps=st.lists(st.builds(p.StepReport, step=i64, state=st.sampled_from(p.STEP_STATES), node=i64,
                                 ranks_saved=i64, local_world_size=i64, nbytes=i64, age_s=finite, error=text),
                       max_size=3),
        commits=i64, failures=i64, bytes_written=i64, bytes_per_s=finite, retries=i64, last_error=text,
        job_id=text, owner_pid=i64, socket=text,
    ),
)


def body(msg: Any) -> bytes:
    frame = p.encode(msg)
    assert p.frame_length(frame[: p.HEADER.size]) == len(frame) - p.HEADER.size
    return frame[p.HEADER.size :]


def raw(**fields: Any) -> bytes:
    """A msgpack map with exactly these fields, bypassing the typed structs."""
    return msgspec.msgpack.encode(fields)


# --- round trips ----------------------------------------------------------------------------------
@given(requests)
def test_every_request_round_trips(msg: Any) -> None:
    decoded = p.decode_request(body(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


@given(replies)
def test_every_reply_round_trips(msg: Any) -> None:
    decoded = p.decode_reply(body(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


def test_every_message_type_is_covered_by_the_strategies() -> None:
    """A new message type must be added to the strategies above, or it would go untested."""
    assert {t.__name__ for t in p.Request.__args__} == {
        "Hello", "LeaseRequest", "SaveRequest", "ReleaseRequest", "StatusRequest", "RestoreRequest", "ReportRequest",
        "RegisterPlan", "PrepareStep",
    }
    assert {t.__name__ for t in p.Reply.__args__} == {
        "Welcome", "LeaseGranted", "SaveAccepted", "StepStatus", "Released", "ErrorReply", "RestoreReply",
        "StatusReport", "PlanRegistered", "StepPrepared",
    }


def test_step_status_defaults_survive_the_wire() -> None:
    msg = p.StepStatus(v=V, step=3, state="committed")
    assert p.decode_reply(body(msg)) == p.StepStatus(v=V, step=3, state="committed", error_code="", error="")


def test_a_request_is_not_a_reply_and_vice_versa() -> None:
    with pytest.raises(ProtocolError):
        p.decode_reply(body(p.Hello(v=V, pid=1, rank=0)))
    with pytest.raises(ProtocolError):
        p.decode_request(body(p.Released(v=V, lease_id=1)))


# --- versions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("v", [0, 1, -1, 99, "2", "x", None, [2], {"v": 2}, 2.5])
@pytest.mark.parametrize("decode", [p.decode_request, p.decode_reply])
def test_other_protocol_versions_are_refused_by_version(v: Any, decode: Any) -> None:
    with pytest.raises(ProtocolVersionError, match="protocol version"):
        decode(raw(v=v, type="hello", pid=1, rank=0))


@pytest.mark.parametrize("decode", [p.decode_request, p.decode_reply])
def test_missing_version_is_a_version_error(decode: Any) -> None:
    with pytest.raises(ProtocolVersionError):
        decode(raw(type="hello", pid=1, rank=0))


def test_version_is_checked_before_the_body() -> None:
    """A newer peer's message may have fields or types we do not know: report the version, not those."""
    with pytest.raises(ProtocolVersionError):
        p.decode_request(raw(v=V + 1, type="brand_new", whatever=[1, 2, 3]))


@pytest.mark.parametrize("v", [True, float(V)])
def test_version_lookalikes_are_still_rejected(v: Any) -> None:
    with pytest.raises(ProtocolError):
        p.decode_request(raw(v=v, type="hello", pid=1, rank=0))


# --- malformed messages ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x81",  # map header with no entries following
        b"not msgpack at all",
        msgspec.msgpack.encode([V, "hello", 1, 0]),  # an array, not a map
        msgspec.msgpack.encode("hello"),
        msgspec.msgpack.encode(None),
        raw(v=V, type="hello", pid=1, rank=0)[:-1],  # truncated
    ],
)
def test_garbage_bytes_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        p.decode_request(data)
    with pytest.raises(ProtocolError):
        p.decode_reply(data)


@given(st.binary(max_size=64))
def test_any_bytes_decode_to_a_request_or_raise_protocol_error(data: bytes) -> None:
    try:
        msg = p.decode_request(data)
    except ProtocolError:
        return
    assert isinstance(msg, p.Request.__args__)


@pytest.mark.parametrize(
    "fields",
    [
        {"pid": "1", "rank": 0},  # str for int
        {"pid": 1.5, "rank": 0},  # float for int
        {"pid": None, "rank": 0},
        {"pid": [1], "rank": 0},
        {"pid": 1},  # missing field
        {"pid": 1, "rank": 0, "extra": 1},  # unknown field
    ],
)
def test_wrong_missing_or_unknown_fields_are_protocol_errors(fields: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as info:
        p.decode_request(raw(v=V, type="hello", **fields))
    assert not isinstance(info.value, ProtocolVersionError)


def test_nested_struct_fields_are_checked() -> None:
    shard = {"key": "w", "dtype": "float32", "global_shape": [2], "global_offset": [0], "shape": [2],
             "chunk_shape": [2], "slot": 0, "surprise": True}
    msg = raw(v=V, type="save", lease_id=1, step=1, rank=0, world_size=1, node=0, num_nodes=1,
              local_world_size=1, shards=[shard], objects={})
    with pytest.raises(ProtocolError, match="surprise"):
        p.decode_request(msg)
    del shard["surprise"]
    shard["global_shape"] = ["2"]
    with pytest.raises(ProtocolError):
        p.decode_request(raw(v=V, type="save", lease_id=1, step=1, rank=0, world_size=1, node=0, num_nodes=1,
                             local_world_size=1, shards=[shard], objects={}))


@pytest.mark.parametrize("tag", ["nope", "", "HELLO", 1, None])
def test_unknown_type_tag_is_a_protocol_error(tag: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        p.decode_request(raw(v=V, type=tag, pid=1, rank=0))
    assert not isinstance(info.value, ProtocolVersionError)
    with pytest.raises(ProtocolError):
        p.decode_reply(raw(v=V, type=tag, lease_id=1))


def test_missing_type_tag_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        p.decode_request(raw(v=V, pid=1, rank=0))


# --- frame size limits ----------------------------------------------------------------------------
def test_encode_enforces_the_frame_limit_exactly() -> None:
    msg = p.ErrorReply(v=V, code="X", message="m" * 100)
    n = len(p.encode(msg)) - p.HEADER.size
    assert len(p.encode(msg, max_frame=n)) == n + p.HEADER.size
    with pytest.raises(ProtocolError, match="exceeds"):
        p.encode(msg, max_frame=n - 1)


def test_encode_rejects_a_message_over_the_default_limit() -> None:
    msg = p.ErrorReply(v=V, code="X", message="m" * (p.DEFAULT_MAX_FRAME + 1))
    with pytest.raises(ProtocolError):
        p.encode(msg)


@given(st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=1, max_value=2**32 - 1))
def test_frame_length_accepts_up_to_the_limit_only(n: int, limit: int) -> None:
    header = p.HEADER.pack(n)
    if n <= limit:
        assert p.frame_length(header, max_frame=limit) == n
    else:
        with pytest.raises(ProtocolError, match="exceeds"):
            p.frame_length(header, max_frame=limit)


def test_frame_length_default_limit() -> None:
    assert p.frame_length(p.HEADER.pack(p.DEFAULT_MAX_FRAME)) == p.DEFAULT_MAX_FRAME
    with pytest.raises(ProtocolError):
        p.frame_length(p.HEADER.pack(p.DEFAULT_MAX_FRAME + 1))
    with pytest.raises(ProtocolError):
        p.frame_length(b"\xff\xff\xff\xff")


# --- plain-data objects ---------------------------------------------------------------------------
@settings(max_examples=50)
@given(st.dictionaries(text, plain, max_size=6))
def test_encode_objects_accepts_plain_data_and_it_survives_a_save_request(objects: dict[str, Any]) -> None:
    p.encode_objects(objects)
    msg = p.SaveRequest(
        v=V, lease_id=1, step=1, rank=0, world_size=1, node=0, num_nodes=1, local_world_size=1, shards=[],
        objects=objects,
    )
    assert p.decode_request(body(msg)) == msg


def test_encode_objects_accepts_tuples() -> None:
    """Optimizer hyper-parameters such as Adam's ``betas`` are tuples (they come back as lists)."""
    p.encode_objects({"param_groups": [{"betas": (0.9, 0.95), "lr": 1e-4}]})


class _Custom:
    pass


@dataclasses.dataclass
class _Record:
    x: int


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(2),
        {1, 2},
        frozenset({"a"}),
        _Custom(),
        _Record(1),  # msgspec could encode it, but it would come back as a dict
        b"bytes",
        datetime.datetime(2024, 1, 1),
        2**70,  # beyond msgpack's integers
        object(),
    ],
    ids=lambda b: type(b).__name__,
)
@pytest.mark.parametrize("where", ["top", "dict", "list"])
def test_encode_objects_rejects_non_plain_values(bad: Any, where: str) -> None:
    objects = {"top": bad, "dict": {"a": {"b": bad}}, "list": {"a": [1, [2, bad]]}}[where]
    with pytest.raises(ProtocolError, match="plain data"):
        p.encode_objects({"x": objects})


def test_encode_objects_rejects_non_string_dict_keys() -> None:
    with pytest.raises(ProtocolError, match="key"):
        p.encode_objects({"groups": [{0: "a"}]})


# --- error hierarchy ------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ProtocolError, ProtocolVersionError])
def test_protocol_errors_are_ckptd_and_value_errors(cls: type[Exception]) -> None:
    assert issubclass(cls, CkptdError)
    assert issubclass(cls, ValueError)


def test_raised_protocol_errors_are_caught_as_value_errors() -> None:
    with pytest.raises(ValueError):
        p.decode_request(b"\xc1")
    with pytest.raises(ValueError):
        p.decode_request(raw(v=V + 1))
    with pytest.raises(CkptdError):
        p.encode_objects({"s": {1}})
