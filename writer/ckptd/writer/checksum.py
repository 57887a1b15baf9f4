"""crc32c (CRC-32C, the iSCSI polynomial): the checksum of every stored chunk, as zarr v3's ``crc32c``
codec appends it and the commit manifest records it.

Every chunk is checksummed once when it is written and once more each time it is read back (a load, an
in-memory restore, ``ckptd verify``), so the checksum's speed is the load's floor whenever the data is
already in memory. ``fastcrc``'s implementation folds with carry-less multiplies (PCLMULQDQ, VPCLMULQDQ
where the CPU has them): on the 2-core EPYC it checksums a cached 1 MiB piece at ~49 GB/s, against ~20 GB/s
for the ``crc32c`` package's SSE4.2 loop (docs/benchmarks-log.md). Both give the same value and release the
GIL; the ``crc32c`` package stays the fallback where no ``fastcrc`` wheel installs.

A raw chunk larger than :data:`PIECE_BYTES` also gets the crc32c of each of its pieces (:func:`chunk_sum`),
recorded in the manifest beside the whole chunk's: a load that needs part of a chunk (a TP change reads each
param's half from the stored bucket slices) reads and checks only the pieces holding bytes it needs. The
whole chunk's value is folded from the pieces' (:func:`crc32c_combine`), so the bytes are checksummed once.

Manifests (node parts, ``COMMITTED``, ``MERGED``) carry the crc32c of their own bytes (:func:`seal_json`,
:func:`check_seal`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import NamedTuple

import crc32c as _crc32c

from ckptd.writer.errors import CorruptCheckpointError

try:
    import fastcrc as _fast
except ImportError:  # pragma: no cover - every platform the CI runs has a wheel
    _fast = None  # type: ignore[assignment]

IMPLEMENTATION = "fastcrc" if _fast is not None else "crc32c"


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The crc32c of ``data`` (any contiguous bytes-like object), continued from ``value``: the crc32c of
    bytes seen before it, so a chunk read piece by piece gets the same value as in one call."""
    if _fast is not None:
        return int(_fast.crc32.iscsi(data, value))
    return int(_crc32c.crc32c(data, value))


PIECE_BYTES = 1 << 20  # the pieces a chunk's ``pieces`` checksums cover (the last one may be shorter)

_POLY = 0x82F63B78  # CRC-32C, reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial, both as reflected 32-bit polynomials."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^k) modulo the polynomial


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what moves a crc past ``nbytes`` zero bytes."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(first: int, second: int, second_nbytes: int) -> int:
    """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``, without the bytes."""
    return _multmodp(_shift(second_nbytes), first) ^ second


class ChunkSum(NamedTuple):
    """A stored chunk's checksums: the crc32c of all its bytes, and of each :data:`PIECE_BYTES` of them,
    packed (:func:`pack_pieces`; empty when the chunk is one piece)."""

    crc32c: int
    pieces: bytes


def pack_pieces(values: Sequence[int]) -> bytes:
    """Piece checksums as a manifest records them: 4 bytes each, little-endian (base64 in its JSON)."""
    return b"".join(v.to_bytes(4, "little") for v in values)


def piece_value(pieces: bytes, i: int) -> int:
    """The crc32c of piece ``i`` in packed ``pieces``."""
    return int.from_bytes(pieces[4 * i : 4 * i + 4], "little")


def pieces_fit(pieces: bytes, nbytes: int) -> bool:
    """Whether a chunk record's packed ``pieces`` hold one value for each :data:`PIECE_BYTES` of its
    ``nbytes`` (another count: pieces of another size, which this version does not know how to use)."""
    return bool(pieces) and len(pieces) == 4 * -(-nbytes // PIECE_BYTES)


def chunk_sum(data: memoryview) -> ChunkSum:
    """:class:`ChunkSum` of ``data`` (contiguous bytes): each piece checksummed once, the whole folded."""
    size = PIECE_BYTES
    if data.nbytes <= size:
        return ChunkSum(crc32c(data), b"")
    pieces = [crc32c(data[a : a + size]) for a in range(0, data.nbytes, size)]
    whole = pieces[0]
    for i, crc in enumerate(pieces[1:], 1):
        whole = crc32c_combine(whole, crc, min(size, data.nbytes - i * size))
    return ChunkSum(whole, pack_pieces(pieces))


# --- manifests ---------------------------------------------------------------------------------------
# A manifest's last member is the crc32c of its JSON as encoded without it (docs/format.md, "Manifest
# checksums"): the file stays one plain JSON object (older releases, and any JSON tool, ignore the member),
# and a reader checks the bytes before it trusts them. Manifests written before it have none: read unchecked.
SEAL_FIELD = "crc32c"
_SEAL = b',"crc32c":"%08x"}'
_SEAL_LEN = len(_SEAL % 0)
_SEALED_RE = re.compile(rb',"crc32c":"([0-9a-f]{8})"\}')
_SEAL_LIKE_RE = re.compile(rb'"crc32c"\s*:\s*"[^"]*"\s*\}\s*\Z')  # the member, however spaced, ending the file


def seal_json(data: bytes) -> bytes:
    """A JSON object (compact, with members) with its :data:`SEAL_FIELD` appended as its last member."""
    if len(data) < 3 or not data.endswith(b"}"):
        raise ValueError("only a JSON object with members can be sealed")
    return data[:-1] + _SEAL % crc32c(data)


def check_seal(data: bytes, what: str) -> bool:
    """Check a manifest's seal (:func:`seal_json`): True if it had one and the bytes match it, False if it
    has none (written before manifests were sealed). :class:`CorruptCheckpointError` when the bytes do not
    match, or when the member is there but not as written (the file was rewritten, e.g. by a JSON tool)."""
    m = _SEALED_RE.fullmatch(data, max(0, len(data) - _SEAL_LEN))
    if m is None:
        if _SEAL_LIKE_RE.search(data, max(0, len(data) - 256)):
            raise CorruptCheckpointError(
                f"{what}: its {SEAL_FIELD} member is not as ckptd wrote it (the file was rewritten or damaged)"
            )
        return False
    body = memoryview(data)[: len(data) - _SEAL_LEN]
    crc, want = crc32c(b"}", crc32c(body)), int(m.group(1), 16)
    if crc != want:
        raise CorruptCheckpointError(
            f"{what} is damaged: its bytes have crc32c {crc:#010x}, it was written with {want:#010x}"
        )
    return True
