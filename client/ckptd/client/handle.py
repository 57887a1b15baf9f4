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
    StepCommittedError,
    StepFailedError,
    error_classes,
)

if TYPE_CHECKING:
    from ckptd.client.client import CheckpointClient

_ERRORS = error_classes()
_POLL_S = 0.5
_STORAGE_POLL_S = 2.0  # how often a handle whose daemon is gone asks storage
_COMMIT_WAIT_S = 600.0  # how long it waits for the coordinator's commit when the daemon did not say
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
        self._wall_start = time.time()  # failure notes of an unnamed attempt count from here
        self._lost: DaemonUnavailableError | None = None  # why the daemon is gone, once it is
        self._orphaned_at: float | None = None  # when the daemon was lost with this node's part written
        self._asked_at = 0.0  # when storage was last asked (at most every _STORAGE_POLL_S)
        self._verdict_seen = False  # the coordinator's verdict to commit found standing at the wait's end

    def _fail(self, error: CkptdError) -> SaveHandle:
        self.state = StepState.FAILED
        self._error = error
        return self

    def _update(self, wait_s: float) -> None:
        if self.state.final or self._client is None:
            return
        if self._orphaned_at is not None:  # the daemon is gone, this node's part is written: storage says more
            self._from_storage()
            if not self.state.final and wait_s > 0:  # as long as a daemon's answer would take at most: no spin
                time.sleep(wait_s)
            return
        try:
            st = self._client._status(self.step, wait_s, self.attempt)
        except DaemonUnavailableError as exc:  # the daemon died, restarted or hangs: this save is lost with it,
            # unless storage says otherwise (_from_storage). Not asked of a hung daemon: it may hang in storage,
            # and the rank would then hang there too
            if isinstance(exc, DaemonUnresponsiveError):
                self._fail(DaemonUnresponsiveError(f"step {self.step}: lost the daemon before the commit: {exc}"))
            else:
                self._lost = exc
                self._from_storage()
            return
        self._apply(st)

    def _from_storage(self) -> None:
        """The save's fate read from storage, once its daemon is gone (dead or restarted, not hung: a hung one
        may hang in storage, and the rank with it). The daemon may have died after its commit, or, on any
        node but the coordinator's (node 0), after its node's part was written: the coordinator may still
        commit the step then, so the handle waits for it, asking storage every few seconds, as long as the
        daemons wait for a commit (their ``--commit-timeout``)."""
        from ckptd.client.reader import stored_fate  # the read path: zarr and fsspec, not on the save path

        client, now = self._client, time.monotonic()
        assert client is not None and self._lost is not None
        if self._asked_at and now - self._asked_at < _STORAGE_POLL_S:
            return
        self._asked_at = now
        try:  # the root: the one given, else the daemon's from its welcome
            fate, note = stored_fate(client.root, self.step, client.placement.node, self.attempt, self._wall_start,
                                     storage_options=client.storage_options)
        except (CkptdError, OSError) as exc:
            if self._orphaned_at is None:
                self._fail(DaemonUnavailableError(
                    f"step {self.step}: lost the daemon before the commit, and storage could not be read to see "
                    f"whether the step committed ({exc}): {self._lost}"))
            else:  # a store that fails a moment: asked again until the wait is over
                self._orphan_waited(now)
            return
        lost = f"step {self.step}: lost the daemon before the commit"
        if fate == "committed":
            self.state = StepState.COMMITTED
        elif fate == "failed" and client.placement.node > 0:  # the coordinator's decision, as a live daemon tells it
            assert note is not None
            cls = _ERRORS.get(str(note.get("code")), StepFailedError)
            self._fail(cls(f"step {self.step} failed on the coordinator: {note.get('message')}"))
        elif fate == "other":
            self._fail(StepCommittedError(f"{lost}, and the step committed with another attempt's part"))
        elif fate == "part" and client.placement.node > 0:
            if self._orphaned_at is None:
                self._orphaned_at, self.state = now, StepState.DURABLE
            self._orphan_waited(now)
        elif fate in ("part", "failed"):
            self._fail(DaemonUnavailableError(f"{lost}; this node's part is on storage, but its daemon was to "
                                              f"commit the step (a restarted daemon does not): {self._lost}"))
        else:
            self._fail(DaemonUnavailableError(f"{lost} (storage holds none of this save): {self._lost}"))

    def _orphan_waited(self, now: float) -> None:
        """Fail once the daemons' commit wait is over with no commit seen (the daemon's own, else 600 s).

        A named attempt's step is then decided as a live daemon decides it at its timeout: this node claims the
        attempt's verdict, so the coordinator will not commit a step this rank reports lost; where the
        coordinator's verdict to commit stands, its marker is its next write, and the wait goes on once more."""
        from ckptd.client.reader import stop_waiting  # the read path, as _from_storage's

        client, orphaned = self._client, self._orphaned_at
        assert client is not None and orphaned is not None
        welcome = client._welcome
        limit = (welcome.commit_timeout_s if welcome is not None else 0.0) or _COMMIT_WAIT_S
        if now - orphaned < limit:
            return
        outcome = "the coordinator may still commit it: ckptd ls"
        if self.attempt and not self._verdict_seen:
            try:
                standing = stop_waiting(client.root, self.step, client.placement.node, self.attempt,
                                        storage_options=client.storage_options)
            except (CkptdError, OSError) as exc:
                outcome = f"the coordinator may still commit it: ckptd ls; its verdict could not be claimed: {exc}"
            else:
                verdict = None if standing is None else standing.get("verdict")
                if verdict == "commit":
                    self._verdict_seen, self._orphaned_at = True, now
                    return
                if verdict != "unknown":  # (storage without an atomic create decides nothing)
                    who = "this rank" if standing is None else f"node {standing.get('node')}"
                    outcome = f"{who} stopped waiting first, so the coordinator will not commit it"
        self._fail(DaemonUnavailableError(
            f"step {self.step}: lost the daemon before the commit; this node's part is on storage, but the step "
            f"did not commit within {limit:.0f}s ({outcome}): {self._lost}"))

    def _apply(self, st: StepStatus) -> None:
        if self.state.final:  # the daemon refused this save: its answer was read on the way (client.pipeline)
            return
        self.state = st.state
        if st.state is StepState.FAILED:
            cls = _ERRORS.get(st.error_code, StepFailedError)
            self._error = cls(f"step {self.step} failed: {st.error}")
        elif st.state is StepState.UNKNOWN:  # a restarted daemon (this save's died): storage tells what is left
            self._lost = DaemonUnavailableError("the daemon has no record of this save (it restarted)")
            self._from_storage()

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
