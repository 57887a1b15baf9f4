"""The S3 path against two implementations: moto and the npm ``s3rver`` (disk-backed, implements less).

Save, commit, load, ``ls``, ``verify``, in-daemon retention and ``gc`` must work on both; where a server
lacks an optional capability (s3rver: no multipart-upload listing, ``If-None-Match`` ignored) ckptd
warns once and carries on (ckptd.writer.backends.s3_compat).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.client.reader import load
from ckptd.testing.fixtures import BUCKET, unavailable
from ckptd.testing.s3rver import S3rverServer, s3rver_command
from ckptd.testing.s3server import S3Server
from ckptd.writer.format import CONTROL_DIR

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180)]
CLI = [sys.executable, "-m", "ckptd.daemon.cli"]


@pytest.fixture(scope="module", params=["moto", "s3rver"])
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "s3rver" and s3rver_command() is None:
        unavailable("s3rver is not installed (./bootstrap.sh setup installs it into .ci/node_modules with npm)")
    with (S3Server() if request.param == "moto" else S3rverServer()) as srv:
        srv.make_bucket(BUCKET)
        yield srv


def _flags(srv: Any) -> list[str]:
    return ["--endpoint-url", srv.endpoint_url, "--addressing-style", "path", "--region", "us-east-1"]


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"model/w": torch.randn(64 * 1024, generator=g), "model/b": torch.randn(9, generator=g).bfloat16()}


def _warnings(text: str, capability: str) -> int:
    return sum(1 for line in text.splitlines() if "WARNING" in line and f"does not support {capability}" in line)


def test_round_trip_retention_ls_verify_gc(server: Any, start_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    moto = isinstance(server, S3Server)
    env = server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    root = f"s3://{BUCKET}/compat"
    d = start_daemon(root, "d0", *_flags(server), "--keep", "2", "--chunk-bytes", "64KiB", env=env)
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
    for step in (1, 2, 3, 4):  # retention runs after each commit: steps 1 and 2 go
        client.save(step, _state(step)).wait(60)
    client.close()
    opts = {"endpoint_url": server.endpoint_url, "addressing_style": "path", "region": "us-east-1"}
    for step in (3, 4):
        template = {k: torch.zeros_like(v) for k, v in _state(step).items()}
        load(root, step, template, storage_options=opts)
        assert all(torch.equal(template[k].view(torch.uint8), v.view(torch.uint8)) for k, v in _state(step).items())
    d.stop()
    log = Path(d.log_path).read_text()  # type: ignore[arg-type]
    # one warning per missing capability for the daemon's life, not one per retention or commit
    assert _warnings(log, "multipart_listing") == (0 if moto else 1), log[-3000:]
    assert _warnings(log, "conditional_put") == (0 if moto else 1), log[-3000:]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, *args, *_flags(server)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env})

    out = cli("ls", root, "--json")
    assert out.returncode == 0, out.stderr
    assert [(r["step"], r["committed"]) for r in json.loads(out.stdout)] == [(3, True), (4, True)]
    out = cli("verify", root, "--json")
    assert out.returncode == 0, out.stderr
    assert [(r["step"], r["ok"]) for r in json.loads(out.stdout)] == [(3, True), (4, True)]

    s3 = server.client()
    # a failed attempt: its part and the coordinator's failure note (s3rver's delimiter listings omit
    # prefixes holding only nested keys, so a step with no object at its top level is invisible there)
    s3.put_object(Bucket=BUCKET, Key="compat/step_0/_parts/node-0.json", Body=b"{}")
    s3.put_object(Bucket=BUCKET, Key="compat/step_0/FAILED", Body=b"{}")
    if moto:
        s3.create_multipart_upload(Bucket=BUCKET, Key="compat/step_3/model/w/c.0")
    out = cli("gc", root, "--keep", "1", "--grace", "0")  # the unfinished step 0 was written just now
    assert out.returncode == 0, out.stderr  # s3rver answered 501 to the multipart listing: gc still runs
    assert _warnings(out.stderr, "multipart_listing") == (0 if moto else 1), out.stderr
    assert {k.split("/")[1] for k in server.list_keys(BUCKET, "compat/")} == {"step_4", CONTROL_DIR, "zarr.json"}
    if moto:
        assert s3.list_multipart_uploads(Bucket=BUCKET, Prefix="compat/").get("Uploads", []) == []
