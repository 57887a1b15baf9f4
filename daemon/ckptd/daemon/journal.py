"""The steps a daemon has in flight, kept in a small file next to its socket, so that its successor can
abandon them cleanly.

A daemon killed mid-save (``kill -9``, OOM killer, node daemon restarted) leaves steps that will never
finish: its staged data died with it. Without a record, the coordinator's peers wait for a commit until
``commit_timeout_s`` and ``ckptd ls`` shows the step as "incomplete" like a step still being written.
The journal names those steps. A daemon started on the same socket reads its predecessor's journal
before it serves and, for each step of the same root that did not commit, writes the step's ``FAILED``
note (:meth:`~ckptd.writer.commit.CheckpointWriter.mark_failed`) with a
:class:`~ckptd.writer.errors.StepAbandonedError`:

- the step never commits (only the dead daemon could have finished its node's part; a re-save of the
  step by the trainer is a new attempt and clears the note);
- the other nodes' daemons waiting for its commit, and a coordinator waiting for its part, stop waiting;
- ``ckptd ls`` shows it ``failed`` with the reason, ``ckptd verify`` reports it, and retention removes it
  once a newer step commits.

A node's part already written is left alone when the node is not the coordinator: the node's data is
durable and the coordinator may still commit the step. Committed steps are never touched.

The file is rewritten (write, then rename) when a step starts and when it ends: a few hundred bytes,
twice per step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import msgspec

from ckptd.client.ownership import pid_alive, process_start_time
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import StepAbandonedError
from ckptd.writer.format import other_attempt
from ckptd.writer.urls import normalize_root

log = logging.getLogger(__name__)


class JournalEntry(msgspec.Struct, frozen=True):
    """One step in flight on this node."""

    step: int
    node: int
    num_nodes: int
    started_at: float
    attempt: str = ""


class JournalDoc(msgspec.Struct, frozen=True):
    pid: int
    root: str
    steps: list[JournalEntry] = []
    # the writer's start time (clock ticks since boot, ownership.process_start_time; 0: not recorded): a
    # live process of that pid that started at another time is another process (pids are reused)
    started: int = 0


def journal_path(socket_path: str) -> str:
    """The journal of the daemon serving ``socket_path`` (in the socket's private directory)."""
    return f"{socket_path}.steps.json"


class StepJournal:
    """This daemon's steps in flight, mirrored to :func:`journal_path`."""

    def __init__(self, path: str, root: str) -> None:
        self.path = path
        self.root = normalize_root(root)  # one spelling: a restart with ``ckpt/`` or ``file://...`` is the same root
        self._steps: dict[int, JournalEntry] = {}
        self._me = (os.getpid(), process_start_time(os.getpid()) or 0)  # read once: every write names it

    def read_predecessor(self) -> JournalDoc | None:
        """What a dead predecessor left (``None`` when nothing, or when its daemon is still running)."""
        try:
            with open(self.path, "rb") as f:
                doc = msgspec.json.decode(f.read(), type=JournalDoc)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("ignoring an unreadable step journal %s: %s", self.path, exc)
            return None
        if doc.pid != os.getpid() and pid_alive(doc.pid) and doc.started in (0, process_start_time(doc.pid)):
            log.warning("step journal %s belongs to a running daemon (pid %d): not recovering it", self.path, doc.pid)
            return None
        return doc

    def started(self, step: int, node: int, num_nodes: int, attempt: str = "") -> JournalEntry:
        entry = self._steps[step] = JournalEntry(step, node, num_nodes, time.time(), attempt)
        self._write()
        return entry

    def ended(self, entry: JournalEntry) -> None:
        """``entry``'s attempt is final (a newer attempt of the same step keeps its own entry)."""
        if self._steps.get(entry.step) is entry:
            del self._steps[entry.step]
            self._write()

    def _write(self) -> None:
        # A failed write costs only the successor's clean-up of this step, never the step itself.
        pid, started = self._me
        doc = JournalDoc(pid, self.root, sorted(self._steps.values(), key=lambda e: e.step), started)
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(msgspec.json.encode(doc))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not write the step journal %s: %s", self.path, exc)

    def remove(self) -> None:
        """Forget the journal (clean shutdown with nothing in flight)."""
        if not self._steps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


async def abandon_predecessor_steps(journal: StepJournal, root: CheckpointWriter) -> list[int]:
    """Mark every uncommitted step of a dead predecessor ``FAILED`` (see the module doc). Returns them."""
    doc = journal.read_predecessor()
    if doc is None or not doc.steps:
        return []
    if normalize_root(doc.root) != journal.root:
        log.warning("step journal %s is of root %s, not %s: its steps %s are left as they are", journal.path,
                    doc.root, journal.root, [e.step for e in doc.steps])
        return []
    abandoned = []
    for entry in doc.steps:
        try:
            if await root.is_committed(entry.step):
                continue
            part = (await root.read_parts(entry.step)).get(entry.node) if entry.node != 0 else None
            if part is not None and not other_attempt(part.attempt, entry.attempt):  # (another's: not its own)
                log.info("step=%d node=%d: the dead daemon's part is on storage; the coordinator may still "
                         "commit it", entry.step, entry.node)
                continue
            err = StepAbandonedError(
                f"step {entry.step}: abandoned: node {entry.node}'s daemon (pid {doc.pid}) died while writing it; "
                f"its staged data is lost (the restarted daemon, pid {os.getpid()}, will not commit it)"
            )
            await root.mark_failed(entry.step, err, **_note(entry))
        except Exception as exc:  # recovery is best effort: the daemon must start and serve anyway
            log.warning("step=%d: could not mark the dead daemon's step failed: %s", entry.step, exc)
            continue
        log.warning("%s", err)
        abandoned.append(entry.step)
    return abandoned


def _note(entry: JournalEntry) -> dict[str, Any]:
    return {"node": entry.node, "abandoned": True, "attempt": entry.attempt}
