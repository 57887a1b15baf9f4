"""A second S3 implementation for tests: the npm package ``s3rver`` (disk-backed), on 127.0.0.1.

Installed project-locally by ``./bootstrap.sh setup`` (``npm install --prefix .ci s3rver@<pin>``, into
``.ci/node_modules``) where ``npm`` exists; :func:`s3rver_command` is ``None`` otherwise, and the tests
that need it skip. The server exposes the same surface as :class:`~ckptd.testing.s3server.S3Server`
(``endpoint_url``, ``env()``, ``client()``, ``make_bucket``, ``list_keys``), so S3 tests can be
parametrized over both. s3rver accepts the access key ``S3RVER`` (secret ``S3RVER``).

It implements less of S3 than moto: no ``ListMultipartUploads``, and answers a batch delete or a
conditional PUT differently; ckptd's optional capabilities degrade there (docs/operations.md).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from ckptd.testing.s3server import DEFAULT_REGION, S3Credentials

__all__ = ["S3RVER_CREDENTIALS", "S3rverServer", "s3rver_command"]

S3RVER_VERSION = "3.7.1"  # pinned in bootstrap.sh
S3RVER_CREDENTIALS = S3Credentials("S3RVER", "S3RVER")
_REPO = Path(__file__).resolve().parents[3]


def s3rver_command() -> list[str] | None:
    """How to run s3rver here: the project-local install, else one on ``PATH``; ``None`` if neither."""
    local = _REPO / ".ci" / "node_modules" / ".bin" / "s3rver"
    if local.exists() and shutil.which("node"):
        return [str(local)]
    found = shutil.which("s3rver")
    return [found] if found else None


class S3rverServer:
    """``s3rver`` in a subprocess with a temporary data directory, as a context manager."""

    credentials = S3RVER_CREDENTIALS
    region = DEFAULT_REGION

    def __init__(self, *, startup_timeout: float = 30.0) -> None:
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._port = 0

    def start(self) -> S3rverServer:
        cmd = s3rver_command()
        if cmd is None:
            raise RuntimeError("s3rver is not installed (./bootstrap.sh setup installs it where npm exists)")
        self._dir = tempfile.mkdtemp(prefix="ckptd-s3rver-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self._port = s.getsockname()[1]
        self._proc = subprocess.Popen(
            [*cmd, "-d", self._dir, "-a", "127.0.0.1", "-p", str(self._port), "--silent",
             "--allow-mismatched-signatures", "--no-vhost-buckets"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"s3rver exited with code {self._proc.returncode}: {err[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self._port)) == 0:
                    return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"s3rver did not listen on port {self._port} within {self.startup_timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stderr:
                self._proc.stderr.close()
            self._proc = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> S3rverServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def env(self, endpoint_url: str | None = None) -> dict[str, str]:
        """Credentials, region and endpoint for child processes (like ``S3Server.env``)."""
        return {
            "AWS_ACCESS_KEY_ID": self.credentials.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.credentials.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": endpoint_url or self.endpoint_url,
        }

    def client(self, endpoint_url: str | None = None) -> Any:
        import boto3

        return boto3.client(
            "s3", endpoint_url=endpoint_url or self.endpoint_url, region_name=self.region,
            aws_access_key_id=self.credentials.access_key_id,
            aws_secret_access_key=self.credentials.secret_access_key,
        )

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


if __name__ == "__main__":  # manual use: print the endpoint, serve until Ctrl-C
    with S3rverServer() as srv:
        print(srv.endpoint_url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    os._exit(0)
