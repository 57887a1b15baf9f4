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
import dataclasses
import functools
import logging
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from urllib.parse import urlparse

import s3fs
from zarr.storage import FsspecStore

from ckptd.writer.errors import (
    CkptdError,
    InvalidRequestError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)

__all__ = [
    "S3Metrics",
    "S3Options",
    "abort_incomplete_uploads",
    "check_bucket",
    "classify_error",
    "close_s3_filesystem",
    "open_s3_filesystem",
    "open_s3_store",
    "put_if_absent",
    "s3_metrics",
    "s3_options",
    "split_s3_url",
]

logger = logging.getLogger(__name__)

_NOT_FOUND_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "NotFound", "404", "NoSuchUpload"})
_PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidAccessKeyId",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidToken",
        "TokenRefreshRequired",
        "UnrecognizedClientException",
        "InvalidSecurity",
    }
)
# exception class names from botocore's credential chain (matched by name: several are optional there)
_CREDENTIAL_ERRORS = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "ProfileNotFound",
        "NoAuthTokenError",
        "UnauthorizedSSOTokenError",
        "SSOTokenLoadError",
        "TokenRetrievalError",
    }
)
_SECRET_PATTERNS = [
    re.compile(r"\b(?:AKIA|ASIA|AROA|AIDA)[A-Z0-9]{12,}\b"),
    re.compile(r"(?i)(x-amz-(?:credential|signature|security-token)=)[^&\s\"']+"),
    re.compile(
        r"(?i)((?:signature|credential|awsaccesskeyid|aws_secret_access_key|secret)\s*[=:]\s*)[^,&\s\"']+"
    ),
]
_ABORT_CONCURRENCY = 8
# codes botocore's standard retry mode already treats as throttling (botocore.retries.standard)
_THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "TransactionInProgressException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",
        "PriorRequestNotComplete",
        "EC2ThrottledException",
    }
)


@dataclass(frozen=True, slots=True)
class S3Options:
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
        if self.addressing_style not in ("auto", "virtual", "path"):
            raise InvalidRequestError(
                f"addressing_style must be auto, virtual or path: {self.addressing_style!r}"
            )
        if self.request_checksums not in ("when_supported", "when_required"):
            raise InvalidRequestError(
                f"request_checksums must be when_supported or when_required: {self.request_checksums!r}"
            )
        if self.retry_mode not in ("standard", "adaptive"):
            raise InvalidRequestError(f"retry_mode must be standard or adaptive: {self.retry_mode!r}")
        for name in ("max_attempts", "fs_retries", "max_pool_connections", "multipart_concurrency"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> S3Options:
        """Build from a plain mapping (config file, CLI); unknown keys are an error, not ignored.

        Strings are converted to the field's type (CLI flags and environment values arrive as text);
        ``None`` means "not given".
        """
        kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(kinds))
        if unknown:
            raise InvalidRequestError(f"unknown S3 options {unknown}; known: {sorted(kinds)}")
        given = {k: _coerce_option(k, kinds[k], v) for k, v in values.items() if v is not None}
        return cls(**given)

    @property
    def worst_case_requests(self) -> int:
        """HTTP requests one logical operation may cost before it fails."""
        return self.max_attempts * self.fs_retries


@dataclass
class S3Metrics:
    """What one filesystem's HTTP client went through: retried attempts and the faults that caused them.

    ``faults`` counts failed attempts by S3 error code (``SlowDown``, ``Throttling``, ``InternalError``)
    or exception class (``ConnectionClosedError``, ``ReadTimeoutError``); only 5xx, 429 and connection
    failures count, not ordinary answers such as a 404 to an existence check.
    """

    retries: int = 0
    faults: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> S3Metrics:
        return S3Metrics(self.retries, Counter(self.faults))

    def since(self, earlier: S3Metrics) -> S3Metrics:
        return S3Metrics(self.retries - earlier.retries, self.faults - earlier.faults)

    def describe(self) -> str:
        kinds = ",".join(f"{k}:{n}" for k, n in sorted(self.faults.items()))
        return f"{self.retries}" + (f" ({kinds})" if kinds else "")


