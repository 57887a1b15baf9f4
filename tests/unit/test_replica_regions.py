"""Non-main replicas, the pure parts: the planner sets them apart, the wire and the node part carry them
(additively: old messages and parts decode), the node keeps those it did not write, and the coordinator's
check refuses regions no rank wrote or wrote with another shape or dtype."""

from __future__ import annotations

import msgspec
import pytest
import torch

from ckptd.client.protocol import (
    PROTOCOL_VERSION,
    RegisterPlan,
    ReplicaMeta,
    SaveRequest,
    decode_request,
    encode,
)
from ckptd.client.reuse import RepeatedPlans
from ckptd.client.state import Plan, Shard, plan_state, replica_metas
from ckptd.daemon.arena import Lease
from ckptd.daemon.job import RankSave
from ckptd.daemon.plans import PlanRegistry
from ckptd.daemon.replicas import check_replica_metas, node_replicas
from ckptd.writer import format as fmt
from ckptd.writer.errors import InvalidKeyError, ShardLayoutError
from ckptd.writer.replicas import ReplicaRecord, check_replicas


def _state() -> dict[str, object]:
    return {
        "plain": torch.arange(6.0).reshape(2, 3),
        "sh": Shard("sh", torch.ones(2), (4,), (2,), replica_id=(0, 1)),
        "main": Shard("main", torch.ones(2), (4,), (0,)),
        "n": 3,
    }


def test_planner_reports_non_main_replicas_instead_of_dropping_them() -> None:
    on0, on1 = plan_state(_state(), 0), plan_state(_state(), 1)
    assert [s.key for s in on0.shards] == ["plain", "main"] and [s.key for s in on0.replicas] == ["sh"]
    assert [s.key for s in on1.shards] == ["main"] and [s.key for s in on1.replicas] == ["plain", "sh"]
    assert replica_metas(on1.replicas) == [
        ReplicaMeta("plain", "float32", [2, 3], [0, 0], [2, 3]), ReplicaMeta("sh", "float32", [4], [2], [2]),
    ]


def test_wire_carries_replicas_compactly_and_old_messages_decode() -> None:
    reps = [ReplicaMeta("a/b", "bfloat16", [8, 4], [4, 0], [4, 4])]
    save = SaveRequest(v=PROTOCOL_VERSION, lease_id=1, step=2, rank=1, world_size=2, node=0, num_nodes=1,
                       local_world_size=2, shards=[], objects={}, replicas=reps)
    reg = RegisterPlan(v=PROTOCOL_VERSION, rank=1, shards=[], offsets=[], sizes=[], span=0, replicas=reps)
    for msg in (save, reg):
        assert decode_request(encode(msg)[4:]) == msg
    assert msgspec.msgpack.encode(reps[0]) == msgspec.msgpack.encode(["a/b", "bfloat16", [8, 4], [4, 0], [4, 4]])
    old = {k: v for k, v in msgspec.structs.asdict(save).items() if k != "replicas"}
    assert decode_request(msgspec.msgpack.encode({"type": "save", **old})).replicas == []  # type: ignore[union-attr]


def test_daemon_checks_replica_metas_and_keeps_a_plans_replicas() -> None:
    check_replica_metas([ReplicaMeta("k", "float32", [4], [2], [2])])
    with pytest.raises(InvalidKeyError):
        check_replica_metas([ReplicaMeta("../k", "float32", [4], [0], [4])])
    for bad in (ReplicaMeta("k", "float32", [4], [3], [2]), ReplicaMeta("k", "float32", [4], [0], [2, 2])):
        with pytest.raises(ShardLayoutError):
            check_replica_metas([bad])
    reps = [ReplicaMeta("k", "float32", [4], [0], [4])]
    registry = PlanRegistry()
    pid = registry.register(RegisterPlan(v=PROTOCOL_VERSION, rank=1, shards=[], offsets=[], sizes=[], span=0,
                                         replicas=reps), owner=0)
    req = SaveRequest(v=PROTOCOL_VERSION, lease_id=1, step=2, rank=1, world_size=2, node=0, num_nodes=1,
                      local_world_size=2, shards=[], objects={}, plan_id=pid)
    expanded, _ = registry.expand(req, Lease(1, 0, [0], [64]))
    assert expanded.replicas == reps


