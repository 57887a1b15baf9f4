"""The plain ``save()`` path's plan reuse: a state saved again with the same structure is staged through a
registered :class:`~ckptd.client.plan.StagePlan` instead of per-shard metas.

A ``save(state)`` plans its shards from the caller's dict at every call (the tensors may be new objects
each time: ``model.state_dict()`` returns fresh views), so the plan cannot hold the sources; it holds
everything else. Every shard is a per-save (*dynamic*) source of the plan: its slot, its meta (registered
with the daemon once and then named by id) and its prebuilt destination view are reused, and one batched
``_foreach_copy_`` stages them. The structure is compared at every save (key, dtype, shape, device, global
shape and offset, chunk grid of every shard, in order); a plan is built only when a structure repeats, so
a caller whose state differs each time pays nothing extra (no registration per save). A plan is built from
checked shards, and the structure compared holds everything those checks read, so a save whose structure
matches one skips the per-shard checks (``save()`` plans with ``plan_state(validate=False)``; any other save
is checked in :meth:`RepeatedPlans.plan_for`). Shards of a subclass that stages itself
(:meth:`~ckptd.client.state.Shard.stage_into` overridden) keep the per-shard path.

A rank whose state holds only non-main replicas (another rank's plain tensors, which rank 0 writes) has a
plan too: nothing to stage, and its replica regions registered once instead of sent and checked with every
save (10,000 plain tensors on 2 ranks of the 2-core VM: rank 1 stalled 89-90 ms a save before, 6-8 ms now).

Once a structure has a plan, the state dict that planned it leaves a :class:`~ckptd.client.skeleton.Skeleton`
(:meth:`RepeatedPlans.remember`): a later dict of the same shape goes to that plan without being planned
shard by shard (:meth:`RepeatedPlans.match`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ckptd.client.plan import StagePlan
from ckptd.client.planbuild import build_stage_plan
from ckptd.client.skeleton import Skeleton
from ckptd.client.state import Plan, Shard, plan_state

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_KEY = "plain"
Route = tuple[StagePlan, list[torch.Tensor], dict[str, Any]] | Plan  # a plan save's arguments, or the shards


def shards_fingerprint(shards: Sequence[Shard], replicas: Sequence[Shard] = ()) -> tuple[Any, ...] | None:
    """Everything a plan of ``shards`` depends on, or None when one stages itself (a subclass). The
    non-main ``replicas`` a plan reports (with its registration) are part of it."""
    if any(type(s) is not Shard for s in shards):
        return None
    ts = [s.data for s in shards]
    fp = (
        [s.key for s in shards], list(map(_DTYPE, ts)), list(map(_SHAPE, ts)), list(map(_DEVICE, ts)),
        [(s.global_shape, s.global_offset, s.chunk_shape) for s in shards],
    )
    if not replicas:
        return fp
    rs = [r.data for r in replicas]
    return (*fp, [r.key for r in replicas], list(map(_DTYPE, rs)), list(map(_SHAPE, rs)),
            [(r.global_shape, r.global_offset, r.chunk_shape) for r in replicas])


class PlanCache:
    """The last plan per owner key, reused while its fingerprint matches (no torch op to compare)."""

    def __init__(self) -> None:
        self._plans: dict[object, StagePlan] = {}

    def get(self, key: object, fingerprint: object) -> StagePlan | None:
        plan = self._plans.get(key)
        return plan if plan is not None and plan.fingerprint == fingerprint else None

    def last(self, key: object) -> StagePlan | None:
        return self._plans.get(key)

    def put(self, key: object, plan: StagePlan) -> None:
        self._plans[key] = plan

    def drop(self, key: object) -> None:
        self._plans.pop(key, None)


class RepeatedPlans:
    """One client's plan for its plain saves: built the second time a structure is seen, reused while it
    holds."""

    def __init__(self) -> None:
        self._cache = PlanCache()
        self._last: object = None  # the previous save's structure, while it has no plan
        self._skeleton: Skeleton | None = None  # the shape of the dict the cached plan was last used for

    def plan_for(self, plan: Plan) -> StagePlan | None:
        """The plan to stage ``plan``'s shards through, or None for the per-shard path; its non-main
        replicas are registered with the plan. A plan is built only from validated shards, so shards that
        match one need no checks of their own; any others are validated here (:meth:`Plan.validate`)."""
        shards, replicas = plan.shards, plan.replicas
        fp = shards_fingerprint(shards, replicas) if shards or replicas else None
        if fp is not None and (staged := self._cache.get(_KEY, fp)) is not None:
            return staged
        plan.validate()
        if fp is None:
            return None
        if fp != self._last:
            self._last = fp
            return None
        staged = build_stage_plan([], shards, fp, replicas)
        self._cache.put(_KEY, staged)
        self._last = None
        return staged

    def match(self, state: Mapping[str, Any]) -> tuple[StagePlan, list[torch.Tensor], dict[str, Any]] | None:
        """(plan, per-save tensors, plain data) for a state dict shaped like the one remembered, while its plan
        is the cached one; None otherwise (plan it: :func:`~ckptd.client.state.plan_state`)."""
        sk = self._skeleton
        if sk is None or self._cache.last(_KEY) is not sk.plan:
            return None
        hit = sk.match(state)
        return None if hit is None else (sk.plan, *hit)

    def remember(self, state: Mapping[str, Any], plan: Plan, staged: StagePlan) -> None:
        """Keep the shape of ``state``, planned as ``plan`` and staged through ``staged``: later dicts of that
        shape skip the planning."""
        self._skeleton = Skeleton.of(state, staged, plan.shards, plan.replicas)

    def route(self, state: Mapping[str, Any], rank: int) -> Route:
        """How ``save(state)`` stages: through a registered plan as (plan, per-save tensors, plain data), else
        as planned shards (checked), one slot each."""
        hit = self.match(state)
        if hit is not None:
            return hit
        plan = plan_state(state, rank, validate=False)  # checked in plan_for unless a plan matches
        route = self.route_plan(plan)
        if not isinstance(route, Plan):
            self.remember(state, plan, route[0])
        return route

    def route_plan(self, plan: Plan) -> Route:
        """:meth:`route` for a state planned already."""
        staged = self.plan_for(plan)
        return plan if staged is None else (staged, [s.data for s in plan.shards], plan.objects)
