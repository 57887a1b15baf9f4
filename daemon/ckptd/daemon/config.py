"""Daemon configuration, resolved once at the edge: defaults < TOML file < ``CKPTD_*`` environment < flags."""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptd.client.paths import default_socket_path
from ckptd.writer.arrays import CODECS
from ckptd.writer.errors import InvalidRequestError
from ckptd.writer.format import DEFAULT_CHUNK_BYTES

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: str | int) -> int:
    """``"4GiB"``, ``"512M"``, ``"1048576"`` -> bytes (binary units)."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(value)
    if not m:
        raise InvalidRequestError(f"cannot parse size {value!r}; use e.g. 512MiB or 4GiB")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class DaemonConfig:
    root: str
    socket: str = field(default_factory=lambda: default_socket_path(os.environ))
    arena_size: int = 2 << 30
    write_concurrency: int = 8
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    pack_bytes: int | None = None  # small arrays a node holds whole -> one object; None: 1MiB on S3, off locally
    codec: str = "raw"
    keep: int = 0  # committed steps to keep; 0 keeps all
    part_timeout_s: float = 600.0
    stage_grace_s: float = 0.5  # start writing a step once all local ranks staged, or after this long
    commit_timeout_s: float = 600.0
    drain_grace_s: float = 120.0
    max_frame_bytes: int = 32 << 20
    read_timeout_s: float = 30.0
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    prefault: bool = True
    nice: int = 10  # the daemon yields the CPU to training ranks on busy nodes

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise InvalidRequestError(f"codec must be one of {CODECS}, got {self.codec!r}")
        for name in ("arena_size", "write_concurrency", "chunk_bytes", "max_frame_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        if self.pack_bytes is not None and self.pack_bytes < 0:
            raise InvalidRequestError(f"pack_bytes must be >= 0, got {self.pack_bytes}")
        if self.keep < 0:
            raise InvalidRequestError(f"keep must be >= 0, got {self.keep}")


_FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}
_SIZES = {"arena_size", "chunk_bytes", "max_frame_bytes", "pack_bytes"}


def _coerce(name: str, value: Any) -> Any:
    if name in _SIZES:
        return parse_size(value)
    kind = _FIELDS[name].type
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
    return value


def load_config(
    flags: Mapping[str, Any], env: Mapping[str, str], config_file: str | None = None
) -> DaemonConfig:
    """Merge the layers; ``flags`` holds only options given on the command line (None = not given)."""
    values: dict[str, Any] = {}
    path = config_file or env.get("CKPTD_CONFIG")
    if path:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
        section = doc.get("daemon", doc)
        for key, value in section.items():
            if section is doc and key == "storage":  # a flat file's [storage] table, read below
                continue
            name = key.replace("-", "_")
            if name not in _FIELDS:
                raise InvalidRequestError(f"{path}: unknown option {key!r}; known: {sorted(_FIELDS)}")
            values[name] = value
        if "storage" in doc:
            values["storage_options"] = dict(doc["storage"])
    for name in _FIELDS:
        env_value = env.get(f"CKPTD_{name.upper()}")
        if env_value is not None and name != "storage_options":
            values[name] = env_value
    for name, value in flags.items():
        if value is not None and name in _FIELDS:
            values[name] = value
    values.setdefault("socket", default_socket_path(env))
    if "root" not in values:
        raise InvalidRequestError("no checkpoint root: pass --root, set CKPTD_ROOT, or set root in the config file")
    return DaemonConfig(**{k: _coerce(k, v) for k, v in values.items()})
