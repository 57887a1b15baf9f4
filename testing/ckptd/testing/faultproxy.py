"""A fault-injecting HTTP/1.1 reverse proxy for putting in front of an S3 endpoint in tests.

Each request it receives is either forwarded to the upstream endpoint unchanged (bodies streamed in
bounded pieces, never held whole: Content-Length, chunked, and read-to-EOF responses, keep-alive on both
sides) or hit by one fault, drawn per request from the configured fractions:

=====================  =======================================================================
``slowdown``           503 with an S3 ``SlowDown`` XML error body
``internal``           500 with an S3 ``InternalError`` body
``throttle``           429 with a throttling body (code configurable; default ``Throttling``)
``reset_before``       request read in full, then the connection reset (TCP RST), no response
``reset_mid_request``  connection reset after half of the request body (or right after the headers)
``reset_mid_response`` request forwarded (so upstream applies it!), response cut after half its body
``stall``              request read, nothing answered for ``stall_s`` seconds, then a reset
``error``              any S3 error reply: ``error_status`` with ``error_code``/``error_message``
                       (default: MinIO's 507 ``XMinioStorageFull``; e.g. 403 ``QuotaExceeded``)
=====================  =======================================================================

``latency_s`` (+ uniform ``latency_jitter_s``) delays every eligible request before anything else.
``fail_all`` applies one fault to every eligible request; ``max_faults`` stops injecting after that
many; ``methods`` and ``path_regex`` restrict which requests are eligible. Counters of requests, faults
and statuses tell a test exactly what the client went through.

Two ways to run it:

* :class:`FaultProxy` — an asyncio server on its own thread in this process; configure it with
  :meth:`FaultProxy.set_faults` and read :meth:`FaultProxy.stats`.
* :class:`FaultProxyProcess` — the same server in a child process (``python faultproxy.py --upstream
  URL``), so a benchmark's proxy does not share the GIL with the client; configured over the control
  endpoint, which both variants serve under ``/__faultproxy__/`` (``GET stats``, ``POST faults`` with a
  JSON body of :class:`FaultConfig` fields, ``POST reset-stats``). No S3 bucket name can contain ``_``,
  so the control paths never shadow S3 requests.

Everything binds 127.0.0.1. Importable without pytest.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from ckptd.testing import child_server

__all__ = ["Fault", "FaultConfig", "FaultProxy", "FaultProxyProcess", "ProxyStats"]

_PIECE = 1 << 20  # bytes relayed per read: bounded memory per connection
_HEAD_LIMIT = 1 << 20
_CONTROL_PREFIX = "/__faultproxy__/"
_READY_PREFIX = "CKPTD_FAULTPROXY_PORT="
_HOP_BY_HOP = ("connection", "keep-alive", "proxy-connection")


class Fault(enum.StrEnum):
    """The faults the proxy can inject (see the module docstring)."""

    SLOWDOWN = "slowdown"
    INTERNAL = "internal"
    THROTTLE = "throttle"
    RESET_BEFORE = "reset_before"
    RESET_MID_REQUEST = "reset_mid_request"
    RESET_MID_RESPONSE = "reset_mid_response"
    STALL = "stall"
    ERROR = "error"


_ERROR_REPLIES: dict[Fault, tuple[int, str, str, str]] = {
    Fault.SLOWDOWN: (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    Fault.INTERNAL: (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    Fault.THROTTLE: (429, "Too Many Requests", "Throttling", "Rate exceeded."),
}


@dataclass(frozen=True)
class FaultConfig:
    """What to inject. Fractions are per eligible request and must sum to at most 1."""

    slowdown: float = 0.0
    internal: float = 0.0
    throttle: float = 0.0
    reset_before: float = 0.0
    reset_mid_request: float = 0.0
    reset_mid_response: float = 0.0
    stall: float = 0.0
    error: float = 0.0
    fail_all: Fault | None = None
    max_faults: int | None = None
    methods: frozenset[str] | None = None
    path_regex: str | None = None
    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    stall_s: float = 30.0
    throttle_code: str = "Throttling"
    error_status: int = 507
    error_code: str = "XMinioStorageFull"
    error_message: str = (
        "Storage backend has reached its minimum free drive threshold. Please delete a few objects to proceed."
    )
    seed: int | None = None

    def __post_init__(self) -> None:
        fractions = [getattr(self, f.value) for f in Fault]
        if any(not 0.0 <= x <= 1.0 for x in fractions) or sum(fractions) > 1.0 + 1e-9:
            raise ValueError(f"fault fractions must be in [0, 1] and sum to at most 1: {fractions}")
        if self.fail_all is not None:
            object.__setattr__(self, "fail_all", Fault(self.fail_all))
        if self.methods is not None:
            object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        if self.path_regex is not None:
            re.compile(self.path_regex)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FaultConfig:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown fault settings: {sorted(unknown)}")
        if data.get("methods") is not None:
            data = {**data, "methods": frozenset(data["methods"])}
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.methods is not None:
            out["methods"] = sorted(self.methods)
        return out


@dataclass
class ProxyStats:
    """Counters since start or the last :meth:`FaultProxy.reset_stats`."""

    connections: int = 0  # client connections accepted (fewer than requests: keep-alive works)
    requests: int = 0  # proxied requests received (control requests excluded)
    forwarded: int = 0  # requests sent on to the upstream
    delayed: int = 0  # requests that got added latency
    faults: Counter[str] = field(default_factory=Counter)  # by Fault value
    statuses: Counter[int] = field(default_factory=Counter)  # statuses sent to the client, incl. injected
    methods: Counter[str] = field(default_factory=Counter)
    upstream_errors: int = 0  # upstream unreachable or broke mid-exchange
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())

    def to_json(self) -> dict[str, Any]:
        # not dataclasses.asdict: it rebuilds a Counter from its items, counting the pairs
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["faults"] = dict(self.faults)
        out["methods"] = dict(self.methods)
        out["statuses"] = {str(k): v for k, v in self.statuses.items()}
        out["total_faults"] = self.total_faults
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProxyStats:
        data = dict(data)
        data.pop("total_faults", None)
        return cls(
            **{
                **data,
                "faults": Counter(data.get("faults", {})),
                "statuses": Counter({int(k): v for k, v in data.get("statuses", {}).items()}),
                "methods": Counter(data.get("methods", {})),
            }
        )


class _Reset(Exception):
    """Abort the client connection with a TCP reset."""


class _Close(Exception):
    """Close the client connection normally (after the current response)."""


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def keep_alive(self) -> bool:
        conn = (self.header("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn

    def encode(self, drop: Iterable[str] = ()) -> bytes:
        return _encode_head(f"{self.method} {self.target} {self.version}", self.headers, drop)


def _encode_head(first_line: str, headers: list[tuple[str, str]], drop: Iterable[str] = ()) -> bytes:
    dropped = {d.lower() for d in drop}
    lines = [first_line, *(f"{k}: {v}" for k, v in headers if k.lower() not in dropped)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        key, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"bad header line {line!r}")
        headers.append((key.strip(), value.strip()))
    return lines[0], headers


def _framing(headers: list[tuple[str, str]]) -> tuple[str, int]:
    """('chunked', 0) | ('length', n) | ('none', 0) for a request body."""
    lowered = {k.lower(): v for k, v in headers}
    if "chunked" in lowered.get("transfer-encoding", "").lower():
        return "chunked", 0
    if "content-length" in lowered:
        return "length", int(lowered["content-length"])
    return "none", 0


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """The fault-injecting proxy on a background thread of this process (a context manager)."""

    def __init__(self, upstream: str, *, port: int = 0, config: FaultConfig | None = None) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self._requested_port = port
        self._config = config or FaultConfig()
        self._rng = random.Random(self._config.seed)
        self._stats = ProxyStats()
        self._lock = threading.Lock()
        self._injected = 0  # faults under the current config, for max_faults
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._port: int | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._start_error is not None:
            raise RuntimeError("fault proxy failed to start") from self._start_error
        if self._port is None:
            raise RuntimeError("fault proxy did not start within 30 s")
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # loop already closed
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("proxy not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- control -----------------------------------------------------------------------------------
    def set_faults(self, config: FaultConfig | None = None, **settings: Any) -> FaultConfig:
        """Replace the fault configuration (``config`` or :class:`FaultConfig` fields); thread-safe."""
        new = config if config is not None else FaultConfig(**settings)
        with self._lock:
            self._config = new
            self._injected = 0
            if new.seed is not None:
                self._rng = random.Random(new.seed)
        return new

    def clear_faults(self) -> None:
        """Forward everything unchanged from now on."""
        self.set_faults(FaultConfig())

    @property
    def config(self) -> FaultConfig:
        return self._config

    def stats(self) -> ProxyStats:
        """A snapshot of the counters."""
        with self._lock:
            return ProxyStats.from_json(json.loads(json.dumps(self._stats.to_json())))

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = ProxyStats()

    # --- server ------------------------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
            loop.run_forever()
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(
            self._on_client, "127.0.0.1", self._requested_port, limit=_HEAD_LIMIT, reuse_address=True
        )
        self._port = self._server.sockets[0].getsockname()[1]
        self._started.set()

    async def _shutdown(self) -> None:
        assert self._loop is not None
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        self._loop.call_soon(self._loop.stop)

    def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._count(connections=1)
        task = asyncio.get_running_loop().create_task(self._handle_client(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def _choose(self, req: _Request) -> tuple[FaultConfig, Fault | None]:
        with self._lock:
            cfg = self._config
            if cfg.methods is not None and req.method not in cfg.methods:
                return cfg, None
            if cfg.path_regex is not None and not re.search(cfg.path_regex, req.target):
                return cfg, None
            if cfg.max_faults is not None and self._injected >= cfg.max_faults:
                return cfg, None
            chosen: Fault | None = cfg.fail_all
            if chosen is None:
                draw, acc = self._rng.random(), 0.0
                for kind in Fault:
                    acc += getattr(cfg, kind.value)
                    if draw < acc:
                        chosen = kind
                        break
            if chosen is not None:
                self._injected += 1
                self._stats.faults[chosen.value] += 1
            return cfg, chosen

    async def _handle_client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        upstream: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []  # 0 or 1 reusable
        try:
            while True:
                try:
                    head = await creader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except asyncio.LimitOverrunError:
                    await self._reply(cwriter, "GET", 431, "Request Header Fields Too Large", None, False)
                    return
                start_line, headers = _parse_head(head)
                method, target, version = start_line.split(" ", 2)
                req = _Request(method.upper(), target, version, headers)
                if target.startswith(_CONTROL_PREFIX):
                    await self._control(req, creader, cwriter)
                    continue
                if not await self._one_request(req, creader, cwriter, upstream):
                    return
        except _Reset:
            _reset(cwriter)
        except (ConnectionError, asyncio.IncompleteReadError, _Close):
            pass
        except asyncio.CancelledError:
            _reset(cwriter)
            raise
        finally:
            for _r, uw in upstream:
                uw.close()
            if not cwriter.transport.is_closing():
                cwriter.close()
            with contextlib.suppress(Exception):
                await cwriter.wait_closed()

    async def _one_request(
        self,
        req: _Request,
        creader: asyncio.StreamReader,
        cwriter: asyncio.StreamWriter,
        upstream: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    ) -> bool:
        """Serve one request; return whether the client connection stays open."""
        with self._lock:
            self._stats.requests += 1
            self._stats.methods[req.method] += 1
        cfg, fault = self._choose(req)
        if cfg.latency_s or cfg.latency_jitter_s:
            self._count(delayed=1)
            await asyncio.sleep(cfg.latency_s + random.uniform(0, cfg.latency_jitter_s))
        framing, length = _framing(req.headers)
        expects = (req.header("expect") or "").lower() == "100-continue"

        if fault in _ERROR_REPLIES or fault is Fault.ERROR:
            if expects:  # refuse before the body is sent, as S3 does, and drop the connection
                await self._reply(cwriter, req.method, *self._error(cfg, fault, req), keep_alive=False)
                await self._linger(creader, cwriter)
                raise _Close
            await self._relay_body(creader, None, framing, length)
            await self._reply(cwriter, req.method, *self._error(cfg, fault, req), keep_alive=req.keep_alive)
            return req.keep_alive
        if fault in (Fault.RESET_BEFORE, Fault.STALL):
            if expects:
                cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await self._relay_body(creader, None, framing, length)
            if fault is Fault.STALL:
                await asyncio.sleep(cfg.stall_s)
            raise _Reset
        if fault is Fault.RESET_MID_REQUEST:
            if expects:
                cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if framing == "length" and length > 0:
                await self._relay_body(creader, None, "length", length // 2)
            elif framing == "chunked":
                await creader.read(_PIECE)
            raise _Reset

        # forward
        if upstream and (upstream[0][0].at_eof() or upstream[0][1].is_closing()):
            upstream.pop()[1].close()
        try:
            if not upstream:
                upstream.append(
                    await asyncio.open_connection(self.upstream_host, self.upstream_port, limit=_HEAD_LIMIT)
                )
        except OSError:
            self._count(upstream_errors=1)
            await self._relay_body(creader, None, framing, length)
            await self._reply(cwriter, req.method, 502, "Bad Gateway", None, keep_alive=req.keep_alive)
            return req.keep_alive
        ureader, uwriter = upstream[0]
        self._count(forwarded=1)
        if expects:
            cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            uwriter.write(req.encode(drop=("expect", *_HOP_BY_HOP)))
            sent = await self._relay_body(creader, uwriter, framing, length)
            self._count(bytes_to_upstream=sent)
            status_line, rheaders = await self._read_response_head(ureader)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            upstream.pop()[1].close()
            if creader.at_eof():
                raise _Close from None  # the client went away mid-request
            self._count(upstream_errors=1)
            raise _Reset from None  # the request may or may not have been applied: a reset says so
        status = int(status_line.split(" ", 2)[1])
        with self._lock:
            self._stats.statuses[status] += 1
        lowered = {k.lower(): v for k, v in rheaders}
        if req.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            rframing, rlength = "none", 0
        elif "chunked" in lowered.get("transfer-encoding", "").lower():
            rframing, rlength = "chunked", 0
        elif "content-length" in lowered:
            rframing, rlength = "length", int(lowered["content-length"])
        else:
            rframing, rlength = "eof", 0
        upstream_keeps = rframing != "eof" and "close" not in lowered.get("connection", "").lower()
        # Connection is hop-by-hop: the client's keep-alive is ours to decide, whatever the upstream
        # does (moto's server closes after every response; real S3 keeps connections open)
        client_keeps = req.keep_alive and rframing != "eof"
        rheaders = [(k, v) for k, v in rheaders if k.lower() not in _HOP_BY_HOP]
        rheaders = [*rheaders, ("Connection", "keep-alive" if client_keeps else "close")]
        rhead = _encode_head(status_line, rheaders, drop=_HOP_BY_HOP[1:])

        if fault is Fault.RESET_MID_RESPONSE:
            upstream.pop()[1].close()
            if rframing == "length" and rlength > 1:
                cwriter.write(rhead)
                await self._relay_body(ureader, cwriter, "length", rlength // 2)
            else:
                cwriter.write(rhead[: len(rhead) // 2])
            await cwriter.drain()
            raise _Reset

        cwriter.write(rhead)
        try:
            got = await self._relay_body(ureader, cwriter, rframing, rlength, client_side=True)
        except _UpstreamBroke:
            self._count(upstream_errors=1)
            upstream.pop()[1].close()
            raise _Reset from None
        self._count(bytes_to_client=got + len(rhead))
        if not upstream_keeps:
            upstream.pop()[1].close()
        if rframing == "eof":
            raise _Close  # the body ended with the connection: the client must see the close
        return client_keeps

    async def _read_response_head(self, ureader: asyncio.StreamReader) -> tuple[str, list[tuple[str, str]]]:
        while True:
            head = await ureader.readuntil(b"\r\n\r\n")
            status_line, headers = _parse_head(head)
            if not status_line.split(" ", 2)[1].startswith("1"):
                return status_line, headers
            # an interim 1xx we did not ask for (Expect was stripped): skip it

    async def _relay_body(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter | None,
        framing: str,
        length: int,
        *,
        client_side: bool = False,
    ) -> int:
        """Copy (or discard, when ``writer`` is None) one body; return the bytes relayed.

        With ``client_side`` the reader is the upstream: its EOF is an upstream failure
        (:class:`_UpstreamBroke`), while a failing write means the client went away.
        """
        total = 0

        async def copy(n: int) -> None:
            nonlocal total
            while n > 0:
                piece = await reader.read(min(n, _PIECE))
                if not piece:
                    if client_side:
                        raise _UpstreamBroke
                    raise asyncio.IncompleteReadError(b"", n)
                n -= len(piece)
                total += len(piece)
                if writer is not None:
                    writer.write(piece)
                    await writer.drain()

        async def line() -> bytes:
            try:
                data = await reader.readuntil(b"\r\n")
            except asyncio.IncompleteReadError:
                if client_side:
                    raise _UpstreamBroke from None
                raise
            if writer is not None:
                writer.write(data)
            return data

        if framing == "length":
            await copy(length)
        elif framing == "chunked":
            while True:
                size = int((await line()).split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while (await line()) != b"\r\n":  # trailers, then the blank line
                        pass
                    break
                await copy(size)
                await line()  # CRLF after the chunk data
            if writer is not None:
                await writer.drain()
        elif framing == "eof":
            while piece := await reader.read(_PIECE):
                total += len(piece)
                if writer is not None:
                    writer.write(piece)
                    await writer.drain()
        return total

    def _error(self, cfg: FaultConfig, fault: Fault, req: _Request) -> tuple[int, str, bytes]:
        if fault is Fault.ERROR:
            status, reason, code, message = cfg.error_status, "Error", cfg.error_code, cfg.error_message
        else:
            status, reason, code, message = _ERROR_REPLIES[fault]
        if fault is Fault.THROTTLE:
            code = cfg.throttle_code
        resource = req.target.split("?", 1)[0]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<Resource>{resource}</Resource><RequestId>faultproxy-{fault.value}</RequestId></Error>"
        ).encode()
        return status, reason, body

    async def _reply(
        self,
        cwriter: asyncio.StreamWriter,
        method: str,
        status: int,
        reason: str,
        body: bytes | None,
        keep_alive: bool,
        content_type: str = "application/xml",
        *,
        count: bool = True,
    ) -> None:
        body = body or b""
        headers = [
            f"HTTP/1.1 {status} {reason}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}",
            "x-amz-request-id: faultproxy",
            f"Connection: {'keep-alive' if keep_alive else 'close'}",
        ]
        cwriter.write(("\r\n".join(headers) + "\r\n\r\n").encode("latin-1"))
        if method != "HEAD":
            cwriter.write(body)
        await cwriter.drain()
        if count:  # control replies are not proxied traffic
            with self._lock:
                self._stats.statuses[status] += 1

    async def _linger(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        """After an early reply: stop writing, swallow what the client still sends, briefly.

        Closing at once with unread input makes the kernel send a reset that can destroy the reply
        before the client reads it.
        """
        with contextlib.suppress(OSError, RuntimeError):
            cwriter.write_eof()
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            async with asyncio.timeout(2.0):
                while await creader.read(_PIECE):
                    pass

    async def _control(
        self, req: _Request, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter
    ) -> None:
        framing, length = _framing(req.headers)
        if framing != "length":
            length = 0
        body = await creader.readexactly(length) if length else b""
        action = req.target[len(_CONTROL_PREFIX) :].split("?", 1)[0]
        status, reason, payload = 200, "OK", {}
        try:
            if action == "stats" and req.method == "GET":
                payload = self.stats().to_json()
            elif action == "faults" and req.method == "POST":
                payload = self.set_faults(FaultConfig.from_json(json.loads(body or b"{}"))).to_json()
            elif action == "faults" and req.method == "GET":
                payload = self.config.to_json()
            elif action == "reset-stats" and req.method == "POST":
                self.reset_stats()
            else:
                status, reason, payload = (
                    404,
                    "Not Found",
                    {"error": f"no control action {req.method} {action}"},
                )
        except (ValueError, TypeError) as exc:
            status, reason, payload = 400, "Bad Request", {"error": str(exc)}
        body_out = json.dumps(payload).encode()
        await self._reply(
            cwriter, req.method, status, reason, body_out, req.keep_alive, "application/json", count=False
        )


class _UpstreamBroke(Exception):
    """The upstream closed or broke while its response was being relayed."""


class FaultProxyProcess:
    """:class:`FaultProxy` in a child process, controlled over its ``/__faultproxy__/`` endpoint."""

    def __init__(
        self, upstream: str, *, config: FaultConfig | None = None, startup_timeout: float = 30.0
    ) -> None:
        self.upstream = upstream
        self._initial = config
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[str] | None = None
        self._port: int | None = None

    def start(self) -> FaultProxyProcess:
        if self._proc is not None:
            return self
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd.testing.faultproxy", "--upstream", self.upstream],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        port = child_server.read_port(self._proc, _READY_PREFIX, self.startup_timeout)
        if port is None:
            self.stop()
            raise RuntimeError("fault proxy process did not start")
        self._port = port
        if self._initial is not None:
            self.set_faults(self._initial)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        child_server.stop(proc, timeout)

    def __enter__(self) -> FaultProxyProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._port is None:
            raise RuntimeError("proxy not started")
        return f"http://127.0.0.1:{self._port}"

    def _call(self, method: str, action: str, payload: dict[str, Any] | None = None) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(
            f"{self.url}{_CONTROL_PREFIX}{action}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"{}")

    def set_faults(self, config: FaultConfig | None = None, **settings: Any) -> FaultConfig:
        new = config if config is not None else FaultConfig(**settings)
        return FaultConfig.from_json(self._call("POST", "faults", new.to_json()))

    def clear_faults(self) -> None:
        self.set_faults(FaultConfig())

    def stats(self) -> ProxyStats:
        return ProxyStats.from_json(self._call("GET", "stats"))

    def reset_stats(self) -> None:
        self._call("POST", "reset-stats", {})


def _main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="fault-injecting HTTP proxy (127.0.0.1 only)")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    proxy = FaultProxy(args.upstream, port=args.port).start()
    child_server.serve_until_parent_leaves(_READY_PREFIX, proxy.port)
    proxy.stop()


if __name__ == "__main__":
    _main(sys.argv[1:])
