"""Coverage checks of a load at another layout, pure: what a plan of pieces leaves unwritten.

A live param's optimizer state is assembled from its model pieces (:mod:`~ckptd.client.megatron.reshard`):
an element that none of them views, or a piece's region that no saved piece holds, would be left as it was
(stale, or zero) without a word. Each is checked once, where the plan is built, before anything is read;
:class:`StateMismatchError` names the param or model key and the missing range.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection

import numpy as np

from ckptd.writer.errors import StateMismatchError
from ckptd.writer.layout import ParamLayout

Box = tuple[tuple[int, int], ...]  # [lo, hi) on each axis


def covered(p: ParamLayout, cut: Collection[ParamLayout] = ()) -> ParamLayout:
    """``p``, once its model pieces cover every element of it (:meth:`~ckptd.writer.layout.ParamLayout.uncovered`),
    or it is one of ``cut``: params whose pieces a load cut to a checkpoint's vocabulary rows
    (:mod:`~ckptd.client.megatron.vocab`; the rest of them is zeroed, not read)."""
    gap = p.uncovered()
    if gap is not None and not (cut and p in cut):
        raise StateMismatchError(
            f"{p.name}: its model pieces ({', '.join(dict.fromkeys(x.key for x in p.model_pieces)) or 'none'}) "
            f"leave elements [{gap[0]}, {gap[1]}) of the flattened param (shape {p.shape}) uncovered: their "
            "optimizer state cannot be placed at another layout (a module whose sharded_state_dict covers part "
            "of the param)"
        )
    return p


def missing_box(need: Box, have: Collection[Box]) -> Box | None:
    """A box of ``need`` that none of ``have`` (boxes inside ``need``) meets, or None when they cover it.

    The axes are cut where any box starts or ends, and the cells marked: exact whatever the boxes' overlaps,
    and small, as a model piece is met by a few saved pieces (one per saved TP rank, say)."""
    cuts = [sorted({lo, hi} | {x for box in have for x in box[axis] if lo < x < hi})
            for axis, (lo, hi) in enumerate(need)]
    cells = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    for box in have:
        cells[tuple(slice(bisect.bisect_left(c, x), bisect.bisect_left(c, y))
                    for c, (x, y) in zip(cuts, box, strict=True))] = True
    if cells.all():
        return None
    first = np.argwhere(~cells)[0]
    return tuple((c[i], c[i + 1]) for c, i in zip(cuts, first, strict=True))
