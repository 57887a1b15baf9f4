"""RNG state of a rank: torch (and CUDA, and Megatron's CUDA RNG tracker) as per-rank arrays, Python's and
NumPy's as plain data; and the way back."""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch

from ckptd.client.megatron import introspect
from ckptd.client.state import Shard, torch_dtype
from ckptd.writer.format import RNG_PREFIX, ArrayRecord, CommitManifest, validate_key

RngPlain = dict[str, list[object]]  # {"python": [...], "numpy": [...]}


def rng_state(rank: int, world: int) -> tuple[list[Shard], RngPlain]:
    """This rank's RNG state: shards ``rng/torch``, ``rng/cuda``, ``rng/cuda_tracker/<name>`` and plain data."""
    shards = [Shard.per_rank(f"{RNG_PREFIX}torch", torch.get_rng_state(), rank, world)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        shards.append(Shard.per_rank(f"{RNG_PREFIX}cuda", torch.cuda.get_rng_state(), rank, world))
        for name, st in sorted(introspect.cuda_rng_tracker_states().items()):
            if isinstance(st, torch.Generator):  # a graph-safe tracker's (use_cudagraphable_rng): its state
                st = st.get_state()
            if isinstance(st, torch.Tensor):
                key = validate_key(f"{RNG_PREFIX}cuda_tracker/{name}")
                shards.append(Shard.per_rank(key, st.cpu(), rank, world))
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    plain: RngPlain = {
        "python": [version, _plain_words("python", internal), gauss],
        "numpy": [str(name), _plain_words("numpy", np.asarray(keys)), int(pos), int(has_gauss), float(cached)],
    }
    return shards, plain


_words: dict[str, tuple[tuple[int, ...] | np.ndarray, list[int]]] = {}  # generator -> last state words, as saved


def _plain_words(generator: str, words: tuple[int, ...] | np.ndarray) -> list[int]:
    """The 624-word state as a list of ints: the list of the last save when the words are unchanged (a
    generator the training loop does not draw from), else a new one. Comparing is one C loop; building the
    list allocates 624 ints, a cost on every save's critical path. (``get_state`` hands out a copy: it can
    be held.)"""
    held = _words.get(generator)
    if held is not None:
        before = held[0]
        if np.array_equal(before, words) if isinstance(words, np.ndarray) else before == words:
            return held[1]
    out = words.tolist() if isinstance(words, np.ndarray) else list(words)
    _words[generator] = (words, out)
    return out


def rng_template(commit: CommitManifest, source: int) -> dict[str, Shard]:
    """Buffers for the stored RNG arrays of saved rank ``source``."""
    out = {}
    for rec in commit.arrays:
        if _is_rng(rec) and source < rec.shape[0]:
            data = torch.empty((1, rec.shape[1]), dtype=torch_dtype(rec.torch_dtype))
            out[rec.name] = Shard(rec.name, data, (rec.shape[0], rec.shape[1]), (source, 0))
    return out


def _is_rng(rec: ArrayRecord) -> bool:
    return rec.name.startswith(RNG_PREFIX) and len(rec.shape) == 2


def restore_rng(tensors: Mapping[str, Shard], plain: object) -> None:
    """Set the generators from :func:`rng_template`'s filled buffers and the saved plain data."""
    if f"{RNG_PREFIX}torch" in tensors:
        torch.set_rng_state(tensors[f"{RNG_PREFIX}torch"].data[0].clone())
    if torch.cuda.is_available() and f"{RNG_PREFIX}cuda" in tensors:
        torch.cuda.set_rng_state(tensors[f"{RNG_PREFIX}cuda"].data[0].clone())
        prefix = f"{RNG_PREFIX}cuda_tracker/"
        states = {k[len(prefix) :]: s.data[0].clone() for k, s in tensors.items() if k.startswith(prefix)}
        if states:
            introspect.update_cuda_rng_tracker_states(states)
    if isinstance(plain, Mapping):
        if "python" in plain:
            version, internal, gauss = plain["python"]
            random.setstate((version, tuple(internal), gauss))
        if "numpy" in plain:
            name, keys, pos, has_gauss, cached = plain["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
