"""The commit sequence, in one place: data -> part manifests -> ``COMMITTED`` -> ``latest`` -> retention.

Write order is the protocol (docs/format.md):

1. every node writes its chunks, makes them durable (:meth:`CheckpointWriter.make_durable`), then writes
   ``step_N/_parts/node-K.json`` (:meth:`~CheckpointWriter.write_part`);
2. the coordinator (node 0's daemon) waits until all parts exist, checks that together they tile every
   array and that some rank wrote every region a rank held only as a non-main replica, writes each
   array's ``zarr.json`` and the group documents, then ``step_N/COMMITTED`` with a
   create-once write — the last write of the step, shielded from cancellation
   (:meth:`~CheckpointWriter.commit`); the other nodes wait for it (:meth:`~CheckpointWriter.wait_committed`);
3. only then does ``latest`` move; retention deletes old steps only after a newer one committed
   (:meth:`~CheckpointWriter.retain`).

Coordination goes through storage alone: no daemon ever joins the training process group.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from ckptd.writer.arrays import control_doc, group_doc, write_array_doc, write_control_doc, write_group
from ckptd.writer.errors import (
    CheckpointNotFoundError,
    CkptdError,
    CorruptCheckpointError,
    SaveTimeoutError,
    StepAbandonedError,
    StepCommittedError,
    StepFailedError,
    StorageError,
    error_classes,
)
from ckptd.writer.fanout import bounded_map
from ckptd.writer.format import (
    COMMIT_MARKER,
    CONTROL_LAYOUTS,
    FORMAT_VERSION,
    CommitManifest,
    PartManifest,
    array_groups,
    check_sidecar,
    commit_marker,
    control_dir,
    control_groups,
    encode_json,
    failed_marker,
    latest_key,
    note_of,
    other_attempt,
    part_key,
    sidecar_key,
    step_dir,
)
from ckptd.writer.parts import merge_parts
from ckptd.writer.polls import Polls
from ckptd.writer.replicas import check_replicas
from ckptd.writer.root import CheckpointRoot

if TYPE_CHECKING:
    from ckptd.writer.backends import Backend

log = logging.getLogger(__name__)

METADATA_CONCURRENCY = 16
_DELETES_KEPT = 4096  # deletes remembered for CheckpointWriter._check_not_deleted_under
CLOCK_SKEW_S = 5.0  # how far two nodes' wall clocks may differ: the slack of comparisons across nodes


class Leftovers(NamedTuple):
    """What storage holds of a step before a node starts writing it (:meth:`CheckpointWriter.leftovers`)."""

    committed: bool  # its commit marker, in any control layout
    part: bool  # this node's part manifest, left by an earlier attempt
    failed: bool  # the coordinator's failure note of an earlier attempt


class CheckpointWriter(CheckpointRoot):
    """The read view plus every write of the commit protocol. Opened on a backend the caller owns."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend)
        # `latest` is read, compared and replaced: two commits of the coordinator at once (steps commit out of
        # order) must not interleave there, or the older step's replace lands last
        self._hint = asyncio.Lock()
        # step -> wall clock when this writer last ended a delete of it, and the deletes of each step under way:
        # retention's delete of an old step number may meet a new save of it (a rollback) and remove its files
        self._deleted: dict[int, float] = {}
        self._deleting: collections.Counter[int] = collections.Counter()

    # --- a node's part --------------------------------------------------------------------------------
    async def make_durable(self, keys: Iterable[str], *, synced: bool = False, whole_filesystem: bool = False) -> None:
        """fsync written chunks (unless ``synced``: done as they were written) and their folders, where
        the backend needs it (``capabilities.needs_fsync``); with ``whole_filesystem`` (some were written
        without an fsync of their own), one sync of the root's filesystem instead, which covers them all."""
        if not self.backend.capabilities.needs_fsync:
            return
        if whole_filesystem:
            await self.backend.sync_all()
        else:
            await self.backend.sync(keys, files=not synced)

    async def write_part(self, part: PartManifest) -> None:
        """This node's part manifest; durable before it returns (it claims the node's data). Written whole
        (:meth:`~ckptd.writer.backends.Backend.replace`): a daemon killed, or a disk filled, mid-write leaves
        the earlier part or none, never a torn one that the coordinator would stop at."""
        await self.backend.replace(part_key(part.step, part.node), encode_json(part))

    async def write_sidecar(self, name: str, text: str) -> bool:
        """Store a content-addressed document once; False if it was already there.

        Created whole or not at all (:meth:`~ckptd.writer.backends.Backend.create`): every later step that
        names it needs it. One found damaged (torn by a kill mid-write of an earlier release, which wrote it
        in place) is written again."""
        check_sidecar(name, text)
        key = sidecar_key(name)
        data = text.encode()
        found = await self.backend.get(key)
        if found == data:
            return False
        if found is not None:
            log.warning("sidecar %s under %s is damaged (%d bytes of %d); writing it again", name, self.url,
                        len(found), len(data))
            await self.backend.delete(key)
        if not await self.backend.create(key, data):
            raise CorruptCheckpointError(f"sidecar {name} under {self.url}: another writer stored other bytes")
        await self.make_durable([key])
        return True

    async def leftovers(self, step: int, node: int) -> Leftovers:
        """What a first save of ``step`` on ``node`` must know of storage, probed all at once: a save waits
        for one request's latency, not four (on S3 each is a round trip). Nothing is deleted here: a part
        of a committed step is part of the checkpoint."""
        keys = [commit_marker(step, v) for v in CONTROL_LAYOUTS[::-1]]
        keys += [part_key(step, node), failed_marker(step)]
        found = await self.backend.exists_all(keys)
        return Leftovers(committed=any(found[:-2]), part=found[-2], failed=found[-1])

    async def discard_part(self, step: int, node: int) -> None:
        """Drop a stale part of this node (left by a crashed attempt) before the step is written again."""
        key = part_key(step, node)
        if await self.backend.exists(key):
            log.warning("step=%d node=%d: removing a part left by an earlier, unfinished attempt", step, node)
            await self.backend.delete(key)

    async def _put_shared(self, key: str, make: Callable[[], Awaitable[bytes]]) -> None:
        """A document of the root that every commit writes (its group's, its control folder's): written
        whole (aside, then renamed on a local disk) and only when it differs, so a commit cut short or a
        reader opening the root meanwhile never finds it empty."""
        data = await make()
        if await self.backend.get(key) != data:
            await self.backend.replace(key, data)

    # --- the coordinator --------------------------------------------------------------------------
    async def wait_parts(
        self, step: int, num_nodes: int, timeout: float, poll: float = 0.05, *, attempt: str = "", since: float = 0.0
    ) -> list[PartManifest]:
        """Every node's part of ``attempt``, in node order; :class:`SaveTimeoutError` when some are missing
        at ``timeout``. A part of another attempt (left by a failed one, whose node has not started this
        one yet) counts as missing: committing it would pair two attempts' bytes."""
        deadline = time.monotonic() + timeout
        warned: set[int] = set()
        polls = Polls(step)
        while True:
            found = await polls.read(self.read_parts(step), {})
            parts = {n: p for n, p in found.items() if not other_attempt(p.attempt, attempt)}
            for n in sorted(set(found) - set(parts) - warned):
                warned.add(n)
                log.warning("step=%d: node %d's part is from attempt %s, not this one (%s): waiting for its new "
                            "part", step, n, found[n].attempt, attempt)
            if len(parts) < num_nodes:  # a node that gave this attempt up says so (journal.py, attempts)
                await self._raise_if_given_up(step, attempt, since, polls)
            missing = sorted(set(range(num_nodes)) - set(parts))
            if not missing:
                return [parts[n] for n in range(num_nodes)]
            if time.monotonic() >= deadline:
                stale = "".join(f"; node {n}'s part is from another attempt ({found[n].attempt}, this one is "
                                f"{attempt})" for n in missing if n in found)
                raise SaveTimeoutError(
                    f"step {step}: only node parts {sorted(parts)} of {num_nodes} arrived within {timeout:.0f}s"
                    f"{stale}; not committed{polls.why()}"
                )
            await asyncio.sleep(poll)
            poll = min(poll * 1.5, 1.0)

    async def commit(
        self, step: int, num_nodes: int, timeout: float, *, attempt: str = "", since: float = 0.0
    ) -> CommitManifest:
        """Coordinator side: wait for all parts of ``attempt``, check them, write metadata, then the commit
        marker. ``since``: when the coordinator's attempt began (wall clock; what an unnamed attempt's
        failure notes are told apart by, as in :meth:`wait_committed`)."""
        if await self.is_committed(step):
            raise StepCommittedError(f"step {step} already committed under {self.url}")
        parts = await self.wait_parts(step, num_nodes, timeout, attempt=attempt, since=since)
        if await self.is_committed(step):  # while it waited: a late coordinator must not rewrite its metadata
            raise StepCommittedError(f"step {step} was committed by another coordinator under {self.url}")
        self._check_not_deleted_under(step, parts)
        merged = merge_parts(parts)
        check_replicas(parts, {rec.name: rec for rec in merged.arrays})  # someone wrote every replica region
        prefix = step_dir(step)
        store = self.store
        docs: list[Callable[[], Awaitable[None]]] = [
            functools.partial(write_array_doc, store, f"{prefix}/{rec.name}", rec) for rec in merged.arrays
        ]
        # "" is the step's own group: zarr.open_group(ROOT) lists committed steps, open_group(ROOT/step_N) works
        for group in sorted(array_groups(rec.name for rec in merged.arrays) | {""}):
            docs.append(functools.partial(write_group, store, f"{prefix}/{group}" if group else prefix))
        shared: dict[str, Callable[[], Awaitable[bytes]]] = {
            "zarr.json": functools.partial(group_doc, {"ckptd": {"format": FORMAT_VERSION}})
        }
        for folder in control_groups(step):
            if folder == control_dir(""):  # the root's, rewritten by every commit
                shared[f"{folder}/zarr.json"] = control_doc
            else:
                docs.append(functools.partial(write_control_doc, store, folder))
        docs += [functools.partial(self._put_shared, key, make) for key, make in shared.items()]
        try:  # zarr writes these through its store: classify their failures like the backend's own
            await bounded_map(lambda write: write(), docs, limit=METADATA_CONCURRENCY)
            await self.backend.sync_all()  # local roots: the metadata durable before the marker (S3: no-op)
        except CkptdError:
            raise
        except Exception as exc:
            raise self.backend.error(exc) from exc
        final = msgspec.structs.replace(merged, step=step, committed_at=time.time())
        # The marker is the commit: once started, let it finish even if the caller is cancelled.
        await asyncio.shield(self._seal(step, num_nodes, attempt, encode_json(final)))
        return final

    def _check_not_deleted_under(self, step: int, parts: Sequence[PartManifest]) -> None:
        """Refuse to commit a step this writer deleted (retention, an older save of the same number) while
        any node may already have been writing it: the delete may have removed its new files, and a commit
        would name chunks that are gone. Parts of older daemons (no start time) count from the beginning."""
        ended = math.inf if self._deleting[step] else self._deleted.get(step)
        started = min(p.started_at for p in parts)
        if ended is not None and ended > started - CLOCK_SKEW_S:
            raise StepFailedError(
                f"step {step}: an older step {step} was being deleted (retention) while this one was saved, so "
                "some of its files may be gone; it is not committed: save it again (after a rollback, `ckptd gc "
                "ROOT --after STEP` before the first save keeps this from happening)"
            )

    async def _seal(self, step: int, num_nodes: int, attempt: str, data: bytes) -> None:
        """The attempt's verdict where other nodes wait for this commit (one of them may have stopped waiting
        at its timeout, and then reported the step failed), then the marker."""
        if attempt and num_nodes > 1:
            standing = await self.claim_verdict(step, attempt, "commit", node=0)
            if standing is not None and standing.get("verdict") != "commit":
                raise SaveTimeoutError(f"step {step}: node {standing.get('node')} stopped waiting for the commit at "
                                       f"its commit timeout and reported the step failed; not committed")
        await self.write_marker(step, data)

    async def write_marker(self, step: int, data: bytes) -> None:
        """``COMMITTED`` (create-once), then ``latest`` if this is the newest step."""
        # Create-once (conditional PUT on S3, link on local disks): of two racing coordinators exactly one
        # commits; the other learns it here instead of overwriting the manifest. Backends without an
        # atomic create say so in their capabilities (an explicit opt-out, logged when opened).
        key = commit_marker(step)
        try:
            created = await self.backend.create(key, data)
        except StorageError:  # every try's answer lost: the marker may have landed all the same
            if await self.backend.get(key) != data:
                raise
            log.warning("step %d: the %s write under %s failed, but the marker stored is ours: committed",
                        step, COMMIT_MARKER, self.url)
            created = True
        if not created:
            raise StepCommittedError(f"step {step} was committed by another coordinator under {self.url}")
        async with self._hint:
            await self._move_latest(step)

    async def _move_latest(self, step: int) -> None:
        try:  # only a hint: the step is committed whatever happens to it (readers trust the markers)
            current = await self.latest_hint()
            newest: int | None = step
            if current is not None and step < current:
                # the newer step named there may have been deleted since (a rollback): then the newest by the
                # markers, which may be a step between the two
                newest = None if await self.is_committed(current) else max(step, await self.latest() or step)
            if newest is not None:
                await self.backend.replace(latest_key(), str(newest).encode())
        except CkptdError as exc:
            log.warning("step %d is committed under %s, but its 'latest' hint was not moved: %s", step, self.url, exc)

    async def mark_failed(self, step: int, error: BaseException, *, attempt: str = "", **extra: object) -> None:
        """Tell the other nodes' daemons at once that this step's ``attempt`` will never commit (they stop
        waiting); ``ckptd ls`` shows the note. ``extra`` fields go into the note as they are. A named
        attempt's note is also kept under its own key: a late note of another attempt may replace the
        step's newest one, never this one."""
        doc = encode_json({**extra, "step": step, "code": type(error).__name__, "message": str(error),
                           "at": time.time(), "attempt": attempt})
        keys = [failed_marker(step, attempt=attempt)] if attempt else []
        done = await asyncio.gather(*(self.backend.put(k, doc) for k in [*keys, failed_marker(step)]),
                                    return_exceptions=True)  # each written even if the other failed
        for exc in done:
            if isinstance(exc, BaseException):
                raise exc

    async def _raise_if_given_up(self, step: int, attempt: str, since: float, polls: Polls) -> None:
        """Raise the note's error when a node gave up this attempt: its daemon died (``abandoned``, written
        by its successor), its ranks were replaced (``superseded``) or it failed before it wrote its part
        (``part_missing``; both written by the node itself)."""
        failed = await polls.read(self.read_failed(step, attempt), None)
        if failed is None or other_attempt(str(failed.get("attempt", "")), attempt):
            return
        if failed.get("abandoned"):
            raise StepAbandonedError(f"step {step}: not committed: {failed.get('message')}")
        named = bool(attempt) and failed.get("attempt") == attempt
        if (named and failed.get("superseded")) or (
                failed.get("part_missing") and (named or (since and note_of(failed, attempt, since)))):
            cls = error_classes().get(str(failed.get("code")), StepFailedError)
            why = "failed before its part was written" if failed.get("part_missing") else "gave it up"
            raise cls(f"step {step}: not committed: node {failed.get('node')} {why}: {failed.get('message')}")

    async def clear_failed(self, step: int) -> None:
        """The coordinator starts the step again: drop the failure note of an earlier attempt."""
        key = failed_marker(step)
        if await self.backend.exists(key):
            await self.backend.delete(key)

    # --- the other nodes --------------------------------------------------------------------------
    async def wait_committed(
        self, step: int, timeout: float, poll: float = 0.05, *, since: float = 0.0, attempt: str = "", node: int = -1
    ) -> CommitManifest:
        """Non-coordinator side: wait for the marker (or for a failure note of this attempt).

        A note names its attempt: one of another attempt is ignored. Where either attempt is unknown, notes
        written before ``since`` (wall clock) are taken for an earlier attempt's. A commit that holds another
        attempt's part of ``node`` raises :class:`StepCommittedError` (this attempt's part is not in it).

        At ``timeout`` a node of a named attempt claims the attempt's verdict before it reports the step
        failed: the coordinator claims it too before its marker, so exactly one of them decides (a node that
        stops waiting as the coordinator commits never reports a committed step failed); where the coordinator
        won, the marker is its next write and the wait goes on for up to ``timeout`` more.
        """
        deadline = time.monotonic() + timeout
        decided = False  # the coordinator's verdict to commit seen: its marker is its next write
        polls = Polls(step)  # a storage failure that passes is polled through (polls.py)
        while not await polls.read(self.is_committed(step), False):
            failed = await polls.read(self.read_failed(step, attempt), None)
            if failed is not None and note_of(failed, attempt, since):
                cls = error_classes().get(str(failed.get("code")), StepFailedError)
                where = "on the coordinator" if not failed.get("part_missing") else f"on node {failed.get('node')}"
                raise cls(f"step {step} failed {where}: {failed.get('message')}")
            if time.monotonic() >= deadline:
                if decided or not attempt or node < 1:  # unnamed: this node's report may miss a late commit
                    raise SaveTimeoutError(f"step {step} did not commit within {timeout:.0f}s{polls.why()}")
                # create-once: a retry after a failure finds this node's own claim if the first one landed
                standing = await polls.retried(lambda: self.claim_verdict(step, attempt, "timeout", node=node))
                if standing is None or standing.get("verdict") != "commit":  # now it never commits
                    who = "this node" if standing is None else f"node {standing.get('node')}"
                    raise SaveTimeoutError(f"step {step} did not commit within {timeout:.0f}s; {who} stopped "
                                           f"waiting first, so the coordinator will not commit it")
                decided, deadline = True, time.monotonic() + timeout
                continue
            await asyncio.sleep(poll)
            poll = min(poll * 1.5, 1.0)
        manifest = await polls.retried(lambda: self.read_commit(step))
        theirs = manifest.attempts[node] if 0 <= node < len(manifest.attempts) else ""
        if other_attempt(theirs, attempt):
            raise StepCommittedError(f"step {step} was committed with node {node}'s part of another attempt "
                                     f"({theirs}), not this one ({attempt})")
        return manifest

    # --- retention --------------------------------------------------------------------------------
    async def delete_step(self, step: int) -> None:
        """Remove a step; the commit marker goes first so a half-deleted step is never 'committed', then the
        step's ``zarr.json`` so that zarr no longer lists it as a group.

        Where crashed uploads leave parts behind (``capabilities.multipart_cleanup``: S3) the unfinished
        uploads under the step are aborted too: invisible to listings, but kept and billed until aborted.
        """
        self._deleting[step] += 1  # two commits' retentions may delete the same step at once
        try:
            await self._delete_step(step)
        finally:
            self._deleting[step] -= 1
            if self._deleting[step] <= 0:
                del self._deleting[step]
            self._deleted.pop(step, None)
            self._deleted[step] = time.time()
            if len(self._deleted) > _DELETES_KEPT:  # the oldest: thousands of commits ago, no step lives so long
                del self._deleted[next(iter(self._deleted))]

    async def _delete_step(self, step: int) -> None:
        prefix = step_dir(step)
        for version in CONTROL_LAYOUTS:  # every marker first (a step of either format)
            await self.backend.delete(commit_marker(step, version))
        if await self.is_committed(step):  # a store that answered the delete without doing it: touch nothing
            raise StorageError(f"step {step}: its {COMMIT_MARKER} under {self.url} is still there after its "
                               "delete; nothing else of the step was deleted")
        # then its group document: zarr.open_group(ROOT) stops listing a step that is no longer whole
        await self.backend.delete(f"{prefix}/zarr.json")
        await self.backend.delete_prefix(prefix)
        if self.backend.capabilities.multipart_cleanup:
            aborted = await self.backend.abort_uploads(prefix)
            if aborted:
                log.info("step=%d: aborted %d unfinished multipart upload(s)", step, aborted)

    async def doomed_steps(self, keep: int, busy: Collection[int] = (), gone: Collection[int] = ()) -> list[int]:
        """What :meth:`retain` would remove now (see :func:`plan_retention`); ``gone``: steps to count as
        removed already (a dry run's rollback)."""
        found, unreadable = await self.scan_steps()
        for step, exc in unreadable.items():  # never deleted, never counted: it may be committed
            log.warning("retention: step %d left alone: its commit marker could not be looked at: %s", step, exc)
        committed = [s for s in found if s not in gone]
        steps = [s for s in await self.steps() if s not in gone and s not in unreadable]
        return plan_retention(committed, steps, keep, busy)

    async def written_lately(self, within_s: float, after: int | None = None, gone: Collection[int] = ()) -> list[int]:
        """The unfinished steps something wrote under in the last ``within_s`` seconds (or whose time the
        store cannot tell): maybe still being written by a daemon, as a step may commit after a newer one.
        What ``ckptd gc``, which does not know the daemons' steps in flight, leaves alone. Those older than
        the newest commit (what retention removes), or with ``after``, those after that step; ``gone``: steps
        to count as removed already (a dry run's rollback)."""
        found, unreadable = await self.scan_steps()
        committed, gone = set(found) - set(gone), {*gone, *unreadable}  # unreadable ones are never removed
        newest = max(committed, default=-1)  # only older unfinished steps are ever removed: list no others
        unfinished = [s for s in await self.steps() if s not in committed and s not in gone
                      and (s < newest if after is None else s > after)]
        written = self.backend.newest_write
        times = await bounded_map(lambda s: written(step_dir(s)), unfinished, limit=METADATA_CONCURRENCY)
        now = time.time()
        return [s for s, t in zip(unfinished, times, strict=True) if t is None or now - t < within_s]

    async def retain(self, keep: int, busy: Collection[int] = ()) -> list[int]:
        """Keep the newest ``keep`` committed steps; drop older ones and unfinished steps older than the
        newest commit, except those in ``busy`` (steps a daemon is still writing: a step may commit after a
        newer one). Never removes the only committed step, nor anything when nothing committed."""
        doomed = await self.doomed_steps(keep, busy)
        removed = []
        for step in doomed:
            if step in busy:  # asked again: ``busy`` may be a live view (the daemon's steps in flight)
                continue
            log.info("retention: removing step %d", step)
            await self.delete_step(step)
            removed.append(step)
        return removed


    async def drop_after(self, step: int, busy: Collection[int] = (), *, dry_run: bool = False) -> list[int]:
        """Roll the root back to ``step`` (committed): remove every step after it, committed or not, newest
        first, except those in ``busy``; then ``latest`` names the newest committed step left. Afterwards a
        load of ``latest`` and retention (which go by step number) follow the steps saved from ``step`` on,
        not the abandoned ones. Cut short, it leaves a shorter rollback; run it again to finish (the hint
        too: it is set right whenever it names another step than the newest committed)."""
        if not await self.is_committed(step):
            raise CheckpointNotFoundError(
                f"step {step} is not committed under {self.url}: roll back to a committed step"
            )
        doomed = sorted((s for s in await self.steps() if s > step and s not in busy), reverse=True)
        if dry_run:
            return doomed
        for s in doomed:
            log.info("rollback to step %d: removing step %d", step, s)
            await self.delete_step(s)
        async with self._hint:
            newest, hint = await self.latest(), await self.latest_hint()
            if newest is None:  # every committed step went meanwhile (another retention): no hint to leave
                await self.backend.delete(latest_key())
            elif hint != newest:
                await self.backend.replace(latest_key(), str(newest).encode())
        return doomed


def plan_retention(committed: list[int], steps: list[int], keep: int, busy: Collection[int] = ()) -> list[int]:
    """The steps retention removes, ascending: committed ones beyond the newest ``max(1, keep)``, and
    unfinished ones older than the newest commit, never one in ``busy`` (still being written, or committed
    just now: a step that commits after a newer one stays until the next commit). Nothing when nothing
    committed. Pure."""
    if not committed:
        return []
    newest = max(committed)
    done = sorted(committed)
    doomed = set(done[: -max(1, keep)])
    doomed |= {s for s in steps if s < newest and s not in committed}
    return sorted(doomed - set(busy))
