"""The commit protocol and the view of a checkpoint root: which steps exist, which committed, retention.

Write order is the protocol (docs/format.md):

1. every node writes its chunks, makes them durable, then writes ``step_N/_parts/node-K.json``;
2. the coordinator (node 0's daemon) waits until all parts exist, checks that together they tile every
   array, writes each array's ``zarr.json`` and the group documents, then ``step_N/COMMITTED`` — the
   last write, shielded from cancellation;
3. only then does ``latest`` move; retention deletes old steps only after a newer one committed.

Coordination goes through storage alone: no daemon ever joins the training process group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import msgspec
from zarr.abc.store import Store

from ckptd.writer.arrays import array_metadata, write_group, write_metadata
from ckptd.writer.errors import (
    CheckpointNotFoundError,
    CkptdError,
    CorruptCheckpointError,
    SaveTimeoutError,
    StepCommittedError,
    StepFailedError,
    UncommittedStepError,
    error_classes,
)
from ckptd.writer.format import (
    COMMIT_MARKER,
    FAILED_MARKER,
    FORMAT_VERSION,
    LATEST,
    PARTS_DIR,
    SIDECAR_DIR,
    CommitManifest,
    PartManifest,
    check_sidecar,
    decode_commit,
    decode_part,
    encode_json,
    merge_parts,
    parse_step_dir,
    part_name,
    step_dir,
)
from ckptd.writer.store import abort_uploads, fsync, get_bytes, list_dir, put_bytes, put_if_absent

log = logging.getLogger(__name__)

METADATA_CONCURRENCY = 16


class CheckpointRoot:
    """All checkpoints under one root, seen through a zarr store."""

    def __init__(self, store: Store, url: str = "") -> None:
        self.store = store
        self.url = url

    # --- reading ----------------------------------------------------------------------------------
    async def steps(self) -> list[int]:
        """Every step directory present, committed or not, ascending."""
        found = [parse_step_dir(name) for name in await list_dir(self.store, "")]
        return sorted(s for s in found if s is not None)

    async def is_committed(self, step: int) -> bool:
        return await self.store.exists(f"{step_dir(step)}/{COMMIT_MARKER}")

    async def committed_steps(self) -> list[int]:
        steps = await self.steps()
        flags = await asyncio.gather(*(self.is_committed(s) for s in steps))
        return [s for s, ok in zip(steps, flags, strict=True) if ok]

    async def latest(self) -> int | None:
        """The newest committed step. ``latest`` is a hint; the commit markers are the truth."""
        committed = await self.committed_steps()
        return committed[-1] if committed else None

    async def resolve(self, step: int | str) -> int:
        if step == "latest":
            found = await self.latest()
            if found is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.url or 'the root'}")
            return found
        if not isinstance(step, int):
            raise CheckpointNotFoundError(f"step must be an int or 'latest', got {step!r}")
        return step

    async def read_commit(self, step: int) -> CommitManifest:
        data = await get_bytes(self.store, f"{step_dir(step)}/{COMMIT_MARKER}")
        if data is None:
            if await list_dir(self.store, step_dir(step)):
                raise UncommittedStepError(f"step {step} under {self.url} never committed: it is not a checkpoint")
            raise CheckpointNotFoundError(f"no checkpoint for step {step} under {self.url}")
        try:
            return decode_commit(data)
        except Exception as exc:
            raise CorruptCheckpointError(f"step {step}: unreadable {COMMIT_MARKER}: {exc}") from exc

    async def read_parts(self, step: int) -> dict[int, PartManifest]:
        prefix = f"{step_dir(step)}/{PARTS_DIR}"
        parts: dict[int, PartManifest] = {}
        for name in await list_dir(self.store, prefix):
            data = await get_bytes(self.store, f"{prefix}/{name}")
            if data is None:
                continue
            part = decode_part(data)
            parts[part.node] = part
        return parts

    # --- writing ----------------------------------------------------------------------------------
    async def write_part(self, part: PartManifest) -> None:
        key = f"{step_dir(part.step)}/{part_name(part.node)}"
        await put_bytes(self.store, key, encode_json(part))
        await fsync(self.store, [key])

    async def write_sidecar(self, name: str, text: str) -> bool:
        """Store a content-addressed document once; False if it was already there."""
        check_sidecar(name, text)
        key = f"{SIDECAR_DIR}/{name}"
        if await self.store.exists(key):
            return False
        await put_bytes(self.store, key, text.encode())
        await fsync(self.store, [key])
        return True

    async def read_sidecar(self, name: str) -> str:
        data = await get_bytes(self.store, f"{SIDECAR_DIR}/{name}")
        if data is None:
            raise CheckpointNotFoundError(f"sidecar {name} not found under {self.url}")
        text = data.decode()
        try:
            check_sidecar(name, text)
        except CkptdError as exc:
            raise CorruptCheckpointError(f"sidecar {name} does not match its hash") from exc
        return text

    async def make_durable(self, keys: Iterable[str], *, synced: bool = False) -> None:
        """fsync written chunks (unless ``synced``: already done as they were written) and their folders."""
        await fsync(self.store, keys, files=not synced)

    async def discard_part(self, step: int, node: int) -> None:
        """Drop a stale part of this node (left by a crashed attempt) before the step is written again."""
        key = f"{step_dir(step)}/{part_name(node)}"
        if await self.store.exists(key):
            log.warning("step=%d node=%d: removing a part left by an earlier, unfinished attempt", step, node)
            await self.store.delete(key)

    async def wait_parts(self, step: int, num_nodes: int, timeout: float, poll: float = 0.05) -> list[PartManifest]:
        deadline = time.monotonic() + timeout
        while True:
            parts = await self.read_parts(step)
            if len(parts) >= num_nodes:
                missing = sorted(set(range(num_nodes)) - set(parts))
                if not missing:
                    return [parts[n] for n in range(num_nodes)]
            if time.monotonic() >= deadline:
                have = sorted(parts)
                raise SaveTimeoutError(
                    f"step {step}: only node parts {have} of {num_nodes} arrived within {timeout:.0f}s; not committed"
                )
            await asyncio.sleep(poll)
            poll = min(poll * 1.5, 1.0)

    async def commit(self, step: int, num_nodes: int, timeout: float) -> CommitManifest:
        """Coordinator side: wait for all parts, check them, write metadata, then the commit marker."""
        if await self.is_committed(step):
            raise StepCommittedError(f"step {step} already committed under {self.url}")
        parts = await self.wait_parts(step, num_nodes, timeout)
        merged = merge_parts(parts)
        prefix = step_dir(step)
        sem = asyncio.Semaphore(METADATA_CONCURRENCY)

        async def one(rec_name: str, meta_args: tuple[Any, ...], codec: str) -> None:
            async with sem:
                meta = await array_metadata(*meta_args, codec=codec)
                await write_metadata(self.store, f"{prefix}/{rec_name}", meta)

        async with asyncio.TaskGroup() as tg:
            for rec in merged.arrays:
                tg.create_task(one(rec.name, (rec.torch_dtype, rec.shape, rec.chunks), rec.codec))
            for group in _groups(rec.name for rec in merged.arrays):
                tg.create_task(write_group(self.store, f"{prefix}/{group}" if group else prefix))
            tg.create_task(write_group(self.store, "", {"ckptd": {"format": FORMAT_VERSION}}))
        final = msgspec.structs.replace(merged, step=step, committed_at=time.time())
        # The marker is the commit: once started, let it finish even if the caller is cancelled.
        await asyncio.shield(self._write_marker(step, encode_json(final)))
        return final

    async def _write_marker(self, step: int, data: bytes) -> None:
        # Create-once (conditional PUT on S3, link on local disks): of two racing coordinators exactly
        # one commits; the other learns it here instead of overwriting the manifest.
        key = f"{step_dir(step)}/{COMMIT_MARKER}"
        if not await put_if_absent(self.store, key, data):
            raise StepCommittedError(f"step {step} was committed by another coordinator under {self.url}")
        current = await self._latest_hint()
        if current is None or step >= current:
            await put_bytes(self.store, LATEST, str(step).encode())

    async def _latest_hint(self) -> int | None:
        data = await get_bytes(self.store, LATEST)
        try:
            return int(data) if data else None
        except ValueError:
            return None

    async def mark_failed(self, step: int, error: BaseException) -> None:
        """Tell the other nodes' daemons at once that this step will never commit (they stop waiting)."""
        doc = {"step": step, "code": type(error).__name__, "message": str(error), "at": time.time()}
        await put_bytes(self.store, f"{step_dir(step)}/{FAILED_MARKER}", encode_json(doc))

    async def read_failed(self, step: int) -> dict[str, Any] | None:
        data = await get_bytes(self.store, f"{step_dir(step)}/{FAILED_MARKER}")
        return None if data is None else dict(msgspec.json.decode(data))

    async def clear_failed(self, step: int) -> None:
        """The coordinator starts the step again: drop the failure note of an earlier attempt."""
        key = f"{step_dir(step)}/{FAILED_MARKER}"
        if await self.store.exists(key):
            await self.store.delete(key)

    async def wait_committed(
        self, step: int, timeout: float, poll: float = 0.05, *, since: float = 0.0
    ) -> CommitManifest:
        """Non-coordinator side: wait for the marker (or for the coordinator's failure note).

        Failure notes written before ``since`` (wall clock) belong to an earlier attempt and are ignored.
        """
        deadline = time.monotonic() + timeout
        while not await self.is_committed(step):
            failed = await self.read_failed(step)
            if failed is not None and float(failed.get("at", 0.0)) >= since:
                cls = error_classes().get(str(failed.get("code")), StepFailedError)
                raise cls(f"step {step} failed on the coordinator: {failed.get('message')}")
            if time.monotonic() >= deadline:
                raise SaveTimeoutError(f"step {step} did not commit within {timeout:.0f}s")
            await asyncio.sleep(poll)
            poll = min(poll * 1.5, 1.0)
        return await self.read_commit(step)

    # --- retention --------------------------------------------------------------------------------
    async def delete_step(self, step: int) -> None:
        """Remove a step; the commit marker goes first so a half-deleted step is never 'committed'.

        On S3 the unfinished multipart uploads under the step (left by a writer that died mid-upload)
        are aborted too: they are invisible to listings but kept, and billed, until aborted.
        """
        prefix = step_dir(step)
        await self.store.delete(f"{prefix}/{COMMIT_MARKER}")
        await self.store.delete_dir(prefix)
        aborted = await abort_uploads(self.store, prefix)
        if aborted:
            log.info("step=%d: aborted %d unfinished multipart upload(s)", step, aborted)

    async def retain(self, keep: int) -> list[int]:
        """Keep the newest ``keep`` committed steps; drop older ones and unfinished steps older than the
        newest commit. Never removes the only committed step, nor anything when nothing committed."""
        keep = max(1, keep)
        committed = await self.committed_steps()
        if not committed:
            return []
        newest = committed[-1]
        doomed = set(committed[:-keep])
        doomed |= {s for s in await self.steps() if s < newest and s not in committed}
        for step in sorted(doomed):
            log.info("retention: removing step %d", step)
            await self.delete_step(step)
        return sorted(doomed)


def _groups(names: Iterable[str]) -> set[str]:
    """Every intermediate group path of the given array names (relative to the step)."""
    out: set[str] = set()
    for name in names:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            out.add("/".join(parts[:i]))
    return out
