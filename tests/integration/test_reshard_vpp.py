"""Virtual pipeline parallelism (the interleaved schedule: several model chunks per pipeline rank, megatron-core's
``virtual_pipeline_model_parallel_size``): a step saved at PP2 x VPP2 loads at the same layout, at PP2 without
VPP and at PP1, each merge-free and from a ``ckptd merge``d copy, holding exactly the state the saving ranks
held (every model param, fp32 main param, Adam moment bit for bit, and Adam's step: :mod:`ckptd.testing.crosscheck`),
and the next step's loss is the saved run's, bit for bit (the same TP: the same arithmetic per layer).

Each layer carries a stand-in for Transformer Engine's per-layer ``_extra_state`` (its value: 1000 + the layer's
global number at save). ckptd stores it by model chunk and local module name, which names another layer once the
layers sit otherwise in the chunks: at the saved layout it comes back to its own layer; at PP2 without VPP (the
same TP/PP sizes: RNG state still from the counterpart) and at PP1 (no counterpart) it is left as it is. Before
the record said which layers each chunk held, PP2 x VPP2 -> PP2 refused the load (``0/decoder.layers.1.fp8_meta.
_extra_state: the module has extra state, the checkpoint none``), and a name both layouts have would have taken
another layer's state.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient
from ckptd.client.megatron import load_checkpoint, save_checkpoint
from ckptd.testing.crosscheck import assert_loaded_as_saved, model_space_states, reference
from ckptd.testing.launch import DaemonProcess, socket_dir
from ckptd.testing.te_state import AmaxState
from ckptd.testing.toy_gpt import build_gpt, saved_and_merged, spawn_ranks

pytestmark = pytest.mark.megatron

K = 2
CLI = [sys.executable, "-m", "ckptd.daemon.cli"]
SMALL: dict[str, Any] = {"hidden": 32, "heads": 2, "vocab": 64, "seq": 8, "layers": 4}
VPP: dict[str, Any] = {"pp": 2, "vpp": 2, **SMALL}


def _layers(chunk: Any) -> list[Any]:
    return list(chunk.module.decoder.layers)


def _metas(model: list[torch.nn.Module], saving: bool) -> list[tuple[int, AmaxState]]:
    out = []
    for chunk in model:
        for layer in _layers(chunk):
            meta = AmaxState(1000.0 + layer.layer_number if saving else -1.0)
            layer.add_module("fp8_meta", meta)
            out.append((layer.layer_number, meta))
    return out


def _save(rank: int, world: int, socket: str) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(**VPP)
    assert len(model) == 2
    _metas(model, True)
    for i in range(K):
        train_step(i)
    save_checkpoint(CheckpointClient(socket), K, model, optimizer, extra={"iteration": K}).wait(60)
    return {"states": model_space_states(model, optimizer), "next": train_step(K),
            "layers": [[layer.layer_number for layer in _layers(c)] for c in model]}


def _load(rank: int, world: int, roots: tuple[str, str], build: dict[str, Any]) -> dict[str, Any]:
    warned: list[str] = []
    warn = logging.Handler(logging.WARNING)
    warn.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptd.client.megatron.rank_state").addHandler(warn)
    loads = []
    for path in roots:  # each into its own new model and optimizer (other init, same data)
        model, optimizer, train_step = build_gpt(seed=4321, data_seed=1234, **build)
        metas = _metas(model, False)
        loaded = load_checkpoint(path, K, model, optimizer)
        loads.append({"states": model_space_states(model, optimizer), "layout": loaded.layout,
                      "extra": loaded.extra, "metas": [(n, float(m.amax[0])) for n, m in metas],
                      "next": train_step(K)})
    return {"loads": loads, "warned": warned, "chunks": len(model)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vpp")
    merged, root, results = saved_and_merged(_save, 2, str(tmp))
    assert [r["layers"] for r in results] == [[[1], [3]], [[2], [4]]]  # interleaved: chunk v of rank p
    return {"roots": (merged, root), "saved": reference([r["states"] for r in results]), "next": results[0]["next"]}


CASES = [  # (world, build, chunks per rank, layouts read (merged copy, plain root), extra state back)
    (2, VPP, 2, ("saved", "saved"), True),  # the saved layout
    (2, {"pp": 2, **SMALL}, 1, ("merged", "resharded"), False),  # the same TP/PP sizes without VPP
    (1, {"pp": 1, **SMALL}, 1, ("merged", "resharded"), False),  # PP1
]


@pytest.mark.parametrize(("world", "build", "chunks", "layouts", "restored"), CASES, ids=["same", "pp2", "pp1"])
def test_vpp_save_loads_as_saved(
    saved: dict[str, Any], world: int, build: dict[str, Any], chunks: int, layouts: tuple[str, str], restored: bool
) -> None:
    results = spawn_ranks(_load, world, saved["roots"], build)
    assert {r["chunks"] for r in results} == {chunks}
    for i, which in enumerate(("load of the merged copy", "load of the plain root")):  # each on its own
        loads = [r["loads"][i] for r in results]
        assert {load["layout"] for load in loads} == {layouts[i]}
        assert_loaded_as_saved(saved["saved"], [load["states"] for load in loads], which)
        assert {load["next"] for load in loads} == {saved["next"]}
        for load in loads:
            assert load["extra"] == {"iteration": K}
            assert load["metas"] == [(n, 1000.0 + n if restored else -1.0) for n, _v in load["metas"]], which
    for r in results:
        if restored:
            assert r["warned"] == []
        elif build["pp"] == 2:  # a counterpart, but its chunks held other layers
            assert len(r["warned"]) == 1 and "_extra_state is left as it is" in r["warned"][0], r["warned"]
        else:
            assert len(r["warned"]) == 1 and "no saved rank is this rank's counterpart" in r["warned"][0]


def test_pp1_save_loads_at_pp2_vpp2(tmp_path: Path) -> None:
    """The other way: saved without VPP (PP1), loaded into interleaved chunks."""
    build = {"pp": 1, **SMALL}

    root = str(tmp_path / "plain")
    with socket_dir("ckw-") as sockets:
        daemon = DaemonProcess(root, f"{sockets}/d.sock", "--arena-size", "64MiB", "--no-prefault",
                               log_path=str(tmp_path / "daemon.log")).wait_ready()
        try:
            results = spawn_ranks(_save_plain, 1, daemon.socket, build)
        finally:
            daemon.stop(timeout=20)
    merged = str(tmp_path / "merged")
    shutil.copytree(root, merged)
    subprocess.run([*CLI, "merge", merged, "--json"], check=True, capture_output=True)
    loaded = spawn_ranks(_load, 2, (merged, root), VPP)
    for i, which in enumerate(("load of the merged copy", "load of the plain root")):
        loads = [r["loads"][i] for r in loaded]
        assert {load["layout"] for load in loads} == {("merged", "resharded")[i]}
        assert_loaded_as_saved(reference([results[0]["states"]]), [load["states"] for load in loads], which)
        assert {load["next"] for load in loads} == {results[0]["next"]}


def _save_plain(rank: int, world: int, socket: str, build: dict[str, Any]) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(**build)
    for i in range(K):
        train_step(i)
    save_checkpoint(CheckpointClient(socket), K, model, optimizer).wait(60)
    return {"states": model_space_states(model, optimizer), "next": train_step(K)}
