"""A load at another padded vocabulary: the rows both the checkpoint and the live model hold.

Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by`` x TP (GPT-2's 50257 is
50304 rows at TP1, 50432 at TP2, 50688 at TP4), so the word embeddings and the output layer of a model
loaded at another TP have another number of rows. megatron-core marks those ``ShardedTensor``\\ s
``allow_shape_mismatch=True`` and its loader (``dist_checkpointing/strategies/torch.py``) zeroes such a
tensor, then reads the region the checkpoint and the model share; the optimizer's state of the param (its
``ShardedTensor``\\ s are copies of the model's, flag included) is treated the same.

ckptd does the same, on every load path. Where a model array's stored global shape differs from the live
one only along the first (vocab) axis, and every live ``ShardedTensor`` of that key allows the mismatch:

- the model tensors read the rows both hold; the live rows the checkpoint lacks are zeroed; the checkpoint's
  rows beyond the live vocabulary are not read (:func:`fit_vocab`);
- the optimizer's state of such a param (fp32 main param, Adam's moments) likewise: its model pieces are cut
  to the stored rows (:meth:`VocabFit.fit`), so the plans of :mod:`~ckptd.client.megatron.reshard` read the
  overlap, and its range of this rank's bucket slices is zeroed first (:meth:`VocabFit.zero`). The new rows'
  main params are then 0, the value of the zeroed model rows (also of a bf16 model's), and their moments 0,
  as a fresh Adam holds them.

Any other shape difference, or one of a key not marked so, is left to the usual checks, which refuse it
naming the key. Nothing here writes until :meth:`VocabFit.zero`, which the loader calls after every check.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import msgspec
import torch

from ckptd.client.megatron import introspect
from ckptd.client.megatron.coverage import covered
from ckptd.client.state import Shard
from ckptd.writer.errors import StateMismatchError
from ckptd.writer.format import CommitManifest, model_key, split_bucket_key
from ckptd.writer.layout import MegatronLayout, ModelPiece, ParamLayout

logger = logging.getLogger(__name__)


@dataclass
class VocabFit:
    """A load's fit to the checkpoint's vocabulary rows (empty where every shape matches)."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model array -> its stored global shape
    fresh: list[torch.Tensor] = field(default_factory=list)  # live model rows the checkpoint lacks
    cut: frozenset[ParamLayout] = frozenset()  # params of the fitted layout that hold such rows
    layout: MegatronLayout | None = None  # the fitted layout (:meth:`fit`)
    live: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model array -> the live global shape
    step: int = 0
    with_optimizer: bool = True
    _told: bool = False

    def fit(self, layout: MegatronLayout) -> MegatronLayout:
        """``layout`` with the model pieces of the refitted keys cut to the stored rows (the global shape the
        checkpoint's); the params that lost rows are kept in :attr:`cut`, whose plans may leave them partly
        uncovered. ``layout`` itself when nothing differs."""
        if not self.shapes:
            return layout
        cut: set[ParamLayout] = set()

        def fitted(p: ParamLayout) -> ParamLayout:
            pieces = [c for piece in p.model_pieces if (c := self._piece(layout, piece)) is not None]
            if pieces == list(p.model_pieces):
                return p
            out = msgspec.structs.replace(covered(p), model_pieces=tuple(pieces))
            if out.uncovered() is not None:
                cut.add(out)
            return out

        self.layout = layout.with_params(fitted)
        self.cut = frozenset(cut)
        return self.layout

    def _piece(self, layout: MegatronLayout, piece: ModelPiece) -> ModelPiece | None:
        """``piece`` cut to the stored rows (None when it holds none of them)."""
        shape = self.shapes.get(layout.model_key(piece.key))
        if shape is None:
            return piece
        if piece.prepend_axis_num:  # the first axis is a stacking axis, not the vocabulary's
            raise StateMismatchError(f"{piece.key}: the checkpoint has global shape {shape}, the model "
                                     f"{piece.global_shape} (on a stacking axis)")
        rows = min(max(shape[0] - piece.global_offset[0], 0), piece.view_shape[0])
        if rows == 0:
            return None
        return msgspec.structs.replace(piece, global_shape=shape, view_shape=(rows, *piece.view_shape[1:]))

    def zero(self, slices: Mapping[str, torch.Tensor] | None = None) -> None:
        """Zero the live model rows the checkpoint lacks, and in ``slices`` (this rank's bucket slices, by
        optimizer key) the ranges of the :attr:`cut` params, whose overlap the read then fills. The first write
        of the load: call it after every check. Logs the one INFO line naming the keys (a refused load never
        gets here, so never logs it)."""
        self._tell()
        for t in self.fresh:
            t.zero_()
        if not slices or not self.cut or self.layout is None:
            return
        by_prefix: dict[str, list[torch.Tensor]] = {}
        for key, t in slices.items():
            by_prefix.setdefault(split_bucket_key(key)[0], []).append(t)
        cut = {id(p) for p in self.cut}  # the fitted layout's own objects
        for buf, bucket in self.layout.buckets():
            s = buf.slice_numel(bucket)
            lo = buf.dp_rank * s
            for p in bucket.params:
                if id(p) in cut:
                    a, b = max(p.start - bucket.start, lo) - lo, min(p.end - bucket.start, lo + s) - lo
                    for t in by_prefix.get(self.layout.bucket_prefix(buf, bucket), []) if a < b else []:
                        t[a:b].zero_()


    def _tell(self) -> None:
        if self._told or not self.shapes:
            return
        self._told = True
        grown = sorted(k for k in self.shapes if self.live[k][0] > self.shapes[k][0])
        shrunk = sorted(k for k in self.shapes if self.live[k][0] < self.shapes[k][0])
        what = " and their optimizer state" if self.with_optimizer else ""
        said = [f"{k} {self.shapes[k]} -> {self.live[k]}" for k in sorted(self.shapes)]
        done = ["the rows both hold are loaded"]
        if grown:
            done.append(f"the live rows beyond the checkpoint's are zeroed{what} ({', '.join(grown)})")
        if shrunk:
            done.append(f"the checkpoint's rows beyond the live vocabulary are left out ({', '.join(shrunk)})")
        logger.info("step %d: another padded vocabulary than the checkpoint's (checkpoint -> live shape: %s): %s",
                    self.step, ", ".join(said), "; ".join(done))


