"""ckptd on S3, end to end: a real moto server on 127.0.0.1, ``ckptd serve --root s3://...`` daemon
processes, gloo ranks, the CLI, and a fault-injecting proxy between the daemon and the server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_pipeline import expected_state, tensors, zero_template

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.reader import load
from ckptd.daemon.packing import HeldBlock, covers_whole
from ckptd.testing.faultproxy import Fault, FaultProxy
from ckptd.testing.fixtures import BUCKET, TRANSIENT_20
from ckptd.testing.launch import RankFailedError, run_ranks
from ckptd.testing.s3server import S3Server
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import (
    StepCommittedError,
    StorageError,
    StorageNotFoundError,
)
from ckptd.writer.format import FORMAT_VERSION, PartManifest, decode_commit, decode_part

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180)]

# Fake, distinctive credentials (moto without auth accepts any): they must never show up in logs or objects.
ACCESS_KEY = "AKIACKPTDTESTKEY0042"
SECRET_KEY = "ckptd-test-secret-never-log-me-42"
CLI = [sys.executable, "-m", "ckptd.daemon.cli"]


# --- fixtures -------------------------------------------------------------------------------------
def aws_env(s3: S3Server, **extra: str) -> dict[str, str]:
    env = s3.env()
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, **extra)
    return env


@pytest.fixture
def in_aws_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    for key, value in aws_env(s3).items():
        monkeypatch.setenv(key, value)
    return s3


def s3_flags(endpoint: str, *extra: str) -> list[str]:
    return ["--endpoint-url", endpoint, "--addressing-style", "path", "--region", "us-east-1", *extra]


def options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "addressing_style": "path", "region": "us-east-1"}


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=120)


# --- rank bodies (module level: they run in forked rank processes) -------------------------------
def node_state(rank: int, world: int, local: int, step: int) -> dict[str, object]:
    """The pipeline tests' state plus a small array split over the ranks of one node only."""
    state = expected_state(rank, world, step)
    node, lr = divmod(rank, local)
    g = torch.Generator().manual_seed(31 * step + node)
    tp = torch.randn(2 * local, 3, generator=g)
    state[f"tp{node}"] = {"bias": Shard(f"tp{node}/bias", tp[2 * lr : 2 * lr + 2].clone(), (2 * local, 3), (2 * lr, 0))}
    return state


def node_template(rank: int, world: int, local: int) -> dict[str, object]:
    template = zero_template(rank, world)
    node, lr = divmod(rank, local)
    template[f"tp{node}"] = {"bias": Shard(f"tp{node}/bias", torch.zeros(2, 3), (2 * local, 3), (2 * lr, 0))}
    return template


