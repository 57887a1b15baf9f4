"""S3 storage for the writer: an async ``s3fs`` filesystem with bounded retries, typed errors, GC helpers.

Retries happen in two layers, both bounded here:

* botocore retries every request (``retry_mode`` standard/adaptive, ``max_attempts`` in total) on 5xx,
  throttling codes (``SlowDown``, ``Throttling``, ...; a 429 whose code is not one of them is *not*
  retried), connection errors and timeouts, with jittered exponential backoff (``rand·2^n`` seconds,
  at most 20 s) and a client-wide retry quota;
* s3fs wraps each call in its own loop of ``fs_retries`` attempts for what botocore does not retry (a
  body cut off while being read) and retries ``SlowDown`` again after botocore gives up.

So one logical operation costs at most ``fs_retries * max_attempts`` HTTP requests.

Credentials come from the standard AWS chain (environment, profile, container/instance metadata);
nothing here reads or logs them, and :func:`classify_error` scrubs anything key-like from messages.
The filesystem must be created inside the running event loop that will use it (fsspec async instances
bind to the loop that made them); :func:`open_s3_filesystem` enforces that.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec
import s3fs
from zarr.storage import FsspecStore

from ckptd.writer.backends import Backend, Capabilities, RetryMetrics
from ckptd.writer.backends.s3_cleanup import abort_incomplete_uploads, delete_one_by_one
from ckptd.writer.backends.s3_compat import (
    BATCH_DELETE,
    CONDITIONAL_PUT,
    endpoint_of,
    lacks,
    mark_lacking,
    not_implemented,
    probe_conditional_put,
)
from ckptd.writer.backends.s3_errors import (
    classify_error,
    count_fault,
    count_retry,
    describe_location,
    error_code,
    error_status,
    split_s3_url,
    treat_429_as_throttling,
)
from ckptd.writer.backends.s3_multipart import CkptdS3FileSystem
from ckptd.writer.backends.s3_read import newest_modified, read_range_into
from ckptd.writer.errors import (
    CkptdError,
    ConfigError,
    StorageError,
    StorageNotFoundError,
)

__all__ = [
    "S3Backend",
    "S3Options",
    "abort_incomplete_uploads",
    "check_bucket",
    "classify_error",
    "close_s3_filesystem",
    "open_s3_filesystem",
    "put_if_absent",
    "split_s3_url",
]

logger = logging.getLogger(__name__)


class S3Options(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to reach S3 (or an S3-compatible endpoint). Credentials are deliberately not part of it.

    Attributes
    ----------
    endpoint_url:
        Custom endpoint (``http://127.0.0.1:9000``, MinIO, Ceph...); ``None`` for AWS.
    region:
        Region name; ``None`` lets botocore resolve it (``AWS_REGION``, profile).
    profile:
        Named profile from the shared AWS config; ``None`` for the default chain.
    addressing_style:
        ``"path"`` for most S3-compatible servers and IP endpoints, ``"virtual"`` for AWS, or ``"auto"``.
    retry_mode:
        botocore retry mode; ``"adaptive"`` also rate-limits the client when throttled.
    max_attempts:
        Total HTTP attempts per request in botocore (the first one included).
    fs_retries:
        Attempts of s3fs's outer retry loop (see the module docstring).
    connect_timeout, read_timeout:
        Per-attempt socket timeouts in seconds.
    max_pool_connections:
        Connection pool size: the upper bound on concurrent requests of one filesystem.
    multipart_concurrency:
        Parts uploaded at once by one multipart upload.
    anonymous:
        Send unsigned requests (public buckets only).
    request_checksums:
        ``"when_supported"`` (botocore's default) sends a CRC32 of every upload body, which the server
        verifies; ``"when_required"`` skips it to save client CPU (bodies then rely on TCP alone).
    conditional_put:
        Write commit markers with ``If-None-Match: *`` (see :func:`put_if_absent`). Turn it off only
        for endpoints that silently ignore the header; racing coordinators are then not excluded.
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: Literal["auto", "virtual", "path"] = "auto"
    retry_mode: Literal["standard", "adaptive"] = "standard"
    max_attempts: int = 5
    fs_retries: int = 3
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    max_pool_connections: int = 32
    multipart_concurrency: int = 8
    anonymous: bool = False
    request_checksums: Literal["when_supported", "when_required"] = "when_supported"
    conditional_put: bool = True

    def __post_init__(self) -> None:
        # also for direct construction, which msgspec does not validate
        if self.addressing_style not in ("auto", "virtual", "path"):
            raise ConfigError(f"addressing_style must be auto, virtual or path: {self.addressing_style!r}")
        if self.request_checksums not in ("when_supported", "when_required"):
            raise ConfigError(
                f"request_checksums must be when_supported or when_required: {self.request_checksums!r}"
            )
        if self.retry_mode not in ("standard", "adaptive"):
            raise ConfigError(f"retry_mode must be standard or adaptive: {self.retry_mode!r}")
        for name in ("max_attempts", "fs_retries", "max_pool_connections", "multipart_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> S3Options:
        """Build from already-typed values (config file, settings, API); ``None`` means "not given".

        Types are strict (``"3"`` is not an int: text goes through :meth:`typed_from_text` first);
        unknown keys, wrong types and values out of range raise :class:`ConfigError`.
        """
        return cls._convert({k: v for k, v in values.items() if v is not None}, strict=True)

    @classmethod
    def typed_from_text(cls, values: Mapping[str, str]) -> dict[str, Any]:
        """The typed values of options given as text (``--storage-option KEY=VALUE``, environment):
        ``"false"`` -> ``False``, ``"2"`` -> ``2``; :class:`ConfigError` if one does not parse."""
        converted = cls._convert(values, strict=False)
        return {k: getattr(converted, k) for k in values}

    @classmethod
    def _convert(cls, values: Mapping[str, Any], *, strict: bool) -> S3Options:
        unknown = sorted(set(values) - set(cls.__struct_fields__))
        if unknown:
            raise ConfigError(f"unknown S3 options {unknown}; known: {sorted(cls.__struct_fields__)}")
        try:
            return msgspec.convert(dict(values), cls, strict=strict)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid S3 option: {exc}") from exc

    @property
    def worst_case_requests(self) -> int:
        """HTTP requests one logical operation may cost before it fails."""
        return self.max_attempts * self.fs_retries


class S3Backend(Backend):
    """A prefix of an S3 bucket (or an S3-compatible endpoint) through an async ``s3fs`` filesystem.

    The backend owns its filesystem (closed by :meth:`close`) and the retry counters its requests fill
    (:attr:`metrics`). ``create`` is a conditional PUT (atomic) unless ``conditional_put`` is off.
    """

    def __init__(self, url: str, fs: s3fs.S3FileSystem, options: S3Options, metrics: RetryMetrics) -> None:
        bucket, prefix = split_s3_url(url)
        self._path = f"{bucket}/{prefix}".rstrip("/")
        capabilities = Capabilities(
            atomic_create=options.conditional_put, needs_fsync=False, multipart_cleanup=True
        )
        super().__init__(url, FsspecStore(fs, path=self._path, read_only=False), capabilities)
        self.fs = fs
        self.options = options
        self.metrics = metrics

    @classmethod
    async def open(cls, url: str, options: Mapping[str, Any] | S3Options | None = None) -> S3Backend:
        """Open the filesystem in the running loop and check the bucket (one HEAD): a missing bucket
        or denied access fails here, typed."""
        opts = options if isinstance(options, S3Options) else S3Options.from_mapping(options or {})
        metrics = RetryMetrics()
        fs = await open_s3_filesystem(url, opts, metrics)
        try:
            await check_bucket(fs, url)
        except BaseException:
            await close_s3_filesystem(fs)
            raise
        if not opts.conditional_put:
            logger.warning(
                "%s: conditional_put is off: commit markers are written check-then-put, which does not "
                "exclude a racing coordinator", describe_location(url),
            )
        return cls(url, fs, opts, metrics)

    async def create(self, key: str, data: bytes) -> bool:
        if self.options.conditional_put:
            await probe_conditional_put(self.fs, self._path)
        return await put_if_absent(self.fs, f"{self._path}/{key}", data, conditional=self.options.conditional_put)

    async def put_body(self, key: str, body: bytearray) -> None:
        """The bytearray goes out as the request body, without the copies of zarr's ``Buffer`` round trip."""
        try:
            await self.fs._pipe_file(f"{self._path}/{key}", body)
        except Exception as exc:
            raise self.error(exc) from exc

    async def read_into(self, key: str, start: int, bufs: Sequence[memoryview]) -> tuple[int, int | None]:
        """One ranged GET whose body is read straight into ``bufs`` (:func:`~.s3_read.read_range_into`)."""
        return await read_range_into(self.fs, f"{self._path}/{key}", start, bufs, self.url)

    async def delete(self, key: str) -> None:
        """One ``DeleteObject``: a refusal is an error. (A batch ``DeleteObjects``, what the store's delete
        sends, answers 200 with the key's refusal inside, which s3fs drops: a marker "deleted" that stays.)"""
        bucket, path, _version = self.fs.split_path(f"{self._path}/{key}")
        try:
            await self.fs._call_s3("delete_object", Bucket=bucket, Key=path)
        except Exception as exc:
            raise self.error(exc) from exc
        self.fs.invalidate_cache(f"{bucket}/{path}")

    async def delete_prefix(self, prefix: str) -> None:
        """Batch deletes (``DeleteObjects``) where the server has them, else one DELETE per object."""
        if not lacks(self.fs, BATCH_DELETE):
            try:
                await super().delete_prefix(prefix)
                return
            except StorageError as exc:
                if not not_implemented(exc):
                    raise
                mark_lacking(self.fs, BATCH_DELETE, exc)
        await delete_one_by_one(self.fs, f"{self._path}/{prefix}".rstrip("/"))

    async def newest_write(self, prefix: str) -> float | None:
        return await newest_modified(self.fs, f"{self._path}/{prefix}".rstrip("/"), self.url)

    async def abort_uploads(self, prefix: str) -> int:
        bucket, _, base = self._path.partition("/")
        key_prefix = f"{base}/{prefix}".strip("/") + "/"
        return await abort_incomplete_uploads(self.fs, bucket, key_prefix)

    def error(self, exc: BaseException) -> CkptdError:
        return classify_error(exc, self.url)

    async def close(self) -> None:
        await close_s3_filesystem(self.fs)


