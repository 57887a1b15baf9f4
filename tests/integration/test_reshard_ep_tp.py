"""Expert parallelism with tensor parallelism: a mixture-of-experts GPT (4 experts, allgather dispatcher,
megatron-core on CPU through the shim) saved with TP2 and EP2 loads at another EP and expert-TP (and TP)
from its merged layout and merge-free (straight from the stored DP bucket slices of the dense and expert
buffers): each load, into its own freshly built model and optimizer, holds exactly the state the saving
ranks held, put back together in model space (every model param, fp32 main param and Adam moment bit for
bit; experts by their global index, joined over expert TP: :mod:`ckptd.testing.crosscheck`), and training
continues from the merge-free load with the original run's losses (to REL_TOL: the expert outputs may be
summed in another order). The control loads again, zeroes the optimizer's moments and misses the second
loss.

CI runs a 2-rank case: TP2 with EP2 over the TP ranks (expert-TP 1) -> TP2, EP1, expert-TP 2. The 4-rank
case (TP2 x EP2, expert-TP 2, DP2 -> TP2 x EP1 on 2 ranks and TP1 x EP4 on 4 ranks) is marked slow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient
from ckptd.client.megatron import load_checkpoint, save_checkpoint
from ckptd.testing.crosscheck import assert_loaded_as_saved, model_space_states, reference
from ckptd.testing.toy_gpt import build_gpt, saved_and_merged, spawn_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

K, AFTER = 2, 2
REL_TOL = 1e-6
MOE = {"experts": 4}


def _sizes() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(), ps.get_data_parallel_world_size())


def _save(rank: int, world: int, socket: str, par: dict[str, int]) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(**par, **MOE)
    for i in range(K):
        train_step(i)
    save_checkpoint(CheckpointClient(socket), K, model, optimizer).wait(60)
    states = model_space_states(model, optimizer)  # what the checkpoint holds of this rank
    return {"states": states, "losses": [train_step(K + i) for i in range(AFTER)], "sizes": _sizes()}


def _zero_moments(optimizer: Any) -> None:
    for opt in optimizer.chained_optimizers:
        for state in opt.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value.zero_()


def _load(rank: int, world: int, roots: tuple[str, str], par: dict[str, int]) -> dict[str, Any]:
    states = []  # per load (the merged layout, then merge-free), each into a new model and optimizer
    for i, root in enumerate(roots):
        model, optimizer, train_step = build_gpt(seed=4321, data_seed=1234, initialize_parallel=i == 0, **par, **MOE)
        assert load_checkpoint(root, K, model, optimizer).layout == ("merged", "resharded")[i]
        states.append(model_space_states(model, optimizer))
    plain = roots[1]
    losses = [train_step(K + i) for i in range(AFTER)]
    load_checkpoint(plain, K, model, optimizer)  # control: the right params, the optimizer's moments zeroed
    _zero_moments(optimizer)
    dropped = [train_step(K + i) for i in range(AFTER)]
    return {"states": states, "losses": losses, "dropped": dropped, "sizes": _sizes()}


def _saved(tmp: Path, world: int, par: dict[str, int]) -> dict[str, Any]:
    merged, root, saved = saved_and_merged(_save, world, str(tmp), par)
    return {"roots": (merged, root), "losses": saved[0]["losses"], "sizes": saved[0]["sizes"],
            "saved": reference([r["states"] for r in saved])}


def _check_loads(saved: dict[str, Any], world: int, par: dict[str, int], sizes: tuple[int, ...]) -> None:
    original = saved["losses"]
    experts = [name for name in saved["saved"].states if ".experts.local_experts." in name]
    assert len(experts) == 2 * 4 * 2, experts  # layers x experts x (fc1, fc2), by global expert index
    results = spawn_ranks(_load, world, saved["roots"], par)
    for i, which in enumerate(("load of the merged copy", "load without a merge")):  # each on its own
        assert_loaded_as_saved(saved["saved"], [r["states"][i] for r in results], which)
    for r in results:
        assert r["sizes"] == sizes, r["sizes"]
        assert all(abs(x - y) <= REL_TOL * abs(y) for x, y in zip(r["losses"], original, strict=True)), (
            r["losses"], original)
        assert r["dropped"][0] == pytest.approx(original[0], rel=REL_TOL)  # the params alone give the first loss
        assert abs(r["dropped"][1] - original[1]) > 10 * REL_TOL * abs(original[1]), (r["dropped"], original)


def test_tp2_ep2_over_tp_ranks_loads_at_ep1_etp2(tmp_path: Path) -> None:
    saved = _saved(tmp_path, 2, {"tp": 2, "ep": 2, "etp": 1})
    assert saved["sizes"] == (2, 2, 1, 1)  # (TP, EP, expert TP, DP)
    _check_loads(saved, 2, {"tp": 2, "ep": 1}, (2, 1, 2, 1))


@pytest.fixture(scope="module")
def tp2ep2dp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    saved = _saved(tmp_path_factory.mktemp("tp2ep2"), 4, {"tp": 2, "ep": 2})
    assert saved["sizes"] == (2, 2, 2, 2)
    return saved


@pytest.mark.slow
@pytest.mark.parametrize(("world", "par", "sizes"), [(2, {"tp": 2, "ep": 1}, (2, 1, 2, 1)),
                                                     (4, {"tp": 1, "ep": 4}, (1, 4, 1, 4))],
                         ids=["to-tp2ep1", "to-tp1ep4"])
def test_tp2_ep2_dp2_loads_at_other_ep_and_tp(
    tp2ep2dp2: dict[str, Any], world: int, par: dict[str, int], sizes: tuple[int, ...]
) -> None:
    _check_loads(tp2ep2dp2, world, par, sizes)
