"""Megatron integration against live megatron-core on CPU: layout, merge formula, model shards, round trips.

Every test runs real gloo ranks (2-4 processes) training a tiny GPTModel with DistributedDataParallel
and DistributedOptimizer through the CPU shim. References come from Megatron's own bookkeeping
(``DistributedOptimizer._get_model_param_range_map`` / ``_get_main_param_and_optimizer_states``), not
from the code under test.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client.megatron import (
    MAIN_PARAM,
    OPTIM_META,
    MegatronLayout,
    apply_optimizer_state,
    get_layout,
    model_state,
    optimizer_meta,
    optimizer_read_regions,
    optimizer_shards,
    view_of,
)
from ckptd.client.state import Shard, plan_state
from ckptd.testing.fixtures import megatron_owned_state
from ckptd.testing.toy_gpt import RankFailedError, build_gpt, spawn_ranks

pytestmark = pytest.mark.megatron

STATES = (MAIN_PARAM, "exp_avg", "exp_avg_sq")

CASES: dict[str, dict[str, Any]] = {
    "fp32-dp2": {"world": 2, "build": {}},
    "bf16-dp2": {"world": 2, "build": {"bf16": True}},
    "multibucket-dp2": {"world": 2, "build": {"overlap_grad_reduce": True, "bucket_size": 6000}},
    "tp2-dp2": {"world": 4, "build": {"tp": 2}},
    "pp2-dp2": {"world": 4, "build": {"pp": 2}},
}


# --- rank-side helpers (run inside the spawned processes) ----------------------------------------------
def _shards(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "key": s.key,
            "global_shape": s.global_shape,
            "global_offset": s.global_offset,
            "chunk_shape": s.chunk_shape,
            "main": s.is_main_replica,
            "data": s.data.detach().clone(),
        }
        for s in state.values()
        if isinstance(s, Shard)
    ]


def _materialized(optimizer: Any, layout: MegatronLayout) -> dict[str, Shard]:
    """The save path's bucket-slice shards (optimizer_shards), each staged into a real tensor."""
    return {
        k: Shard(s.key, s.materialize(), s.global_shape, s.global_offset, s.replica_id, s.chunk_shape)
        for k, s in optimizer_shards(optimizer, layout).items()
    }


def _layout_rank(rank: int, world: int, build: dict[str, Any]) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(**build)
    for it in range(2):
        train_step(it)
    layout = get_layout(model, optimizer)
    assert get_layout(model, optimizer) is layout  # cached
    assert MegatronLayout.from_json(layout.to_json()) == layout
    shards = optimizer_shards(optimizer, layout)
    # the shards hold no memory (a zero-stride placeholder): each stages its slice from the live optimizer,
    # writing every element of the slot (params and padding), so a dirty staging slot cannot leak through
    assert all(s.data.stride() == (0,) for s in shards.values())
    for s in shards.values():
        slot = torch.full(s.data.shape, float("nan"), dtype=s.data.dtype)
        s.stage_into(slot)
        assert torch.equal(slot, s.materialize()), s.key
    opt = _materialized(optimizer, layout)
    again = _materialized(optimizer, layout)
    assert all(torch.equal(opt[k].data, again[k].data) for k in opt)
    return {
        "layout": layout.to_json(),
        "optim": _shards(opt),
        "meta": optimizer_meta(optimizer, layout),
        "model": _shards(model_state(model, min_split_bytes=0)),
        "reference": megatron_owned_state(optimizer, layout),
    }


