"""The S3 options a rank needs for its own storage calls, read where the node daemon reads its own.

A daemon (``ckptd serve``, or the embedded one a client starts) takes its storage options from the
``[storage]`` table of its config file (``--config``, else ``$CKPTD_CONFIG``), from ``CKPTD_STORAGE_<KEY>``
(and a JSON table in ``CKPTD_STORAGE``), and from its storage flags (``--endpoint-url``, ``--region``, ...,
``--storage-option KEY=VALUE``), later sources winning key by key. A rank that reads, checks or deletes
steps under the same root itself (an integration's existence check, retention or load, Megatron-LM's
tracker on S3) must reach the same endpoint, or it talks to AWS while the daemon writes to MinIO:
:func:`storage_options_from_env` reads the same sources the same way. The client package cannot import
``ckptd.daemon`` (``pyproject.toml``'s import contracts), so this mirrors ``ckptd.daemon.config``;
``tests/unit/test_storage_env.py`` checks that both give the same options.

Local roots take no options: :func:`storage_options_for` returns none for them without reading anything,
so a stray variable never needs the S3 extra on a job that writes to a local disk.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from ckptd.writer.errors import ConfigError

__all__ = ["ENV_CONFIG", "ENV_PREFIX", "storage_options_for", "storage_options_from_env"]

ENV_PREFIX = "CKPTD_STORAGE_"  # CKPTD_STORAGE_ENDPOINT_URL -> endpoint_url (any case, as the daemon reads it)
ENV_CONFIG = "CKPTD_CONFIG"  # the daemon's TOML config file; its [storage] table
_TABLE_ENV = ENV_PREFIX.rstrip("_")  # CKPTD_STORAGE='{"endpoint_url": ...}': the whole table as JSON
# the text pydantic (the daemon's settings) reads as a bool; msgspec alone takes only true/false/1/0
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def storage_options_for(
    root: str, env: Mapping[str, str] = os.environ, daemon_args: Sequence[str] = ()
) -> dict[str, object]:
    """:func:`storage_options_from_env` for an ``s3://`` root; ``{}`` for any other (local backends take
    no options)."""
    if not root.startswith("s3://"):
        return {}
    return storage_options_from_env(env, daemon_args)


def storage_options_from_env(env: Mapping[str, str] = os.environ, daemon_args: Sequence[str] = ()) -> dict[str, object]:
    """The storage options a daemon started in ``env`` with ``daemon_args`` uses, typed as the storage
    backends take them: the config file's ``[storage]`` table < ``CKPTD_STORAGE*`` < the storage flags in
    ``daemon_args`` (other flags are ignored). ``{}`` when none is given; :class:`ConfigError` for an
    unknown key or a value that does not parse."""
    flags, text_flags, config = _flags(daemon_args)
    layers: list[Mapping[str, object]] = []
    path = config or env.get(ENV_CONFIG)
    if path:
        layers.append(_typed(_config_table(path)))  # the daemon's settings convert TOML text too ("8" -> 8)
    layers += [_typed(_env_table(env)), flags, _typed(text_flags)]
    merged: dict[str, object] = {}
    for layer in layers:
        merged.update(layer)
    return merged


def _env_table(env: Mapping[str, str]) -> dict[str, object]:
    """``CKPTD_STORAGE`` (JSON) and ``CKPTD_STORAGE_<KEY>`` (text), keys lower case, case-insensitive names."""
    table: dict[str, object] = {}
    nested: dict[str, object] = {}
    for name, value in env.items():
        upper = name.upper()
        if upper == _TABLE_ENV:
            try:
                doc = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"{name}: not a JSON table: {exc}") from exc
            if not isinstance(doc, dict):
                raise ConfigError(f"{name}: not a JSON table: {value!r}")
            table.update({str(k).lower(): v for k, v in doc.items()})
        elif upper.startswith(ENV_PREFIX) and len(upper) > len(ENV_PREFIX):
            nested[name[len(ENV_PREFIX):].lower()] = value
    return {**table, **nested}


def read_config_file(path: str) -> dict[str, Any]:
    """The daemon's TOML config file as a dict (its reader too: ``ckptd.daemon.config``); :class:`ConfigError`
    when it cannot be read or parsed."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


def _config_table(path: str) -> dict[str, object]:
    table = read_config_file(path).get("storage", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [storage] must be a table")
    return {str(k).replace("-", "_"): v for k, v in table.items()}


def _flags(daemon_args: Sequence[str]) -> tuple[dict[str, object], dict[str, str], str | None]:
    """The storage flags of ``ckptd serve`` in ``daemon_args``: (typed flags, ``--storage-option`` text,
    ``--config``)."""
    if not daemon_args:
        return {}, {}, None
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--endpoint-url", "--region", "--profile", "--addressing-style", "--retry-mode", "--config"):
        p.add_argument(flag)
    for flag in ("--max-attempts", "--fs-retries"):
        p.add_argument(flag, type=int)
    for flag in ("--connect-timeout", "--read-timeout"):
        p.add_argument(flag, type=float)
    p.add_argument("--storage-option", action="append", default=[])
    try:
        args, _ = p.parse_known_args(list(daemon_args))
    except SystemExit as exc:  # argparse's way to say a value did not parse
        raise ConfigError(f"cannot read the storage flags of {list(daemon_args)}") from exc
    values = vars(args)
    config, items = values.pop("config"), values.pop("storage_option")
    text: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option wants KEY=VALUE, got {item!r}")
        text[key.strip().replace("-", "_")] = value.strip()
    return {k: v for k, v in values.items() if v is not None}, text, config


def _typed(values: Mapping[str, object]) -> dict[str, object]:
    """Text values as the typed ones the backends take (``"3"`` -> 3, ``"yes"`` -> True); others as given."""
    text = {k: v for k, v in values.items() if isinstance(v, str)}
    if not text:
        return dict(values)
    import msgspec

    from ckptd.writer.backends.s3 import S3Options  # S3 only (storage_options_for): the s3 extra is there

    kinds = {f.name: f.type for f in msgspec.structs.fields(S3Options)}
    for key, value in text.items():
        if kinds.get(key) is bool and value.strip().lower() in _TRUE | _FALSE:
            text[key] = "true" if value.strip().lower() in _TRUE else "false"
    return {**values, **S3Options.typed_from_text(text)}
