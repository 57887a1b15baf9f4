"""``ckptd demo`` as users run it: a subprocess that starts a daemon, trains 4 Megatron ranks, reloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import zarr

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.megatron


def test_demo_json(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    cmd = [sys.executable, "-m", "ckptd.daemon.cli", "demo", "--json", "--root", str(root), "--steps", "8",
           "--save-every", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["committed_steps"] == [4, 8]
    assert out["roundtrip"] == "bit-exact" and out["roundtrip_step"] == 8
    assert out["roundtrip_tensors_checked"] > 100 and not out["mismatches"]
    assert out["verify"] == "ok" and out["verify_detail"]["bytes"] == out["bytes_per_step"]
    # at another layout, from the DP slices (no merge) and after the merge from the merged layout: every
    # param's fp32 value and Adam moments, every element, compared with what the saving ranks held
    other = out["other_layout"]
    assert (other["ranks"], other["tp"], other["dp"]) == (4, 1, 4)
    params = out["model_params"]
    for name in ("resharded", "merged"):
        assert other[name]["result"] == "bit-exact" and not other[name]["mismatches"], other[name]
        assert other[name]["layout"] == [name]
        assert other[name]["values_compared"] == 3 * params and other[name]["params_compared"] > 40
    assert out["merge"]["step"] == 8 and out["merge"]["arrays"] == out["verify_detail"]["merged_arrays"] > 0
    assert out["verify_detail"]["merged_bytes"] == out["merge"]["bytes_written"]
    assert (out["ranks"], out["tp"], out["dp"]) == (4, 2, 2)
    assert out["bytes_per_step"] > 1 << 20
    assert 0 < out["stall_s_median"] < 30
    assert all(p["bytes"] == out["bytes_per_step"] for p in out["per_step"])
    assert sorted(os.listdir(root)) == ["_ckptd", "step_4", "step_8", "zarr.json"]
    assert os.path.isfile(os.path.join(root, "_ckptd", "demo"))  # the demo's mark, where zarr lists nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zarr warns of an object at the root it does not know
        assert sorted(zarr.open_group(str(root), mode="r").group_keys()) == ["step_4", "step_8"]

    # any other non-empty directory is refused, untouched
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    refused = subprocess.run([*cmd[:-6], "--root", str(other)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not made by `ckptd demo`" in refused.stderr
    assert (other / "keep.txt").read_text() == "mine"
