"""The backend conformance suite against S3 (a moto server process on 127.0.0.1), and what only S3 has:
retry counters owned by the backend, multipart cleanup, the explicit non-atomic ``conditional_put=false``."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import pytest

from ckptd.testing.conformance import BackendConformance
from ckptd.testing.fixtures import BUCKET
from ckptd.testing.s3server import S3Server
from ckptd.writer.backends import Capabilities, RetryMetrics, open_backend
from ckptd.writer.backends.s3 import S3Backend
from ckptd.writer.errors import ConfigError

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


@pytest.fixture
def aws_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "region": "us-east-1", "addressing_style": "path", **extra}


class TestS3Backend(BackendConformance):
    expected = Capabilities(atomic_create=True, needs_fsync=False, multipart_cleanup=True)

    @pytest.fixture
    def backend_url(self, aws_env: S3Server) -> str:
        return f"s3://{BUCKET}/conformance-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def backend_options(self, aws_env: S3Server) -> Mapping[str, Any]:
        return s3_options(aws_env.endpoint_url)

    @pytest.fixture
    def missing_url(self) -> str:
        return "s3://no-such-bucket/run"


async def test_backend_owns_its_retry_counters_and_aborts_uploads(aws_env: S3Server) -> None:
    url = f"s3://{BUCKET}/owned-{uuid.uuid4().hex[:8]}"
    async with await open_backend(url, s3_options(aws_env.endpoint_url)) as backend:
        assert isinstance(backend, S3Backend) and isinstance(backend.metrics, RetryMetrics)
        assert not hasattr(backend.fs, "ckptd_metrics")  # nothing stuck onto the filesystem
        await backend.put("x", b"x")
        assert backend.metrics.retries == 0
        key = f"{url.split('/', 3)[3]}/step_1/big"
        aws_env.client().create_multipart_upload(Bucket=BUCKET, Key=key)
        assert await backend.abort_uploads("step_1") == 1


async def test_conditional_put_off_is_declared_not_atomic(aws_env: S3Server) -> None:
    url = f"s3://{BUCKET}/plain-{uuid.uuid4().hex[:8]}"
    async with await open_backend(url, s3_options(aws_env.endpoint_url, conditional_put=False)) as backend:
        assert backend.capabilities.atomic_create is False
        assert await backend.create("M", b"one") is True
        assert await backend.create("M", b"two") is False


async def test_options_are_typed(aws_env: S3Server) -> None:
    for bad in ({"max_attempts": "3"}, {"conditional_put": "false"}, {"no_such_option": 1}, {"read_timeout": 0}):
        with pytest.raises(ConfigError):
            await open_backend(f"s3://{BUCKET}/x", s3_options(aws_env.endpoint_url, **bad))


async def _committed_step(url: str, options: Mapping[str, Any]) -> None:
    import numpy as np

    from ckptd.writer.arrays import ChunkSink
    from ckptd.writer.commit import CheckpointWriter
    from ckptd.writer.format import (
        CHUNK_SEPARATOR,
        FORMAT_VERSION,
        ArrayRecord,
        ChunkRecord,
        PartManifest,
        ShardRecord,
        chunk_key,
    )

    async with await open_backend(url, options) as backend:
        data = np.arange(16, dtype=np.float32)
        crc, _ = await ChunkSink(backend).put(f"step_2/w/{chunk_key((0,), CHUNK_SEPARATOR)}", data)
        shard = ShardRecord(0, [0], [16], [ChunkRecord([0], 64, crc)])
        rec = ArrayRecord("w", "float32", [16], [16], [shard], separator=CHUNK_SEPARATOR)
        writer = CheckpointWriter(backend)
        await writer.write_part(PartManifest(format=FORMAT_VERSION, step=2, node=0, num_nodes=1, world_size=1,
                                             ranks=[0], arrays=[rec], objects={"0": {"n": 1}}, nbytes=64,
                                             written_at=0.0))
        await writer.commit(2, 1, timeout=10)


@pytest.mark.filterwarnings("error")
def test_readers_close_every_backend_they_open(aws_env: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    import torch

    from ckptd.client import reader
    from ckptd.writer.root import open_root

    url = f"s3://{BUCKET}/readers-{uuid.uuid4().hex[:8]}"
    opts = s3_options(aws_env.endpoint_url)
    asyncio.run(_committed_step(url, opts))
    counts = {"open": 0, "close": 0}
    real_open, real_close = S3Backend.open.__func__, S3Backend.close  # type: ignore[attr-defined]

    async def counting_open(cls: type[S3Backend], *args: Any, **kwargs: Any) -> S3Backend:
        counts["open"] += 1
        return await real_open(cls, *args, **kwargs)  # type: ignore[no-any-return]

    async def counting_close(self: S3Backend) -> None:
        counts["close"] += 1
        await real_close(self)

    monkeypatch.setattr(S3Backend, "open", classmethod(counting_open))
    monkeypatch.setattr(S3Backend, "close", counting_close)

    commit = reader.read_commit(url, "latest", storage_options=opts)
    flat = reader.read_flat(url, commit, {"w": (4, 100)}, storage_options=opts)
    template = {"w": torch.zeros(16), "n": 0}
    out = reader.load(url, 2, template, storage_options=opts)
    assert counts == {"open": 3, "close": 3}
    assert torch.equal(flat["w"], torch.arange(4, 16, dtype=torch.float32))
    assert torch.equal(template["w"], torch.arange(16, dtype=torch.float32)) and out["n"] == 1

    async def once() -> None:  # an opened root is shared by several reads and left open for its owner
        async with open_root(url, opts) as root:
            c = await reader.read_commit_async(root, "latest")
            await reader.read_flat_async(root, c, {"w": (0, 4)})
            await reader.load_async(root, c.step, {"w": torch.zeros(16)})

    asyncio.run(once())
    assert counts == {"open": 4, "close": 4}
