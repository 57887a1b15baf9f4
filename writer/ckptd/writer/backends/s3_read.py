"""Ranged GETs straight into the caller's memory: the S3 half of the fast read path (and the listing
that tells ``ckptd gc`` when a step was last written to).

``s3fs``'s ``cat_file`` reads a body into a new ``bytes`` (and its concurrent variant into a ``bytearray``
it then copies again); zarr wraps that in a ``Buffer``, and the reader copied it once more into place.
Here the body of one ranged ``GetObject`` is read piece by piece with aiobotocore's ``readinto`` into the
destination memory the caller gives (views of the tensor being loaded): the one copy left is from the
HTTP client's receive buffer into the destination.

Retries: the request itself is retried by botocore and s3fs (``_call_s3``); a body cut off while being
read (a reset connection, a read timeout) is not, so the whole range is requested again, at most
``fs.retries`` times (it is written to the same place, so a retry is idempotent).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence

import aiohttp
import s3fs
from botocore.exceptions import ReadTimeoutError, ResponseStreamingError

from ckptd.writer.backends.s3_errors import classify_error, error_code

__all__ = ["newest_modified", "read_range_into"]

logger = logging.getLogger(__name__)

PIECE = 1 << 20  # bytes handed to one readinto (what the HTTP client has buffered is copied, up to this)
_BODY_FAULTS = (ResponseStreamingError, ReadTimeoutError, aiohttp.ClientPayloadError, ConnectionError,
                asyncio.IncompleteReadError)
_CONTENT_RANGE = re.compile(r"bytes\s+\d+-\d+/(\d+)")


async def read_range_into(
    fs: s3fs.S3FileSystem, path: str, start: int, bufs: Sequence[memoryview], url: str
) -> tuple[int, int | None]:
    """Read bytes ``[start, start + total length of bufs)`` of the object at ``path`` (``bucket/key``) into
    ``bufs`` in order. Returns ``(bytes read, the object's size)``: fewer bytes than asked when the object is
    shorter (none at all when it ends before ``start``); the size from ``Content-Range`` (None if the server
    sent none). Typed storage errors (:func:`classify_error`); a missing object is
    :class:`~ckptd.writer.errors.StorageNotFoundError`."""
    want = sum(b.nbytes for b in bufs)
    if want == 0:
        return 0, None
    bucket, key, _version = fs.split_path(path)
    attempts = max(1, int(getattr(fs, "retries", 1)))
    attempt = 0
    while True:
        try:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{start + want - 1}")
        except Exception as exc:
            if error_code(exc) == "InvalidRange":  # the object ends before ``start``
                return 0, None
            raise classify_error(exc, url) from exc
        body = resp["Body"]
        try:
            got = await _fill(body, bufs)
        except _BODY_FAULTS as exc:
            attempt += 1
            if attempt >= attempts:
                raise classify_error(exc, url) from exc
            logger.info("s3 ranged read of %s cut off (%s); reading it again", key, type(exc).__name__)
            await asyncio.sleep(min(0.1 * 1.7**attempt, 5.0))
            continue
        finally:
            body.close()
        match = _CONTENT_RANGE.match(str(resp.get("ContentRange") or ""))
        return got, int(match.group(1)) if match else None


async def _fill(body: object, bufs: Sequence[memoryview]) -> int:
    got = 0
    for buf in bufs:
        pos = 0
        while pos < buf.nbytes:
            n = await body.readinto(buf[pos : pos + PIECE])  # type: ignore[attr-defined]
            if n == 0:
                return got + pos
            pos += n
        got += pos
    return got


async def newest_modified(fs: s3fs.S3FileSystem, path: str, url: str) -> float | None:
    """The newest ``LastModified`` of the objects under ``path`` (``bucket/prefix``), as epoch seconds."""
    try:
        found = await fs._find(path, detail=True)
    except Exception as exc:
        raise classify_error(exc, url) from exc
    times = [info["LastModified"].timestamp() for info in found.values() if info.get("LastModified")]
    return max(times, default=None)
