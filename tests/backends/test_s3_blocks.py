"""The S3 building blocks against a real moto server process: the server helper, the fault proxy,
and ``ckptd.writer.backends.s3`` (retries, typed errors, conditional PUT, multipart GC)."""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

import botocore.exceptions
import numpy as np
import pytest
import s3fs
import zarr.api.asynchronous as za
from zarr.storage import FsspecStore

from ckptd.testing.faultproxy import Fault, FaultProxy, FaultProxyProcess
from ckptd.testing.fixtures import BUCKET, TRANSIENT_20
from ckptd.testing.s3server import S3Credentials, S3Server
from ckptd.writer.backends.s3 import (
    S3Options,
    abort_incomplete_uploads,
    check_bucket,
    classify_error,
    close_s3_filesystem,
    open_s3_filesystem,
    put_if_absent,
)
from ckptd.writer.errors import (
    CkptdError,
    ConfigError,
    InvalidRequestError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


# --- fixtures -------------------------------------------------------------------------------------
@pytest.fixture
def aws_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


def options(endpoint: str, **overrides: object) -> S3Options:
    base: dict[str, object] = {
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "addressing_style": "path",
        "max_attempts": 5,
        "fs_retries": 3,
        "connect_timeout": 2.0,
        "read_timeout": 5.0,
    }
    return S3Options.from_mapping({**base, **overrides})


@pytest.fixture
async def fs_via_proxy(aws_env: S3Server, proxy: FaultProxy) -> AsyncIterator[s3fs.S3FileSystem]:
    fs = await open_s3_filesystem(f"s3://{BUCKET}/t", options(proxy.url))
    yield fs
    await close_s3_filesystem(fs)


# moto (auth off) serves private objects to any request that carries an Authorization header
AUTH = (
    "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00"
)


def raw_request(
    url: str, method: str, path: str, body: bytes | None = None, timeout: float = 10.0
) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Authorization": AUTH})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# --- the server helper ----------------------------------------------------------------------------
def test_server_starts_serves_and_stops() -> None:
    server = S3Server().start()
    try:
        pid, port = server.pid, server.port
        assert server.endpoint_url == f"http://127.0.0.1:{port}"
        server.make_bucket("lifecycle")
        server.client().put_object(Bucket="lifecycle", Key="a/b", Body=b"hello")
        assert server.list_keys("lifecycle") == ["a/b"]
        env = server.env()
        assert env["AWS_ENDPOINT_URL_S3"] == server.endpoint_url and env["AWS_ACCESS_KEY_ID"]
    finally:
        server.stop()
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


# --- the proxy, at the HTTP level (no client retries) ---------------------------------------------
@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        (Fault.SLOWDOWN, 503, "SlowDown"),
        (Fault.INTERNAL, 500, "InternalError"),
        (Fault.THROTTLE, 429, "Throttling"),
    ],
)
def test_proxy_injects_error_replies(
    s3: S3Server, proxy: FaultProxy, fault: Fault, status: int, code: str
) -> None:
    s3.client().put_object(Bucket=BUCKET, Key="err/obj", Body=b"payload")
    proxy.set_faults(fail_all=fault, max_faults=1)
    got_status, body = raw_request(proxy.url, "GET", f"/{BUCKET}/err/obj")
    assert got_status == status and f"<Code>{code}</Code>".encode() in body
    assert raw_request(proxy.url, "GET", f"/{BUCKET}/err/obj") == (200, b"payload")  # budget spent
    stats = proxy.stats()
    assert stats.faults == {fault.value: 1} and stats.requests == 2 and stats.forwarded == 1
    assert stats.statuses == {status: 1, 200: 1}


