"""The RNG state a save stores: Python's and NumPy's words are reused from the last save only while the
generator has not drawn, and always equal the live state."""

from __future__ import annotations

import random

import numpy as np

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
