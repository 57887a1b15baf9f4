"""A real ``ckptd serve`` refuses, with a typed error and before accepting anything, the requests that froze it
or failed a whole node's step (review 47: a zero-byte shard of a huge grid, a grid of one-element blocks,
non-plain ``objects``, an oversized plan); it keeps serving the others, and their steps commit. Options out of
range stop ``serve`` at startup with a one-line ConfigError."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.client.protocol import (
    PROTOCOL_VERSION,
    Hello,
    LeaseRequest,
    PlanRegistered,
    PrepareStep,
    RegisterPlan,
    SaveAccepted,
    SaveRequest,
    ShardMeta,
    StepPrepared,
    Welcome,
)
from ckptd.daemon import plans
from ckptd.testing.wire import RawPeer, refused
from ckptd.writer.errors import InvalidRequestError, ShardLayoutError

pytestmark = pytest.mark.timeout(180)  # the daemon of the old code never answered again: fail, do not hang


def _save(lease_id: int, shards: list[ShardMeta], step: int, rank: int = 0, world: int = 1,
          objects: dict[str, object] | None = None) -> SaveRequest:
    return SaveRequest(v=PROTOCOL_VERSION, lease_id=lease_id, step=step, rank=rank, world_size=world, node=0,
                       num_nodes=1, local_world_size=world, shards=shards, objects=objects or {})


def test_costly_grids_and_tiny_blocks_are_refused_and_others_are_served(start_daemon, tmp_path):
    d = start_daemon(str(tmp_path / "ckpt"))
    peer = RawPeer(d.socket)
    huge = 2**61 - 1  # a prime: its grid took ~2**61 divisor trials on the daemon's loop
    zero = ShardMeta("w", "float32", [huge], [0], [0], [huge], 0)
    refused(peer.call(_save(peer.lease(4096, step=1, timeout_s=5.0).lease_id, [zero], 1)), ShardLayoutError)
    n = 1 << 18  # 1 MiB of float32 in one-element blocks: a task and a file per element
    tiny = ShardMeta("w", "float32", [n], [0], [n], [1], 0)
    lease = peer.lease(4 * n, step=1, timeout_s=5.0).lease_id
    assert "262144 blocks" in refused(peer.call(_save(lease, [tiny], 1)), ShardLayoutError)
    t0 = time.monotonic()
    assert isinstance(RawPeer(d.socket).call(Hello(v=PROTOCOL_VERSION, pid=2, rank=1)), Welcome)
    assert time.monotonic() - t0 < 5
    # the refused saves took nothing: the same lease saves the shard as one block, and it commits
    whole = ShardMeta("w", "float32", [n], [0], [n], [n], 0)
    assert isinstance(peer.call(_save(lease, [whole], 1)), SaveAccepted)
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    client.save(2, {"w": torch.arange(8.0)}).wait(60)
    status = peer.final_status(1)  # asked again: the daemon holds one status request back 5 s at most
    assert status.state == "committed", status
    assert len([f for f in os.listdir(tmp_path / "ckpt" / "step_1" / "w") if f.startswith("c.")]) == 1
    client.close()


def test_objects_that_are_not_plain_data_are_refused_and_the_nodes_step_still_commits(start_daemon, tmp_path):
    """Review 47's t3: rank 1's ``objects`` holds a msgpack Ext; it was accepted, then failed the step of the
    node's every rank when the part was written. Now rank 1 is told at once, and saves again."""
    d = start_daemon(str(tmp_path / "ckpt"))
    peers = [RawPeer(d.socket), RawPeer(d.socket)]
    leases = [p.lease(16, step=7, timeout_s=5.0).lease_id for p in peers]
    metas = [ShardMeta("w", "float32", [8], [4 * r], [4], [4], 0) for r in (0, 1)]
    assert isinstance(peers[0].call(_save(leases[0], [metas[0]], 7, 0, 2, {"k": 1})), SaveAccepted)
    body = msgspec.msgpack.encode(_save(leases[1], [metas[1]], 7, 1, 2, {"k": "PLACEHOLDER"}))
    body = body.replace(msgspec.msgpack.encode("PLACEHOLDER"), msgspec.msgpack.encode(msgspec.msgpack.Ext(5, b"x")))
    assert "plain data" in refused(peers[1].send(body), InvalidRequestError)
    assert isinstance(peers[1].call(_save(leases[1], [metas[1]], 7, 1, 2, {"k": 2})), SaveAccepted)
    status = peers[0].final_status(7)
    assert status.state == "committed", status