def test_proxy_resets_connections(s3: S3Server, proxy: FaultProxy) -> None:
    big = os.urandom(4 << 20)
    s3.client().put_object(Bucket=BUCKET, Key="reset/big", Body=big)

    proxy.set_faults(fail_all=Fault.RESET_BEFORE, max_faults=1)
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        raw_request(proxy.url, "GET", f"/{BUCKET}/reset/big")

    proxy.set_faults(fail_all=Fault.RESET_MID_REQUEST, max_faults=1)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        raw_request(proxy.url, "PUT", f"/{BUCKET}/reset/never", body=big)

    proxy.set_faults(fail_all=Fault.RESET_MID_RESPONSE, max_faults=1)
    with pytest.raises((ConnectionError, http.client.IncompleteRead)):
        raw_request(proxy.url, "GET", f"/{BUCKET}/reset/big")
    # a PUT cut in its response was applied upstream: the client cannot tell, which is the point
    proxy.set_faults(fail_all=Fault.RESET_MID_RESPONSE, max_faults=1)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        raw_request(proxy.url, "PUT", f"/{BUCKET}/reset/applied", body=b"x" * 1000)

    assert "reset/never" not in "".join(s3.list_keys(BUCKET, "reset/"))
    assert s3.list_keys(BUCKET, "reset/") == ["reset/applied", "reset/big"]
    assert raw_request(proxy.url, "GET", f"/{BUCKET}/reset/big") == (200, big)
    stats = proxy.stats()
    assert stats.faults == {"reset_before": 1, "reset_mid_request": 1, "reset_mid_response": 2}
    assert stats.requests == 5 and stats.forwarded == 3


def test_proxy_latency_and_stall(s3: S3Server, proxy: FaultProxy) -> None:
    s3.client().put_object(Bucket=BUCKET, Key="slow/obj", Body=b"x")
    proxy.set_faults(latency_s=0.3)
    start = time.monotonic()
    assert raw_request(proxy.url, "GET", f"/{BUCKET}/slow/obj") == (200, b"x")
    assert time.monotonic() - start >= 0.3
    proxy.set_faults(fail_all=Fault.STALL, stall_s=0.4, max_faults=1)
    start = time.monotonic()
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        raw_request(proxy.url, "GET", f"/{BUCKET}/slow/obj")
    assert time.monotonic() - start >= 0.4
    proxy.set_faults(fail_all=Fault.STALL, stall_s=5.0, max_faults=1)
    with pytest.raises(TimeoutError):
        raw_request(proxy.url, "GET", f"/{BUCKET}/slow/obj", timeout=0.3)
    stats = proxy.stats()
    assert stats.delayed == 1 and stats.faults == {"stall": 2}


def test_proxy_fraction_and_filters(s3: S3Server, proxy: FaultProxy) -> None:
    s3.client().put_object(Bucket=BUCKET, Key="frac/obj", Body=b"x")
    proxy.set_faults(slowdown=0.5, seed=7, methods=["GET"])
    statuses = [raw_request(proxy.url, "GET", f"/{BUCKET}/frac/obj")[0] for _ in range(100)]
    assert 30 <= statuses.count(503) <= 70 and statuses.count(503) + statuses.count(200) == 100
    assert raw_request(proxy.url, "HEAD", f"/{BUCKET}/frac/obj")[0] == 200  # HEAD not eligible
    assert proxy.stats().faults == {"slowdown": statuses.count(503)}
    with pytest.raises(ValueError):
        proxy.set_faults(slowdown=0.7, internal=0.7)


