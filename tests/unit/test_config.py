"""The daemon's one config loader: layers, types, sizes, unknown keys, storage options (all ConfigError)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ckptd.daemon.config import DaemonConfig, StorageOptions, load_config, load_storage_options, parse_size
from ckptd.writer.errors import ConfigError, InvalidRequestError
from ckptd.writer.format import DEFAULT_CHUNK_BYTES


# --- daemon config (moved from test_state.py) ---------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1 << 20),
        ("0", 0),
        ("512M", 512 << 20),
        ("512MiB", 512 << 20),
        ("512MB", 512 << 20),
        ("512mib", 512 << 20),
        ("4GiB", 4 << 30),
        (" 4 GiB ", 4 << 30),
        ("2T", 2 << 40),
        ("64K", 64 << 10),
        ("1.5KiB", 1536),
        ("100B", 100),
        (12345, 12345),
    ],
)
def test_parse_size_units(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "4 XB", "-1", "4GiBs", "1e6", "G", "4 G B"])
def test_parse_size_rejects_nonsense(text: str) -> None:
    with pytest.raises(ConfigError, match="cannot parse size"):
        parse_size(text)


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ckptd.toml"
    path.write_text(text)
    return str(path)


def test_load_config_precedence(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        """
[daemon]
root = "/from/file"
arena_size = "1GiB"
write_concurrency = 3
codec = "zstd"
keep = 2
part-timeout-s = 5

