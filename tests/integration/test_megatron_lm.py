"""The Megatron-LM adapter called the way ``megatron/training/training.py`` calls its checkpointing.

Megatron-LM is not pip-installable, so this harness plays its training loop: an ``argparse.Namespace``
as ``get_args()`` returns it, megatron-core's ``OptimizerParamScheduler``, the iteration counter,
``num_floating_point_operations_so_far`` and ``args.consumed_train_samples``; the toy GPT (real
megatron-core, distributed optimizer, 2 gloo ranks) plus a module with Transformer-Engine-style
``_extra_state``. One run trains N steps, saves (``--async-save``), trains M more (the reference) and
finalizes; fresh processes with other initial weights load and train M steps: losses, learning rates,
data position and extra state equal the uninterrupted run's. Finetune and model-only variants too.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client.megatron.megatron_lm import TRACKER, checkpoint_args, load_checkpoint, read_tracker, save_checkpoint
from ckptd.client.megatron.megatron_lm import finalize_async_saves as maybe_finalize_async_save
from ckptd.client.reader import read_commit
from ckptd.testing.launch import run_ranks
from ckptd.testing.te_state import AmaxState
from ckptd.testing.toy_gpt import build_gpt
from ckptd.writer.errors import CkptdError, ConfigError, NoCommittedStepError, StateMismatchError

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(240)]

N, M = 3, 2  # save at iteration N, then M more iterations
GBS = 8  # global batch size: 4 micro-batches of 2


def _args(root: str, **over: Any) -> argparse.Namespace:
    args = argparse.Namespace(
        save=root, load=root, async_save=True, no_save_optim=False, no_save_rng=False, finetune=False,
        no_load_optim=False, no_load_rng=False, exit_on_missing_checkpoint=False, ckpt_step=None,
        consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0, global_batch_size=GBS,
        micro_batch_size=2, train_iters=N + M, lr=1e-3, params_dtype=torch.float32, hidden_size=64,
    )
    for k, v in over.items():
        setattr(args, k, v)
    return args


def _setup(seed: int, initialize_parallel: bool = True, tp: int = 1) -> tuple[Any, Any, Any, Any, AmaxState]:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model, optimizer, train_step = build_gpt(tp, seed=seed, data_seed=7, initialize_parallel=initialize_parallel)
    fp8 = AmaxState()
    model[0].module.decoder.add_module("fp8_meta", fp8)
    for group in optimizer.param_groups:  # Megatron-LM's OptimizerConfig sets these from --min-lr/--lr
        group["max_lr"], group["min_lr"] = 1e-3, 1e-5
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=2 * GBS, lr_decay_steps=20 * GBS,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=20 * GBS, wd_incr_style="constant",
    )
    return model, optimizer, train_step, scheduler, fp8


def _train(iteration: int, steps: int, args: argparse.Namespace, train_step: Any, scheduler: Any, fp8: AmaxState,
           nfp: float) -> tuple[int, float, list[float], list[float]]:
    """Megatron-LM's loop body: train_step, scheduler.step(increment=GBS), consumed samples, flops."""
    losses, lrs = [], []
    for _ in range(steps):
        losses.append(train_step(iteration))
        fp8.amax = fp8.amax + losses[-1]
        iteration += 1
        scheduler.step(increment=GBS)
        args.consumed_train_samples += GBS
        nfp += 1e9
        lrs.append(scheduler.get_lr(scheduler.optimizer.param_groups[0]))
    return iteration, nfp, losses, lrs


