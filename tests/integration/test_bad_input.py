"""Hostile and broken input: every case gets its typed error, the daemon keeps serving, nothing committed changes."""

from __future__ import annotations

import os
import pwd
import socket
import subprocess

import msgspec
import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    PrepareStep,
    SaveRequest,
    ShardMeta,
    StatusRequest,
    StepPrepared,
    StepStatus,
    Welcome,
)
from ckptd.testing.fixtures import tree_digest
from ckptd.testing.wire import RawPeer
from ckptd.writer.errors import (
    CkptdError,
    DuplicateSaveError,
    InvalidKeyError,
    InvalidRequestError,
    LeaseError,
    ProtocolError,
    ProtocolVersionError,
    ShardLayoutError,
    StepCommittedError,
    UnsupportedDtypeError,
    error_classes,
)


def _save(lease_id: int, shards: list[ShardMeta], step: int = 9, rank: int = 0) -> SaveRequest:
    return SaveRequest(v=PROTOCOL_VERSION, lease_id=lease_id, step=step, rank=rank, world_size=1, node=0,
                       num_nodes=1, local_world_size=1, shards=shards, objects={})


def _meta(key: str, shape: list[int], offset: list[int] | None = None, gshape: list[int] | None = None,
          dtype: str = "float32", chunk: list[int] | None = None, slot: int = 0) -> ShardMeta:
    return ShardMeta(key=key, dtype=dtype, global_shape=gshape or shape, global_offset=offset or [0] * len(shape),
                     shape=shape, chunk_shape=chunk or shape, slot=slot)