# --- parent-side helpers ---------------------------------------------------------------------------
def _assemble(shards: list[dict[str, Any]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Place main-replica shards into full arrays; also count how often each element was written."""
    arrays: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for s in shards:
        if not s["main"]:
            continue
        if s["key"] not in arrays:
            arrays[s["key"]] = (
                torch.zeros(s["global_shape"], dtype=s["data"].dtype),
                torch.zeros(s["global_shape"], dtype=torch.int32),
            )
        full, count = arrays[s["key"]]
        assert tuple(full.shape) == tuple(s["global_shape"]), s["key"]
        region = tuple(slice(o, o + n) for o, n in zip(s["global_offset"], s["data"].shape, strict=True))
        full[region] = s["data"]
        count[region] += 1
    return arrays


def _reference_param_state(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """Full flattened per-param state, assembled from every DP rank's Megatron-owned sub-ranges."""
    pieces: dict[tuple[str, str], list[tuple[tuple[int, int], dict[str, torch.Tensor]]]] = {}
    for r in results:
        for e in r["reference"]:
            pieces.setdefault((e["mp"], e["name"]), []).append((e["range"], e["tensors"]))
    out = {}
    for pid, items in pieces.items():
        numel = max(hi for (_lo, hi), _t in items)
        full = {k: torch.zeros(numel, dtype=torch.float32) for k in STATES}
        count = torch.zeros(numel, dtype=torch.int32)
        for (lo, hi), tensors in items:
            for k in STATES:
                full[k][lo:hi] = tensors[k]
            count[lo:hi] += 1
        assert bool((count == 1).all()), f"{pid}: Megatron's DP sub-ranges do not tile the param"
        out[pid] = full
    return out


# --- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_layout_merge_formula_matches_live_optimizer(case: str) -> None:
    """bucket_full[start - bucket_start : end - bucket_start] is the live state of every param, bit-exact."""
    cfg = CASES[case]
    results = spawn_ranks(_layout_rank, cfg["world"], cfg["build"])
    layouts = [MegatronLayout.from_json(r["layout"]) for r in results]
    optim = _assemble([s for r in results for s in r["optim"]])
    model = _assemble([s for r in results for s in r["model"]])
    reference = _reference_param_state(results)
    bf16 = bool(cfg["build"].get("bf16"))

    # BRIEF section 4 buffer facts, checked on the installed megatron-core
    for layout in layouts:
        assert layout.dp_size * layout.tp_size * layout.pp_size == cfg["world"]
        for buf, bucket in layout.buckets():
            assert bucket.padded_numel % math.lcm(buf.dp_size, 128) == 0
            assert bucket.start % math.lcm(buf.dp_size, 128) == 0
            assert bucket.params and all(p.start % 64 == 0 for p in bucket.params)
            assert bucket.numel_unpadded == bucket.params[-1].end - bucket.start
    if case.startswith(("multibucket", "pp2")):  # pp2: the shared embedding gets a bucket of its own
        assert all(len(buf.buckets) >= 2 for layout in layouts for buf in layout.buffers)

    # every DP rank wrote one whole chunk of each padded bucket: the arrays are complete
    for r, layout in zip(results, layouts, strict=True):
        for s in r["optim"]:
            (p,) = s["global_shape"]
            assert s["chunk_shape"] == (p // layout.dp_size,)
            assert s["global_offset"] == (layout.dp_rank * p // layout.dp_size,)
    for key, (_full, count) in optim.items():
        assert bool((count == 1).all()), f"{key}: DP slices do not tile the padded bucket"

    checked = 0
    for layout in (lay for lay in layouts if lay.dp_rank == 0):
        mp = f"tp{layout.tp_rank}.pp{layout.pp_rank}"
        for buf, bucket in layout.buckets():
            fulls = {k: optim[layout.bucket_key(buf, bucket, k)][0] for k in STATES}
            covered = torch.zeros(bucket.padded_numel, dtype=torch.bool)
            for p in bucket.params:
                lo, hi = p.start - bucket.start, p.end - bucket.start
                covered[lo:hi] = True
                ref = reference[(mp, p.name)]
                for k in STATES:
                    assert torch.equal(fulls[k][lo:hi], ref[k]), f"{case} {p.name} {k}"
                # merge into model space with the layout's pieces; compare with the model arrays
                main = fulls[MAIN_PARAM][lo:hi].view(p.shape)
                assert p.model_pieces, p.name
                for piece in p.model_pieces:
                    view = view_of(piece, main)
                    region = piece.region()
                    stored, _ = model[layout.model_key(piece.key)]
                    want = view.to(torch.bfloat16) if bf16 else view
                    assert torch.equal(stored[region].reshape(piece.view_shape), want), (case, piece.key)
                checked += 1
            for k in STATES:  # padding gaps are zero
                assert not bool(fulls[k][~covered].any()), f"{case}: nonzero padding in {k}"
    assert checked == len(reference)

    # plain data: param groups without params, one step count for all params
    for r in results:
        (entry,) = r["meta"]["optimizers"].values()
        assert all("params" not in g for g in entry["param_groups"])
        assert entry["scalar_state"]["step"] == {"dtype": "float32", "value": 2.0}


def _model_rank(rank: int, world: int, min_split_bytes: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    model, optimizer, train_step = build_gpt(tp=1)
    train_step(0)
    state = model_state(model, min_split_bytes=min_split_bytes)
    plan = plan_state({"model": state}, rank)
    full = {}
    if ps.get_data_parallel_rank() == 0:  # full (unsplit) model tensors, for the reference
        full = {k: v for k, v in unwrap_model(model[0]).state_dict().items() if isinstance(v, torch.Tensor)}
    return {
        "shards": _shards(state),
        "staged": plan.nbytes,
        "params": {n: p.detach().clone() for n, p in unwrap_model(model[0]).named_parameters()},
        "layout": get_layout(model, optimizer).to_json(),
        "full": full,
    }


def test_model_state_tiles_every_param_once_with_dp_split() -> None:
    results = spawn_ranks(_model_rank, 2, 0)
    arrays = _assemble([s for r in results for s in r["shards"]])
    for key, (_full, count) in arrays.items():
        assert bool((count == 1).all()), f"{key}: main-replica regions do not tile the array exactly once"
    # each DP rank stages about half of the model: replicated tensors were split
    total = sum(r["staged"] for r in results)
    assert max(r["staged"] for r in results) <= total * 0.55
    assert all(r["staged"] > 0 for r in results)
    # every model param is in the arrays, at the place the layout says, with its value
    layout = MegatronLayout.from_json(results[0]["layout"])
    params = results[0]["params"]
    seen = set()
    for _buf, bucket in layout.buckets():
        for p in bucket.params:
            seen.add(p.name)
            for piece in p.model_pieces:
                view = view_of(piece, params[p.name])
                region = piece.region()
                stored, _ = arrays[layout.model_key(piece.key)]
                assert torch.equal(stored[region].reshape(piece.view_shape), view), piece.key
    assert seen == set(params)

    # with the default threshold the tiny model is not split: DP rank 0 stages everything
    results = spawn_ranks(_model_rank, 2, 1 << 20)
    assert results[1]["staged"] == 0 and results[0]["staged"] > 0


def _round_trip_rank(rank: int, world: int, build: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.utils import unwrap_model

    model, optimizer, train_step = build_gpt(**build)
    for it in range(3):
        train_step(it)
    layout = get_layout(model, optimizer)
    saved: dict[str, Any] = {k: v.data for k, v in _materialized(optimizer, layout).items()}
    saved[OPTIM_META] = optimizer_meta(optimizer, layout)
    weights = {k: v.clone() for k, v in unwrap_model(model[0]).state_dict().items() if isinstance(v, torch.Tensor)}
    expected = [train_step(3), train_step(4)]

    # a fresh model and optimizer (other init seed, same data), then load and continue
    model2, optimizer2, train_step2 = build_gpt(**build, seed=4321, data_seed=1234)
    inner = optimizer2.chained_optimizers[0].optimizer
    assert len(inner.state) == 0  # no optimizer state yet: apply must allocate it
    unwrap_model(model2[0]).load_state_dict(weights, strict=False)
    apply_optimizer_state(optimizer2, get_layout(model2, optimizer2), saved)
    steps = [st["step"] for st in inner.state.values()]
    assert len({id(s) for s in steps}) == len(steps) and all(float(s) == 3.0 for s in steps)
    got = [train_step2(3), train_step2(4)]
    return {"expected": expected, "got": got}


@pytest.mark.parametrize(
    "build",
    [{}, {"bf16": True, "overlap_grad_reduce": True, "bucket_size": 6000}, {"pp": 2}],
    ids=["fp32-dp2", "bf16-multibucket-dp2", "pp2-dp1"],
)
def test_round_trip_in_memory_reproduces_next_losses(build: dict[str, Any]) -> None:
    for r in spawn_ranks(_round_trip_rank, 2, build):
        assert r["got"] == r["expected"]  # bit-exact floats


def _save_rank(rank: int, world: int, out: str, build: dict[str, Any]) -> float:
    from megatron.core.utils import unwrap_model

    model, optimizer, train_step = build_gpt(**build)
    for it in range(3):
        train_step(it)
    layout = get_layout(model, optimizer)
    record = {
        "optim": _shards(_materialized(optimizer, layout)),
        "meta": optimizer_meta(optimizer, layout),
        "reference": megatron_owned_state(optimizer, layout),
    }
    if rank == 0:
        record["weights"] = {
            k: v.clone() for k, v in unwrap_model(model[0]).state_dict().items() if isinstance(v, torch.Tensor)
        }
    torch.save(record, Path(out) / f"rank{rank}.pt")
    return train_step(3)


def _load_rank(rank: int, world: int, out: str, saved_world: int, build: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.utils import unwrap_model

    records = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(saved_world)]
    arrays = _assemble([s for rec in records for s in rec["optim"]])  # what the store holds
    model, optimizer, train_step = build_gpt(**build, seed=4321, data_seed=1234)
    unwrap_model(model[0]).load_state_dict(records[0]["weights"], strict=False)
    layout = get_layout(model, optimizer)
    slices: dict[str, Any] = {OPTIM_META: [rec["meta"] for rec in records]}
    clipped = 0
    for prefix, (start, stop) in optimizer_read_regions(layout).items():
        keys = [k for k in arrays if k.startswith(prefix)]
        assert {k[len(prefix) :] for k in keys} == set(STATES)
        for k in keys:
            stored = arrays[k][0]
            clipped += stop > stored.numel()
            slices[k] = stored[start : min(stop, stored.numel())]
    apply_optimizer_state(optimizer, layout, slices)
    reference = _reference_param_state(records)
    mine = megatron_owned_state(optimizer, layout)
    for e in mine:
        lo, hi = e["range"]
        ref = reference[(e["mp"], e["name"])]
        for k in STATES:
            assert torch.equal(e["tensors"][k], ref[k][lo:hi]), (e["name"], k)
        assert float(e["tensors"]["step"]) == 3.0
    return {"loss": train_step(3), "owned": len(mine), "clipped": clipped}


@pytest.mark.parametrize(("saved_dp", "loaded_dp"), [(2, 1), (2, 3)])
def test_round_trip_changes_dp(tmp_path: Path, saved_dp: int, loaded_dp: int) -> None:
    """Slices saved at one DP load at another (same TP/PP); the next loss is bit-exact."""
    build = {"overlap_grad_reduce": True, "bucket_size": 6000, "global_microbatches": 6}
    expected = spawn_ranks(_save_rank, saved_dp, str(tmp_path), build)
    assert len(set(expected)) == 1
    loaded = spawn_ranks(_load_rank, loaded_dp, str(tmp_path), saved_dp, build)
    assert all(r["loss"] == expected[0] for r in loaded)
    assert sum(r["owned"] for r in loaded) >= 1
    if loaded_dp == 3:  # padding grows from lcm(2,128) to lcm(3,128): the last rank reads past the stored end
        assert any(r["clipped"] for r in loaded)


def _shim_rank(rank: int, world: int) -> dict[str, Any]:
    from ckptd.testing.cpu_shim import install_cpu_shim

    install_cpu_shim()
    install_cpu_shim()  # idempotent
    t = torch.ones(3, device="cuda")
    return {
        "device": str(t.device),
        "moved": str(torch.zeros(2).cuda().device),
        "to": str(torch.zeros(2).to("cuda:0").device),
        "type": t.type(),
        "bf16_type": t.bfloat16().type(),
        "current_device": torch.cuda.current_device(),
        "stream_is_class": isinstance(torch.cuda.Stream(), torch.cuda.Stream),  # type: ignore[no-untyped-call]
    }


def _failing_rank(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def test_cpu_shim_and_launcher() -> None:
    (r,) = spawn_ranks(_shim_rank, 1)
    assert r == {
        "device": "cpu",
        "moved": "cpu",
        "to": "cpu",
        "type": "torch.cuda.FloatTensor",
        "bf16_type": "torch.cuda.BFloat16Tensor",
        "current_device": 0,
        "stream_is_class": True,
    }
    with pytest.raises(RankFailedError, match=r"(?s)in _failing_rank.*ValueError: rank one refuses"):
        spawn_ranks(_failing_rank, 2)
