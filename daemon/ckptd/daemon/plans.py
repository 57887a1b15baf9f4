"""Registered save plans: a rank's shard metas and slot layout, validated once, named by id in later saves.

A rank whose state keeps its structure (Megatron: every save after the first) registers the plan once
(:class:`~ckptd.client.protocol.RegisterPlan`); each save then leases one contiguous span and sends only
the plan's id. :meth:`PlanRegistry.expand` turns such a save back into what the writer knows: the plan's
shard metas, and a per-shard lease over the span. Nothing per shard is checked again on a save — that is
the point — so :meth:`PlanRegistry.register` checks everything a per-save validation would.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from ckptd.client.protocol import RegisterPlan, ReplicaMeta, SaveRequest, ShardMeta
from ckptd.daemon.arena import Lease
from ckptd.daemon.replicas import check_replica_metas
from ckptd.writer.errors import InvalidRequestError, LeaseError, PlanUnknownError, ShardLayoutError
from ckptd.writer.format import check_region, itemsize, validate_key

MAX_PLANS = 256  # plans kept (oldest dropped first); a dropped one is registered again by its client


@dataclass(frozen=True)
class SavePlan:
    """A validated plan: its shard metas (``slot`` = index into offsets/sizes) and the span they tile."""

    plan_id: int
    shards: list[ShardMeta]
    offsets: list[int]
    sizes: list[int]
    span: int
    replicas: list[ReplicaMeta]  # the rank's non-main replica regions (replicas.py), sent once with the plan
    rank: int  # the rank that registered it, for the error message
    owner: int  # the connection that registered it: its id names it on that connection only


def validate_plan(msg: RegisterPlan) -> None:
    """Everything the daemon checks of a save's shards, once: keys, dtypes, chunk grids, regions given
    once, slots that fit their shard and lie inside the span without overlapping."""
    n = len(msg.offsets)
    if len(msg.sizes) != n or msg.span < 0:
        raise LeaseError(f"plan: {n} slot offsets, {len(msg.sizes)} sizes, span {msg.span}")
    order = sorted(range(n), key=msg.offsets.__getitem__)
    end = 0
    for i in order:
        lo, size = msg.offsets[i], msg.sizes[i]
        if lo < end or size < 0 or lo + size > msg.span:
            raise LeaseError(f"plan: slot {i} [{lo}, {lo + size}) overlaps another or leaves the {msg.span}-byte span")
        end = lo + size
    check_shards(msg.shards, msg.sizes, "the plan")
    check_replica_metas(msg.replicas)


def check_shards(shards: Sequence[ShardMeta], sizes: Sequence[int], owner: str) -> None:
    """A save's shard metas against the slots they name (of a plan or a lease, ``owner`` in errors): valid
    keys and chunk grids, regions inside their arrays and given once, each slot used once and big enough."""
    used: set[int] = set()
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for meta in shards:
        validate_key(meta.key)
        if not 0 <= meta.slot < len(sizes) or meta.slot in used:
            raise LeaseError(f"{meta.key}: slot {meta.slot} is not a free slot of {owner}")
        used.add(meta.slot)
        size = math.prod(meta.shape) * itemsize(meta.dtype)
        if size > sizes[meta.slot]:
            raise LeaseError(f"{meta.key}: {size} bytes do not fit slot {meta.slot} of {sizes[meta.slot]} bytes")
        if any(c <= 0 for c in meta.chunk_shape) or len(meta.chunk_shape) != len(meta.global_shape):
            raise ShardLayoutError(f"{meta.key}: invalid chunk grid {meta.chunk_shape}")
        check_region(meta.key, meta.global_shape, meta.global_offset, meta.shape, meta.chunk_shape)
        where = (meta.key, tuple(meta.global_offset))
        if where in seen:
            raise ShardLayoutError(f"{meta.key}: region at {meta.global_offset} given twice")
        seen.add(where)


class PlanRegistry:
    """The daemon's registered plans, by id (bounded: the oldest go first)."""

    def __init__(self, max_plans: int = MAX_PLANS) -> None:
        self._plans: OrderedDict[int, SavePlan] = OrderedDict()
        self._next_id = 1
        self._max = max_plans

    def register(self, msg: RegisterPlan, owner: int) -> int:
        """Validate ``msg`` and keep it for connection ``owner``; returns its id.

        Clients register their plans once per connection, so an id means something only on the connection
        that registered it; a client that kept an id from an earlier connection, or an earlier daemon whose
        ids the new one hands out again, gets :class:`PlanUnknownError` and registers again.
        """
        validate_plan(msg)
        plan = SavePlan(
            self._next_id, list(msg.shards), list(msg.offsets), list(msg.sizes), msg.span, list(msg.replicas),
            msg.rank, owner,
        )
        self._next_id += 1
        self._plans[plan.plan_id] = plan
        while len(self._plans) > self._max:
            self._plans.popitem(last=False)
        return plan.plan_id

    def forget(self, owner: int) -> None:
        """Drop the plans of connection ``owner`` (it closed: nobody can name them any more)."""
        for pid in [pid for pid, plan in self._plans.items() if plan.owner == owner]:
            del self._plans[pid]

    def spans(self) -> dict[int, int]:
        """Each rank's largest registered span: what its next plan save will lease."""
        out: dict[int, int] = {}
        for plan in self._plans.values():
            out[plan.rank] = max(out.get(plan.rank, 0), plan.span)
        return out

    def get(self, plan_id: int) -> SavePlan:
        plan = self._plans.get(plan_id)
        if plan is None:
            raise PlanUnknownError(f"save plan {plan_id} is not registered with this daemon")
        self._plans.move_to_end(plan_id)
        return plan

    def expand(self, req: SaveRequest, lease: Lease) -> tuple[SaveRequest, Lease]:
        """A plan save as the writer sees it: the plan's metas and replicas, and a lease with one slot per shard.

        The returned lease is a view over ``lease``'s one span: it is not registered with the arena and
        frees nothing itself (its slots start released); the caller releases ``lease`` when the rank's
        save is written.
        """
        if req.shards:
            raise LeaseError(f"save of step {req.step} names plan {req.plan_id} and sends shards too")
        if req.replicas:
            raise InvalidRequestError(f"save of step {req.step} names plan {req.plan_id} and sends replicas too")
        plan = self.get(req.plan_id)
        if plan.owner != lease.owner:  # never another connection's (another rank's) layout
            who = f"rank {plan.rank}, not {req.rank}" if plan.rank != req.rank else "another connection"
            raise PlanUnknownError(
                f"save plan {plan.plan_id} was registered by {who}: an id holds on its own connection only"
            )
        if len(lease.sizes) != 1 or lease.sizes[0] < plan.span:
            raise LeaseError(
                f"plan {plan.plan_id} needs one slot of {plan.span} bytes; lease {lease.lease_id} has {lease.sizes[:4]}"
            )
        base = lease.offsets[0]
        view = Lease(-lease.lease_id, lease.owner, [base + o for o in plan.offsets], list(plan.sizes))
        view.released = [True] * len(view.offsets)
        return msgspec.structs.replace(req, shards=plan.shards, replicas=plan.replicas), view
