"""Configuration, resolved once at the edge: defaults < TOML file < ``CKPTD_*`` environment < CLI flags.

One loader serves every subcommand: :func:`load_config` for ``ckptd serve``, :func:`load_storage_options`
for the offline commands (``ls``, ``verify``, ``gc``, ``merge``), which need only the storage options but
validate the whole file the same way. The schema is a pydantic-settings model: types, ranges and unknown
keys are checked by it, and every failure is a :class:`~ckptd.writer.errors.ConfigError`.

The TOML file holds the daemon options at top level or in a ``[daemon]`` table (not both), and the
storage options in a ``[storage]`` table. Environment variables are ``CKPTD_<OPTION>`` for daemon options
and ``CKPTD_STORAGE_<KEY>`` for storage options. The environment is passed in, never read here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from ckptd.client.paths import default_socket_path
from ckptd.client.storage_env import read_config_file
from ckptd.writer.arrays import CODECS
from ckptd.writer.errors import ConfigError
from ckptd.writer.format import DEFAULT_CHUNK_BYTES

__all__ = [
    "DaemonConfig",
    "OfflineConfig",
    "StorageOptions",
    "load_config",
    "load_storage_options",
    "parse_size",
]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DAEMON_TABLE = "daemon"
_STORAGE_TABLE = "storage"


def parse_size(value: str | int) -> int:
    """``"4GiB"``, ``"512M"``, ``"1048576"`` -> bytes (binary units); :class:`ConfigError` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if not m:
        raise ConfigError(f"cannot parse size {value!r}; use e.g. 512MiB or 4GiB")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * _UNITS[unit])


Size = Annotated[int, BeforeValidator(parse_size)]


