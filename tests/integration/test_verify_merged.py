"""``ckptd verify`` of a merged step re-reads the merged layout's chunks too: their bytes count in what it
reports, and a damaged merged chunk makes the step corrupt (exit 1), naming the chunk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient, Placement
from ckptd.client.megatron import OPTIM_META, get_layout, model_state, optimizer_meta, optimizer_shards
from ckptd.testing.launch import run_ranks
from ckptd.writer.format import sidecar_name

pytestmark = pytest.mark.megatron
CLI = [sys.executable, "-m", "ckptd.daemon.cli"]


def _rank_save(rank: int, world: int, socket_path: str) -> None:
    from ckptd.testing.cpu_shim import install_cpu_shim
    from ckptd.testing.toy_gpt import build_gpt

    install_cpu_shim()
    model, optimizer, train_step = build_gpt()
    train_step(0)
    layout = get_layout(model, optimizer)
    text = layout.to_json()
    state = {**model_state(model), **optimizer_shards(optimizer, layout), OPTIM_META: optimizer_meta(optimizer, layout),
             "megatron": {"layout": sidecar_name(text)}}
    client = CheckpointClient(socket_path, placement=Placement(rank, world, world, 0))
    client.save(1, state, sidecars=[text]).wait(120)
    client.close()


def _verify(root: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run([*CLI, "verify", root, "--json"], capture_output=True, text=True, check=False)
    return out.returncode, json.loads(out.stdout)[0]


def test_verify_rereads_the_merged_layout(start_daemon, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, arena="128MiB")
    run_ranks(_rank_save, 2, d.socket, timeout_s=300)
    rc, before = _verify(root)
    assert rc == 0 and before["ok"] and not before["merged"], before
    subprocess.run([*CLI, "merge", root, "--step", "1", "--json"], capture_output=True, text=True, check=True)
    merged = sorted(p for p in (Path(root) / "step_1" / "merged").rglob("c.*") if p.is_file())
    assert merged
    merged_bytes = sum(p.stat().st_size - 4 for p in merged)  # each chunk's bytes, then its crc32c
    rc, after = _verify(root)
    assert rc == 0 and after["ok"] and after["merged"], after
    assert after["bytes"] == before["bytes"] + merged_bytes, (before, after, merged_bytes)
    data = bytearray(merged[0].read_bytes())
    data[0] ^= 0x01
    merged[0].write_bytes(bytes(data))
    rc, damaged = _verify(root)
    assert rc == 1 and damaged["state"] == "corrupt", damaged
    assert any(merged[0].name in e for e in damaged["errors"]), damaged["errors"]
