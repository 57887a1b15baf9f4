"""Megatron checkpoints through ckptd end to end: real daemon processes, real gloo ranks, real megatron-core.

Every rank trains the toy GPT (``ckptd.testing.toy_gpt``, CPU shim), saves with
:func:`save_checkpoint` through a ``ckptd serve`` subprocess, and the state loaded by
:func:`load_checkpoint` into a freshly built model and optimizer is compared with the *live* state at
save time, bit for bit: every model tensor, every main param, every per-param state of the inner
optimizer whatever its name (``exp_avg``, ``exp_avg_sq``, ``step``), the param groups, and the RNGs.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient
from ckptd.client.megatron import (
    LoadedCheckpoint,
    MegatronLayout,
    get_layout,
    load_checkpoint,
    save_checkpoint,
)
from ckptd.client.megatron.layout import cached_plan
from ckptd.client.megatron.model import model_template
from ckptd.client.reader import read_commit, read_sidecar
from ckptd.testing.fixtures import megatron_owned_state
from ckptd.testing.toy_gpt import build_gpt, spawn_ranks, spawn_with_daemon
from ckptd.writer.errors import LayoutMismatchError, StateMismatchError
from ckptd.writer.merge import merge

pytestmark = pytest.mark.megatron

K = 3  # save after K training steps (iterations 0..K-1); the checkpoint's step number is K
AFTER = 2  # then train on for AFTER more steps
MULTIBUCKET = {"overlap_grad_reduce": True, "bucket_size": 6000}


# --- live state of a rank, and bit-exact comparison ------------------------------------------------
def _model_snapshot(model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    from megatron.core.utils import unwrap_model

    sd = unwrap_model(model[0]).state_dict()
    return {k: v.detach().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _optimizer_snapshot(optimizer: Any) -> dict[str, Any]:
    """The live distributed optimizer, as Megatron holds it: per owned param its main shard and every state."""
    from megatron.core.utils import unwrap_model

    out: dict[str, Any] = {}
    for oi, opt in enumerate(optimizer.chained_optimizers):
        names = {p: n for c in opt.model_chunks for n, p in unwrap_model(c).named_parameters()}
        for param, (gi, go) in opt.model_param_group_index_map.items():
            main = opt.optimizer.param_groups[gi]["params"][go]
            entry: dict[str, Any] = {"main": main.detach().clone()}
            for k, v in opt.optimizer.state.get(main, {}).items():
                entry[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
            out[f"{oi}/{names[param]}"] = entry
        out[f"{oi}/param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
    return out


def _rng_snapshot() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.copy()), pos, has_gauss, cached),
    }


def _state_storages(model: list[torch.nn.Module], optimizer: Any) -> dict[str, int]:
    """Per state, the most distinct storages the owned params of one bucket keep it in."""
    from ckptd.client.megatron.layout import bind

    most: dict[str, int] = {}
    for entries in bind(optimizer, get_layout(model, optimizer)).owned.values():
        for name in ("exp_avg", "exp_avg_sq"):
            n = len({o.state[name].untyped_storage().data_ptr() for o in entries})
            most[name] = max(most.get(name, 0), n)
    return most


def _live(model: list[torch.nn.Module], optimizer: Any) -> dict[str, Any]:
    return {"model": _model_snapshot(model), "optim": _optimizer_snapshot(optimizer)}


def _assert_same(a: Any, b: Any, where: str = "") -> int:
    """Bit-exact equality of nested snapshots; returns the number of tensors compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{where} differs"
        return 1
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        return sum(_assert_same(a[k], b[k], f"{where}/{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        return sum(_assert_same(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True)))
    assert a == b, f"{where}: {a!r} vs {b!r}"
    return 0


def _owned_ranges(optimizer: Any) -> dict[str, tuple[tuple[int, int], dict[str, torch.Tensor]]]:
    """Per owned param: its sub-range of the flattened param and the per-element state there (Megatron's view)."""
    return {e["name"]: (e["range"], e["tensors"]) for e in megatron_owned_state(optimizer)}


def _save_plan_of(optimizer: Any) -> Any:
    cached = cached_plan(optimizer)
    assert cached is not None and cached.save is not None
    return cached.save


# --- rank bodies (module level: they run in forked rank processes) -------------------------------
def _train_save_reload(rank: int, world: int, socket: str, root: str, build: dict[str, Any],
                       extra_key_check: bool) -> dict[str, Any]:
    """Train K steps saving at K-1 and K, snapshot the live state at K, train on; then reload into a fresh
    model and optimizer in this process and compare with the snapshot."""
    model, optimizer, train_step = build_gpt(**build)
    client = CheckpointClient(socket)
    losses = [train_step(i) for i in range(K - 1)]
    first = save_checkpoint(client, K - 1, model, optimizer, extra={"iteration": K - 1})
    plan = _save_plan_of(optimizer)
    losses.append(train_step(K - 1))
    first.wait(60)
    random.seed(10 + rank)  # distinct RNG states per rank, so the restore is checked per rank
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)
    extra = {"iteration": K, "scheduler": {"num_steps": K * 8, "lr": [1e-3, 0.5]}, "note": "ckptd"}
    handle = save_checkpoint(client, K, model, optimizer, extra=extra)
    reused = _save_plan_of(optimizer) is plan  # the second save reused the planned shards
    at_save = _live(model, optimizer)
    rng_at_save = _rng_snapshot()
    owned_at_save = _owned_ranges(optimizer)
    after = [train_step(K + i) for i in range(AFTER)]  # overwrites the tensors while the daemon drains
    handle.wait(60)
    final = _model_snapshot(model)
    layout_json = get_layout(model, optimizer).to_json()

    # a fresh model and optimizer (another init), RNG scrambled; then load and compare
    model2, optimizer2, train_step2 = build_gpt(**build, seed=4321, data_seed=build.get("data_seed", 1234))
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    assert len(optimizer2.chained_optimizers[0].optimizer.state) == 0
    loaded = load_checkpoint(root, "latest", model2, optimizer2)
    assert loaded == LoadedCheckpoint(K, extra, rank), loaded
    checked = _assert_same(at_save, _live(model2, optimizer2), f"rank{rank}")
    _assert_same(rng_at_save, _rng_snapshot(), f"rank{rank}/rng")
    steps = [st["step"] for opt in optimizer2.chained_optimizers for st in opt.optimizer.state.values()]
    assert len({id(s) for s in steps}) == len(steps), "one step tensor shared by several params"
    # each bucket slice of a state was read into one tensor whose views became the params' state
    assert _state_storages(model2, optimizer2) == {"exp_avg": 1, "exp_avg_sq": 1}
    resumed = [train_step2(K + i) for i in range(AFTER)]
    assert resumed == after, (resumed, after)

    if extra_key_check:  # the checkpoint has a key this model lacks: refused, nothing overwritten
        model3, optimizer3, train_step3 = build_gpt(**{**build, "share_embeddings": True})
        train_step3(0)
        before = _live(model3, optimizer3)
        with_extra = pytest.raises(StateMismatchError, match=r"model/output_layer\.weight: in checkpoint")
        with with_extra:
            load_checkpoint(root, K, model3, optimizer3)
        _assert_same(before, _live(model3, optimizer3), "untouched")
    return {
        "losses": losses, "after": after, "final": final, "checked": checked, "reused": reused,
        "layout": layout_json, "owned": owned_at_save, "model_at_save": at_save["model"],
    }


def _resume_fresh(rank: int, world: int, root: str, build: dict[str, Any]) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(**build, seed=4321, data_seed=1234)
    loaded = load_checkpoint(root, "latest", model, optimizer)
    assert loaded.step == K
    after = [train_step(loaded.extra["iteration"] + i) for i in range(AFTER)]
    return {"after": after, "final": _model_snapshot(model)}


def _reload_into_replaced_params(rank: int, world: int, root: str, build: dict[str, Any]) -> int:
    """Load twice (the second reuses the model template), then replace two params' ``.data`` and load
    again: the new tensors are filled, not the old ones the kept template viewed."""
    from megatron.core.utils import unwrap_model

    model, optimizer, _train_step = build_gpt(**build, seed=4321, data_seed=1234)
    load_checkpoint(root, K, model, optimizer)
    loaded = _model_snapshot(model)
    first = model_template(model)
    assert all(a is b for a, b in zip(first.values(), model_template(model).values(), strict=True))
    params = dict(unwrap_model(model[0]).named_parameters())
    replaced = ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc2.weight"]
    for name in replaced:
        params[name].data = torch.full_like(params[name], 7.0)
    load_checkpoint(root, K, model, optimizer)
    assert all(not torch.equal(params[n], torch.full_like(params[n], 7.0)) for n in replaced)
    return _assert_same(loaded, _model_snapshot(model), f"rank{rank}")


def _load_other_dp(rank: int, world: int, root: str, build: dict[str, Any]) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(**build, seed=4321, data_seed=1234)
    train_step(0)  # live state exists and must be replaced
    loaded = load_checkpoint(root, K, model, optimizer)
    layout = get_layout(model, optimizer)
    return {
        "step": loaded.step, "dp": (layout.dp_rank, layout.dp_size), "owned": _owned_ranges(optimizer),
        "model": _model_snapshot(model), "loss": train_step(K),
    }


def _load_changed_structure(rank: int, world: int, root: str) -> list[str]:
    messages = []
    # the last: every 1-D param (biases, norms) frozen leaves one param group where two were saved
    for change in ({"share_embeddings": False}, {"ffn_hidden": 96}, {"frozen": ("layernorm", "bias")}):
        model, optimizer, train_step = build_gpt(**MULTIBUCKET, **change)
        train_step(0)
        before = _live(model, optimizer)
        with pytest.raises(StateMismatchError) as err:
            load_checkpoint(root, K, model, optimizer)
        assert not isinstance(err.value, LayoutMismatchError)
        _assert_same(before, _live(model, optimizer), f"untouched after {change}")
        messages.append(str(err.value))
    return messages


def _frozen_then_trainable(rank: int, world: int, socket: str, root: str) -> list[str]:
    """Saved while the final norm was frozen (no optimizer state), loaded where it trains: merge-free, then
    from the merged layout. The rank whose slice holds the norm finds no saved state for it and says so
    before writing anything; the other rank needs none, and is told so before it writes: it raises the same
    error class, naming the rank. Returns each attempt's error, or "" where the load went on."""
    model, optimizer, train_step = build_gpt(**MULTIBUCKET, frozen=("final_layernorm",))
    train_step(0)
    client = CheckpointClient(socket, timeout_s=60)
    save_checkpoint(client, K, model, optimizer).wait(60)
    client.close()
    model2, optimizer2, train_step2 = build_gpt(**MULTIBUCKET, seed=4321)
    train_step2(0)
    out = []
    for merged in (False, True):
        if merged:
            if rank == 0:
                merge(root, K, progress=False)
            torch.distributed.barrier()
        before = _live(model2, optimizer2)
        try:
            load_checkpoint(root, K, model2, optimizer2)
            out.append("")
        except StateMismatchError as exc:
            _assert_same(before, _live(model2, optimizer2), f"untouched ({merged=})")
            out.append(str(exc))
    return out


# --- fixtures ------------------------------------------------------------------------------------
def _run_saving(tmp: Path, sockdir: str, name: str, world: int, build: dict[str, Any],
                extra_key_check: bool = False, daemon_args: tuple[str, ...] = ()) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp / f"root-{name}")
    results = spawn_with_daemon(_train_save_reload, world, root, os.path.join(sockdir, f"{name}.sock"), build,
                                extra_key_check, log_path=str(tmp / f"{name}.log"), daemon_args=daemon_args)
    return root, results


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory, module_sockdir: str) -> dict[str, Any]:
    """TP1 x DP2, a multi-bucket buffer (overlap_grad_reduce): saved at steps K-1 and K, reloaded in-process."""
    root, results = _run_saving(tmp_path_factory.mktemp("megatron"), module_sockdir, "mb", 2, MULTIBUCKET)
    return {"root": root, "results": results}


