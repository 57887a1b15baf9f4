"""``ckptd serve``: the node daemon's socket server and lifecycle.

One asyncio loop owns everything: the Unix socket (in a ``0700`` directory, peers checked with
``SO_PEERCRED``), the staging arena, the storage writes. A malformed or hostile client gets a typed
error reply and, when its framing is broken, its connection closed; no client can disturb another.
SIGTERM/SIGINT (or the injectable ``shutdown`` event of :func:`serve`) stop new saves, drain in-flight
steps within the grace period, then cancel what is left; every task lives in one task group.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import struct
import time
from collections.abc import Coroutine
from typing import Any

from ckptd.client.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    LeaseGranted,
    LeaseRequest,
    PlanRegistered,
    PrepareStep,
    RegisterPlan,
    Released,
    ReleaseRequest,
    Reply,
    ReportRequest,
    Request,
    RestoreRequest,
    SaveAccepted,
    SaveRequest,
    StatusRequest,
    StepPrepared,
    StepStatus,
    Welcome,
    decode_request,
    encode,
    frame_length,
)
from ckptd.daemon.arena import Arena, remove_stale_arenas
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.journal import StepJournal, abandon_predecessor_steps, journal_path
from ckptd.daemon.plans import MAX_SHARDS
from ckptd.daemon.service import CheckpointService
from ckptd.daemon.socketfile import SocketClaim, claim_socket, prepare_socket_dir
from ckptd.daemon.stats import DaemonStats, status_report
from ckptd.writer.backends import Backend, open_backend
from ckptd.writer.errors import (
    BackpressureError,
    CkptdError,
    ConfigError,
    DaemonShuttingDownError,
    InvalidRequestError,
    ProtocolError,
    first_leaf,
)

log = logging.getLogger(__name__)

MAX_STATUS_WAIT_S = 5.0


def _renice(increment: int) -> None:
    """``os.nice(increment)``; a negative increment this process may not take (it needs root or
    ``CAP_SYS_NICE``) is a :class:`ConfigError`."""
    try:
        os.nice(increment)
    except OSError as exc:
        raise ConfigError(f"--nice {increment}: cannot change the daemon's CPU niceness ({exc}); a negative "
                          "increment needs root or CAP_SYS_NICE: use 0 or a positive one") from exc


def _peer(sock: socket.socket) -> tuple[int, int]:
    """The connected process's pid (0 where it is in a PID namespace this one cannot see) and uid."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


async def serve(
    config: DaemonConfig,
    *,
    shutdown: asyncio.Event | None = None,
    ready: asyncio.Event | None = None,
    handle_signals: bool = True,
) -> int:
    """Run the node daemon until ``shutdown`` is set (or SIGTERM/SIGINT); return the exit code.

    On shutdown it stops granting and accepting saves, keeps answering status requests while in-flight
    steps finish within ``config.drain_grace_s``, then cancels what is left: 0 if everything drained,
    1 if steps were cut off. ``ready`` is set once the socket accepts connections.
    """
    return await Daemon(config, shutdown=shutdown, handle_signals=handle_signals).run(ready)


