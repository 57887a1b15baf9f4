"""Reshard on read, merge optional: load_checkpoint at another TP, PP, DP or bucket layout reads each
param's optimizer state straight from the stored DP bucket slices through the saved layout sidecars.

Every case loads twice in one set of ranks, each time into a freshly built model and optimizer (another
init): first from a copy of the root that ``ckptd merge`` processed (the merged layout is used), then from
the root without it (the merge-free path). Each load on its own must hold, put back together over its ranks
in model space, exactly the state the saving ranks held at save time: every model param, fp32 main param
and Adam moment bit for bit, and Adam's step (:mod:`ckptd.testing.crosscheck`). Then training continues
from the merge-free load and the losses must match the original run's (bit-exact at the same TP; to
REL_TOL after a TP change, as in test_reshard.py, whose control shows lost optimizer moments move the
second loss far outside it; the control here repeats it for the merge-free path). RNG state and
``_extra_state`` follow the rule of ``ckptd.client.megatron.rank_state`` on both paths: restored from the
saved counterpart where the TP/PP sizes are unchanged (DP rank 0's where that DP rank did not exist), left
as they are with one warning otherwise.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient
from ckptd.client.megatron import get_layout, load_checkpoint, save_checkpoint
from ckptd.testing.crosscheck import assert_loaded_as_saved, model_space_states, reference
from ckptd.testing.te_state import AmaxState
from ckptd.testing.toy_gpt import build_gpt, saved_and_merged, spawn_ranks

pytestmark = pytest.mark.megatron

K, AFTER = 3, 2
REL_TOL = 1e-6
MULTI = {"overlap_grad_reduce": True, "bucket_size": 6000}


def _with_fp8(model: list[torch.nn.Module], value: float) -> AmaxState:
    fp8 = AmaxState(value)
    model[0].module.decoder.add_module("fp8_meta", fp8)
    return fp8


def _rng_digest() -> str:
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode() + repr(np.random.get_state(legacy=True)).encode())
    return h.hexdigest()


def _save(rank: int, world: int, socket: str, build: dict[str, Any]) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(**build)
    _with_fp8(model, 100.0 + rank)  # each saved rank's own extra state
    client = CheckpointClient(socket)
    for i in range(K):
        train_step(i)
    torch.manual_seed(500 + rank)  # each saved rank's own generators
    random.seed(500 + rank)
    np.random.seed(500 + rank)
    rng = _rng_digest()
    save_checkpoint(client, K, model, optimizer, extra={"iteration": K}).wait(60)
    states = model_space_states(model, optimizer)  # what the checkpoint holds of this rank
    return {"rng": rng, "states": states, "losses": [train_step(K + i) for i in range(AFTER)]}


def _digest(model: list[torch.nn.Module], optimizer: Any) -> str:
    """sha256 of every model param, main param and optimizer state tensor of this rank (test_restore.py)."""
    h = hashlib.sha256()
    for chunk in model:
        for name, p in chunk.named_parameters():
            h.update(name.encode() + p.detach().float().numpy().tobytes())
    for opt in optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                h.update(p.detach().numpy().tobytes())
                for key, value in sorted(opt.optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        h.update(key.encode() + value.detach().float().numpy().tobytes())
    return h.hexdigest()


def _load(rank: int, world: int, roots: tuple[str, str], build: dict[str, Any], drop: bool) -> dict[str, Any]:
    import logging

    paths: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if msg.startswith("loaded step"):
                paths.append("merge-free" if "without a merge" in msg else "merged" if "merged" in msg else "dp")

    log = logging.getLogger("ckptd.client.megatron.load")
    log.addHandler(Collect())
    log.setLevel(logging.INFO)
    warned: list[str] = []
    warn = logging.Handler(logging.WARNING)
    warn.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptd.client.megatron.rank_state").addHandler(warn)
    merged, plain = roots
    per_rank = []  # per load: (RNG before, RNG after, amax after)
    layouts = []  # per load: what LoadedCheckpoint.layout says was read
    states = []  # per load: the loaded state in model space
    for path in (merged, plain):  # each into its own new model and optimizer (other init, same data)
        model, optimizer, train_step = build_gpt(seed=4321, data_seed=1234, initialize_parallel=path == merged,
                                                 **build)
        fp8 = _with_fp8(model, -1.0)
        torch.manual_seed(900 + rank)
        random.seed(900 + rank)
        np.random.seed(900 + rank)
        before = _rng_digest()
        loaded = load_checkpoint(path, K, model, optimizer)
        layouts.append(loaded.layout)
        per_rank.append((before, _rng_digest(), float(fp8.amax[0])))
        states.append(model_space_states(model, optimizer))
    if drop:  # control: the right params, but the optimizer's moments zeroed
        for opt in optimizer.chained_optimizers:
            for state in opt.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        value.zero_()
    layout = get_layout(model, optimizer)
    return {"states": states, "extra": loaded.extra, "paths": paths, "layouts": layouts,
            "rank_state": per_rank, "warned": warned, "dp_rank": layout.dp_rank,
            "sizes": (layout.tp_size, layout.pp_size, layout.dp_size),
            "losses": [train_step(K + i) for i in range(AFTER)]}


def _saved(tmp: Path, name: str, world: int, build: dict[str, Any]) -> dict[str, Any]:
    merged, root, saved = saved_and_merged(_save, world, str(tmp), build)
    assert not (Path(root) / "step_3" / "merged").exists()
    return {"roots": (merged, root), "losses": saved[0]["losses"], "rng": [r["rng"] for r in saved],
            "saved": reference([r["states"] for r in saved])}


@pytest.fixture(scope="module")
def tp1dp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _saved(tmp_path_factory.mktemp("tp1dp2"), "a", 2, {"tp": 1, **MULTI})


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _saved(tmp_path_factory.mktemp("tp2pp2"), "b", 4, {"tp": 2, "pp": 2, **MULTI})


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= REL_TOL * abs(y) for x, y in zip(a, b, strict=True))


CASES = [  # (saved, world, build, sizes): the load paths taken are "dp" for a DP change, else merged/merge-free
    ("tp1dp2", 1, {"tp": 1, **MULTI}, (1, 1, 1)),  # DP 2 -> 1
    ("tp1dp2", 4, {"tp": 1, **MULTI}, (1, 1, 4)),  # DP 2 -> 4
    ("tp1dp2", 2, {"tp": 1}, (1, 1, 2)),  # bucket layout changed (one bucket), same TP/PP/DP
    ("tp1dp2", 2, {"tp": 2, **MULTI}, (2, 1, 1)),  # TP 1 -> 2
    ("tp2pp2", 2, {"tp": 2, "pp": 1, **MULTI}, (2, 1, 1)),  # PP 2 -> 1
    ("tp2pp2", 1, {"tp": 1, "pp": 1, **MULTI}, (1, 1, 1)),  # TP 2 -> 1 and PP 2 -> 1
]


@pytest.mark.parametrize(("saved", "world", "build", "sizes"), CASES,
                         ids=["dp2-1", "dp2-4", "buckets", "tp1-2", "pp2-1", "tp2pp2-1"])
def test_load_without_merge_equals_merged_and_resumes(
    request: pytest.FixtureRequest, saved: str, world: int, build: dict[str, Any], sizes: tuple[int, ...]
) -> None:
    run = request.getfixturevalue(saved)
    results = spawn_ranks(_load, world, run["roots"], build, False)
    assert {r["sizes"] for r in results} == {sizes}
    same = saved == "tp1dp2" and build == {"tp": 1, **MULTI}  # only DP changed: the DP layout as saved
    assert {tuple(r["paths"]) for r in results} == {("dp", "dp") if same else ("merged", "merge-free")}
    assert {tuple(r["layouts"]) for r in results} == {("saved", "saved") if same else ("merged", "resharded")}
    for i, which in enumerate(("load of the merged copy", "load of the plain root")):  # each on its own
        assert_loaded_as_saved(run["saved"], [r["states"][i] for r in results], which)
    for r in results:
        assert r["extra"] == {"iteration": K}
        if saved == "tp1dp2" and build["tp"] == 1:  # TP/PP sizes unchanged: the counterpart's RNG and amax
            source = r["dp_rank"] if r["dp_rank"] < 2 else 0  # saved rank = DP rank; DP rank 0 where none
            assert [after for _b, after, _a in r["rank_state"]] == [run["rng"][source]] * 2
            assert [amax for _b, _a, amax in r["rank_state"]] == [100.0 + source] * 2
            assert r["warned"] == []
        else:  # TP or PP size changed: no counterpart, left as they were, one warning for both loads
            assert all(after == before and amax == -1.0 for before, after, amax in r["rank_state"]), r["rank_state"]
            assert len(r["warned"]) == 1 and "no saved rank is this rank's counterpart" in r["warned"][0]
    losses, original = results[0]["losses"], run["losses"]
    assert losses[0] == pytest.approx(original[0], rel=REL_TOL)
    assert _close(losses, original), (losses, original)


def test_control_lost_optimizer_state_is_caught(tp1dp2: dict[str, Any]) -> None:
    results = spawn_ranks(_load, 2, tp1dp2["roots"], {"tp": 1}, True)
    losses, original = results[0]["losses"], tp1dp2["losses"]
    assert abs(losses[1] - original[1]) > 10 * REL_TOL * abs(original[1]), (losses, original)


def test_merged_step_lists_without_warnings(tp1dp2: dict[str, Any]) -> None:
    import warnings

    import zarr

    merged = tp1dp2["roots"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(merged, mode="r")
        members = dict(group.members(max_depth=None))
        assert "step_3/merged" in members and "step_3/merged/_ckptd" in members
        n = sum(1 for v in members.values() if isinstance(v, zarr.Array) and v[...] is not None)
    assert n > 20
    assert json.loads((Path(merged) / "step_3" / "merged" / "zarr.json").read_text())["node_type"] == "group"


@pytest.fixture(scope="module")
def pp3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _saved(tmp_path_factory.mktemp("pp3"), "c", 3, {"pp": 3, "layers": 5, "stage_layers": (1, 2), **MULTI})


def test_the_same_sizes_with_the_layers_split_otherwise_reshard(pp3: dict[str, Any]) -> None:
    """PP3, the 5 layers split 1/2/2 at save and 2/2/1 at load: the middle stage holds as many layers at the same
    bucket offsets, but other ones (layers 2 and 3, not 1 and 2). It took the saved middle stage's optimizer
    state (and its fp32 weights) as its own, without an error; now every stage reads by place in model space."""
    results = spawn_ranks(_load, 3, pp3["roots"], {"pp": 3, "layers": 5, "stage_layers": (2, 1), **MULTI}, False)
    assert {r["sizes"] for r in results} == {(1, 3, 1)}
    assert {tuple(r["layouts"]) for r in results} == {("merged", "resharded")}
    for i, which in enumerate(("load of the merged copy", "load of the plain root")):
        assert_loaded_as_saved(pp3["saved"], [r["states"][i] for r in results], which)
    assert results[0]["losses"] == pp3["losses"]  # the same TP: the model computes exactly as saved
