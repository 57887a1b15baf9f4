"""The verl integration keeps to what verl itself does with a run's checkpoints (review findings, each a
failure before its fix): retention deletes only steps this run saved, or, resumed from the newest step,
those up to it (a step saved after resuming from an older one used to be deleted at once, for being older
than the earlier run's steps, and the next resume failed); a model-only load also refreshes the
distributed optimizer's fp32 main params (with bf16 weights the first step used to copy the stale ones back
over the loaded model); and the SFT trainers' ``<dir>/global_step_N`` folders (no role folder) keep their
ckptd root inside ``<dir>`` and load.

Real verl 0.9 managers around the toy megatron-core GPT, one gloo rank each run, the embedded daemon."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl.utils.checkpoint.megatron_checkpoint_manager")

from ckptd.integrations.verl import ckptd_root
from ckptd.testing.launch import run_ranks
from ckptd.testing.verl_job import HOOK, PRELOAD, build_managers, committed, train

pytestmark = [pytest.mark.megatron, pytest.mark.verl]

ONE = {"actor": 1234}


def _env(sockdir: str) -> dict[str, str]:
    return {"CKPTD_SOCKET": os.path.join(sockdir, "default.sock"),
            "CKPTD_DAEMON_ARGS": "--arena-size 64MiB --no-prefault --restore-hold 0"}


def _saves(rank: int, world: int, ckpt_dir: str, steps: list[int], load: int, keep: int | None) -> list[int]:
    m = build_managers(HOOK, 0, async_save=False, roles=ONE)["actor"]
    if load:
        m.manager.load_checkpoint(os.path.join(ckpt_dir, f"global_step_{load}", "actor"))
    for step in steps:
        train({"actor": m}, step - 1, 1)
        local = os.path.join(ckpt_dir, f"global_step_{step}", "actor")
        m.manager.save_checkpoint(local, None, step, max_ckpt_to_keep=keep)
    return committed(ckptd_root(os.path.join(ckpt_dir, "global_step_1", "actor"), "actor"))


def test_retention_deletes_only_this_runs_steps(tmp_path: Path, sockdir: str) -> None:
    ckpt_dir, env = str(tmp_path / "ckpt"), _env(sockdir)
    assert run_ranks(_saves, 1, ckpt_dir, [2, 4, 6], 0, None, env=env, launcher="ray", preload=PRELOAD) == [[2, 4, 6]]
    # resumed from step 2 (resume_path), keep 1: step 3 stays though 4 and 6 are newer; then 5 replaces it
    assert run_ranks(_saves, 1, ckpt_dir, [3], 2, 1, env=env, launcher="ray", preload=PRELOAD) == [[2, 3, 4, 6]]
    assert run_ranks(_saves, 1, ckpt_dir, [3, 5], 2, 1, env=env, launcher="ray", preload=PRELOAD) == [[2, 4, 5, 6]]
    # resumed from the newest step (auto-resume after a preemption): the steps up to it count as this run's,
    # so each resume does not leave `keep` more behind
    assert run_ranks(_saves, 1, ckpt_dir, [7, 8], 6, 2, env=env, launcher="ray", preload=PRELOAD) == [[7, 8]]


def _from_another_run(rank: int, world: int, src_dir: str, dst_dir: str) -> tuple[list[int], list[int]]:
    """A run that starts from another run's newest step (its own checkpoint dir), keep 1."""
    m = build_managers(HOOK, 0, async_save=False, roles=ONE)["actor"]
    m.manager.load_checkpoint(os.path.join(src_dir, "global_step_6", "actor"))
    for step in (7, 8):
        train({"actor": m}, step - 1, 1)
        m.manager.save_checkpoint(os.path.join(dst_dir, f"global_step_{step}", "actor"), None, step, max_ckpt_to_keep=1)
    root = ckptd_root(os.path.join(src_dir, "global_step_1", "actor"), "actor")
    return committed(root), committed(ckptd_root(os.path.join(dst_dir, "global_step_1", "actor"), "actor"))


def test_a_run_started_from_another_runs_step_deletes_none_of_it(tmp_path: Path, sockdir: str) -> None:
    src, dst, env = str(tmp_path / "a"), str(tmp_path / "b"), _env(sockdir)
    assert run_ranks(_saves, 1, src, [2, 4, 6], 0, None, env=env, launcher="ray", preload=PRELOAD) == [[2, 4, 6]]
    got = run_ranks(_from_another_run, 1, src, dst, env=env, launcher="ray", preload=PRELOAD)
    assert got == [([2, 4, 6], [8])]  # before the fix: the source run's root emptied


