"""The future of one save (:class:`SaveHandle`): node durability, then the global commit."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

from ckptd.client.daemon_lost import DaemonUnresponsiveError
from ckptd.client.protocol import StepState, StepStatus
from ckptd.writer.errors import (
    CkptdError,
    DaemonUnavailableError,
    DuplicateSaveError,
    SaveTimeoutError,
    StepFailedError,
    error_classes,
)
from ckptd.writer.format import other_attempt

if TYPE_CHECKING:
    from ckptd.client.client import CheckpointClient

_ERRORS = error_classes()
_POLL_S = 0.5
# the process's clients: a step saved through one is in flight for every client of the same rank and daemon
_CLIENTS: weakref.WeakSet[CheckpointClient] = weakref.WeakSet()


class SaveHandle:
    """The future of one save: node durability, then global commit. Errors re-raise here."""

    def __init__(
        self, client: CheckpointClient | None, step: int, nbytes: int, stall_s: float, skipped: bool = False,
        attempt: str = "",
    ) -> None:
        self._client = client
        self.step = step
        self.attempt = attempt  # which attempt at the step this save was (client/attempts.py)
        self.nbytes = nbytes
        self.stall_s = stall_s
        self.skipped = skipped
        self.state: StepState = StepState.SKIPPED if skipped else StepState.PENDING
        self._error: CkptdError | None = None
        self._polled = False  # its state is asked for with each pipelined save (client.pipeline), not per save
        self._delivered = False  # the error reached the caller (wait() raised it, or a warning told it)

    def _fail(self, error: CkptdError) -> SaveHandle:
        self.state = StepState.FAILED
        self._error = error
        return self

    def _update(self, wait_s: float) -> None:
        if self.state.final or self._client is None:
            return
        try:
            st = self._client._status(self.step, wait_s, self.attempt)
        except DaemonUnavailableError as exc:  # the daemon died, restarted or hangs: this save is lost with it,
            # unless the daemon committed it first (it died after its marker). Not asked of a hung daemon: it may
            # hang in storage, and the rank would then hang there too
            if isinstance(exc, DaemonUnresponsiveError):
                self._fail(DaemonUnresponsiveError(f"step {self.step}: lost the daemon before the commit: {exc}"))
            elif self._committed_in_storage():
                self.state = StepState.COMMITTED
            else:
                self._fail(DaemonUnavailableError(
                    f"step {self.step}: lost the daemon before the commit (storage holds none of this save): {exc}"))
            return
        self._apply(st)

    def _committed_in_storage(self) -> bool:
        """Whether storage holds this save's commit: a daemon can die after its commit and before it said so.
        Asked once, when the daemon is lost; a step that is not readable as committed counts as not."""
        from ckptd.client.reader import read_commit  # the read path: zarr and fsspec, not on the save path

        assert self._client is not None
        try:  # the root: the one given, else the daemon's from its welcome
            commit = read_commit(self._client.root, self.step, storage_options=self._client.storage_options)
        except (CkptdError, OSError):
            return False
        return not any(other_attempt(a, self.attempt) for a in commit.attempts)

    def _apply(self, st: StepStatus) -> None:
        if self.state.final:  # the daemon refused this save: its answer was read on the way (client.pipeline)
            return
        self.state = st.state
        if st.state is StepState.FAILED:
            cls = _ERRORS.get(st.error_code, StepFailedError)
            self._error = cls(f"step {self.step} failed: {st.error}")
        elif st.state is StepState.UNKNOWN:
            # a restarted daemon never commits its predecessor's unfinished steps: the save is lost
            self._fail(DaemonUnavailableError(
                f"step {self.step}: the daemon has no record of this save (it restarted before committing?)"
            ))

    def done(self) -> bool:
        """True once the step committed or failed (non-blocking)."""
        self._update(0.0)
        return self.state.final

    def durable(self) -> bool:
        """True once this node's part is on storage (before or after the global commit)."""
        self._update(0.0)
        return self.state in (StepState.DURABLE, StepState.COMMITTED)

    def wait(self, timeout: float | None = None) -> SaveHandle:
        """Block until the step committed; raise its error if it failed, SaveTimeoutError on timeout.

        A failure is delivered once: after ``wait()`` raised it, the next ``save()`` does not raise it
        again. A lost daemon (:class:`DaemonUnavailableError`; one that does not answer within the client's
        ``timeout_s`` is lost too: :class:`~ckptd.client.daemon_lost.DaemonUnresponsiveError`) is raised only
        under the client's ``on_daemon_lost="raise"``; under ``"warn"`` it is logged once and ``wait()``
        returns the handle in state ``FAILED`` (see :meth:`exception`); a daemon lost after it committed the
        step is no lost save (the handle finds the commit in storage). ``SaveTimeoutError``: ``timeout``
        passed before the commit, or the step itself timed out in the daemons.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            self._update(max(0.0, left))
            if self.state is StepState.FAILED and self._error is not None:
                if self._client is not None and not self._client._must_raise(self):
                    return self
                self._delivered = True
                raise self._error
            if self.state in (StepState.COMMITTED, StepState.SKIPPED):
                return self
            if deadline is not None and time.monotonic() >= deadline:
                raise SaveTimeoutError(f"step {self.step} not committed within {timeout}s (state: {self.state})")

    def result(self, timeout: float | None = None) -> SaveHandle:
        """Same as :meth:`wait` (the ``concurrent.futures`` spelling)."""
        return self.wait(timeout)

    def exception(self) -> CkptdError | None:
        """The step's error once it failed, else ``None`` (non-blocking)."""
        self._update(0.0)
        return self._error

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, state={self.state}, nbytes={self.nbytes}, stall_s={self.stall_s:.4f})"


def raise_background_errors(client: CheckpointClient) -> None:
    """Raise the first failure of an earlier save of ``client`` that no ``wait()`` delivered (each is
    delivered once); keep the handles still in flight."""
    handles, client._handles = client._handles, []
    for i, h in enumerate(handles):
        if not h._polled:
            h._update(0.0)
        if h.state is StepState.FAILED and h._error is not None:
            if h._delivered or not client._must_raise(h):
                continue
            h._delivered = True
            client._handles.extend(x for x in handles[i + 1 :] if not x.state.final or not x._delivered)
            raise StepFailedError(f"an earlier save failed in the background: {h._error}") from h._error
        if not h.state.final:
            client._handles.append(h)


def track(client: CheckpointClient) -> None:
    """Count ``client`` among the process's clients (for :func:`refuse_repeat`; held weakly)."""
    _CLIENTS.add(client)


def refuse_repeat(client: CheckpointClient, step: int) -> None:
    """A second save call of ``step`` while a first is still in flight — through ``client``, or another open
    client of this process for the same rank and daemon — would be a new attempt (:mod:`ckptd.client.attempts`)
    that gives up the one its peers are saving into: refused with :class:`DuplicateSaveError` before anything
    is sent. Once the first has failed, saving it again is a retry."""
    same = [c for c in _CLIENTS if c is not client and c._sock is not None
            and (c.socket_path, c.placement.rank) == (client.socket_path, client.placement.rank)]
    for h in (h for c in (client, *same) for h in c._handles):
        if h.step == step and not h.state.final:
            h._update(0.0)  # asked now: a pipelined save's state may be one save old
            if not h.state.final:
                raise DuplicateSaveError(
                    f"rank {client.placement.rank}: step {step} is already being saved by this process "
                    f"(attempt {h.attempt or '-'}, {h.state}); wait() for it, or save under another step"
                )
