"""Where the verl integration puts things, from verl's paths and Ray's environment (no verl needed)."""

from __future__ import annotations

import os

import pytest

from ckptd.client.placement import Placement
from ckptd.integrations.verl import ckptd_root, placement_from_env, socket_for, step_of
from ckptd.writer.errors import InvalidRequestError


def test_root_per_role_inside_the_checkpoint_dir() -> None:
    actor = ckptd_root("/ckpt/run/global_step_7/actor", "actor", {})
    critic = ckptd_root("/ckpt/run/global_step_7/critic", "critic", {})
    assert (actor, critic) == ("/ckpt/run/ckptd/actor", "/ckpt/run/ckptd/critic")
    assert ckptd_root("/ckpt/run/global_step_9/actor", "actor", {}) == actor  # one root for every step


def test_root_from_env() -> None:
    assert ckptd_root("/x/global_step_1/actor", "actor", {"CKPTD_ROOT": "s3://b/run1/"}) == "s3://b/run1/actor"
    assert ckptd_root("/x/global_step_1/critic", "critic", {"CKPTD_ROOT": "/fast"}) == "/fast/critic"
    rel = ckptd_root("/x/global_step_1/critic", "critic", {"CKPTD_ROOT": "rel"})
    assert rel == os.path.join(os.getcwd(), "rel", "critic")


def test_socket_per_root() -> None:
    env = {"XDG_RUNTIME_DIR": "/run/me", "CKPTD_SOCKET": "/run/me/one-for-the-process.sock"}
    a, c = socket_for("/ckpt/ckptd/actor", env), socket_for("/ckpt/ckptd/critic", env)
    assert a != c and os.path.dirname(a) == os.path.dirname(c) == "/run/me/ckptd"
    assert socket_for("/ckpt/ckptd/actor", env) == a  # every rank of the node agrees without talking


def test_step_of_the_folder_the_trainer_names() -> None:
    assert step_of("/ckpt/global_step_12/actor") == 12
    assert step_of("/ckpt/global_step_12/critic/") == 12
    for bad in ("/ckpt/latest/actor", "/ckpt/global_step_x/actor", "/ckpt/actor"):
        with pytest.raises(InvalidRequestError, match="global_step_<N>"):
            step_of(bad)


def test_placement_under_ray() -> None:
    # verl's Ray workers: RANK, WORLD_SIZE, RAY_LOCAL_WORLD_SIZE; no LOCAL_WORLD_SIZE
    env = {"RANK": "5", "WORLD_SIZE": "8", "RAY_LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert placement_from_env(env) == Placement(5, 8, 4, 1)
    assert placement_from_env({**env, "RANK": "3", "LOCAL_RANK": "3"}).node == 0
    assert placement_from_env({**env, "LOCAL_WORLD_SIZE": "2"}) == Placement(5, 8, 2, 2)  # torchrun wins
    assert placement_from_env({**env, "CKPTD_NODE_RANK": "0"}).node == 0
