"""The offline merge against live megatron-core: every merged per-parameter tensor equals the live optimizer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient, Placement
from ckptd.client.megatron import (
    OPTIM_META,
    MegatronLayout,
    get_layout,
    model_state,
    optimizer_meta,
    optimizer_shards,
    view_of,
)
from ckptd.testing.fixtures import megatron_owned_state
from ckptd.testing.interop import check_readers
from ckptd.testing.launch import run_ranks
from ckptd.writer.format import sidecar_name

pytestmark = pytest.mark.megatron

CLI = [sys.executable, "-m", "ckptd.daemon.cli"]


def _rank_save(rank: int, world: int, socket_path: str, build: dict[str, Any], step: int) -> dict[str, Any]:
    from ckptd.testing.cpu_shim import install_cpu_shim
    from ckptd.testing.toy_gpt import build_gpt

    install_cpu_shim()
    model, optimizer, train_step = build_gpt(**build)
    for it in range(2):
        train_step(it)
    layout = get_layout(model, optimizer)
    text = layout.to_json()
    # the save path's shards (they stage themselves from the live optimizer), as save_checkpoint stages them
    state = {
        **model_state(model),
        **optimizer_shards(optimizer, layout),
        OPTIM_META: optimizer_meta(optimizer, layout),
        "megatron": {"layout": sidecar_name(text)},
    }
    client = CheckpointClient(socket_path, placement=Placement(rank, world, world, 0))
    client.save(step, state, sidecars=[text]).wait(120)
    client.close()
    # Ground truth from Megatron's own bookkeeping: this rank's range of each param's live state.
    return {"layout": text, "live": megatron_owned_state(optimizer, layout)}


def _save(start_daemon, tmp_path: Path, world: int, build: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, arena="128MiB")
    return root, run_ranks(_rank_save, world, d.socket, build, 1, timeout_s=600)


def _check_merged_equals_live(root: str, results: list[dict[str, Any]]) -> int:
    layouts = {}
    for r in results:
        lay = MegatronLayout.from_json(r["layout"])
        layouts.setdefault(f"tp{lay.tp_rank}.pp{lay.pp_rank}", lay)
    full: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for r in results:
        for entry in r["live"]:
            per = full.setdefault((entry["mp"], entry["name"]), {})
            for state, t in entry["tensors"].items():
                if t.numel() != entry["range"][1] - entry["range"][0]:
                    continue  # scalar state (Adam's step) is plain data, not merged per element
                buf = per.setdefault(state, torch.full((entry["numel"],), float("nan")))
                buf[entry["range"][0] : entry["range"][1]] = t.flatten().float()
    group = zarr.open_group(root, path="step_1/merged", mode="r")
    assert group.attrs["ckptd"]["content"] == "fully_reshardable"
    checked = 0
    for (mp, name), states in full.items():
        param = next(p for _b, bucket in layouts[mp].buckets() for p in bucket.params if p.name == name)
        for state, flat in states.items():
            assert not torch.isnan(flat).any(), f"{name} {state}: DP ranges do not cover the param"
            value = flat.view(param.shape)
            for piece in param.model_pieces:
                if any(piece.replica_id[:-1]):
                    continue
                arr = zarr.open_array(root, path=f"step_1/merged/optimizer.state.{state}.{piece.key}", mode="r")
                region = piece.region()
                got = torch.from_numpy(np.asarray(arr[region]))
                want = view_of(piece, value.contiguous()).reshape(got.shape)
                assert torch.equal(got, want), f"{piece.key} {state} differs from the live optimizer"
                checked += 1
    return checked


@pytest.mark.parametrize(
    ("world", "build"),
    [
        (2, {}),
        (2, {"overlap_grad_reduce": True, "bucket_size": 6000}),  # several buckets: Megatron's own writer is wrong here
        (2, {"bf16": True}),
        (4, {"tp": 2}),
    ],
    ids=["fp32-dp2", "multibucket-dp2", "bf16-dp2", "tp2-dp2"],
)
def test_merged_state_equals_live_optimizer(start_daemon, tmp_path, world, build):
    root, results = _save(start_daemon, tmp_path, world, build)
    out = subprocess.run([*CLI, "merge", root, "--step", "1", "--json"], capture_output=True, text=True, check=True)
    summary = json.loads(out.stdout)
    assert summary["tasks"] >= (2 if "bucket_size" in build else 1) and not summary["already_merged"]
    assert _check_merged_equals_live(root, results) > 0
    check_readers(root, merged=True)  # zarr-python and tensorstore read both layouts alike, without warnings
    again = json.loads(subprocess.run([*CLI, "merge", root, "--json"], capture_output=True, text=True,
                                      check=True).stdout)
    assert again["already_merged"]
    ls = json.loads(subprocess.run([*CLI, "ls", root, "--json"], capture_output=True, text=True, check=True).stdout)
    assert ls[0]["merged"] is True
    verify = json.loads(subprocess.run([*CLI, "verify", root, "--json"], capture_output=True, text=True,
                                       check=True).stdout)
    assert verify[0]["ok"] and verify[0]["merged"]


def _merged_digest(root: str) -> str:
    h = hashlib.sha256()
    base = Path(root) / "step_1" / "merged"
    for path in sorted(base.rglob("*")):
        rel = path.relative_to(base)
        if path.is_dir() or rel.parts[:2] == ("_ckptd", "_progress") or rel.name == "MERGED":
            continue
        h.update(str(rel).encode() + path.read_bytes())
    merged = json.loads((base / "_ckptd" / "MERGED").read_text())
    merged.pop("committed_at")
    merged.pop("crc32c")  # the manifest's checksum covers its committed_at
    merged["objects"].pop("source_committed_at")  # the commit it was built from (a step saved again: another)
    h.update(json.dumps(merged, sort_keys=True).encode())
    return h.hexdigest()


def _kill_mid_merge(root: str) -> None:
    """Run ``ckptd merge`` (one process) and SIGKILL it once its first finished task is recorded. It runs in
    slices of about a millisecond and is looked at only while stopped, so the kill cannot come after the
    end (polling a running merge raced it: a small merge can finish between two looks)."""
    proc = subprocess.Popen(
        [*CLI, "merge", root, "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    progress = Path(root) / "step_1" / "merged" / "_ckptd" / "_progress"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            os.kill(proc.pid, signal.SIGSTOP)
            os.waitpid(proc.pid, os.WUNTRACED)  # returns once it is stopped
            if progress.exists() and any(p.suffix == ".json" for p in progress.iterdir()):
                return
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.001)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_merge_killed_and_rerun_gives_identical_output(start_daemon, tmp_path):
    root, _results = _save(start_daemon, tmp_path, 2, {"overlap_grad_reduce": True, "bucket_size": 3000})
    clean = str(tmp_path / "clean")
    shutil.copytree(root, clean)
    subprocess.run([*CLI, "merge", clean, "--json"], check=True, capture_output=True)

    _kill_mid_merge(root)
    assert not (Path(root) / "step_1" / "merged" / "_ckptd" / "MERGED").exists(), "the merge finished before the kill"
    rerun = subprocess.run([*CLI, "merge", root, "--json"], capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    out = json.loads(rerun.stdout)
    assert out["tasks_skipped"] >= 1
    assert _merged_digest(root) == _merged_digest(clean)
    # a torn progress note (an earlier release wrote them in place; a kill mid-write left half of one): its
    # bucket is merged again, the others are skipped, the output is the same
    torn = str(tmp_path / "torn")
    shutil.copytree(clean, torn)
    control = Path(torn) / "step_1" / "merged" / "_ckptd"
    (control / "MERGED").unlink()
    notes = sorted((control / "_progress").iterdir())
    notes[0].write_bytes(notes[0].read_bytes()[: notes[0].stat().st_size // 2])
    rerun = subprocess.run([*CLI, "merge", torn, "--json"], capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads(rerun.stdout)["tasks_skipped"] == len(notes) - 1
    assert "unreadable" in rerun.stderr and _merged_digest(torn) == _merged_digest(clean)


def _chunk_files(root: str, state: str) -> list[Path]:
    return sorted(p for p in (Path(root) / "step_1" / "optim").rglob("*") if p.is_file() and p.parent.name == state
                  and p.name.startswith("c."))


def test_merge_checks_its_sources_and_the_step_it_merges(start_daemon, tmp_path, monkeypatch):
    """What the merge reads is checked against the commit manifest (a lost chunk is not zeros, a swapped one is
    not taken), a step deleted mid-merge is said to be, a merge of an earlier commit of the step number is not
    this one's, a merge overtaken by another ends with the other's, and one bucket is held at a time."""
    import asyncio
    import weakref

    from ckptd.writer import merge as merge_mod
    from ckptd.writer.commit import CheckpointWriter
    from ckptd.writer.errors import CheckpointNotFoundError, CorruptCheckpointError
    from ckptd.writer.root import open_root

    root, _results = _save(start_daemon, tmp_path, 2, {"overlap_grad_reduce": True, "bucket_size": 3000})
    clean = str(tmp_path / "clean")
    shutil.copytree(root, clean)
    subprocess.run([*CLI, "merge", clean, "--json"], check=True, capture_output=True)
    assert not list(Path(clean).rglob("*.tmp"))  # chunks written aside, then renamed: none left behind

    def copy(name: str) -> str:
        out = str(tmp_path / name)
        shutil.copytree(root, out)
        return out

    marker = Path("step_1") / "merged" / "_ckptd" / "MERGED"
    lost = copy("lost")  # a chunk gone: zarr would read zeros
    _chunk_files(lost, "param")[1].unlink()
    with pytest.raises(CorruptCheckpointError, match=r"chunk \[1\] missing"):
        merge_mod.merge(lost, 1, progress=False)
    swapped = copy("swapped")  # a valid chunk of another state in its place: its own trailer checks out
    shutil.copyfile(_chunk_files(swapped, "exp_avg")[0], _chunk_files(swapped, "param")[0])
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        merge_mod.merge(swapped, 1, progress=False)
    assert not (Path(lost) / marker).exists() and not (Path(swapped) / marker).exists()

    # one bucket in memory at a time: the state read before is freed when the next is read
    held: list[weakref.ref[np.ndarray]] = []
    read = merge_mod.read_bucket

    async def tracked(*args: Any) -> np.ndarray:
        for _ in range(100):  # a write's worker thread drops its arguments just after its result is in
            if all(ref() is None for ref in held):
                break
            await asyncio.sleep(0.002)
        assert all(ref() is None for ref in held), "an earlier bucket is still held"
        flat = await read(*args)
        held.append(weakref.ref(flat))
        return flat

    monkeypatch.setattr(merge_mod, "read_bucket", tracked)
    one_at_a_time = copy("one")
    assert not merge_mod.merge(one_at_a_time, 1, workers=1, progress=False).already_merged
    assert len(held) > 2 and _merged_digest(one_at_a_time) == _merged_digest(clean)
    monkeypatch.setattr(merge_mod, "read_bucket", read)

    # the step deleted by retention while it is merged
    place = merge_mod._place_state
    deleted = copy("deleted")

    async def then_delete(*args: Any) -> None:
        await place(*args)
        async with open_root(deleted) as r:
            await CheckpointWriter(r.backend).delete_step(1)

    monkeypatch.setattr(merge_mod, "_place_state", then_delete)
    with pytest.raises(CheckpointNotFoundError, match="deleted while it was being merged"):
        merge_mod.merge(deleted, 1, workers=1, progress=False)
    assert not (Path(deleted) / marker).exists()

    # another merge commits while this one runs: this one stops and reports the other's
    overtaken = copy("overtaken")
    others: list[merge_mod.MergeSummary] = []

    async def other_merges_first(*args: Any) -> None:
        await place(*args)
        if not others:
            others.append(merge_mod.MergeSummary(1, 0, 0, 0, 0, 0, 0.0))  # no third merge from inside this one
            async with open_root(overtaken) as r:
                others[0] = await merge_mod.run_merge(r, 1, workers=1, progress=False)

    monkeypatch.setattr(merge_mod, "_place_state", other_merges_first)
    summary = merge_mod.merge(overtaken, 1, workers=1, progress=False)
    assert summary.already_merged and not others[0].already_merged
    assert _merged_digest(overtaken) == _merged_digest(clean)
    monkeypatch.setattr(merge_mod, "_place_state", place)

    # the step number committed again (deleted part-way, COMMITTED first, then saved anew): the old merge and
    # its progress notes are not this commit's
    again = str(tmp_path / "again")
    shutil.copytree(clean, again)
    committed = Path(again) / "step_1" / "_ckptd" / "COMMITTED"
    doc = json.loads(committed.read_text())
    doc["committed_at"] += 60.0
    del doc["crc32c"]  # edited on purpose: without its checksum (docs/format.md, "Manifest checksums")
    committed.write_text(json.dumps(doc))

    async def merged_manifest() -> Any:
        async with open_root(again) as r:
            return await r.read_merged_manifest(1, source=await r.read_commit(1))

    assert asyncio.run(merged_manifest()) is None
    redo = merge_mod.merge(again, 1, progress=False)
    assert not redo.already_merged and redo.tasks_skipped == 0 and redo.tasks > 1
    assert asyncio.run(merged_manifest()).objects["source_committed_at"] == doc["committed_at"]
    assert _merged_digest(again) == _merged_digest(clean)
