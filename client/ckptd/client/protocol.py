"""The client/daemon wire protocol: typed, versioned msgpack frames over a Unix socket. Never pickle.

A frame is a 4-byte big-endian length followed by one msgpack-encoded message. Every message carries
the protocol version ``v`` and a ``type`` tag; encode/decode are pure and tested without sockets.
Decoding checks the version before the body, so a peer of another version gets
:class:`ProtocolVersionError` rather than a confusing field error.
"""

from __future__ import annotations

import socket
import struct
from enum import StrEnum
from typing import Any

import msgspec

from ckptd.writer.errors import ProtocolError, ProtocolVersionError

PROTOCOL_VERSION = 4  # 2: LeaseRequest.ahead; 3: PrepareStep; 4: the attempt token
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 32 << 20


class StepState(StrEnum):
    """Where a step stands on a node; the wire carries the value strings.

    ``PENDING`` -> ``DURABLE`` (the node's part is on storage) -> ``COMMITTED``; ``FAILED`` from either of
    the first two. ``UNKNOWN``: the daemon has no record of the step. ``SKIPPED`` exists only on the
    client (a save the backpressure policy skipped); the daemon never reports it.
    """

    PENDING = "pending"
    DURABLE = "durable"
    COMMITTED = "committed"
    FAILED = "failed"
    UNKNOWN = "unknown"
    SKIPPED = "skipped"

    @property
    def final(self) -> bool:
        """True for the states a step never leaves."""
        return self in _FINAL_STATES


_FINAL_STATES = frozenset({StepState.COMMITTED, StepState.FAILED, StepState.SKIPPED})
# the states a daemon reports in StepStatus
STEP_STATES = (StepState.PENDING, StepState.DURABLE, StepState.COMMITTED, StepState.FAILED, StepState.UNKNOWN)


class _Msg(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True):
    v: int


# --- client -> daemon -----------------------------------------------------------------------------
class Hello(_Msg, frozen=True, tag="hello"):
    pid: int
    rank: int


class LeaseRequest(_Msg, frozen=True, tag="lease"):
    """Ask for staging space: one slot per size, granted all together or not at all."""

    step: int
    rank: int
    sizes: list[int]
    timeout_s: float
    # for the next save, asked for with this one: granted from free space only, never by evicting the bytes
    # kept for an in-memory restore (a save's own lease may evict them: saves win the space)
    ahead: bool = False


class ShardMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: str
    dtype: str
    global_shape: list[int]
    global_offset: list[int]
    shape: list[int]
    chunk_shape: list[int]
    slot: int  # index into the lease's slots


class ReplicaMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A region this rank holds only as a non-main replica (it writes nothing of it): the coordinator
    checks that some rank wrote it (``ShardLayoutError`` otherwise). A msgpack array, for compactness:
    ``[key, dtype, global_shape, global_offset, shape]``."""

    key: str
    dtype: str
    global_shape: list[int]
    global_offset: list[int]
    shape: list[int]


class _StepPlacement(_Msg, frozen=True):
    """The step a rank saves and where the rank sits: what starts a step's job on a node."""

    step: int
    rank: int
    world_size: int
    node: int
    num_nodes: int
    local_world_size: int


class SaveRequest(_StepPlacement, frozen=True, tag="save"):
    lease_id: int
    shards: list[ShardMeta]
    objects: dict[str, Any]
    # Content-addressed documents written once per root (e.g. a Megatron layout): name -> JSON text.
    # Names are "<sha256 of the text>.json"; the daemon checks the hash and skips ones already stored.
    sidecars: dict[str, str] = {}
    # A plan registered with RegisterPlan: the daemon takes the shards (and their slots in the lease's one
    # contiguous span) from it, and ``shards`` is empty. 0: no plan, ``shards`` says everything.
    plan_id: int = 0
    # Seconds the rank was blocked up to sending this request (planning and the copy into the arena):
    # the daemon's save-stall histogram. 0.0 from clients that do not measure it.
    stall_s: float = 0.0
    # Regions the rank holds only as non-main replicas (a plan save's come with its RegisterPlan instead).
    replicas: list[ReplicaMeta] = []
    attempt: str = ""  # which attempt at the step (:mod:`ckptd.client.attempts`); "" when unknown