[storage]
anonymous = false
""",
    )
    env = {"CKPTD_ARENA_SIZE": "256MiB", "CKPTD_KEEP": "5", "CKPTD_PREFAULT": "off",
           "CKPTD_SOCKET": "/run/x.sock", "UNRELATED": "1"}
    flags = {"keep": 7, "root": None, "arena_size": None}
    cfg = load_config(flags, env, path)
    assert cfg.root == "/from/file"  # file; a None flag does not override
    assert cfg.arena_size == 256 << 20  # env over file
    assert cfg.write_concurrency == 3  # file over default
    assert cfg.codec == "zstd"
    assert cfg.keep == 7  # flag over env over file
    assert cfg.part_timeout_s == 5.0 and isinstance(cfg.part_timeout_s, float)
    assert cfg.prefault is False
    assert cfg.socket == "/run/x.sock"
    assert cfg.storage_options == {"anonymous": False}
    assert cfg.chunk_bytes == DEFAULT_CHUNK_BYTES  # default
    assert cfg.commit_timeout_s == DaemonConfig(root="r").commit_timeout_s


def test_load_config_from_env_and_flags_only() -> None:
    env = {"CKPTD_ROOT": "s3://bucket/ckpt", "CKPTD_WRITE_CONCURRENCY": "16"}
    cfg = load_config({"arena_size": "64MiB"}, env)
    assert (cfg.root, cfg.arena_size, cfg.write_concurrency) == ("s3://bucket/ckpt", 64 << 20, 16)
    assert load_config({"root": "/flag"}, {"CKPTD_ROOT": "/env"}).root == "/flag"


def test_config_file_named_by_the_environment(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'root = "/flat/file"\nkeep = 3\n\n[storage]\nregion = "k"\n')
    cfg = load_config({}, {"CKPTD_CONFIG": path})
    assert (cfg.root, cfg.keep) == ("/flat/file", 3)
    assert cfg.storage_options == {"region": "k"}


def test_config_file_argument_wins_over_ckptd_config(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'root = "/given"\n')
    assert load_config({}, {"CKPTD_CONFIG": str(tmp_path / "absent.toml")}, path).root == "/given"


@pytest.mark.parametrize("text", ['[daemon]\nroot = "/r"\narena_sise = "1G"\n', 'root = "/r"\nbogus = 1\n'])
def test_unknown_config_file_keys_are_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        load_config({}, {}, write_toml(tmp_path, text))


def test_missing_root_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no checkpoint root"):
        load_config({"keep": 1}, {"CKPTD_KEEP": "2"})
    with pytest.raises(ConfigError, match="no checkpoint root"):
        load_config({}, {}, write_toml(tmp_path, "keep = 1\n"))


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        ({"codec": "gzip"}, {}),
        ({}, {"CKPTD_ARENA_SIZE": "0"}),
        ({}, {"CKPTD_ARENA_SIZE": "lots"}),
        ({"write_concurrency": 0}, {}),
        ({"keep": -1}, {}),
    ],
)
def test_invalid_values_are_refused(flags: dict[str, Any], env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        load_config({"root": "/r", **flags}, env)


def test_config_is_frozen() -> None:
    cfg = load_config({"root": "/r"}, {})
    with pytest.raises(ValidationError, match="frozen"):
        cfg.root = "/other"  # type: ignore[misc]


# --- one loader for every subcommand ------------------------------------------------------------
def test_precedence_of_every_layer_for_one_option(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'root = "/r"\nwrite_concurrency = 2\n')
    assert DaemonConfig(root="/r").write_concurrency == 8  # default
    assert load_config({}, {}, path).write_concurrency == 2  # file over default
    assert load_config({}, {"CKPTD_WRITE_CONCURRENCY": "3"}, path).write_concurrency == 3  # env over file
    assert load_config({"write_concurrency": 4}, {"CKPTD_WRITE_CONCURRENCY": "3"}, path).write_concurrency == 4


def test_storage_option_precedence(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[storage]\nmax_attempts = 2\nregion = "file"\nendpoint_url = "http://file:1"\n')
    env = {"CKPTD_STORAGE_MAX_ATTEMPTS": "3", "CKPTD_STORAGE_REGION": "env"}
    flags = {"storage": {"max_attempts": "4", "fs_retries": None}}
    opts = load_storage_options(flags, env, path)
    assert opts == {"max_attempts": 4, "region": "env", "endpoint_url": "http://file:1"}
    cfg = load_config({"root": "/r", **flags}, env, path)
    assert cfg.storage_options == opts


def test_ckptd_env_reaches_storage_options_typed() -> None:
    env = {"CKPTD_STORAGE_ENDPOINT_URL": "http://127.0.0.1:9000", "CKPTD_STORAGE_CONDITIONAL_PUT": "false",
           "CKPTD_STORAGE_CONNECT_TIMEOUT": "2.5", "ckptd_storage_addressing_style": "path"}
    opts = load_storage_options({}, env)
    assert opts == {"endpoint_url": "http://127.0.0.1:9000", "conditional_put": False, "connect_timeout": 2.5,
                    "addressing_style": "path"}
    assert isinstance(opts["connect_timeout"], float) and opts["conditional_put"] is False
    assert load_config({}, {"CKPTD_ROOT": "s3://b/p", **env}).storage_options == opts


def test_offline_commands_need_no_root_but_validate_the_file(tmp_path: Path) -> None:
    assert load_storage_options({}, {}) == {}
    path = write_toml(tmp_path, '[daemon]\narena_size = "1GiB"\n\n[storage]\nfs_retries = 2\n')
    assert load_storage_options({}, {"CKPTD_CONFIG": path}) == {"fs_retries": 2}
    bad = write_toml(tmp_path, '[daemon]\narena_sise = "1GiB"\n')
    with pytest.raises(ConfigError, match="unknown option 'arena_sise'"):
        load_storage_options({}, {}, bad)


@pytest.mark.parametrize(
    "text",
    [
        '[daemon]\nroot = "/r"\n\n[storage]\nsecret_access_key = "x"\n',  # credentials are not options
        'root = "/r"\n\n[storage]\nendpoint = "http://x"\n',
        '[daemon]\nroot = "/r"\n\n[other]\nx = 1\n',  # an unknown table
        'bogus = 1\n\n[daemon]\nroot = "/r"\n',  # a top-level key next to [daemon] is not silently ignored
        'keep = 1\n\n[daemon]\nroot = "/r"\n',  # nor a known one: options go in one place
    ],
)
def test_unknown_keys_in_any_table_are_config_errors(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="unknown option") as info:
        load_config({}, {}, write_toml(tmp_path, text))
    assert not isinstance(info.value, InvalidRequestError)  # a config mistake is not a wire error
    with pytest.raises(ConfigError, match="unknown option"):
        load_storage_options({}, {}, write_toml(tmp_path, text))


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        ({"not_an_option": 1}, {}),
        ({"storage": {"nope": 1}}, {}),
        ({}, {"CKPTD_STORAGE_NOPE": "1"}),
    ],
)
def test_unknown_flags_and_storage_env_are_config_errors(flags: dict[str, Any], env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        load_config({"root": "/r", **flags}, env)


def test_other_ckptd_variables_are_not_options(tmp_path: Path) -> None:
    env = {"CKPTD_LOG_LEVEL": "DEBUG", "CKPTD_CONFIG": write_toml(tmp_path, 'root = "/r"\n'), "CKPTD_X": "1"}
    assert load_config({}, env).root == "/r"


@pytest.mark.parametrize(
    ("flags", "env", "match"),
    [
        ({"storage": {"max_attempts": 0}}, {}, "max_attempts"),
        ({}, {"CKPTD_STORAGE_ADDRESSING_STYLE": "sideways"}, "addressing_style"),
        ({}, {"CKPTD_STORAGE_CONDITIONAL_PUT": "maybe"}, "conditional_put"),
        ({}, {"CKPTD_CHUNK_BYTES": "16 parsecs"}, "cannot parse size"),
        ({"write_concurrency": "many"}, {}, "write_concurrency"),
        ({"socket": "/tmp/" + "d" * 100 + ".sock"}, {}, "at most 107 bytes, this one has 110"),
        ({}, {"CKPTD_SOCKET": "/" + "é" * 54}, "at most 107 bytes, this one has 109"),
    ],
)
def test_bad_values_name_the_option(flags: dict[str, Any], env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config({"root": "/r", **flags}, env)


def test_broken_or_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config({}, {}, write_toml(tmp_path, "root = \n"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config({}, {}, str(tmp_path / "absent.toml"))


def test_sizes_accept_units_in_every_layer(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'root = "/r"\nchunk_bytes = "8MiB"\npack_bytes = 4096\n')
    cfg = load_config({"max_frame_bytes": "64MiB"}, {"CKPTD_ARENA_SIZE": "8GiB"}, path)
    assert (cfg.arena_size, cfg.chunk_bytes, cfg.pack_bytes, cfg.max_frame_bytes) == (8 << 30, 8 << 20, 4096, 64 << 20)


def test_storage_schema_matches_the_s3_backend() -> None:
    from ckptd.writer.backends.s3 import S3Options

    assert set(StorageOptions.model_fields) == set(S3Options.__struct_fields__)
