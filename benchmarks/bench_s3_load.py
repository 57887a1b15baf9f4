"""A Megatron checkpoint on S3 loaded at its saving layout and at another TP (``--only s3_load``), the TP change
read by 1 MiB piece against the same load reading every chunk it touches whole, in one run.

A moto S3 server runs on 127.0.0.1 in its own process, with a counting proxy in front of it
(``ckptd.testing.faultproxy``, no faults, its own process) that every load reads through: the bytes it relays to
the ranks are what the load GETs. Two gloo ranks save the toy GPT at TP1 x DP2 through a ``ckptd serve
--root s3://...`` daemon (straight to the server). Then, per repeat, the modes take turns, each a
``load_checkpoint`` of that step into a live model and optimizer:

- ``same``: TP1 x DP2, the saving layout (each rank its own bucket slices);
- ``tp2``: TP2 x DP1, merge-free: each param's half read out of the stored bucket slices, only in the
  1 MiB pieces that hold a needed element (ranged GETs of those pieces and the chunk's trailer);
- ``tp2_whole``: the same load with piece reads switched off (every chunk it touches GET whole and checked
  whole): what the TP change cost before the manifest recorded each piece's crc32c.

Times are the slowest rank's, medians over the repeats (3; 1 at smoke size); bytes are both ranks' together
per load. The two TP2 loads are compared bit for bit (every model param and optimizer state on each rank).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
import urllib.request
from typing import Any

BUCKET = "bench"
STEP = 1
FULL = {"hidden": 1024, "layers": 8, "heads": 16, "vocab": 32768, "seq": 64, "micro_batch_size": 1}  # as bench_load
SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 128, "seq": 16}
MODES = {"same": 1, "tp2": 2, "tp2_whole": 2}  # mode: TP


def _proxy(url: str, method: str, action: str) -> Any:
    """The counting proxy's control endpoint (``GET stats``, ``POST reset-stats``)."""
    data = b"{}" if method == "POST" else None
    req = urllib.request.Request(f"{url}/__faultproxy__/{action}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"{}")


def _save(rank: int, world: int, socket_path: str, cfg: dict[str, Any]) -> int:
    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(**cfg)
    train_step(0)
    client = CheckpointClient(socket_path, timeout_s=600)
    save_checkpoint(client, STEP, model, optimizer, extra={"iteration": STEP}).wait(1800)
    client.close()
    return sum(p.numel() for c in model for p in c.parameters())


def _digest(model: list[Any], optimizer: Any) -> str:
    """Every model param's and optimizer state's bytes, hashed (a rank's loaded state, bit for bit)."""
    import torch

    h = hashlib.sha256()
    for c in model:
        for p in c.parameters():
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for opt in optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                for v in opt.optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _loads(rank: int, world: int, root: str, cfg: dict[str, Any], tp: int, modes: list[str], repeats: int,
           proxy_url: str) -> dict[str, Any]:
    import torch.distributed as dist

    import ckptd.client.fastread as fastread
    from ckptd.client.megatron import load_checkpoint
    from ckptd.testing.cpu_shim import suspended
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(tp=tp, seed=4321, data_seed=1234, **cfg)
    train_step(0)  # live optimizer state, as in a restarted job before its load
    options = {"endpoint_url": proxy_url, "addressing_style": "path", "region": "us-east-1"}
    by_piece = fastread.needed_pieces
    out: dict[str, Any] = {m: [] for m in modes} | {f"{m}_bytes": [] for m in modes}
    for _ in range(repeats):
        for mode in modes:  # taking turns: drift in the machine's speed reaches every mode alike
            fastread.needed_pieces = (lambda job: None) if mode == "tp2_whole" else by_piece  # type: ignore[assignment]
            dist.barrier()
            if rank == 0:
                _proxy(proxy_url, "POST", "reset-stats")
            dist.barrier()
            t0 = time.perf_counter()
            with suspended():
                load_checkpoint(root, STEP, model, optimizer, storage_options=options)
            out[mode].append(time.perf_counter() - t0)
            dist.barrier()
            if rank == 0:
                out[f"{mode}_bytes"].append(_proxy(proxy_url, "GET", "stats")["bytes_to_client"])
            out[f"{mode}_digest"] = _digest(model, optimizer)
    fastread.needed_pieces = by_piece  # type: ignore[assignment]
    return out


def bench_s3_load(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    from run import emit, runs

    from ckptd.testing.faultproxy import FaultProxyProcess
    from ckptd.testing.launch import DaemonProcess, run_ranks
    from ckptd.testing.s3server import S3Server

    cfg = SMOKE if args.smoke else FULL
    repeats = runs(args, full=3)
    with S3Server() as server:
        server.make_bucket(BUCKET)
        env = server.env()
        root = f"s3://{BUCKET}/load"
        sock = os.path.join(args.sockets, "s3load.sock")
        daemon = DaemonProcess(root, sock, "--arena-size", "1GiB", "--endpoint-url", server.endpoint_url,
                               "--addressing-style", "path", "--region", "us-east-1", env=env,
                               log_path=os.path.join(workdir, "daemon-s3load.log"))
        daemon.wait_ready(120)
        try:
            params = run_ranks(_save, 2, sock, cfg, env=env, timeout_s=1800)[0]
        finally:
            daemon.stop()
        with FaultProxyProcess(server.endpoint_url) as proxy:
            env = server.env(proxy.url)  # every request of the loads through the proxy
            same = run_ranks(_loads, 2, root, cfg, 1, ["same"], repeats, proxy.url, env=env, timeout_s=3600)
            tp2 = run_ranks(_loads, 2, root, cfg, 2, ["tp2", "tp2_whole"], repeats, proxy.url, env=env,
                            timeout_s=3600)
    row: dict[str, Any] = {"bench": "s3_load", "params": params, "ranks": 2, "repeats": repeats,
                           "endpoint": "moto ThreadedMotoServer on 127.0.0.1, through a counting proxy"}
    for mode, results in (("same", same), ("tp2", tp2), ("tp2_whole", tp2)):
        slowest = [max(r[mode][i] for r in results) for i in range(repeats)]
        row[f"{mode}_s"] = round(statistics.median(slowest), 3)
        row[f"{mode}_mb"] = round(statistics.median(results[0][f"{mode}_bytes"]) / 1e6, 1)
    row["ratio_tp2_vs_same"] = round(row["tp2_s"] / row["same_s"], 3)
    row["ratio_tp2_whole_vs_same"] = round(row["tp2_whole_s"] / row["same_s"], 3)
    row["ratio_tp2_bytes_vs_whole"] = round(row["tp2_mb"] / row["tp2_whole_mb"], 3)
    row["tp2_equal_whole"] = all(r["tp2_digest"] == r["tp2_whole_digest"] for r in tp2)
    return [emit(row)]


BENCHES = {"s3_load": bench_s3_load}
