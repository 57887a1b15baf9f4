"""A plan save's static copies, started before its checks.

Most of what a Megatron save with thousands of tensors spends beyond the copy is its checks: the structure
(:class:`~ckptd.client.megatron.staged.Structure`), the optimizer-state lookups, the plain data. They read
Python objects only. Nearly all of the bytes are the plan's **static** sources — runs of the params' buffers
and the re-homed optimizer states, memory the plan itself holds — so their copy can run meanwhile: when the
lease granted with the previous save is there (:meth:`~ckptd.client.pipeline.Pipeline.take`), :func:`begin`
copies them into it first. On a GPU those D2H transfers are queued (``non_blocking``) and the checks run on
the CPU while they move; the save then copies only its looked-up sources, waits once, and goes on as usual.
On a CPU with a second core for the rank (:func:`~ckptd.client.staging.spare_core`) the memcpy
runs on a worker thread meanwhile (torch releases the GIL inside it) and the save waits for it before its own
copy; without one it is the same memcpy, made before the checks instead of after.

Why this cannot save wrong bytes:

- the sources copied are the plan's own references (memory that cannot have been freed) into the plan's own
  lease, and the save's request (what the daemon commits) is sent only after the checks passed (before them
  at most the step's announcement, ``PrepareStep``, which carries no data);
- a check that fails (the save plans again), a looked-up source that no longer matches, or any error before
  the save took the lease over ends in :meth:`EarlyCopy.abandon`: it waits for the queued transfers (or the
  worker's copy), then gives the lease back, so no transfer lands in a span the daemon may grant again;
- the lease belongs to the connection it was granted on: when that connection is gone by the time the save
  uses it, the transfers are waited for and the save leases anew (a reconnect maps the arena again, and
  the mapping waits for queued transfers before it is dropped: :meth:`~ckptd.client.staging.StagingArena.close`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptd.client.handle import refuse_repeat
from ckptd.client.pipeline import send_prepare

if TYPE_CHECKING:
    import socket

    from ckptd.client.client import CheckpointClient
    from ckptd.client.pipeline import _Owed
    from ckptd.client.plan import StagePlan
    from ckptd.client.protocol import LeaseGranted


@dataclass
class EarlyCopy:
    """A plan's static sources copied (or, on a GPU, being copied) into a lease, ahead of the save."""

    client: CheckpointClient
    plan: StagePlan | None  # let go of once done (a save that plans again frees the old plan first)
    grant: LeaseGranted
    sock: socket.socket  # the connection the lease was granted on
    prepared: _Owed | None = None  # the step's PrepareStep sent ahead too: its answer, read after the copy
    done: bool = False  # taken over by the save, or abandoned

    def take(self, plan: StagePlan) -> LeaseGranted | None:
        """The lease, for the save of ``plan`` that now owns it (its static sources are in it); None when
        it cannot be used (another plan, another connection): abandoned, and the save copies everything."""
        if self.done:
            return None
        if plan is not self.plan or self.client._sock is not self.sock:
            self.abandon()
            return None
        self.done, self.plan = True, None
        self.client._pipe.early["used"] += 1
        return self.grant

    def abandon(self) -> None:
        """Wait for the queued transfers, then give the lease back (once; a no-op once taken over)."""
        if self.done:
            return
        self.done, self.plan = True, None
        client = self.client
        client._staging.settle()
        client._pipe.early["abandoned"] += 1
        if client._sock is self.sock:  # else the daemon freed it with the connection
            client._release(self.grant)


def begin(client: CheckpointClient, plan: StagePlan, step: int, prepare: bool) -> EarlyCopy | None:
    """Copy ``plan``'s static sources into the lease granted ahead for this save of ``step``, if there is one
    (the caller passes the result to the save, and :meth:`~EarlyCopy.abandon`\\ s it on any other way out); else
    None. ``prepare`` (a save that waits for its answer): announce the step now too (``PrepareStep``), so the
    daemon's storage checks of the step run while this rank copies and checks. Call it inside the save call
    (``CheckpointClient.one_save_call``): the announcement carries the call's attempt token. (An earlier save's
    failure is raised by the save after this; a step announced and then not saved fails on the daemon by
    ``--part-timeout``, as any rank's that never saves.)"""
    if not plan.has_static or client._sock is None:
        return None
    client._drop_if_dead()  # as the save itself does first: the lease's answer, and those before it, read
    refuse_repeat(client, step)  # before a new attempt is announced: it would give up the one in flight
    grant = client._pipe.take(client, plan.span)
    if grant is None:
        return None
    early = EarlyCopy(client, plan, grant, client._sock)
    try:
        client._staging.stage_static(plan, grant.offsets[0])
        if prepare:
            client._attempt = client._attempts.next(step)  # the save's own token (one save call: the same)
            early.prepared = send_prepare(client, step)
    except BaseException:
        early.abandon()
        raise
    return early


@contextlib.contextmanager
def copied_ahead(
    client: CheckpointClient, plan: StagePlan | None, step: int, prepare: bool
) -> Iterator[EarlyCopy | None]:
    """:func:`begin` for ``plan`` (None: nothing to copy ahead), abandoned on the way out unless a save took it
    over. Holds no reference to ``plan`` meanwhile: a save that plans again frees the old plan first."""
    early = begin(client, plan, step, prepare) if plan is not None else None
    del plan
    try:
        yield early
    finally:
        if early is not None:
            early.abandon()
