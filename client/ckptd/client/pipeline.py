"""Saves that wait for no answer (``assume_constant_structure``): the copy, one send, back to training.

A plan save normally makes two round trips while the trainer waits: the lease before the copy and the
save request after it (the daemon's validation, run before it answers). The storage checks of a step's
first save (committed already? leftovers of an earlier attempt?) run while the rank copies: a save that
waits for its answer announces its step first (:func:`send_prepare`, not waited for) and reads that
answer after the copy (:func:`check_prepared`), raising the typed error a refusal carries.

Under the constant-structure promise the next save will stage the same span, so :func:`save_span` sends the
save request together with a lease request for the next save (``timeout_s=0``: granted only if the arena has
room now, never waited for) and returns without reading either answer. The next exchange with the daemon (the
next save, ``handle.wait()``, ``close()``) reads them first, in order (:meth:`Pipeline.drain`): the save's
acceptance or its typed error (the handle fails with it: ``wait()`` or the next ``save()`` raises it, as for
any background failure), and the granted lease, which the next save copies into at once
(:meth:`Pipeline.take`). Until then each save holds its plan (to register it again should the daemon have
dropped it); a Megatron save that plans again reads the answers first
(:meth:`~ckptd.client.client.CheckpointClient.read_answers`), so the old plan's tensors (re-homed optimizer
states) are freed before the new plan allocates its own.

The pre-granted lease belongs to the connection: the daemon frees it when the client disconnects, and a
save of another size, or any save that leases the usual way, gives it back first (:meth:`Pipeline.release`).
The daemon grants it from free space only (:func:`lease_ahead`): it never evicts the step kept for an
in-memory restore. A checked plan save (without the promise) asks for it too, with its own request, and
still waits for that request's answer: one round trip a save instead of two; its lease answer is read like
the pipelined ones (:meth:`Pipeline.owe_lease`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from ckptd.client.handle import SaveHandle
from ckptd.client.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    ErrorReply,
    LeaseGranted,
    LeaseRequest,
    PrepareStep,
    SaveAccepted,
    SaveRequest,
    StatusRequest,
    StepStatus,
    decode_reply,
    encode,
    frame_length,
)
from ckptd.writer.errors import CkptdError, DaemonUnavailableError, ProtocolError, error_classes

if TYPE_CHECKING:
    import socket

    from ckptd.client.client import CheckpointClient
    from ckptd.client.plan import StagePlan

log = logging.getLogger(__name__)
_ERRORS = error_classes()


@dataclass
class _Owed:
    """An answer the daemon owes: a save's (``handle`` set) or the next save's lease (``size`` bytes)."""

    handle: SaveHandle | None = None
    grant: LeaseGranted | None = None
    request: SaveRequest | None = None
    plan: StagePlan | None = None
    size: int = 0
    polled: SaveHandle | None = None  # an earlier save whose step's state was asked for
    prepared: bool = False  # a PrepareStep's: ``reply`` keeps it for the save that sent it
    reply: Any = None
    docs: tuple[str, ...] = ()  # the sidecars the save carried: sent once the daemon accepted it


@dataclass
class _Held:
    grant: LeaseGranted
    size: int
    sock: socket.socket  # the connection it was granted on: the daemon frees it when that one ends


class Pipeline:
    """One client's answers still unread and the lease granted ahead for its next save."""

    def __init__(self) -> None:
        self.owed: list[_Owed] = []
        self.held: _Held | None = None
        self.early: Counter[str] = Counter()  # static copies started ahead of a save: "used", "abandoned"

    def reset(self) -> None:
        """The connection ended: what it owed is gone with it (a handle learns its step's fate by status), and
        so is the pre-granted lease (the daemon frees a departed connection's leases)."""
        self.owed.clear()
        self.held = None

    def drain(self, client: CheckpointClient) -> None:
        """Read every answer still owed, in order, then act on them: a refused save fails its handle (and
        gives its lease back), a save naming a plan the daemon dropped is registered and sent again."""
        owed, self.owed = self.owed, []
        answers: list[tuple[_Owed, Any]] = []
        try:
            for o in owed:
                header = client._recv_exactly(HEADER.size)
                answers.append((o, decode_reply(client._recv_exactly(frame_length(header)))))
        except (TimeoutError, OSError, ProtocolError) as exc:
            log.warning("rank %d: lost the daemon's answers to earlier saves: %s", client.placement.rank, exc)
            client._close_socket()  # the handles ask for their step's state on the next connection
            return
        for o, reply in answers:
            if o.prepared:
                o.reply = reply
            elif o.polled is not None:
                if isinstance(reply, StepStatus):
                    o.polled._apply(reply)
            elif o.handle is None:
                self.held = _Held(reply, o.size, client._sock) if isinstance(reply, LeaseGranted) else None  # type: ignore[arg-type]
            elif isinstance(reply, ErrorReply):
                self._refused(client, o, reply)
            elif isinstance(reply, SaveAccepted):
                client._sidecars_sent.update(o.docs)  # a refused save's sidecars go with the next save again
            else:
                client._close_socket()
                o.handle._fail(ProtocolError(f"the daemon answered a save with {type(reply).__name__}"))

    def _refused(self, client: CheckpointClient, o: _Owed, reply: ErrorReply) -> None:
        if o.handle is None or o.grant is None or o.request is None or o.plan is None:
            return
        error = _ERRORS.get(reply.code, CkptdError)(reply.message)
        if reply.code == "PlanUnknownError":  # the daemon dropped the plan: the staged bytes are still in the lease
            try:
                client._request(msgspec.structs.replace(o.request, plan_id=client._register_plan(o.plan)))
                client._sidecars_sent.update(o.docs)
                return
            except CkptdError as exc:
                error = exc
        client._release(o.grant)
        o.handle._fail(error)

    def take(self, client: CheckpointClient, size: int) -> LeaseGranted | None:
        """The lease granted ahead, if it is this connection's and ``size`` bytes; else give it back."""
        held, self.held = self.held, None
        if held is not None and held.sock is client._sock and held.size == size:
            return held.grant
        if held is not None and held.sock is client._sock:
            client._release(held.grant)
        return None

    def owe_lease(self, size: int) -> None:
        """A lease request for the next save (``size`` bytes) went out; its answer is read later, in order."""
        self.owed.append(_Owed(size=size))

    def release(self, client: CheckpointClient) -> None:
        """Give back the lease granted ahead (a save of another kind leases the usual way)."""
        if self.held is not None:
            self.take(client, -1)


