"""The storage format, as pure functions and typed records: names, keys, dtypes, chunk grids, manifests.

Nothing here performs I/O or imports zarr, so the client may use it to reject bad input before it
stages a byte, and tests can check it exhaustively. ``docs/format.md`` is the prose version.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec

from ckptd.writer.checksum import seal_json
from ckptd.writer.errors import InvalidKeyError, UnsupportedDtypeError, UnsupportedFormatError
from ckptd.writer.grid import CHUNK_SEPARATOR as CHUNK_SEPARATOR
from ckptd.writer.grid import DEFAULT_CHUNK_BYTES as DEFAULT_CHUNK_BYTES  # the grid is part of the format
from ckptd.writer.grid import ChunkSeparator as ChunkSeparator
from ckptd.writer.grid import check_region as check_region
from ckptd.writer.grid import chunk_count as chunk_count
from ckptd.writer.grid import chunk_key as chunk_key
from ckptd.writer.grid import chunk_selection_of as chunk_selection_of
from ckptd.writer.grid import plan_chunks as plan_chunks
from ckptd.writer.grid import region_chunks as region_chunks
from ckptd.writer.replicas import ReplicaRecord

FORMAT_VERSION = 4
#: 1: control objects beside the arrays; 2: in ``_ckptd/``; 3: edge chunks stored whole (zarr v3), not cut;
#: 4: chunk keys ``c.<i>.<j>`` (:data:`CHUNK_SEPARATOR`, each array's record says which), not ``c/<i>/<j>``
READABLE_VERSIONS = (1, 2, 3, 4)
#: where control objects live, by format: 1 beside the arrays, 2 (and 3) in ``_ckptd/``; readers try both
CONTROL_LAYOUTS = (1, 2)

COMMIT_MARKER = "COMMITTED"
FAILED_MARKER = "FAILED"
VERDICT = "VERDICT"
LATEST = "latest"
PARTS_DIR = "_parts"
SIDECAR_DIR = "_sidecars"
# Since format 2 ckptd's control objects (markers, manifests, sidecars, ``latest``) live in a folder that
# is a zero-size zarr array: zarr readers list it as an (empty) array and never look inside, so listing a
# group meets nothing but zarr nodes (zarr-python warns about any other object in a group's folder).
CONTROL_DIR = "_ckptd"
ARRAY_ATTR = "ckptd"

_STEP_RE = re.compile(r"step_(0|[1-9][0-9]*)")  # exactly what step_dir() writes
# how users name a step: a number, ckptd's stored name, or Megatron-LM's folder name (iter_0000100)
_STEP_NAME_RE = re.compile(r"(step_|iter_)?([0-9]+)")
_KEY_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-+=:@,]*$")
MAX_KEY_LEN = 1024


# --- names ----------------------------------------------------------------------------------------
def step_dir(step: int) -> str:
    if step < 0:
        raise InvalidKeyError(f"step must be >= 0, got {step}")
    return f"step_{step}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def megatron_iter_name(step: int) -> str:
    """Megatron-LM's name for the checkpoint of iteration ``step``: ``iter_0000100`` (7 digits, zero-padded).

    Only a spelling users meet (``--load``, ``--step``, Megatron-LM's logs): ckptd stores the step as
    :func:`step_dir`."""
    if step < 0:
        raise InvalidKeyError(f"step must be >= 0, got {step}")
    return f"iter_{step:07d}"


def parse_step(value: int | str) -> int | Literal["latest"]:
    """A step as a user names it: its number, or ``"latest"``.

    Accepts an int, ``"latest"``, ``"100"``, ckptd's stored name ``"step_100"`` and Megatron-LM's
    ``"iter_0000100"`` (any zero padding). Everything that takes a step from a user (``ckptd ls/verify/
    merge --step``, ``CheckpointRoot.resolve``, the loaders, Megatron-LM's ``--ckpt-step``) goes through
    here. Anything else raises :class:`InvalidKeyError`.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        if value.strip() == LATEST:
            return "latest"
        m = _STEP_NAME_RE.fullmatch(value.strip())
        if m:
            return int(m.group(2))
    raise InvalidKeyError(f"a step is a number, 'latest', 'step_N' or 'iter_NNNNNNN', got {value!r}")


def split_step_path(path: str) -> tuple[str, int | None]:
    """``(root, step)`` for a path that names one step's folder, else ``(path, None)``.

    Megatron-LM users point ``--load`` at ``<root>/iter_0000100`` (and ckptd's own folders are
    ``<root>/step_100``): the last component, when it is such a name, is the step of the root above it.
    Pure: the caller decides whether ``path`` is itself a root (see ``megatron_lm.load_checkpoint``).
    """
    head, sep, last = path.rstrip("/").rpartition("/")
    m = _STEP_NAME_RE.fullmatch(last)
    if not sep or not head or head.endswith(":/") or m is None or m.group(1) is None:
        return path, None
    return head, int(m.group(2))


def part_name(node: int) -> str:
    return f"{PARTS_DIR}/node-{node}.json"


PART_FILE_RE = re.compile(r"node-(0|[1-9][0-9]*)\.json")  # a part's name in its folder (part_name's tail)


def control_dir(group: str = "", version: int = FORMAT_VERSION) -> str:
    """The folder holding the control objects of a group (``""``: the root): ``<group>/_ckptd`` since
    format 2, the group's own folder in format 1. Its ``zarr.json`` makes it an empty array."""
    if version >= 2:
        return f"{group}/{CONTROL_DIR}" if group else CONTROL_DIR
    return group


def _in(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def commit_marker(step: int, version: int = FORMAT_VERSION) -> str:
    """``step_N/_ckptd/COMMITTED`` (format 1: ``step_N/COMMITTED``)."""
    return _in(control_dir(step_dir(step), version), COMMIT_MARKER)


def failed_marker(step: int, version: int = FORMAT_VERSION, attempt: str = "") -> str:
    """``step_N/_ckptd/FAILED``: the newest failure note; ``FAILED.<attempt>``: that named attempt's own."""
    name = f"{FAILED_MARKER}.{attempt}" if attempt else FAILED_MARKER
    return _in(control_dir(step_dir(step), version), name)


def verdict_key(step: int, attempt: str) -> str:
    """``step_N/_ckptd/VERDICT.<attempt>``: who decided a named attempt of a multi-node step, created once —
    the coordinator, about to commit, or a node that stopped waiting for the commit (docs/format.md)."""
    return _in(control_dir(step_dir(step)), f"{VERDICT}.{attempt}")


def parts_dir(step: int, version: int = FORMAT_VERSION) -> str:
    return _in(control_dir(step_dir(step), version), PARTS_DIR)


def part_key(step: int, node: int, version: int = FORMAT_VERSION) -> str:
    """``step_N/_ckptd/_parts/node-K.json``."""
    return _in(control_dir(step_dir(step), version), part_name(node))


def latest_key(version: int = FORMAT_VERSION) -> str:
    """``_ckptd/latest`` (format 1: ``latest``)."""
    return _in(control_dir("", version), LATEST)


def sidecar_key(name: str, version: int = FORMAT_VERSION) -> str:
    """``_ckptd/_sidecars/<sha256>.json`` (format 1: ``_sidecars/<sha256>.json``)."""
    return _in(control_dir("", version), f"{SIDECAR_DIR}/{name}")


def control_groups(step: int) -> list[str]:
    """The control folders a commit of ``step`` declares as (empty) zarr arrays."""
    return [control_dir(""), control_dir(step_dir(step))]


def sidecar_name(text: str | bytes) -> str:
    """The content address of a sidecar document (its text, or the bytes stored)."""
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest() + ".json"


def check_sidecar(name: str, text: str) -> None:
    if name != sidecar_name(text):
        raise InvalidKeyError(f"sidecar name {name[:80]!r} is not the sha256 of its content")


def validate_key(key: object) -> str:
    """Return ``key`` if it is a safe relative array name; raise :class:`InvalidKeyError` otherwise.

    Keys may contain ``/`` (nested groups). Each part must start with a letter or digit (names that start
    with ``_`` or ``.`` are ckptd's or zarr's own) and use only ``[A-Za-z0-9._-+=:@,]``, which rules out
    ``..``, absolute paths, empty parts, backslashes and control characters.
    """
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_LEN:
        raise InvalidKeyError(f"key longer than {MAX_KEY_LEN} characters: {key[:60]!r}...")
    for part in key.split("/"):
        if part in ("", ".", "..") or not _KEY_PART_RE.fullmatch(part) or part == "zarr.json":
            raise InvalidKeyError(
                f"unsafe key {key!r}: part {part!r} is empty, '.', '..', starts with '_' or '.', or uses "
                "characters outside [A-Za-z0-9._-+=:@,]"
            )
    return key


def array_groups(names: Iterable[str]) -> set[str]:
    """Every group the given array names are in, relative to the step (``a/b/c`` is in ``a`` and ``a/b``)."""
    groups: set[str] = set()
    for name in names:
        group = name.rpartition("/")[0]
        while group and group not in groups:  # its parents are in already
            groups.add(group)
            group = group.rpartition("/")[0]
    return groups


def check_key_tree(names: Iterable[str], *, saved: bool = True) -> None:
    """A step's array names form a tree: none is also a group of another (``a`` and ``a/b``: both would
    own ``a/zarr.json``; ``a`` and ``a/c.0``: one's chunk, the other's folder), and, for names a rank saves
    (``saved``), none lies in the folder ``ckptd merge`` writes (``merged/``). :class:`InvalidKeyError`
    naming the pair otherwise."""
    names = set(names)
    for name in names if saved else ():
        if name.split("/", 1)[0] == MERGED_DIR:
            raise InvalidKeyError(f"key {name!r}: '{MERGED_DIR}/' holds what `ckptd merge` writes; name it otherwise")
    clash = names & array_groups(names)
    if clash:
        group = min(clash)
        member = min(n for n in names if n.startswith(f"{group}/"))
        raise InvalidKeyError(f"key {group!r} is an array and also the group of {member!r}: rename one")


# --- dtypes ---------------------------------------------------------------------------------------
# torch dtype name -> (numpy dtype stored in zarr, item size). Types numpy/zarr lack are stored as raw
# bits of the same width; the torch dtype is recorded in the array attributes.
_STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("float64", 8),
    "float32": ("float32", 4),
    "float16": ("float16", 2),
    "bfloat16": ("uint16", 2),
    "float8_e4m3fn": ("uint8", 1),
    "float8_e5m2": ("uint8", 1),
    "int64": ("int64", 8),
    "int32": ("int32", 4),
    "int16": ("int16", 2),
    "int8": ("int8", 1),
    "uint8": ("uint8", 1),
    "bool": ("bool", 1),
}


def storage_dtype(torch_dtype: str) -> str:
    try:
        return _STORAGE_DTYPES[torch_dtype][0]
    except KeyError:
        raise UnsupportedDtypeError(
            f"unsupported dtype {torch_dtype!r}; supported: {sorted(_STORAGE_DTYPES)}"
        ) from None


def itemsize(torch_dtype: str) -> int:
    storage_dtype(torch_dtype)
    return _STORAGE_DTYPES[torch_dtype][1]


def supported_dtypes() -> list[str]:
    return sorted(_STORAGE_DTYPES)


# --- manifests ------------------------------------------------------------------------------------
class ChunkRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    coords: list[int]
    nbytes: int
    crc32c: int
    # crc32c of each PIECE_BYTES (1 MiB) of a raw chunk's bytes, the last piece shorter, when it has more than
    # one (ckptd.writer.checksum.chunk_sum), 4 bytes each, little-endian (base64 in JSON): a partial read
    # checks just the pieces it read. Absent otherwise, and in chunks written before (checked whole)
    pieces: bytes = b""


class ShardRecord(msgspec.Struct, frozen=True):
    rank: int
    offset: list[int]
    shape: list[int]
    chunks: list[ChunkRecord]


class ArrayRecord(msgspec.Struct, frozen=True):
    name: str
    torch_dtype: str
    shape: list[int]
    chunks: list[int]
    shards: list[ShardRecord] = []
    codec: str = "raw"  # "raw" or "zstd"; crc32c is always last
    # how its chunk keys join the coordinates (:func:`chunk_key`): "." since format 4, "/" before (the
    # default: records of older manifests have no such field)
    separator: ChunkSeparator = "/"


class PartManifest(msgspec.Struct, frozen=True):
    """``step_N/_parts/node-K.json``: what one node wrote for one step; written once all is durable."""

    format: int
    step: int
    node: int
    num_nodes: int
    world_size: int
    ranks: list[int]
    arrays: list[ArrayRecord]
    objects: dict[str, Any]
    nbytes: int
    written_at: float
    replicas: list[ReplicaRecord] = []  # regions its ranks hold only as non-main replicas (writer/replicas.py)
    attempt: str = ""  # the attempt of its ranks' saves (client/attempts.py); "" when unknown
    started_at: float = 0.0  # wall clock: when the node's first save of the step came (0: unknown, older parts)


class CommitManifest(msgspec.Struct, frozen=True):
    """``step_N/COMMITTED``: the global manifest, written last. Its presence makes the step a checkpoint."""

    format: int
    step: int
    num_nodes: int
    world_size: int
    arrays: list[ArrayRecord]
    objects: dict[str, Any]
    nbytes: int
    committed_at: float
    attempts: list[str] = []  # each node's attempt token, in node order ("" unknown; absent before them)


def other_attempt(a: str, b: str) -> bool:
    """Whether two attempt tokens name different attempts: both known and unequal (``""`` is unknown and
    stands for any, as it did before attempts were named)."""
    return bool(a) and bool(b) and a != b


def note_of(note: dict[str, object], attempt: str, since: float) -> bool:
    """Whether a failure note is about the waiter's attempt (the rule of
    :meth:`~ckptd.writer.commit.CheckpointWriter.wait_committed`)."""
    theirs = str(note.get("attempt", ""))
    if theirs and attempt:
        return theirs == attempt
    at = note.get("at", 0.0)
    return float(at) >= since if isinstance(at, int | float) else False


def encode_json(obj: object) -> bytes:
    """``obj`` as compact JSON; a manifest (:class:`CommitManifest`, also ``MERGED``, :class:`PartManifest`)
    sealed with the crc32c of its bytes (:func:`~ckptd.writer.checksum.seal_json`; readers check it:
    :mod:`ckptd.writer.manifests`)."""
    data = msgspec.json.encode(obj)
    return seal_json(data) if isinstance(obj, CommitManifest | PartManifest) else data


def decode_part(data: bytes) -> PartManifest:
    return msgspec.json.decode(data, type=PartManifest)


def decode_commit(data: bytes) -> CommitManifest:
    """A commit (or merge) manifest; :class:`UnsupportedFormatError` for a format this reader predates."""
    manifest = msgspec.json.decode(data, type=CommitManifest)
    if manifest.format not in READABLE_VERSIONS:
        raise UnsupportedFormatError(
            f"step {manifest.step} is stored in format {manifest.format}; this ckptd reads formats "
            f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade ckptd to read it"
        )
    return manifest


# === Megatron integration and merged layout: stored names ==========================================
# Every name the Megatron integration (ckptd.client.megatron), the offline merge (ckptd.writer.merge) and
# the merged-layout reader store or look up is spelled here and nowhere else. The functions read the
# module's constants at call time, so a renamed prefix changes every writer and reader at once.
MEGATRON_CHECKPOINT_VERSION = 1  # the per-rank ``megatron`` record's version
MEGATRON_LAYOUT_VERSION = 1  # the layout sidecar's (and the optimizer metadata's) version
MEGATRON_RECORD = "megatron"  # per-rank plain data: layout sidecar name, parallel ranks and sizes
MODEL_PREFIX = "model/"  # model/<ShardedTensor key>
OPTIM_PREFIX = "optim/"  # optim/<mp>/buf<g>/bucket<b>/<state>
OPTIM_META = "optim_meta"  # plain optimizer data: param groups, scalar per-param state, grad scaler
MAIN_PARAM = "param"  # the bucket state holding the fp32 main params
RNG_PREFIX = "rng/"  # rng/torch, rng/cuda, rng/cuda_tracker/<name>: per-rank arrays
RNG_RECORD = "rng"  # Python's and NumPy's RNG state, plain data
EXTRA = "extra"  # the caller's plain data
LAYOUT_FIELD = "layout"  # the record field naming the layout sidecar

MERGED_DIR = "merged"  # step_N/merged/: the fully-reshardable layout
MERGED_MARKER = "MERGED"  # step_N/merged/MERGED: the merge's manifest, written last
MERGED_PROGRESS_DIR = "_progress"  # step_N/merged/_ckptd/_progress/<task>.<tag>.json: one per finished bucket
MERGED_CONTENT = "fully_reshardable"
#: the ``committed_at`` of the commit a merge was built from, in ``MERGED``'s objects (and, as a hex tag of
#: its microseconds, in each progress note's name): a step number saved again is merged anew
MERGED_SOURCE_FIELD = "source_committed_at"
STATE_PREFIX = "optimizer.state."  # merged/optimizer.state.<state>.<model key>


def model_key(sharded_key: str, prefix: str | None = None) -> str:
    """``model/<ShardedTensor key>``: the array of one model tensor in model space."""
    return validate_key(f"{MODEL_PREFIX if prefix is None else prefix}{sharded_key}")


def optim_mp(tp: int, pp: int, ep: int | None = None) -> str:
    """The model-parallel tag of optimizer keys: ``tp<t>.pp<p>`` (dense) or ``tp<t>.ep<e>.pp<p>`` (expert)."""
    return f"tp{tp}.pp{pp}" if ep is None else f"tp{tp}.ep{ep}.pp{pp}"


def bucket_prefix(mp: str, buffer: int, bucket: int, prefix: str | None = None) -> str:
    """``optim/<mp>/buf<g>/bucket<b>/``: every state of one padded bucket is stored under it."""
    return f"{OPTIM_PREFIX if prefix is None else prefix}{mp}/buf{buffer}/bucket{bucket}/"


def bucket_key(mp: str, buffer: int, bucket: int, state: str, prefix: str | None = None) -> str:
    """``optim/<mp>/buf<g>/bucket<b>/<state>``: one state of one padded bucket, a 1-D array."""
    return validate_key(bucket_prefix(mp, buffer, bucket, prefix) + state)


def bucket_states(names: Sequence[str], prefix: str) -> list[str]:
    """The states stored directly under a :func:`bucket_prefix` among ``names``, sorted."""
    return sorted(n[len(prefix) :] for n in names if n.startswith(prefix) and "/" not in n[len(prefix) :])


def split_bucket_key(key: str) -> tuple[str, str]:
    """``(bucket prefix, state)`` of a :func:`bucket_key`."""
    prefix, _, state = key.rpartition("/")
    return prefix + "/", state


def merged_array_name(state: str, sharded_key: str) -> str:
    """``merged/optimizer.state.<state>.<model key>``, relative to the step directory."""
    return validate_key(f"{MERGED_DIR}/{STATE_PREFIX}{state}.{sharded_key}")


def merged_state_of(name: str) -> str | None:
    """The state of a :func:`merged_array_name` (``exp_avg``...), or None for another array."""
    prefix = f"{MERGED_DIR}/{STATE_PREFIX}"
    return name[len(prefix) :].split(".", 1)[0] if name.startswith(prefix) else None


def merged_control_dir(step: int, version: int = FORMAT_VERSION) -> str:
    """``step_N/merged/_ckptd`` (format 1: ``step_N/merged``): the merge's marker and progress notes."""
    return control_dir(f"{step_dir(step)}/{MERGED_DIR}", version)


def merged_marker(step: int, version: int = FORMAT_VERSION) -> str:
    return f"{merged_control_dir(step, version)}/{MERGED_MARKER}"


def merged_progress_dir(step: int, version: int = FORMAT_VERSION) -> str:
    return f"{merged_control_dir(step, version)}/{MERGED_PROGRESS_DIR}"