def _first_run(rank: int, world: int, root: str, model_only: bool) -> dict[str, Any]:
    model, optimizer, train_step, scheduler, fp8 = _setup(seed=1234)
    args = _args(root, no_save_optim=model_only, async_save=not model_only)  # model-only run: a synchronous save
    ctx: dict[str, Any] = {}
    iteration, nfp = load_checkpoint(model, optimizer, scheduler, args=args)  # nothing there yet
    assert (iteration, nfp) == (0, 0.0)
    iteration, nfp, _, _ = _train(iteration, N, args, train_step, scheduler, fp8, nfp)
    saved_params = [p.detach().clone() for p in model[0].parameters()]
    saved_amax = fp8.amax.clone()
    save_checkpoint(iteration, model, optimizer, scheduler, nfp, checkpointing_context=ctx, args=args)
    _, _, losses, lrs = _train(iteration, M, args, train_step, scheduler, fp8, nfp)
    maybe_finalize_async_save(blocking=True, terminate=True)  # as training.py calls it at exit (no context)
    return {"losses": losses, "lrs": lrs, "consumed": args.consumed_train_samples, "amax": saved_amax,
            "params": saved_params}


def _resume(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:
    # other weights: only a load makes them equal
    model, optimizer, train_step, scheduler, fp8 = _setup(seed=99, tp=2 if mode.endswith("tp2") else 1)
    if mode.startswith("optim_required"):
        try:
            load_checkpoint(model, optimizer, scheduler, args=_args(root))
        except StateMismatchError as exc:
            return {"error": str(exc)}
        return {"error": None}
    # Megatron-LM's step names: --load <root>/iter_0000003, --ckpt-step iter_0000003 (stored as step_3)
    named: dict[str, dict[str, Any]] = {
        "no_load_optim": {"load": f"{root}/iter_{N:07d}"}, "finetune": {"ckpt_step": f"iter_{N:07d}"},
        # Megatron-LM's fallback: --pretrained-checkpoint where --load is unset or holds no step
        "pretrained": {"load": None, "pretrained_checkpoint": root},
        "pretrained_after_empty": {"load": f"{root}-empty", "pretrained_checkpoint": root},
        "pretrained_step": {"load": f"{root}-empty", "pretrained_checkpoint": root, "ckpt_step": N},
    }
    args = _args(root, finetune=mode == "finetune", no_load_optim=mode == "no_load_optim", **named.get(mode, {}))
    iteration, nfp = load_checkpoint(model, optimizer, scheduler, args=args)
    params = [p.detach().clone() for p in model[0].parameters()]
    out = {"iteration": iteration, "nfp": nfp, "consumed_at_load": args.consumed_train_samples,
           "amax": fp8.amax.clone(), "params": params}
    if mode == "resume":
        _, _, out["losses"], out["lrs"] = _train(iteration, M, args, train_step, scheduler, fp8, nfp)
        out["consumed"] = args.consumed_train_samples
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, module_sockdir: str) -> tuple[str, list[dict[str, Any]]]:
    from ckptd.testing.launch import DaemonProcess

    root = str(tmp_path_factory.mktemp("mlm") / "ck")
    d = DaemonProcess(root, os.path.join(module_sockdir, "mlm.sock"), "--arena-size", "64MiB", "--no-prefault")
    d.wait_ready()
    try:
        # the adapter opens its own client from args.save; CKPTD_SOCKET points it at this daemon
        return root, run_ranks(_first_run, 2, root, False, env={"CKPTD_SOCKET": d.socket})
    finally:
        d.stop()


def test_resume_continues_like_the_uninterrupted_run(full_run: tuple[str, list[dict[str, Any]]]) -> None:
    root, ref = full_run
    assert read_tracker(root) == N and Path(root, TRACKER).read_text() == str(N)
    got = run_ranks(_resume, 2, root, "resume")
    for r in range(2):
        assert (got[r]["iteration"], got[r]["nfp"], got[r]["consumed_at_load"]) == (N, N * 1e9, N * GBS)
        assert got[r]["losses"] == ref[r]["losses"]  # bit-equal next losses
        assert got[r]["lrs"] == ref[r]["lrs"]  # the scheduler came back
        assert got[r]["consumed"] == ref[r]["consumed"] == (N + M) * GBS  # the data position
        assert torch.equal(got[r]["amax"], ref[r]["amax"])  # _extra_state restored, not dropped
    saved = checkpoint_args(root)
    assert saved["hidden_size"] == 64 and saved["params_dtype"] == "torch.float32"
    extra = read_commit(root, N).objects["1"]["extra"]["megatron_lm"]
    assert extra["checkpoint_version"] == 3.0 and extra["args"] is None and extra["iteration"] == N


