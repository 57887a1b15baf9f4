"""A real S3-compatible HTTP server for tests and benchmarks: moto's threaded server in a subprocess.

The server runs in its own OS process (``python s3server.py --serve``), bound to 127.0.0.1 on a port
the kernel picks; the child reports the port on stdout and exits when its stdin closes, so a crashed
test run never leaves a server behind. Importable without pytest::

    with S3Server() as s3:
        s3.make_bucket("ckpt")
        env = s3.env()          # fake credentials + endpoint for child processes

With ``auth=True`` moto checks signatures against its IAM backend: the server gets one IAM user with
full access, :attr:`S3Server.credentials` holds that user's key, and wrong keys fail with
``InvalidAccessKeyId`` / ``SignatureDoesNotMatch`` like real S3.

moto keeps every object in memory (about twice the payload): size benchmarks accordingly.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ckptd.testing import child_server

__all__ = ["DEFAULT_REGION", "S3Credentials", "S3Server", "S3ServerError"]

DEFAULT_REGION = "us-east-1"
_READY_PREFIX = "CKPTD_S3SERVER_PORT="


class S3ServerError(RuntimeError):
    """The moto server did not start, or stopped unexpectedly."""


@dataclass(frozen=True)
class S3Credentials:
    """A static access key pair (fake unless the server runs with ``auth=True``)."""

    access_key_id: str
    secret_access_key: str

    def __repr__(self) -> str:  # keep secrets out of assertion messages and logs
        return f"S3Credentials(access_key_id={self.access_key_id!r}, secret_access_key='***')"


FAKE_CREDENTIALS = S3Credentials("testing", "testing")


class S3Server:
    """moto's S3 server in a subprocess on 127.0.0.1, as a context manager.

    Parameters
    ----------
    auth:
        Enforce SigV4 authentication against moto's IAM backend (see module docstring).
    startup_timeout:
        Seconds to wait for the child to answer HTTP before giving up.
    region:
        Region reported to clients (moto accepts any).
    """

    def __init__(
        self, *, auth: bool = False, startup_timeout: float = 30.0, region: str = DEFAULT_REGION
    ) -> None:
        self.auth = auth
        self.startup_timeout = startup_timeout
        self.region = region
        self.credentials: S3Credentials = FAKE_CREDENTIALS
        self._proc: subprocess.Popen[str] | None = None
        self._port: int | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="ckptd-moto-", suffix=".log", delete=False)  # noqa: SIM115

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> S3Server:
        """Start the child and wait until it answers HTTP; idempotent."""
        if self._proc is not None:
            return self
        env = dict(os.environ)
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)  # auth is switched on later, over HTTP
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd.testing.s3server", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,  # a Ctrl-C in the test runner must not kill it mid-teardown
        )
        try:
            self._port = self._read_port(self._proc)
            self._wait_until_answering()
            if self.auth:
                self._enable_auth()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child: close its stdin (it exits on EOF), then SIGTERM, then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        child_server.stop(proc, timeout)
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise S3ServerError("server not started")
        return self._proc.pid

    @property
    def port(self) -> int:
        if self._port is None:
            raise S3ServerError("server not started")
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- clients and environment -------------------------------------------------------------------
    def env(self, endpoint_url: str | None = None) -> dict[str, str]:
        """Environment for a child process that should reach this server through the AWS chain.

        Credentials, region and ``AWS_ENDPOINT_URL_S3`` (``endpoint_url`` overrides it, e.g. a fault
        proxy); config files point at /dev/null and instance metadata is off, so nothing on the host
        leaks in and nothing waits on a metadata endpoint.
        """
        return {
            "AWS_ACCESS_KEY_ID": self.credentials.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.credentials.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": endpoint_url or self.endpoint_url,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, endpoint_url: str | None = None, credentials: S3Credentials | None = None) -> Any:
        """A synchronous boto3 S3 client (path-style addressing) for test setup and inspection."""
        import boto3
        from botocore.config import Config

        creds = credentials or self.credentials
        return boto3.client(
            "s3",
            endpoint_url=endpoint_url or self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=creds.access_key_id,
            aws_secret_access_key=creds.secret_access_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1, "mode": "standard"}),
        )

    def make_bucket(self, name: str) -> str:
        """Create ``name`` (no error if it exists) and return it."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        return name

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` in ``bucket``, sorted."""
        paginator = self.client().get_paginator("list_objects_v2")
        keys: list[str] = []
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return sorted(keys)

    def reset(self) -> None:
        """Drop every bucket and object (moto's ``/moto-api/reset``); auth stays on, with a new key."""
        if self.auth:
            self._post("/moto-api/reset-auth", b"inf")  # the reset also drops the IAM user
        self._post("/moto-api/reset", b"")
        if self.auth:
            self._enable_auth()

    # --- internals ---------------------------------------------------------------------------------
    def _read_port(self, proc: subprocess.Popen[str]) -> int:
        port = child_server.read_port(proc, _READY_PREFIX, self.startup_timeout)
        if port is None:
            raise S3ServerError(
                f"moto server did not report a port within {self.startup_timeout}s{self._tail()}"
            )
        return port

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise S3ServerError(f"moto server exited with {self._proc.returncode}{self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/data.json", timeout=2) as resp:
                    resp.read()
                return
            except (urllib.error.URLError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise S3ServerError(f"moto server not answering: {exc}{self._tail()}") from exc
                time.sleep(0.05)

    def _enable_auth(self) -> None:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=FAKE_CREDENTIALS.access_key_id,
            aws_secret_access_key=FAKE_CREDENTIALS.secret_access_key,
        )
        user = "ckptd-test"
        with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
            iam.create_user(UserName=user)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        self.credentials = S3Credentials(key["AccessKeyId"], key["SecretAccessKey"])
        self._post("/moto-api/reset-auth", b"0")  # every later request must be signed by a known key

    def _post(self, path: str, body: bytes) -> None:
        # text/plain: with urllib's default form type, werkzeug hands moto an empty ``request.data``
        req = urllib.request.Request(
            f"{self.endpoint_url}{path}", data=body, method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def _tail(self) -> str:
        try:
            text = Path(self._log.name).read_text(errors="replace")[-2000:]
        except OSError:
            return ""
        return f"\n--- moto server log (tail) ---\n{text}" if text else ""


def _serve() -> None:
    """Child entry point: run moto on 127.0.0.1:<free port> until stdin closes or SIGTERM."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _host, port = server.get_host_and_port()
    child_server.serve_until_parent_leaves(_READY_PREFIX, port)
    server.stop()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:
        with S3Server() as s3:
            print(json.dumps({"endpoint_url": s3.endpoint_url, "pid": s3.pid}), flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while s3.running:
                    time.sleep(1)
