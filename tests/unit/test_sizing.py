"""The arena sizing rule (``ckptd plan``) and the startup check that /dev/shm can hold the arena."""

from __future__ import annotations

import os

import pytest

from ckptd.daemon.arena import Arena, shm_free_bytes
from ckptd.daemon.sizing import parse_count, plan_arena
from ckptd.writer.errors import ArenaError, ConfigError


def test_bf16_adam_is_14_bytes_per_param_over_the_node() -> None:
    # 70B params, TP8 x PP4 x DP4 = 128 ranks, 8 per node: each rank stages 70e9/128 params x 14 B
    plan = plan_arena(70 * 10**9, tp=8, pp=4, dp=4, ranks_per_node=8)
    assert plan.bytes_per_param == 14
    assert plan.per_rank_bytes == -(-70 * 10**9 // 128) * 14
    assert plan.per_node_bytes >= plan.per_rank_bytes * 8
    assert plan.minimum_arena_bytes % (1 << 30) == 0 and plan.minimum_arena_bytes >= plan.per_node_bytes
    assert plan.overlap_arena_bytes >= 2 * plan.per_node_bytes


def test_fp32_weights_and_small_worlds() -> None:
    plan = plan_arena(1000, dp=2, ranks_per_node=8, weight_dtype="fp32")
    assert plan.bytes_per_param == 16 and plan.ranks_per_node == 2  # never more ranks on a node than the world
    assert plan.per_rank_bytes == 500 * 16


@pytest.mark.parametrize("text,value", [("7e9", 7 * 10**9), ("70B", 70 * 10**9), ("350m", 350 * 10**6),
                                        ("1.5T", 15 * 10**11), ("123", 123)])
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("kwargs", [{"params": 0}, {"params": 10, "tp": 0}, {"params": 10, "weight_dtype": "int3"},
                                    {"params": 10, "optimizer": "lion?"}])
def test_bad_plans_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        plan_arena(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        parse_count("lots")


def test_arena_larger_than_shm_fails_at_startup(tmp_path) -> None:
    free = shm_free_bytes(str(tmp_path))
    with pytest.raises(ArenaError, match="does not fit"):
        Arena(free + (1 << 30), shm_dir=str(tmp_path), prefault=False)
    assert os.listdir(tmp_path) == []  # nothing created
