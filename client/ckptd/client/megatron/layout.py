"""A rank's :class:`~ckptd.writer.layout.MegatronLayout` built from live objects, and the one plan cache.

Everything static about a (model chunks, optimizer) pair — its layout, the owned slices bound to the
live optimizer, the planned save — lives in one :class:`RankPlan` per optimizer object, held in one
``WeakKeyDictionary`` (:data:`_PLANS`): it goes away with the optimizer. Each part is computed on first
use and checked before reuse (a different layout rebinds; a moved param replans the save).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ckptd.client.megatron import introspect
from ckptd.client.megatron.introspect import DistOpt, Owned
from ckptd.writer.errors import InvalidRequestError
from ckptd.writer.format import LAYOUT_FIELD, OPTIM_PREFIX, CommitManifest
from ckptd.writer.layout import MegatronLayout, ModelPiece, decode_layout

if TYPE_CHECKING:
    from ckptd.client.megatron.save import SavePlan
    from ckptd.writer.root import CheckpointRoot

logger = logging.getLogger(__name__)


def build_layout(model_chunks: Sequence[torch.nn.Module], optimizer: object) -> MegatronLayout:
    """Compute the layout from live model chunks (DDP-wrapped) and a (chained) DistributedOptimizer.

    No communication. Cross-checks Megatron's own per-rank ranges (``gbuf_ranges``) against the
    ranges derived from ``param_index_map``/``bucket_indices``, so a megatron-core version that changes
    the buffer layout fails loudly here rather than writing wrong slices.
    """
    buffers = introspect.buffer_layouts(model_chunks, optimizer)
    ranks = introspect.parallel_ranks()
    layout = MegatronLayout(
        tp_rank=ranks.tp_rank,
        tp_size=ranks.tp_size,
        pp_rank=ranks.pp_rank,
        pp_size=ranks.pp_size,
        dp_rank=ranks.dp_rank,
        dp_size=ranks.dp_size,
        buffers=tuple(buffers),
        megatron_core_version=introspect.megatron_version(),
    )
    for _buf, bucket in layout.buckets():
        for p in bucket.params:
            for piece in p.model_pieces:
                layout.model_key(piece.key)  # every key valid before anything is staged
    logger.debug(
        "megatron layout tp%d pp%d dp%d/%d: %d buffers, %d buckets",
        layout.tp_rank,
        layout.pp_rank,
        layout.dp_rank,
        layout.dp_size,
        len(layout.buffers),
        sum(len(b.buckets) for b in layout.buffers),
    )
    return layout


def view_of(piece: ModelPiece, param: torch.Tensor) -> torch.Tensor:
    """``piece`` of ``param`` (any contiguous tensor of the param's shape, e.g. a merged state)."""
    if not param.is_contiguous():
        raise InvalidRequestError(f"{piece.key}: view_of needs a contiguous tensor")
    return param.as_strided(piece.view_shape, piece.view_stride, param.storage_offset() + piece.view_offset)


# --- the plan cache -------------------------------------------------------------------------------------
@dataclass
class Binding:
    """A layout bound to a live (chained) DistributedOptimizer: the slices this rank owns, per bucket."""

    layout: MegatronLayout
    owned: dict[tuple[int, int], list[Owned]]  # (buffer.index, bucket.index) -> owned slices
    dist: dict[int, DistOpt]  # optimizer_index -> DistributedOptimizer


@dataclass
class RankPlan:
    """What does not change between saves and loads of one (model chunks, optimizer) on this rank."""

    layout: MegatronLayout | None = None  # get_layout's, built once
    binding: Binding | None = None  # the last layout bound (get_layout's, or one a caller passed)
    save: SavePlan | None = None  # the planned save (keys, shapes, validated shards)


_PLANS: weakref.WeakKeyDictionary[object, RankPlan] = weakref.WeakKeyDictionary()


def rank_plan(optimizer: object) -> RankPlan:
    """The cached plan of ``optimizer`` (created empty on first use)."""
    plan = _PLANS.get(optimizer)
    if plan is None:
        plan = _PLANS[optimizer] = RankPlan()
    return plan


def cached_plan(optimizer: object) -> RankPlan | None:
    """The cached plan of ``optimizer``, or None if nothing was computed for it yet."""
    return _PLANS.get(optimizer)


def get_layout(model_chunks: Sequence[torch.nn.Module], optimizer: object) -> MegatronLayout:
    """:func:`build_layout`, computed once per optimizer object and cached."""
    plan = rank_plan(optimizer)
    if plan.layout is None:
        plan.layout = build_layout(model_chunks, optimizer)
    return plan.layout


def bind(optimizer: object, layout: MegatronLayout) -> Binding:
    """``layout`` bound to ``optimizer``; reused while the same layout object is asked for."""
    plan = rank_plan(optimizer)
    if plan.binding is None or plan.binding.layout is not layout:
        owned, dist = introspect.bind_owned(optimizer, layout)
        plan.binding = Binding(layout, owned, dist)
    return plan.binding


async def saved_layouts(
    ckpt: CheckpointRoot, commit: CommitManifest, records: Mapping[int, Mapping[str, Any]]
) -> list[MegatronLayout]:
    """Layout sidecars covering every model-parallel tag the step stores: the first saved rank of each TP/PP
    rank, then (expert parallelism: the EP rank is not in the record) further distinct sidecars, in rank
    order, until every stored ``optim/<mp>/`` has one."""
    stored = {r.name[len(OPTIM_PREFIX) :].split("/", 1)[0] for r in commit.arrays if r.name.startswith(OPTIM_PREFIX)}
    firsts: dict[tuple[int, int], int] = {}
    for r, rec in sorted(records.items()):
        firsts.setdefault((rec["tp"], rec["pp"]), r)
    names = [records[r][LAYOUT_FIELD] for r in firsts.values()]
    names += [rec[LAYOUT_FIELD] for _r, rec in sorted(records.items()) if rec[LAYOUT_FIELD] not in names]
    layouts: list[MegatronLayout] = []
    covered: set[str] = set()
    for i, name in enumerate(dict.fromkeys(names)):
        if i >= len(firsts) and stored <= covered:
            break
        layouts.append(decode_layout(await ckpt.read_sidecar(name)))
        covered |= {buf.mp for buf in layouts[-1].buffers}
    return layouts
