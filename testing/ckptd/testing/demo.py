"""``ckptd demo``: the whole job on one machine, for real.

1. starts ``ckptd serve`` as its own process (socket in a private temporary directory);
2. launches gloo ranks (4 by default: TP2 x DP2) that train a small Megatron GPT with the distributed
   optimizer (through the CPU shim when there is no GPU) and save with
   :func:`ckptd.client.megatron.save_checkpoint` every ``save_every`` steps while they keep training:
   a rank waits for its previous save only right before the next one;
3. reloads the latest committed step into fresh rank processes (new model, new optimizer, another
   init seed) and compares the model and the optimizer state bit for bit with digests each rank took
   of its live state right after its last save returned;
4. reloads that step at another layout (TP2 x DP2 -> TP1 x DP4; TP1 -> TP2) straight from the stored DP
   bucket slices, no merge, and compares every param's optimizer state (fp32 main param, Adam's moments
   and step) in model space with what the saving ranks held, byte for byte (:mod:`.crosscheck`);
5. merges the step offline (what ``ckptd merge`` does), reloads it at that other layout again, now from the
   merged layout, and compares the same way;
6. re-reads every chunk of that step, the merged layout's included, against its crc32c (what
   ``ckptd verify`` does) and prints a summary (or one JSON object with ``--json``).

Why TP2 x DP2 for 4 ranks: it exercises both halves of the format at once — model tensors split over
tensor parallelism and written in model space by their owners, and optimizer state in the DP layout
(each DP rank writing its own contiguous bucket slices), with DP-replicated tensors split between DP
ranks. TP1 x DP4 would leave the model-space sharding untested. Other rank counts fall back to TP1.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import msgspec

from ckptd.testing.crosscheck import compare_runs, full_states, param_states
from ckptd.testing.launch import DaemonProcess, run_ranks
from ckptd.writer.errors import InvalidRequestError
from ckptd.writer.merge import merge

# a root holding this file was made by the demo and may be emptied by it: in the control folder, which zarr
# reads as an (empty) array, so that zarr lists nothing it does not know; roots of earlier demos hold the old one
MARKER = "_ckptd/demo"
OLD_MARKER = ".ckptd-demo"
MODEL = {"hidden": 128, "layers": 4, "vocab": 512, "seq": 32, "heads": 4}
ARENA = "256MiB"


# --- ranks (module level: run in forked rank processes) ----------------------------------------------
def state_digests(model: list[Any], optimizer: Any) -> dict[str, str]:
    """sha256 of every model tensor and of every live optimizer tensor/value this rank holds."""
    import torch
    from megatron.core.utils import unwrap_model

    def digest(t: torch.Tensor) -> str:
        t = t.detach().contiguous().reshape(-1).cpu()
        return f"{t.dtype}:{hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()}"

    out = {}
    for k, v in unwrap_model(model[0]).state_dict().items():
        if isinstance(v, torch.Tensor):
            out[f"model/{k}"] = digest(v)
    for oi, opt in enumerate(optimizer.chained_optimizers):
        names = {p: n for c in opt.model_chunks for n, p in unwrap_model(c).named_parameters()}
        for param, (gi, go) in opt.model_param_group_index_map.items():
            main = opt.optimizer.param_groups[gi]["params"][go]
            out[f"optim/{oi}/{names[param]}/main"] = digest(main)
            for name, value in opt.optimizer.state.get(main, {}).items():
                key = f"optim/{oi}/{names[param]}/{name}"
                out[key] = digest(value) if isinstance(value, torch.Tensor) else repr(value)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
        out[f"optim/{oi}/param_groups"] = repr(groups)
    return out


def _train_rank(rank: int, world: int, socket: str, steps: int, save_every: int, tp: int, gmb: int) -> dict[str, Any]:
    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(tp=tp, global_microbatches=gmb, **MODEL)  # type: ignore[arg-type]
    client = CheckpointClient(socket, timeout_s=120)
    handle = None
    saves: list[dict[str, Any]] = []
    losses: list[float] = []
    digests: dict[str, str] = {}
    params: dict[str, Any] = {}
    t0 = time.perf_counter()
    for it in range(steps):
        losses.append(train_step(it))
        step = it + 1
        if step % save_every:
            continue
        if handle is not None:
            handle.wait(300)  # only the previous save: training overlapped with its drain
        started = time.time()
        handle = save_checkpoint(client, step, model, optimizer, extra={"iteration": step, "losses": list(losses)})
        saves.append({"step": step, "started_at": started, "stall_s": handle.stall_s, "nbytes": handle.nbytes})
        digests = state_digests(model, optimizer)  # the state at save time; training goes on from here
        params = param_states(model, optimizer)
    train_s = time.perf_counter() - t0
    if handle is not None:
        handle.wait(300)
    client.close()
    return {"saves": saves, "digests": digests, "params": params, "losses": losses, "train_s": train_s}


def _reload_rank(rank: int, world: int, root: str, tp: int, gmb: int) -> dict[str, Any]:
    from ckptd.client.megatron import load_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, _train = build_gpt(tp=tp, global_microbatches=gmb, seed=97, **MODEL)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    loaded = load_checkpoint(root, "latest", model, optimizer)
    return {"step": loaded.step, "digests": state_digests(model, optimizer), "load_s": time.perf_counter() - t0}


def _reload_other_rank(rank: int, world: int, root: str, tp: int, gmb: int) -> dict[str, Any]:
    from ckptd.client.megatron import load_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, _train = build_gpt(tp=tp, global_microbatches=gmb, seed=98, **MODEL)  # type: ignore[arg-type]
    warned: list[str] = []  # the loader's warnings, printed once by the parent instead of once per rank
    keep = logging.Handler(logging.WARNING)
    keep.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptd").addHandler(keep)
    t0 = time.perf_counter()
    loaded = load_checkpoint(root, "latest", model, optimizer)
    load_s = time.perf_counter() - t0
    return {"step": loaded.step, "layout": loaded.layout, "params": param_states(model, optimizer), "load_s": load_s,
            "warnings": warned}


# --- the parent ----------------------------------------------------------------------------------
def parallel_layout(ranks: int) -> tuple[int, int, int]:
    """(TP, DP, global micro-batches) for ``ranks`` ranks: TP2 x DP(ranks/2) for an even count >= 4."""
    if ranks < 1:
        raise InvalidRequestError(f"--ranks must be >= 1, got {ranks}")
    tp = 2 if ranks >= 4 and ranks % 2 == 0 else 1
    dp = ranks // tp
    return tp, dp, dp * max(1, -(-4 // dp))


def other_layout(ranks: int, tp: int) -> tuple[int, int, int, int]:
    """(ranks, TP, DP, global micro-batches) of the reload at another layout: TP 2 -> 1 over the same ranks,
    else TP 1 -> 2 (one rank more for an odd count)."""
    new_tp, n = (1, ranks) if tp == 2 else (2, ranks + ranks % 2)
    dp = n // new_tp
    return n, new_tp, dp, dp * max(1, -(-4 // dp))


def _prepare_root(root: str) -> None:
    if os.path.isdir(root) and os.listdir(root):
        if not any(os.path.exists(os.path.join(root, m)) for m in (MARKER, OLD_MARKER)):
            raise InvalidRequestError(
                f"{root} exists and was not made by `ckptd demo`; pass --root with a new or empty directory"
            )
        shutil.rmtree(root)  # an earlier demo's checkpoints: start over, the step numbers repeat
    os.makedirs(os.path.dirname(os.path.join(root, MARKER)), exist_ok=True)
    with open(os.path.join(root, MARKER), "w") as fh:
        fh.write("made by `ckptd demo`; the demo empties this directory when it runs again\n")


async def _inspect(root: str) -> tuple[list[int], dict[int, Any], dict[str, Any]]:
    """Committed steps, their manifests, and a full checksum pass over the latest one (its merged layout's
    arrays counted apart: ``merged_arrays``, ``merged_bytes``)."""
    from ckptd.writer.arrays import verify_array
    from ckptd.writer.errors import CkptdError
    from ckptd.writer.format import step_dir
    from ckptd.writer.root import open_root

    async with open_root(root) as ckpt:
        steps = await ckpt.committed_steps()
        commits = {s: await ckpt.read_commit(s) for s in steps}
        report: dict[str, Any] = {"ok": False, "step": None, "bytes": 0, "arrays": 0, "merged_bytes": 0,
                                  "merged_arrays": 0, "errors": []}
        if steps:
            latest = commits[steps[-1]]
            merged = await ckpt.read_merged_manifest(latest.step)
            report.update(step=latest.step, arrays=len(latest.arrays))
            tagged = [("bytes", rec) for rec in latest.arrays]
            tagged += [("merged_bytes", rec) for rec in (merged.arrays if merged else [])]
            for part, rec in tagged:
                try:
                    report[part] += await verify_array(ckpt.store, step_dir(latest.step), rec)
                except CkptdError as exc:
                    report["errors"].append(f"{type(exc).__name__}: {exc}")
            report["merged_arrays"] = len(merged.arrays) if merged else 0
            report["ok"] = not report["errors"]
    return steps, commits, report


def run_demo(root: str | None, as_json: bool, ranks: int, steps: int, save_every: int) -> int:
    """Run the demo; 0 when the reload is bit-exact and the latest step verifies, 1 otherwise."""
    if save_every < 1 or steps < save_every:
        raise InvalidRequestError(f"need --steps >= --save-every >= 1 (got {steps} and {save_every})")
    tp, dp, gmb = parallel_layout(ranks)
    root = os.path.abspath(root or "ckptd-demo")
    _prepare_root(root)
    # megatron-core warns about missing Apex/TE at import: noise here (the forkserver inherits this)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckptd-demo-") as private:
        os.chmod(private, 0o700)
        log_path = os.path.join(private, "daemon.log")
        daemon = DaemonProcess(root, os.path.join(private, "daemon.sock"), "--arena-size", ARENA, log_path=log_path)
        try:
            daemon.wait_ready(120)
            trained = run_ranks(_train_rank, ranks, daemon.socket, steps, save_every, tp, gmb, timeout_s=600)
        except BaseException:
            print(daemon.log_tail(), file=sys.stderr)
            raise
        finally:
            daemon.stop(60)
    reloaded = run_ranks(_reload_rank, ranks, root, tp, gmb, timeout_s=600)
    # another layout: first straight from the DP bucket slices, then from the merged layout
    n_other, tp_other, dp_other, gmb_other = other_layout(ranks, tp)
    saved_states = full_states([t["params"] for t in trained])
    resharded = run_ranks(_reload_other_rank, n_other, root, tp_other, gmb_other, timeout_s=600)
    merge_summary = merge(root, "latest", progress=False)
    via_merged = run_ranks(_reload_other_rank, n_other, root, tp_other, gmb_other, timeout_s=600)
    across = {name: _across(saved_states, runs, trained) for name, runs in
              (("resharded", resharded), ("merged", via_merged))}
    committed, commits, verify = asyncio.run(_inspect(root))

    mismatched = sorted(
        f"rank {r}: {k}"
        for r, (t, lo) in enumerate(zip(trained, reloaded, strict=True))
        for k in set(t["digests"]) | set(lo["digests"])
        if t["digests"].get(k) != lo["digests"].get(k)
    )
    saved_step = trained[0]["saves"][-1]["step"]
    roundtrip = "bit-exact" if not mismatched and all(r["step"] == saved_step for r in reloaded) else "mismatch"
    stalls = [s["stall_s"] for t in trained for s in t["saves"]]
    per_step = []
    for i, save in enumerate(trained[0]["saves"]):
        commit = commits.get(save["step"])
        started = min(t["saves"][i]["started_at"] for t in trained)
        drain_s = commit.committed_at - started if commit is not None else None
        per_step.append({
            "step": save["step"],
            "bytes": commit.nbytes if commit is not None else None,
            "stall_s_median": statistics.median(t["saves"][i]["stall_s"] for t in trained),
            "stall_s_max": max(t["saves"][i]["stall_s"] for t in trained),
            "drain_s": drain_s,
            "drain_mib_s": commit.nbytes / drain_s / 2**20 if commit is not None and drain_s else None,
        })
    latest = commits[committed[-1]] if committed else None
    params = sum(math.prod(a.shape) for a in latest.arrays if a.name.startswith("model/")) if latest else 0
    drains = [p["drain_mib_s"] for p in per_step if p["drain_mib_s"]]
    result = {
        "root": root,
        "ranks": ranks,
        "tp": tp,
        "dp": dp,
        "model_params": params,
        "steps": steps,
        "save_every": save_every,
        "committed_steps": committed,
        "bytes_per_step": latest.nbytes if latest else 0,
        "stall_s_median": statistics.median(stalls) if stalls else None,
        "stall_s_max": max(stalls) if stalls else None,
        "drain_mib_s_median": statistics.median(drains) if drains else None,
        "per_step": per_step,
        "roundtrip": roundtrip,
        "roundtrip_step": reloaded[0]["step"],
        "roundtrip_tensors_checked": sum(len(t["digests"]) for t in trained),
        "mismatches": mismatched[:20],
        "other_layout": {"ranks": n_other, "tp": tp_other, "dp": dp_other, **across},
        "merge": msgspec.to_builtins(merge_summary),
        "verify": "ok" if verify["ok"] else "corrupt",
        "verify_detail": verify,
        "losses": trained[0]["losses"],
        "seconds": round(time.perf_counter() - t_start, 2),
    }
    if as_json:
        print(json.dumps(result))
    else:
        _print_table(result)
    exact = all(r["result"] == "bit-exact" for r in across.values())
    return 0 if roundtrip == "bit-exact" and exact and verify["ok"] and committed else 1


def _across(saved: Any, runs: list[dict[str, Any]], trained: list[dict[str, Any]]) -> dict[str, Any]:
    """One reload at the other layout against the saving ranks' state: which layout it read, how many
    values matched, what differs."""
    compared, differs = compare_runs(saved, full_states([r["params"] for r in runs]))
    step = trained[0]["saves"][-1]["step"]
    ok = not differs and compared > 0 and all(r["step"] == step for r in runs)
    return {"result": "bit-exact" if ok else "mismatch", "layout": sorted({r["layout"] for r in runs}),
            "values_compared": compared, "params_compared": len(saved.states), "mismatches": differs[:20],
            "load_s_max": max(r["load_s"] for r in runs), "warnings": sorted({w for r in runs for w in r["warnings"]})}


def _print_table(r: dict[str, Any]) -> None:
    print(f"ckptd demo: {r['ranks']} gloo ranks (TP{r['tp']} x DP{r['dp']}), Megatron GPT with "
          f"{r['model_params'] / 1e6:.2f}M params, DistributedOptimizer (Adam)")
    print(f"root: {r['root']}   {r['steps']} steps, async save every {r['save_every']}")
    print()
    print(f"{'step':>6} {'bytes':>10} {'stall median':>13} {'stall max':>10} {'drain':>9} {'drain MiB/s':>12}")
    for p in r["per_step"]:
        nbytes = f"{p['bytes'] / 2**20:.1f}MiB" if p["bytes"] is not None else "-"
        drain = f"{p['drain_s']:.3f}s" if p["drain_s"] is not None else "-"
        mib_s = f"{p['drain_mib_s']:.0f}" if p["drain_mib_s"] is not None else "-"
        print(f"{p['step']:>6} {nbytes:>10} {p['stall_s_median'] * 1e3:>11.1f}ms {p['stall_s_max'] * 1e3:>8.1f}ms "
              f"{drain:>9} {mib_s:>12}")
    print()
    print(f"committed steps: {r['committed_steps']}")
    print(f"reload of step {r['roundtrip_step']} into fresh ranks: {r['roundtrip']} "
          f"({r['roundtrip_tensors_checked']} model/optimizer entries compared on {r['ranks']} ranks)")
    for m in r["mismatches"]:
        print(f"  differs: {m}")
    o, m = r["other_layout"], r["merge"]
    where = {"resharded": "straight from the DP bucket slices, no merge", "merged": "from the merged layout"}
    for name in ("resharded", "merged"):
        if name == "merged":
            print(f"merge of step {m['step']} (offline, what `ckptd merge` does): {m['arrays']} arrays (one per "
                  f"param and state, layers stacked), {m['bytes_read'] / 2**20:.1f} MiB read, "
                  f"{m['bytes_written'] / 2**20:.1f} MiB written in {m['seconds']:.1f}s")
        x = o[name]
        print(f"reload at TP{o['tp']} x DP{o['dp']} {where[name]}: {x['result']} ({x['params_compared']} params' "
              f"optimizer state, {x['values_compared']:,} values, against the saving ranks'; read from: "
              f"{', '.join(x['layout'])})")
        for d in x["mismatches"]:
            print(f"  differs: {d}")
    for w in sorted({w for name in ("resharded", "merged") for w in o[name]["warnings"]}):
        print(f"  (the loader warned: {w})")
    v = r["verify_detail"]
    status = "OK" if v["ok"] else f"CORRUPT ({len(v['errors'])} array(s))"
    print(f"verify step {v['step']}: {status}: {v['arrays']} arrays, {v['bytes'] / 2**20:.1f} MiB, and "
          f"{v['merged_arrays']} merged arrays, {v['merged_bytes'] / 2**20:.1f} MiB, re-read against crc32c")
    print(f"total {r['seconds']:.1f}s")
