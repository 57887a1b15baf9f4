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
from ckptd.client.reuse import RepeatedPlans
from ckptd.client.skeleton import Skeleton
from ckptd.client.state import Shard, plan_state

_PLAN = StagePlan([], [], [], 0, None)  # the plan a skeleton names: any plan serves here


def _of(state: Any, rank: int = 0) -> Skeleton | None:
    """The skeleton of ``state`` as a save of it on ``rank`` makes it: with ``plan_state``'s shards and replicas."""
    planned = plan_state(state, rank)
    return Skeleton.of(state, _PLAN, planned.shards, planned.replicas)


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


def _check_like_plan_state(sk: Skeleton, state: dict[str, Any], rank: int = 0) -> None:
    hit = sk.match(state)
    assert hit is not None
    tensors, objects = hit
    planned = plan_state(state, rank)
    assert len(tensors) == len(planned.shards)
    assert all(s.data is t for s, t in zip(planned.shards, tensors, strict=True))  # same objects, same order
    assert objects == planned.objects


def test_a_dict_of_the_same_shape_gives_what_plan_state_gives() -> None:
    sk = _of(_state(1))
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
        sk = _of(tree(0, seed))
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
    sk = _of(_state(3))
    assert sk is not None and sk.match(_state(4)) is not None
    assert sk.match(changed) is None, what


def test_a_strided_view_of_the_same_dtype_and_shape_is_the_same_shape() -> None:
    """Strides do not change the plan (a copy reads any layout): torch's guard refuses it, the exact
    comparison takes it."""
    sk = _of(_state(3))
    assert sk is not None
    s = _state(3)
    s["model"]["w"] = torch.randn(3, 4).t()
    _check_like_plan_state(sk, s)
    _check_like_plan_state(sk, _state(5))


class _OwnShard(Shard):
    """A Shard subclass (it may stage itself)."""


@pytest.mark.parametrize("leaf", [
    _OwnShard("x", torch.zeros(2), (4,), (0,)),
    object(),
    {1, 2},
    torch.Size([2]),
], ids=["shard-subclass", "object", "set", "size"])
def test_dicts_with_leaves_it_does_not_stand_for_have_none(leaf: object) -> None:
    state = {"a": torch.zeros(1), "n": {"x": leaf}}
    assert Skeleton.of(state, _PLAN, [Shard("a", state["a"], (1,), (0,))], []) is None


def test_non_string_keys_and_non_dict_states_have_none() -> None:
    t = torch.zeros(1)
    assert Skeleton.of({1: t}, _PLAN, [Shard("1", t, (1,), (0,))], []) is None  # type: ignore[dict-item]
    assert Skeleton.of({"a": {2: 1}}, _PLAN, [], []) is None
    sk = _of({"a": t})
    assert sk is not None
    assert sk.match([("a", t)]) is None  # type: ignore[arg-type]


def test_leaves_that_are_not_the_plans_tensors_have_none() -> None:
    state = {"a": torch.zeros(1), "b": torch.ones(1)}
    planned = plan_state(state, 0)
    assert Skeleton.of(state, _PLAN, planned.shards[::-1], []) is None  # another order
    assert Skeleton.of(state, _PLAN, planned.shards[:1], []) is None  # one missing


