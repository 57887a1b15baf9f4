"""Pure planning of a state dict into shards and plain data; and the daemon's layered configuration."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.client.reuse import RepeatedPlans
from ckptd.client.state import Shard, dtype_name, plan_state, torch_dtype
from ckptd.writer.errors import (
    InvalidKeyError,
    InvalidRequestError,
    ShardLayoutError,
    UnsupportedDtypeError,
)
from ckptd.writer.format import region_chunks


def sample_state() -> dict[str, Any]:
    return {
        "model": {
            "decoder.layers.0.mlp.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3),
            "bias": torch.zeros(3, dtype=torch.bfloat16),
        },
        "optimizer": {"param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95)}], "name": "adam"},
        "iteration": 5,
        "args": None,
    }


# --- plan_state -----------------------------------------------------------------------------------
def test_plain_tensors_are_written_by_rank_zero_under_their_path() -> None:
    state = sample_state()
    plan = plan_state(state, rank=0)
    by_key = {s.key: s for s in plan.shards}
    assert sorted(by_key) == ["model/bias", "model/decoder.layers.0.mlp.weight"]
    w = by_key["model/decoder.layers.0.mlp.weight"]
    assert w.data is state["model"]["decoder.layers.0.mlp.weight"]  # no copy while planning
    assert (w.global_shape, w.global_offset, w.grid) == ((4, 3), (0, 0), (4, 3))
    assert plan.nbytes == 12 * 4 + 3 * 2


def test_plain_tensors_are_not_written_by_other_ranks() -> None:
    plan = plan_state(sample_state(), rank=1)
    assert plan.shards == []
    assert plan.nbytes == 0


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_plain_data_keeps_its_nested_structure(rank: int) -> None:
    plan = plan_state(sample_state(), rank=rank)
    assert plan.objects == {
        "optimizer": {"param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95)}], "name": "adam"},
        "iteration": 5,
        "args": None,
    }


def test_shard_leaves_keep_their_own_key() -> None:
    t = torch.ones(4, 3)
    state = {"anything": {"here": Shard("decoder.final_layernorm.weight", t, (8, 3), (4, 0))}}
    (shard,) = plan_state(state, rank=5).shards
    assert shard.key == "decoder.final_layernorm.weight"
    assert (shard.global_shape, shard.global_offset) == ((8, 3), (4, 0))
    assert shard.data is t


@pytest.mark.parametrize("replica", [1, (0, 1), (0, 0, 2), (1, 0, 0)])
def test_non_main_replicas_are_dropped(replica: int | tuple[int, ...]) -> None:
    main = Shard("w", torch.ones(2, 3), (4, 3), (0, 0), replica_id=0)
    copy = Shard("w", torch.ones(2, 3), (4, 3), (2, 0), replica_id=replica)
    plan = plan_state({"a": main, "b": copy}, rank=0)
    assert [s.global_offset for s in plan.shards] == [(0, 0)]


@pytest.mark.parametrize("replica", [0, (0,), (0, 0, 0)])
def test_main_replicas_are_kept(replica: int | tuple[int, ...]) -> None:
    plan = plan_state({"a": Shard("w", torch.ones(2), (2,), (0,), replica_id=replica)}, rank=3)
    assert len(plan.shards) == 1


def test_a_region_given_twice_is_a_layout_error() -> None:
    a = Shard("w", torch.ones(2, 3), (4, 3), (2, 0))
    b = Shard("w", torch.zeros(2, 3), (4, 3), (2, 0))
    with pytest.raises(ShardLayoutError, match="given twice"):
        plan_state({"x": {"a": a}, "y": b}, rank=0)


@pytest.mark.parametrize(("state", "match"), [
    ({"a": torch.ones(1), "x": Shard("a/b", torch.ones(1), (1,), (0,))}, "'a' is an array and also the group of 'a/b'"),
    ({"a": torch.ones(1), "x": Shard("a/c.0", torch.ones(1), (1,), (0,))}, "group of 'a/c.0'"),  # a's chunk file
    ({"merged": {"w": torch.ones(1)}}, "ckptd merge"),
])
def test_keys_that_are_both_array_and_group_or_in_merged_are_refused(state: dict[str, Any], match: str) -> None:
    """Both would own ``a/zarr.json`` (the step committed and zarr could not open ``a``), or one's chunk is
    the other's folder; ``merged/`` is ``ckptd merge``'s."""
    with pytest.raises(InvalidKeyError, match=match):
        plan_state(state, rank=0)
    unchecked = plan_state(state, rank=0, validate=False)  # a repeated structure: checked once, by validate()
    with pytest.raises(InvalidKeyError, match=match):
        unchecked.validate()
    plan_state({"a": {"b": torch.ones(1)}, "ab": torch.ones(1), "a-b": {"c": torch.ones(1)}}, rank=0)


def test_a_plain_tensor_and_a_shard_of_the_same_key_collide() -> None:
    with pytest.raises(ShardLayoutError):
        plan_state({"w": torch.ones(2), "x": Shard("w", torch.ones(2), (2,), (0,))}, rank=0)


@pytest.mark.parametrize(
    "state",
    [
        {"a b": torch.ones(1)},
        {"..": {"w": torch.ones(1)}},
        {"_private": torch.ones(1)},
        {"model": {".hidden": torch.ones(1)}},
        {"model": {"": torch.ones(1)}},
        {"x": Shard("/abs/w", torch.ones(1), (1,), (0,))},
        {"x": Shard("a/../b", torch.ones(1), (1,), (0,))},
        {"x": Shard("a\\b", torch.ones(1), (1,), (0,))},
    ],
    ids=repr,
)
def test_unsafe_keys_are_rejected(state: dict[str, Any]) -> None:
    with pytest.raises(InvalidKeyError):
        plan_state(state, rank=0)


def test_unsafe_keys_are_rejected_on_every_rank() -> None:
    """Rank 1 does not write a plain tensor, but must still refuse a key rank 0 will refuse."""
    with pytest.raises(InvalidKeyError):
        plan_state({"a b": torch.ones(1)}, rank=1)


def test_non_string_state_keys_are_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="strings"):
        plan_state({"model": {0: torch.ones(1)}}, rank=0)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.uint16])
def test_unsupported_dtypes_are_rejected(dtype: torch.dtype) -> None:
    with pytest.raises(UnsupportedDtypeError):
        plan_state({"w": torch.zeros(2, dtype=dtype)}, rank=0)
    with pytest.raises(InvalidRequestError):
        plan_state({"w": torch.zeros(2, dtype=dtype)}, rank=1)


@pytest.mark.parametrize(
    ("shard", "match"),
    [
        (Shard("w", torch.ones(2, 3), (4,), (0,)), "dims"),
        (Shard("w", torch.ones(2), (8,), (1,)), "chunk grid"),
        (Shard("w", torch.ones(3), (8,), (6,)), "outside"),
        (Shard("w", torch.ones(3), (8,), (0,), chunk_shape=(2,)), "chunk grid"),
    ],
    ids=["dims", "misaligned", "out-of-bounds", "block-off-grid"],
)
def test_bad_regions_are_rejected(shard: Shard, match: str) -> None:
    with pytest.raises(ShardLayoutError, match=match):
        plan_state({"w": shard}, rank=0)


@pytest.mark.parametrize(
    "bad",
    [{"w": torch.zeros(2, dtype=torch.complex64)}, {"a b": torch.ones(2)},
     {"w": Shard("w", torch.ones(2), (8,), (1,))}],
    ids=["dtype", "key", "region"],
)
def test_a_plain_save_checks_its_shards_unless_a_plan_of_checked_ones_matches(bad: dict[str, Any], monkeypatch) -> None:
    """``save()`` plans without the per-shard checks and leaves them to the plan lookup: a state whose
    structure matches a plan (built from checked shards) skips them; any other is checked, after a plan exists
    too."""
    import ckptd.client.state as state_mod

    plans = RepeatedPlans()
    good = {"w": torch.ones(2)}
    for _ in range(2):  # the second save of a structure builds its plan
        plans.plan_for(plan_state(good, rank=0, validate=False))
    calls: list[str] = []
    real = state_mod.validate_shard
    monkeypatch.setattr(state_mod, "validate_shard", lambda s: (calls.append(s.key), real(s))[1])
    assert plans.plan_for(plan_state({"w": torch.full((2,), 7.0)}, rank=0, validate=False)) is not None
    assert calls == []  # matched the plan: not checked again
    unchecked = plan_state(bad, rank=0, validate=False)
    with pytest.raises((UnsupportedDtypeError, InvalidKeyError, ShardLayoutError)):
        plans.plan_for(unchecked)
    assert calls  # checked, and refused with the same typed error plan_state raises


@st.composite
def sharded_tensors(draw: st.DrawFn) -> tuple[torch.Tensor, tuple[int, ...], int, int]:
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    block = tuple(draw(st.integers(1, n)) for n in shape)
    world = draw(st.integers(1, 4))
    replicas = draw(st.integers(1, 3))
    x = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
    return x, block, world, replicas


@settings(max_examples=60, deadline=None)
@given(sharded_tensors())
def test_ranks_plans_tile_a_tensor_exactly_once(case: tuple[torch.Tensor, tuple[int, ...], int, int]) -> None:
    """Blocks dealt to ranks, each also held by non-main replicas elsewhere: merge(plan(split(x))) == x."""
    x, block, world, replicas = case
    states: list[dict[str, Any]] = [{} for _ in range(world)]
    axes = [range(0, n, b) for n, b in zip(x.shape, block, strict=True)]
    for i, offset in enumerate(itertools.product(*axes)):
        index = tuple(slice(o, o + b) for o, b in zip(offset, block, strict=True))
        piece = x[index]
        for r in range(replicas):
            owner = (i + r) % world
            states[owner][f"blk{i}_r{r}"] = Shard(
                "x", piece, tuple(x.shape), offset, replica_id=(0, r), chunk_shape=block
            )
    out = torch.full_like(x, float("nan"))
    seen: list[tuple[int, ...]] = []
    for rank, state in enumerate(states):
        for s in plan_state(state, rank).shards:
            assert s.is_main_replica
            seen.extend(region_chunks(s.global_offset, s.data.shape, s.grid))
            out[tuple(slice(o, o + m) for o, m in zip(s.global_offset, s.data.shape, strict=True))] = s.data
    assert len(seen) == len(set(seen)) == len(list(itertools.product(*axes)))
    assert torch.equal(out, x)


# --- Shard constructors ---------------------------------------------------------------------------
def test_per_rank_shard_shape_and_offset() -> None:
    data = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    s = Shard.per_rank("rng/cuda", data, rank=1, world_size=4)
    assert s.key == "rng/cuda"
    assert tuple(s.data.shape) == (1, 2, 3)
    assert s.global_shape == (4, 2, 3)
    assert s.global_offset == (1, 0, 0)
    assert s.grid == (1, 2, 3)
    assert torch.equal(s.data[0], data)


def test_per_rank_shards_of_every_rank_tile_the_array() -> None:
    world = 4
    seen = []
    for rank in range(world):
        shard = Shard.per_rank("rng", torch.tensor([rank, rank]), rank, world)
        (s,) = plan_state({"rng": shard}, rank).shards
        seen.extend(region_chunks(s.global_offset, s.data.shape, s.grid))
    assert sorted(seen) == [(r, 0) for r in range(world)]


def test_per_rank_of_a_scalar() -> None:
    s = Shard.per_rank("seed", torch.tensor(7), rank=2, world_size=3)
    assert (tuple(s.data.shape), s.global_shape, s.global_offset) == ((1,), (3,), (2,))


def megatron_sharded_tensor(**over: Any) -> SimpleNamespace:
    """What Megatron's ShardedTensor looks like for layer 1 of 3, TP rank 1 of 2 (split on dim 0)."""
    fields = dict(
        key="decoder.layers.self_attention.linear_qkv.weight",
        data=torch.randn(6, 4),
        global_shape=(3, 12, 4),
        global_offset=(1, 6, 0),
        replica_id=(0, 0, 0),
        prepend_axis_num=1,
        axis_fragmentations=(3, 2, 1),
        flattened_range=None,
    )
    fields.update(over)
    return SimpleNamespace(**fields)


