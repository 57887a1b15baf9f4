"""What a rank saves: shard descriptors and the pure planning that turns a state dict into them.

A state dict is a nested ``dict`` whose leaves are

- :class:`Shard` — a block of a global tensor (Megatron ``ShardedTensor`` semantics: key, global shape,
  global offset, replica id; only the main replica, ``replica_id`` 0 or all zeros, is written);
- objects that quack like Megatron's ``ShardedTensor`` (converted with :meth:`Shard.from_sharded_tensor`);
- plain ``torch.Tensor`` — a tensor replicated on every rank, stored once (rank 0 writes it) under its
  dict path joined with ``/``; use :meth:`Shard.per_rank` for tensors that differ between ranks. Every
  other rank reports it as a non-main replica, and so does any rank for a non-main ``Shard``: the step
  fails with :class:`~ckptd.writer.errors.ShardLayoutError` on every rank, and nothing is committed, when no
  rank wrote that key's main replica with the same global shape and dtype (say rank 1 saves a plain
  tensor under a key rank 0 lacks) — never committed without it;
- anything else — plain data (numbers, strings, lists, dicts) kept per rank in the commit manifest.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.client.protocol import ReplicaMeta
from ckptd.writer.errors import InvalidRequestError, ShardLayoutError
from ckptd.writer.format import check_key_tree, check_region, itemsize, validate_key


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidRequestError(f"unknown torch dtype {name!r}")
    return dt


def _is_main(replica_id: object) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(int(r) == 0 for r in replica_id)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Shard:
    """One rank's block of a global tensor."""

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: int | tuple[int, ...] = 0
    chunk_shape: tuple[int, ...] | None = None  # the block grid; defaults to the block's own shape

    @property
    def is_main_replica(self) -> bool:
        return _is_main(self.replica_id)

    @property
    def grid(self) -> tuple[int, ...]:
        if self.chunk_shape is not None:
            return self.chunk_shape
        return tuple(max(1, n) for n in self.data.shape)  # a zero-size block still has a valid (empty) grid

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def stage_into(self, dst: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy the block into ``dst`` (a staging slot of ``data``'s shape and dtype).

        Subclasses that assemble the block from several tensors at staging time override this (the
        Megatron integration stages each bucket slice straight from the optimizer's per-param state).
        """
        dst.copy_(self.data, non_blocking=non_blocking)

    @classmethod
    def per_rank(cls, key: str, data: torch.Tensor, rank: int, world_size: int) -> Shard:
        """A tensor that differs per rank (RNG state, ...), stored as ``(world_size, *shape)``."""
        return cls(key, data.unsqueeze(0), (world_size, *data.shape), (rank, *([0] * data.dim())))

    @classmethod
    def from_sharded_tensor(cls, st: Any) -> Shard:
        """Convert a Megatron ``ShardedTensor`` (duck-typed: no Megatron import needed)."""
        if getattr(st, "flattened_range", None) is not None:
            raise InvalidRequestError(
                f"{st.key}: flattened ShardedTensors are not stored piecewise; save the rank's contiguous "
                "buffer slice instead (ckptd.client.megatron does this for the distributed optimizer)"
            )
        prepend = int(getattr(st, "prepend_axis_num", 0))
        data = st.data.reshape((1,) * prepend + tuple(st.data.shape))
        global_shape = tuple(int(n) for n in st.global_shape)
        frag = getattr(st, "axis_fragmentations", None) or tuple(
            g // max(1, n) for g, n in zip(global_shape, data.shape, strict=True)
        )
        grid = tuple(-(-g // int(f)) for g, f in zip(global_shape, frag, strict=True))
        return cls(st.key, data, global_shape, tuple(int(o) for o in st.global_offset), st.replica_id, grid)


@dataclass
class Plan:
    """A rank's save: the shards it writes (main replicas only), its plain-data leaves, and the shards it
    holds only as non-main replicas (not written; reported so the coordinator can check someone wrote them)."""

    shards: list[Shard] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    replicas: list[Shard] = field(default_factory=list)
    validated: bool = True  # False: made by plan_state(validate=False); validate() before it is staged

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def validate(self) -> None:
        """Check every shard as :func:`plan_state` does (keys, dtypes, dims, chunk grid), once."""
        if not self.validated:
            for shard in (*self.shards, *self.replicas):
                validate_shard(shard)
            check_key_tree(s.key for s in (*self.shards, *self.replicas))
            self.validated = True


def replica_metas(replicas: Iterable[Shard]) -> list[ReplicaMeta]:
    """The wire form of non-main replica shards: what the coordinator checks someone wrote."""
    return [
        ReplicaMeta(s.key, dtype_name(s.data.dtype), list(s.global_shape), list(s.global_offset), list(s.data.shape))
        for s in replicas
    ]


def _is_sharded_tensor(obj: object) -> bool:
    return all(hasattr(obj, a) for a in ("key", "data", "global_shape", "global_offset", "replica_id"))


def iter_leaves(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in state.items():
        if not isinstance(k, str):
            raise InvalidRequestError(f"state dict keys must be strings, got {k!r} under {prefix or '/'}")
        path = f"{prefix}/{k}" if prefix else k
        if isinstance(v, Mapping):
            yield from iter_leaves(v, path)
        else:
            yield path, v


def to_shard(path: str, leaf: object, rank: int) -> Shard | None:
    """The shard a tensor-like leaf stands for, or None for plain data."""
    if isinstance(leaf, Shard):
        return leaf
    if isinstance(leaf, torch.Tensor):
        shape = tuple(leaf.shape)
        return Shard(path, leaf, shape, (0,) * len(shape), 0 if rank == 0 else 1)
    if _is_sharded_tensor(leaf):
        return Shard.from_sharded_tensor(leaf)
    return None


def validate_shard(shard: Shard) -> None:
    validate_key(shard.key)
    itemsize(dtype_name(shard.data.dtype))
    if len(shard.global_shape) != shard.data.dim():
        raise ShardLayoutError(
            f"{shard.key}: data has {shard.data.dim()} dims but global_shape {shard.global_shape} has "
            f"{len(shard.global_shape)}"
        )
    check_region(shard.key, shard.global_shape, shard.global_offset, tuple(shard.data.shape), shard.grid)


def plan_state(state: Mapping[str, Any], rank: int, *, validate: bool = True) -> Plan:
    """Split a state dict into the shards this rank writes and its plain-data leaves. Pure, no I/O.

    Raises typed errors for unsafe keys, unsupported dtypes, regions off the chunk grid and the same key
    staged twice by this rank. Non-main replicas are not written; they go to ``Plan.replicas``.
    ``validate=False`` leaves the per-shard checks to :meth:`Plan.validate` (the same region twice is
    still refused here): a save whose structure matches a plan made from checked shards skips them.
    """
    plan = Plan(validated=validate)
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for path, leaf in iter_leaves(state):
        shard = to_shard(path, leaf, rank)
        if shard is None:
            set_path(plan.objects, path, leaf)
            continue
        if validate:
            validate_shard(shard)
        if not shard.is_main_replica:
            plan.replicas.append(shard)
            continue
        where = (shard.key, shard.global_offset)
        if where in seen:
            raise ShardLayoutError(f"{shard.key}: region at {shard.global_offset} given twice ({seen[where]}, {path})")
        seen[where] = path
        plan.shards.append(shard)
    if validate:
        check_key_tree(s.key for s in (*plan.shards, *plan.replicas))
    return plan


def set_path(tree: dict[str, Any], path: str, value: object) -> None:
    *parents, last = path.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value

