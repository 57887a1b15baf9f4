"""Expert parallelism: a mixture-of-experts GPT (4 experts, allgather dispatcher, megatron-core on CPU through
the shim) saved at EP2 loads merge-free at EP1 (experts gathered on one rank, DP 2 -> 1) and at EP1 with
DP 2 (the experts' DP group grows from 1 to 2), straight from the stored DP bucket slices of the expert and
dense buffers, and from the merged layout of a merged copy: each load, into its own freshly built model and
optimizer, holds exactly the state the saving ranks held, put back together in model space (every model
param, fp32 main param and Adam moment bit for bit, experts by their global index:
:mod:`ckptd.testing.crosscheck`); training then continues from the merge-free load with the original run's
losses (to REL_TOL: the expert outputs may be summed in another order). The control drops the optimizer
moments after the same load and misses them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient
from ckptd.client.megatron import get_layout, load_checkpoint, save_checkpoint
from ckptd.testing.crosscheck import FullStates, assert_loaded_as_saved, model_space_states, reference
from ckptd.testing.toy_gpt import build_gpt, saved_and_merged, spawn_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(240)]

K, AFTER = 2, 2
REL_TOL = 1e-6
MOE = {"experts": 4}


def _save(rank: int, world: int, socket: str) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(ep=2, **MOE)
    for i in range(K):
        train_step(i)
    save_checkpoint(CheckpointClient(socket), K, model, optimizer).wait(60)
    states = model_space_states(model, optimizer)  # what the checkpoint holds of this rank
    return {"states": states, "losses": [train_step(K + i) for i in range(AFTER)]}


def _load(rank: int, world: int, roots: tuple[str, str], drop: bool) -> dict[str, Any]:
    states = []  # per load (the merged layout, then merge-free), each into a new model and optimizer
    for i, root in enumerate(roots):
        model, optimizer, train_step = build_gpt(ep=1, seed=4321, data_seed=1234, initialize_parallel=i == 0, **MOE)
        assert load_checkpoint(root, K, model, optimizer).layout == ("merged", "resharded")[i]
        states.append(model_space_states(model, optimizer))
    if drop:  # control: the right params, the optimizer's moments zeroed
        for opt in optimizer.chained_optimizers:
            for state in opt.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        value.zero_()
    experts = sum(p.numel() for name, p in model[0].named_parameters() if ".experts." in name)
    return {"losses": [train_step(K + i) for i in range(AFTER)], "experts": experts, "states": states,
            "dp": get_layout(model, optimizer).dp_size}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[str, str], list[float], FullStates]:
    merged, root, ranks = saved_and_merged(_save, 2, str(tmp_path_factory.mktemp("ep2")))
    return (merged, root), ranks[0]["losses"], reference([r["states"] for r in ranks])


@pytest.mark.parametrize("world", [1, 2], ids=["ep2-1", "ep2-1-expert-dp2"])
def test_expert_parallel_load_without_merge(
    saved: tuple[tuple[str, str], list[float], FullStates], world: int
) -> None:
    roots, original, states = saved
    assert sum(".experts.local_experts." in name for name in states.states) == 2 * 4 * 2  # layers, experts, fc1/2
    results = spawn_ranks(_load, world, roots, False)
    for i, which in enumerate(("load of the merged copy", "load without a merge")):  # each on its own
        assert_loaded_as_saved(states, [r["states"][i] for r in results], which)
    for r in results:
        assert r["dp"] == world and r["experts"] == 4 * 2 * 2 * 64 * 128 * 3 // 2, r  # all 4 experts on each rank
        assert all(abs(x - y) <= REL_TOL * abs(y) for x, y in zip(r["losses"], original, strict=True)), (
            r["losses"], original)
    if world > 1:
        return
    dropped = spawn_ranks(_load, world, roots, True)[0]["losses"]
    assert abs(dropped[1] - original[1]) > 10 * REL_TOL * abs(original[1]), (dropped, original)
