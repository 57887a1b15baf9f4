"""Which param holds a storage range (placing a model's ShardedTensors on its params), found by bisection where
the params' spans do not overlap, and with the same answer as a walk over every param where they do."""

from __future__ import annotations

import random

import torch

from ckptd.client.megatron.introspect import ParamSpans, leaves_reused, sharded_leaves, storage_span


def _walk(params, ptr, lo, hi):
    """The reference: the first param, in order, whose span holds [lo, hi)."""
    for p in params:
        p_ptr, p_lo, p_hi = storage_span(p)
        if p_ptr == ptr and p_lo <= lo and hi <= p_hi and p_hi > p_lo:
            return p, p_lo
    return None


def _buffer_params(sizes, gap=0):
    """Params viewing one flat buffer back to back (with ``gap`` padding elements after each), like
    Megatron's grad buffers, in a shuffled order."""
    buf = torch.zeros(sum(sizes) + gap * len(sizes))
    params, at = [], 0
    for n in sizes:
        params.append(torch.nn.Parameter(buf[at : at + n]))
        at += n + gap
    random.Random(0).shuffle(params)
    return buf, params


def _check_random_queries(params, ptr, total, rng):
    spans = ParamSpans(params)
    for _ in range(2000):
        lo = rng.randrange(total)
        hi = lo + rng.randrange(1, 40)
        got = spans.owner(ptr, lo, hi)
        want = _walk(params, ptr, lo, hi)
        assert (got is None) == (want is None), (lo, hi)
        if want is not None:
            assert got[0] is want[0] and got[1] == want[1]


def test_disjoint_params_of_one_buffer_match_the_walk():
    rng = random.Random(1)
    sizes = [rng.randrange(0, 50) for _ in range(300)]  # empty params included
    buf, params = _buffer_params(sizes, gap=3)
    _check_random_queries(params, buf.untyped_storage().data_ptr(), buf.numel() + 10, rng)


def test_overlapping_views_give_the_first_param_in_order():
    buf = torch.zeros(100)
    whole = torch.nn.Parameter(buf[0:100])
    half = torch.nn.Parameter(buf[40:60])
    ptr = buf.untyped_storage().data_ptr()
    assert ParamSpans([half, whole]).owner(ptr, 45, 50) == (half, 40)
    assert ParamSpans([whole, half]).owner(ptr, 45, 50) == (whole, 0)
    _check_random_queries([half, whole], ptr, 110, random.Random(2))


def test_ranges_no_param_holds_whole_are_none():
    buf, params = _buffer_params([10, 10])
    ptr = buf.untyped_storage().data_ptr()
    spans = ParamSpans(params)
    assert spans.owner(ptr, 5, 15) is None  # across two params
    assert spans.owner(ptr, 20, 21) is None  # past the last one
    assert spans.owner(torch.zeros(4).untyped_storage().data_ptr(), 0, 1) is None  # another storage


class _Chunk(torch.nn.Module):
    """A module with a ``sharded_state_dict()`` that counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def sharded_state_dict(self) -> dict[str, object]:
        self.calls += 1
        return {}


def test_sharded_state_dict_is_built_once_per_chunk_inside_leaves_reused():
    a, b = _Chunk(), _Chunk()
    with leaves_reused():
        first = sharded_leaves(a)
        assert sharded_leaves(a) is first
        sharded_leaves(b)
    assert (a.calls, b.calls) == (1, 1)
    sharded_leaves(a)  # outside: built anew each time
    sharded_leaves(a)
    assert a.calls == 3
