"""A node that stops waiting for the commit at ``--commit-timeout`` and a coordinator that commits after it
agree on the outcome: two daemons (two nodes) on one root, the coordinator's rank saving only after node 1's
timeout. Both ranks are told the step failed and it is not committed (before, node 1 reported it failed while
the coordinator committed it); the next step commits on both and loads bit-exact."""

from __future__ import annotations

import asyncio

import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.reader import load
from ckptd.testing.launch import run_ranks
from ckptd.writer.errors import SaveTimeoutError
from ckptd.writer.root import open_root

WORLD = 2
# long enough that the step both nodes save together (step 2) commits on a loaded runner (node 1 waits this long
# for the commit, the coordinator as long for node 1's part); step 1's order does not depend on it (a barrier)
TIMEOUT_S = 10.0


def _shard(rank: int, step: int) -> Shard:
    return Shard("w", torch.arange(4.0) + 10 * step + 4 * rank, (4 * WORLD,), (4 * rank,))


def _rank(rank: int, world: int, sockets: list[str]) -> dict[int, str]:
    client = CheckpointClient(sockets[rank], placement=Placement(rank, world, 1, rank))
    outcome: dict[int, str] = {}
    for step in (1, 2):
        if step == 1 and rank == 0:  # the coordinator's part comes after node 1 stopped waiting (and said so)
            torch.distributed.barrier()
        handle = client.save(step, {"w": _shard(rank, step)})
        try:
            handle.wait(60)
            outcome[step] = "committed"
        except SaveTimeoutError as exc:
            outcome[step] = str(exc)
        if step == 1 and rank == 1:  # node 1 gave step 1 up at its commit timeout: now the coordinator saves
            torch.distributed.barrier()
        torch.distributed.barrier()
    client.close()
    return outcome


def test_a_step_a_node_gave_up_at_its_timeout_is_not_committed_late(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    flags = ("--commit-timeout", str(TIMEOUT_S))
    d0, d1 = start_daemon(root, "n0", *flags), start_daemon(root, "n1", *flags)
    coordinator, node1 = run_ranks(_rank, WORLD, [d0.socket, d1.socket], timeout_s=120)
    assert "this node stopped waiting first" in node1[1], node1
    assert "node 1 stopped waiting for the commit" in coordinator[1], coordinator
    assert coordinator[2] == node1[2] == "committed"

    async def committed() -> list[int]:
        async with open_root(root) as r:
            return await r.committed_steps()

    assert asyncio.run(committed()) == [2]
    for rank in range(WORLD):
        out = {"w": Shard("w", torch.zeros(4), (4 * WORLD,), (4 * rank,))}
        load(root, 2, out, rank=rank)
        assert torch.equal(out["w"].data, _shard(rank, 2).data)