# --- tests -----------------------------------------------------------------------------------------
def test_multibucket_reload_equals_live_state_and_layouts_are_findable(saved_run: dict[str, Any]) -> None:
    root, results = saved_run["root"], saved_run["results"]
    assert all(r["checked"] > 50 and r["reused"] for r in results)
    commit = read_commit(root, K)
    assert sorted(commit.objects) == ["0", "1"]
    for rank, r in enumerate(results):
        record = commit.objects[str(rank)]["megatron"]
        stored = MegatronLayout.from_json(read_sidecar(root, record["layout"]))
        assert stored == MegatronLayout.from_json(r["layout"])
        assert (record["dp"], record["dp_size"], record["tp_size"], record["pp_size"]) == (rank, 2, 1, 1)
        assert all(len(buf.buckets) >= 2 for buf in stored.buffers)  # really the multi-bucket case
    # the optimizer arrays are the DP layout: one chunk per DP rank of every padded bucket
    optim = [a for a in commit.arrays if a.name.startswith("optim/")]
    assert optim and all(len(a.shards) == 2 and a.chunks[0] * 2 == a.shape[0] for a in optim)
    assert {a.name.rpartition("/")[2] for a in optim} == {"param", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(
    ("world", "build", "extra_key_check"),
    [(2, {"share_embeddings": False}, True), (2, {"bf16": True}, False), (4, {"tp": 2}, False),
     (4, {"pp": 2}, False)],
    ids=["fp32-unshared-dp2", "bf16-dp2", "tp2-dp2", "pp2-dp2"],
)
def test_reload_equals_live_state(tmp_path: Path, module_sockdir: str, world: int, build: dict[str, Any],
                                  extra_key_check: bool) -> None:
    name = f"rt{world}-{len(os.listdir(module_sockdir))}"
    _root, results = _run_saving(tmp_path, module_sockdir, name, world, build, extra_key_check)
    assert all(r["checked"] > 20 and r["reused"] for r in results)
    assert len({tuple(r["after"]) for r in results}) == 1


def test_reload_equals_live_state_with_small_arrays_packed_locally(tmp_path: Path, module_sockdir: str) -> None:
    """``--pack-bytes`` on a local root (docs/configuration.md suggests it for models with many small
    tensors): the arrays one node holds whole are stored as one chunk, and the load reads them bit-exact."""
    name = f"packed-{len(os.listdir(module_sockdir))}"
    root, results = _run_saving(tmp_path, module_sockdir, name, 2, {}, daemon_args=("--pack-bytes", "1MiB"))
    assert all(r["checked"] > 20 and r["reused"] for r in results)
    assert len({tuple(r["after"]) for r in results}) == 1
    model = [a for a in read_commit(root, K).arrays if a.name.startswith("model/")]
    # the layers' stacked params: saved one piece per layer, stored as one chunk only when packed
    stacked = [a for a in model if ".layers." in a.name]
    assert stacked and all(list(a.chunks) == list(a.shape) for a in stacked)


def test_resume_in_fresh_processes_matches_the_uninterrupted_run(saved_run: dict[str, Any]) -> None:
    resumed = spawn_ranks(_resume_fresh, 2, saved_run["root"], MULTIBUCKET)
    for r, ref in zip(resumed, saved_run["results"], strict=True):
        assert r["after"] == ref["after"]  # bit-exact float losses
        _assert_same(ref["final"], r["final"], "final params")


def test_a_reload_fills_params_whose_data_was_replaced(saved_run: dict[str, Any]) -> None:
    assert all(n > 20 for n in spawn_ranks(_reload_into_replaced_params, 2, saved_run["root"], MULTIBUCKET))


@pytest.mark.parametrize("loaded_dp", [1, 4])
def test_dp_change(saved_run: dict[str, Any], loaded_dp: int) -> None:
    """Saved at DP=2, loaded at DP=1 and DP=4: every rank's optimizer slice equals the saved live state."""
    saved = saved_run["results"]
    numel: dict[str, int] = {}
    for r in saved:
        for name, ((_lo, hi), _t) in r["owned"].items():
            numel[name] = max(numel.get(name, 0), hi)
    full: dict[str, dict[str, torch.Tensor]] = {}
    for r in saved:  # the live state at save time, assembled from both DP ranks' owned ranges
        for name, ((lo, hi), tensors) in r["owned"].items():
            for k, v in tensors.items():
                if v.dim():  # per-element state; scalar state (Adam's step) is checked by value below
                    full.setdefault(name, {}).setdefault(k, torch.full((numel[name],), float("nan")))[lo:hi] = v
    loaded = spawn_ranks(_load_other_dp, loaded_dp, saved_run["root"], MULTIBUCKET)
    covered = 0
    for r in loaded:
        assert r["step"] == K and r["dp"][1] == loaded_dp
        _assert_same(saved[0]["model_at_save"], r["model"], "model")
        for name, ((lo, hi), tensors) in r["owned"].items():
            assert {k for k, v in tensors.items() if v.dim()} == set(full[name]) == {"param", "exp_avg", "exp_avg_sq"}
            for k, v in tensors.items():
                if v.dim():
                    _assert_same(full[name][k][lo:hi], v, f"{name}/{k}")
                else:
                    _assert_same(saved[0]["owned"][name][1][k], v, f"{name}/{k}")
            covered += hi - lo
        assert r["loss"] == saved[0]["after"][0]  # the next step is bit-exact at any DP
    assert covered == sum(hi - lo for r in saved for (lo, hi), _t in r["owned"].values())


def test_structure_change_raises_state_mismatch_before_overwriting(saved_run: dict[str, Any]) -> None:
    missing, shape, groups = spawn_ranks(_load_changed_structure, 2, saved_run["root"])[0]
    assert "model/output_layer.weight: not in checkpoint" in missing
    assert "model/decoder.layers.mlp.linear_fc" in shape and "global shape" in shape
    assert "2 saved param groups, 1 live" in groups, groups


def test_param_without_saved_state_raises_before_overwriting(tmp_path: Path, module_sockdir: str) -> None:
    messages = spawn_with_daemon(_frozen_then_trainable, 2, str(tmp_path / "root-frozen"),
                                 os.path.join(module_sockdir, "frozen.sock"), log_path=str(tmp_path / "frozen.log"))
    free, merged = (sorted(attempt, key=lambda m: "refused this load" in m) for attempt in zip(*messages, strict=True))
    assert "no saved optimizer state covers" in free[0] and "final_layernorm" in free[0], free
    assert "the merged checkpoint has no state" in merged[0] and "final_layernorm" in merged[0], merged
    holder = messages.index([free[0], merged[0]])  # the rank whose slice holds the norm, on both paths
    for told in (free[1], merged[1]):  # the other rank wrote nothing either, and says who refused
        assert f"rank {holder} refused this load (StateMismatchError" in told, messages


def test_cpu_shim_is_not_on_the_library_import_path() -> None:
    code = (
        "import sys, ckptd.client.megatron, ckptd.client\n"
        "print(sorted(m for m in sys.modules if m.startswith(('ckptd.daemon', 'megatron'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
