"""A load at another TP with another padded vocabulary, as Megatron-LM pads it (to a multiple of
``make_vocab_size_divisible_by`` x TP): the word embeddings and the output layer, whose ShardedTensors say
``allow_shape_mismatch``, have another number of rows.

Megatron's own loader zeroes such a tensor and reads the rows both hold (its optimizer state too). So must
ckptd, from the merged copy and merge-free: every model param, fp32 main param and Adam moment bit for bit
as saved on the rows both hold, the live rows the checkpoint lacks zero (model, main param, moments: a bf16
model's main params equal its zeroed rows), the checkpoint's rows beyond the live vocabulary left out, and
every other param bit for bit. Any other shape difference (a flagged tensor's other axis, a tensor not
flagged) is still refused naming the key, with the live model untouched.

One save spawn writes both checkpoints (fp32 TP1xDP2 with 64 rows; bf16 TP2xDP1 with 128 rows), one load
spawn runs every load (a fresh model and optimizer each, stepped once at other data so that its state is
not zero where the load must zero it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient
from ckptd.client.megatron import load_checkpoint, save_checkpoint
from ckptd.testing.crosscheck import FullStates, compare_runs, full_states, model_space_states, reference
from ckptd.testing.launch import DaemonProcess, socket_dir
from ckptd.testing.toy_gpt import build_gpt, spawn_ranks

pytestmark = pytest.mark.megatron

K = 2
CLI = [sys.executable, "-m", "ckptd.daemon.cli"]
TINY = {"hidden": 32, "layers": 2, "heads": 4, "share_embeddings": False}
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")  # the tensors Megatron pads
SAVES = {"fp32": {"tp": 1, "vocab": 64, **TINY}, "bf16": {"tp": 2, "vocab": 128, "bf16": True, **TINY}}
LOADS = [  # (checkpoint, live build, the live rows)
    ("fp32", {"tp": 2, "vocab": 128, **TINY}, 128),  # TP1 -> TP2, 64 -> 128 rows
    ("fp32", {"tp": 1, "vocab": 128, **TINY}, 128),  # TP1 (DP2) with 128 rows (another vocab setting)
    ("bf16", {"tp": 1, "vocab": 64, "bf16": True, **TINY}, 64),  # TP2 -> TP1 (DP2), 128 -> 64 rows
    ("bf16", {"tp": 2, "vocab": 256, "bf16": True, **TINY}, 256),  # bf16, 128 -> 256 rows
]
CONTROL = {"tp": 2, "vocab": 128, **TINY}  # the fp32 checkpoint at TP2: the rows alone differ, it loads
REFUSED = [  # (live build, the key the refusal names): CONTROL with another difference too
    ({"tp": 2, "vocab": 128, "seq": 32, **TINY}, "embedding.position_embeddings.weight"),  # not flagged
    ({"tp": 2, "vocab": 128, **TINY, "hidden": 48}, "embedding.word_embeddings.weight"),  # flagged, not the rows
]


def _save(rank: int, world: int, sockets: list[str]) -> dict[str, Any]:
    out = {}
    for (name, build), socket in zip(SAVES.items(), sockets, strict=True):
        model, optimizer, train_step = build_gpt(**build)
        for i in range(K):
            train_step(i)
        save_checkpoint(CheckpointClient(socket), K, model, optimizer).wait(60)
        out[name] = model_space_states(model, optimizer)
    return out


def _load(rank: int, world: int, roots: dict[str, tuple[str, str]]) -> dict[str, Any]:
    import logging

    logged: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("ckptd.client.megatron.vocab")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    loads: list[list[Any]] = []
    tp = None
    for saved, build, _rows in LOADS:
        per_root = []
        for path in roots[saved]:  # the merged copy, then the plain root
            model, optimizer, train_step = build_gpt(seed=4321, data_seed=1234, initialize_parallel=build["tp"] != tp,
                                                     **build)
            tp = build["tp"]
            train_step(77)  # a stepped optimizer: its moments are not zero where the load must zero them
            del logged[:]
            try:
                loaded = load_checkpoint(path, K, model, optimizer)
            except Exception as exc:
                per_root.append(f"{type(exc).__name__}: {exc}")
                continue
            per_root.append((loaded.layout, model_space_states(model, optimizer), list(logged)))
        loads.append(per_root)
    refused: list[Any] = []
    model_only: dict[str, Any] = {}
    for build in [CONTROL, *(b for b, _key in REFUSED)]:
        model, optimizer, _train = build_gpt(seed=4321, initialize_parallel=build["tp"] != tp, **build)
        tp = build["tp"]
        if build is CONTROL:  # the model alone first (optimizer=None): this TP rank's rows of each
            del logged[:]
            try:
                model_only = {"layout": load_checkpoint(roots["fp32"][1], K, model, None).layout}
            except Exception as exc:
                model_only = {"layout": f"{type(exc).__name__}: {exc}"}
            params = dict(model[0].module.named_parameters())
            model_only.update({k: params[k].detach().clone() for k in VOCAB})
            model_only["logged"] = list(logged)
        before = [p.detach().clone() for p in model[0].parameters()]
        del logged[:]
        try:
            load_checkpoint(roots["fp32"][1], K, model, optimizer)
            refused.append(None)
        except Exception as exc:
            untouched = all(torch.equal(a, b) for a, b in zip(before, model[0].parameters(), strict=True))
            refused.append((type(exc).__name__, str(exc), untouched and not logged))  # nor said to be loaded
    return {"loads": loads, "refused": refused, "model_only": model_only}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vocab")
    roots = {name: str(tmp / name) for name in SAVES}
    with socket_dir("ckv-") as sockets:
        daemons = [DaemonProcess(root, f"{sockets}/{name}.sock", "--arena-size", "32MiB", "--no-prefault",
                                 log_path=str(tmp / f"{name}.log")).wait_ready() for name, root in roots.items()]
        try:
            saved = spawn_ranks(_save, 2, [d.socket for d in daemons])
        finally:
            for d in daemons:
                d.stop(timeout=20)
    pairs = {}
    for name, root in roots.items():
        merged = root + "-merged"
        shutil.copytree(root, merged)
        subprocess.run([*CLI, "merge", merged, "--json"], check=True, capture_output=True)
        pairs[name] = (merged, root)
    results = spawn_ranks(_load, 2, pairs)
    return {"saved": {name: reference([r[name] for r in saved]) for name in SAVES}, "results": results}


def _assert_fits(saved: FullStates, ranks: list[dict[str, Any]], rows: int, what: str) -> None:
    """``ranks`` hold ``saved`` bit for bit, but for the rows of the :data:`VOCAB` tensors: the rows both
    hold as saved, the live rows beyond the checkpoint's zero (every state)."""
    loaded = full_states(ranks)
    assert loaded.problems == [], (what, loaded.problems[:5])
    rest = [FullStates({k: v for k, v in s.states.items() if k not in VOCAB}, s.scalars) for s in (saved, loaded)]
    compared, differs = compare_runs(*rest)
    assert differs == [], f"{what}: {differs[:10]}"
    assert compared == sum(t.numel() for states in rest[0].states.values() for t in states.values())
    for name in VOCAB:
        old, new = saved.states[name], loaded.states[name]
        assert sorted(new) == sorted(old) == ["exp_avg", "exp_avg_sq", "main", "model"], (what, name)
        n = min(rows, old["model"].shape[0])  # the rows both hold
        for state, value in new.items():
            assert value.shape == (rows, *old[state].shape[1:]) and value.dtype == old[state].dtype, (what, name)
            assert torch.equal(value[:n].view(torch.uint8), old[state][:n].view(torch.uint8)), (what, name, state)
            assert not value[n:].contiguous().view(torch.uint8).any(), f"{what}: {name}/{state} new rows not zero"
        # the new rows' main params are the live model's values there (of a bf16 model too: what it holds, as fp32)
        assert torch.equal(new["main"][n:], new["model"][n:].float()), (what, name)