def s3_metrics(fs: Any) -> S3Metrics | None:
    """The retry counters of a filesystem made by :func:`open_s3_filesystem` (``None`` for others)."""
    metrics = getattr(fs, "ckptd_metrics", None)
    return metrics if isinstance(metrics, S3Metrics) else None


def s3_options(fs: Any) -> S3Options | None:
    """The options a filesystem made by :func:`open_s3_filesystem` was opened with."""
    options = getattr(fs, "ckptd_options", None)
    return options if isinstance(options, S3Options) else None


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``; raise :class:`InvalidRequestError` otherwise."""
    parsed = urlparse(url)
    if parsed.scheme not in ("s3", "s3a") or not parsed.netloc:
        raise InvalidRequestError(f"not an s3:// URL: {_scrub(url)!r}")
    return parsed.netloc, parsed.path.strip("/")


async def open_s3_filesystem(url: str, options: S3Options) -> s3fs.S3FileSystem:
    """An ``s3fs.S3FileSystem(asynchronous=True)`` for ``url``'s bucket, bound to the running loop.

    The client is created here (``set_session``), so a missing or broken credential chain fails now
    with :class:`StoragePermissionError` rather than on the first write. The bucket itself is not
    contacted; use :func:`check_bucket` for that. Close the result with :func:`close_s3_filesystem`.
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
    fs = s3fs.S3FileSystem(
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
    logger.debug(
        "opening S3 filesystem for s3://%s/%s endpoint=%s region=%s retries=%s*%s timeouts=%s/%s",
        bucket,
        prefix,
        options.endpoint_url or "aws",
        options.region or "default",
        options.retry_mode,
        options.max_attempts,
        options.connect_timeout,
        options.read_timeout,
    )
    try:
        client = await fs.set_session()
    except Exception as exc:
        raise classify_error(exc, url) from exc
    metrics = S3Metrics()
    client.meta.events.register_first("needs-retry.s3", _treat_429_as_throttling)
    client.meta.events.register_first("needs-retry.s3", functools.partial(_count_fault, metrics))
    client.meta.events.register("request-created.s3", functools.partial(_count_retry, metrics))
    fs.ckptd_metrics = metrics
    fs.ckptd_options = options
    return fs


async def close_s3_filesystem(fs: s3fs.S3FileSystem) -> None:
    """Close the HTTP client of a filesystem made by :func:`open_s3_filesystem` (idempotent)."""
    creator = getattr(fs, "_s3creator", None)
    if creator is None or getattr(fs, "_s3", None) is None:
        return
    fs._s3 = None
    await creator.__aexit__(None, None, None)


async def open_s3_store(root: str, options: Mapping[str, Any] | S3Options | None = None) -> FsspecStore:
    """A zarr ``FsspecStore`` at ``root`` (``s3://bucket/prefix``) over :func:`open_s3_filesystem`."""
    opts = options if isinstance(options, S3Options) else S3Options.from_mapping(options or {})
    bucket, prefix = split_s3_url(root)
    fs = await open_s3_filesystem(root, opts)
    return FsspecStore(fs, path=f"{bucket}/{prefix}".rstrip("/"), read_only=False)


async def check_bucket(fs: s3fs.S3FileSystem, url: str) -> None:
    """Fail fast unless ``url``'s bucket exists and the credentials may use it (one HEAD request)."""
    bucket, _prefix = split_s3_url(url)
    try:
        await fs._call_s3("head_bucket", Bucket=bucket)
    except Exception as exc:
        raise classify_error(exc, url) from exc


def classify_error(exc: BaseException, url: str) -> CkptdError:
    """Map an exception from botocore/aiobotocore/s3fs to ckptd's typed storage errors.

    :class:`StorageNotFoundError` for a missing bucket/object, :class:`StoragePermissionError` for
    denied access, unknown or wrong keys and missing credentials, :class:`StorageError` for the rest
    (including transient faults that outlived their retries). The message names the bucket and
    prefix, the S3 error code and HTTP status, never a credential. Already-typed errors pass through.
    The caller should ``raise classify_error(exc, url) from exc``.
    """
    if isinstance(exc, CkptdError):
        return exc
    where = _where(url)
    for err in _chain(exc):
        if type(err).__name__ in _CREDENTIAL_ERRORS:
            return StoragePermissionError(
                f"no usable AWS credentials for {where} ({type(err).__name__}): "
                "configure the standard AWS chain (environment, profile or instance role)"
            )
        response = getattr(err, "response", None)
        if isinstance(response, Mapping) and isinstance(response.get("Error"), Mapping):
            code = str(response["Error"].get("Code") or "")
            message = _scrub(str(response["Error"].get("Message") or ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            detail = f"{code or 'error'}, HTTP {status}" + (f": {message}" if message else "")
            if code in _NOT_FOUND_CODES or status == 404:
                what = "bucket does not exist" if code == "NoSuchBucket" else "not found"
                return StorageNotFoundError(f"{what}: {where} ({detail})")
            if code in _PERMISSION_CODES or status == 403:
                return StoragePermissionError(f"access denied to {where} ({detail})")
            return StorageError(f"S3 request failed for {where} ({detail})")
    name = type(exc).__name__
    text = _scrub(str(exc))
    if isinstance(exc, FileNotFoundError):
        return StorageNotFoundError(f"not found: {where} ({name}: {text})")
    if isinstance(exc, PermissionError):
        return StoragePermissionError(f"access denied to {where} ({name}: {text})")
    return StorageError(f"S3 operation failed for {where} ({name}: {text})")


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
                if isinstance(err, StorageNotFoundError) and _error_code(exc) == "NoSuchUpload":
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
        try:
            page = await fs._call_s3("list_multipart_uploads", **kwargs)
        except Exception as exc:
            raise classify_error(exc, url) from exc
        todo = [
            (u["Key"], u["UploadId"])
            for u in page.get("Uploads", [])
            if initiated_before is None or u["Initiated"] < initiated_before
        ]
        async with asyncio.TaskGroup() as tg:  # the first failure cancels the rest
            for key, upload_id in todo:
                tg.create_task(abort(key, upload_id))
        if not page.get("IsTruncated"):
            break
        key_marker, upload_marker = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
    if aborted:
        logger.info("aborted %d incomplete multipart uploads under %s", aborted, url)
    return aborted


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
    if not conditional:
        if await _exists(fs, bucket, key, url):
            return await _holds(fs, bucket, key, data, url)
        await _put(fs, bucket, key, data, url)
        return True
    for attempt in range(5):
        try:
            await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except Exception as exc:
            code, status = _error_code(exc), _error_status(exc)
            if code == "PreconditionFailed" or status == 412 or isinstance(exc, FileExistsError):
                return await _holds(fs, bucket, key, data, url)
            if code == "NotImplemented" or status == 501:
                logger.warning(
                    "%s: the endpoint rejects conditional PUTs (If-None-Match); falling back to a "
                    "check-then-put, which does not exclude a racing writer",
                    _where(url),
                )
                return await put_if_absent(fs, path, data, conditional=False)
            if code == "ConditionalRequestConflict" or status == 409:
                await asyncio.sleep(0.1 * 2**attempt)  # a concurrent conditional write is in progress
                continue
            raise classify_error(exc, url) from exc
    raise StorageError(f"conditional PUT of {url} kept conflicting with concurrent writers")


# --- internals ------------------------------------------------------------------------------------
def _coerce_option(name: str, kind: str, value: Any) -> Any:
    if not isinstance(value, str) or kind not in ("int", "float", "bool"):
        return value
    if kind == "bool":
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise InvalidRequestError(f"S3 option {name} must be true or false, got {value!r}")
    try:
        return int(value) if kind == "int" else float(value)
    except ValueError:
        raise InvalidRequestError(f"S3 option {name} must be a number, got {value!r}") from None


def _count_retry(metrics: S3Metrics, request: Any = None, **_kwargs: Any) -> None:
    """``request-created`` runs once per attempt; attempts after the first are retries."""
    context = getattr(request, "context", None) or {}
    attempt = context.get("retries", {}).get("attempt", 1)
    if attempt > 1:
        metrics.retries += 1


def _count_fault(
    metrics: S3Metrics, response: Any = None, caught_exception: BaseException | None = None, **_kwargs: Any
) -> None:
    """Runs on ``needs-retry`` after every attempt; counts the failures a retry may follow."""
    if caught_exception is not None:
        metrics.faults[type(caught_exception).__name__] += 1
        logger.debug("S3 attempt failed: %s", type(caught_exception).__name__)
        return
    if not isinstance(response, tuple) or len(response) != 2:
        return
    http, parsed = response
    status = getattr(http, "status_code", None)
    if isinstance(status, int) and (status >= 500 or status == 429):
        error = parsed.get("Error", {}) if isinstance(parsed, dict) else {}
        code = str(error.get("OriginalCode") or error.get("Code") or status)
        metrics.faults[code] += 1
        logger.debug("S3 attempt failed: HTTP %s %s", status, code)


def _treat_429_as_throttling(response: Any = None, **_kwargs: Any) -> None:
    """Make botocore retry every HTTP 429, not only those whose error code it knows.

    botocore's standard and adaptive modes retry 500/502/503/504 by status but 429 only by error
    code (``Throttling``, ``SlowDown``...): a 429 answered to a HEAD (no body, so the code is just
    ``"429"``) or with another code (``TooManyRequests``) fails at once. Runs first on
    ``needs-retry`` and renames such codes to ``Throttling``, so the regular handler retries them with
    throttling backoff, attempt limit and retry quota. Returns ``None``: it never decides itself.
    """
    if not isinstance(response, tuple) or len(response) != 2:
        return
    http, parsed = response
    if getattr(http, "status_code", None) != 429 or not isinstance(parsed, dict):
        return
    error = parsed.setdefault("Error", {})
    if error.get("Code") not in _THROTTLING_CODES:
        error["OriginalCode"] = error.get("Code")
        error["Code"] = "Throttling"


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
        if isinstance(err, StorageNotFoundError) and _error_code(exc) != "NoSuchBucket":
            return False
        raise err from exc
    return True


async def _holds(fs: s3fs.S3FileSystem, bucket: str, key: str, data: bytes, url: str) -> bool:
    try:
        stored = await fs._cat_file(f"{bucket}/{key}")
    except Exception as exc:
        raise classify_error(exc, url) from exc
    return bytes(stored) == data


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        err = todo.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo.extend(e for e in (err.__cause__, err.__context__) if e is not None)


def _client_response(exc: BaseException) -> Mapping[str, Any] | None:
    for err in _chain(exc):
        response = getattr(err, "response", None)
        if isinstance(response, Mapping) and isinstance(response.get("Error"), Mapping):
            return response
    return None


def _error_code(exc: BaseException) -> str | None:
    response = _client_response(exc)
    return None if response is None else str(response["Error"].get("Code") or "")


def _error_status(exc: BaseException) -> int | None:
    response = _client_response(exc)
    if response is None:
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def _where(url: str) -> str:
    try:
        bucket, prefix = split_s3_url(url)
    except InvalidRequestError:
        return _scrub(url)
    return f"bucket {bucket!r}, prefix {prefix!r} (s3://{bucket}/{prefix})"


def _scrub(text: str) -> str:
    """Remove anything that looks like a credential or a signature from ``text``."""
    text = _SECRET_PATTERNS[0].sub("<redacted>", text)
    for pattern in _SECRET_PATTERNS[1:]:
        text = pattern.sub(r"\1<redacted>", text)
    return text
