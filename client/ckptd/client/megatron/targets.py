"""Where a load's bucket slices land: straight in the optimizer's own memory, so each byte is copied once.

A stored bucket slice ``optim/<mp>/buf<g>/bucket<b>/<state>`` holds this rank's owned params back to back at
their slice offsets (padding between). The loader reads it into one 1-D destination of ``S`` elements:

- **in place** when the live tensors already sit that way in one storage: the fp32 main params of an fp32
  model are views of the grad buffer's ``param_data``, and the states this module installed on an earlier
  load are views of one tensor. Checked by address (same storage, each tensor exactly at its offset,
  contiguous, the stored dtype), never assumed;
- **into a new flat tensor** whose views then *become* the per-param state (:meth:`SliceTargets.install`,
  after the read): a state the optimizer does not have yet (a fresh job loads before its first step) or
  keeps as separate per-param tensors (torch Adam's ``zeros_like``). The old tensors are dropped; the
  optimizer steps views just as well (Adam's foreach/fused kernels take lists of tensors);
- **into the live tensors one by one** (``parts``; same-layout loads that opt in): the fp32 main params of a
  bf16 model are one separate tensor per param, each read as its own run of the slice (runs that share a
  stored chunk: that chunk is read once, :meth:`~ckptd.client.fastread.ChunkReader.add_gather`);
- otherwise (a state kept in another dtype, a load from the daemon's memory) into a fresh tensor that
  :func:`~ckptd.client.megatron.optimizer.apply_optimizer_state` copies from, as before.

Only the last takes a second copy; the choice is per (bucket, state). A load at another layout
(:func:`~ckptd.client.megatron.reshard.plan_dp_slices`) writes into the same destinations.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ckptd.client.gather import Strided, boxes, monotone
from ckptd.client.megatron.introspect import Owned
from ckptd.client.megatron.layout import bind
from ckptd.client.megatron.optimizer import padding_gaps
from ckptd.client.state import dtype_name, torch_dtype
from ckptd.writer.errors import ShardLayoutError, StateMismatchError
from ckptd.writer.format import MAIN_PARAM, CommitManifest, bucket_states, split_bucket_key
from ckptd.writer.layout import MegatronLayout

if TYPE_CHECKING:
    from ckptd.client.fastread import ChunkReader


@dataclass
class SliceTargets:
    """One destination per optimizer key, and which of them are the optimizer's memory already."""

    slices: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> 1-D destination (the region's length)
    in_place: set[str] = field(default_factory=set)  # written straight into the optimizer's tensors
    # fresh flat tensors whose views become the per-param state once the read succeeded: (key, flat, owners, state)
    pending: list[tuple[str, torch.Tensor, Sequence[Owned], str]] = field(default_factory=list)
    # (device, first byte, end) of every main param written in place: a model param there needs no read
    main_memory: list[tuple[torch.device, int, int]] = field(default_factory=list)
    # key -> (offset in the slice, the live 1-D tensor there), for keys read into separate live tensors; their
    # ``slices`` entry is a zero-stride stand-in of the slice's length (nothing to copy from it)
    parts: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    _starts: list[int] = field(default_factory=list)

    def add_reads(self, reader: ChunkReader, key: str, start: int) -> None:
        """Have ``reader`` fill ``key``'s destination from the stored array's element ``start`` on."""
        parts = self.parts.get(key)
        if parts is None:
            reader.add(key, self.slices[key], (start,))
            return
        for lo, t in parts:
            reader.add_gather(key, t, Strided(start + lo, (t.numel(),), (1,)))

    def covers(self, t: torch.Tensor) -> bool:
        """Whether the in-place main params span all of ``t``'s memory (an fp32 model's params are views of
        the same grad buffer as its main params): then the optimizer's read fills ``t`` as well."""
        if not t.is_contiguous() or t.numel() == 0 or not self.main_memory:
            return False
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        i = bisect.bisect_right(self._sorted(), lo)  # the ranges of one device are disjoint: the one that
        # starts last at or before ``lo`` is the candidate; ranges of other devices may sit between
        while i > 0:
            d, a, b = self.main_memory[i - 1]
            if d == t.device:
                return a <= lo and hi <= b
            i -= 1
        return False

    def touches(self, t: torch.Tensor) -> bool:
        """Whether any byte of ``t``'s span (first to last element, strides included) lies in the in-place
        main params: then ``t``'s read and the optimizer's must not run at once (the main params win)."""
        if t.numel() == 0 or not self.main_memory:
            return False
        span = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
        lo = t.data_ptr()
        hi = lo + span * t.element_size()
        i = bisect.bisect_left(self._sorted(), hi)  # the ranges that start before ``hi``; of one device's
        # (disjoint, sorted) the last one is the only candidate
        while i > 0:
            d, _a, b = self.main_memory[i - 1]
            if d == t.device:
                return b > lo
            i -= 1
        return False

    def outside(self, t: torch.Tensor) -> list[tuple[tuple[slice, ...], torch.Tensor]] | None:
        """The parts of ``t`` that no in-place main param holds: ``(selection, view)`` boxes of ``t``
        (:func:`~ckptd.client.gather.boxes`). A model param that this rank's slice edge cuts is read there
        only; the main params' read fills the rest, so the two reads need no order. None where ``t``'s
        strides do not keep its elements in memory order, or a main param's edge falls inside an element
        (the caller reads ``t`` whole, before the main params)."""
        if t.numel() == 0 or not monotone(tuple(t.shape), tuple(t.stride())):
            return None
        item, base = t.element_size(), t.data_ptr()
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        covered: list[tuple[int, int]] = []  # element positions from t's first, ascending, merged
        i = bisect.bisect_left(self._sorted(), base + span * item)
        while i > 0:
            d, a, b = self.main_memory[i - 1]
            i -= 1
            if d != t.device:
                continue
            if b <= base:
                break
            if (a - base) % item or (b - base) % item:
                return None
            lo, hi = max(0, (a - base) // item), min(span, (b - base) // item)
            if covered and covered[0][0] == hi:
                covered[0] = (lo, covered[0][1])
            else:
                covered.insert(0, (lo, hi))
        region = Strided(0, tuple(t.shape), tuple(t.stride()))
        gaps = zip([0] + [hi for _lo, hi in covered], [lo for lo, _hi in covered] + [span], strict=True)
        return [(sel, t[sel]) for a, b in gaps if a < b for sel, _block in boxes(region, a, b)]

    def _sorted(self) -> list[int]:
        """The main-param ranges' first bytes, ascending (the ranges sorted once, then bisected)."""
        if len(self._starts) != len(self.main_memory):
            self.main_memory.sort(key=lambda r: r[1])
            self._starts = [a for _d, a, _b in self.main_memory]
        return self._starts

    def install(self) -> None:
        """Make each filled flat tensor's views the owned params' state (call after the read succeeded)."""
        for key, flat, entries, state in self.pending:
            install_views(flat, entries, state)
            self.in_place.add(key)
        self.pending = []


def install_views(flat: torch.Tensor, entries: Sequence[Owned], state: str) -> None:
    """Make ``flat``'s views (each owner's ``[lo, hi)``, in its param's shape) the owners' ``state``."""
    for o in entries:
        o.inner.state[o.main][state] = flat[o.lo : o.hi].view(o.main.shape)


def fresh_flat(entries: Sequence[Owned], s: int, dtype: torch.dtype) -> torch.Tensor:
    """A new 1-D tensor of ``s`` elements on the owners' device, laid out like the stored bucket slice:
    the padding between (and after) the owners' ranges zeroed, their ranges left for the caller to fill."""
    flat = torch.empty(s, dtype=dtype, device=entries[0].main.device)
    for lo, hi in padding_gaps(entries, s):  # padding: zero, whatever the read writes (or not) there
        flat[lo:hi].zero_()
    return flat


def slice_targets(
    optimizer: object, layout: MegatronLayout, regions: Mapping[str, tuple[int, int]], dtypes: Mapping[str, str],
    *, parts: bool = False,
) -> SliceTargets:
    """Destinations for ``regions`` (``{optimizer key: (start, stop)}``, already clipped to the stored arrays)
    of stored torch dtype ``dtypes[key]``; with ``parts``, main params that are separate tensors are read
    into one by one (:meth:`SliceTargets.add_reads` plans the reads). Raises :class:`ShardLayoutError` when a
    region is shorter than an owned param needs (nothing is written yet)."""
    binding = bind(optimizer, layout)
    buckets = {layout.bucket_prefix(buf, bucket): (buf, bucket) for buf, bucket in layout.buckets()}
    out = SliceTargets()
    for key, (start, stop) in regions.items():
        prefix, state = split_bucket_key(key)
        if prefix not in buckets:
            raise StateMismatchError(f"{key}: no such optimizer bucket in this rank's layout")
        buf, bucket = buckets[prefix]
        entries = binding.owned[(buf.index, bucket.index)]
        n = stop - start
        short = next((o for o in entries if o.hi > n), None)
        if short is not None:
            raise ShardLayoutError(
                f"{key}: {short.param.name} needs elements [{short.lo}, {short.hi}) of this rank's slice, but "
                f"the checkpoint holds only {n}"
            )
        dtype = torch_dtype(dtypes[key])
        if parts and state == MAIN_PARAM and entries and all(
            o.main.dtype == dtype and o.main.device.type == "cpu" and o.main.is_contiguous()
            and o.main.numel() == o.hi - o.lo for o in entries
        ) and flat_alias([o.main for o in entries], entries, buf.slice_numel(bucket), dtype) is None:
            out.parts[key] = [(o.lo, o.main.view(-1)) for o in entries]
            out.in_place.add(key)
            out.slices[key] = torch.zeros((), dtype=dtype).expand(n)
            continue
        out.slices[key] = _target(out, key, entries, state, buf.slice_numel(bucket), n, dtype)
    return out


def _target(
    out: SliceTargets, key: str, entries: Sequence[Owned], state: str, s: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    if not entries:
        return torch.empty(n, dtype=dtype)
    live = [o.main if state == MAIN_PARAM else o.get(state) for o in entries]
    alias = flat_alias(live, entries, s, dtype)
    if alias is not None:
        out.in_place.add(key)
        if state == MAIN_PARAM:
            isz = alias.element_size()
            out.main_memory += [(o.main.device, o.main.data_ptr(), o.main.data_ptr() + (o.hi - o.lo) * isz)
                                for o in entries]
        return alias[:n]
    if state != MAIN_PARAM and all(
        t is None or (isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == o.main.shape)
        for t, o in zip(live, entries, strict=True)
    ):
        flat = fresh_flat(entries, s, dtype)
        out.pending.append((key, flat, entries, state))
        return flat[:n]
    return torch.empty(n, dtype=dtype)


def flat_alias(
    tensors: Sequence[object], entries: Sequence[Owned], numel: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """A 1-D tensor of ``numel`` elements over the memory ``tensors`` occupy, when they lie in one storage
    each exactly at its owner's slice offset (contiguous, ``dtype``); None otherwise."""
    if not tensors or not isinstance(tensors[0], torch.Tensor):
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    base, isz = storage.data_ptr(), first.element_size()
    rel = first.data_ptr() - base - entries[0].lo * isz
    if rel < 0 or rel % isz or rel + numel * isz > storage.nbytes():
        return None
    for t, o in zip(tensors, entries, strict=True):
        if not (
            isinstance(t, torch.Tensor) and t.dtype == dtype and t.device == first.device and t.is_contiguous()
            and t.numel() == o.hi - o.lo and t.untyped_storage().data_ptr() == base
            and t.data_ptr() == base + rel + o.lo * isz
        ):
            return None
    return torch.empty(0, dtype=dtype, device=first.device).set_(storage, rel // isz, (numel,), (1,))


def main_dtype(step: int, states: dict[str, str], optimizer: object, layout: MegatronLayout) -> dict[str, str]:
    """``states`` (state -> stored dtype) once the stored main params are of the live ones' dtype: a load
    that cast them would hold other values than were saved (the same-layout path refuses it too)."""
    live = next((e.main.dtype for entries in bind(optimizer, layout).owned.values() for e in entries), None)
    stored = states.get(MAIN_PARAM)
    if live is not None and stored is not None and stored != dtype_name(live):
        raise StateMismatchError(f"step {step}: the checkpoint's main params are {stored}, the optimizer's {live}")
    return states


def slice_regions(
    layout: MegatronLayout, states: Mapping[str, str]
) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """This rank's whole slice of every bucket for each state, and the state's dtype (``{key: ...}`` twice)."""
    regions: dict[str, tuple[int, int]] = {}
    dtypes: dict[str, str] = {}
    for buf, bucket in layout.buckets():
        s = buf.slice_numel(bucket)
        for state, dtype in states.items():
            key = layout.bucket_key(buf, bucket, state)
            regions[key], dtypes[key] = (buf.dp_rank * s, (buf.dp_rank + 1) * s), dtype
    return regions, dtypes


def optimizer_regions(
    commit: CommitManifest, layout: MegatronLayout, optimizer: object
) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """Every stored state of every bucket of this rank, with the region this rank reads (clipped to the
    stored array: a checkpoint saved at another DP size is padded differently), and its stored dtype."""
    arrays = {rec.name: rec for rec in commit.arrays}
    binding = bind(optimizer, layout)
    regions: dict[str, tuple[int, int]] = {}
    dtypes: dict[str, str] = {}
    for buf, bucket in layout.buckets():
        prefix = layout.bucket_prefix(buf, bucket)
        start, stop = buf.dp_rank * buf.slice_numel(bucket), (buf.dp_rank + 1) * buf.slice_numel(bucket)
        main_key = prefix + MAIN_PARAM
        if main_key not in arrays:
            raise StateMismatchError(f"{main_key}: not in checkpoint step {commit.step}")
        for state in bucket_states(list(arrays), prefix):
            name = prefix + state
            rec = arrays[name]
            if len(rec.shape) != 1 or rec.shape[0] < bucket.numel_unpadded:
                raise StateMismatchError(
                    f"{name}: the checkpoint holds shape {tuple(rec.shape)}, the model's bucket has "
                    f"{bucket.numel_unpadded} elements"
                )
            entries = binding.owned[(buf.index, bucket.index)]
            if name == main_key and entries and rec.torch_dtype != dtype_name(entries[0].main.dtype):
                raise StateMismatchError(
                    f"{name}: the checkpoint has dtype {rec.torch_dtype}, the main params {entries[0].main.dtype}"
                )
            end = min(stop, rec.shape[0])
            regions[name] = (min(start, end), end)
            dtypes[name] = rec.torch_dtype
    return regions, dtypes