def _save(rank: int, shards: list[Shard], replicas: list[Shard]) -> RankSave:
    from ckptd.client.plan import shard_meta

    req = SaveRequest(v=PROTOCOL_VERSION, lease_id=1, step=2, rank=rank, world_size=4, node=0, num_nodes=1,
                      local_world_size=4, shards=[shard_meta(s, i) for i, s in enumerate(shards)], objects={},
                      replicas=replica_metas(replicas))
    return RankSave(req, Lease(rank, 0, [], []))


def test_node_part_lists_only_replicas_the_node_did_not_write() -> None:
    t = torch.zeros(4)
    saves = [
        _save(0, [Shard("a", t, (4,), (0,))], []),
        _save(1, [], [Shard("a", t, (4,), (0,), 1), Shard("b", t, (4,), (0,), 1)]),  # a: node 0 wrote it
        _save(2, [], [Shard("b", t, (4,), (0,), 1), Shard("a", t.double(), (4,), (0,), 1)]),  # a of another dtype
    ]
    assert node_replicas(saves) == [
        ReplicaRecord("a", "float64", [4], [0], [4], [2]), ReplicaRecord("b", "float32", [4], [0], [4], [1, 2]),
    ]


def _part(node: int, arrays: list[fmt.ArrayRecord], replicas: list[ReplicaRecord]) -> fmt.PartManifest:
    return fmt.PartManifest(fmt.FORMAT_VERSION, 3, node, 2, 2, [node], arrays, {}, 0, 0.0, replicas)


def test_coordinator_refuses_replicas_nobody_wrote_or_wrote_otherwise() -> None:
    whole = fmt.ArrayRecord("w", "float32", [4], [4], [fmt.ShardRecord(0, [0], [4], [fmt.ChunkRecord([0], 16, 0)])])
    arrays = {"w": whole}
    ok = _part(1, [], [ReplicaRecord("w", "float32", [4], [2], [2], [1])])
    check_replicas([_part(0, [whole], []), ok], arrays)
    # an old part (written before replicas were reported) decodes with none
    raw = msgspec.json.decode(fmt.encode_json(ok))
    del raw["replicas"]
    assert fmt.decode_part(msgspec.json.encode(raw)).replicas == []
    cases = {
        "'x' (ranks [1, 3])": ReplicaRecord("x", "float32", [4], [0], [4], [1, 3]),
        "written as float32(4,); ranks [1] hold a replica of bfloat16(4,)": ReplicaRecord(
            "w", "bfloat16", [4], [0], [4], [1]),
        "written as float32(4,); ranks [1] hold a replica of float32(8,)": ReplicaRecord(
            "w", "float32", [8], [0], [8], [1]),
        "lies outside (4,)": ReplicaRecord("w", "float32", [4], [3], [2], [1]),
    }
    for text, rec in cases.items():
        with pytest.raises(ShardLayoutError, match="step 3 not committed") as info:
            check_replicas([_part(0, [whole], []), _part(1, [], [rec])], arrays)
        assert text in str(info.value)


def test_plain_save_plan_is_rebuilt_when_its_replicas_change() -> None:
    main = [Shard("m", torch.zeros(2), (2,), (0,))]
    reps = [Shard("r", torch.zeros(3), (3,), (0,), 1)]
    plans = RepeatedPlans()
    assert plans.plan_for(Plan(main, replicas=reps)) is None
    plan = plans.plan_for(Plan(main, replicas=reps))
    assert plan is not None and [r.key for r in plan.replicas] == ["r"]
    assert plans.plan_for(Plan(main, replicas=reps)) is plan
    assert plans.plan_for(Plan(main)) is None  # the replica went: a new structure, not the old plan
    other = [Shard("q", torch.zeros(3), (3,), (0,), 1)]
    assert plans.plan_for(Plan(main, replicas=other)) is None  # another replica key