async def open_s3_filesystem(
    url: str, options: S3Options, metrics: RetryMetrics | None = None
) -> s3fs.S3FileSystem:
    """An ``s3fs.S3FileSystem(asynchronous=True)`` for ``url``'s bucket, bound to the running loop (a
    :class:`~.s3_multipart.CkptdS3FileSystem`: a failed or cancelled multipart write aborts its upload).

    The client is created here (``set_session``), so a missing or broken credential chain fails now
    with :class:`StoragePermissionError` rather than on the first write. The bucket itself is not
    contacted; use :func:`check_bucket` for that. Close the result with :func:`close_s3_filesystem`.
    Retries and faults of its requests are counted into ``metrics``.
    """
    loop = asyncio.get_running_loop()  # RuntimeError outside a loop: the fs would bind to the wrong one
    bucket, prefix = split_s3_url(url)
    config_kwargs: dict[str, Any] = {
        "retries": {"mode": options.retry_mode, "total_max_attempts": options.max_attempts},
        "connect_timeout": options.connect_timeout,
        "read_timeout": options.read_timeout,
        "max_pool_connections": options.max_pool_connections,
        "s3": {"addressing_style": options.addressing_style},
        "request_checksum_calculation": options.request_checksums,
    }
    client_kwargs: dict[str, Any] = {}
    if options.region:
        client_kwargs["region_name"] = options.region
    session_kwargs: dict[str, Any] = {}
    if options.profile:
        session_kwargs["profile"] = options.profile  # s3fs hands extra kwargs to AioSession
    fs = CkptdS3FileSystem(  # a failed or cancelled multipart write aborts its upload (s3_multipart)
        asynchronous=True,
        loop=loop,
        skip_instance_cache=True,
        use_listings_cache=False,  # other nodes write under the same prefix: never trust a cached listing
        anon=options.anonymous,
        endpoint_url=options.endpoint_url,
        client_kwargs=client_kwargs,
        config_kwargs=config_kwargs,
        max_concurrency=options.multipart_concurrency,
        **session_kwargs,
    )
    fs.retries = options.fs_retries  # instance override of s3fs's class default (5)
    try:
        client = await fs.set_session()
    except Exception as exc:
        raise classify_error(exc, url) from exc
    # what botocore resolved, the environment's or a profile's endpoint included: capability flags are kept
    # per endpoint (s3_compat), and the option alone says "AWS" for an endpoint set in the environment
    fs.resolved_endpoint = client.meta.endpoint_url
    logger.debug(
        "opened S3 filesystem for s3://%s/%s endpoint=%s region=%s retries=%s*%s timeouts=%s/%s",
        bucket,
        prefix,
        endpoint_of(fs),
        client.meta.region_name,
        options.retry_mode,
        options.max_attempts,
        options.connect_timeout,
        options.read_timeout,
    )
    counters = metrics if metrics is not None else RetryMetrics()
    client.meta.events.register_first("needs-retry.s3", treat_429_as_throttling)
    client.meta.events.register_first("needs-retry.s3", functools.partial(count_fault, counters))
    client.meta.events.register("request-created.s3", functools.partial(count_retry, counters))
    return fs


