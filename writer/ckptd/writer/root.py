"""The read view of a checkpoint root: which steps exist, which committed, their manifests and sidecars.

A step is a checkpoint only once its ``COMMITTED`` marker exists; ``latest`` is a hint, the markers are
the truth. Nothing here writes: the commit sequence lives in :mod:`ckptd.writer.commit`.

    async with open_root(url, options) as root:
        commit = await root.read_commit(await root.resolve("latest"))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from zarr.abc.store import Store

from ckptd.writer.backends import Backend, open_backend
from ckptd.writer.errors import (
    CheckpointNotFoundError,
    CkptdError,
    CorruptCheckpointError,
    InvalidKeyError,
    NoCommittedStepError,
    UncommittedStepError,
)
from ckptd.writer.fanout import bounded_map
from ckptd.writer.format import (
    COMMIT_MARKER,
    CONTROL_LAYOUTS,
    FORMAT_VERSION,
    MERGED_SOURCE_FIELD,
    PART_FILE_RE,
    CommitManifest,
    PartManifest,
    commit_marker,
    encode_json,
    failed_marker,
    latest_key,
    merged_marker,
    parse_step,
    parse_step_dir,
    parts_dir,
    sidecar_key,
    sidecar_name,
    step_dir,
    verdict_key,
)
from ckptd.writer.manifests import decode_commit_checked, decode_part_checked

if TYPE_CHECKING:
    from ckptd.writer.backends.s3 import S3Options

log = logging.getLogger(__name__)

#: small reads (markers, part manifests) in flight at once
READ_CONCURRENCY = 16


class CheckpointRoot:
    """All checkpoints under one root, read through its :class:`~ckptd.writer.backends.Backend`.

    The root does not own the backend: whoever opened it closes it (:func:`open_root` does).
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def store(self) -> Store:
        """The zarr store at the root (array metadata and reads)."""
        return self.backend.store

    async def steps(self) -> list[int]:
        """Every step directory present, committed or not, ascending."""
        found = [parse_step_dir(name) for name in await self.backend.list_dir("")]
        return sorted(s for s in found if s is not None)

    async def _get_any(self, keys: list[str]) -> bytes | None:
        """The first of ``keys`` that exists (the same object in each readable format version, newest first)."""
        for key in keys:
            data = await self.backend.get(key)
            if data is not None:
                return data
        return None

    async def is_committed(self, step: int) -> bool:
        for version in CONTROL_LAYOUTS[::-1]:  # the current layout first: one request for new steps
            if await self.backend.exists(commit_marker(step, version)):
                return True
        return False

    async def scan_steps(self) -> tuple[list[int], dict[int, CkptdError]]:
        """The committed steps, ascending, and the steps whose marker could not be looked at (``EIO``, a stale
        NFS handle, no permission), each with its typed error: one such step hides none of the others."""
        steps = await self.steps()

        async def probe(step: int) -> bool | CkptdError:
            try:
                return await self.is_committed(step)
            except CkptdError as exc:
                return exc

        flags = await bounded_map(probe, steps, limit=READ_CONCURRENCY)
        unreadable = {s: f for s, f in zip(steps, flags, strict=True) if isinstance(f, CkptdError)}
        return [s for s, f in zip(steps, flags, strict=True) if f is True], unreadable

    async def committed_steps(self) -> list[int]:
        """The committed steps, ascending; a step whose marker could not be looked at raises its error."""
        committed, unreadable = await self.scan_steps()
        if unreadable:
            raise next(iter(unreadable.values()))
        return committed

    async def latest(self) -> int | None:
        """The newest committed step (by the markers, not by the ``latest`` hint). A newer step whose marker
        could not be looked at raises its error (it may be the newest); an older one does not matter."""
        committed, unreadable = await self.scan_steps()
        newest = committed[-1] if committed else None
        later = [s for s in unreadable if newest is None or s > newest]
        if later:
            raise unreadable[max(later)]
        return newest

    async def latest_hint(self) -> int | None:
        """What the ``latest`` object says (``None`` if absent or unreadable)."""
        data = await self._get_any([latest_key(v) for v in CONTROL_LAYOUTS[::-1]])
        try:
            return int(data) if data else None
        except ValueError:
            return None

    async def resolve(self, step: int | str) -> int:
        """``"latest"`` -> the newest committed step; a number stays as it is. Strings are read by
        :func:`~ckptd.writer.format.parse_step` (``"100"``, ``"step_100"``, ``"iter_0000100"``)."""
        try:
            step = parse_step(step)
        except InvalidKeyError as exc:
            raise CheckpointNotFoundError(str(exc)) from exc
        if step == "latest":
            found = await self.latest()
            if found is None:
                raise NoCommittedStepError(f"no committed checkpoint under {self.url or 'the root'}")
            return found
        if not isinstance(step, int):
            raise CheckpointNotFoundError(f"step must be an int or 'latest', got {step!r}")
        return step

    async def read_commit(self, step: int) -> CommitManifest:
        """The commit manifest of a committed step; :class:`UncommittedStepError` if it never committed."""
        data = await self._get_any([commit_marker(step, v) for v in CONTROL_LAYOUTS[::-1]])
        if data is None:
            if await self.backend.list_dir(step_dir(step)):
                raise UncommittedStepError(f"step {step} under {self.url} never committed: it is not a checkpoint")
            raise CheckpointNotFoundError(f"no checkpoint for step {step} under {self.url}")
        try:
            manifest = decode_commit_checked(data, f"step {step}: {COMMIT_MARKER} under {self.url}")
        except CkptdError:  # a newer format, a damaged manifest: their own errors, not "unreadable"
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"step {step}: unreadable {COMMIT_MARKER}: {exc}") from exc
        if manifest.step != step:  # a marker copied or restored into the wrong step's folder
            raise CorruptCheckpointError(
                f"step {step}: its {COMMIT_MARKER} under {self.url} is the manifest of step {manifest.step}"
            )
        return manifest

    async def read_parts(self, step: int) -> dict[int, PartManifest]:
        """The node part manifests present for ``step``, by node (other names in the folder, such as a
        part being written aside, are not parts). One that does not decode (torn by a kill mid-write of a
        release that wrote parts in place), fails its checksum or chunk records, or is another step's raises
        :class:`CorruptCheckpointError` naming it."""
        prefix = parts_dir(step, FORMAT_VERSION)
        names = [n for n in await self.backend.list_dir(prefix) if PART_FILE_RE.fullmatch(n)]
        found = await bounded_map(lambda n: self.backend.get(f"{prefix}/{n}"), names, limit=READ_CONCURRENCY)
        parts: dict[int, PartManifest] = {}
        for name, data in zip(names, found, strict=True):
            if data is not None:
                try:
                    part = decode_part_checked(data, name)
                    if part.step != step:
                        raise CorruptCheckpointError(f"it is a part of step {part.step}")
                except (msgspec.DecodeError, CorruptCheckpointError) as exc:
                    raise CorruptCheckpointError(
                        f"step {step}: part manifest {prefix}/{name} under {self.url} is damaged ({len(data)} "
                        f"bytes: {exc}); delete it and save the step again"
                    ) from exc
                parts[part.node] = part
        return parts

    async def read_sidecar(self, name: str) -> str:
        """A content-addressed document (e.g. a layout sidecar), checked against its hash."""
        data = await self._get_any([sidecar_key(name, v) for v in CONTROL_LAYOUTS[::-1]])
        if data is None:
            raise CheckpointNotFoundError(f"sidecar {name} not found under {self.url}")
        if sidecar_name(data) != name:  # the stored bytes, before they are decoded (damage may not be UTF-8)
            raise CorruptCheckpointError(f"sidecar {name} under {self.url} does not match its hash")
        return data.decode()

    async def claim_verdict(self, step: int, attempt: str, verdict: str, *, node: int) -> dict[str, object] | None:
        """Create ``attempt``'s verdict (create-once): ``None`` when this claim decided it, else the verdict
        that stands (another node's, or this one's of an earlier call). The coordinator claims ``"commit"``
        before its marker; a node that stops waiting for the commit claims ``"timeout"``: exactly one decides
        whether a multi-node step of a named attempt may still commit."""
        key = verdict_key(step, attempt)
        if await self.backend.create(key, encode_json({"verdict": verdict, "node": node, "at": time.time()})):
            return None
        found = await self.read_verdict(step, attempt)
        if found is None:
            raise CorruptCheckpointError(f"step {step}: unreadable {key} under {self.url}")
        return found

    async def read_verdict(self, step: int, attempt: str) -> dict[str, object] | None:
        """``attempt``'s verdict as it stands (None: none claimed yet); :class:`CorruptCheckpointError` for one
        that does not decode."""
        key = verdict_key(step, attempt)
        data = await self.backend.get(key)
        if data is None:
            return None
        try:
            found = msgspec.json.decode(data)
        except msgspec.DecodeError:
            found = None
        if not isinstance(found, dict):
            raise CorruptCheckpointError(f"step {step}: unreadable {key} under {self.url}")
        return found

    async def read_failed(self, step: int, attempt: str = "") -> dict[str, Any] | None:
        """The newest failure note for ``step`` (``None`` if there is none); for a named ``attempt``, that
        attempt's own note when it has one (read beside the newest: a late note of another attempt may
        have replaced the newest, or the newest was never written).

        A note that cannot be decoded (cut short on a full local disk) still says the step failed; its time
        is unknown (``at`` 0: waiters do not take it for a failure of their attempt)."""
        if not attempt:
            return await self._read_note(failed_marker(step), step)
        own, newest = await asyncio.gather(
            self._read_note(failed_marker(step, attempt=attempt), step), self._read_note(failed_marker(step), step)
        )
        return own if own is not None else newest

    async def _read_note(self, key: str, step: int) -> dict[str, Any] | None:
        data = await self.backend.get(key)
        if data is None:
            return None
        try:
            return dict(msgspec.json.decode(data))
        except (msgspec.DecodeError, TypeError, ValueError):
            return {"step": step, "code": "StepFailedError", "at": 0.0,
                    "message": f"the step failed; its failure note is unreadable ({len(data)} bytes)"}

    async def read_merged_manifest(self, step: int, source: CommitManifest | None = None) -> CommitManifest | None:
        """The merge manifest of ``step`` (``ckptd merge``), or ``None`` if it was never merged. With ``source``
        (the step's commit), a merge of another commit under the same step number — the step deleted part-way
        (its ``COMMITTED`` first) and saved again — counts as none."""
        data = await self._get_any([merged_marker(step, v) for v in CONTROL_LAYOUTS[::-1]])
        if data is None:
            return None
        try:
            manifest = decode_commit_checked(data, f"step {step}: merge manifest under {self.url}")
        except msgspec.DecodeError as exc:
            raise CorruptCheckpointError(f"step {step}: unreadable merge manifest: {exc}") from exc
        if manifest.step != step:
            raise CorruptCheckpointError(f"step {step}: its merge manifest under {self.url} is step {manifest.step}'s")
        if source is not None and not merged_from(manifest, source):
            log.warning("step %d under %s: its merged layout was built from an earlier commit of this step number "
                        "(the step was deleted and saved again); not used: run `ckptd merge` again", step, self.url)
            return None
        return manifest


def merged_from(manifest: CommitManifest, commit: CommitManifest) -> bool:
    """Whether a merge manifest was built from ``commit`` (merges before this check was recorded: assumed)."""
    source = manifest.objects.get(MERGED_SOURCE_FIELD)
    return source is None or source == commit.committed_at


@contextlib.asynccontextmanager
async def open_root(
    url: str, options: Mapping[str, Any] | S3Options | None = None, *, create: bool = False
) -> AsyncIterator[CheckpointRoot]:
    """Open the backend at ``url`` (see :func:`~ckptd.writer.backends.open_backend`), yield its read
    view, and close the backend on exit. ``create=False`` (readers) refuses a missing local root."""
    async with await open_backend(url, options, create=create) as backend:
        yield CheckpointRoot(backend)
