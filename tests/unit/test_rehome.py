"""Re-homed optimizer state (:mod:`ckptd.client.megatron.rehome`) with torch's own Adam(W): views of flat
tensors train exactly as the separate tensors torch allocates, and a plan stages a held flat tensor in one
copy while refusing a state the user replaced.

Real torch optimizers (single-tensor, foreach and fused paths on CPU); the params' ``Owned`` records are
built by hand (no Megatron here: the integration tests run the real one).
"""

from __future__ import annotations

import pytest
import torch

from ckptd.client.megatron.introspect import Owned
from ckptd.client.megatron.rehome import elements_of, home_scalars
from ckptd.client.megatron.targets import flat_alias, fresh_flat, install_views
from ckptd.client.plan import Fetch, Piece, StalePlanError
from ckptd.client.planbuild import build_stage_plan
from ckptd.client.state import Shard

SIZES = (5, 17, 64, 3)


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], it: int) -> None:
    g = torch.Generator().manual_seed(it)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def _owned(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[Owned]:
    out, lo = [], 0
    for p in params:
        out.append(Owned(None, lo, lo + p.numel(), p, opt, 0))  # type: ignore[arg-type]
        lo += p.numel() + 3  # padding between, as in a bucket
    return out


def _rehome(opt: torch.optim.Optimizer, owned: list[Owned]) -> tuple[torch.Tensor, ...]:
    s = owned[-1].hi + 5
    flats = []
    for name in ("exp_avg", "exp_avg_sq"):
        flat = fresh_flat(owned, s, torch.float32)
        for o in owned:
            flat[o.lo : o.hi].copy_(o.state[name])
        install_views(flat, owned, name)
        flats.append(flat)
    steps = home_scalars(owned, [o.state["step"] for o in owned], "step")  # type: ignore[misc]
    assert steps is not None
    return (*flats, steps)


@pytest.mark.parametrize("path", ["single", "foreach", "fused"])
def test_adam_updates_rehomed_states_in_place_and_trains_bit_identical(path: str) -> None:
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kw = {"lr": 1e-2, "weight_decay": 0.1, "foreach": path == "foreach", "fused": True if path == "fused" else None}
    a, b = torch.optim.AdamW(ps, **kw), torch.optim.AdamW(qs, **kw)
    _train(a, ps, 0)
    _train(b, qs, 0)
    owned = _owned(b, qs)
    exp_avg, exp_avg_sq, steps = _rehome(b, owned)
    for it in range(1, 4):
        _train(a, ps, it)
        _train(b, qs, it)
    for p, q, o in zip(ps, qs, owned, strict=True):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][k].view(torch.int32), b.state[q][k].view(torch.int32)), k
        # still views: the optimizer wrote into the flat tensors, never replaced them
        assert torch.equal(exp_avg[o.lo : o.hi], b.state[q]["exp_avg"])
        assert b.state[q]["exp_avg_sq"].data_ptr() == exp_avg_sq[o.lo :].data_ptr()
    assert steps.tolist() == [4.0] * len(SIZES)  # every param's step, read at once
    assert flat_alias([o.state["exp_avg"] for o in owned], owned, exp_avg.numel(), torch.float32) is not None
    assert torch.count_nonzero(exp_avg[owned[0].hi : owned[1].lo]) == 0  # the padding stays zero
    # homed already: found again, not copied
    assert home_scalars(owned, [o.state["step"] for o in owned], "step").data_ptr() == steps.data_ptr()  # type: ignore[union-attr,misc]


def test_separate_scalars_are_not_taken_for_one_flat_tensor() -> None:
    ts = [torch.tensor(float(i)) for i in range(4)]  # adjacent allocations, maybe: separate storages
    assert elements_of(ts) is None
    flat = torch.arange(6, dtype=torch.float32)
    assert elements_of([flat[1], flat[2], flat[3]]).tolist() == [1.0, 2.0, 3.0]  # type: ignore[union-attr]
    assert elements_of([flat[1], flat[3]]) is None
    assert elements_of([flat[2], flat[1]]) is None  # not in order
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p, q])
    shared = torch.tensor(3.0)  # one step tensor for every param (Megatron's own load does this): not split
    opt.state[p]["step"] = opt.state[q]["step"] = shared
    owned = _owned(opt, [p, q])
    assert home_scalars(owned, [shared, shared], "step") is None and opt.state[q]["step"] is shared


def test_a_held_flat_state_is_one_copy_and_a_replaced_state_is_refused() -> None:
    ps = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = torch.optim.Adam(ps)
    _train(opt, ps, 0)
    owned = _owned(opt, ps)
    exp_avg = _rehome(opt, owned)[0]
    held = tuple(Fetch(opt, p, "exp_avg") for p in ps)
    shard = Shard("exp_avg", exp_avg, (exp_avg.numel(),), (0,))
    object.__setattr__(shard, "stage_pieces", lambda: [Piece(0, src=exp_avg, held=held)])
    plan = build_stage_plan([shard])
    assert plan.copies == 1
    arena = torch.zeros(plan.span, dtype=torch.uint8)
    plan.stage(arena, 0, plan.sources([]))
    assert torch.equal(arena[: exp_avg.numel() * 4].view(torch.float32), exp_avg)
    _train(opt, ps, 1)  # in place: still held
    plan.stage(arena, 0, plan.sources([]))
    assert torch.equal(arena[: exp_avg.numel() * 4].view(torch.float32)[owned[1].lo : owned[1].hi],
                       opt.state[ps[1]]["exp_avg"])
    opt.state[ps[2]]["exp_avg"] = opt.state[ps[2]]["exp_avg"].clone()  # the user's own tensor now
    with pytest.raises(StalePlanError):
        plan.sources([])
    opt.load_state_dict(opt.state_dict())  # every state tensor replaced
    with pytest.raises(StalePlanError):
        plan.sources([])


@pytest.mark.parametrize("change", ["replaced", "data_elsewhere", "set_elsewhere", "deleted"])
def test_a_held_state_changed_in_any_way_is_refused_before_the_copy(change: str) -> None:
    ps = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = torch.optim.Adam(ps)
    _train(opt, ps, 0)
    exp_avg = _rehome(opt, _owned(opt, ps))[0]
    shard = Shard("exp_avg", exp_avg, (exp_avg.numel(),), (0,))
    held = tuple(Fetch(opt, p, "exp_avg") for p in ps)
    object.__setattr__(shard, "stage_pieces", lambda: [Piece(0, src=exp_avg, held=held)])
    plan = build_stage_plan([shard])
    plan.sources([])  # as planned
    state = opt.state[ps[1]]
    with torch.no_grad():
        if change == "replaced":  # another tensor: the optimizer updates it, the plan would stage the old one
            state["exp_avg"] = state["exp_avg"].clone()
        elif change == "data_elsewhere":  # the plan's own view, its memory swapped under it
            state["exp_avg"].data = state["exp_avg"].data.clone()
        elif change == "set_elsewhere":
            state["exp_avg"].set_(torch.zeros_like(state["exp_avg"]))
        else:
            del state["exp_avg"]
    with pytest.raises(StalePlanError):
        plan.sources([])