def test_proxy_streams_chunked_keepalive_and_expect(s3: S3Server, proxy: FaultProxy) -> None:
    pieces = [os.urandom(1 << 20) for _ in range(6)]
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request(
        "PUT",
        f"/{BUCKET}/stream/chunked",
        body=iter(pieces),
        encode_chunked=True,
        headers={"Authorization": AUTH},
    )
    assert conn.getresponse().read() is not None
    conn.request(
        "GET", f"/{BUCKET}/stream/chunked", headers={"Authorization": AUTH}
    )  # same connection: keep-alive to the client
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b"".join(pieces)
    conn.close()
    assert proxy.stats().connections == 1 and proxy.stats().requests == 2

    # Expect: 100-continue is answered by the proxy, or refused before the body when a fault hits
    body = b"e" * 100_000
    head = (
        f"PUT /{BUCKET}/stream/expect HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(head)
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    proxy.set_faults(fail_all=Fault.SLOWDOWN)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(head)
        assert sock.recv(64).startswith(b"HTTP/1.1 503")


def test_proxy_relays_chunked_responses() -> None:
    payload = [os.urandom(300_000) for _ in range(4)]

    class Chunked(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in payload:
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args: object) -> None:
            pass

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Chunked)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}") as p:
            assert raw_request(p.url, "GET", "/x") == (200, b"".join(payload))
            assert raw_request(p.url, "GET", "/y") == (200, b"".join(payload))
    finally:
        upstream.shutdown()
        upstream.server_close()


def test_proxy_process_control(s3: S3Server) -> None:
    s3.client().put_object(Bucket=BUCKET, Key="proc/obj", Body=b"x")
    with FaultProxyProcess(s3.endpoint_url) as p:
        p.set_faults(fail_all=Fault.INTERNAL, max_faults=2)
        assert [raw_request(p.url, "GET", f"/{BUCKET}/proc/obj")[0] for _ in range(3)] == [500, 500, 200]
        stats = p.stats()
        assert stats.faults == {"internal": 2} and stats.requests == 3
        p.reset_stats()
        assert p.stats().requests == 0


# --- the writer's S3 filesystem through faults ----------------------------------------------------
async def test_writes_survive_transient_faults_bit_exact(
    fs_via_proxy: s3fs.S3FileSystem, proxy: FaultProxy
) -> None:
    fs = fs_via_proxy
    proxy.set_faults(**TRANSIENT_20, throttle_code="TooManyRequests", seed=11)
    rng = np.random.default_rng(0)
    arr = rng.standard_normal(2 << 20, dtype=np.float32)  # 8 MiB in 32 chunks
    store = FsspecStore(fs, path=f"{BUCKET}/t/zarr")
    a = await za.create_array(
        store, name="w", shape=arr.shape, dtype=arr.dtype, chunks=(1 << 16,), compressors=None
    )
    await a.setitem(slice(None), arr)
    blob = rng.bytes(12 << 20)
    await fs._pipe_file(f"{BUCKET}/t/multipart", blob, chunksize=5 << 20)
    singles = {f"{BUCKET}/t/single{i}": rng.bytes(100_000 + i) for i in range(10)}
    for path, data in singles.items():
        await fs._pipe_file(path, data)

    # read back with faults still on
    back = await (
        await za.open_array(store=FsspecStore(fs, path=f"{BUCKET}/t/zarr", read_only=True), path="w")
    ).getitem(slice(None))
    assert np.array_equal(np.asarray(back).view(np.uint32), arr.view(np.uint32))
    assert await fs._cat_file(f"{BUCKET}/t/multipart") == blob
    for path, data in singles.items():
        assert await fs._cat_file(path) == data
    stats = proxy.stats()
    assert stats.total_faults >= 10, stats
    assert len(stats.faults) >= 4, stats  # several kinds really hit


async def test_throttled_head_is_retried(
    fs_via_proxy: s3fs.S3FileSystem, proxy: FaultProxy, s3: S3Server
) -> None:
    s3.client().put_object(Bucket=BUCKET, Key="t/head", Body=b"h")
    proxy.set_faults(fail_all=Fault.THROTTLE, methods=["HEAD"], max_faults=2)
    assert await fs_via_proxy._cat_file(f"{BUCKET}/t/head") == b"h"
    assert proxy.stats().faults == {"throttle": 2}


