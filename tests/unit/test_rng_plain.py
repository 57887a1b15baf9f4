"""The RNG state a save stores: Python's and NumPy's words are reused from the last save only while the
generator has not drawn, and always equal the live state; a restore into Megatron's CUDA RNG tracker keeps
a graph-safe tracker's generators."""

from __future__ import annotations

import random

import numpy as np
import torch

from ckptd.client.megatron.rng import rng_state


def _words(plain: dict[str, list[object]]) -> tuple[object, object]:
    return plain["python"][1], plain["numpy"][1]


def test_words_follow_every_draw_and_are_reused_when_unchanged() -> None:
    random.seed(11)
    np.random.seed(11)
    first = _words(rng_state(0, 2)[1])
    again = _words(rng_state(0, 2)[1])
    assert again[0] is first[0] and again[1] is first[1]  # nothing drew: the same lists
    random.random()
    moved = _words(rng_state(0, 2)[1])
    assert moved[0] is not first[0] and moved[0] == list(random.getstate()[1]) != first[0]
    assert moved[1] is first[1]
    np.random.rand()
    drawn = _words(rng_state(0, 2)[1])
    assert drawn[1] == np.random.get_state(legacy=True)[1].tolist() != first[1]  # type: ignore[index,union-attr]


def test_saved_words_restore_the_generators() -> None:
    random.seed(5)
    np.random.seed(5)
    plain = rng_state(0, 1)[1]
    want = (random.random(), float(np.random.rand()))
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))  # type: ignore[arg-type]
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))  # type: ignore[arg-type]
    assert (random.random(), float(np.random.rand())) == want


def test_a_graph_safe_trackers_generators_are_set_in_place() -> None:
    """With ``use_cudagraphable_rng`` Megatron's tracker holds ``torch.Generator``s, which captured CUDA graphs
    keep: a restore sets their state in place (replacing them with tensors broke the tracker), while a plain
    tracker's tensor states are replaced. (CPU generators stand in for CUDA ones.)"""
    from ckptd.client.megatron.introspect import update_cuda_rng_tracker_states

    class Tracker:
        def __init__(self, states: dict[str, object]) -> None:
            self.states = states

        def get_states(self) -> dict[str, object]:
            return dict(self.states)

        def set_states(self, states: dict[str, object]) -> None:
            self.states = states

    gen = torch.Generator().manual_seed(1)
    saved = torch.Generator().manual_seed(7).get_state()
    tracker = Tracker({"model-parallel-rng": gen, "data-parallel-rng": torch.zeros(3), "expert": torch.ones(2)})
    update_cuda_rng_tracker_states({"model-parallel-rng": saved, "data-parallel-rng": torch.ones(3)}, tracker)
    assert tracker.states["model-parallel-rng"] is gen and torch.equal(gen.get_state(), saved)
    assert torch.equal(tracker.states["data-parallel-rng"], torch.ones(3))  # type: ignore[arg-type]
    assert torch.equal(tracker.states["expert"], torch.ones(2))  # type: ignore[arg-type]
