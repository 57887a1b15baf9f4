"""A second zarr v3 implementation reads ckptd's checkpoints: tensorstore's ``zarr3`` driver opens every array
of a committed step — the DP layout a save writes and the merged layout ``ckptd merge`` adds — on a local
root and on S3 (its own ``s3`` kvstore against the moto server on 127.0.0.1), and reads the same bytes as
zarr-python and as the tensors the rank saved. zarr-python lists the root and every group with warnings
turned into errors.

One real save serves both roots: one gloo rank trains the toy Megatron GPT (bf16, distributed optimizer) and
saves to a local daemon and an S3 daemon (``--codec zstd``, and default packing: small arrays are one
whole-array chunk there; the merge writes raw chunks on both),
plus plain tensors of every stored dtype, some with edge chunks that the array's end cuts (zarr v3 stores
those whole: format 3). Then ``ckptd merge`` runs on both roots.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import zarr

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.megatron import OPTIM_META, get_layout, model_state, optimizer_meta, optimizer_shards
from ckptd.client.reader import load
from ckptd.testing.fixtures import BUCKET, unavailable
from ckptd.testing.launch import DaemonProcess, run_ranks
from ckptd.testing.s3server import S3Server
from ckptd.writer.arrays import verify_array
from ckptd.writer.format import CONTROL_DIR, sidecar_name, step_dir
from ckptd.writer.root import open_root

pytestmark = [pytest.mark.megatron, pytest.mark.s3, pytest.mark.timeout(240)]

CLI = [sys.executable, "-m", "ckptd.daemon.cli"]
S3_PREFIX = "tstore"
S3_FLAGS = ["--addressing-style", "path", "--region", "us-east-1"]


@pytest.fixture(autouse=True, scope="module")
def _tensorstore() -> None:
    try:
        import tensorstore  # noqa: F401
    except ImportError:
        unavailable("tensorstore is not installed (the test extra pins it)")


def _extras() -> dict[str, Any]:
    """Plain tensors of every stored dtype; ``chunk_shape`` smaller than the array leaves edge chunks."""
    g = torch.Generator().manual_seed(7)
    b16 = torch.randn(10, 3, generator=g).to(torch.bfloat16)
    f32 = torch.randn(5, 7, generator=g)
    i64 = torch.arange(7, dtype=torch.int64) - 3
    flags = torch.rand(9, generator=g) > 0.5
    return {
        "extra": {
            "bf16_edge": Shard("extra/bf16_edge", b16, (10, 3), (0, 0), chunk_shape=(4, 3)),  # rows 8..9 cut
            "f32_edge2d": Shard("extra/f32_edge2d", f32, (5, 7), (0, 0), chunk_shape=(2, 3)),  # cut on both axes
            "i64_edge": Shard("extra/i64_edge", i64, (7,), (0,), chunk_shape=(3,)),
            "bool_edge": Shard("extra/bool_edge", flags, (9,), (0,), chunk_shape=(4,)),
            "f16": torch.randn(6, generator=g).half(),
            "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
            "i32": torch.arange(-4, 4, dtype=torch.int32),
            "i16": torch.arange(5, dtype=torch.int16),
            "i8": torch.arange(-6, 6, dtype=torch.int8).view(3, 4),
            "u8": torch.arange(250, 256, dtype=torch.uint8),
            "f8": torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn),
            "scalar": torch.tensor(2.5, dtype=torch.float64),  # a 0-d array: one chunk named "c"
        }
    }


def _leaves(state: dict[str, Any], path: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in state.items():
        key = f"{path}/{k}" if path else k
        if isinstance(v, dict):
            yield from _leaves(v, key)
        else:
            yield key, v


def _stored(t: torch.Tensor) -> np.ndarray:
    """A tensor as its array stores it: bfloat16 as uint16 bits, float8 as uint8 bits."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def _global_arrays(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every array the save writes, as the rank staged it (one rank: each Shard's region of its array)."""
    full: dict[str, torch.Tensor] = {}
    for path, value in _leaves(state):
        if isinstance(value, Shard):
            block = torch.empty(value.data.shape, dtype=value.data.dtype)
            value.stage_into(block)  # bucket slices assemble themselves from the live optimizer here
            whole = full.setdefault(value.key, torch.zeros(value.global_shape, dtype=block.dtype))
            whole[tuple(slice(o, o + n) for o, n in zip(value.global_offset, block.shape, strict=True))] = block
        elif isinstance(value, torch.Tensor):
            full[path] = value.clone()
    return {key: np.array(_stored(t)) for key, t in full.items()}  # ascontiguousarray would make 0-d 1-d


def _rank_save(rank: int, world: int, sockets: list[str], step: int) -> dict[str, np.ndarray]:
    from ckptd.testing.cpu_shim import install_cpu_shim
    from ckptd.testing.toy_gpt import build_gpt

    install_cpu_shim()
    model, optimizer, train_step = build_gpt(bf16=True)
    train_step(0)
    layout = get_layout(model, optimizer)
    text = layout.to_json()
    state = {
        **model_state(model),
        **optimizer_shards(optimizer, layout),
        OPTIM_META: optimizer_meta(optimizer, layout),
        "megatron": {"layout": sidecar_name(text)},
        **_extras(),
    }
    for sock in sockets:
        client = CheckpointClient(sock, placement=Placement(rank, world, world, 0))
        client.save(step, state, sidecars=[text]).wait(120)
        client.close()
    return _global_arrays(state)


