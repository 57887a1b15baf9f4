"""A multipart write that fails or is cancelled aborts its own upload (``ckptd.writer.backends.s3_multipart``),
against the moto server behind the fault proxy: no parts are left stored and billed, the write's own error
is what propagates, and a cancelled write never waits on its abort longer than ``ABORT_TIMEOUT_S``."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import botocore.exceptions
import numpy as np
import pytest
import s3fs

from ckptd.testing.faultproxy import Fault, FaultProxy
from ckptd.testing.fixtures import BUCKET
from ckptd.testing.s3server import S3Server
from ckptd.writer.backends import s3_compat
from ckptd.writer.backends.s3 import S3Options, close_s3_filesystem, open_s3_filesystem

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

PART = 5 * 2**20  # S3's smallest part: three parts of an object of 2.2 parts
# part 2's PUT, and the abort (DELETE ?uploadId=..., which part uploads never are: they carry partNumber too)
PART_2_AND_ABORT = r"partNumber=2\b|\?uploadId=[^&]*$"


@pytest.fixture(autouse=True)
def fresh_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_compat, "_lacking", set())  # a later proxy may reuse this one's port


@pytest.fixture
async def fs(s3: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[s3fs.S3FileSystem]:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    opts = S3Options(endpoint_url=proxy.url, region="us-east-1", addressing_style="path", read_timeout=20.0,
                     multipart_concurrency=1)  # part 2 starts once part 1 is stored
    f = await open_s3_filesystem(f"s3://{BUCKET}/mp", opts)
    yield f
    await close_s3_filesystem(f)


def _data() -> bytes:
    return np.random.default_rng(7).integers(0, 256, int(2.2 * PART), dtype=np.uint8).tobytes()


def _uploads(s3: S3Server, key: str) -> list[dict[str, Any]]:
    return list(s3.client().list_multipart_uploads(Bucket=BUCKET, Prefix=key).get("Uploads", []))


async def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _first_part_stored(s3: S3Server, key: str) -> Callable[[], bool]:
    def check() -> bool:
        ups = _uploads(s3, key)
        client = s3.client()
        return bool(ups) and bool(
            client.list_parts(Bucket=BUCKET, Key=key, UploadId=ups[0]["UploadId"]).get("Parts")
        )
    return check


def _abort_left_over(s3: S3Server, key: str) -> None:
    for up in _uploads(s3, key):
        s3.client().abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up["UploadId"])


async def test_multipart_write_round_trips_and_leaves_no_upload(
    fs: s3fs.S3FileSystem, s3: S3Server, proxy: FaultProxy
) -> None:
    key = f"mp/{uuid.uuid4().hex}"
    data = _data()
    await fs._pipe_file(f"{BUCKET}/{key}", data, chunksize=PART, max_concurrency=2)
    assert s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read() == data
    assert proxy.stats().methods["PUT"] == 3  # three parts: it went multipart
    assert _uploads(s3, key) == []


async def test_cancelled_write_aborts_its_upload(fs: s3fs.S3FileSystem, s3: S3Server, proxy: FaultProxy) -> None:
    key = f"mp/{uuid.uuid4().hex}"
    proxy.set_faults(fail_all=Fault.STALL, methods=["PUT"], path_regex=r"partNumber=2\b", stall_s=60)
    task = asyncio.create_task(fs._pipe_file(f"{BUCKET}/{key}", _data(), chunksize=PART))
    try:
        await _until(_first_part_stored(s3, key))  # part 1 stored, part 2 hanging in the proxy
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=15)
        assert task in done and task.cancelled()
        assert _uploads(s3, key) == []
    finally:
        _abort_left_over(s3, key)


async def test_cancelled_again_the_writer_goes_and_the_abort_goes_on(
    fs: s3fs.S3FileSystem, s3: S3Server, proxy: FaultProxy
) -> None:
    key = f"mp/{uuid.uuid4().hex}"
    # the abort is held back long enough that the upload is still listed below, however slowly this process (its
    # boto3 client made anew) gets there on a loaded runner; waiting for it would take several seconds
    proxy.set_faults(methods=["PUT", "DELETE"], path_regex=PART_2_AND_ABORT, latency_s=5.0)
    task = asyncio.create_task(fs._pipe_file(f"{BUCKET}/{key}", _data(), chunksize=PART))
    try:
        await _until(_first_part_stored(s3, key))
        task.cancel()
        await asyncio.sleep(0.2)  # now waiting on its (delayed) abort
        start = time.monotonic()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=15)
        assert task in done and task.cancelled()
        assert time.monotonic() - start < 3.0  # did not wait for the abort (5 s away)
        assert _uploads(s3, key) != []
        await _until(lambda: _uploads(s3, key) == [], timeout=30)  # the shielded abort landed all the same
    finally:
        _abort_left_over(s3, key)


async def test_failed_part_error_propagates_and_a_refused_abort_is_remembered(
    fs: s3fs.S3FileSystem, s3: S3Server, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"mp/{uuid.uuid4().hex}"
    proxy.set_faults(fail_all=Fault.ERROR, error_status=403, error_code="AccessDenied", error_message="denied",
                     methods=["PUT", "DELETE"], path_regex=PART_2_AND_ABORT)
    caplog.set_level(logging.WARNING)
    try:
        for _ in range(2):
            with pytest.raises(PermissionError) as info:
                await fs._pipe_file(f"{BUCKET}/{key}", _data(), chunksize=PART)
            # the part's error, not the refused abort's
            cause = info.value.__cause__
            assert isinstance(cause, botocore.exceptions.ClientError) and cause.operation_name == "UploadPart"
        assert s3_compat.lacks(fs, s3_compat.MULTIPART_LISTING)
        warned = [r.getMessage() for r in caplog.records if "does not support multipart_listing" in r.getMessage()]
        assert len(warned) == 1 and proxy.url in warned[0], warned
        assert proxy.stats().methods["DELETE"] == 1  # refused once: not asked again
        assert len(_uploads(s3, key)) == 2  # left to the server's own cleanup, as documented
    finally:
        _abort_left_over(s3, key)


async def test_an_abort_that_hangs_is_given_up_in_time(
    fs: s3fs.S3FileSystem, s3: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr("ckptd.writer.backends.s3_multipart.ABORT_TIMEOUT_S", 0.5)
    key = f"mp/{uuid.uuid4().hex}"
    proxy.set_faults(fail_all=Fault.STALL, methods=["PUT", "DELETE"], path_regex=PART_2_AND_ABORT, stall_s=60)
    caplog.set_level(logging.WARNING)
    task = asyncio.create_task(fs._pipe_file(f"{BUCKET}/{key}", _data(), chunksize=PART))
    try:
        await _until(_first_part_stored(s3, key))
        start = time.monotonic()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=15)
        assert task in done and task.cancelled()
        assert time.monotonic() - start < 3.0
        assert any("was given up" in r.getMessage() and key in r.getMessage() for r in caplog.records)
    finally:
        _abort_left_over(s3, key)