def _sharded(seed: int, rank: int, offset: int = 0, replica: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 3, generator=g)
    return {
        "w": Shard("w", w[4 * rank : 4 * rank + 4], (8, 3), (4 * rank + offset, 0)),  # this rank's rows
        "emb": torch.randn(5, generator=g),  # a plain tensor: rank 0 writes it
        "opt": {"m": Shard("opt/m", torch.randn(2, generator=g), (4,), (2 * rank,), chunk_shape=(2,))},
        "tied": Shard("tied", torch.randn(3, generator=g), (3,), (0,), replica_id=replica * rank),
        "step": seed,
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_shard_leaves_give_what_plan_state_gives_on_each_rank(rank: int) -> None:
    sk = _of(_sharded(1, rank), rank)
    assert sk is not None
    _check_like_plan_state(sk, _sharded(1, rank), rank)
    _check_like_plan_state(sk, _sharded(2, rank), rank)  # new Shard objects, new values


@pytest.mark.parametrize(("what", "changed"), [
    ("global offset", _sharded(3, 1, offset=-2)),
    ("replica id", _sharded(3, 1, replica=2)),
    ("key", {**_sharded(3, 1), "w": Shard("w2", torch.zeros(4, 3), (8, 3), (4, 0))}),
    ("global shape", {**_sharded(3, 1), "w": Shard("w", torch.zeros(4, 3), (12, 3), (4, 0))}),
    ("chunk grid", {**_sharded(3, 1), "opt": {"m": Shard("opt/m", torch.zeros(2), (4,), (2,))}}),
    ("data dtype", {**_sharded(3, 1), "w": Shard("w", torch.zeros(4, 3).double(), (8, 3), (4, 0))}),
    ("became a tensor", {**_sharded(3, 1), "tied": torch.zeros(3)}),
], ids=lambda x: x if isinstance(x, str) else "")
def test_any_change_of_a_shard_leaf_is_refused(what: str, changed: dict[str, Any]) -> None:
    sk = _of(_sharded(3, 1), 1)
    assert sk is not None and sk.match(_sharded(4, 1)) is not None
    assert sk.match(changed) is None, what


@pytest.mark.parametrize("sharded", [False, True])
def test_a_skeleton_keeps_no_tensor_alive(sharded: bool) -> None:
    state = _sharded(1, 1) if sharded else _state(1)
    ref = weakref.ref(state["w"].data if sharded else state["model"]["w"])
    sk = _of(state, 1 if sharded else 0)
    assert sk is not None
    del state
    gc.collect()
    assert ref() is None


def _aliased(t: torch.Tensor, u: torch.Tensor, order: str) -> dict[str, Any]:
    """One tensor under two keys when ``t is u``: written under one, held as a non-main replica under the other."""
    replica, main = Shard("x", t, (4,), (0,), replica_id=1), Shard("y", u, (4,), (0,))
    states: dict[str, dict[str, Any]] = {
        "replica first": {"a": replica, "b": main},
        "main first": {"a": main, "b": replica},
        "plain then main": {"a": t, "b": Shard("y", u, (4,), (0,))},  # rank 1: the plain tensor is a replica
        "replica then plain": {"a": Shard("x", t, (4,), (0,), replica_id=1), "b": u},  # rank 0 writes "b"
        "plain twice": {"a": t, "b": u},
    }
    return states[order]


_ORDERS = ["replica first", "main first", "plain then main", "replica then plain", "plain twice"]


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_under_two_keys_when_planned_maps_each_key_to_its_own_position(order: str, rank: int) -> None:
    t = torch.zeros(4)
    sk = _of(_aliased(t, t, order), rank)
    assert sk is not None
    # later saves with distinct tensors: each key's own tensor is staged, never the other key's
    _check_like_plan_state(sk, _aliased(torch.full((4,), 1.0), torch.full((4,), 2.0), order), rank)
    _check_like_plan_state(sk, _aliased(t, t, order), rank)


def test_repeated_plans_stage_the_written_keys_tensor_after_an_aliased_first_save() -> None:
    rp = RepeatedPlans()
    t = torch.zeros(4)
    for _ in range(2):  # the second save of the structure makes the plan and remembers the dict
        rp.route(_aliased(t, t, "replica first"), 0)
    u, v = torch.full((4,), 1.0), torch.full((4,), 2.0)
    route = rp.route(_aliased(u, v, "replica first"), 0)
    assert isinstance(route, tuple)
    plan, tensors, _ = route
    assert [m.key for m in plan.metas] == ["y"]
    assert len(tensors) == 1 and tensors[0] is v
