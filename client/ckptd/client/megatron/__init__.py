"""Megatron-core integration: model and distributed-optimizer state as ckptd shards, and the way back.

Entry points: :func:`save_checkpoint` (every rank; returns the ``SaveHandle`` once the data is staged,
the static plan cached after the first call) and :func:`load_checkpoint` (every rank; same TP/PP and any
DP, or any TP/PP/DP from a merged step; everything checked before a live tensor is written). See
docs/megatron.md.

Modules:

- :mod:`.introspect` — the only module that touches megatron-core internals (grad buffers,
  ``param_index_map``, ``gbuf_ranges``, ``sharded_state_dict()``, ``parallel_state``, the RNG tracker);
- :mod:`.layout` — a rank's :class:`~ckptd.writer.layout.MegatronLayout` (the sidecar schema lives in
  :mod:`ckptd.writer.layout`) built from live objects, and the one per-optimizer plan cache;
- :mod:`.model` — :func:`model_state`: the model's sharded state dict as shards, DP replicas split;
- :mod:`.optimizer` — :func:`optimizer_shards` (this DP rank's bucket slices, staged straight from the
  optimizer) and its inverse :func:`apply_optimizer_state`;
- :mod:`.rng`, :mod:`.save`, :mod:`.load`, and :mod:`.reshard` (reading the merged layout).

Every stored name (``model/``, ``optim/<mp>/buf<g>/bucket<b>/<state>``, ``optim_meta``, ``rng/``, the
``megatron`` record, the merged arrays) is defined in :mod:`ckptd.writer.format`. Importing this package
loads no megatron, zarr or fsspec: megatron is imported where a function needs it, and the read path
(:func:`load_checkpoint`) on first use. The CPU shim (``ckptd.testing.cpu_shim``) is test-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptd.client.megatron.introspect import MegatronOptimizer
from ckptd.client.megatron.layout import build_layout, get_layout, view_of
from ckptd.client.megatron.model import DEFAULT_MIN_SPLIT_BYTES, model_state
from ckptd.client.megatron.optimizer import (
    BucketSliceShard,
    apply_optimizer_state,
    optimizer_meta,
    optimizer_read_regions,
    optimizer_shards,
)
from ckptd.client.megatron.save import save_checkpoint
from ckptd.writer.format import (
    MAIN_PARAM,
    MEGATRON_CHECKPOINT_VERSION,
    MEGATRON_LAYOUT_VERSION,
    MODEL_PREFIX,
    OPTIM_META,
    OPTIM_PREFIX,
)
from ckptd.writer.layout import BucketLayout, BufferLayout, MegatronLayout, ModelPiece, ParamLayout

if TYPE_CHECKING:
    from ckptd.client.megatron.load import LoadedCheckpoint, load_checkpoint

CHECKPOINT_VERSION = MEGATRON_CHECKPOINT_VERSION
LAYOUT_VERSION = MEGATRON_LAYOUT_VERSION

__all__ = [
    "CHECKPOINT_VERSION",
    "DEFAULT_MIN_SPLIT_BYTES",
    "LAYOUT_VERSION",
    "MAIN_PARAM",
    "MODEL_PREFIX",
    "OPTIM_META",
    "OPTIM_PREFIX",
    "BucketLayout",
    "BucketSliceShard",
    "BufferLayout",
    "LoadedCheckpoint",
    "MegatronLayout",
    "MegatronOptimizer",
    "ModelPiece",
    "ParamLayout",
    "apply_optimizer_state",
    "build_layout",
    "get_layout",
    "load_checkpoint",
    "model_state",
    "optimizer_meta",
    "optimizer_read_regions",
    "optimizer_shards",
    "save_checkpoint",
    "view_of",
]

_READ_PATH = frozenset({"LoadedCheckpoint", "load_checkpoint"})


def __getattr__(name: str) -> object:
    # The read path loads zarr and fsspec; training processes that only save never import it.
    if name in _READ_PATH:
        from ckptd.client.megatron import load

        return getattr(load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
