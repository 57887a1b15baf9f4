"""The demo's check across layouts (``ckptd.testing.crosscheck``) on hand-made rank views: it puts a param
back together from DP ranges and TP pieces (a gated fc1's halves included) and catches what it must."""

from __future__ import annotations

from typing import Any

import torch

from ckptd.testing.crosscheck import compare_runs, full_states

FULL = torch.arange(48, dtype=torch.float32).reshape(8, 6)  # one param in model space
NORM = torch.linspace(0.0, 1.0, 6)  # one TP-replicated param


def _view(name: str, local: torch.Tensor, tp: int, tp_size: int, dim: int | None, start: int, end: int,
          gated: bool = False, step: float = 3.0) -> dict[str, Any]:
    flat = local.reshape(-1)
    return {name: {"tp": tp, "tp_size": tp_size, "dim": dim, "gated": gated, "shape": tuple(local.shape),
                   "start": start, "states": {"main": flat[start:end].clone(), "exp_avg": 2 * flat[start:end]},
                   "scalars": {"step": step}}}


def _run(tp_size: int, dp_size: int, gated: bool = False) -> list[dict[str, Any]]:
    """The rank views of one run: ``FULL`` split over TP along dim 0 (gated: each TP rank takes its piece
    of both halves), ``NORM`` replicated over TP; each split over DP in contiguous ranges."""
    ranks = []
    for tp in range(tp_size):
        if gated:
            gate, up = FULL.chunk(2, dim=0)
            local = torch.cat([gate.chunk(tp_size, dim=0)[tp], up.chunk(tp_size, dim=0)[tp]])
        else:
            local = FULL.chunk(tp_size, dim=0)[tp]
        for dp in range(dp_size):
            views: dict[str, Any] = {}
            for name, t, dim in (("w", local, 0), ("norm", NORM, None)):
                n = t.numel()
                lo, hi = n * dp // dp_size, n * (dp + 1) // dp_size
                views.update(_view(name, t, tp, tp_size, dim, lo, hi, gated and name == "w"))
            ranks.append(views)
    return ranks


def test_runs_at_other_tp_and_dp_put_back_together_compare_equal() -> None:
    for gated in (False, True):
        saved = full_states(_run(2, 2, gated))
        for tp_size, dp_size in ((1, 4), (1, 1), (2, 3)):
            compared, differs = compare_runs(saved, full_states(_run(tp_size, dp_size, gated)))
            assert differs == [] and compared == 2 * (FULL.numel() + NORM.numel()), (gated, tp_size, dp_size)
        assert torch.equal(saved.states["w"]["main"], FULL) and torch.equal(saved.states["w"]["exp_avg"], 2 * FULL)


def test_a_changed_value_a_lost_range_a_bad_join_and_a_scalar_are_caught() -> None:
    saved = full_states(_run(2, 2))

    changed = _run(1, 4)
    changed[3]["w"]["states"]["exp_avg"][-1] += 1  # one element of one moment, on the last DP rank
    assert compare_runs(saved, full_states(changed))[1] == ["w/exp_avg: values differ"]

    lost = [r for i, r in enumerate(_run(1, 4)) if i != 2]  # a DP rank's ranges never arrive
    differs = compare_runs(saved, full_states(lost))[1]
    assert "loaded: w/main: TP rank 0's DP ranges do not cover it exactly once" in differs

    # a gated fc1 joined as a plain TP split (gate and rest interleaved wrongly) differs from the true param
    assert compare_runs(full_states(_run(2, 2, gated=True)), full_states(_run(1, 2)))[1] == []
    plain_join = _run(2, 2, gated=True)
    for r in plain_join:
        r["w"]["gated"] = False
    assert "w/main: values differ" in compare_runs(full_states(plain_join), full_states(_run(1, 2)))[1]

    replica = _run(2, 1)
    replica[1]["norm"]["states"]["main"][0] = -1.0  # TP rank 1's copy of a replicated param
    assert "norm/main: a TP-replicated param differs between TP ranks" in full_states(replica).problems

    stepped = _run(1, 2)
    for r in stepped:
        r["w"]["scalars"] = {"step": 4.0}
    assert compare_runs(saved, full_states(stepped))[1] == ["w: scalar state {'step': 3.0} / {'step': 4.0}"]