@pytest.mark.parametrize("fault", [Fault.SLOWDOWN, Fault.RESET_BEFORE])
async def test_every_request_failing_fails_fast_and_typed(
    aws_env: S3Server, proxy: FaultProxy, fault: Fault
) -> None:
    opts = options(proxy.url, max_attempts=3, fs_retries=2)
    fs = await open_s3_filesystem(f"s3://{BUCKET}/t", opts)
    proxy.set_faults(fail_all=fault)
    # what the S3 stack raises once its retries are spent: s3fs's OSError over botocore's SlowDown reply, or
    # botocore's connection error over the reset connection
    raised = OSError if fault is Fault.SLOWDOWN else botocore.exceptions.ConnectionError
    start = time.monotonic()
    try:
        with pytest.raises(raised) as info:
            await fs._pipe_file(f"{BUCKET}/t/doomed", b"x" * 1000)
    finally:
        await close_s3_filesystem(fs)
    elapsed = time.monotonic() - start
    if fault is Fault.SLOWDOWN:
        reply = _in_chain(info.value, botocore.exceptions.ClientError)
        assert reply.response["Error"]["Code"] == "SlowDown", reply.response
        expected = "SlowDown, HTTP 503"
    else:
        _in_chain(info.value, ConnectionResetError)
        expected = type(info.value).__name__
    err = classify_error(info.value, f"s3://{BUCKET}/t")
    assert type(err) is StorageError, err
    assert BUCKET in str(err) and expected in str(err), err
    assert elapsed < 15, elapsed
    assert 2 <= proxy.stats().requests <= opts.worst_case_requests


# --- typed errors ---------------------------------------------------------------------------------
_E = TypeVar("_E", bound=BaseException)


def _in_chain(exc: BaseException, kind: type[_E]) -> _E:
    """The first exception of ``kind`` in ``exc``'s chain (itself, then its causes and contexts)."""
    seen: list[str] = []
    cur: BaseException | None = exc
    while cur is not None and len(seen) < 16:
        if isinstance(cur, kind):
            return cur
        seen.append(type(cur).__name__)
        cur = cur.__cause__ or cur.__context__
    raise AssertionError(f"no {kind.__name__} in the chain {' <- '.join(seen)}")


async def _write_error(endpoint: str, raised: type[BaseException]) -> tuple[BaseException, CkptdError]:
    """Write one object under ``s3://BUCKET/run`` with the credentials in the environment; the write must
    fail with ``raised`` (what the S3 stack raises, not a bug of the test's own); that exception, and how
    ckptd classifies it."""
    url = f"s3://{BUCKET}/run"
    fs = await open_s3_filesystem(url, options(endpoint))
    try:
        with pytest.raises(raised) as info:
            await fs._pipe_file(f"{BUCKET}/run/x", b"x")
    finally:
        await close_s3_filesystem(fs)
    return info.value, classify_error(info.value, url)


async def test_missing_bucket_is_not_found(aws_env: S3Server) -> None:
    url = "s3://no-such-bucket/run"
    fs = await open_s3_filesystem(url, options(aws_env.endpoint_url))
    try:
        with pytest.raises(StorageNotFoundError, match="no-such-bucket"):
            await check_bucket(fs, url)
        with pytest.raises(FileNotFoundError) as info:  # s3fs's translation of the NoSuchBucket reply
            await fs._pipe_file("no-such-bucket/run/x", b"x")
        reply = _in_chain(info.value, botocore.exceptions.ClientError)
        assert reply.response["Error"]["Code"] == "NoSuchBucket", reply.response
        err = classify_error(info.value, url)
        assert isinstance(err, StorageNotFoundError) and isinstance(err, FileNotFoundError)
        assert "NoSuchBucket" in str(err) and "no-such-bucket" in str(err)
    finally:
        await close_s3_filesystem(fs)