def rank_save(rank: int, world: int, sockets: list[str], local: int, steps: list[int]) -> bool:
    client = CheckpointClient(sockets[rank // local], placement=Placement(rank, world, local, rank // local))
    for step in steps:
        handle = client.save(step, node_state(rank, world, local, step))
        torch.distributed.barrier()
        handle.wait(timeout=90)
    client.close()
    return True


def rank_load(rank: int, world: int, root: str, steps: list[tuple[object, int]], local: int,
              opts: dict[str, Any]) -> bool:
    for step, expect in steps:
        check_load(rank, world, root, step, expect, local, opts)
    return True


def check_load(rank: int, world: int, root: str, step: object, expect: int, local: int, opts: dict[str, Any]) -> None:
    template = node_template(rank, world, local)
    out = load(root, step, template, rank=rank, storage_options=opts)  # type: ignore[arg-type]
    want, got = tensors(node_state(rank, world, local, expect)), tensors(template)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), f"{key} differs (rank {rank})"
    assert out["meta"] == {"step": expect, "note": f"rank{rank}", "lrs": [0.1, 0.01]}


# --- the round trip, the CLI, packing, GC -----------------------------------------------------------
def test_two_nodes_four_ranks_round_trip_cli_and_gc(s3: S3Server, start_daemon, tmp_path: Path,
                                                    in_aws_env: S3Server) -> None:
    prefix = "rt"
    root = f"s3://{BUCKET}/{prefix}"
    env = aws_env(s3, CKPTD_LOG_LEVEL="DEBUG")
    config = tmp_path / "ckptd.toml"  # storage options from the config file's [storage] table
    config.write_text(
        f'[daemon]\nwrite_concurrency = 4\n[storage]\nendpoint_url = "{s3.endpoint_url}"\n'
        'addressing_style = "path"\nregion = "us-east-1"\nmax_attempts = 4\n'
    )
    d0 = start_daemon(root, "node0", "--config", str(config), env=env)
    d1 = start_daemon(root, "node1", *s3_flags(s3.endpoint_url), env=env)
    run_ranks(rank_save, 4, [d0.socket, d1.socket], 2, [1, 2], local_world_size=2, env=env)
    opts = options(s3.endpoint_url)
    assert run_ranks(rank_load, 4, root, [("latest", 2), (1, 1)], 2, opts, env=env) == [True] * 4

    client = s3.client()
    commit = decode_commit(client.get_object(Bucket=BUCKET, Key=f"{prefix}/step_2/_ckptd/COMMITTED")["Body"].read())
    arrays = {a.name: a for a in commit.arrays}
    # Arrays spanning both nodes keep the rank grid: one object per writer.
    assert arrays["model/w"].chunks == [4, 6] and sorted(s.rank for s in arrays["model/w"].shards) == [0, 1, 2, 3]
    assert len(s3.list_keys(BUCKET, f"{prefix}/step_2/model/w/c.")) == 4
    # A small array one node holds whole is packed into one object, written by that node.
    for node in (0, 1):
        rec = arrays[f"tp{node}/bias"]
        assert rec.chunks == [4, 3] and [s.rank for s in rec.shards] == [2 * node]
        assert s3.list_keys(BUCKET, f"{prefix}/step_2/tp{node}/bias/c") == [f"{prefix}/step_2/tp{node}/bias/c.0.0"]
    part_key = f"{prefix}/step_2/_ckptd/_parts/node-1.json"
    part1 = decode_part(client.get_object(Bucket=BUCKET, Key=part_key)["Body"].read())
    assert part1.ranks == [2, 3]
    assert client.get_object(Bucket=BUCKET, Key=f"{prefix}/_ckptd/latest")["Body"].read() == b"2"

    # Any zarr v3 reader gets the packed array without ckptd.
    import zarr
    from zarr.storage import FsspecStore

    store = FsspecStore.from_url(root, read_only=True, storage_options={
        "endpoint_url": s3.endpoint_url, "key": ACCESS_KEY, "secret": SECRET_KEY})
    full = torch.cat([node_state(r, 4, 2, 2)["tp1"]["bias"].data for r in (2, 3)])  # type: ignore[index]
    assert np.array_equal(zarr.open_array(store=store, path="step_2/tp1/bias", mode="r")[:], full.numpy())

    # The CLI on S3: ls, verify, gc (flags here; the daemon used the config file).
    flags = s3_flags(s3.endpoint_url)
    out = cli("ls", root, "--json", *flags, env=env)
    assert out.returncode == 0, out.stderr
    assert [(r["step"], r["committed"]) for r in json.loads(out.stdout)] == [(1, True), (2, True)]
    out = cli("verify", root, "--json", *flags, env=env)
    assert out.returncode == 0, out.stderr
    assert [r["ok"] for r in json.loads(out.stdout)] == [True, True]

    # A failed step 0 left data and an unfinished multipart upload; step 1 left one too.
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/step_0/_ckptd/_parts/node-0.json", Body=b"{}")
    client.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}/step_0/model/w/c.0.0")
    client.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}/step_1/model/w/c.1.0")
    out = cli("gc", root, "--keep", "1", *flags, env=env)  # step 0 was written to just now: a daemon may be
    assert out.returncode == 0, out.stderr                   # writing it still (from its objects' LastModified)
    assert "within 1200s (--grace): [0]" in out.stdout, out.stdout
    assert {k.split("/")[1] for k in s3.list_keys(BUCKET, f"{prefix}/")} == {"step_0", "step_2", "_ckptd", "zarr.json"}
    out = cli("gc", root, "--keep", "1", "--grace", "0", *flags, env=env)
    assert out.returncode == 0, out.stderr
    left = {k.split("/")[1] for k in s3.list_keys(BUCKET, f"{prefix}/")}
    assert left == {"step_2", "_ckptd", "zarr.json"}
    uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=f"{prefix}/").get("Uploads", [])
    assert uploads == []
    for rank in (0, 3):
        check_load(rank, 4, root, "latest", 2, 2, opts)

    # Credentials never reach logs (the daemons ran at DEBUG) or stored objects.
    for d in (d0, d1):
        d.stop()
        text = Path(d.log_path).read_text()  # type: ignore[arg-type]
        assert "step=2 node=" in text and "S3 requests retried since start" in text
        assert SECRET_KEY not in text and ACCESS_KEY not in text
    for key in s3.list_keys(BUCKET, f"{prefix}/"):
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert SECRET_KEY.encode() not in body and ACCESS_KEY.encode() not in body, key