class Daemon:
    """The node server: the socket, the arena and the service, all tasks in one task group."""

    def __init__(
        self, config: DaemonConfig, *, shutdown: asyncio.Event | None = None, handle_signals: bool = True
    ) -> None:
        self.config = config
        self._conn_ids = itertools.count(1)
        self._stop = shutdown if shutdown is not None else asyncio.Event()
        self._handle_signals = handle_signals
        self._tasks: asyncio.TaskGroup | None = None
        self._live: set[asyncio.Task[None]] = set()  # the group's tasks still running
        self.service: CheckpointService | None = None
        self.arena: Arena | None = None
        self._clients = 0  # open connections, for --exit-when-idle
        self._client_seen = 0.0  # when a connection last began or ended (loop time): a short one counts too
        self._conn_since: dict[int, float] = {}  # when each open connection began (monotonic)
        self._owner_is_rank = False  # the owner process connected as a client: no launcher restarts ranks
        self._claim: SocketClaim | None = None  # the lock on the socket path, and the socket bound

    async def run(self, ready: asyncio.Event | None = None) -> int:
        """Serve until shut down (see :func:`serve`). The socket path is claimed first (its private directory,
        the lock that makes one daemon per socket) and let go last; the storage backend is opened next."""
        prepare_socket_dir(self.config.socket)  # before anything is opened: a socket it cannot use fails at once
        self._claim = await claim_socket(self.config.socket)
        try:
            return await self._run_claimed(ready)
        finally:
            self._claim.release()

    async def _run_claimed(self, ready: asyncio.Event | None) -> int:
        cfg = self.config
        if cfg.nice:
            _renice(cfg.nice)  # before any worker thread exists, so they all inherit it
        stale = remove_stale_arenas()
        if stale:
            log.info("removed %d stale arena file(s) of dead daemons: %s", len(stale), ", ".join(stale))
        backend = await open_backend(cfg.root, cfg.storage_options)  # checks the bucket: fails loudly, typed
        try:
            return await self._run(backend, ready)
        except BaseExceptionGroup as group:  # a typed startup failure inside the task group: raise it bare
            leaf = first_leaf(group)
            if isinstance(leaf, CkptdError):
                raise leaf from group
            raise
        finally:
            if backend.metrics is not None:
                log.info("S3 requests retried since start: %s", backend.metrics.describe())
            await backend.close()

    async def _run(self, backend: Backend, ready: asyncio.Event | None) -> int:
        cfg = self.config
        self.arena = Arena(cfg.arena_size, prefault=cfg.prefault)
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if self._handle_signals else ()
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                stats = self._stats(backend)
                self.service = CheckpointService(cfg, self.arena, backend, spawn=self._spawn, stats=stats)
                journal = StepJournal(journal_path(cfg.socket), cfg.root)
                await abandon_predecessor_steps(journal, self.service.root)  # before serving: see journal.py
                self.service.journal = journal
                server = await self._listen()
                for sig in signals:
                    loop.add_signal_handler(sig, self._stop.set)
                log.info(
                    "ckptd serving root=%s socket=%s arena=%dMiB pid=%d", cfg.root, cfg.socket,
                    cfg.arena_size >> 20, os.getpid(),
                )
                if ready is not None:
                    ready.set()
                if cfg.exit_when_idle_s is not None:
                    self._spawn(self._exit_when_idle(cfg.exit_when_idle_s), "idle-exit")
                if cfg.owner_pid is not None:
                    self._spawn(self._exit_with_owner(cfg.owner_pid), "owner-exit")
                code = await self._serve_until_stopped(server)
                server.close()
                # What is left (idle connections, steps cut off by the grace period) ends now.
                for task in list(self._live):
                    task.cancel()
            await server.wait_closed()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            self._tasks = None
            self._socket().unlink_socket()  # its own socket only: never a successor's
            if self.service is not None and self.service.journal is not None:
                self.service.journal.remove()  # only when nothing is left in flight
            self.arena.close()
        log.info("ckptd stopped")
        return code

    async def _listen(self) -> asyncio.Server:
        claim = self._socket()  # its directory and lock made ready by run(), before anything was opened
        await claim.clear()  # nothing appeared there meanwhile but, at most, a dead daemon's socket
        old_umask = os.umask(0o177)
        try:
            server = await asyncio.start_unix_server(self._on_connect, path=claim.path, limit=1 << 20)
        except OSError as exc:
            raise ConfigError(f"cannot listen on --socket {claim.path}: {exc}") from exc
        finally:
            os.umask(old_umask)
        claim.bound()
        return server

    async def _serve_until_stopped(self, server: asyncio.Server) -> int:
        """Serve until the shutdown trigger, then drain: status requests are still answered meanwhile."""
        service = self._service()
        await self._stop.wait()
        log.info("shutting down: draining %d in-flight step(s) within %.0fs", len(service.in_flight()),
                 self.config.drain_grace_s)
        if not await service.drain(self.config.drain_grace_s):
            log.error("grace period over with steps unfinished: they will not commit")
            return 1
        return 0

    async def _exit_when_idle(self, idle_s: float) -> None:
        """Stop once no client has been connected and no step in flight for ``idle_s`` (the embedded mode);
        while a committed step is kept for an in-memory restore, for ``restore_hold_s`` (if longer): ranks
        a launcher restarts after a crash (torchrun's, the model built again) can still restore it. Not when
        the owner (``--owner-pid``) is a rank itself (it connected): no launcher, so no restarted ranks (the
        daemon ends with that process), and one that lives on without a client gets the memory back."""
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        holding: int | None = None  # the kept step this idle spell was extended for (logged once)
        while not self._stop.is_set():
            await asyncio.sleep(min(0.2, idle_s))
            service = self._service()
            if self._clients or service.in_flight():
                idle_since, holding = loop.time(), None
                continue
            if self._client_seen > idle_since:  # a connection came and went between two looks
                idle_since, holding = self._client_seen, None
            idle, held = loop.time() - idle_since, None if self._owner_is_rank else service.retention.held
            if idle < idle_s:
                continue
            if held is not None and idle < self.config.restore_hold_s:
                if holding != held:
                    holding = held
                    log.info("idle for %.1fs but holding step %d for an in-memory restore: exiting after %.0fs "
                             "idle unless a client comes (--restore-hold)", idle, held, self.config.restore_hold_s)
                continue
            log.info("no client and no step in flight for %.1fs: exiting (--exit-when-idle%s)", idle,
                     ", --restore-hold" if held is not None else "")
            self._stop.set()

    async def _exit_with_owner(self, pid: int) -> None:
        """Stop once the owner process is gone (``--owner-pid``): its job is over; drain, then exit."""
        from ckptd.daemon.owner import wait_for_exit

        await wait_for_exit(pid)
        if not self._stop.is_set():
            log.info("owner process %d is gone: draining and exiting (job %s)", pid, self.config.job_id or "-")
            self._stop.set()

    def _stats(self, backend: Backend) -> DaemonStats:
        """The counters; with ``metrics_port`` they also feed a Prometheus endpoint (metrics.py)."""
        if self.config.metrics_port is None:
            return DaemonStats()
        from ckptd.daemon.metrics import serve_metrics

        return serve_metrics(self.config.metrics_port, self.config.metrics_host, self._arena(), backend)

    def stop(self) -> None:
        """Trigger shutdown (the same as SIGTERM)."""
        self._stop.set()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        if self._tasks is None:
            coro.close()
            raise RuntimeError(f"the daemon is not running; cannot start {name}")
        task = self._tasks.create_task(self._guarded(coro, name), name=name)
        self._live.add(task)
        task.add_done_callback(self._live.discard)
        return task

    @staticmethod
    async def _guarded(coro: Coroutine[Any, Any, None], name: str) -> None:
        # One task's bug must not cancel the whole group (every save of every client): log it, go on.
        try:
            await coro
        except Exception:
            log.exception("task %s failed unexpectedly", name)

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = next(self._conn_ids)
        try:
            self._spawn(self._serve_client(conn, reader, writer), f"conn={conn}")
        except RuntimeError:  # accepted while shutting down
            writer.close()

    def _service(self) -> CheckpointService:
        if self.service is None:
            raise RuntimeError("the daemon is not running")
        return self.service

    def _socket(self) -> SocketClaim:
        if self._claim is None:
            raise RuntimeError("the daemon is not running")
        return self._claim

    def _arena(self) -> Arena:
        if self.arena is None:
            raise RuntimeError("the daemon is not running")
        return self.arena

    async def _serve_client(self, conn: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        arena = self._arena()
        self._clients += 1
        self._client_seen = asyncio.get_running_loop().time()
        self._conn_since[conn] = time.monotonic()
        try:
            pid, uid = _peer(sock) if sock is not None else (0, os.getuid())
            if uid != os.getuid():
                log.warning("conn=%d: refused a peer of another user", conn)
                return
            self._owner_is_rank |= pid == self.config.owner_pid
            while True:
                try:
                    first = await reader.readexactly(1)  # between requests a client may stay idle for ever
                except asyncio.IncompleteReadError:
                    return
                try:
                    async with asyncio.timeout(self.config.read_timeout_s):  # a frame begun comes whole, in time
                        header = first + await reader.readexactly(HEADER.size - 1)
                        n = frame_length(header, self.config.max_frame_bytes)
                        body = await reader.readexactly(n)
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
            self._clients -= 1
            self._client_seen = asyncio.get_running_loop().time()
            self._conn_since.pop(conn, None)
            if self.service is not None:
                self.service.plans.forget(conn)
            freed = arena.release_owner(conn)
            if freed:
                log.info("conn=%d: client left; released %d unused lease(s)", conn, freed)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _send(self, writer: asyncio.StreamWriter, reply: Reply) -> None:
        limit = self.config.max_frame_bytes
        try:
            frame = encode(reply, limit)
        except ProtocolError as exc:  # an answer too big for one frame: the client still gets a typed one
            log.error("an answer does not fit the frame limit (max_frame_bytes): %s", exc)
            err = ErrorReply(v=PROTOCOL_VERSION, code=ProtocolError.__name__,
                             message=f"the daemon's answer does not fit in one frame: {exc} (max_frame_bytes)")
            try:
                frame = encode(err, limit)
            except ProtocolError as again:  # not even that fits: only closing the connection is left
                raise ConnectionAbortedError(str(again)) from exc
        writer.write(frame)
        await writer.drain()

    async def _handle(self, conn: int, body: bytes) -> Reply:
        """The answer to one whole frame: a typed :class:`ErrorReply` for a bad request, and for a bug of the
        daemon's (``InternalError``, logged with its traceback); the connection stays usable either way."""
        try:
            req = decode_request(body)
            return await self._dispatch(conn, req)
        except CkptdError as exc:
            log.info("conn=%d: rejected request: %s: %s", conn, type(exc).__name__, exc)
            return ErrorReply(v=PROTOCOL_VERSION, code=type(exc).__name__, message=str(exc))
        except Exception as exc:
            log.exception("conn=%d: a request failed unexpectedly", conn)
            return ErrorReply(v=PROTOCOL_VERSION, code="InternalError",
                              message=f"the daemon failed on this request: {type(exc).__name__}: {exc}")

    async def _dispatch(self, conn: int, req: Request) -> Reply:
        service, arena = self._service(), self._arena()
        v = PROTOCOL_VERSION
        match req:
            case Hello():
                return Welcome(
                    v=v, daemon_pid=os.getpid(), arena_path=arena.path, arena_bytes=arena.size,
                    root=self.config.root, job_id=self.config.job_id or "", owner_pid=self.config.owner_pid or 0,
                    draining=service.draining or self._stop.is_set(), commit_timeout_s=self.config.commit_timeout_s,
                )
            case LeaseRequest():
                if service.draining:
                    raise DaemonShuttingDownError("the daemon is shutting down and grants no staging space")
                if any(n < 0 for n in req.sizes) or len(req.sizes) > MAX_SHARDS:
                    raise InvalidRequestError(f"lease sizes must be >= 0, at most {MAX_SHARDS} of them: "
                                              f"{len(req.sizes)} given, {req.sizes[:8]}...")
                if req.ahead:  # for the client's next save: no room now is an answer, not an event to log
                    try:
                        lease = await arena.lease(conn, req.sizes, 0.0, ahead=True, leave=service.due_slots(req.rank))
                    except BackpressureError as exc:
                        return ErrorReply(v=v, code=type(exc).__name__, message=str(exc))
                else:
                    lease = await arena.lease(conn, req.sizes, max(0.0, req.timeout_s))
                return LeaseGranted(v=v, lease_id=lease.lease_id, offsets=lease.offsets)
            case PrepareStep():
                await service.prepare(req, since=self._conn_since.get(conn, 0.0))
                return StepPrepared(v=v, step=req.step)
            case SaveRequest():
                nbytes = await service.accept(req, conn, since=self._conn_since.get(conn, 0.0))
                return SaveAccepted(v=v, step=req.step, nbytes=nbytes)
            case ReleaseRequest():
                held = arena.get(req.lease_id, conn)
                if held is None:
                    raise InvalidRequestError(f"lease {req.lease_id} is not held by this connection")
                arena.release(held)
                return Released(v=v, lease_id=req.lease_id)
            case RegisterPlan():
                return PlanRegistered(v=v, plan_id=service.plans.register(req, conn))
            case StatusRequest():
                state, err = await service.status(req.step, min(max(0.0, req.wait_s), MAX_STATUS_WAIT_S), req.attempt)
                return StepStatus(
                    v=v, step=req.step, state=state, error_code=type(err).__name__ if err else "",
                    error=str(err) if err else "",
                )
            case RestoreRequest():
                return service.retention.reply(req.step)
            case ReportRequest():
                return status_report(service.stats, service.jobs, arena, service.root.backend,
                                     root=self.config.root, draining=service.draining or self._stop.is_set(),
                                     retained=service.retention.retained_bytes,
                                     retain=service.retention.enabled, job_id=self.config.job_id or "",
                                     owner_pid=self.config.owner_pid or 0, socket=self.config.socket)
        raise ProtocolError(f"unexpected message {type(req).__name__}")