def send_prepare(client: CheckpointClient, step: int) -> _Owed | None:
    """Tell the daemon that this rank's save of ``step`` is being copied (:class:`PrepareStep`), so it starts
    the step meanwhile; the answer is read after the copy (:func:`check_prepared`). None when the
    connection is gone (the save's own request finds that out)."""
    sock, p = client._sock, client.placement
    if sock is None:
        return None
    msg = PrepareStep(v=PROTOCOL_VERSION, step=step, rank=p.rank, world_size=p.world_size, node=p.node,
                      num_nodes=p.num_nodes, local_world_size=p.local_world_size, attempt=client._attempt)
    try:
        sock.sendall(encode(msg))
    except OSError:
        return None
    owed = _Owed(prepared=True)
    client._pipe.owed.append(owed)
    return owed


def check_prepared(client: CheckpointClient, owed: _Owed | None) -> None:
    """Read the answer :func:`send_prepare` left owed (and those before it): the save's typed error, raised
    before its request is sent (the caller gives its lease back); :class:`DaemonUnavailableError` when
    the connection was lost meanwhile."""
    if owed is None:
        return
    client._pipe.drain(client)
    if isinstance(owed.reply, ErrorReply):
        raise _ERRORS.get(owed.reply.code, CkptdError)(owed.reply.message)
    if owed.reply is None:
        raise DaemonUnavailableError(f"lost the connection to the daemon at {client.socket_path} during a save")


def lease_ahead(step: int, rank: int, size: int) -> LeaseRequest:
    """The request for the next save's staging space, sent with this save's: granted at once from free
    space, or refused (never waited for, never evicting what the daemon keeps for an in-memory restore)."""
    return LeaseRequest(v=PROTOCOL_VERSION, step=step, rank=rank, sizes=[size], timeout_s=0.0, ahead=True)


def save_span(
    client: CheckpointClient, step: int, plan: StagePlan, sources: list[torch.Tensor], objects: dict[str, Any],
    docs: dict[str, str], t0: float, plan_id: int, ahead: LeaseGranted | None = None,
) -> SaveHandle:
    """One save through a registered plan (as ``plan_id``) without waiting for the daemon: copy into the lease
    granted ahead (``ahead``: its static sources copied already, :mod:`ckptd.client.early`; else the one
    granted ahead and not taken yet, or one leased now), send the save and the next save's lease request,
    return."""
    pipe = client._pipe
    grant = ahead
    if grant is None:
        pipe.drain(client)
        grant = pipe.take(client, plan.span)
    if grant is None:
        leased = client._lease(step, [plan.span], t0)
        if isinstance(leased, SaveHandle):
            return leased
        grant = leased
    try:
        client._staging.stage_plan(plan, grant.offsets[0], sources, static=ahead is None)
        req = client._save_request(step, grant, [], objects, docs, plan_id, t0)
        rank = client.placement.rank
        next_lease = lease_ahead(step, rank, plan.span)
        # earlier saves' states are asked for here too, so the next save learns of a background failure
        # without a round trip of its own (the client's check of earlier saves skips polled handles)
        polls = [h for h in client._handles if not h.state.final]
        sock = client._sock
        if sock is None:
            raise DaemonUnavailableError(f"no connection to the daemon at {client.socket_path}")
        try:
            sock.sendall(b"".join([encode(req), encode(next_lease)] + [
                encode(StatusRequest(v=PROTOCOL_VERSION, step=h.step, wait_s=0.0, attempt=h.attempt)) for h in polls
            ]))
        except OSError as exc:
            client._close_socket()
            raise DaemonUnavailableError(f"lost the connection to the daemon at {client.socket_path}: {exc}") from exc
    except BaseException:
        client._release(grant)
        raise
    handle = SaveHandle(client, step, plan.nbytes, time.perf_counter() - t0, attempt=client._attempt)
    handle._polled = True
    pipe.owed += [_Owed(handle, grant, req, plan, docs=tuple(docs)), _Owed(size=plan.span)]
    pipe.owed += [_Owed(polled=h) for h in polls]
    client._handles.append(handle)
    return handle
