"""A state dict shaped like the one a plan was made from is recognised without planning it: the same tensors
in the same order and the same plain data as :func:`plan_state` gives, and any change of shape is refused."""

from __future__ import annotations

import gc
import random
import weakref
from collections import OrderedDict
from typing import Any

import pytest
import torch

from ckptd.client.plan import StagePlan
from ckptd.client.skeleton import Skeleton
from ckptd.client.state import Shard, plan_state

_PLAN = StagePlan([], [], [], 0, None)  # the plan a skeleton names: any plan serves here


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)},
        "step": seed,
        "opt": OrderedDict(
            exp_avg=torch.randn(5, generator=g), lr=0.1 * seed, name=f"run{seed}",
            groups=[{"wd": 0.0}], none=None, exp_avg_sq=torch.randn(5, generator=g), flag=True,
        ),
        "p": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        "tail": torch.zeros(0),
        "raw": b"\x00\x01",
        "pair": (1, 2),
    }


def _check_like_plan_state(sk: Skeleton, state: dict[str, Any]) -> None:
    hit = sk.match(state)
    assert hit is not None
    tensors, objects = hit
    planned = plan_state(state, 0)
    assert len(tensors) == len(planned.shards)
    assert all(s.data is t for s, t in zip(planned.shards, tensors, strict=True))  # same objects, same order
    assert objects == planned.objects


def test_a_dict_of_the_same_shape_gives_what_plan_state_gives() -> None:
    sk = Skeleton.of(_state(1), _PLAN)
    assert sk is not None and sk.plan is _PLAN
    _check_like_plan_state(sk, _state(1))
    _check_like_plan_state(sk, _state(2))  # new tensor objects, new plain values: the same shape


def test_random_nestings_give_what_plan_state_gives() -> None:
    rnd = random.Random(7)

    def tree(depth: int, seed: int) -> dict[str, Any]:
        r = random.Random(seed)  # the same shape for the same seed, whatever the values
        out: dict[str, Any] = {}
        for i in range(r.randint(1, 6)):
            kind = r.choice("ttttpd" if depth < 3 else "ttp")
            if kind == "t":
                out[f"k{i}"] = torch.full((r.randint(0, 4),), float(rnd.random()))
            elif kind == "p":
                out[f"k{i}"] = rnd.random()
            else:
                out[f"k{i}"] = tree(depth + 1, r.randint(0, 1 << 30))
        return out

    for seed in range(40):
        sk = Skeleton.of(tree(0, seed), _PLAN)
        assert sk is not None
        _check_like_plan_state(sk, tree(0, seed))


def _changes() -> list[tuple[str, Any]]:
    def edit(fn: Any) -> dict[str, Any]:
        s = _state(3)
        fn(s)
        return s

    return [
        ("key added", edit(lambda s: s.update(extra=torch.ones(1)))),
        ("key removed", edit(lambda s: s.pop("raw"))),
        ("key renamed", edit(lambda s: s.update(step2=s.pop("step")))),
        ("keys reordered", dict(reversed(list(_state(3).items())))),
        ("nested key added", edit(lambda s: s["model"].update(c=torch.ones(1)))),
        ("nested keys reordered", edit(lambda s: s.update(model={"b": s["model"]["b"], "w": s["model"]["w"]}))),
        ("tensor became a number", edit(lambda s: s["model"].update(w=1.0))),
        ("number became a tensor", edit(lambda s: s.update(step=torch.tensor(3)))),
        ("number became a string", edit(lambda s: s.update(step="3"))),
        ("tensor became a dict", edit(lambda s: s.update(tail={"x": torch.zeros(0)}))),
        ("dict became an OrderedDict", edit(lambda s: s.update(model=OrderedDict(s["model"])))),
        ("parameter became a tensor", edit(lambda s: s.update(p=s["p"].detach()))),
        ("dtype", edit(lambda s: s["model"].update(w=s["model"]["w"].double()))),
        ("shape", edit(lambda s: s["model"].update(w=s["model"]["w"].reshape(3, 4)))),
        ("size", edit(lambda s: s["opt"].update(exp_avg=torch.zeros(6)))),
        ("device", edit(lambda s: s["model"].update(w=torch.empty(4, 3, device="meta")))),
        ("a shard leaf", edit(lambda s: s.update(tail=Shard("tail", torch.zeros(0), (0,), (0,))))),
    ]


@pytest.mark.parametrize(("what", "changed"), _changes(), ids=[c[0] for c in _changes()])
def test_any_change_of_shape_is_refused(what: str, changed: dict[str, Any]) -> None:
    sk = Skeleton.of(_state(3), _PLAN)
    assert sk is not None and sk.match(_state(4)) is not None
    assert sk.match(changed) is None, what


def test_a_strided_view_of_the_same_dtype_and_shape_is_the_same_shape() -> None:
    """Strides do not change the plan (a copy reads any layout): torch's guard refuses it, the exact
    comparison takes it."""
    sk = Skeleton.of(_state(3), _PLAN)
    assert sk is not None
    s = _state(3)
    s["model"]["w"] = torch.randn(3, 4).t()
    _check_like_plan_state(sk, s)
    _check_like_plan_state(sk, _state(5))


@pytest.mark.parametrize("leaf", [
    Shard("x", torch.zeros(2), (4,), (0,)),
    object(),
    {1, 2},
    torch.Size([2]),
], ids=["shard", "object", "set", "size"])
def test_dicts_with_leaves_it_does_not_stand_for_have_none(leaf: object) -> None:
    assert Skeleton.of({"a": torch.zeros(1), "n": {"x": leaf}}, _PLAN) is None


def test_non_string_keys_and_non_dict_states_have_none() -> None:
    assert Skeleton.of({1: torch.zeros(1)}, _PLAN) is None  # type: ignore[dict-item]
    assert Skeleton.of({"a": {2: 1}}, _PLAN) is None
    sk = Skeleton.of({"a": torch.zeros(1)}, _PLAN)
    assert sk is not None
    assert sk.match([("a", torch.zeros(1))]) is None  # type: ignore[arg-type]


def test_a_skeleton_keeps_no_tensor_alive() -> None:
    state = _state(1)
    ref = weakref.ref(state["model"]["w"])
    sk = Skeleton.of(state, _PLAN)
    assert sk is not None
    del state
    gc.collect()
    assert ref() is None
