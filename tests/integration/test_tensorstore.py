"""A second zarr v3 implementation reads what the daemon writes: tensorstore's ``zarr3`` driver opens every
array of a committed step on a local root and on S3 (its own ``s3`` kvstore against the moto server on
127.0.0.1) and reads the bytes zarr-python reads and the client saved; zarr-python lists the root and every
group with warnings as errors (``ckptd.testing.interop``). ckptd's own load and verify read the same step.

One client saves tensors of every stored dtype to a local daemon (raw chunks) and an S3 daemon (``--codec
zstd``; default packing: small arrays are one whole-array chunk there): some with edge chunks that the
array's end cuts along one or both axes (zarr v3 stores them whole: format 3), and a 0-d one. The Megatron
layouts (DP buckets, ``ckptd merge``'s merged layout) go through the same check in
tests/integration/test_merge.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.reader import load
from ckptd.testing.fixtures import BUCKET
from ckptd.testing.interop import S3Access, check_readers
from ckptd.testing.launch import DaemonProcess
from ckptd.testing.s3server import S3Server
from ckptd.writer.arrays import verify_array
from ckptd.writer.format import step_dir
from ckptd.writer.root import open_root

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180)]

S3_URL = f"s3://{BUCKET}/tstore"


def _state() -> dict[str, Any]:
    """Tensors of every stored dtype; a ``chunk_shape`` smaller than the array leaves edge chunks."""
    g = torch.Generator().manual_seed(7)
    return {
        "edge": {
            "bf16": Shard("edge/bf16", torch.randn(10, 3, generator=g).to(torch.bfloat16), (10, 3), (0, 0),
                          chunk_shape=(4, 3)),  # rows 8..9 cut
            "f32": Shard("edge/f32", torch.randn(5, 7, generator=g), (5, 7), (0, 0), chunk_shape=(2, 3)),  # both axes
            "i64": Shard("edge/i64", torch.arange(7, dtype=torch.int64) - 3, (7,), (0,), chunk_shape=(3,)),
            "bool": Shard("edge/bool", torch.rand(9, generator=g) > 0.5, (9,), (0,), chunk_shape=(4,)),
        },
        "f16": torch.randn(6, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i32": torch.arange(-4, 4, dtype=torch.int32),
        "i16": torch.arange(5, dtype=torch.int16),
        "i8": torch.arange(-6, 6, dtype=torch.int8).view(3, 4),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "f8": torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5, dtype=torch.float64),  # a 0-d array: one chunk named "c"
        "empty": torch.zeros(0, 4),  # no chunk at all
        "step": 1,
    }


def _leaves(state: dict[str, Any], path: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in state.items():
        key = f"{path}/{k}" if path else k
        if isinstance(v, dict):
            yield from _leaves(v, key)
        elif isinstance(v, (Shard, torch.Tensor)):
            yield key, v.data if isinstance(v, Shard) else v  # one rank: a Shard is its whole array


def _stored(t: torch.Tensor) -> np.ndarray:
    """A tensor as its array stores it: bfloat16 as uint16 bits, float8 as uint8 bits (0-d stays 0-d)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    return {k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v.data if isinstance(v, Shard) else v)
            for k, v in state.items() if isinstance(v, (dict, Shard, torch.Tensor))}


@pytest.fixture(scope="module")
def saved(s3: S3Server, module_sockdir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Step 1 saved by one client to a local root (returned) and to ``S3_URL``."""
    tmp = tmp_path_factory.mktemp("tstore")
    root = str(tmp / "ckpt")
    flags = ["--arena-size", "16MiB", "--no-prefault"]
    s3_flags = ["--endpoint-url", s3.endpoint_url, "--addressing-style", "path", "--region", s3.region]
    daemons = [
        DaemonProcess(root, os.path.join(module_sockdir, "local.sock"), *flags, log_path=str(tmp / "local.log")),
        DaemonProcess(S3_URL, os.path.join(module_sockdir, "s3.sock"), *flags, *s3_flags, "--codec", "zstd",
                      env={**os.environ, **s3.env()}, log_path=str(tmp / "s3.log")),
    ]
    try:
        for d in daemons:
            client = CheckpointClient(d.wait_ready().socket, placement=Placement(0, 1, 1, 0))
            client.save(1, _state()).wait(60)
            client.close()
    finally:
        for d in daemons:
            d.stop(timeout=20)
    return root


async def _verify(url: str) -> int:
    """What ``ckptd verify`` does to each array of the step."""
    async with open_root(url) as root:
        commit = await root.read_commit(1)
        return sum([await verify_array(root.store, step_dir(1), rec) for rec in commit.arrays])


def _check_load(url: str, options: dict[str, Any] | None = None) -> None:
    loaded = dict(_leaves(load(url, 1, _zeros(_state()), storage_options=options)))
    for key, want in _leaves(_state()):
        assert _stored(loaded[key]).tobytes() == _stored(want).tobytes(), f"ckptd's load of {key}"


def test_tensorstore_reads_a_local_root_as_zarr_python_does(saved: str) -> None:
    expected = {key: _stored(t) for key, t in _leaves(_state())}
    arrays = check_readers(saved, expected=expected)
    assert arrays["edge/f32"].chunks == (2, 3)  # the edge chunks are there
    _check_load(saved)
    assert asyncio.run(_verify(saved)) > 0


def test_tensorstore_reads_an_s3_root_as_zarr_python_does(saved: str, s3: S3Server,
                                                          s3_options: dict[str, Any]) -> None:
    expected = {key: _stored(t) for key, t in _leaves(_state())}
    access = S3Access(s3.endpoint_url, s3.region, s3.credentials.access_key_id, s3.credentials.secret_access_key)
    arrays = check_readers(S3_URL, s3=access, expected=expected)
    codecs = {path: [c.to_dict()["name"] for c in arr.metadata.codecs] for path, arr in arrays.items()}
    assert codecs["edge/bf16"] == ["bytes", "zstd", "crc32c"]  # the daemon's --codec
    _check_load(S3_URL, s3_options)
