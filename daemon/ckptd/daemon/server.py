"""``ckptd serve``: the node daemon's socket server and lifecycle.

One asyncio loop owns everything: the Unix socket (in a ``0700`` directory, peers checked with
``SO_PEERCRED``), the staging arena, the storage writes. A malformed or hostile client gets a typed
error reply and, when its framing is broken, its connection closed; no client can disturb another.
SIGTERM/SIGINT stop new saves, drain in-flight steps within the grace period, then exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import stat
import struct

from ckptd.client.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    LeaseGranted,
    LeaseRequest,
    Released,
    ReleaseRequest,
    Reply,
    Request,
    SaveAccepted,
    SaveRequest,
    StatusRequest,
    StepStatus,
    Welcome,
    decode_request,
    encode,
    frame_length,
)
from ckptd.daemon.arena import Arena, remove_stale_arenas
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.service import CheckpointService
from ckptd.writer.backends import Backend, open_backend
from ckptd.writer.errors import CkptdError, DaemonShuttingDownError, InvalidRequestError, ProtocolError

log = logging.getLogger(__name__)

MAX_STATUS_WAIT_S = 5.0


def prepare_socket_dir(path: str) -> None:
    """Create the socket's directory ``0700`` (or insist an existing one is ours and private)."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid():
        raise PermissionError(f"socket directory {d} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(d, 0o700)


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self._conn_ids = itertools.count(1)
        self._stop = asyncio.Event()
        self.service: CheckpointService | None = None
        self.arena: Arena | None = None

    async def run(self, ready: asyncio.Event | None = None) -> int:
        cfg = self.config
        stale = remove_stale_arenas()
        if stale:
            log.info("removed %d stale arena file(s) of dead daemons: %s", len(stale), ", ".join(stale))
        backend = await open_backend(cfg.root, cfg.storage_options)  # checks the bucket: fails loudly, typed
        try:
            return await self._run(backend, ready)
        finally:
            if backend.metrics is not None:
                log.info("S3 requests retried since start: %s", backend.metrics.describe())
            await backend.close()

    async def _run(self, backend: Backend, ready: asyncio.Event | None) -> int:
        cfg = self.config
        if cfg.nice:
            os.nice(cfg.nice)  # before any worker thread exists, so they all inherit it
        self.arena = Arena(cfg.arena_size, prefault=cfg.prefault)
        self.service = CheckpointService(cfg, self.arena, backend)
        prepare_socket_dir(cfg.socket)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(cfg.socket)
        old_umask = os.umask(0o177)
        try:
            server = await asyncio.start_unix_server(self._serve_client, path=cfg.socket, limit=1 << 20)
        finally:
            os.umask(old_umask)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        log.info(
            "ckptd serving root=%s socket=%s arena=%dMiB pid=%d", cfg.root, cfg.socket, cfg.arena_size >> 20,
            os.getpid(),
        )
        if ready is not None:
            ready.set()
        code = 0
        try:
            async with server:
                await self._stop.wait()
                in_flight = len(self.service.in_flight())
                log.info("shutting down: draining %d in-flight step(s) within %.0fs", in_flight, cfg.drain_grace_s)
                if not await self.service.drain(cfg.drain_grace_s):
                    log.error("grace period over with steps unfinished: they will not commit")
                    code = 1
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg.socket)
            self.arena.close()
        log.info("ckptd stopped")
        return code

    def stop(self) -> None:
        self._stop.set()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = next(self._conn_ids)
        sock = writer.get_extra_info("socket")
        assert self.service is not None and self.arena is not None
        try:
            if sock is not None and _peer_uid(sock) != os.getuid():
                log.warning("conn=%d: refused a peer of another user", conn)
                return
            while True:
                try:
                    header = await reader.readexactly(HEADER.size)
                except asyncio.IncompleteReadError:
                    return
                try:
                    n = frame_length(header, self.config.max_frame_bytes)
                    body = await asyncio.wait_for(reader.readexactly(n), self.config.read_timeout_s)
                except (ProtocolError, TimeoutError, asyncio.IncompleteReadError) as exc:
                    # The stream cannot be resynchronised: say why, then drop only this client.
                    err = exc if isinstance(exc, ProtocolError) else ProtocolError(f"incomplete frame: {exc!r}")
                    await self._send(writer, ErrorReply(v=PROTOCOL_VERSION, code=type(err).__name__, message=str(err)))
                    return
                reply = await self._handle(conn, body)
                await self._send(writer, reply)
        except (ConnectionError, OSError) as exc:
            log.debug("conn=%d: connection lost: %s", conn, exc)
        finally:
            freed = self.arena.release_owner(conn)
            if freed:
                log.info("conn=%d: client left; released %d unused lease(s)", conn, freed)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _send(self, writer: asyncio.StreamWriter, reply: Reply) -> None:
        writer.write(encode(reply, self.config.max_frame_bytes))
        await writer.drain()

    async def _handle(self, conn: int, body: bytes) -> Reply:
        try:
            req = decode_request(body)
            return await self._dispatch(conn, req)
        except CkptdError as exc:
            log.info("conn=%d: rejected request: %s: %s", conn, type(exc).__name__, exc)
            return ErrorReply(v=PROTOCOL_VERSION, code=type(exc).__name__, message=str(exc))

    async def _dispatch(self, conn: int, req: Request) -> Reply:
        assert self.service is not None and self.arena is not None
        v = PROTOCOL_VERSION
        match req:
            case Hello():
                return Welcome(
                    v=v, daemon_pid=os.getpid(), arena_path=self.arena.path, arena_bytes=self.arena.size,
                    root=self.config.root,
                )
            case LeaseRequest():
                if self.service.draining:
                    raise DaemonShuttingDownError("the daemon is shutting down and grants no staging space")
                if any(n < 0 for n in req.sizes):
                    raise InvalidRequestError(f"lease sizes must be >= 0: {req.sizes[:8]}")
                lease = await self.arena.lease(conn, req.sizes, max(0.0, req.timeout_s))
                return LeaseGranted(v=v, lease_id=lease.lease_id, offsets=lease.offsets)
            case SaveRequest():
                nbytes = await self.service.accept(req, conn)
                return SaveAccepted(v=v, step=req.step, nbytes=nbytes)
            case ReleaseRequest():
                held = self.arena.get(req.lease_id, conn)
                if held is None:
                    raise InvalidRequestError(f"lease {req.lease_id} is not held by this connection")
                self.arena.release(held)
                return Released(v=v, lease_id=req.lease_id)
            case StatusRequest():
                state, err = await self.service.status(req.step, min(max(0.0, req.wait_s), MAX_STATUS_WAIT_S))
                return StepStatus(
                    v=v, step=req.step, state=state, error_code=type(err).__name__ if err else "",
                    error=str(err) if err else "",
                )
        raise ProtocolError(f"unexpected message {type(req).__name__}")
