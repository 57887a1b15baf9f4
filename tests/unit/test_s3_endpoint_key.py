"""S3 capability flags are kept per endpoint as botocore resolved it (``s3_compat.endpoint_of``): an endpoint
set through ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` is that endpoint, not "AWS". No request is sent."""

from __future__ import annotations

import logging
import os

import pytest

from ckptd.writer.backends import s3_compat
from ckptd.writer.backends.s3 import S3Options, close_s3_filesystem, open_s3_filesystem


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_compat, "_lacking", set())
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
async def test_environment_endpoints_do_not_share_flags(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, variable: str
) -> None:
    opts = S3Options(region="us-east-1", addressing_style="path")  # no endpoint_url option
    caplog.set_level(logging.DEBUG, logger="ckptd.writer.backends")
    monkeypatch.setenv(variable, "http://127.0.0.1:19001")
    minio = await open_s3_filesystem("s3://bucket/run", opts)
    monkeypatch.setenv(variable, "http://127.0.0.1:19002")
    other = await open_s3_filesystem("s3://bucket/run", opts)
    monkeypatch.delenv(variable)
    aws = await open_s3_filesystem("s3://bucket/run", opts)
    try:
        assert "endpoint=http://127.0.0.1:19001" in caplog.text  # the open names the env's endpoint
        s3_compat.mark_lacking(minio, s3_compat.BATCH_DELETE, None)
        assert s3_compat.lacks(minio, s3_compat.BATCH_DELETE)
        assert not s3_compat.lacks(other, s3_compat.BATCH_DELETE)
        assert not s3_compat.lacks(aws, s3_compat.BATCH_DELETE)
        warned = [r.getMessage() for r in caplog.records if "does not support" in r.getMessage()]
        assert len(warned) == 1 and "http://127.0.0.1:19001" in warned[0], warned
        assert s3_compat.endpoint_of(aws).endswith("amazonaws.com")
    finally:
        for fs in (minio, other, aws):
            await close_s3_filesystem(fs)
    assert s3_compat.lacks(minio, s3_compat.BATCH_DELETE)  # the same endpoint once closed
