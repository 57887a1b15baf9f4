"""Cleaning up under an S3 prefix: unfinished multipart uploads aborted, and objects deleted one by one
where the server has no batch delete (both used by :class:`~ckptd.writer.backends.s3.S3Backend`)."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

import s3fs

from ckptd.writer.backends.s3_compat import MULTIPART_LISTING, lacks, mark_lacking, not_implemented
from ckptd.writer.backends.s3_errors import classify_error, error_code
from ckptd.writer.errors import StorageNotFoundError, StoragePermissionError, first_leaf

logger = logging.getLogger(__name__)

_ABORT_CONCURRENCY = 8  # aborts or single DELETEs in flight at once


async def abort_incomplete_uploads(
    fs: s3fs.S3FileSystem,
    bucket: str,
    prefix: str,
    *,
    initiated_before: datetime | None = None,
) -> int:
    """Abort the unfinished multipart uploads under ``prefix`` in ``bucket``; return how many.

    Parts of an upload that never completed are invisible to listings but billed and kept until
    aborted. ``initiated_before`` (timezone-aware) spares uploads started later, e.g. by a save still
    in flight; pass it whenever anything may be writing under ``prefix``. An upload that vanished
    meanwhile (completed or aborted by someone else) is not counted.
    """
    url = f"s3://{bucket}/{prefix}"
    aborted = 0
    sem = asyncio.Semaphore(_ABORT_CONCURRENCY)

    async def abort(key: str, upload_id: str) -> None:
        nonlocal aborted
        async with sem:
            try:
                await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception as exc:
                err = classify_error(exc, url)
                if isinstance(err, StorageNotFoundError) and error_code(exc) == "NoSuchUpload":
                    return
                if isinstance(err, StoragePermissionError) and error_code(exc) == "AccessDenied":
                    # a policy without s3:AbortMultipartUpload: optional, never fails the retention or gc
                    # (another refusal, an expired token, is raised: it is not this endpoint's lack)
                    mark_lacking(fs, MULTIPART_LISTING, exc)
                    return
                raise err from exc
            aborted += 1

    key_marker: str | None = None
    upload_marker: str | None = None
    while True:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if key_marker is not None:
            kwargs["KeyMarker"] = key_marker
            if upload_marker is not None:
                kwargs["UploadIdMarker"] = upload_marker
        if lacks(fs, MULTIPART_LISTING):
            return aborted
        try:
            page = await fs._call_s3("list_multipart_uploads", **kwargs)
        except Exception as exc:
            if not_implemented(exc):  # optional: never fail the retention or gc that asked
                mark_lacking(fs, MULTIPART_LISTING, exc)
                return aborted
            raise classify_error(exc, url) from exc
        todo = [
            (u["Key"], u["UploadId"])
            for u in page.get("Uploads", [])
            if initiated_before is None or u["Initiated"] < initiated_before
        ]
        try:
            async with asyncio.TaskGroup() as tg:  # the first failure cancels the rest
                for key, upload_id in todo:
                    tg.create_task(abort(key, upload_id))
        except* Exception as group:
            raise first_leaf(group) from group
        if lacks(fs, MULTIPART_LISTING):  # refused: the rest would be refused too
            return aborted
        if not page.get("IsTruncated"):
            break
        key_marker, upload_marker = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
    if aborted:
        logger.info("aborted %d incomplete multipart uploads under %s", aborted, url)
    return aborted


async def delete_one_by_one(fs: s3fs.S3FileSystem, path: str) -> None:
    """Delete every object under ``path`` (``bucket/prefix``) with single DELETEs, a few at a time."""
    bucket, key_prefix, _version = fs.split_path(path)
    url = f"s3://{bucket}/{key_prefix}"
    try:
        keys = [fs.split_path(p)[1] for p in await fs._find(path)]
    except Exception as exc:
        raise classify_error(exc, url) from exc
    sem = asyncio.Semaphore(_ABORT_CONCURRENCY)

    async def one(key: str) -> None:
        async with sem:
            try:
                await fs._call_s3("delete_object", Bucket=bucket, Key=key)
            except Exception as exc:
                raise classify_error(exc, url) from exc

    try:
        async with asyncio.TaskGroup() as tg:
            for key in keys:
                tg.create_task(one(key))
    except* Exception as group:
        raise first_leaf(group) from group