@pytest.fixture
def served(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    d = start_daemon(root)
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    client.save(1, {"w": torch.arange(16.0)}).wait(30)
    before = tree_digest(os.path.join(root, "step_1"))
    yield d, client, root
    assert tree_digest(os.path.join(root, "step_1")) == before, "a committed step changed"
    # ... and the daemon still serves a normal save after all of it
    client2 = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    client2.save(100, {"w": torch.arange(4.0)}).wait(30)
    client.close()
    client2.close()


def test_malformed_frames_and_versions(served):
    d, _client, _root = served
    peer = RawPeer(d.socket)
    garbage = b"\xc1\xff not msgpack"
    reply = peer.send_raw(HEADER.pack(len(garbage)) + garbage)
    assert isinstance(reply, ErrorReply) and reply.code == "ProtocolError"
    # the frame boundary was intact, so the same connection keeps working
    assert isinstance(peer.call(Hello(v=PROTOCOL_VERSION, pid=1, rank=0)), Welcome)
    # unknown protocol version
    future = msgspec.msgpack.encode({"type": "hello", "v": 99, "pid": 1, "rank": 0})
    reply = peer.send_raw(HEADER.pack(len(future)) + future)
    assert isinstance(reply, ErrorReply) and reply.code == ProtocolVersionError.__name__
    # wrong field types and unknown fields
    for bad in ({"type": "hello", "v": PROTOCOL_VERSION, "pid": "x", "rank": 0},
                {"type": "hello", "v": PROTOCOL_VERSION, "pid": 1, "rank": 0, "z": 1},
                {"type": "nope", "v": PROTOCOL_VERSION}):
        body = msgspec.msgpack.encode(bad)
        reply = peer.send_raw(HEADER.pack(len(body)) + body)
        assert isinstance(reply, ErrorReply) and issubclass(error_classes()[reply.code], ProtocolError), bad
    # an oversized frame header: refused, and only this connection is dropped
    reply = peer.send_raw(HEADER.pack(1 << 30))
    assert isinstance(reply, ErrorReply) and reply.code == "ProtocolError" and "exceeds" in reply.message
    with pytest.raises((ConnectionResetError, OSError)):
        peer.call(Hello(v=PROTOCOL_VERSION, pid=1, rank=0))
    assert isinstance(RawPeer(d.socket).call(Hello(v=PROTOCOL_VERSION, pid=1, rank=0)), Welcome)


def test_truncated_frame_times_out_only_that_client(served):
    d, client, _root = served
    peer = RawPeer(d.socket)
    peer.sock.sendall(HEADER.pack(100) + b"12345")  # then silence
    client.save(2, {"w": torch.arange(3.0)}).wait(30)  # others are served meanwhile


@pytest.mark.parametrize(
    "key", ["../escape", "/etc/passwd", "a/../../b", "a//b", "_parts/node-0.json", "sp ace", "x\\y"]
)
def test_unsafe_keys_rejected(served, key):
    d, _client, _root = served
    peer = RawPeer(d.socket)
    lease = peer.lease(64)
    peer.expect_error(_save(lease.lease_id, [_meta(key, [4])]), InvalidKeyError)


def test_unsafe_keys_rejected_by_client_before_staging(served):
    _d, client, _root = served
    with pytest.raises(InvalidKeyError):
        client.save(3, {"ok": torch.zeros(2), "bad": Shard("../x", torch.zeros(2), (2,), (0,))})


def test_lease_never_granted_and_lease_of_another_connection(served):
    d, _client, _root = served
    peer, other = RawPeer(d.socket), RawPeer(d.socket)
    peer.expect_error(_save(12345, [_meta("w", [4])]), LeaseError)
    theirs = other.lease(64)
    peer.expect_error(_save(theirs.lease_id, [_meta("w", [4])]), LeaseError)
    mine = peer.lease(16)
    msg = peer.expect_error(_save(mine.lease_id, [_meta("w", [400])]), LeaseError)  # larger than the slot
    assert "do not fit" in msg
    peer.expect_error(_save(mine.lease_id, [_meta("w", [2], slot=3)]), LeaseError)


def test_region_errors(served):
    d, _client, _root = served
    peer = RawPeer(d.socket)
    lease = peer.lease(64, 64)
    overlap = [_meta("w", [4], [0], [8], chunk=[4], slot=0), _meta("w", [4], [0], [8], chunk=[4], slot=1)]
    peer.expect_error(_save(lease.lease_id, overlap), ShardLayoutError)
    peer.expect_error(_save(lease.lease_id, [_meta("w", [4], [2], [8], chunk=[4])]), ShardLayoutError)  # off-grid
    peer.expect_error(_save(lease.lease_id, [_meta("w", [4], [6], [8], chunk=[4])]), ShardLayoutError)  # outside
    peer.expect_error(_save(lease.lease_id, [_meta("w", [4], [0], [8, 2], chunk=[4])]), ShardLayoutError)  # rank
    peer.expect_error(_save(lease.lease_id, [_meta("w", [4], dtype="complex64")]), UnsupportedDtypeError)
    peer.expect_error(SaveRequest(v=PROTOCOL_VERSION, lease_id=lease.lease_id, step=9, rank=3, world_size=2, node=0,
                                  num_nodes=1, local_world_size=1, shards=[], objects={}), InvalidRequestError)


def test_step_already_committed_and_duplicate_save(served):
    d, client, _root = served
    with pytest.raises(StepCommittedError):
        client.save(1, {"w": torch.zeros(16)})
    peer = RawPeer(d.socket)
    lease = peer.lease(64)
    peer.expect_error(_save(lease.lease_id, [_meta("w", [4])], step=1), StepCommittedError)
    # same rank twice for an in-flight step (world of 2 so the step stays open)
    two = SaveRequest(v=PROTOCOL_VERSION, lease_id=lease.lease_id, step=50, rank=0, world_size=2, node=0,
                      num_nodes=1, local_world_size=2, shards=[], objects={})
    assert peer.call(two).__class__.__name__ == "SaveAccepted"
    lease2 = peer.lease(64)
    peer.expect_error(SaveRequest(**{**msgspec.structs.asdict(two), "lease_id": lease2.lease_id}), DuplicateSaveError)
    # rank 1 completes step 50, so the daemon's shutdown has no step to wait out
    last = SaveRequest(**{**msgspec.structs.asdict(two), "lease_id": peer.lease(64).lease_id, "rank": 1})
    assert peer.call(last).__class__.__name__ == "SaveAccepted"


def _prepare(step: int, rank: int = 0, world: int = 1) -> PrepareStep:
    return PrepareStep(v=PROTOCOL_VERSION, step=step, rank=rank, world_size=world, node=0, num_nodes=1,
                       local_world_size=world)


def test_prepare_step_answers_what_the_save_would(served):
    """A client announces its save before the copy (PrepareStep); the answer is the save's own verdict."""
    d, _client, _root = served
    peer = RawPeer(d.socket)
    peer.expect_error(_prepare(1), StepCommittedError)
    peer.expect_error(_prepare(60, rank=3, world=2), InvalidRequestError)
    assert peer.call(_prepare(60, world=2)) == StepPrepared(v=PROTOCOL_VERSION, step=60)
    assert peer.call(_prepare(60, world=2)) == StepPrepared(v=PROTOCOL_VERSION, step=60)  # again: the same job
    status = peer.call(StatusRequest(v=PROTOCOL_VERSION, step=60, wait_s=0))
    assert isinstance(status, StepStatus) and status.state == "pending"  # started before any save
    save = SaveRequest(v=PROTOCOL_VERSION, lease_id=peer.lease(64).lease_id, step=60, rank=0, world_size=2, node=0,
                       num_nodes=1, local_world_size=2, shards=[], objects={})
    assert peer.call(save).__class__.__name__ == "SaveAccepted"
    peer.expect_error(_prepare(60, world=2), DuplicateSaveError)
    assert peer.call(_prepare(60, rank=1, world=2)) == StepPrepared(v=PROTOCOL_VERSION, step=60)
    last = SaveRequest(**{**msgspec.structs.asdict(save), "lease_id": peer.lease(64).lease_id, "rank": 1})
    assert peer.call(last).__class__.__name__ == "SaveAccepted"
    status = peer.final_status(60)  # asked again: the daemon holds one status request back 5 s at most
    assert status.state == "committed", status


def test_a_prepared_step_never_saved_fails_by_the_part_timeout(start_daemon, tmp_path):
    """A rank that announced its save and died before sending it fails the step like a rank that never saved;
    the step can then be saved again."""
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0", "--part-timeout", "1")
    peer = RawPeer(d.socket)
    assert isinstance(peer.call(_prepare(7)), StepPrepared)
    status = peer.final_status(7)
    assert status.state == "failed", status
    assert status.error_code == "SaveTimeoutError" and "never saved" in status.error, status
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    client.save(7, {"w": torch.arange(8.0)}).wait(30)
    out = {"w": torch.zeros(8)}
    client.load(7, out)
    assert torch.equal(out["w"], torch.arange(8.0))
    client.close()


def _two_rank_step(socket_path: str, step: int, state0: dict, state1: dict) -> list[Exception | None]:
    c0 = CheckpointClient(socket_path, placement=Placement(0, 2, 2, 0))
    c1 = CheckpointClient(socket_path, placement=Placement(1, 2, 2, 0))
    handles = [c0.save(step, state0), c1.save(step, state1)]
    errors: list[Exception | None] = []
    for h in handles:
        try:
            h.wait(30)
            errors.append(None)
        except CkptdError as exc:
            errors.append(exc)
    c0.close()
    c1.close()
    return errors


@pytest.mark.parametrize(
    ("case", "state1"),
    [
        ("overlap", {"w": Shard("w", torch.ones(4), (8,), (0,))}),
        ("gap", {}),
        ("global shape", {"w": Shard("w", torch.ones(4), (12,), (4,))}),
        ("dtype", {"w": Shard("w", torch.ones(4, dtype=torch.float64), (8,), (4,))}),
    ],
)
def test_cross_rank_inconsistency_fails_the_step(served, case, state1):
    d, _client, root = served
    state0 = {"w": Shard("w", torch.zeros(4), (8,), (0,))}
    errors = _two_rank_step(d.socket, 60, state0, state1)
    assert all(isinstance(e, ShardLayoutError) for e in errors), (case, errors)
    assert not os.path.exists(os.path.join(root, "step_60", "_ckptd", "COMMITTED"))


def test_another_user_cannot_connect_or_map_the_arena(served):
    d, client, _root = served
    name = "ckptdtest"
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    uid, gid = pwd.getpwnam(name).pw_uid, pwd.getpwnam(name).pw_gid
    arena_path = client._welcome.arena_path  # type: ignore[union-attr]
    assert os.stat(arena_path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(d.socket)).st_mode & 0o777 == 0o700
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user's process
        os.close(r)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        outcome = []
        for what, attempt in (("socket", lambda: socket.socket(socket.AF_UNIX).connect(d.socket)),
                              ("arena", lambda: os.close(os.open(arena_path, os.O_RDONLY)))):
            try:
                attempt()
                outcome.append(f"{what}:opened")
            except PermissionError:
                outcome.append(f"{what}:denied")
            except OSError as exc:
                outcome.append(f"{what}:{type(exc).__name__}")
        os.write(w, ",".join(outcome).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 200).decode() == "socket:denied,arena:denied"