def test_from_sharded_tensor_prepends_axes_and_uses_fragmentations() -> None:
    st_ = megatron_sharded_tensor()
    s = Shard.from_sharded_tensor(st_)
    assert s.key == st_.key
    assert tuple(s.data.shape) == (1, 6, 4)
    assert s.global_shape == (3, 12, 4)
    assert s.global_offset == (1, 6, 0)
    assert s.grid == (1, 6, 4)
    assert s.is_main_replica
    assert torch.equal(s.data[0], st_.data)


def test_duck_typed_sharded_tensors_are_planned() -> None:
    plan = plan_state({"model": {"qkv": megatron_sharded_tensor()}}, rank=3)
    (s,) = plan.shards
    assert s.key == "decoder.layers.self_attention.linear_qkv.weight"
    assert plan.objects == {}
    assert plan_state({"qkv": megatron_sharded_tensor(replica_id=(0, 0, 1))}, rank=3).shards == []


def test_from_sharded_tensor_without_fragmentations_derives_the_grid() -> None:
    st_ = megatron_sharded_tensor(prepend_axis_num=0, axis_fragmentations=None, global_shape=(12, 4),
                                  global_offset=(6, 0))
    s = Shard.from_sharded_tensor(st_)
    assert s.grid == (6, 4)
    assert tuple(s.data.shape) == (6, 4)


def test_flattened_sharded_tensors_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="flattened"):
        Shard.from_sharded_tensor(megatron_sharded_tensor(flattened_range=slice(0, 4)))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool]
)
def test_dtype_names_round_trip(dtype: torch.dtype) -> None:
    assert torch_dtype(dtype_name(dtype)) is dtype


@pytest.mark.parametrize("name", ["nope", "Tensor", "complex", "__name__"])
def test_unknown_torch_dtype_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequestError):
        torch_dtype(name)

