"""The training rank's side: hand shards to the node daemon through shared memory, then get back to work.

``save()`` blocks only for the copy into a staging slot the daemon granted (plus two short socket
round trips); it imports no zarr or fsspec and starts no thread or event loop, so training processes
stay fork-safe. Everything after the copy happens in the daemon; :class:`SaveHandle` reports it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args

import msgspec
import torch

from ckptd.client.attempts import Attempts
from ckptd.client.collector import paused
from ckptd.client.daemon_lost import (
    DAEMON_LOST_POLICIES,
    DaemonLostPolicy,
    DaemonUnresponsiveError,
    must_raise,
    peer_hung_up,
    warn_lost,
)
from ckptd.client.early import EarlyCopy
from ckptd.client.embedded import ensure_daemon
from ckptd.client.handle import SaveHandle, raise_background_errors, refuse_repeat, track
from ckptd.client.ownership import check_daemon_job, job_identity, owner_pid
from ckptd.client.paths import client_socket_path
from ckptd.client.pipeline import Pipeline, check_prepared, lease_ahead, save_span, send_prepare
from ckptd.client.placement import Placement
from ckptd.client.plan import StagePlan, shard_meta
from ckptd.client.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    LeaseGranted,
    LeaseRequest,
    PlanRegistered,
    ReleaseRequest,
    Reply,
    SaveAccepted,
    SaveRequest,
    ShardMeta,
    StatusRequest,
    StepStatus,
    Welcome,
    _Msg,
    decode_reply,
    encode,
    encode_objects,
    frame_length,
    recv_exactly,
)
from ckptd.client.reuse import RepeatedPlans, Route
from ckptd.client.staging import StagingArena, spare_core
from ckptd.client.state import Plan, Shard, replica_metas
from ckptd.client.trust import connect_own
from ckptd.writer.errors import (
    BackpressureError,
    CkptdError,
    ConfigError,
    DaemonUnavailableError,
    PlanUnknownError,
    ProtocolError,
    RootMismatchError,
    StaleDaemonError,
    error_classes,
)
from ckptd.writer.format import sidecar_name
from ckptd.writer.urls import normalize_root

log = logging.getLogger(__name__)

Policy = Literal["wait", "fail", "skip"]
# A state dict: tensors (or Shard / ShardedTensor descriptions of them) and plain data, nested in dicts and
# lists. Values are typed ``object`` because what a leaf may be is checked at run time by plan_state.
StateDict = Mapping[str, object]
_R = TypeVar("_R", bound=_Msg)
PROBE_S = 2.0  # a daemon that left a request unanswered gets this long for a reconnect's Hello, not timeout_s
_ERRORS, _POLL_S = error_classes(), 0.5


def _raise_reply(reply: ErrorReply) -> None:
    raise _ERRORS.get(reply.code, CkptdError)(reply.message)


def _expect(reply: Reply, kind: type[_R]) -> _R:
    """``reply`` if it is the answer the request calls for, else :class:`ProtocolError`."""
    if not isinstance(reply, kind):
        raise ProtocolError(f"the daemon answered {type(reply).__name__} where {kind.__name__} was expected")
    return reply


class CheckpointClient:
    """A rank's connection to its node daemon.

    ``socket_path`` defaults to the agreed per-root location (:func:`ckptd.client.paths.client_socket_path`);
    a daemon that writes to another root than ``root`` is refused (:class:`RootMismatchError`). With
    ``start_daemon=True`` and a ``root``, the first rank on a node that finds no daemon starts one as a
    separate process (the embedded default); otherwise run ``ckptd serve`` next to the job.

    ``job_id`` (default: :func:`ckptd.client.ownership.job_identity` of the environment) is this client's
    job: a daemon of another job is refused (:class:`JobMismatchError`), or, with ``start_daemon=True``
    and that job over (its daemon draining), waited for and replaced; an embedded daemon is started with
    this job id and exits once the job's owner process is gone (:mod:`ckptd.client.ownership`).

    ``on_daemon_lost``: ``"warn"`` (default) fails only the save's handle when the daemon is gone (or hung:
    a save then waits :data:`PROBE_S` for it), with one warning; ``"raise"`` raises
    :class:`DaemonUnavailableError` (:mod:`ckptd.client.daemon_lost`). ``assume_constant_structure=True``:
    each save stages what the previous one did (values change); plan saves wait for no answer
    (:mod:`ckptd.client.pipeline`) and the Megatron save skips per-tensor checks.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        root: str | None = None,
        placement: Placement | None = None,
        backpressure: Policy = "wait",
        lease_timeout_s: float = 300.0,
        timeout_s: float = 60.0,
        start_daemon: bool = False,
        daemon_args: Sequence[str] = (),
        storage_options: Mapping[str, object] | None = None,
        on_daemon_lost: DaemonLostPolicy = "warn",
        job_id: str | None = None,
        assume_constant_structure: bool = False,
    ) -> None:
        env = os.environ
        if on_daemon_lost not in DAEMON_LOST_POLICIES:
            raise ConfigError(f"on_daemon_lost must be one of {DAEMON_LOST_POLICIES}, got {on_daemon_lost!r}")
        self.on_daemon_lost: DaemonLostPolicy = on_daemon_lost
        self.socket_path = socket_path or client_socket_path(env, root)
        self.placement = placement or Placement.detect(env)
        if backpressure not in get_args(Policy):  # a typo would act as "fail"
            raise ConfigError(f"backpressure must be one of {get_args(Policy)}, got {backpressure!r}")
        self.backpressure: Policy = backpressure
        self.lease_timeout_s = lease_timeout_s
        self.timeout_s = timeout_s
        self.storage_options = dict(storage_options or {})
        self._start_daemon = start_daemon
        self._daemon_args = list(daemon_args)
        self._root = root
        self.job_id = job_id or job_identity(env)
        self._sock: socket.socket | None = None
        self._unanswered = False  # the daemon left a request unanswered: a reconnect's Hello waits PROBE_S
        self._staging = StagingArena(threaded=spare_core(self.placement.local_world_size))
        self._welcome: Welcome | None = None
        self._handles: list[SaveHandle] = []
        self._sidecars_sent: set[str] = set()
        self._repeats = RepeatedPlans()  # the plain save path's plan, reused while the structure holds
        track(self)
        self.assume_constant_structure = assume_constant_structure
        self._pipe = Pipeline()  # answers read later, the lease granted ahead (assume_constant_structure)
        self._attempts = Attempts(env, self.placement.rank)
        self._attempt = ""  # the token of the save being made (:mod:`ckptd.client.attempts`)
        self._connect()

    # --- connection -------------------------------------------------------------------------------
    @property
    def root(self) -> str:
        """The checkpoint root: the one given, else the one the daemon writes to."""
        if self._root:
            return self._root
        if self._welcome is None:
            raise DaemonUnavailableError(f"not connected to a daemon at {self.socket_path}")
        return self._welcome.root

    def _connect(self) -> None:
        try:
            self._open_socket()
        except StaleDaemonError as exc:  # another job's daemon on our socket, on its way out
            if not self._start_daemon:
                raise
            self._spawn_daemon(replacing=exc.daemon_pid)
            self._open_socket()
        except DaemonUnresponsiveError:  # a daemon is there and hung: another one must not write its root
            raise
        except DaemonUnavailableError:
            if not self._start_daemon:
                raise
            self._spawn_daemon()
            self._open_socket()

    def _open_socket(self) -> None:
        self._close_socket()
        # this user's daemon only (else ConfigError, never "lost"); after a hang each save's Hello is a short probe
        sock = connect_own(self.socket_path, min(PROBE_S, self.timeout_s) if self._unanswered else self.timeout_s)
        self._sock = sock
        self._sidecars_sent = set()  # a new daemon may serve another root
        welcome = _expect(self._request(Hello(v=PROTOCOL_VERSION, pid=os.getpid(), rank=self.placement.rank)), Welcome)
        sock.settimeout(self.timeout_s)
        self._unanswered = False
        if self._root and normalize_root(welcome.root) != normalize_root(self._root):
            self._close_socket()
            raise RootMismatchError(
                f"the daemon at {self.socket_path} (pid {welcome.daemon_pid}) writes to root {welcome.root!r}, "
                f"this client was given root {self._root!r}: start a daemon for this root or use its socket"
            )
        try:
            check_daemon_job(self.job_id, welcome.job_id, daemon_pid=welcome.daemon_pid, owner=welcome.owner_pid,
                             draining=welcome.draining, socket_path=self.socket_path)
            self._staging.map(welcome.arena_path, welcome.arena_bytes)  # its file gone: DaemonUnavailableError
        except CkptdError:
            self._close_socket()
            raise
        self._welcome = welcome

    def _spawn_daemon(self, replacing: int = 0) -> None:
        if not self._root:
            raise DaemonUnavailableError("start_daemon=True needs root= to tell the daemon where to write")
        ensure_daemon(self.socket_path, self._root, self._daemon_args, timeout_s=self.timeout_s,
                      rank=self.placement.rank, job_id=self.job_id, owner_pid=owner_pid(os.environ),
                      replacing=replacing)

    def _drop_if_dead(self) -> None:
        """Close the connection if the daemon hung up (died, restarted): the next request reconnects."""
        self._pipe.drain(self)  # answers still owed make the socket readable: read them first
        if self._sock is not None and peer_hung_up(self._sock):
            log.warning("rank %d: the daemon at %s went away; reconnecting", self.placement.rank, self.socket_path)
            self._close_socket()

    def _close_socket(self) -> None:
        """End the connection and unmap the arena (after the copies queued into it): a dead daemon's tmpfs pages
        stay allocated while a rank maps them (a restarted daemon may lack the space); a new connection maps anew."""
        self._pipe.reset()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        self._staging.close()

    def read_answers(self) -> None:
        """Read now the daemon's answers that pipelined saves (``assume_constant_structure``) left owed: a
        refusal reaches its handle, and the plans those saves held for a resend are let go (a caller about
        to plan again calls it first, so the old plan's tensors are freed before new ones are allocated)."""
        self._pipe.drain(self)

    def close(self) -> None:
        """Close the socket and unmap the arena (saves already handed over go on in the daemon)."""
        self._pipe.drain(self)  # a save's refusal still reaches its handle
        self._close_socket()

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, msg: _Msg, ahead: LeaseRequest | None = None, *, wait_s: float = 0.0) -> Reply:
        """Send ``msg`` and read its answer. ``ahead``: a lease request for the next save, sent with it; its
        answer stays owed (:mod:`ckptd.client.pipeline`: read by the next exchange, the next save takes the
        lease). ``wait_s``: how long the daemon may hold its answer back on purpose, on top of ``timeout_s``."""
        if self._pipe.owed:
            self._pipe.drain(self)
        if self._sock is None:
            self._connect()  # reconnect; the embedded mode starts a new daemon if the old one is gone
        sock = self._sock
        if sock is None:
            raise DaemonUnavailableError(f"no connection to the daemon at {self.socket_path}")
        limit = self.timeout_s + wait_s if wait_s else sock.gettimeout() or self.timeout_s
        try:
            if wait_s:
                sock.settimeout(limit)
            sock.sendall(encode(msg) if ahead is None else encode(msg) + encode(ahead))
            if ahead is not None:
                self._pipe.owe_lease(ahead.sizes[0])
            header = self._recv_exactly(HEADER.size)
            reply = decode_reply(self._recv_exactly(frame_length(header)))
            if wait_s:
                sock.settimeout(self.timeout_s)
        except TimeoutError as exc:  # a hung daemon is a lost one (the on_daemon_lost policy decides)
            self._close_socket()
            self._unanswered = True
            why = f"the daemon at {self.socket_path} did not answer within {limit:g}s (stopped or stuck?)"
            raise DaemonUnresponsiveError(why + ": the connection is closed, the next save connects again") from exc
        except (OSError, ProtocolError) as exc:
            self._close_socket()
            raise DaemonUnavailableError(f"lost the connection to the daemon at {self.socket_path}: {exc}") from exc
        if isinstance(reply, ErrorReply):
            _raise_reply(reply)
        return reply

    def _recv_exactly(self, n: int) -> bytes:
        if self._sock is None:
            raise ConnectionResetError("the connection to the daemon was closed")
        return recv_exactly(self._sock, n)

    def _status(self, step: int, wait_s: float, attempt: str = "") -> StepStatus:
        ask = StatusRequest(v=PROTOCOL_VERSION, step=step, wait_s=wait_s, attempt=attempt)
        return _expect(self._request(ask, wait_s=wait_s), StepStatus)  # the daemon may hold it up to wait_s

    # --- save -------------------------------------------------------------------------------------
    @paused
    def save(self, step: int, state: StateDict, *, sidecars: Sequence[str] = ()) -> SaveHandle:
        """Stage ``state`` for ``step`` and return once it is copied; the caller may then overwrite it.

        ``sidecars`` are JSON documents stored once per root under their content hash (e.g. a model
        layout); reference them from ``state`` by :func:`ckptd.writer.format.sidecar_name`. Each is sent
        to the daemon once per connection. Raises the error of an earlier save that failed in the
        background, typed errors for bad input, and (policy ``"fail"``) :class:`BackpressureError` when the
        arena is still full.
        """
        t0 = time.perf_counter()
        return self._save(step, self._repeats.route(state, self.placement.rank), sidecars, t0)

    @paused
    def save_plan(self, step: int, plan: Plan, *, sidecars: Sequence[str] = ()) -> SaveHandle:
        """Like :meth:`save` for an already planned state (callers that cache their plan)."""
        t0 = time.perf_counter()
        return self._save(step, self._repeats.route_plan(plan), sidecars, t0)

    @paused
    def save_staged(
        self,
        step: int,
        plan: StagePlan,
        dynamic: Sequence[torch.Tensor],
        objects: dict[str, Any],
        *,
        sidecars: Sequence[str] = (),
        t0: float | None = None,
        fetched: Sequence[torch.Tensor] | None = None,
        pipelined: bool | None = None,
        early: EarlyCopy | None = None,
    ) -> SaveHandle:
        """Like :meth:`save_plan` for a compiled :class:`~ckptd.client.plan.StagePlan`: registered with the
        daemon once (again after it restarted), then per save one span lease, the plan's batched copies
        (``dynamic``: its per-save tensors, in order) and a request that names the plan. Raises
        :class:`~ckptd.client.plan.StalePlanError` before leasing when a looked-up source changed.
        ``fetched``: the plan's looked-up sources as the caller holds them (:meth:`StagePlan.fetch`);
        ``pipelined``: wait for no answer (:mod:`ckptd.client.pipeline`; default: ``assume_constant_structure``);
        ``early``: the plan's static sources copied ahead (:mod:`ckptd.client.early`), whose lease it takes over."""
        t0 = time.perf_counter() if t0 is None else t0
        args = (step, plan, dynamic, objects, sidecars, t0, fetched, pipelined, early)
        return self._guarded(step, t0, lambda: self._save_span(*args))

    def one_save_call(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Saves of ``step`` inside are one save call, one attempt: a save that tries again inside itself
        (its peers did not) keeps its attempt token (:mod:`ckptd.client.attempts`)."""
        return self._attempts.one_call(step)

    def _register_plan(self, plan: StagePlan) -> int:
        reply = _expect(self._request(plan.register_message(self.placement.rank)), PlanRegistered)
        if self._welcome is not None:
            plan.registered = (self._welcome, reply.plan_id)
        return reply.plan_id

    def _save(self, step: int, route: Route, sidecars: Sequence[str], t0: float) -> SaveHandle:
        """``t0`` is when the caller's save began: ``SaveHandle.stall_s`` is all the time it was blocked.
        A structure saved before goes through its registered plan (:mod:`ckptd.client.reuse`)."""
        if isinstance(route, Plan):
            return self._guarded(step, t0, lambda: self._save_shards(step, route, sidecars, t0))
        return self._guarded(step, t0, lambda: self._save_span(step, *route, sidecars, t0))

    def _guarded(self, step: int, t0: float, attempt: Callable[[], SaveHandle]) -> SaveHandle:
        """Run one save attempt under the daemon-loss policy: a lost daemon fails the save's handle (with a
        warning) instead of raising into the training loop, unless ``on_daemon_lost="raise"``."""
        self._drop_if_dead()
        self._raise_background_errors()
        refuse_repeat(self, step)
        self._attempt = self._attempts.next(step)
        try:
            return attempt()
        except DaemonUnavailableError as exc:
            handle = SaveHandle(self, step, 0, time.perf_counter() - t0)._fail(exc)
            if self._must_raise(handle):
                handle._delivered = True
                raise
            return handle

    def _must_raise(self, handle: SaveHandle) -> bool:
        """Whether ``handle``'s error goes up into the caller (else: a warning, once, and the handle says it)."""
        if must_raise(handle._error, self.on_daemon_lost):
            return True
        if not handle._delivered:
            handle._delivered = True
            warn_lost(self.placement.rank, handle.step, handle._error)
        return False

    def _lease(self, step: int, sizes: list[int], t0: float) -> LeaseGranted | SaveHandle:
        """Staging space for one save, or a skipped handle (policy ``skip`` with the arena still full)."""
        timeout = self.lease_timeout_s if self.backpressure == "wait" else 0.0
        self._pipe.release(self)  # a lease granted ahead and not used: give it back first
        try:
            ask = LeaseRequest(v=PROTOCOL_VERSION, step=step, rank=self.placement.rank, sizes=sizes, timeout_s=timeout)
            grant = self._request(ask, wait_s=timeout)  # the daemon may wait up to ``timeout`` for space
        except BackpressureError:
            if self.backpressure == "skip":
                log.warning("rank %d: step %d skipped: staging arena still full", self.placement.rank, step)
                return SaveHandle(None, step, 0, time.perf_counter() - t0, skipped=True)
            raise
        return _expect(grant, LeaseGranted)

    def _save_shards(self, step: int, plan: Plan, sidecars: Sequence[str], t0: float) -> SaveHandle:
        """One save of planned shards: a slot each, one copy each, the shard metas in the request."""
        docs = self._unsent(sidecars)
        encode_objects(plan.objects)
        grant = self._lease(step, [s.nbytes for s in plan.shards], t0)
        if isinstance(grant, SaveHandle):
            return grant
        try:
            prepared = send_prepare(self, step)  # the daemon starts the step while the shards are copied
            self._staging.stage(plan.shards, grant.offsets)
            metas = [shard_meta(s, i) for i, s in enumerate(plan.shards)]
            check_prepared(self, prepared)
            reply = self._request(self._save_request(step, grant, metas, plan.objects, docs, 0, t0, plan.replicas))
            self._sidecars_sent.update(docs)
        except BaseException:
            self._release(grant)
            raise
        return self._accepted(step, reply, t0)

    def _save_span(
        self, step: int, plan: StagePlan, dynamic: Sequence[torch.Tensor], objects: dict[str, Any],
        sidecars: Sequence[str], t0: float, fetched: Sequence[torch.Tensor] | None = None,
        pipelined: bool | None = None, early: EarlyCopy | None = None,
    ) -> SaveHandle:
        """One save through a registered plan: one span lease, the plan's batched copies, a request naming it."""
        docs = self._unsent(sidecars)
        encode_objects(objects)
        sources = plan.sources(dynamic, fetched)
        plan_id = plan.plan_id(self._welcome) or self._register_plan(plan)  # once per connection
        ahead = early.take(plan) if early is not None else None  # its static sources are in it already
        if self.assume_constant_structure if pipelined is None else pipelined:
            return save_span(self, step, plan, sources, objects, docs, t0, plan_id, ahead)
        if ahead is None:
            self._pipe.drain(self)  # the lease asked for with the previous save, if its answer is still unread
        grant = ahead or self._pipe.take(self, plan.span) or self._lease(step, [plan.span], t0)
        if isinstance(grant, SaveHandle):
            return grant
        try:
            prepared = early.prepared if early is not None and ahead is not None else send_prepare(self, step)
            self._staging.stage_plan(plan, grant.offsets[0], sources, static=ahead is None)
            check_prepared(self, prepared)
            req = self._save_request(step, grant, [], objects, docs, plan_id, t0)
            try:  # the next save's lease asked for with this one: one round trip a save, not two
                reply = self._request(req, ahead=lease_ahead(step, self.placement.rank, plan.span))
            except PlanUnknownError:  # the daemon dropped it (or is another one): register again, resend
                reply = self._request(msgspec.structs.replace(req, plan_id=self._register_plan(plan)))
            self._sidecars_sent.update(docs)
        except BaseException:
            self._release(grant)
            raise
        return self._accepted(step, reply, t0)

    def _save_request(
        self, step: int, grant: LeaseGranted, shards: list[ShardMeta], objects: dict[str, Any],
        docs: dict[str, str], plan_id: int, t0: float, replicas: Sequence[Shard] = (),
    ) -> SaveRequest:
        p = self.placement
        return SaveRequest(
            v=PROTOCOL_VERSION, lease_id=grant.lease_id, step=step, rank=p.rank, world_size=p.world_size,
            node=p.node, num_nodes=p.num_nodes, local_world_size=p.local_world_size, shards=shards,
            objects=objects, sidecars=docs, plan_id=plan_id, replicas=replica_metas(replicas),
            stall_s=time.perf_counter() - t0, attempt=self._attempt,
        )

    def _unsent(self, sidecars: Sequence[str]) -> dict[str, str]:
        docs = {_sidecar_name(t): t for t in sidecars}
        return {n: t for n, t in docs.items() if n not in self._sidecars_sent}

    def _release(self, grant: LeaseGranted) -> None:
        if self._sock is None:  # the connection it was granted on is gone, and the lease with it: no reconnect
            return
        with contextlib.suppress(CkptdError):
            self._request(ReleaseRequest(v=PROTOCOL_VERSION, lease_id=grant.lease_id))

    def _accepted(self, step: int, reply: Reply, t0: float) -> SaveHandle:
        accepted = _expect(reply, SaveAccepted)
        handle = SaveHandle(self, step, accepted.nbytes, time.perf_counter() - t0, attempt=self._attempt)
        self._handles.append(handle)
        return handle

    def _raise_background_errors(self) -> None:
        raise_background_errors(self)

    # --- load -------------------------------------------------------------------------------------
    def load(self, step: int | Literal["latest"], template: StateDict) -> dict[str, object]:
        """Fill the template's tensors in place from a committed step (see :func:`ckptd.client.reader.load`)."""
        from ckptd.client.reader import load

        return load(self.root, step, template, rank=self.placement.rank, storage_options=self.storage_options)


# the layout sidecar is the same string every save: hash it once (its sha256 costs ~1 µs per shard)
_sidecar_name = functools.lru_cache(maxsize=16)(sidecar_name)