def fit_vocab(
    commit: CommitManifest, template: Mapping[str, Shard], model_chunks: Sequence[torch.nn.Module], *,
    with_optimizer: bool = True,
) -> tuple[dict[str, Shard], VocabFit]:
    """``template`` fitted to ``commit``'s vocabulary rows (see the module's docstring), and the fit; the
    template as it is when every shape matches. Pure: nothing is written (nor logged: :meth:`VocabFit.zero`
    says what the load did, once every check passed)."""
    arrays = {rec.name: tuple(rec.shape) for rec in commit.arrays}
    differ = {sh.key: arrays[sh.key] for sh in template.values()
              if sh.key in arrays and arrays[sh.key] != tuple(sh.global_shape)}
    if not differ:
        return dict(template), VocabFit()
    flexible = _flexible(model_chunks)
    fit = VocabFit(step=commit.step, with_optimizer=with_optimizer)
    out: dict[str, Shard] = {}
    for path, sh in template.items():
        shape = differ.get(sh.key)
        live = tuple(sh.global_shape)
        if shape is None or sh.key not in flexible or len(shape) != len(live) or shape[1:] != live[1:]:
            out[path] = sh  # plan_reads refuses a difference not of the vocab rows, naming the key
            continue
        fit.shapes[sh.key], fit.live[sh.key] = shape, live
        n, at = sh.data.shape[0], min(sh.global_offset[0], shape[0])
        rows = min(shape[0] - at, n)
        if rows < n:
            fit.fresh.append(sh.data.narrow(0, rows, n - rows))
        # (a shard of no stored row is kept, empty: the key is still the model's, read or not)
        out[path] = replace(sh, data=sh.data.narrow(0, 0, rows), global_shape=shape,
                            global_offset=(at, *sh.global_offset[1:]), chunk_shape=None)
    return out, fit


def _flexible(model_chunks: Sequence[torch.nn.Module]) -> set[str]:
    """The model arrays of which every live ``ShardedTensor`` says ``allow_shape_mismatch``."""
    flexible: set[str] = set()
    rigid: set[str] = set()
    for chunk in model_chunks:
        for leaf in introspect.sharded_leaves(chunk):
            if introspect.is_sharded_tensor(leaf):
                (flexible if getattr(leaf, "allow_shape_mismatch", False) else rigid).add(model_key(leaf.key))
    return flexible - rigid
