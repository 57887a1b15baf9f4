"""Building a :class:`~ckptd.client.plan.StagePlan` from a rank's shards: the slot layout in one span and the
copy program (static sources merged into byte runs, sources looked up per save, gaps to zero). Pure: no I/O,
nothing copied; the plan's per-save side is :mod:`ckptd.client.plan`.

Memory an optimizer owns and may let go of between saves (a trainer that moves its optimizer to the host
and back replaces its state tensors, and the ``.data`` of its main params) is never held through a view:
a re-homed state's flat tensor is held weakly (its views in the optimizer keep it), a main param with
memory of its own is copied from as the param object (:attr:`~ckptd.client.plan.Piece.live`). Otherwise
a cached plan would keep the old copies alive until the next save planned again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ckptd.client.copyruns import MAX_GAP
from ckptd.client.copyruns import Dst as _Dst
from ckptd.client.plan import (
    ALIGN,
    Piece,
    StagePlan,
    StalePlanError,
    WeakBytes,
    aligned,
    byte_span,
    bytes_of,
    nbytes_of,
    shard_meta,
)
from ckptd.client.state import Shard, replica_metas


def pieces_of(shard: Shard) -> list[Piece]:
    """What staging ``shard`` copies: its own pieces if it describes them, else its data whole."""
    describe: Callable[[], list[Piece]] | None = getattr(shard, "stage_pieces", None)
    return describe() if describe is not None else [Piece(0, src=shard.data.detach())]


def build_stage_plan(
    shards: Sequence[Shard], dynamic: Sequence[Shard] = (), fingerprint: object = None,
    replicas: Sequence[Shard] = (),
) -> StagePlan:
    """Lay out ``shards`` (static or described by pieces) and ``dynamic`` (tensor given per save) in one
    span, and compile the copy program. Pure: no I/O, nothing copied. ``shards`` are validated already;
    ``replicas`` (the rank's non-main replicas, staged by nobody) go with the plan's registration."""
    everything = list(shards) + list(dynamic)
    offsets = [0] * len(everything)
    sizes = [s.nbytes for s in everything]
    pieces = [pieces_of(s) for s in shards]
    # whole-shard contiguous sources, ordered by where they live, so neighbours in memory are neighbours
    # in the span (the gap mirrored) and one copy moves the run
    spans: dict[int, tuple[int, int]] = {}
    for i, ps in enumerate(pieces):
        src = ps[0].src if len(ps) == 1 and ps[0].lo == 0 and not (ps[0].held or ps[0].live) else None
        where = byte_span(src) if src is not None and src.dtype == shards[i].data.dtype else None
        if where is not None:
            spans[i] = where
    plain = sorted(spans, key=spans.__getitem__)
    end = 0
    prev: tuple[int, int] | None = None  # (storage, byte end) of the last placed plain source
    for i in plain:
        ptr, off = spans[i]
        gap = off - prev[1] if prev is not None and prev[0] == ptr else -1
        # mirror the source's spacing (one copy for the run), else keep the source's alignment mod ALIGN
        offsets[i] = end + gap if 0 <= gap <= MAX_GAP else aligned(end) + off % ALIGN
        end = offsets[i] + sizes[i]
        prev = (ptr, off + sizes[i])
    for i in range(len(everything)):
        if i not in spans:
            offsets[i] = aligned(end)
            end = offsets[i] + sizes[i]
    plan = StagePlan([shard_meta(s, i) for i, s in enumerate(everything)], offsets, sizes, aligned(end), fingerprint)
    plan.replicas = replica_metas(replicas)
    runs = _Runs(plan)
    for i in plain:  # (a piece that holds lookups or is live is never plain)
        runs.add(pieces[i][0].src, offsets[i])  # type: ignore[arg-type]
    runs.flush()
    for i, ps in enumerate(pieces):
        if i not in spans:
            _compile_pieces(plan, runs, sorted(ps, key=lambda p: p.lo), offsets[i], shards[i].data.dtype)
    plan._group_fetches()
    for s, i in zip(dynamic, range(len(shards), len(everything)), strict=True):
        d = _Dst(offsets[i], s.data.dtype, tuple(s.data.shape))
        plan._dynamic.append((d, d))
        plan.cuda |= s.data.is_cuda
    plan.compile_copies()
    return plan


class _Runs:
    """Merges static sources whose bytes are contiguous in one storage, with the span's spacing equal to
    the source's, into one byte copy."""

    def __init__(self, plan: StagePlan) -> None:
        self.plan = plan
        self.run: list[Any] = []  # [tensor, storage byte start, span start, bytes]

    def add(self, src: torch.Tensor, rel: int) -> None:
        ptr, off = byte_span(src)  # type: ignore[misc]
        n = nbytes_of(src)
        self.plan.cuda |= src.is_cuda
        r = self.run
        if r and r[0].untyped_storage().data_ptr() == ptr and off - r[1] == rel - r[2] and off >= r[1] + r[3]:
            r[3] = off + n - r[1]
            return
        self.flush()
        r.extend([src, off, rel, n])

    def flush(self) -> None:
        if self.run:
            t, start, rel, n = self.run
            self.plan._static.append((bytes_of(t, start, n), _Dst(rel, torch.uint8, (n,))))
            self.run.clear()


def _compile_pieces(plan: StagePlan, runs: _Runs, pieces: list[Piece], base: int, dtype: torch.dtype) -> None:
    """A described shard's pieces: static ones of the slot's dtype join runs (zeros are filled after every
    copy, so a run may cross a gap), others copy converting into the slot's dtype. A piece that does not
    join the run ends it: a run merged across that piece's slot would copy the source's bytes over it."""
    for p in pieces:
        rel = base + p.lo
        if p.src is not None:
            held = _hold(plan, p)
            span = byte_span(p.src) if p.src.dtype == dtype else None
            if span is not None and not (held or p.live):
                runs.add(p.src, rel)
                continue
            runs.flush()
            if held and span is not None:  # a re-homed state's flat tensor: held weakly, a copy of its own,
                # through the tensor the states are views of (what keeps the memory while they are the states)
                anchor, n = held[0]._base if held[0]._base is not None else held[0], nbytes_of(p.src)
                plan._static.append((WeakBytes(anchor, span[1], n), _Dst(rel, torch.uint8, (n,))))
            else:
                plan._static.append((p.src, _Dst(rel, dtype, tuple(p.src.shape))))
            plan.cuda |= p.src.is_cuda
        elif p.fetch is not None:
            runs.flush()  # copied after the static ones, so it would win; still, no run spans its slot
            t = p.fetch.owner.state.get(p.fetch.key, {}).get(p.fetch.name)
            if not isinstance(t, torch.Tensor):
                raise StalePlanError(f"no optimizer state {p.fetch.name!r} to plan a save of")
            shape = tuple(t.shape)
            plan.cuda |= t.is_cuda
            plan._fetched.append((p.fetch, _Dst(rel, t.dtype, shape), _Dst(rel, dtype, shape)))
        elif p.nbytes:
            plan._zeros.append(_Dst(rel, torch.uint8, (p.nbytes,)))
    runs.flush()


def _hold(plan: StagePlan, piece: Piece) -> list[torch.Tensor]:
    """Record the tensors a static piece holds (their lookups, checked at each save); returns them."""
    found = []
    for f in piece.held:
        t = f.owner.state.get(f.key, {}).get(f.name)
        if not isinstance(t, torch.Tensor):
            raise StalePlanError(f"no optimizer state {f.name!r} to plan a save of")
        plan._held.append((f, weakref.ref(t)))
        found.append(t)
    return found