class PrepareStep(_StepPlacement, frozen=True, tag="prepare"):
    """A rank is about to save ``step`` and copies into its lease now: the daemon starts the step on its node
    meanwhile (for its first rank: the storage checks, whether the step is committed and what an earlier
    attempt left), so the :class:`SaveRequest` that follows is answered at once. Its answer,
    :class:`StepPrepared` or the typed error the save would get (``StepCommittedError``...), is read after
    the copy; the fields are the save's own."""

    attempt: str = ""


class ReleaseRequest(_Msg, frozen=True, tag="release"):
    lease_id: int


class StatusRequest(_Msg, frozen=True, tag="status"):
    step: int
    wait_s: float  # block up to this long for the step to reach a final state
    attempt: str = ""  # the save's attempt: an earlier attempt of the step is reported, not the newest


# --- daemon -> client -----------------------------------------------------------------------------
class Welcome(_Msg, frozen=True, tag="welcome"):
    daemon_pid: int
    arena_path: str
    arena_bytes: int
    root: str
    # Ownership (ckptd.client.ownership): the job an embedded daemon serves ("" = any job, e.g. an
    # operator's ``ckptd serve``), the process whose end ends it (0 = none), and whether it is shutting down.
    job_id: str = ""
    owner_pid: int = 0
    draining: bool = False
    # how long its node parts wait for their commit: a rank that lost the daemon after its node's part was
    # written waits as long for the coordinator's commit, through storage (ckptd.client.handle)
    commit_timeout_s: float = 0.0


class LeaseGranted(_Msg, frozen=True, tag="granted"):
    lease_id: int
    offsets: list[int]


class SaveAccepted(_Msg, frozen=True, tag="accepted"):
    step: int
    nbytes: int


class StepPrepared(_Msg, frozen=True, tag="prepared"):
    step: int


class StepStatus(_Msg, frozen=True, tag="step_status"):
    step: int
    state: StepState  # one of STEP_STATES
    error_code: str = ""
    error: str = ""


class Released(_Msg, frozen=True, tag="released"):
    lease_id: int


class ErrorReply(_Msg, frozen=True, tag="error"):
    code: str  # the CkptdError subclass name
    message: str


# --- in-memory restore (the daemon keeps the newest committed step's staged bytes in its arena) --------
class RestoreRequest(_Msg, frozen=True, tag="restore"):
    """Which arena ranges hold ``step``'s shards staged on this node (empty when it keeps none)."""

    step: int


class RestoreShard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: str
    dtype: str  # torch dtype name; the bytes are the stored (raw-bit) little-endian layout
    global_offset: list[int]
    shape: list[int]
    offset: int  # byte offset in the arena
    nbytes: int


class RestoreReply(_Msg, frozen=True, tag="restore_reply"):
    step: int
    shards: list[RestoreShard]




# --- operations (``ckptd status``) ------------------------------------------------------------------
class ReportRequest(_Msg, frozen=True, tag="report"):
    """Ask the daemon for its :class:`StatusReport` (no side effects)."""


class StepReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One step the daemon holds a record of."""

    step: int
    state: StepState
    node: int
    ranks_saved: int
    local_world_size: int
    nbytes: int
    age_s: float  # since its first rank saved
    error: str = ""


class StatusReport(_Msg, frozen=True, tag="report_reply"):
    """A live daemon's state for operators: steps, arena, queue, throughput, retries, last error."""

    daemon_pid: int
    root: str
    uptime_s: float
    draining: bool
    arena_bytes: int
    arena_free_bytes: int
    leases: int
    in_flight: int  # steps not yet committed or failed (the queue)
    steps: list[StepReport]
    commits: int
    failures: int
    bytes_written: int  # by steps that reached storage (durable or committed) since start
    bytes_per_s: float  # of the last finished step, first save to commit
    retries: int  # storage requests retried since start (S3)
    last_error: str = ""
    arena_retained_bytes: int = 0  # of the used bytes: the newest committed step kept for an in-memory restore
    retain: bool = True  # in-memory restore on (off: ``ckptd serve --no-retain``)
    # as in Welcome: the job it serves ("" = any), its owner process (0 = none); and the socket it listens on
    job_id: str = ""
    owner_pid: int = 0
    socket: str = ""
    # of the used bytes: leases granted to clients for their next save (``LeaseRequest.ahead``), not used yet
    arena_ahead_bytes: int = 0
    arena_waiting: int = 0  # lease requests waiting for staging space now (earlier saves still being written)
    metrics_url: str = ""  # the Prometheus endpoint as bound (``--metrics-port 0`` picks the port); "" = off