# --- transient and permanent faults -----------------------------------------------------------------
def _fault_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"big": torch.randn(1 << 20, generator=g), "small": torch.arange(5, dtype=torch.int64) + step}


def _check_loads(root: str, endpoint: str, step: int) -> None:
    template = {k: torch.zeros_like(v) for k, v in _fault_state(step).items()}
    load(root, step, template, storage_options=options(endpoint))
    for key, want in _fault_state(step).items():
        assert torch.equal(template[key].view(torch.uint8), want.view(torch.uint8)), key


def _retries_logged(log_path: str, step: int) -> int:
    found = re.search(rf"step={step} node=0 state=committed .* s3_retries=(\d+)", Path(log_path).read_text())
    assert found, Path(log_path).read_text()[-3000:]
    return int(found.group(1))


def test_transient_faults_still_commit_bit_exact(s3: S3Server, proxy: FaultProxy, start_daemon,
                                                 in_aws_env: S3Server) -> None:
    root = f"s3://{BUCKET}/flaky"
    d0 = start_daemon(root, "d0", *s3_flags(proxy.url), "--chunk-bytes", "256KiB", env=aws_env(s3))
    proxy.set_faults(**TRANSIENT_20, latency_jitter_s=0.02, seed=5)
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
    for step in (1, 2):
        client.save(step, _fault_state(step)).wait(120)
    stats = proxy.stats()
    assert stats.total_faults >= 5 and len(stats.faults) >= 3, stats
    assert _retries_logged(d0.log_path, 1) + _retries_logged(d0.log_path, 2) >= 3  # type: ignore[arg-type]
    _check_loads(root, proxy.url, 2)  # read back through the faults too
    proxy.clear_faults()
    _check_loads(root, s3.endpoint_url, 1)
    client.close()


def test_faults_on_every_request_fail_the_step_typed_and_bounded(
    s3: S3Server, proxy: FaultProxy, start_daemon, in_aws_env: S3Server
) -> None:
    root = f"s3://{BUCKET}/doomed"
    retry = ["--max-attempts", "2", "--fs-retries", "1", "--connect-timeout", "2", "--read-timeout", "3"]
    d0 = start_daemon(root, "d0", *s3_flags(proxy.url), *retry, env=aws_env(s3))
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
    client.save(1, _fault_state(1)).wait(60)

    # faults on every request: the save is refused at once (the step's first storage lookup fails);
    # faults on every write: the step is accepted, then fails while writing
    for fault, methods in ((Fault.SLOWDOWN, None), (Fault.RESET_BEFORE, None), (Fault.SLOWDOWN, ["PUT"]),
                           (Fault.RESET_MID_REQUEST, ["PUT"])):
        proxy.set_faults(fail_all=fault, methods=methods)
        client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
        start = time.monotonic()
        with pytest.raises(StorageError) as info:
            client.save(2, _fault_state(2)).wait(60)
        assert time.monotonic() - start < 30
        assert type(info.value) is StorageError and BUCKET in str(info.value), info.value
        client.close()
    proxy.clear_faults()

    # Nothing earlier was harmed, step 2 never committed, and the daemon still serves.
    _check_loads(root, s3.endpoint_url, 1)
    assert s3.list_keys(BUCKET, "doomed/step_2/_ckptd/COMMITTED") == []
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
    client.save(3, _fault_state(3)).wait(60)
    _check_loads(root, s3.endpoint_url, 3)
    client.close()


