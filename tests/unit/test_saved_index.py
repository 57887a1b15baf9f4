"""The merge-free load's lookup of the saved pieces a needed piece meets: by the first axis, with the same
answer, in the same order, as testing every saved piece of the key."""

from __future__ import annotations

import random

from ckptd.client.megatron.reshard import _overlap, _SavedIndex, _SavedPiece
from ckptd.writer.layout import ModelPiece


def _piece(key, shape, offset, local, prepend=0, replica=(0, 0, 0)):
    view = local[prepend:]
    return ModelPiece(
        key=key, global_shape=shape, global_offset=offset, prepend_axis_num=prepend, view_offset=0,
        view_shape=view, view_stride=tuple(1 for _ in view), replica_id=replica,
    )


def _saved(pieces):
    return [_SavedPiece(p, None, f"optim/x/bucket{i}/", 0, 1) for i, p in enumerate(pieces)]  # type: ignore[arg-type]


def _walk(saved, piece):
    """Every saved piece tested, in the index's order, each with where it meets ``piece``."""
    ordered = sorted(saved, key=lambda s: any(s.piece.replica_id))
    met = [(sp, _overlap(piece, sp.piece)) for sp in ordered if sp.piece.key == piece.key]
    return [(sp, inter) for sp, inter in met if inter is not None]


def test_stacked_layers_split_over_tp_match_the_walk():
    layers, rows, cols = 50, 8, 6
    shape = (layers, rows, cols)
    saved_pieces = []
    for layer in range(layers):  # saved at TP 2 along the last axis, with a DP replica of each
        for t in range(2):
            for replica in ((0, t, 0), (0, t, 1)):
                saved_pieces.append(_piece("w", shape, (layer, 0, t * 3), (1, rows, 3), prepend=1, replica=replica))
    saved_pieces.append(_piece("other", (4,), (0,), (4,)))
    saved = _saved(saved_pieces)
    index = _SavedIndex(saved)
    rng = random.Random(0)
    for _ in range(300):  # needed at TP 1, 2, 3 and across layers
        layer = rng.randrange(layers)
        c0 = rng.randrange(cols)
        piece = _piece("w", shape, (layer, 0, c0), (1, rows, rng.randrange(1, cols - c0 + 1)), prepend=1)
        assert index.overlapping(piece) == _walk(saved, piece)


def test_pieces_of_mixed_extents_and_a_scalar_key_match_the_walk():
    shape = (100, 4)
    saved_pieces = [_piece("e", shape, (0, 0), (60, 4)), _piece("e", shape, (60, 0), (10, 4)),
                    _piece("e", shape, (70, 0), (30, 4)), _piece("s", (), (), ())]
    saved = _saved(saved_pieces)
    index = _SavedIndex(saved)
    for lo in range(0, 100, 7):
        for n in (1, 5, 30):
            piece = _piece("e", shape, (lo, 0), (min(n, 100 - lo), 4))
            assert index.overlapping(piece) == _walk(saved, piece)
    scalar = _piece("s", (), (), ())
    assert index.overlapping(scalar) == _walk(saved, scalar)
    assert index.overlapping(_piece("missing", (3,), (0,), (3,))) == []
