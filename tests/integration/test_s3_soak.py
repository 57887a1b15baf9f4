"""S3 soak: many consecutive steps (12 in CI, 40 in the slow tier) through the fault proxy at a steady fault
rate (503 slow-downs, 500s, throttling, connection resets before, during and after a request, added
latency) — every step commits, every step reads back bit-exact and verifies, and the daemon logs each step's
retry count."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_s3 import aws_env, cli, in_aws_env, options, s3_flags  # noqa: F401 (fixture)

from ckptd.client import CheckpointClient, Placement
from ckptd.client.reader import load
from ckptd.testing.faultproxy import FaultProxy
from ckptd.testing.fixtures import BUCKET
from ckptd.testing.s3server import S3Server

pytestmark = [pytest.mark.s3, pytest.mark.timeout(600), pytest.mark.usefixtures("in_aws_env")]

# 8% of eligible requests fail transiently, spread over every transient kind the proxy knows
SOAK_FAULTS = {
    "slowdown": 0.02,
    "internal": 0.01,
    "throttle": 0.01,
    "reset_before": 0.015,
    "reset_mid_request": 0.01,
    "reset_mid_response": 0.015,
}


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "w": torch.randn(96 * 1024, generator=g),  # 384 KiB: two 256 KiB chunks
        "b": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "i": torch.arange(11, dtype=torch.int64) * step,
    }


def _retries(log: str, step: int) -> int:
    found = re.search(rf"step={step} node=0 state=committed .* s3_retries=(\d+)", log)
    assert found, f"no commit line with retries for step {step}:\n{log[-3000:]}"
    return int(found.group(1))


@pytest.mark.parametrize("steps", [12, pytest.param(40, marks=pytest.mark.slow)], ids=["12-steps", "40-steps"])
def test_steps_under_steady_faults_all_commit_bit_exact(
    s3: S3Server, proxy: FaultProxy, start_daemon, steps: int
) -> None:
    assert sum(SOAK_FAULTS.values()) >= 0.05
    root = f"s3://{BUCKET}/soak-{steps}"
    d0 = start_daemon(root, "d0", *s3_flags(proxy.url), "--chunk-bytes", "256KiB", env=aws_env(s3))
    proxy.set_faults(**SOAK_FAULTS, latency_jitter_s=0.01, seed=20261201)
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0), timeout_s=60)
    for step in range(1, steps + 1):
        client.save(step, _state(step)).wait(120)
    client.close()
    stats = proxy.stats()
    assert stats.total_faults >= 10 and len(stats.faults) >= 4, stats  # the faults really happened, of many kinds

    log = Path(d0.log_path).read_text()  # type: ignore[arg-type]
    per_step = {step: _retries(log, step) for step in range(1, steps + 1)}
    assert sum(per_step.values()) >= 5, per_step

    # every step reads back bit-exact, still through the faults
    for step in range(1, steps + 1):
        template = {k: torch.zeros_like(v) for k, v in _state(step).items()}
        load(root, step, template, storage_options=options(proxy.url))
        for key, want in _state(step).items():
            assert torch.equal(template[key].view(torch.uint8), want.view(torch.uint8)), (step, key)

    # and an independent re-read of every chunk against its crc32c, without faults
    proxy.clear_faults()
    out = cli("verify", root, "--json", *s3_flags(s3.endpoint_url), env=aws_env(s3))
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(r["step"] for r in results) == list(range(1, steps + 1))
    assert all(r["ok"] and r["bytes"] > 0 for r in results), results