class StorageOptions(BaseModel):
    """The ``[storage]`` table: how to reach S3. ``None`` means "not given" (the backend's default applies).

    The keys and their meaning are those of :class:`ckptd.writer.backends.s3.S3Options`; credentials are never
    options (they come from the AWS chain).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: Literal["auto", "virtual", "path"] | None = None
    retry_mode: Literal["standard", "adaptive"] | None = None
    max_attempts: int | None = Field(default=None, ge=1)
    fs_retries: int | None = Field(default=None, ge=1)
    connect_timeout: float | None = Field(default=None, gt=0)
    read_timeout: float | None = Field(default=None, gt=0)
    max_pool_connections: int | None = Field(default=None, ge=1)
    multipart_concurrency: int | None = Field(default=None, ge=1)
    anonymous: bool | None = None
    request_checksums: Literal["when_supported", "when_required"] | None = None
    conditional_put: bool | None = None

    def given(self) -> dict[str, object]:
        """The options that were set, as typed values (the mapping the storage backends take)."""
        return self.model_dump(exclude_none=True)


MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path on Linux: 108 bytes with the terminating NUL


class _Options(BaseSettings):
    """Every daemon option but ``root``; shared by the serve and offline views of the same file."""

    model_config = SettingsConfigDict(
        env_prefix="CKPTD_",
        env_nested_delimiter="_",
        env_nested_max_split=1,  # CKPTD_STORAGE_ENDPOINT_URL -> storage.endpoint_url
        case_sensitive=False,
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,  # every duration is a finite number of seconds
    )

    socket: str = Field(default_factory=lambda: default_socket_path(os.environ))
    arena_size: Size = Field(default=2 << 30, gt=0)
    write_concurrency: int = Field(default=8, gt=0)
    chunk_bytes: Size = Field(default=DEFAULT_CHUNK_BYTES, ge=4 << 10)  # below: a file per few elements
    # small arrays a node holds whole -> one object; None: 1MiB on S3, off locally
    pack_bytes: Size | None = Field(default=None, ge=0)
    codec: str = "raw"
    keep: int = Field(default=0, ge=0)  # committed steps to keep; 0 keeps all
    part_timeout_s: float = Field(default=600.0, gt=0)
    # start writing a step once all local ranks staged, or after this long (0: at once)
    stage_grace_s: float = Field(default=0.5, ge=0)
    commit_timeout_s: float = Field(default=600.0, gt=0)
    drain_grace_s: float = Field(default=120.0, ge=0)  # 0: steps in flight at SIGTERM are not waited for
    max_frame_bytes: Size = Field(default=32 << 20, gt=0, le=(1 << 32) - 1)  # the frame header is 4 bytes
    read_timeout_s: float = Field(default=30.0, gt=0)
    prefault: bool = True
    # keep the newest committed step's staged bytes for an in-memory restore (ckptd.daemon.restore)
    retain: bool = True
    nice: int = Field(default=10, ge=-20, le=19)  # the daemon yields the CPU to training ranks on busy nodes
    # an embedded daemon ends with its job: no client and no step in flight for this long -> exit
    exit_when_idle_s: float | None = Field(default=None, gt=0)
    # ... but while it holds a committed step for an in-memory restore it waits this long (restarted ranks)
    restore_hold_s: float = Field(default=300.0, ge=0)
    # the job an embedded daemon belongs to (clients of other jobs refuse it) and the process whose end
    # ends it: drain, keep what committed, exit (ckptd.client.ownership)
    job_id: str | None = None
    owner_pid: int | None = Field(default=None, gt=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)  # opt-in Prometheus endpoint; 0: any free port
    metrics_host: str = "127.0.0.1"
    storage: StorageOptions = Field(default_factory=StorageOptions)

    @field_validator("socket")
    @classmethod
    def _bindable(cls, value: str) -> str:
        size = len(os.fsencode(value))
        if size > MAX_SOCKET_PATH:
            raise ValueError(
                f"a Unix socket's path holds at most {MAX_SOCKET_PATH} bytes, this one has {size}: choose a "
                "shorter --socket (or CKPTD_SOCKET)"
            )
        return value

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        if value not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {value!r}")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Constructing a config never reads the process environment: the loader passes it in.
        return (init_settings,)

    @property
    def storage_options(self) -> dict[str, object]:
        """The storage options that were given, typed (see :meth:`StorageOptions.given`)."""
        return self.storage.given()


def root_given(value: str | None) -> str | None:
    """An empty root (``""``, ``file://``) would be the current directory, wherever the daemon started."""
    if value is not None and not value.lower().removeprefix("file:").removeprefix("//").strip():
        raise ValueError("the checkpoint root is empty; give a path or a file:// or s3:// URL")
    return value


class DaemonConfig(_Options):
    """What ``ckptd serve`` runs with (frozen). Build it with :func:`load_config`."""

    root: Annotated[str, AfterValidator(root_given)]


class OfflineConfig(_Options):
    """The same file and environment seen by an offline command, whose root is an argument."""

    root: Annotated[str | None, AfterValidator(root_given)] = None


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._given_env = env  # read by _load_env_vars, which the base __init__ calls
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._given_env, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


def _keys(table: Mapping[str, Any]) -> dict[str, Any]:
    """TOML and flags may spell options with dashes (``part-timeout-s``)."""
    return {str(k).replace("-", "_"): v for k, v in table.items()}


def _read_toml(path: str) -> dict[str, Any]:
    doc = read_config_file(path)
    storage = doc.pop(_STORAGE_TABLE, {})
    if not isinstance(storage, dict):
        raise ConfigError(f"{path}: [{_STORAGE_TABLE}] must be a table")
    if _DAEMON_TABLE in doc:
        daemon = doc.pop(_DAEMON_TABLE)
        if not isinstance(daemon, dict):
            raise ConfigError(f"{path}: [{_DAEMON_TABLE}] must be a table")
        if doc:  # options belong in [daemon] once it exists; anything else here is a typo
            raise ConfigError(
                f"{path}: unknown option(s) {sorted(doc)} at top level next to a [{_DAEMON_TABLE}] table; "
                f"put daemon options in [{_DAEMON_TABLE}]"
            )
        doc = daemon
    values = _keys(doc)
    if storage:
        values["storage"] = _keys(storage)
    return values


def _given(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Flags that were given (``None`` means "not on the command line"), storage ones nested."""
    values = {k: v for k, v in _keys(flags).items() if v is not None and k != "storage"}
    storage = {k: v for k, v in _keys(flags.get("storage") or {}).items() if v is not None}
    if storage:
        values["storage"] = storage
    return values


def _merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win, key by key; the storage table merges key by key too."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key == "storage" and isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    return merged


def _describe(exc: ValidationError, path: str | None) -> str:
    where = f" (config file {path})" if path else ""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        table = f"[{_STORAGE_TABLE}] " if err["loc"][:1] == ("storage",) and len(err["loc"]) > 1 else ""
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown option {table}{err['loc'][-1]!r}")
        elif err["type"] == "missing" and loc == "root":
            lines.append("no checkpoint root: pass --root, set CKPTD_ROOT, or set root in the config file")
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"{loc}: {msg} (got {err['input']!r})")
    return "; ".join(lines) + where


def _load(cls: type[_Options], flags: Mapping[str, Any], env: Mapping[str, str], config_file: str | None) -> Any:
    path = config_file or env.get("CKPTD_CONFIG") or None
    file_values = _read_toml(path) if path else {}
    try:
        env_values = _MappingEnvSource(cls, env)()
        values = _merge(file_values, env_values, _given(flags))
        values.setdefault("socket", default_socket_path(env, values.get("root")))  # one socket per root
        return cls(**values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
    except ValueError as exc:  # pydantic-settings: an environment value it could not decode (bad JSON)
        raise ConfigError(str(exc)) from exc


def load_config(
    flags: Mapping[str, Any], env: Mapping[str, str], config_file: str | None = None
) -> DaemonConfig:
    """The daemon's configuration from its layers, or :class:`ConfigError`.

    ``flags`` holds the options given on the command line by option name (``None`` = not given; storage
    options nested under ``"storage"``); ``env`` is the process environment; ``config_file`` (else
    ``$CKPTD_CONFIG``) names the TOML file.
    """
    cfg: DaemonConfig = _load(DaemonConfig, flags, env, config_file)
    return cfg


def load_storage_options(
    flags: Mapping[str, Any], env: Mapping[str, str], config_file: str | None = None
) -> dict[str, object]:
    """The storage options for an offline command, from the same layers as :func:`load_config`.

    The whole file is validated (an unknown daemon option is an error here too); ``root`` is optional.
    Returns only the options that were given, as typed values.
    """
    cfg: OfflineConfig = _load(OfflineConfig, flags, env, config_file)
    return cfg.storage_options
