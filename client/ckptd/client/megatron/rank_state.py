"""Per-rank state a load restores besides tensors (RNG, modules' ``_extra_state``), and from which saved rank.

The rule, the same on every load path (same layout, another DP size, other buckets, the merged layout, the
merge-free reshard, model only):

* A saved rank is this rank's *counterpart* when the saving run had this run's TP and PP sizes and expert
  (EP) and expert-tensor (ETP) parallel sizes, and the saved rank had this rank's TP, PP, EP, ETP and DP
  ranks (records saved before the EP fields: TP/PP/DP only). When DP grew and this DP rank did not exist,
  the lowest DP rank of the same TP/PP/EP/ETP rank is the counterpart (Megatron seeds the generators of
  every DP rank alike unless ``data_parallel_random_init``; TE's amax is reduced over DP): logged once per
  process.
* With a counterpart, its RNG state and ``_extra_state`` are restored, whatever else changed (DP size,
  bucket layout, merged or merge-free read); its ``_extra_state`` only where it held the same transformer layers
  in the same model chunks (its record's ``layers``, records saved before it: taken as the same): the stored
  names are per chunk and local layer index, so with virtual pipeline stages added or removed, or the layers
  split otherwise over the stages, a name is another layer's. There ``_extra_state`` is left as it is, with one
  warning per process.
* Without one (the TP, PP, EP or ETP size changed), no saved generator belongs to this rank — Megatron
  derives the tensor-parallel seed from the TP rank, the expert one from the EP and ETP ranks and the default
  one from the PP rank, and the experts' ``_extra_state`` (TE's amax) belongs to the saved rank's experts —
  so RNG state and ``_extra_state`` are left as they are, with one warning per process (as Megatron-LM
  ignores the RNG state when TP/PP changed).

``extra`` (the caller's plain data) comes from the counterpart, else from the lowest saved rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.client.megatron import introspect
from ckptd.client.megatron.extra_state import (
    EXTRA_STATE_RECORD,
    LAYERS_FIELD,
    check_extra_states,
    chunk_layers,
    restore_extra_states,
)
from ckptd.client.megatron.rng import restore_rng, rng_template
from ckptd.client.state import Shard
from ckptd.writer.format import EXTRA, RNG_RECORD, CommitManifest

logger = logging.getLogger(__name__)

Record = dict[str, Any]  # a saved rank's ``megatron`` record (plain data)

_warned: set[str] = set()  # one warning per process and kind


def _once(kind: str, msg: str, *args: object, level: int = logging.WARNING) -> None:
    if kind not in _warned:
        _warned.add(kind)
        logger.log(level, msg, *args)


EXPERT_FIELDS = ("ep", "ep_size", "etp", "etp_size")  # absent from records saved before them


def counterpart(
    records: Mapping[int, Record], tp: int, pp: int, tp_size: int, pp_size: int, dp: int,
    expert: Mapping[str, int] | None = None,
) -> tuple[int, bool]:
    """The saved rank whose per-rank state this rank restores (see the module's rule), and whether it is a
    counterpart at all (else the lowest saved rank, for ``extra`` only). ``expert``: this rank's
    :data:`EXPERT_FIELDS`, matched against the records that hold them."""
    same = [r for r, rec in sorted(records.items())
            if (rec["tp"], rec["pp"], rec["tp_size"], rec["pp_size"]) == (tp, pp, tp_size, pp_size)
            and (expert is None or "ep_size" not in rec or all(rec[f] == expert[f] for f in EXPERT_FIELDS))]
    if not same:
        return min(records), False
    return next((r for r in same if records[r]["dp"] == dp), same[0]), True


@dataclass
class RankState:
    """What a load restores of one saved rank besides tensors: planned (and checked) before any write, the
    RNG buffers filled with the model's tensors, then applied by :meth:`restore`."""

    commit: CommitManifest
    source: int  # the counterpart, else the lowest saved rank (``extra`` only)
    matched: bool  # ``source`` is this rank's counterpart
    rng: dict[str, Shard] = field(default_factory=dict)  # buffers for the stored RNG arrays, filled by the load
    same_layers: bool = True  # ``source`` held this rank's layers in its chunks: its ``_extra_state`` is ours

    @property
    def objects(self) -> Mapping[str, Any]:
        objects: Mapping[str, Any] = self.commit.objects[str(self.source)]
        return objects

    @property
    def extra(self) -> object:
        return self.objects.get(EXTRA)

    def restore(self, model_chunks: Sequence[torch.nn.Module], *, rng: bool) -> None:
        """Set ``_extra_state`` and (``rng``) the generators from the counterpart; nothing without one."""
        if not self.matched:
            return
        if self.same_layers:
            restore_extra_states(model_chunks, self.objects.get(EXTRA_STATE_RECORD))
        if rng:
            restore_rng(self.rng, self.objects.get(RNG_RECORD))


def plan_rank_state(
    commit: CommitManifest,
    records: Mapping[int, Record],
    model_chunks: Sequence[torch.nn.Module],
    coords: tuple[int, int, int, int, int],
    *,
    rng: bool,
) -> RankState:
    """Pick the saved rank for ``coords`` = (tp, pp, tp_size, pp_size, dp), check its ``_extra_state`` fits
    the model (:class:`StateMismatchError` before any write) and allocate the RNG buffers to fill."""
    tp, pp, tp_size, pp_size, dp = coords
    expert = introspect.expert_ranks() if any("ep_size" in rec for rec in records.values()) else None
    source, matched = counterpart(records, tp, pp, tp_size, pp_size, dp, expert)
    state = RankState(commit, source, matched)
    if not matched and expert is not None and counterpart(records, tp, pp, tp_size, pp_size, dp)[1]:
        saved = sorted({(rec.get("ep_size", 1), rec.get("etp_size", 1)) for rec in records.values()})
        _once("no-expert-counterpart", "step %d was saved at EP/ETP %s, this run is EP=%d ETP=%d: no saved rank is "
              "this rank's counterpart, so RNG state and _extra_state are left as they are (restored only at the "
              "saved TP/PP/EP/ETP sizes)", commit.step, saved, expert["ep_size"], expert["etp_size"])
        return state
    if not matched:
        saved = sorted({(rec["tp_size"], rec["pp_size"]) for rec in records.values()})
        _once("no-counterpart", "step %d was saved at TP/PP %s, this run is TP=%d PP=%d: no saved rank is this "
              "rank's counterpart, so RNG state and _extra_state are left as they are (restored only at the saved "
              "TP/PP sizes)", commit.step, saved, tp_size, pp_size)
        return state
    if records[source]["dp"] != dp:
        _once("dp-fallback", "step %d: DP rank %d did not exist at save time; RNG state and _extra_state come "
              "from the lowest DP rank of the same TP/PP/EP rank", commit.step, dp, level=logging.INFO)
    saved_layers = records[source].get(LAYERS_FIELD)
    if saved_layers is not None and saved_layers != (live := chunk_layers(model_chunks)):
        state.same_layers = False
        _once("other-layers", "step %d: saved rank %d held the transformer layers %s in its model chunks, this rank "
              "holds %s (virtual pipeline stages or the split of the layers changed): _extra_state is left as it "
              "is (restored only where the same chunks hold the same layers); RNG state is restored",
              commit.step, source, saved_layers, live)
    else:
        check_extra_states(model_chunks, state.objects.get(EXTRA_STATE_RECORD))
    if rng:
        state.rng = rng_template(commit, source)
    return state