def test_bucket_deleted_while_serving(s3: S3Server, start_daemon, in_aws_env: S3Server) -> None:
    bucket = s3.make_bucket("vanishing")
    root = f"s3://{bucket}/run"
    d0 = start_daemon(root, "d0", *s3_flags(s3.endpoint_url), "--max-attempts", "2", env=aws_env(s3))
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
    client.save(1, _fault_state(1)).wait(60)
    boto = s3.client()
    for key in s3.list_keys(bucket):
        boto.delete_object(Bucket=bucket, Key=key)
    boto.delete_bucket(Bucket=bucket)
    with pytest.raises(StorageNotFoundError, match="vanishing"):
        client.save(2, _fault_state(2)).wait(60)
    client.close()
    s3.make_bucket(bucket)  # the daemon kept serving: once the bucket is back, saves commit again
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
    client.save(3, _fault_state(3)).wait(60)
    _check_loads(root, s3.endpoint_url, 3)
    client.close()


def test_missing_bucket_fails_loudly_everywhere(s3: S3Server, start_daemon, in_aws_env: S3Server) -> None:
    root = "s3://no-such-bucket/run"
    env = aws_env(s3)
    with pytest.raises(RankFailedError, match=r"StorageNotFoundError.*no-such-bucket"):
        start_daemon(root, "d0", *s3_flags(s3.endpoint_url), env=env)
    for command in (["ls", root], ["gc", root, "--keep", "1"]):
        out = cli(*command, *s3_flags(s3.endpoint_url), env=env)
        assert out.returncode == 2 and "StorageNotFoundError" in out.stderr and "no-such-bucket" in out.stderr
    with pytest.raises(StorageNotFoundError):
        load(root, "latest", {"x": torch.zeros(1)}, storage_options=options(s3.endpoint_url))