def _bf16(seed: int, load_contents: list[str] | None) -> tuple[Any, Any, Any]:
    from ray._private.runtime_env.setup_hook import load_and_execute_setup_hook

    load_and_execute_setup_hook(HOOK)
    from megatron.core.utils import unwrap_model
    from omegaconf import OmegaConf
    from verl.workers.config.checkpoint import McoreCheckpointConfig
    from verl.workers.engine.megatron import transformer_impl

    from ckptd.testing.toy_gpt import build_gpt

    model, opt, step = build_gpt(1, bf16=True, seed=seed, data_seed=1, lr=1e-6)
    cfg = OmegaConf.create({"model": {"path": "unused"}, "megatron": {
        "dist_ckpt_optim_fully_reshardable": False, "distrib_optim_fully_reshardable_mem_efficient": False}})
    kw = {} if load_contents is None else {"load_contents": load_contents}
    mgr = transformer_impl.MegatronCheckpointManager(
        config=cfg, checkpoint_config=McoreCheckpointConfig(async_save=False, **kw), model_config=None,
        transformer_config=unwrap_model(model[0]).config, role="actor", model=model, arch="GPTModel",
        hf_config=None, param_dtype=torch.bfloat16, share_embeddings_and_output_weights=True,
        processing_class=None, optimizer=opt, optimizer_scheduler=None, use_distributed_optimizer=True,
        use_checkpoint_opt_param_scheduler=False, use_dist_checkpointing=True, bridge=None, provider=None,
        peft_cls=None, use_megatron_fsdp=False)
    return mgr, model, step


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model[0].named_parameters()}


def _far(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _bf16_save(rank: int, world: int, ckpt_dir: str) -> dict[str, torch.Tensor]:
    mgr, model, step = _bf16(1234, None)
    for it in range(3):
        step(it)
    mgr.save_checkpoint(os.path.join(ckpt_dir, "global_step_3", "actor"), None, 3, max_ckpt_to_keep=None)
    return _weights(model)


def _bf16_model_load(rank: int, world: int, ckpt_dir: str, saved: dict[str, torch.Tensor]) -> tuple[float, float]:
    mgr, model, step = _bf16(99, ["model"])
    mgr.load_checkpoint(os.path.join(ckpt_dir, "global_step_3", "actor"))
    loaded = _far(_weights(model), saved)
    step(3)  # lr 1e-6: the weights stay next to the loaded ones, not this run's initial ones
    return loaded, _far(_weights(model), saved)


def test_a_model_only_load_of_bf16_weights_survives_the_first_step(tmp_path: Path, sockdir: str) -> None:
    ckpt_dir, env = str(tmp_path / "ckpt"), _env(sockdir)
    saved = run_ranks(_bf16_save, 1, ckpt_dir, env=env, launcher="ray", preload=PRELOAD)[0]
    loaded, stepped = run_ranks(_bf16_model_load, 1, ckpt_dir, saved, env=env, launcher="ray", preload=PRELOAD)[0]
    assert loaded == 0.0
    assert stepped < 1e-3  # 0.12 before the fix: the initial weights came back


def _sft(rank: int, world: int, exp_dir: str) -> list[int]:
    m = build_managers(HOOK, 0, async_save=False, roles=ONE)["actor"]
    train({"actor": m}, 0, 2)
    folder = os.path.join(exp_dir, "global_step_2")  # what verl's CheckpointHandler passes: no role folder
    m.manager.save_checkpoint(local_path=folder, global_step=2, max_ckpt_to_keep=None)
    m.manager.load_checkpoint(folder)
    return committed(os.path.join(exp_dir, "ckptd", "actor"))


def test_the_sft_trainers_step_folders(tmp_path: Path, sockdir: str) -> None:
    exp = tmp_path / "proj" / "exp1"
    assert run_ranks(_sft, 1, str(exp), env=_env(sockdir), launcher="ray", preload=PRELOAD) == [[2]]
    assert sorted(os.listdir(tmp_path / "proj")) == ["exp1"]  # the root stays inside the experiment's folder
