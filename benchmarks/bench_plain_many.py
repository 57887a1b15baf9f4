"""The plain ``save(state)`` stall with many small tensors (``--only plain_many``).

One rank (gloo, world 1) beside a ``ckptd serve`` daemon whose root and arena are in a temp dir, saving a flat
state dict of ``n`` bf16 tensors (a model's ``state_dict()`` as FSDP-style trainers hand it over): 1,000 x
256 KiB and 10,000 x 32 KiB; and 10,000 x 32 KiB as ``Shard`` leaves (``leaves: "shards"``: a rank's parts of
sharded tensors, the same ``Shard`` objects each save) (smoke: 200 x 4 KiB, both kinds). The modes take turns,
each save waited on until committed before the next:

- ``ckptd``: ``CheckpointClient.save`` as it is: from the third save on the dict is recognised as shaped like
  the one its plan was made from (:mod:`ckptd.client.skeleton`) and staged through that plan;
- ``planned``: the same saves with that recognition switched off (the client before it): every save plans its
  dict shard by shard and compares the shards' structure with the plan's;
- ``memcpy``: one ``torch.cat`` of the same tensors into one pre-faulted buffer of the same bytes.

Then the newest step is loaded back (``ckptd.client.reader.load`` into tensors of the dict's shapes, page cache
warm, checked bit-exact), taking turns with ``raw_place``: every file of the step read into its own part of one
pre-faulted buffer (:func:`bench_load.raw_readers`: what any loader of those bytes must at least do; no
checksum, nothing parsed).

Prints one JSON line per size: medians of 7 (smoke: 2), ``ratio_vs_memcpy``, ``planned_ratio_vs_memcpy``, the
time beyond the copy per tensor, and ``load_ratio_vs_raw_place``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from typing import Any

from bench_load import raw_readers

from ckptd.testing.launch import DaemonProcess, run_ranks

FULL = [(1_000, 128 << 10, "tensors"), (10_000, 16 << 10, "tensors"), (10_000, 16 << 10, "shards")]  # (leaves,
# bf16 elements each, what a leaf is)
SMOKE = [(200, 2 << 10, "tensors"), (200, 2 << 10, "shards")]


def _rank(
    rank: int, world: int, sock: str, root: str, n: int, elems: int, kind: str, repeats: int
) -> dict[str, list[float]]:
    import torch

    from ckptd.client import CheckpointClient, Placement, Shard
    from ckptd.client.reader import load

    client = CheckpointClient(sock, placement=Placement(0, 1, 1, 0), timeout_s=600)
    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.weight": torch.randn(elems, generator=g).to(torch.bfloat16) for i in range(n)}
    state: dict[str, Any] = dict(tensors)
    if kind == "shards":
        state = {k: Shard(k, t, (elems,), (0,)) for k, t in tensors.items()}
    flat = torch.empty(n * elems, dtype=torch.bfloat16).fill_(1)  # pre-faulted
    repeats_of = client._repeats
    match, remember = repeats_of.match, repeats_of.remember
    out: dict[str, list[float]] = {"ckptd": [], "planned": [], "memcpy": []}
    step = 0
    for _ in range(2):  # the first save of a structure goes shard by shard, the second plans it
        step += 1
        client.save(step, state).wait(600)
    for i in range(repeats):
        for mode in out:
            if mode == "memcpy":
                t0 = time.perf_counter()
                torch.cat(list(tensors.values()), out=flat)
                out[mode].append(time.perf_counter() - t0)
                continue
            off = mode == "planned"
            repeats_of.match = (lambda state: None) if off else match  # type: ignore[method-assign]
            repeats_of.remember = (lambda *a: None) if off else remember  # type: ignore[method-assign]
            step += 1
            handle = client.save(step, state)
            out[mode].append(handle.stall_s)
            handle.wait(600)
        if i < repeats - 1:  # the newest step keeps the values the load is checked against
            for t in tensors.values():
                t.add_(1)
    client.close()
    into = {k: torch.zeros_like(v) for k, v in tensors.items()}
    _reused, raw = raw_readers(root, 0, 1, step)
    out["load"], out["raw_place"] = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        load(root, step, into)
        out["load"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        raw()
        out["raw_place"].append(time.perf_counter() - t0)
    assert all(torch.equal(into[k], v) for k, v in tensors.items()), "the load is not the step saved"
    return out


def bench_plain_many(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    from run import emit

    rows = []
    repeats = 2 if args.smoke else 7
    for n, elems, kind in SMOKE if args.smoke else FULL:
        nbytes = n * elems * 2
        root = os.path.join(workdir, f"plain-many-{kind}-{n}")
        sock = os.path.join(args.sockets, f"pm{kind[0]}{n}.sock")
        arena = f"{4 * nbytes // (1 << 20) + 64}MiB"
        daemon = DaemonProcess(root, sock, "--arena-size", arena, "--keep", "2",
                               log_path=os.path.join(workdir, "plain-many.log")).wait_ready(120)
        try:
            began = time.perf_counter()
            res = run_ranks(_rank, 1, sock, root, n, elems, kind, repeats, timeout_s=1800)[0]
        finally:
            daemon.stop(60)
            shutil.rmtree(root, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in res.items()}
        row = {
            "bench": "plain_many", "tensors": n, "leaves": kind, "bytes": nbytes,
            **{f"{k}_s": round(v, 5) for k, v in med.items()},
            "ratio_vs_memcpy": round(med["ckptd"] / med["memcpy"], 3),
            "planned_ratio_vs_memcpy": round(med["planned"] / med["memcpy"], 3),
            "overhead_us_per_tensor": round((med["ckptd"] - med["memcpy"]) / n * 1e6, 2),
            "planned_overhead_us_per_tensor": round((med["planned"] - med["memcpy"]) / n * 1e6, 2),
            **{f"{k}_s_each": [round(x, 4) for x in res[k]] for k in ("ckptd", "planned")},
            "load_ratio_vs_raw_place": round(med["load"] / med["raw_place"], 3),
            "ranks": 1, "sizes": "smoke" if args.smoke else "full", "part_s": round(time.perf_counter() - began, 1),
        }
        rows.append(emit(row))
    return rows


BENCHES = {"plain_many": bench_plain_many}
