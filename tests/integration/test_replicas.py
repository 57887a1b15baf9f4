"""Non-main replicas are checked, not dropped: a region a rank holds only as a replica that no rank wrote
(a plain tensor on rank 1 under a key rank 0 lacks, a Shard whose every copy has a nonzero replica id, a
replica of another dtype) fails the step on every rank with ShardLayoutError, on the per-shard path and
through a registered plan, and nothing is committed; replicas that are covered commit as before."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.reader import load
from ckptd.testing.launch import run_ranks
from ckptd.writer.errors import CheckpointNotFoundError, ShardLayoutError
from ckptd.writer.format import decode_part, part_key
from ckptd.writer.replicas import ReplicaRecord
from ckptd.writer.root import open_root

WORLD = 2


def _state(rank: int, step: int, bad: bool) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(WORLD * 4, 3, generator=g)
    state: dict[str, object] = {
        "w": Shard("w", w[4 * rank : 4 * rank + 4].clone(), tuple(w.shape), (4 * rank, 0)),
        "shared": torch.randn(5, generator=g),  # a plain tensor: rank 0 writes it, rank 1 holds a replica
    }
    if bad:
        # every copy is a non-main replica (a wrongly set replica id): nobody would write it
        state["b"] = Shard("b", torch.ones(2), (2,), (0,), replica_id=(0, 1))
        if rank == 1:
            state["only_r1"] = torch.full((3,), 7.0)  # a plain tensor on rank 1 only: rank 0 has no such key
            state["shared"] = state["shared"].double()  # type: ignore[union-attr]  # a replica of another dtype
    return state


def _rank(rank: int, world: int, sockets: list[str]) -> dict[int, str]:
    client = CheckpointClient(sockets[rank], placement=Placement(rank, world, 1, rank))
    outcome: dict[int, str] = {}
    # 1 and 4/5 commit; 2 (per-shard: a new structure) and 3 (its registered plan) must not
    for step, bad in ((1, False), (2, True), (3, True), (4, False), (5, False)):
        handle = client.save(step, _state(rank, step, bad))
        if step in (3, 5):  # the structure repeated: staged through a plan registered with its replicas
            plan = client._repeats._cache._plans.get("plain")
            assert plan is not None and plan.registered is not None and plan.plan_id(client._welcome) > 0
            if rank == 1:
                assert sorted(r.key for r in plan.replicas) == (["b", "only_r1", "shared"] if bad else ["shared"])
        try:
            handle.wait(60)
            outcome[step] = "committed"
        except ShardLayoutError as exc:
            outcome[step] = str(exc)
        torch.distributed.barrier()
    client.close()
    return outcome


def test_uncovered_replicas_fail_the_step_on_every_rank(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    d0, d1 = start_daemon(root, "n0"), start_daemon(root, "n1")  # two nodes: replicas travel in node 1's part
    outcomes = run_ranks(_rank, WORLD, [d0.socket, d1.socket], timeout_s=120)
    for rank, out in enumerate(outcomes):
        assert out[1] == out[4] == out[5] == "committed", (rank, out)
        for step in (2, 3):
            msg = out[step]
            assert msg != "committed", (rank, step)
            assert "'only_r1' (ranks [1])" in msg and "'b' (ranks [0, 1])" in msg, msg
            assert "'shared' (written as float32(5,); ranks [1] hold a replica of float64(5,))" in msg, msg

    async def stored() -> tuple[list[int], int | None, list[ReplicaRecord]]:
        async with open_root(root) as r:
            data = await r.backend.get(part_key(4, 1))
            assert data is not None
            return await r.committed_steps(), await r.latest(), decode_part(data).replicas

    committed, latest, replicas = asyncio.run(stored())
    assert committed == [1, 4, 5] and latest == 5
    # node 1 wrote no "shared": its part reports the replica, once, with the rank holding it
    assert [(r.key, r.dtype, r.global_shape, r.ranks) for r in replicas] == [("shared", "float32", [5], [1])]
    for step in (1, 5):  # committed steps load bit-exact; the failed ones changed nothing
        for rank in range(WORLD):
            want = _state(rank, step, False)
            out = {"w": Shard("w", torch.zeros(4, 3), (WORLD * 4, 3), (4 * rank, 0)), "shared": torch.zeros(5)}
            load(root, step, out, rank=rank)
            assert torch.equal(out["w"].data, want["w"].data)  # type: ignore[attr-defined]
            assert torch.equal(out["shared"], want["shared"])  # type: ignore[arg-type]
    with pytest.raises(CheckpointNotFoundError):
        load(root, 3, {"shared": torch.zeros(5)})