@pytest.fixture(scope="module")
def saved(
    s3: S3Server, s3_options: dict[str, object], module_sockdir: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict[str, np.ndarray]]:
    """Step 1 saved by one rank to both roots, then merged and verified there: the local root, and the saved
    arrays by key."""
    tmp = tmp_path_factory.mktemp("tstore")
    local_root, s3_root = str(tmp / "ckpt"), f"s3://{BUCKET}/{S3_PREFIX}"
    env = {**os.environ, **s3.env()}
    flags = ["--arena-size", "64MiB", "--no-prefault"]
    local = DaemonProcess(local_root, os.path.join(module_sockdir, "local.sock"), *flags,
                          log_path=str(tmp / "local.log"))
    remote = DaemonProcess(s3_root, os.path.join(module_sockdir, "s3.sock"), *flags, *S3_FLAGS, "--codec", "zstd",
                           "--endpoint-url", s3.endpoint_url, env=env, log_path=str(tmp / "s3.log"))
    try:
        local.wait_ready()
        remote.wait_ready()
        expected = run_ranks(_rank_save, 1, [local.socket, remote.socket], 1, timeout_s=180)[0]
    finally:
        local.stop(timeout=20)
        remote.stop(timeout=20)
    s3_args = ["--endpoint-url", s3.endpoint_url, *S3_FLAGS]
    merges = [subprocess.Popen([*CLI, "merge", root, "--step", "1", "--json", *extra], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for root, extra in ((local_root, []), (s3_root, s3_args))]  # the real command, both roots at once
    for proc in merges:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"ckptd merge: {out}{err}"
    return local_root, expected


def _check(url: str, options: dict[str, Any] | None, group: Callable[[str], zarr.Group],
           kvstore: Callable[[str], dict[str, Any]], expected: dict[str, np.ndarray]) -> dict[str, zarr.Array]:
    """zarr-python lists without a warning; tensorstore reads every array as zarr-python and the rank did;
    ckptd's own load and verify read the same step (edge chunks stored whole since format 3)."""
    import tensorstore as ts

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zarr-python warns about any object in a group's folder that is no node
        assert sorted(group("").group_keys()) == ["step_1"]
        step = group("step_1")
        members = dict(step.members(max_depth=None))
        for name, node in members.items():
            if isinstance(node, zarr.Group):
                group(f"step_1/{name}").members()
    arrays = {name: node for name, node in members.items() if isinstance(node, zarr.Array)}
    merged = [name for name in arrays if name.startswith("merged/optimizer.state.")]
    assert merged and set(expected) <= set(arrays), sorted(set(expected) - set(arrays))
    assert CONTROL_DIR in arrays and f"merged/{CONTROL_DIR}" in arrays  # control folders read as empty arrays
    context = ts.Context()  # one thread pool and HTTP client for every array
    opened = [ts.open({"driver": "zarr3", "kvstore": kvstore(f"step_1/{name}/")}, read=True, context=context)
              for name in arrays]
    reads = [future.result().read() for future in opened]
    for (name, arr), read in zip(arrays.items(), reads, strict=True):
        z = np.asarray(arr[...])
        t = np.asarray(read.result())
        assert (t.dtype, t.shape) == (z.dtype, z.shape), name
        assert t.tobytes() == z.tobytes(), f"{name}: tensorstore and zarr-python read different bytes"
        if name in expected:
            assert (t.dtype, t.shape) == (expected[name].dtype, expected[name].shape), name
            assert t.tobytes() == expected[name].tobytes(), f"{name}: differs from the saved tensor"
    # ckptd's own load (whole arrays: a Shard's key is its path here) and verify
    template = {key: torch.zeros_like(v.data if isinstance(v, Shard) else v) for key, v in _leaves(_extras())}
    loaded = dict(_leaves(load(url, 1, _nest(template), storage_options=options)))
    for key in template:
        assert _stored(loaded[key]).tobytes() == expected[key].tobytes(), f"ckptd's load of {key}"
    if options is None:  # on S3 the same code reads through another store: left to tests/integration/test_s3.py
        assert asyncio.run(_verify(url, options)) > 0
    return arrays


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


async def _verify(url: str, options: dict[str, Any] | None) -> int:
    """What ``ckptd verify`` does to each array of the step and of its merged layout."""
    async with open_root(url, options) as root:
        commit, merged = await root.read_commit(1), await root.read_merged_manifest(1)
        assert merged is not None
        return sum([await verify_array(root.store, step_dir(1), rec) for rec in [*commit.arrays, *merged.arrays]])


def test_tensorstore_reads_local_root_as_zarr_does(saved: tuple[str, dict[str, np.ndarray]]) -> None:
    root, expected = saved
    _check(root, None, lambda path: zarr.open_group(os.path.join(root, path), mode="r"),
           lambda path: {"driver": "file", "path": os.path.join(root, path)}, expected)


def test_tensorstore_reads_s3_root_as_zarr_does(
    saved: tuple[str, dict[str, np.ndarray]], s3: S3Server, s3_options: dict[str, Any]
) -> None:
    fs_options = {"endpoint_url": s3.endpoint_url, "key": s3.credentials.access_key_id,
                  "secret": s3.credentials.secret_access_key}
    url = f"s3://{BUCKET}/{S3_PREFIX}"
    arrays = _check(
        url, s3_options, lambda path: zarr.open_group(f"{url}/{path}", mode="r", storage_options=fs_options),
        lambda path: {"driver": "s3", "bucket": BUCKET, "path": f"{S3_PREFIX}/{path}", "endpoint": s3.endpoint_url,
                      "aws_region": s3.region},
        saved[1],
    )
    codecs = {name: [c.to_dict()["name"] for c in arr.metadata.codecs] for name, arr in arrays.items()}
    assert codecs["extra/bf16_edge"] == ["bytes", "zstd", "crc32c"]  # the daemon's --codec
    assert codecs["model/embedding.word_embeddings.weight"] == ["bytes", "zstd", "crc32c"]

