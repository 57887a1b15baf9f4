"""A byte run of a described shard covers only the pieces that joined it: a piece copied some other way (a
main param with memory of its own, a source of another dtype, a re-homed state held weakly, a lookup) that
lies between two views of one buffer keeps its own bytes, never the buffer's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ckptd.client.plan import Fetch, Piece, StagePlan
from ckptd.client.planbuild import build_stage_plan
from ckptd.client.state import Shard

N = 16  # elements a slot: A = buf[0:16], B = its own source, C = buf[32:48]
BYTES = N * 4


class _Sliced(Shard):
    """A shard assembled from pieces, like a bucket slice of main params or states."""

    pieces: list[Piece] = []

    def stage_pieces(self) -> list[Piece]:
        return self.pieces


def _sliced(key: str, pieces: list[Piece], n: int = 3 * N) -> _Sliced:
    s = _Sliced(key, torch.empty(n), (n,), (0,))
    object.__setattr__(s, "pieces", pieces)
    return s


def _optimizer_state(value: float) -> tuple[torch.optim.Optimizer, torch.nn.Parameter, torch.Tensor]:
    """An Adam whose ``exp_avg`` is a view of a flat tensor (re-homed), filled with ``value``."""
    p = torch.nn.Parameter(torch.zeros(N))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(N)
    opt.step()
    flat = torch.full((N,), value)
    opt.state[p]["exp_avg"] = flat[:]
    return opt, p, flat


def _live(buf: torch.Tensor) -> tuple[Piece, torch.Tensor]:
    own = torch.full((N,), -7.0)
    return Piece(BYTES, src=own, live=True), own


def _static_view(buf: torch.Tensor) -> tuple[Piece, torch.Tensor]:
    # a view of another buffer, the same dtype: a run of its own, never the first buffer's
    other = torch.full((2 * N,), -5.0)
    return Piece(BYTES, src=other[N:]), other[N:]


def _other_dtype(buf: torch.Tensor) -> tuple[Piece, torch.Tensor]:
    own = torch.full((N,), -3.0, dtype=torch.float64)
    return Piece(BYTES, src=own), own.float()


def _held(buf: torch.Tensor) -> tuple[Piece, torch.Tensor]:
    opt, p, flat = _optimizer_state(-9.0)
    _held.keep = opt  # type: ignore[attr-defined]  # the optimizer keeps the flat tensor the plan holds weakly
    return Piece(BYTES, src=flat, held=(Fetch(opt, p, "exp_avg"),)), flat.clone()


def _fetched(buf: torch.Tensor) -> tuple[Piece, torch.Tensor]:
    opt, p, flat = _optimizer_state(-11.0)
    _fetched.keep = opt  # type: ignore[attr-defined]
    return Piece(BYTES, fetch=Fetch(opt, p, "exp_avg")), flat.clone()


MIDDLES: dict[str, Callable[[torch.Tensor], tuple[Piece, torch.Tensor]]] = {
    "live main param": _live, "another buffer's view": _static_view, "another dtype": _other_dtype,
    "held state": _held, "looked-up state": _fetched,
}


def _staged(plan: StagePlan, ahead: bool) -> torch.Tensor:
    arena = torch.full((plan.span,), 0xAB, dtype=torch.uint8)
    if ahead:  # the static copies made ahead of the save's checks, then the rest
        plan.stage_static(arena, 0)
        plan.stage(arena, 0, plan.sources([]), static=False)
    else:
        plan.stage(arena, 0, plan.sources([]))
    return arena


def _slot(arena: torch.Tensor, plan: StagePlan, i: int, n: int = 3 * N) -> torch.Tensor:
    lo = plan.offsets[i]
    return arena[lo : lo + n * 4].view(torch.float32)


@pytest.mark.parametrize("ahead", [False, True], ids=["stage", "static ahead"])
@pytest.mark.parametrize("middle", list(MIDDLES))
def test_a_piece_between_two_views_of_a_buffer_keeps_its_own_bytes(middle: str, ahead: bool) -> None:
    buf = torch.arange(3 * N, dtype=torch.float32)
    piece, want = MIDDLES[middle](buf)
    shard = _sliced("k", [Piece(0, src=buf[0:N]), piece, Piece(2 * BYTES, src=buf[2 * N :])])
    plan = build_stage_plan([shard])
    out = _slot(_staged(plan, ahead), plan, 0)
    assert torch.equal(out[:N], buf[:N])
    assert torch.equal(out[N : 2 * N], want), middle
    assert torch.equal(out[2 * N :], buf[2 * N :])


def test_pieces_listed_out_of_order_still_merge_across_a_gap_and_split_at_a_live_piece() -> None:
    # A, a zeroed gap, B (views of the buffer, spaced as in it), a live piece, C (view): A..gap..B stay one
    # run (the gap is zeroed after the copies), and the live piece ends it
    buf = torch.arange(5 * N, dtype=torch.float32)
    own = torch.full((N,), -7.0)
    shard = _sliced("k", [
        Piece(4 * BYTES, src=buf[4 * N :]), Piece(BYTES, nbytes=BYTES), Piece(0, src=buf[:N]),
        Piece(3 * BYTES, src=own, live=True), Piece(2 * BYTES, src=buf[2 * N : 3 * N]),
    ], n=5 * N)
    plan = build_stage_plan([shard])
    for ahead in (False, True):
        out = _slot(_staged(plan, ahead), plan, 0, 5 * N)
        assert torch.equal(out[:N], buf[:N])
        assert torch.equal(out[N : 2 * N], torch.zeros(N))
        assert torch.equal(out[2 * N : 3 * N], buf[2 * N : 3 * N])
        assert torch.equal(out[3 * N : 4 * N], own)
        assert torch.equal(out[4 * N :], buf[4 * N :])
    copies = sorted((d.rel - plan.offsets[0], d.dtype.itemsize * d.shape[0]) for _, d in plan._static)
    assert copies == [(0, 3 * BYTES), (3 * BYTES, BYTES), (4 * BYTES, BYTES)]


def test_two_shards_each_mixing_views_and_live_pieces() -> None:
    # a bucket slice per shard, both over one buffer: each slot gets its own bytes
    buf = torch.arange(6 * N, dtype=torch.float32)
    own = [torch.full((N,), -1.0 - i) for i in range(2)]
    shards = [
        _sliced(f"s{i}", [
            Piece(0, src=buf[3 * i * N : (3 * i + 1) * N]), Piece(BYTES, src=own[i], live=True),
            Piece(2 * BYTES, src=buf[(3 * i + 2) * N : (3 * i + 3) * N]),
        ]) for i in range(2)
    ]
    plan = build_stage_plan(shards)
    arena = _staged(plan, False)
    for i in range(2):
        out = _slot(arena, plan, i)
        assert torch.equal(out[:N], buf[3 * i * N : (3 * i + 1) * N])
        assert torch.equal(out[N : 2 * N], own[i])
        assert torch.equal(out[2 * N :], buf[(3 * i + 2) * N : (3 * i + 3) * N])
