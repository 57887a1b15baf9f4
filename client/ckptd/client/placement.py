"""Where a rank sits (global rank, world, its node and the ranks on that node), read from its launcher.

Every rank of a node must tell its daemon the same node index and the same number of local ranks: the
daemon waits for exactly that many local saves before it writes the node's part. A wrong guess does not
fail fast (the daemon waits for ranks that never come), so :meth:`Placement.detect` refuses to guess and
raises :class:`~ckptd.writer.errors.PlacementError` when the environment does not say.

Launchers understood, first match wins:

- torchrun (and ``torch.distributed.launch``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, node from
  ``GROUP_RANK`` (or ``NODE_RANK``);
- Ray (verl sets these in its workers): ``RANK``, ``WORLD_SIZE``, ``RAY_LOCAL_WORLD_SIZE``, ``LOCAL_RANK``;
  the node is ``CKPTD_NODE_RANK`` if set, else ``RANK // RAY_LOCAL_WORLD_SIZE``, accepted only when
  ``LOCAL_RANK == RANK % RAY_LOCAL_WORLD_SIZE`` (ranks packed node by node, as verl's placement groups
  place them);
- SLURM (``srun`` one task per rank): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_NODEID``, and the tasks
  of this node from ``SLURM_NTASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE`` (``"4"``, ``"2(x3)"``,
  ``"2(x3),1"``).

``CKPTD_NODE_RANK`` overrides the node index under every launcher. A single process with no launcher is
rank 0 of 1.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ckptd.writer.errors import PlacementError

_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


@dataclass(frozen=True)
class Placement:
    """Where this rank sits: its global rank, the world, the ranks on its node and the node's index.

    ``local_world_size`` is the number of ranks on *this* node (the daemon waits for that many);
    ``nodes`` the number of nodes when the launcher says so (SLURM with uneven nodes), else 0: derived
    from ``world_size / local_world_size``.
    """

    rank: int
    world_size: int
    local_world_size: int
    node: int
    nodes: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise PlacementError(f"rank {self.rank} outside world size {self.world_size}")
        if not 1 <= self.local_world_size <= self.world_size:
            raise PlacementError(f"local world size {self.local_world_size} outside [1, {self.world_size}]")
        if not 0 <= self.node < self.num_nodes:
            raise PlacementError(f"node {self.node} outside [0, {self.num_nodes}) for rank {self.rank}")

    @property
    def num_nodes(self) -> int:
        """How many nodes the job spans."""
        return self.nodes or -(-self.world_size // self.local_world_size)

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> Placement:
        """Read the placement from torchrun, Ray or SLURM variables; :class:`PlacementError` if unclear."""
        node_override = _int(env, "CKPTD_NODE_RANK")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if rank is None or world is None:
            rank, world = _from_torch(rank, world)
        if rank is not None and world is not None:
            local = _int(env, "LOCAL_WORLD_SIZE")
            if local is not None:  # torchrun
                node = _first(node_override, _int(env, "GROUP_RANK"), _int(env, "NODE_RANK"))
                return cls(rank, world, local, rank // local if node is None else node)
            local = _int(env, "RAY_LOCAL_WORLD_SIZE")
            if local is not None:  # Ray (verl)
                if node_override is not None:
                    return cls(rank, world, local, node_override)
                local_rank = _int(env, "LOCAL_RANK")
                if local_rank is not None and local_rank != rank % local:
                    raise PlacementError(
                        f"rank {rank} has LOCAL_RANK={local_rank} with RAY_LOCAL_WORLD_SIZE={local}: the ranks are "
                        f"not packed node by node, so the node index cannot be derived; set CKPTD_NODE_RANK "
                        f"(the node's index, 0..nodes-1) in every worker or pass placement="
                    )
                return cls(rank, world, local, rank // local)
        if _int(env, "SLURM_PROCID") is not None and _int(env, "SLURM_NTASKS") is not None:
            return _slurm(cls, env, node_override)
        if world is None or world == 1:
            return cls(0, 1, 1, 0)
        raise PlacementError(
            f"RANK={env.get('RANK')} WORLD_SIZE={env.get('WORLD_SIZE')} but no launcher variable says which ranks "
            f"share a node (LOCAL_WORLD_SIZE for torchrun, RAY_LOCAL_WORLD_SIZE for Ray, SLURM_* for srun): set "
            f"LOCAL_WORLD_SIZE (and CKPTD_NODE_RANK) or pass placement=Placement(rank, world, local, node)"
        )


def _slurm(cls: type[Placement], env: Mapping[str, str], node_override: int | None) -> Placement:
    rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    node = _first(node_override, _int(env, "SLURM_NODEID"))
    spec = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if node is None or not spec:
        raise PlacementError(
            f"SLURM task {rank}/{world}: SLURM_NODEID and SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE) are "
            f"needed to place it on a node"
        )
    per_node = tasks_per_node(spec)
    if len(per_node) == 1:  # "--ntasks-per-node=N": the same on every node
        return cls(rank, world, per_node[0], node)
    if node >= len(per_node) or sum(per_node) != world:
        raise PlacementError(f"SLURM tasks per node {spec!r} do not fit node {node} and {world} tasks")
    return cls(rank, world, per_node[node], node, nodes=len(per_node))


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed tasks-per-node list: ``"2(x3),1"`` → ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = _TASKS.match(part.strip())
        if m is None:
            raise PlacementError(f"cannot read SLURM tasks per node {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _from_torch(rank: int | None, world: int | None) -> tuple[int | None, int | None]:
    """Fill what the environment lacks from an initialized ``torch.distributed`` (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return rank, world
    return (dist.get_rank() if rank is None else rank), (dist.get_world_size() if world is None else world)


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise PlacementError(f"{name}={value!r} is not an integer") from None


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)