async def close_s3_filesystem(fs: s3fs.S3FileSystem) -> None:
    """Close the HTTP client of a filesystem made by :func:`open_s3_filesystem` (idempotent)."""
    creator = getattr(fs, "_s3creator", None)
    if creator is None or getattr(fs, "_s3", None) is None:
        return
    fs._s3 = None
    await creator.__aexit__(None, None, None)


async def check_bucket(fs: s3fs.S3FileSystem, url: str) -> None:
    """Fail fast unless ``url``'s bucket exists and the credentials may use it (one HEAD request)."""
    bucket, _prefix = split_s3_url(url)
    try:
        await fs._call_s3("head_bucket", Bucket=bucket)
    except Exception as exc:
        raise classify_error(exc, url) from exc



async def put_if_absent(fs: s3fs.S3FileSystem, path: str, data: bytes, *, conditional: bool = True) -> bool:
    """Create object ``path`` (``bucket/key``) holding ``data`` only if it does not exist yet.

    Uses a conditional PUT (``If-None-Match: *``): atomic on AWS S3 and on moto (which also honours
    it on CompleteMultipartUpload). Returns ``True`` if the object now holds ``data`` because of this
    call, ``False`` if another writer created it first with different bytes. A retried PUT whose first
    attempt landed but whose response was lost gets a 412 on the retry: the stored bytes are then read
    back and compared, so it still reports ``True`` (equally if another writer stored identical bytes).
    Meant for small markers: ``data`` is sent in one PUT.

    Endpoints that ignore ``If-None-Match`` silently overwrite; for those pass ``conditional=False``,
    which checks existence first and is *not* atomic (two writers may both get ``True``).
    """
    bucket, key, _version = fs.split_path(path)
    url = f"s3://{bucket}/{key}"
    if not conditional or lacks(fs, CONDITIONAL_PUT):
        if await _exists(fs, bucket, key, url):
            return await _holds(fs, bucket, key, data, url)
        await _put(fs, bucket, key, data, url)
        return True
    for attempt in range(5):
        try:
            await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except Exception as exc:
            code, status = error_code(exc), error_status(exc)
            if code == "PreconditionFailed" or status == 412 or isinstance(exc, FileExistsError):
                return await _holds(fs, bucket, key, data, url)
            if not_implemented(exc):
                mark_lacking(fs, CONDITIONAL_PUT, exc)
                return await put_if_absent(fs, path, data, conditional=False)
            if code == "ConditionalRequestConflict" or status == 409:
                await asyncio.sleep(0.1 * 2**attempt)  # a concurrent conditional write is in progress
                continue
            raise classify_error(exc, url) from exc
    raise StorageError(f"conditional PUT of {url} kept conflicting with concurrent writers")



async def _put(fs: s3fs.S3FileSystem, bucket: str, key: str, data: bytes, url: str) -> None:
    try:
        await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data)
    except Exception as exc:
        raise classify_error(exc, url) from exc


async def _exists(fs: s3fs.S3FileSystem, bucket: str, key: str, url: str) -> bool:
    try:
        await fs._call_s3("head_object", Bucket=bucket, Key=key)
    except Exception as exc:
        err = classify_error(exc, url)
        if isinstance(err, StorageNotFoundError) and error_code(exc) != "NoSuchBucket":
            return False
        raise err from exc
    return True


async def _holds(fs: s3fs.S3FileSystem, bucket: str, key: str, data: bytes, url: str) -> bool:
    try:
        stored = await fs._cat_file(f"{bucket}/{key}")
    except Exception as exc:
        raise classify_error(exc, url) from exc
    return bytes(stored) == data

