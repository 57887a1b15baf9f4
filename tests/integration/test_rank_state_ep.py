"""Expert parallelism and per-rank state: a mixture-of-experts GPT (4 experts) saved at EP2 DP2 with modules that
keep an ``_extra_state`` on the experts (one per rank on the experts' module, TE-grouped-gemm style, and one per
local expert) loads at EP1 DP2 — same TP/PP/DP sizes, other experts on each rank — without restoring any of it
from the saved rank that held other experts: the load succeeds, the state is left as it is and one warning says
why. The control loads at EP2 and gets each rank's own saved state back."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient
from ckptd.client.megatron import load_checkpoint, save_checkpoint
from ckptd.testing.te_state import AmaxState
from ckptd.testing.toy_gpt import build_gpt, spawn_ranks, spawn_with_daemon

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(240)]

EXPERTS, K = 4, 2
UNSET = -1.0


def _attach(model: list[Any]) -> dict[str, tuple[float, AmaxState]]:
    """Extra-state modules on the experts, valued by what they hold: ``{name: (value, module)}``, where the
    grouped one holds 100 + the EP rank and the per-expert ones (on ``linear_fc1``) their global expert id."""
    from megatron.core import parallel_state as ps

    ep_rank, ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    local = EXPERTS // ep_size
    mods: dict[str, tuple[float, AmaxState]] = {}
    for name, module in model[0].module.named_modules():
        if not name.endswith("mlp.experts"):
            continue
        grouped = AmaxState(100.0 + ep_rank)
        module.add_module("fp8", grouped)
        mods[f"{name}.fp8"] = (100.0 + ep_rank, grouped)
        for i, expert in enumerate(module.local_experts):
            per = AmaxState(float(ep_rank * local + i))
            expert.linear_fc1.get_extra_state = per.get_extra_state
            expert.linear_fc1.set_extra_state = per.set_extra_state
            mods[f"{name}.local_experts.{i}"] = (float(ep_rank * local + i), per)
    return mods


def _save(rank: int, world: int, socket: str, root: str) -> None:
    model, optimizer, train_step = build_gpt(ep=2, experts=EXPERTS)
    _attach(model)
    for i in range(K):
        train_step(i)
    save_checkpoint(CheckpointClient(socket), K, model, optimizer).wait(60)


def _load(rank: int, world: int, root: str, ep: int) -> dict[str, Any]:
    model, optimizer, _ = build_gpt(ep=ep, experts=EXPERTS, seed=77)
    mods = _attach(model)
    for _value, module in mods.values():
        module.amax.fill_(UNSET)
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("ckptd.client.megatron.rank_state").addHandler(Catch())
    load_checkpoint(root, K, model, optimizer)
    return {"amax": {n: (value, float(m.amax[0])) for n, (value, m) in mods.items()}, "warnings": warnings}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, module_sockdir: str) -> str:
    tmp: Path = tmp_path_factory.mktemp("ep2-extra")
    root = str(tmp / "ckpt")
    spawn_with_daemon(_save, 2, root, f"{module_sockdir}/ep-extra.sock", log_path=str(tmp / "daemon.log"))
    return root


def test_ep_change_leaves_extra_state(saved: str) -> None:
    for r in spawn_ranks(_load, 2, saved, 1):  # EP1 DP2: each rank holds experts 0-3
        assert r["amax"] and all(now == UNSET for _, now in r["amax"].values()), r["amax"]
        assert [w for w in r["warnings"] if "EP/ETP" in w and "_extra_state are left as they are" in w], r["warnings"]


def test_same_ep_restores_extra_state(saved: str) -> None:
    for r in spawn_ranks(_load, 2, saved, 2):  # the control: EP2 DP2, each rank its own saved state
        assert r["amax"] and all(now == value for value, now in r["amax"].values()), r["amax"]
        assert not r["warnings"], r["warnings"]
