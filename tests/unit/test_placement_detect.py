"""Placement from torchrun, Ray (as verl sets it) and SLURM variables; per-root socket names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.client.paths import client_socket_path, default_socket_path
from ckptd.client.placement import Placement, tasks_per_node
from ckptd.testing.launch import launcher_env
from ckptd.writer.errors import DaemonUnavailableError, PlacementError
from ckptd.writer.urls import normalize_root


@pytest.mark.parametrize("launcher", ["torchrun", "ray", "slurm"])
def test_two_nodes_of_two_from_each_launcher(launcher: str) -> None:
    got = [Placement.detect(launcher_env(launcher, r, 4, 2)) for r in range(4)]  # type: ignore[arg-type]
    assert [(p.rank, p.world_size, p.local_world_size, p.node, p.num_nodes) for p in got] == [
        (0, 4, 2, 0, 2), (1, 4, 2, 0, 2), (2, 4, 2, 1, 2), (3, 4, 2, 1, 2)
    ]


def test_ray_without_local_world_size_is_refused_not_put_on_node_0() -> None:
    with pytest.raises(PlacementError, match="LOCAL_WORLD_SIZE"):
        Placement.detect({"RANK": "3", "WORLD_SIZE": "4"})


def test_ray_unpacked_ranks_need_an_explicit_node() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "RAY_LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    with pytest.raises(PlacementError, match="CKPTD_NODE_RANK"):
        Placement.detect(env)
    assert Placement.detect({**env, "CKPTD_NODE_RANK": "1"}).node == 1


def test_slurm_uneven_nodes_and_compressed_counts() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_NODEID": "3", "SLURM_TASKS_PER_NODE": "2(x3),1"}
    p = Placement.detect(env)
    assert (p.local_world_size, p.node, p.num_nodes) == (1, 3, 4)
    p = Placement.detect({**env, "SLURM_PROCID": "2", "SLURM_NODEID": "1"})
    assert (p.local_world_size, p.node, p.num_nodes) == (2, 1, 4)
    with pytest.raises(PlacementError, match="SLURM_NODEID"):
        Placement.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(PlacementError, match="tasks per node"):
        Placement.detect({**env, "SLURM_TASKS_PER_NODE": "2(x"})


def test_torchrun_wins_over_slurm_and_single_process_default() -> None:
    env = {**launcher_env("slurm", 0, 2, 1), **launcher_env("torchrun", 5, 8, 4)}
    assert Placement.detect(env) == Placement(5, 8, 4, 1)
    assert Placement.detect({}) == Placement(0, 1, 1, 0)
    with pytest.raises(PlacementError, match="outside"):
        Placement(4, 4, 2, 0)
    with pytest.raises(PlacementError, match="not an integer"):
        Placement.detect({"RANK": "x", "WORLD_SIZE": "2"})


def test_socket_is_per_root_and_roots_are_normalized(tmp_path: os.PathLike[str]) -> None:
    env = {"XDG_RUNTIME_DIR": "/run/user/7"}
    a = default_socket_path(env, str(tmp_path) + "/a")
    assert a == default_socket_path(env, str(tmp_path) + "/./a/")
    assert a != default_socket_path(env, str(tmp_path) + "/b")
    assert a.startswith(f"/run/user/7/ckptd/{os.getuid()}-") and a.endswith(".sock")
    assert default_socket_path({**env, "CKPTD_ROOT": str(tmp_path) + "/a"}) == a
    assert default_socket_path({**env, "CKPTD_SOCKET": "/x.sock"}, "/r") == "/x.sock"
    assert default_socket_path(env) == "/run/user/7/ckptd/daemon.sock"
    assert normalize_root("S3://bucket/run/") == "s3://bucket/run"
    assert normalize_root("file:///a/b/") == "/a/b"


def test_daemon_config_uses_the_same_per_root_socket() -> None:
    from ckptd.daemon.config import load_config

    env = {"XDG_RUNTIME_DIR": "/run/user/7"}
    cfg = load_config({"root": "/data/ck"}, env=env)
    assert cfg.socket == default_socket_path(env, "/data/ck")
    assert load_config({"root": "/data/ck", "exit_when_idle_s": 5}, env=env).exit_when_idle_s == 5


def test_a_client_without_root_finds_the_one_daemon_and_refuses_to_guess_among_several(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    (tmp_path / "ckptd").mkdir()
    assert client_socket_path(env) == str(tmp_path / "ckptd" / "daemon.sock")  # nothing there: the legacy name
    a = Path(default_socket_path(env, "/data/a"))
    a.touch()
    assert client_socket_path(env) == str(a)
    assert client_socket_path(env, "/data/b") == default_socket_path(env, "/data/b")
    Path(default_socket_path(env, "/data/b")).touch()
    with pytest.raises(DaemonUnavailableError, match="pass root="):
        client_socket_path(env)