@pytest.mark.parametrize("wrong", ["key", "secret"])
async def test_wrong_credentials_are_permission_errors(
    s3_auth: S3Server, monkeypatch: pytest.MonkeyPatch, wrong: str
) -> None:
    good = s3_auth.credentials
    bad = (
        S3Credentials("AKIAWRONGWRONGWRONG1", "wrong-secret-value")
        if wrong == "key"
        else S3Credentials(good.access_key_id, "wrong-secret-value")
    )
    for key, value in s3_auth.env().items():
        monkeypatch.setenv(key, value)
    url = f"s3://{BUCKET}/run"
    fs = await open_s3_filesystem(url, options(s3_auth.endpoint_url))
    await fs._pipe_file(f"{BUCKET}/run/ok", b"ok")  # the right key works
    await close_s3_filesystem(fs)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", bad.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bad.secret_access_key)
    code = "InvalidAccessKeyId" if wrong == "key" else "SignatureDoesNotMatch"
    raw, err = await _write_error(s3_auth.endpoint_url, PermissionError)  # s3fs's translation of the 403
    assert _in_chain(raw, botocore.exceptions.ClientError).response["Error"]["Code"] == code
    assert isinstance(err, StoragePermissionError) and isinstance(err, PermissionError)
    assert code in str(err)
    assert BUCKET in str(err)
    for secret in (bad.secret_access_key, good.secret_access_key, bad.access_key_id):
        assert secret not in str(err)


async def test_no_credentials_is_a_permission_error(
    aws_env: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    _raw, err = await _write_error(aws_env.endpoint_url, botocore.exceptions.NoCredentialsError)
    assert isinstance(err, StoragePermissionError) and "credentials" in str(err)


# --- conditional PUT and multipart GC -------------------------------------------------------------
async def test_put_if_absent(fs_via_proxy: s3fs.S3FileSystem, proxy: FaultProxy) -> None:
    fs = fs_via_proxy
    path = f"{BUCKET}/t/COMMITTED"
    assert await put_if_absent(fs, path, b"one") is True
    assert await put_if_absent(fs, path, b"two") is False
    assert await fs._cat_file(path) == b"one"
    # the first attempt lands but its response is lost: the retry's 412 still means "ours"
    proxy.set_faults(fail_all=Fault.RESET_MID_RESPONSE, methods=["PUT"], max_faults=1)
    assert await put_if_absent(fs, f"{BUCKET}/t/COMMITTED2", b"mine") is True
    assert proxy.stats().faults == {"reset_mid_response": 1}
    assert await put_if_absent(fs, f"{BUCKET}/t/COMMITTED2", b"theirs") is False


async def test_abort_incomplete_uploads(aws_env: S3Server) -> None:
    client = aws_env.client()
    for key in ("gc/step_1/a", "gc/step_2/b", "keep/c"):
        client.create_multipart_upload(Bucket=BUCKET, Key=key)
    url = f"s3://{BUCKET}/gc/"
    fs = await open_s3_filesystem(url, options(aws_env.endpoint_url))
    try:
        # moto reports every upload as initiated 2010-11-10: it can only show the filter is applied
        long_ago = datetime(2001, 1, 1, tzinfo=UTC)
        assert await abort_incomplete_uploads(fs, BUCKET, "gc/", initiated_before=long_ago) == 0
        assert await abort_incomplete_uploads(fs, BUCKET, "gc/") == 2
        assert await abort_incomplete_uploads(fs, BUCKET, "gc/") == 0
    finally:
        await close_s3_filesystem(fs)
    left = [u["Key"] for u in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]
    assert left == ["keep/c"]


def test_options_validation_and_loop_requirement() -> None:
    with pytest.raises(ConfigError):
        S3Options(max_attempts=0)
    with pytest.raises(ConfigError, match="unknown S3 options"):
        S3Options.from_mapping({"endpoint": "x"})
    with pytest.raises(InvalidRequestError, match="not an s3:// URL"):
        asyncio.run(open_s3_filesystem("file:///tmp/x", S3Options()))
    coro = open_s3_filesystem("s3://b/p", S3Options())
    with pytest.raises(RuntimeError):  # an async filesystem must be born inside its loop
        coro.send(None)
    coro.close()