def test_a_plan_over_the_shard_limit_is_refused_and_the_connection_goes_on(start_daemon, tmp_path):
    d = start_daemon(str(tmp_path / "ckpt"))
    peer = RawPeer(d.socket)
    n = 100_001
    shards = [ShardMeta(f"k{i}", "float32", [1], [0], [1], [1], i) for i in range(n)]
    big = RegisterPlan(v=PROTOCOL_VERSION, rank=0, shards=shards, offsets=[4 * i for i in range(n)], sizes=[4] * n,
                       span=4 * n)
    assert "more than the 100000" in refused(peer.call(big), InvalidRequestError)
    small = RegisterPlan(v=PROTOCOL_VERSION, rank=0, shards=shards[:100], offsets=big.offsets[:100],
                         sizes=big.sizes[:100], span=400)
    assert isinstance(peer.call(small), PlanRegistered)
    assert n - 1 == plans.MAX_SHARDS


def test_a_lease_of_more_slots_than_a_save_may_have_isrefused(start_daemon, tmp_path):
    d = start_daemon(str(tmp_path / "ckpt"))
    peer = RawPeer(d.socket)
    many = LeaseRequest(v=PROTOCOL_VERSION, step=1, rank=0, sizes=[0] * (plans.MAX_SHARDS + 1), timeout_s=1.0)
    assert f"at most {plans.MAX_SHARDS}" in refused(peer.call(many), InvalidRequestError)
    peer.lease(64, step=1)  # granted: the connection goes on


def test_steps_announced_and_never_saved_are_bounded(start_daemon, tmp_path):
    """Review 47: a rank announcing steps it never saves (``PrepareStep``) started a job each, without end; the
    daemon now starts at most ``MAX_STEPS_IN_FLIGHT``, and once they failed by ``--part-timeout`` new ones go."""
    d = start_daemon(str(tmp_path / "ckpt"), "d0", "--part-timeout", "8")
    peer = RawPeer(d.socket)

    def prepare(step: int) -> object:  # rank 0 of 2: the step waits for rank 1, which never comes
        return peer.call(PrepareStep(v=PROTOCOL_VERSION, step=step, rank=0, world_size=2, node=0, num_nodes=1,
                                     local_world_size=2))

    for step in range(1, plans.MAX_STEPS_IN_FLIGHT + 1):
        assert isinstance(prepare(step), StepPrepared), step
    over = plans.MAX_STEPS_IN_FLIGHT + 1
    assert f"{plans.MAX_STEPS_IN_FLIGHT} steps are already in flight" in refused(prepare(over), InvalidRequestError)
    assert isinstance(RawPeer(d.socket).call(Hello(v=PROTOCOL_VERSION, pid=2, rank=1)), Welcome)
    deadline = time.monotonic() + 90  # they fail by --part-timeout; then a new step is started again
    while not isinstance(reply := prepare(over), StepPrepared) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert isinstance(reply, StepPrepared), reply
    # the earliest announced failed first and made the room; the last one follows by the same timeout
    status = peer.final_status(plans.MAX_STEPS_IN_FLIGHT, timeout=max(0.0, deadline - time.monotonic()))
    assert status.state == "failed", status


@pytest.mark.parametrize(("flags", "env", "match"), [
    (["--root", ""], {}, "root is empty"),
    ([], {"CKPTD_READ_TIMEOUT_S": "0"}, "read_timeout_s"),  # every request failed "incomplete frame"
    (["--part-timeout", "-5"], {}, "part_timeout_s"),  # every multi-rank step failed "never saved within -5s"
])
def test_serve_refuses_options_out_of_range_at_startup(tmp_path, sockdir, flags, env, match):
    root = ["--root", str(tmp_path / "ckpt")] if "--root" not in flags else []
    cmd = [sys.executable, "-m", "ckptd.daemon.cli", "serve", *root, "--socket", os.path.join(sockdir, "d.sock"),
           "--arena-size", "4MiB", "--no-prefault", *flags]
    # the old code served (an empty root: in the current directory) until killed
    out = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    line = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and line.startswith("ckptd serve: ConfigError:") and match in line, out.stderr
    assert "Traceback" not in out.stderr
