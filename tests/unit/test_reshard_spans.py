"""The merge-free reshard reads each saved bucket's wanted param ranges as merged spans (pure planning)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from ckptd.client.megatron.reshard import SPAN_GAP, _spans

ranges = st.lists(st.tuples(st.sampled_from(["a/", "b/"]), st.integers(0, 4 * SPAN_GAP), st.integers(1, 5000))
                  .map(lambda t: (t[0], t[1], t[1] + t[2])), max_size=30)


@given(ranges)
def test_every_range_lies_in_one_span_and_spans_are_apart(wanted: list[tuple[str, int, int]]) -> None:
    wanted = list(dict.fromkeys(wanted))  # the loader's wanted ranges are unique
    spans = _spans(wanted)
    placed = [(p, a, b) for (p, lo, hi), members in spans.items() for a, b in members if lo <= a < b <= hi]
    assert sorted(placed) == sorted(wanted)  # every range exactly once, inside its span
    for prefix in {p for p, _lo, _hi in spans}:
        mine = sorted((lo, hi) for p, lo, hi in spans if p == prefix)
        assert all(b[0] > a[1] + SPAN_GAP for a, b in itertools.pairwise(mine))  # else they would merge


def test_near_ranges_merge_far_ones_do_not() -> None:
    assert _spans([("a/", 0, 10), ("a/", 74, 100), ("a/", 100 + 2 * SPAN_GAP, 100 + 2 * SPAN_GAP + 5),
                   ("b/", 0, 10)]) == {
        ("a/", 0, 100): [(0, 10), (74, 100)],
        ("a/", 100 + 2 * SPAN_GAP, 100 + 2 * SPAN_GAP + 5): [(100 + 2 * SPAN_GAP, 100 + 2 * SPAN_GAP + 5)],
        ("b/", 0, 10): [(0, 10)],
    }