def test_finetune_and_no_load_optim_load_the_model_alone(full_run: tuple[str, list[dict[str, Any]]]) -> None:
    root, ref = full_run
    for mode in ("finetune", "pretrained", "pretrained_after_empty", "pretrained_step"):
        ft = run_ranks(_resume, 2, root, mode)
        for r in range(2):  # iteration and data position start anew; the FLOPs count goes on, as in Megatron-LM
            assert (ft[r]["iteration"], ft[r]["nfp"], ft[r]["consumed_at_load"]) == (0, N * 1e9, 0), mode
            assert all(torch.equal(a, b) for a, b in zip(ft[r]["params"], ref[r]["params"], strict=True)), mode
    nlo = run_ranks(_resume, 2, root, "no_load_optim")
    assert nlo[0]["iteration"] == N and nlo[0]["consumed_at_load"] == N * GBS


def test_what_ckptd_does_not_make_is_refused_before_training(tmp_path: Path) -> None:
    """torch FSDP2's load (skip_load_to_model_and_opt), non-persistent checkpoints (each would become a
    permanent step moving the tracker) and a --pretrained-checkpoint holding nothing: typed errors at the load
    Megatron-LM makes at startup (and at the first save), never a silent start from scratch."""
    root = str(tmp_path / "ck")
    with pytest.raises(ConfigError, match="torch-fsdp2"):
        load_checkpoint([], None, None, skip_load_to_model_and_opt=True, args=_args(root))
    with pytest.raises(ConfigError, match="non-persistent"):
        load_checkpoint([], None, None, args=_args(root, non_persistent_save_interval=100))
    with pytest.raises(ConfigError, match="non-persistent"):
        save_checkpoint(1, [], None, None, 0.0, args=_args(root, non_persistent_save_interval=100))
    with pytest.raises(NoCommittedStepError):
        load_checkpoint([], None, None, args=_args(root, load=None, pretrained_checkpoint=str(tmp_path / "none")))
    megatron_format = tmp_path / "llama-mcore"  # a Megatron-LM checkpoint: its tracker, no ckptd control folder
    megatron_format.mkdir()
    (megatron_format / "latest_checkpointed_iteration.txt").write_text("100")
    with pytest.raises(ConfigError, match="is not a ckptd root"):
        load_checkpoint([], None, None, args=_args(root, load=None, pretrained_checkpoint=str(megatron_format)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoCommittedStepError):  # an empty folder is an empty root, not a Megatron-LM checkpoint
        load_checkpoint([], None, None, args=_args(root, load=None, pretrained_checkpoint=str(empty)))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(CkptdError) as raised:  # a real error of --load is not taken for "nothing there yet"
        load_checkpoint([], None, None, args=_args(str(a_file), pretrained_checkpoint=str(megatron_format)))
    assert not isinstance(raised.value, ConfigError)


def test_model_only_save_loads_without_optimizer_and_refuses_with_one(tmp_path: Path, start_daemon) -> None:
    root = str(tmp_path / "ck")
    d = start_daemon(root)
    ref = run_ranks(_first_run, 2, root, True, env={"CKPTD_SOCKET": d.socket})
    assert read_tracker(root) == N  # written by the synchronous save, after the commit
    commit = read_commit(root, N)
    assert not any(a.name.startswith("optim/") for a in commit.arrays)
    got = run_ranks(_resume, 2, root, "optim_required", env={"CKPTD_SOCKET": d.socket})
    assert "without optimizer state" in got[0]["error"]
    got = run_ranks(_resume, 2, root, "optim_required_tp2")  # resharded: it said "sidecar  not found" before
    assert all("without optimizer state: load it with optimizer=None" in g["error"] for g in got), got
    ft = run_ranks(_resume, 2, root, "finetune")
    assert all(torch.equal(a, b) for a, b in zip(ft[1]["params"], ref[1]["params"], strict=True))


DOC = Path(__file__).parents[2] / "docs" / "megatron.md"


def _doc_examples() -> list[str]:
    """Every ```python block of docs/megatron.md: [training.py's lines, their replacement, the library API]
    (a new example must get a test here: the count is checked)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 3, "docs/megatron.md has a new example: run it in a test here"
    return blocks


def _bound(code: str) -> set[str]:
    return {a.asname or a.name for node in ast.parse(code).body if isinstance(node, ast.ImportFrom) for a in node.names}


def test_the_documented_training_py_imports_resolve() -> None:
    """docs/megatron.md's replacement imports for training.py bind the same names as Megatron-LM's lines
    they replace, and name what this module provides."""
    original, replacement, _ = _doc_examples()
    assert _bound(original) == _bound(replacement) == {
        "load_checkpoint", "save_checkpoint", "save_grads", "maybe_finalize_async_save"}
    assert "from megatron.training.checkpointing import save_checkpoint, save_grads" in original  # as in training.py
    lines = [ln for ln in replacement.splitlines() if ln.startswith("from ckptd")]
    assert len(lines) == 3
    scope: dict[str, Any] = {}
    exec("\n".join(lines), scope)  # our own doc's import lines
    assert scope["save_checkpoint"] is save_checkpoint and scope["load_checkpoint"] is load_checkpoint
    assert scope["maybe_finalize_async_save"] is maybe_finalize_async_save


def _library_example(rank: int, world: int, root: str) -> dict[str, Any]:
    """Runs docs/megatron.md's library example twice: a fresh run (nothing to load; trains and saves),
    then a restart with other initial weights, which must load the last save and have nothing left to do."""
    code = compile(_doc_examples()[2].replace('"/ckpt/run1"', repr(root)), str(DOC), "exec")
    args = argparse.Namespace(train_iters=4, save_interval=2, global_batch_size=GBS)
    out: dict[str, Any] = {}
    for run, seed in (("fresh", 1234), ("restart", 99)):
        model, optimizer, train_step, scheduler, _ = _setup(seed=seed, initialize_parallel=run == "fresh")
        scope: dict[str, Any] = {"model": model, "optimizer": optimizer, "opt_param_scheduler": scheduler,
                                 "args": args, "train_step": train_step}
        exec(code, scope)
        scope["client"].close()
        out[run] = {"iteration": scope["iteration"], "loaded": "loaded" in scope,
                    "params": [p.detach().clone() for p in model[0].parameters()],
                    "lr": scheduler.get_lr(optimizer.param_groups[0]), "steps": scheduler.num_steps}
    return out


def test_the_library_example_runs(tmp_path: Path, start_daemon) -> None:
    root = str(tmp_path / "run1")
    d = start_daemon(root)
    got = run_ranks(_library_example, 1, root, env={"CKPTD_SOCKET": d.socket})[0]
    fresh, restart = got["fresh"], got["restart"]
    assert (fresh["iteration"], fresh["loaded"], restart["iteration"], restart["loaded"]) == (4, False, 4, True)
    assert all(torch.equal(a, b) for a, b in zip(fresh["params"], restart["params"], strict=True))
    assert (restart["lr"], restart["steps"]) == (fresh["lr"], fresh["steps"]) and fresh["steps"] == 4 * GBS
    assert [read_commit(root, s).step for s in (2, "iter_0000004")] == [2, 4]


def test_megatron_step_names_on_the_command_line(full_run: tuple[str, list[dict[str, Any]]], capsys) -> None:
    """``ckptd ls/verify/merge --step iter_0000003`` name the step Megatron-LM calls iteration 3."""
    from ckptd.daemon.cli import main

    root, _ = full_run
    name = f"iter_{N:07d}"
    assert main(["ls", root, "--step", name, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["layout"]) for r in rows] == [(N, {"tp": 1, "pp": 1, "dp": 2})]  # saved at
    assert main(["verify", root, "--step", name, "--json"]) == 0
    assert [(r["step"], r["ok"]) for r in json.loads(capsys.readouterr().out)] == [(N, True)]
    assert main(["merge", root, "--step", name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == N
    assert main(["ls", root, "--step", "iter_0000009"]) == 2  # no such step: a typed error, exit code 2
    assert "no step 9" in capsys.readouterr().err


# --- a save lost with its daemon ---------------------------------------------------------------------
def _lost_daemon_run(rank: int, world: int, root: str, sock: str) -> dict[str, Any]:
    """Synchronous saves, then ``--async-save``: in each, a good iteration, one whose daemon is killed after
    staging, and one more (a new embedded daemon)."""
    import logging

    import ckptd.client.megatron.save as cms
    from ckptd.client.client import CheckpointClient
    from ckptd.testing.daemon_kill import kill_after_staging, socket_refuses
    from ckptd.testing.fixtures import wait_for

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptd.client.megatron.megatron_lm").addHandler(handler)
    model, optimizer, train_step, scheduler, fp8 = _setup(seed=1234)
    client = CheckpointClient(sock, root=root, start_daemon=True, timeout_s=60,
                              daemon_args=["--arena-size", "64MiB", "--no-prefault"])  # default on_daemon_lost
    ctx: dict[str, Any] = {}
    iteration, nfp, out = 0, 0.0, []
    for async_save in (False, True):
        args = _args(root, async_save=async_save)
        for kill in (False, True, False):
            caught: dict[int, bool] = {}
            killed: list[int] = []
            while True:
                iteration, nfp, _, _ = _train(iteration, 1, args, train_step, scheduler, fp8, nfp)
                if kill:
                    kill_after_staging(cms, caught, killed)
                handle = save_checkpoint(iteration, model, optimizer, scheduler, nfp, ctx, args=args, client=client)
                maybe_finalize_async_save(blocking=True, checkpointing_context=ctx)  # no raise: training goes on
                if not kill or caught.get(iteration):
                    break
            if killed:  # the next save must not find the dead daemon's socket still accepting for a moment
                wait_for(lambda: socket_refuses(sock) or client._welcome.daemon_pid != killed[0],  # noqa: B023
                         "the killed daemon's socket to refuse, or a new daemon to serve")
            out.append({"async": async_save, "iteration": iteration, "killed": kill, "state": handle.state.name,
                        "tracker": read_tracker(root), "pending": len(ctx["ckptd"].pending)})
    client.close()
    return {"saves": out, "warned": warned}


def test_a_step_lost_with_its_daemon_gets_no_tracker(tmp_path: Path, sockdir: str) -> None:
    import psutil

    from ckptd.writer.format import commit_marker

    root = str(tmp_path / "ck")
    try:
        got = run_ranks(_lost_daemon_run, 1, root, os.path.join(sockdir, "lost.sock"))[0]
    finally:
        left = [p for p in psutil.process_iter(["cmdline"])
                if "serve" in (p.info["cmdline"] or []) and any(sockdir in a for a in p.info["cmdline"] or [])]
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):  # it may have exited by itself since it was listed
                p.terminate()
        psutil.wait_procs(left, timeout=20)
    saves = got["saves"]
    for mode in (False, True):
        good, lost, again = (s for s in saves if s["async"] is mode)
        assert (good["state"], good["tracker"]) == ("COMMITTED", good["iteration"])
        # the lost iteration: FAILED (no raise under on_daemon_lost="warn"), the tracker still names the last
        # committed one, nothing left pending; the next save commits on a new daemon and moves the tracker on
        assert (lost["state"], lost["tracker"], lost["pending"]) == ("FAILED", good["iteration"], 0), lost
        assert (again["state"], again["tracker"]) == ("COMMITTED", again["iteration"]), again
        assert any(f"iteration {lost['iteration']} did not commit" in w for w in got["warned"]), got["warned"]
    committed = [s for s in saves if s["state"] == "COMMITTED"]
    assert [read_commit(root, s["iteration"]).step for s in committed] == [s["iteration"] for s in committed]
    lost_steps = [s["iteration"] for s in saves if s["killed"]]
    assert not any(Path(root, commit_marker(n)).exists() for n in lost_steps)
