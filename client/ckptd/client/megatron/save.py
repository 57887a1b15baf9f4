"""``save_checkpoint``: stage a rank's model shards, optimizer bucket slices, RNG and extra data."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ckptd.client.collector import paused
from ckptd.client.early import EarlyCopy, copied_ahead
from ckptd.client.megatron import introspect
from ckptd.client.megatron.constant import capture
from ckptd.client.megatron.extra_state import (
    EXTRA_STATE_RECORD,
    LAYERS_FIELD,
    chunk_layers,
    extra_state_modules,
    extra_states,
)
from ckptd.client.megatron.layout import Binding, bind, get_layout, rank_plan
from ckptd.client.megatron.model import model_state, refuse_copies
from ckptd.client.megatron.optimizer import optimizer_shards, state_names
from ckptd.client.megatron.rehome import rehome_states
from ckptd.client.megatron.rng import rng_state
from ckptd.client.megatron.staged import (
    OwnedStates,
    StagedSave,
    Structure,
    cached,
    forget,
    moves_states,
    optim_meta,
    owned_by_optimizer,
    remember,
)
from ckptd.client.plan import StagePlan, StalePlanError
from ckptd.client.planbuild import build_stage_plan
from ckptd.client.state import Plan, Shard, plan_state
from ckptd.writer.format import (
    EXTRA,
    LAYOUT_FIELD,
    MEGATRON_CHECKPOINT_VERSION,
    MEGATRON_RECORD,
    OPTIM_META,
    RNG_RECORD,
    sidecar_name,
)
from ckptd.writer.layout import MegatronLayout

if TYPE_CHECKING:
    from ckptd.client.client import CheckpointClient
    from ckptd.client.handle import SaveHandle
    from ckptd.client.megatron.introspect import MegatronOptimizer

logger = logging.getLogger(__name__)


@dataclass
class SavePlan:
    """What does not change between saves of one (model, optimizer): computed once, then reused."""

    chunk_ids: tuple[int, ...]
    signature: tuple[int, ...]  # storage addresses of every param: a moved param invalidates the plan
    elem_names: tuple[str, ...]
    layout_json: str
    record: dict[str, Any]  # the per-rank ``megatron`` record
    shards: list[Shard]  # model and optimizer shards this rank writes (main replicas), validated
    replicas: list[Shard] = field(default_factory=list)  # held as non-main replicas: reported, not written


def _param_signature(model_chunks: Sequence[torch.nn.Module]) -> tuple[int, ...]:
    return tuple(p.data_ptr() for c in model_chunks for p in c.parameters())


def megatron_record(
    layout: MegatronLayout, layout_json: str, model_chunks: Sequence[torch.nn.Module] | None = None
) -> dict[str, Any]:
    """The per-rank ``megatron`` record: the layout sidecar's name, this rank's parallel coordinates (expert
    parallel ones included) and, given ``model_chunks``, their layers (:func:`~.extra_state.chunk_layers`)."""
    return {
        "version": MEGATRON_CHECKPOINT_VERSION,
        LAYOUT_FIELD: sidecar_name(layout_json),
        "tp": layout.tp_rank,
        "tp_size": layout.tp_size,
        "pp": layout.pp_rank,
        "pp_size": layout.pp_size,
        "dp": layout.dp_rank,
        "dp_size": layout.dp_size,
        "megatron_core": layout.megatron_core_version,
        **introspect.expert_ranks(),
        **({LAYERS_FIELD: chunk_layers(model_chunks)} if model_chunks is not None else {}),
    }


def save_plan(
    model_chunks: Sequence[torch.nn.Module], optimizer: object, rank: int, elem_names: Sequence[str] | None = None
) -> SavePlan:
    """The cached :class:`SavePlan` of this (model chunks, optimizer), (re)planned when it went stale."""
    layout = get_layout(model_chunks, optimizer)
    binding = bind(optimizer, layout)
    elem_names = tuple(state_names(binding)[0] if elem_names is None else elem_names)
    chunk_ids = tuple(id(c) for c in model_chunks)
    signature = _param_signature(model_chunks)
    cache = rank_plan(optimizer)
    plan = cache.save
    if plan is not None and (plan.chunk_ids, plan.signature, plan.elem_names) == (chunk_ids, signature, elem_names):
        return plan
    model = model_state(model_chunks)
    objects = {k: v for k, v in model.items() if not isinstance(v, Shard)}
    if objects:  # _extra_state is saved apart (extra_state.py); other ShardedObjects are not
        logger.warning("rank %d: model ShardedObjects %s are not saved by ckptd", rank, sorted(objects)[:5])
    # detached views: staging reads them after the optimizer has updated the params in place
    state: dict[str, Shard] = {k: replace(v, data=v.data.detach()) for k, v in model.items() if isinstance(v, Shard)}
    refuse_copies(model_chunks, state)
    state.update(optimizer_shards(optimizer, layout))
    planned = plan_state(state, rank)  # validates keys, dtypes and chunk grids; sets replicas apart
    shards = planned.shards
    layout_json = layout.to_json()
    record = megatron_record(layout, layout_json, model_chunks)
    plan = SavePlan(chunk_ids, signature, elem_names, layout_json, record, shards, planned.replicas)
    cache.save = plan
    logger.info(
        "rank %d: planned Megatron save: %d shards, %.1f MiB, layout %s",
        rank, len(shards), sum(s.nbytes for s in shards) / 2**20, record[LAYOUT_FIELD][:12],
    )
    return plan


def model_only_plan(model_chunks: Sequence[torch.nn.Module], rank: int) -> SavePlan:
    """The cached :class:`SavePlan` of a save without optimizer (model tensors only; no layout sidecar)."""
    chunk_ids = tuple(id(c) for c in model_chunks)
    signature = _param_signature(model_chunks)
    cache = rank_plan(model_chunks[0])
    plan = cache.save
    if plan is not None and (plan.chunk_ids, plan.signature) == (chunk_ids, signature):
        return plan
    model = model_state(model_chunks)
    state = {k: replace(v, data=v.data.detach()) for k, v in model.items() if isinstance(v, Shard)}
    ranks = introspect.parallel_ranks()
    record = {
        "version": MEGATRON_CHECKPOINT_VERSION, LAYOUT_FIELD: "", "tp": ranks.tp_rank, "tp_size": ranks.tp_size,
        "pp": ranks.pp_rank, "pp_size": ranks.pp_size, "dp": ranks.dp_rank, "dp_size": ranks.dp_size,
        "megatron_core": introspect.megatron_version(), **introspect.expert_ranks(),
        LAYERS_FIELD: chunk_layers(model_chunks),
    }
    refuse_copies(model_chunks, state)
    planned = plan_state(state, rank)
    plan = SavePlan(chunk_ids, signature, (), "", record, planned.shards, planned.replicas)
    cache.save = plan
    return plan


@paused
def save_checkpoint(
    client: CheckpointClient,
    step: int,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    *,
    extra: Mapping[str, object] | None = None,
    rng: bool = True,
    assume_constant_structure: bool | None = None,
) -> SaveHandle:
    """Stage this rank's model shards, DP-local optimizer slices, RNG state and ``extra`` for ``step``.

    Call it on every rank, like Megatron-LM's ``save_checkpoint(iteration, model, optimizer, ...)``
    (``model_chunks`` is its ``model`` list of DDP-wrapped chunks, ``optimizer`` what
    ``get_megatron_optimizer`` returned, or None to save the model alone). Returns the
    :class:`~ckptd.client.handle.SaveHandle` as soon as the data is in the daemon's shared memory;
    training may go on and overwrite its tensors at once.
    ``handle.wait()`` blocks until the step committed (or raises why it did not).

    - model: ``sharded_state_dict()`` in model space (``model/<key>``), DP-replicated tensors split
      across DP ranks;
    - optimizer: one contiguous slice per (buffer, bucket, state) of the padded bucket
      (``optim/<mp>/buf<g>/bucket<b>/<state>``), copied straight from the optimizer into the slot, plus
      its plain data (param groups, ``step``, grad scaler);
    - modules' ``_extra_state`` (Transformer Engine's FP8 scaling), per rank, as plain data;
    - RNG (``rng=True``): torch (and CUDA, and Megatron's CUDA RNG tracker) states as per-rank arrays,
      Python's and NumPy's as plain data;
    - ``extra``: plain data (dict/list/str/int/float/bool/None): iteration, scheduler ``state_dict()``,
      consumed samples...;
    - the :class:`~ckptd.writer.layout.MegatronLayout` as a content-addressed sidecar, named in this
      rank's ``megatron`` record (sent once per connection, stored once per root).

    Everything static (keys, shapes, bucket layout, the shard metas, the slot layout and the copy
    program) is planned on the first call and registered with the daemon; a later call checks the
    structure (see :mod:`.staged`), does the batched copies and one short socket round trip naming the
    plan (with a request for the next save's staging space). A change of structure plans again. No
    collective.

    ``assume_constant_structure`` (default: the client's setting) promises that the model's params and the
    optimizer's param groups and state tensors stay the same objects between saves (values change): a save
    then skips the per-tensor checks and lookups, reading the tensors captured at the last checked save
    behind a cheap whole-structure check, and waits for no answer from the daemon (its staging space is
    granted with the previous save; a refusal reaches ``handle.wait()`` or the next save). What is still
    read and checked: :mod:`ckptd.client.megatron.constant`.
    """
    if optimizer is None:  # model only (Megatron-LM's --no-save-optim): the per-shard path
        return _save_model_only(client, step, model_chunks, extra, rng)
    t0 = time.perf_counter()
    constant = client.assume_constant_structure if assume_constant_structure is None else assume_constant_structure
    with client.one_save_call(step):  # the replan below is this call's attempt again, as on the other ranks
        try:
            # the plan's static sources (nearly all the bytes) are copied into the lease granted ahead while the
            # checks run (on a GPU, as queued transfers); abandoned, the lease given back, on any other way out
            ahead = copied_ahead(client, _reused_plan(optimizer, model_chunks), step, prepare=not constant)
            with introspect.leaves_reused(), ahead as early:
                return _save_once(client, step, model_chunks, optimizer, extra, rng, t0, constant, early)
        except StalePlanError:  # a state tensor changed under the plan in a way the structure check missed
            forget(optimizer)
            with introspect.leaves_reused():
                return _save_once(client, step, model_chunks, optimizer, extra, rng, t0, constant)


def _reused_plan(optimizer: object, model_chunks: Sequence[torch.nn.Module]) -> StagePlan | None:
    """The plan a save of these (model chunks, optimizer) will reuse if their structure holds."""
    staged = cached(optimizer)
    return staged.plan if staged is not None and staged.chunk_ids == tuple(map(id, model_chunks)) else None


def _save_once(
    client: CheckpointClient,
    step: int,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: object,
    extra: Mapping[str, object] | None,
    rng: bool,
    t0: float,
    constant: bool = False,
    early: EarlyCopy | None = None,
) -> SaveHandle:
    p = client.placement
    staged = cached(optimizer)
    layout = get_layout(model_chunks, optimizer)
    binding = bind(optimizer, layout)
    rng_shards: list[Shard] = []
    objects: dict[str, Any] = {}
    if rng:
        rng_shards, objects[RNG_RECORD] = rng_state(p.rank, p.world_size)
    rng_keys = tuple((s.key, s.data.dtype, s.data.shape) for s in rng_shards)
    chunk_ids = tuple(id(c) for c in model_chunks)
    frozen = staged.frozen if constant and staged is not None and staged.chunk_ids == chunk_ids else None
    fetched = None
    if staged is not None and frozen is not None and frozen.holds(binding, rng_keys):  # the promise, cheaply
        objects[OPTIM_META] = frozen.optim_meta(binding)
        fetched = frozen.fetched
    else:
        states = staged.states.lookup() if staged is not None else {}
        if (
            staged is None
            or staged.chunk_ids != chunk_ids
            or not staged.structure.holds(binding, states, rng_keys)
        ):
            if early is not None:  # the copy made ahead was of the old plan: wait for it, give its lease back
                early.abandon()
                early = None
            # what the old plan holds (captured tensors, re-homed states) goes before re-homing allocates:
            # the cache's reference, and the pipelined saves' (kept for a resend until their answers are read)
            staged = frozen = None
            client.read_answers()
            forget(optimizer)
            staged = _plan_staged(model_chunks, optimizer, layout, binding, p.rank, rng_shards)
            states = staged.states.lookup()
        objects[OPTIM_META] = optim_meta(staged, optimizer, binding, layout, states)
        staged.frozen = capture(staged, binding, states, rng_keys) if constant else None
    objects[MEGATRON_RECORD] = staged.record
    modules_extra = extra_states(model_chunks, staged.extra_modules)
    if modules_extra:
        objects[EXTRA_STATE_RECORD] = modules_extra
    if extra is not None:
        objects[EXTRA] = dict(extra)
    handle = client.save_staged(
        step, staged.plan, [s.data for s in rng_shards], objects, sidecars=[staged.layout_json], t0=t0,
        fetched=fetched, pipelined=constant, early=early,
    )
    staged.served += 1
    return handle


def _plan_staged(
    model_chunks: Sequence[torch.nn.Module],
    optimizer: object,
    layout: MegatronLayout,
    binding: Binding,
    rank: int,
    rng_shards: list[Shard],
) -> StagedSave:
    """Plan the save from scratch (the structure changed): shards, layout, copy program, plain-data walk."""
    rank_plan(optimizer).save = None  # the shard plan is rebuilt too, whatever its own check says
    elem_names, scalar_names = state_names(binding)
    # one flat tensor per (bucket slice, state), one copy each; not for an optimizer that lets them go
    moved = [] if moves_states(optimizer) else rehome_states(binding, layout, elem_names)
    plan = save_plan(model_chunks, optimizer, rank, elem_names)
    owned = owned_by_optimizer(binding, layout)
    states = OwnedStates(owned)
    rng_keys = tuple((s.key, s.data.dtype, s.data.shape) for s in rng_shards)
    structure = Structure(model_chunks, binding, states.lookup(), rng_keys)
    stage_plan = build_stage_plan(plan.shards, rng_shards, replicas=plan.replicas)
    staged = StagedSave(
        structure, states, stage_plan, plan.layout_json, plan.record, scalar_names, owned,
        tuple(id(c) for c in model_chunks), extra_state_modules(model_chunks),
    )
    remember(optimizer, staged)
    logger.info(
        "rank %d: staged plan: %d shards in %d copies, span %.1f MiB (%d optimizer states re-homed)",
        rank, len(stage_plan.metas), stage_plan.copies, stage_plan.span / 2**20, len(moved),
    )
    return staged


def _save_model_only(
    client: CheckpointClient, step: int, model_chunks: Sequence[torch.nn.Module],
    extra: Mapping[str, object] | None, rng: bool,
) -> SaveHandle:
    """A save without optimizer state: the model tensors (cached shard list), extra state, RNG, ``extra``."""
    p = client.placement
    plan = model_only_plan(model_chunks, p.rank)
    objects: dict[str, Any] = {MEGATRON_RECORD: plan.record}
    states = extra_states(model_chunks)
    if states:
        objects[EXTRA_STATE_RECORD] = states
    if extra is not None:
        objects[EXTRA] = dict(extra)
    shards = list(plan.shards)
    if rng:
        rng_shards, objects[RNG_RECORD] = rng_state(p.rank, p.world_size)
        shards += rng_shards
    return client.save_plan(step, Plan(shards, objects, plan.replicas))
