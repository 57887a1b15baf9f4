"""crc32c (CRC-32C, the iSCSI polynomial): the checksum of every stored chunk, as zarr v3's ``crc32c``
codec appends it and the commit manifest records it.

Every chunk is checksummed once when it is written and once more each time it is read back (a load, an
in-memory restore, ``ckptd verify``), so the checksum's speed is the load's floor whenever the data is
already in memory. ``fastcrc``'s implementation folds with carry-less multiplies (PCLMULQDQ, VPCLMULQDQ
where the CPU has them): on the 2-core EPYC it checksums a cached 1 MiB piece at ~49 GB/s, against ~20 GB/s
for the ``crc32c`` package's SSE4.2 loop (docs/benchmarks-log.md). Both give the same value and release the
GIL; the ``crc32c`` package stays the fallback where no ``fastcrc`` wheel installs.
"""

from __future__ import annotations

import crc32c as _crc32c

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