@pytest.mark.parametrize("case", range(len(LOADS)),
                         ids=["tp1-2_rows64-128", "tp1_rows64-128", "tp2-1_rows128-64_bf16", "tp2_rows128-256_bf16"])
def test_another_padded_vocab_loads_the_rows_both_hold(run: dict[str, Any], case: int) -> None:
    saved, _build, rows = LOADS[case]
    for i, (which, layout) in enumerate((("merged copy", "merged"), ("plain root", "resharded"))):
        per_rank = [r["loads"][case][i] for r in run["results"]]
        assert all(isinstance(p, tuple) for p in per_rank), f"{which}: {per_rank}"
        assert {p[0] for p in per_rank} == {layout}
        _assert_fits(run["saved"][saved], [p[1] for p in per_rank], rows, f"{which}, case {case}")
        grown = rows > SAVES[saved]["vocab"]
        for _layout, _states, logged in per_rank:  # one INFO line naming the refitted tensors, saying what it did
            assert len(logged) == 1 and all(f"model/{k}" in logged[0] for k in VOCAB), logged
            assert ("zeroed and their optimizer state" in logged[0]) == grown, logged
            assert ("left out" in logged[0]) == (not grown), logged


def test_other_shape_differences_are_still_refused(run: dict[str, Any]) -> None:
    for r in run["results"]:
        control, *refused = r["refused"]
        assert control is None, control  # the rows alone differ: it loads
        for (kind, message, untouched), (_build, key) in zip(refused, REFUSED, strict=True):
            assert kind == "StateMismatchError" and message.startswith(f"model/{key}:"), message
            assert untouched, message


def test_the_model_alone_loads_the_rows_both_hold(run: dict[str, Any]) -> None:
    """``optimizer=None`` (finetune, no_load_optim): the fp32 checkpoint's 64 rows at TP2 with 128, 64 a rank."""
    for tp_rank, r in enumerate(run["results"]):
        assert r["model_only"]["layout"] == "model", r["model_only"]["layout"]
        (said,) = r["model_only"]["logged"]
        assert "zeroed (" in said and "optimizer" not in said, said
        for name in VOCAB:
            saved, live = run["saved"]["fp32"].states[name]["model"], r["model_only"][name]
            assert live.shape == (64, 32)
            assert torch.equal(live, saved) if tp_rank == 0 else not live.view(torch.uint8).any(), (tp_rank, name)
