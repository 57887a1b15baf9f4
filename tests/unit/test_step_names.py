"""Megatron-LM's ``iter_XXXXXXX`` names where users meet them: one parse for every step a user names, and
``--load <root>/iter_0000100`` / ``--ckpt-step`` resolved to root and step (the stored name stays step_N)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ckptd.client.megatron.megatron_lm import resolve_load
from ckptd.writer.errors import CheckpointNotFoundError, ConfigError, InvalidKeyError
from ckptd.writer.format import CONTROL_DIR, megatron_iter_name, parse_step, split_step_path, step_dir
from ckptd.writer.root import open_root


@pytest.mark.parametrize(
    ("given", "want"),
    [(100, 100), (0, 0), ("100", 100), ("step_100", 100), ("iter_0000100", 100), ("iter_100", 100),
     ("iter_12345678", 12345678), (" latest ", "latest"), ("latest", "latest"), ("007", 7)],
)
def test_parse_step_reads_every_spelling(given: int | str, want: int | str) -> None:
    assert parse_step(given) == want


@pytest.mark.parametrize("bad", ["iter_", "step_-1", "iter_0x10", "newest", "", "100.0", "iter_100/", -1, True])
def test_parse_step_refuses_anything_else(bad: int | str) -> None:
    with pytest.raises(InvalidKeyError):
        parse_step(bad)


def test_megatron_name_round_trips_and_is_not_the_stored_name() -> None:
    assert megatron_iter_name(100) == "iter_0000100" and step_dir(100) == "step_100"
    assert all(parse_step(megatron_iter_name(n)) == n for n in (0, 1, 9_999_999, 10_000_000))
    with pytest.raises(InvalidKeyError):
        megatron_iter_name(-1)


@pytest.mark.parametrize(
    ("path", "want"),
    [("/ck/run1/iter_0000100", ("/ck/run1", 100)), ("/ck/run1/iter_0000100/", ("/ck/run1", 100)),
     ("/ck/run1/step_7", ("/ck/run1", 7)), ("/ck/run1", ("/ck/run1", None)),
     ("s3://bucket/run/iter_0000020", ("s3://bucket/run", 20)), ("s3://iter_0000020", ("s3://iter_0000020", None)),
     ("iter_0000100", ("iter_0000100", None)), ("/ck/iter_x", ("/ck/iter_x", None))],
)
def test_split_step_path(path: str, want: tuple[str, int | None]) -> None:
    assert split_step_path(path) == want


def test_resolve_load_reads_megatron_lm_load_and_ckpt_step(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    assert resolve_load(root) == (root, "latest")
    assert resolve_load(root, 200) == (root, 200)
    assert resolve_load(root, "iter_0000200") == (root, 200)
    assert resolve_load(f"{root}/iter_0000100") == (root, 100)
    assert resolve_load(f"{root}/iter_0000100", 100) == (root, 100)
    with pytest.raises(ConfigError, match="names step 100 but --ckpt-step is 200"):
        resolve_load(f"{root}/iter_0000100", 200)
    # a ckptd root that is itself called iter_N stays a root
    named = tmp_path / "iter_0000005"
    (named / CONTROL_DIR).mkdir(parents=True)
    assert resolve_load(str(named)) == (str(named), "latest")


def test_root_resolve_takes_every_spelling(tmp_path: Path) -> None:
    async def go() -> list[int]:
        async with open_root(str(tmp_path / "r"), create=True) as root:
            got = [await root.resolve(s) for s in (3, "3", "step_3", "iter_0000003")]
            with pytest.raises(CheckpointNotFoundError, match="iter_x"):
                await root.resolve("iter_x")
            return got

    assert asyncio.run(go()) == [3, 3, 3, 3]