# --- save plans (registered once per run, named by id in later SaveRequests) -------------------------
class RegisterPlan(_Msg, frozen=True, tag="register_plan"):
    """A rank's static save layout: every shard's meta and where its slot sits in one contiguous span.

    ``offsets[i]``/``sizes[i]`` are slot ``i``'s byte offset from the span's start and its size; a save
    with this plan leases one slot of ``span`` bytes and the daemon places slot ``i`` at base + offsets[i].
    The daemon validates it once and answers :class:`PlanRegistered`.
    """

    rank: int
    shards: list[ShardMeta]
    offsets: list[int]
    sizes: list[int]
    span: int
    replicas: list[ReplicaMeta] = []  # the plan's non-main replica regions (see SaveRequest.replicas)


class PlanRegistered(_Msg, frozen=True, tag="plan_registered"):
    plan_id: int


Request = (
    Hello | LeaseRequest | SaveRequest | ReleaseRequest | StatusRequest | RestoreRequest | ReportRequest | RegisterPlan
    | PrepareStep
)
Reply = (
    Welcome | LeaseGranted | SaveAccepted | StepStatus | Released | ErrorReply | RestoreReply | StatusReport
    | PlanRegistered | StepPrepared
)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class _Head(msgspec.Struct):
    v: Any = None
    type: Any = None


_head_decoder = msgspec.msgpack.Decoder(_Head)


def encode(msg: _Msg, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    body = _encoder.encode(msg)
    if len(body) > max_frame:
        raise ProtocolError(f"{type(msg).__name__} message of {len(body)} bytes exceeds the {max_frame}-byte limit")
    return HEADER.pack(len(body)) + body


def _decode(body: bytes, decoder: msgspec.msgpack.Decoder[Any]) -> Any:
    # RecursionError: msgspec's answer to values nested deeper than the interpreter's limit (a hostile peer)
    try:
        head = _head_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"undecodable message: {exc}") from exc
    if head.v != PROTOCOL_VERSION:
        raise ProtocolVersionError(f"protocol version {head.v!r} not supported (this side speaks {PROTOCOL_VERSION})")
    try:
        return decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"invalid {head.type!r} message: {exc}") from exc


def decode_request(body: bytes) -> Request:
    return _decode(body, _request_decoder)  # type: ignore[no-any-return]


def decode_reply(body: bytes) -> Reply:
    return _decode(body, _reply_decoder)  # type: ignore[no-any-return]


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking socket (a frame header or body); :class:`ConnectionResetError` on EOF."""
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionResetError("the daemon closed the connection")
        buf += part
    return bytes(buf)


def frame_length(header: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> int:
    (n,) = HEADER.unpack(header)
    if n > max_frame:
        raise ProtocolError(f"frame of {n} bytes exceeds the {max_frame}-byte limit")
    return int(n)


_PLAIN_LEAVES = (str, int, float, bool, type(None))
_FLAT_LEAVES = frozenset(_PLAIN_LEAVES)


def _check_plain(obj: object, path: str) -> None:
    # msgspec also encodes sets, dataclasses, datetimes, bytes...; they would come back as other types.
    if isinstance(obj, _PLAIN_LEAVES):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ProtocolError(f"non-tensor state at {path or '/'}: dict key {k!r} is not a string")
            _check_plain(v, f"{path}/{k}")
        return
    if isinstance(obj, list | tuple):
        if set(map(type, obj)) <= _FLAT_LEAVES:  # e.g. an RNG state: skip the per-item recursion
            return
        for i, v in enumerate(obj):
            _check_plain(v, f"{path}[{i}]")
        return
    raise ProtocolError(
        f"non-tensor state at {path or '/'} must be plain data (dict/list/str/int/float/bool/None), "
        f"got {type(obj).__name__}"
    )


def encode_objects(objects: object) -> None:
    """Raise :class:`ProtocolError` unless ``objects`` is plain data msgpack can carry (no pickle)."""
    _check_plain(objects, "")
    try:
        _encoder.encode(objects)
    except (TypeError, OverflowError) as exc:
        raise ProtocolError(f"non-tensor state must be plain data (dict/list/str/int/float/bool/None): {exc}") from exc
