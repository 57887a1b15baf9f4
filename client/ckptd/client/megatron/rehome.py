"""Re-home the optimizer's per-param state into flat tensors laid out like the stored bucket slices.

torch's Adam allocates one ``exp_avg`` and one ``exp_avg_sq`` per param, and one 0-dim ``step`` each: a save
then gathers thousands of separate tensors (one ``torch.cat`` piece each) and reads thousands of scalars (one
``.item()`` each). At a save's planning this module moves them, once, into

- one 1-D tensor per (bucket slice, state), laid out like the stored slice (each owned param at its offset,
  the padding zeroed): the layout a load leaves (:mod:`.targets`, whose helpers this reuses). The plan then
  stages each (bucket slice, state) as one byte copy (:meth:`~.optimizer.BucketSliceShard.stage_pieces`);
- one 1-D tensor per (DistributedOptimizer, scalar state name) over the owned params that keep it, read with
  one ``.tolist()`` (:mod:`.constant`).

The params' states become views of them (``state[p][name] = flat[lo:hi].view(p.shape)``). torch's Adam(W)
updates every state in place (``exp_avg.lerp_``, ``mul_``/``addcmul_``, ``step_t += 1`` on the single-tensor
path, ``torch._foreach_add_`` on the foreach and fused paths), so training writes into the flat tensors and
its numerics do not change (elementwise kernels over tensors of the same lengths: the tests compare bit for
bit). Re-homing copies one (bucket slice, state) at a time and installs its views before the next: the old
per-param tensors of that pair are freed as their last reference (the state dict) goes, so the peak is the
optimizer's states plus one (bucket slice, state) tensor. Nothing is re-homed when the tensors already sit
that way (a load left them so, or an earlier save did), or when they do not fit (a missing state, another
dtype, shape or device): those are staged piece by piece, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ckptd.client.megatron.introspect import Owned
from ckptd.client.megatron.layout import Binding
from ckptd.client.megatron.targets import flat_alias, fresh_flat, install_views
from ckptd.writer.format import MAIN_PARAM
from ckptd.writer.layout import MegatronLayout


def rehome_states(binding: Binding, layout: MegatronLayout, names: Sequence[str]) -> list[str]:
    """Move every owned (bucket slice, state) of ``names`` into one flat tensor each and install its views
    as the params' state; returns the keys moved (already flat or not movable ones are left as they are)."""
    moved = []
    for buf, bucket in layout.buckets():
        entries = binding.owned[(buf.index, bucket.index)]
        if not entries:
            continue
        s = buf.slice_numel(bucket)
        for name in names:
            if name == MAIN_PARAM:
                continue
            live = [o.get(name) for o in entries]
            first = live[0]
            if not isinstance(first, torch.Tensor) or not all(
                isinstance(t, torch.Tensor) and t.dtype == first.dtype and t.device == o.main.device
                and t.shape == o.main.shape for t, o in zip(live, entries, strict=True)
            ):
                continue  # a param without this state (before its first step), or another dtype: piecewise
            if len(set(map(torch.Tensor.data_ptr, live))) != len(live):  # type: ignore[arg-type]
                continue  # params sharing a tensor: splitting it would change what the optimizer computes
            if flat_alias(live, entries, s, first.dtype) is not None:
                continue  # already one flat tensor at the slice's offsets
            flat = fresh_flat(entries, s, first.dtype)
            with torch.no_grad():
                for t, o in zip(live, entries, strict=True):
                    flat[o.lo : o.hi].copy_(t.reshape(-1))  # type: ignore[attr-defined]
            del live, first, t  # the state dicts hold the old tensors' last references: installing frees them
            install_views(flat, entries, name)
            moved.append(layout.bucket_key(buf, bucket, name))
    return moved


def home_scalars(owners: Sequence[Owned], tensors: Sequence[torch.Tensor], name: str) -> torch.Tensor | None:
    """One 1-D tensor whose elements are ``tensors`` (0-dim, one dtype; ``owners[i]``'s state ``name``), in
    order: the one they are views of already, else a new one whose views become the owners' state. None when
    they are not all 0-dim tensors of one dtype and device, or some of them are one tensor shared by several
    params (left as they are)."""
    if not tensors:
        return None
    first = tensors[0]
    if not all(
        isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == first.dtype and t.device == first.device
        for t in tensors
    ):
        return None
    flat = elements_of(tensors)
    if flat is not None:
        return flat
    if len(set(map(torch.Tensor.data_ptr, tensors))) != len(tensors):
        return None  # one tensor shared by several params (incremented once by each): not split
    flat = torch.stack([t.detach() for t in tensors])
    for i, o in enumerate(owners):
        o.inner.state[o.main][name] = flat[i]
    return flat


def elements_of(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor over the memory ``tensors`` (0-dim, one dtype) occupy when they are its consecutive
    elements in one storage (each ``storage()``'s address is checked: adjacent allocations do not pass)."""
    first = tensors[0]
    storage = first.untyped_storage()
    base, isz = storage.data_ptr(), first.element_size()
    start = first.data_ptr()
    if (start - base) % isz or start + len(tensors) * isz > base + storage.nbytes():
        return None
    for i, t in enumerate(tensors):
        if t.data_ptr() != start + i * isz or t.untyped_storage().data_ptr() != base or t.dtype != first.dtype:
            return None
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        storage, (start - base) // isz, (len(tensors),), (1,)
    )
