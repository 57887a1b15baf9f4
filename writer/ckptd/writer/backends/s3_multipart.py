"""Large objects as S3 multipart uploads that never outlive a failed or cancelled write.

s3fs uploads an object of 100 MiB or more in 50 MiB parts and aborts the upload when a part raises an
``Exception`` — but not when the write is cancelled (a failed step cancels the node's other writes; a
daemon giving up on a step cancels them all), since ``CancelledError`` is a ``BaseException``. The parts
already stored then stay, invisible to listings and billed, until retention or ``gc`` aborts them under
a deleted step; a step that is never listed again keeps them for good. A refused abort also replaced the
write's own error. Here every exit but success aborts the upload by its ``UploadId``: shielded from
further cancellation, bounded by :data:`ABORT_TIMEOUT_S`, best effort, and what propagates is the write's
own error (or its cancellation). Parts go up under one ``TaskGroup``, so the first failed part cancels the
others before the abort is sent (s3fs's ``gather`` left them running, racing the abort).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import s3fs

from ckptd.writer.backends.s3_compat import MULTIPART_LISTING, lacks, mark_lacking, not_implemented
from ckptd.writer.backends.s3_errors import classify_error, error_code
from ckptd.writer.errors import first_leaf

__all__ = ["ABORT_TIMEOUT_S", "CkptdS3FileSystem", "upload_multipart"]

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0  # how long a failed or cancelled write waits for its abort before it gives up on it
_MAX_PUT_BYTES = 5 * 2**30  # S3's limit for one PUT
_aborts: set[asyncio.Task[None]] = set()  # aborts left running by a writer cancelled again as it waited


class CkptdS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]  # (s3fs is untyped)
    """``s3fs.S3FileSystem`` whose multipart writes (``_pipe_file``: zarr's store and
    :meth:`~.s3.S3Backend.put_body`) abort their upload when they fail or are cancelled.

    ``resolved_endpoint`` is the endpoint botocore resolved for the client (set once connected, see
    :func:`~.s3_compat.endpoint_of`)."""

    resolved_endpoint: str | None = None

    async def _pipe_file(
        self,
        path: str,
        data: Any,
        chunksize: int = 50 * 2**20,
        max_concurrency: int | None = None,
        mode: str = "overwrite",
        **kwargs: Any,
    ) -> Any:
        if len(data) < min(_MAX_PUT_BYTES, 2 * chunksize):  # one PUT, as s3fs sends it
            if max_concurrency is not None:  # named only when set: older s3fs releases take neither
                kwargs["max_concurrency"] = max_concurrency
            if mode != "overwrite":
                kwargs["mode"] = mode
            return await super()._pipe_file(path, data, chunksize=chunksize, **kwargs)
        bucket, key, _version = self.split_path(path)
        out = await upload_multipart(
            self,
            bucket,
            key,
            data,
            chunksize=chunksize,
            concurrency=max_concurrency or self.max_concurrency,
            create_kwargs=kwargs,
            complete_kwargs={"IfNoneMatch": "*"} if mode == "create" else {},
        )
        self.invalidate_cache(path)
        return out


async def upload_multipart(
    fs: Any,
    bucket: str,
    key: str,
    data: bytes | bytearray,
    *,
    chunksize: int,
    concurrency: int,
    create_kwargs: dict[str, Any] | None = None,
    complete_kwargs: dict[str, Any] | None = None,
) -> Any:
    """Upload ``data`` as object ``key`` in parts of ``chunksize`` bytes, ``concurrency`` at a time; the
    ``CompleteMultipartUpload`` answer. On failure or cancellation the upload is aborted first
    (:func:`_abort_after`), then the error (or the cancellation) propagates."""
    mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key, **(create_kwargs or {}))
    upload_id = mpu["UploadId"]
    try:
        etags = await _upload_parts(fs, bucket, key, upload_id, data, chunksize, concurrency)
        parts = [{"PartNumber": number, "ETag": etag} for number, etag in enumerate(etags, 1)]
        return await fs._call_s3(
            "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
            MultipartUpload={"Parts": parts}, **(complete_kwargs or {}),
        )
    except (Exception, asyncio.CancelledError):
        await _abort_after(fs, bucket, key, upload_id)
        raise


async def _upload_parts(
    fs: Any, bucket: str, key: str, upload_id: str, data: bytes | bytearray, chunksize: int, concurrency: int
) -> list[str]:
    """The parts' ETags in order. ``concurrency`` workers take the parts in turn (not one task per part:
    an object may have thousands); the first failure cancels the rest."""
    starts = range(0, len(data), chunksize)
    etags = [""] * len(starts)
    todo = iter(enumerate(starts))

    async def worker() -> None:
        for i, start in todo:
            out = await fs._call_s3(
                "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 1,
                Body=data[start : start + chunksize],
            )
            etags[i] = out["ETag"]

    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(min(concurrency, len(starts))):
                tg.create_task(worker())
    except* Exception as group:
        failed = first_leaf(group)
        raise failed from failed.__cause__  # the part's error as s3fs raised it (a botocore error its cause)
    return etags


async def _abort_after(fs: Any, bucket: str, key: str, upload_id: str) -> None:
    """Abort the upload of a write that failed or was cancelled, shielded: cancelled again while it waits,
    the caller goes at once and the abort runs on (bounded by :data:`ABORT_TIMEOUT_S` all the same)."""
    if lacks(fs, MULTIPART_LISTING):  # refused before (warned then): retention and gc cannot either
        return
    task = asyncio.get_running_loop().create_task(_abort(fs, bucket, key, upload_id))
    _aborts.add(task)
    task.add_done_callback(_aborts.discard)
    await asyncio.shield(task)


async def _abort(fs: Any, bucket: str, key: str, upload_id: str) -> None:
    """One ``AbortMultipartUpload``, best effort: never raises (the write's own error is what counts)."""
    url = f"s3://{bucket}/{key}"
    within = asyncio.timeout(ABORT_TIMEOUT_S)
    try:
        async with within:
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception as exc:
        if within.expired():
            logger.warning("%s: the abort of the failed write's multipart upload took over %.0f s and was given "
                           "up: its parts stay until retention or gc aborts it", url, ABORT_TIMEOUT_S)
        elif error_code(exc) == "NoSuchUpload":  # completed (the answer lost) or aborted meanwhile
            pass
        elif not_implemented(exc) or error_code(exc) == "AccessDenied":
            mark_lacking(fs, MULTIPART_LISTING, exc)  # warned once per endpoint
        else:
            logger.warning("%s: the failed write's multipart upload could not be aborted (%s): its parts stay "
                           "until retention or gc aborts it", url, classify_error(exc, url))
        return
    logger.info("%s: write failed or cancelled: its multipart upload was aborted", url)