def test_wrong_credentials_are_permission_errors(s3_auth: S3Server, start_daemon) -> None:
    root = f"s3://{BUCKET}/auth"
    env = s3_auth.env()
    env["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
    with pytest.raises(RankFailedError, match="StoragePermissionError") as info:
        start_daemon(root, "d0", *s3_flags(s3_auth.endpoint_url), env=env)
    assert SECRET_KEY not in str(info.value)
    out = cli("ls", root, *s3_flags(s3_auth.endpoint_url), env=env)
    assert out.returncode == 2 and "StoragePermissionError" in out.stderr and SECRET_KEY not in out.stderr
    # the right key works (so the error above was about the credentials)
    out = cli("ls", root, "--json", *s3_flags(s3_auth.endpoint_url), env=s3_auth.env())
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr


# --- the commit marker is written once ------------------------------------------------------------
async def _race(url: str, opts: dict[str, Any]) -> list[object]:
    backends = [await open_backend(url, opts) for _ in range(3)]
    try:
        part = PartManifest(format=FORMAT_VERSION, step=5, node=0, num_nodes=1, world_size=1, ranks=[0], arrays=[],
                            objects={}, nbytes=0, written_at=0.0)
        await CheckpointWriter(backends[0]).write_part(part)
        results: list[object] = list(await asyncio.gather(
            *(CheckpointWriter(b).commit(5, 1, 10) for b in backends), return_exceptions=True))
        with pytest.raises(StepCommittedError):  # a late coordinator that skipped the early check
            await CheckpointWriter(backends[0]).write_marker(5, b"{}")
        return results
    finally:
        for b in backends:
            await b.close()


@pytest.mark.parametrize("where", ["s3", "local"])
def test_racing_coordinators_commit_exactly_once(where: str, in_aws_env: S3Server, tmp_path: Path) -> None:
    if where == "s3":
        url, opts = f"s3://{BUCKET}/race", options(in_aws_env.endpoint_url)
    else:
        url, opts = str(tmp_path / "race"), {}
    results = asyncio.run(_race(url, opts))
    assert sum(not isinstance(r, BaseException) for r in results) == 1, results
    assert all(isinstance(r, StepCommittedError) for r in results if isinstance(r, BaseException)), results


# --- packing, as a pure decision ------------------------------------------------------------------
def test_covers_whole_needs_an_exact_tiling() -> None:
    from ckptd.client.protocol import ShardMeta

    def block(rank: int, offset: int, rows: int = 2, shape: tuple[int, int] = (4, 3)) -> HeldBlock:
        meta = ShardMeta(key="b", dtype="float32", global_shape=list(shape), global_offset=[offset, 0],
                         shape=[rows, 3], chunk_shape=[2, 3], slot=0)
        return HeldBlock(rank, meta, np.zeros((rows, 3), np.float32))

    assert covers_whole([block(0, 0), block(1, 2)])
    assert not covers_whole([block(0, 0)])  # the other half lives on another node
    assert not covers_whole([block(0, 0), block(1, 0)])  # overlap
    assert not covers_whole([block(0, 0), block(1, 2, shape=(6, 3))])  # disagreeing global shapes
    assert not covers_whole([])


def test_merge_uses_piece_grid_when_the_model_array_was_packed() -> None:
    from ckptd.writer.format import ArrayRecord
    from ckptd.writer.layout import ModelPiece
    from ckptd.writer.merge import _merged_array

    # a (2 layers, 64) bias: one piece per layer; packed on S3 into one (2, 64) chunk, else (1, 64) chunks
    piece = ModelPiece(key="decoder.bias", global_shape=(2, 64), global_offset=(1, 0), prepend_axis_num=1,
                       view_offset=0, view_shape=(64,), view_stride=(1,), replica_id=(0, 0, 0))
    packed = {"model/decoder.bias": ArrayRecord("model/decoder.bias", "float32", [2, 64], [2, 64])}
    per_layer = {"model/decoder.bias": ArrayRecord("model/decoder.bias", "float32", [2, 64], [1, 32])}
    assert _merged_array("m", "float32", piece, packed, None).chunks == (1, 64)
    assert _merged_array("m", "float32", piece, per_layer, None).chunks == (1, 32)


def test_storage_options_from_text_and_cli_flags() -> None:
    from ckptd.daemon.cli import _storage_options, build_parser
    from ckptd.writer.backends.s3 import S3Options
    from ckptd.writer.errors import ConfigError

    args = build_parser().parse_args(["ls", "s3://b/p", "--endpoint-url", "http://x:1", "--max-attempts", "3",
                                      "--storage-option", "conditional_put=false", "--storage-option", "fs-retries=2"])
    opts = S3Options.from_mapping(_storage_options(args))
    assert (opts.endpoint_url, opts.max_attempts, opts.fs_retries, opts.conditional_put) == ("http://x:1", 3, 2, False)
    with pytest.raises(ConfigError, match="conditional_put"):
        S3Options.from_mapping({"conditional_put": "maybe"})
    with pytest.raises(ConfigError, match="conditional_put"):  # text is converted by the CLI, not here
        S3Options.from_mapping({"conditional_put": "false"})
    with pytest.raises(ConfigError, match="conditional_put"):
        S3Options.typed_from_text({"conditional_put": "maybe"})
    with pytest.raises(ConfigError, match="unknown S3 options"):
        S3Options.from_mapping({"secret_access_key": "x"})  # credentials are not options
