"""The storage format's pure parts: key safety, dtypes, chunk grids, region checks and manifest merging."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptd.writer import format as fmt
from ckptd.writer.errors import (
    InvalidKeyError,
    InvalidRequestError,
    ShardLayoutError,
    UnsupportedDtypeError,
    UnsupportedFormatError,
)
from ckptd.writer.format import (
    ArrayRecord,
    ChunkRecord,
    PartManifest,
    ShardRecord,
    check_region,
    chunk_count,
    plan_chunks,
    region_chunks,
    validate_key,
)
from ckptd.writer.parts import merge_parts

# --- keys -----------------------------------------------------------------------------------------
GOOD_KEYS = [
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "embedding.word_embeddings.weight",
    "model/w",
    "optim/tp0.pp0/buf0/bucket1/exp_avg",
    "rng/rank-3",
    "a+b=c:d@e,f",
    "0",
    "x" * fmt.MAX_KEY_LEN,
]

BAD_KEYS = [
    "",
    "..",
    ".",
    "a/../b",
    "a/./b",
    "../a",
    "/abs",
    "a/",
    "a//b",
    ".hidden",
    "a/.hidden",
    "_private",
    "a/_private",
    "a\\b",
    "..\\a",
    "a\x00b",
    "a b",
    " a",
    "a\n",  # a trailing newline slips past a '$'-anchored re.match
    "a\n/b",
    "a\tb",
    "é",
    "a/zarr.json",
    "x" * (fmt.MAX_KEY_LEN + 1),
]


@pytest.mark.parametrize("key", GOOD_KEYS)
def test_validate_key_accepts_megatron_style_names(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_validate_key_rejects_unsafe_names(key: str) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(key)


@pytest.mark.parametrize("key", [None, 1, b"model/w", ["model", "w"], ("a",)], ids=repr)
def test_validate_key_rejects_non_strings(key: object) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(key)


_FIRST = "abcXYZ0189"
_REST = _FIRST + "._-+=:@,"
key_part = st.builds(lambda a, b: a + b, st.sampled_from(_FIRST), st.text(alphabet=_REST, max_size=8)).filter(
    lambda s: s != "zarr.json"
)
good_key = st.lists(key_part, min_size=1, max_size=5).map("/".join)


@given(good_key)
def test_keys_of_safe_parts_are_accepted(key: str) -> None:
    assert validate_key(key) == key


@given(good_key, st.characters(blacklist_characters=_REST + "/" + "".join(
    c for c in map(chr, range(128)) if c.isalnum())), st.data())
def test_any_character_outside_the_alphabet_is_rejected(key: str, bad: str, data: st.DataObject) -> None:
    i = data.draw(st.integers(min_value=0, max_value=len(key)))
    with pytest.raises(InvalidKeyError):
        validate_key(key[:i] + bad + key[i:])


def test_key_errors_are_invalid_requests() -> None:
    with pytest.raises(InvalidRequestError):
        validate_key("../etc/passwd")
    with pytest.raises(ValueError):
        validate_key("/abs")


# --- dtypes ---------------------------------------------------------------------------------------
def test_bfloat16_is_stored_as_uint16() -> None:
    assert fmt.storage_dtype("bfloat16") == "uint16"
    assert fmt.itemsize("bfloat16") == 2


@pytest.mark.parametrize("name", fmt.supported_dtypes())
def test_supported_dtypes_agree_with_torch_and_numpy(name: str) -> None:
    torch_size = torch.empty(0, dtype=getattr(torch, name)).element_size()
    assert fmt.itemsize(name) == torch_size
    assert np.dtype(fmt.storage_dtype(name)).itemsize == torch_size


@pytest.mark.parametrize(
    "name", ["complex64", "complex128", "float4", "qint8", "", "torch.float32", "Float32"]
)
def test_unsupported_dtypes_are_rejected(name: str) -> None:
    with pytest.raises(UnsupportedDtypeError, match="unsupported dtype"):
        fmt.storage_dtype(name)
    with pytest.raises(UnsupportedDtypeError):
        fmt.itemsize(name)
    assert issubclass(UnsupportedDtypeError, InvalidRequestError)


# --- chunk grids ----------------------------------------------------------------------------------
shapes = st.lists(st.integers(min_value=1, max_value=300), min_size=0, max_size=4)
items = st.sampled_from([1, 2, 4, 8])
targets = st.integers(min_value=1, max_value=1 << 20)


@given(shapes, items, targets)
def test_plan_chunks_divides_the_base_block_and_fits_the_target(
    base: list[int], item: int, target: int
) -> None:
    chunks = plan_chunks(base, item, target)
    assert len(chunks) == len(base)
    assert all(c >= 1 and b % c == 0 for b, c in zip(base, chunks, strict=True))
    if item <= target:
        assert math.prod(chunks) * item <= target
    else:  # one element is already over the target: the smallest possible chunk
        assert chunks == (1,) * len(base)
    assert plan_chunks(list(base), item, target) == chunks  # deterministic


@given(shapes, items, targets)
def test_plan_chunks_keeps_a_block_that_already_fits(base: list[int], item: int, target: int) -> None:
    if math.prod(base) * item <= target:
        assert plan_chunks(base, item, target) == tuple(base)


def test_plan_chunks_splits_leading_axes_first() -> None:
    # 8 x 1024 float32 = 32 KiB: axis 0 is divided by its smallest divisor that fits 8 KiB (4)
    assert plan_chunks([8, 1024], 4, 8 << 10) == (2, 1024)
    # the trailing axis is only split when a single row is too big
    assert plan_chunks([8, 1024], 4, 2 << 10) == (1, 512)
    assert plan_chunks([4096, 4096], 2, 32 << 20) == (4096, 4096)
    assert plan_chunks([16384, 8192], 2, 64 << 20) == (4096, 8192)
    # the default (16 MiB) splits a 32 MiB bf16 block in two along its leading axis
    assert plan_chunks([4096, 4096], 2, fmt.DEFAULT_CHUNK_BYTES) == (2048, 4096)


def test_plan_chunks_on_a_prime_axis_larger_than_the_target() -> None:
    """A prime axis cannot be split evenly, so it collapses to chunks of one element along it: the chunk
    still fits the target (it is just small). Only an element larger than the target cannot fit."""
    assert plan_chunks([10007], 2, 4096) == (1,)
    assert plan_chunks([3, 10007], 4, 4096) == (1, 1)
    assert plan_chunks([10007, 2], 4, 4096) == (1, 2)
    assert plan_chunks([5, 3], 16, 8) == (1, 1)  # 16-byte items over an 8-byte target: one element each


def test_plan_chunks_degenerate_axes() -> None:
    assert plan_chunks([], 4, 1) == ()
    assert plan_chunks([0, 7], 4, 1 << 20) == (1, 7)


# --- regions and tilings --------------------------------------------------------------------------
@st.composite
def tilings(draw: st.DrawFn, max_ndim: int = 3, max_len: int = 12) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A global shape and a block shape (blocks tile it regularly, the last along an axis may be short)."""
    shape = tuple(draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_ndim)))
    block = tuple(draw(st.integers(1, n)) for n in shape)
    return shape, block


def blocks(shape: Sequence[int], block: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offset, local shape) of every block of the regular tiling, in C order."""
    axes = [[(o, min(b, n - o)) for o in range(0, n, b)] for n, b in zip(shape, block, strict=True)]
    return [(tuple(o for o, _ in combo), tuple(m for _, m in combo)) for combo in itertools.product(*axes)]


@given(tilings(), items, st.integers(1, 256))
def test_regular_tilings_pass_check_region_and_cover_every_chunk_once(
    tiling: tuple[tuple[int, ...], tuple[int, ...]], item: int, target: int
) -> None:
    shape, block = tiling
    chunks = plan_chunks(block, item, target)
    seen: Counter[tuple[int, ...]] = Counter()
    for offset, local in blocks(shape, block):
        check_region("k", shape, offset, local, chunks)
        seen.update(region_chunks(offset, local, chunks))
    grid = [range(-(-n // c)) for n, c in zip(shape, chunks, strict=True)]
    assert seen == Counter(itertools.product(*grid))
    assert sum(seen.values()) == chunk_count(shape, chunks)


@given(tilings())
def test_region_chunks_are_in_c_order(tiling: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    shape, block = tiling
    for offset, local in blocks(shape, block):
        coords = list(region_chunks(offset, local, block))
        assert coords == sorted(coords)
        assert len(coords) == 1  # a block on its own grid is exactly one chunk


@given(st.integers(2, 8), st.data())
def test_misaligned_regions_are_rejected(c: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(c + 1, 4 * c))
    o = data.draw(st.integers(1, n - 1).filter(lambda o: o % c))
    m = data.draw(st.integers(0, n - o))
    with pytest.raises(ShardLayoutError, match="chunk grid"):
        check_region("k", (n,), (o,), (m,), (c,))


@pytest.mark.parametrize(
    ("shape", "offset", "local", "chunks", "match"),
    [
        ((8,), (0,), (3,), (2,), "chunk grid"),  # ends off the grid, not at the edge
        ((8, 4), (2, 1), (2, 2), (2, 2), "chunk grid"),
        ((8,), (6,), (4,), (2,), "outside"),
        ((8,), (-2,), (2,), (2,), "outside"),
        ((8,), (0,), (-1,), (2,), "outside"),
        ((8,), (8,), (2,), (2,), "outside"),
        ((8, 4), (0,), (8, 4), (8, 4), "rank mismatch"),
        ((8, 4), (0, 0), (8,), (8, 4), "rank mismatch"),
        ((8, 4), (0, 0), (8, 4), (8,), "rank mismatch"),
    ],
)
def test_bad_regions_are_rejected(
    shape: tuple[int, ...],
    offset: tuple[int, ...],
    local: tuple[int, ...],
    chunks: tuple[int, ...],
    match: str,
) -> None:
    with pytest.raises(ShardLayoutError, match=match):
        check_region("w", shape, offset, local, chunks)


def test_a_shorter_last_block_is_accepted() -> None:
    check_region("w", (10,), (8,), (2,), (4,))
    check_region("w", (10, 3), (4, 0), (4, 3), (4, 3))
    assert list(region_chunks((8,), (2,), (4,))) == [(2,)]


def test_chunk_key_and_count() -> None:
    assert fmt.chunk_key((1, 0, 3), "/") == "c/1/0/3"  # formats 1-3
    assert fmt.chunk_key((1, 0, 3), ".") == "c.1.0.3"  # format 4
    assert fmt.chunk_key((), "/") == fmt.chunk_key((), ".") == "c"
    assert fmt.CHUNK_SEPARATOR == "."
    assert chunk_count((), ()) == 1
    assert chunk_count((10, 3), (4, 3)) == 3


# --- merging node parts ---------------------------------------------------------------------------
def shard_record(
    rank: int, offset: Sequence[int], local: Sequence[int], chunks: Sequence[int]
) -> ShardRecord:
    recs = [ChunkRecord(list(c), 4, 0) for c in region_chunks(offset, local, chunks)]
    return ShardRecord(rank, list(offset), list(local), recs)


def make_parts(
    shape: Sequence[int], block: Sequence[int], num_nodes: int, per_node: int, *, step: int = 7
) -> list[PartManifest]:
    """Parts of a valid save: blocks dealt round-robin to ranks, ranks grouped into nodes."""
    world = num_nodes * per_node
    by_node: dict[int, list[ShardRecord]] = {n: [] for n in range(num_nodes)}
    for i, (offset, local) in enumerate(blocks(shape, block)):
        rank = i % world
        by_node[rank // per_node].append(shard_record(rank, offset, local, block))
    parts = []
    for node, shards in by_node.items():
        arrays = [ArrayRecord("w", "float32", list(shape), list(block), shards)] if shards else []
        replicated = shard_record(node * per_node, [0], [3], [3])
        arrays.append(ArrayRecord(f"rep{node}", "int64", [3], [3], [replicated]))
        parts.append(
            PartManifest(
                format=fmt.FORMAT_VERSION, step=step, node=node, num_nodes=num_nodes, world_size=world,
                ranks=list(range(node * per_node, (node + 1) * per_node)), arrays=arrays,
                objects={str(r): {"it": step} for r in range(node * per_node, (node + 1) * per_node)},
                nbytes=100 + node, written_at=1.0,
            )
        )
    return parts


@given(tilings(), st.integers(1, 3), st.integers(1, 3), st.randoms())
def test_parts_of_a_valid_tiling_merge(
    tiling: tuple[tuple[int, ...], tuple[int, ...]], num_nodes: int, per_node: int, rnd: object
) -> None:
    shape, block = tiling
    parts = make_parts(shape, block, num_nodes, per_node)
    rnd.shuffle(parts)  # type: ignore[attr-defined]
    commit = merge_parts(parts)
    assert (commit.step, commit.num_nodes, commit.world_size) == (7, num_nodes, num_nodes * per_node)
    assert commit.nbytes == sum(100 + n for n in range(num_nodes))
    assert set(commit.objects) == {str(r) for r in range(num_nodes * per_node)}
    assert [a.name for a in commit.arrays] == sorted(["w", *(f"rep{n}" for n in range(num_nodes))])
    w = next(a for a in commit.arrays if a.name == "w")
    assert (w.shape, w.chunks, w.torch_dtype) == (list(shape), list(block), "float32")
    coords = [tuple(c.coords) for s in w.shards for c in s.chunks]
    grid = (range(-(-n // b)) for n, b in zip(shape, block, strict=True))
    assert sorted(coords) == sorted(itertools.product(*grid))
    assert [s.offset for s in w.shards] == sorted(s.offset for s in w.shards)
    # the commit manifest survives its JSON encoding
    assert fmt.decode_commit(fmt.encode_json(commit)) == commit


def test_parts_missing_a_rank_or_sharing_one_do_not_merge() -> None:
    """A step commits only with every rank of the world saved once: nodes told a wrong placement would
    commit a step lacking a rank's data, whose load then took another rank's plain data."""
    parts = make_parts((8,), (4,), 2, 2)  # ranks 0, 1 on node 0; 2, 3 on node 1
    assert merge_parts(parts).world_size == 4
    short = msgspec.structs.replace(parts[1], ranks=[2])
    with pytest.raises(ShardLayoutError, match=r"ranks \[0, 1, 2\] of a world of 4 \(missing \[3\]"):
        merge_parts([parts[0], short])
    with pytest.raises(ShardLayoutError, match="missing"):
        merge_parts([parts[0]])  # a node whose part never came is the coordinator's wait, not a commit
    shared = msgspec.structs.replace(parts[1], ranks=[1, 2, 3])
    with pytest.raises(ShardLayoutError, match="rank 1 is in the parts of nodes 0 and 1"):
        merge_parts([parts[0], shared])
    outside = msgspec.structs.replace(parts[1], ranks=[2, 3, 4])
    with pytest.raises(ShardLayoutError, match=r"outside it \[4\]"):
        merge_parts([parts[0], outside])
    other_world = msgspec.structs.replace(parts[1], world_size=2)  # said first: the parts disagree
    with pytest.raises(ShardLayoutError, match="node parts disagree"):
        merge_parts([parts[0], other_world])


def test_parts_whose_keys_clash_across_nodes_do_not_merge() -> None:
    """Each rank checks its own keys; an array of one node that is another node's group is the merge's."""
    parts = make_parts((8,), (4,), 2, 1)
    rec = parts[1].arrays[0]
    clash = msgspec.structs.replace(rec, name="w/inner")
    with pytest.raises(InvalidKeyError, match="'w' is an array and also the group of 'w/inner'"):
        merge_parts([parts[0], msgspec.structs.replace(parts[1], arrays=[*parts[1].arrays, clash])])


def test_a_manifest_of_a_newer_format_is_refused_by_name() -> None:
    commit = merge_parts(make_parts((8,), (4,), 1, 2))
    for version in fmt.READABLE_VERSIONS:
        old = msgspec.structs.replace(commit, format=version)
        assert fmt.decode_commit(fmt.encode_json(old)).format == version
    newer = msgspec.structs.replace(commit, format=fmt.FORMAT_VERSION + 1)
    expected = f"format {fmt.FORMAT_VERSION + 1}; this ckptd reads formats 1, 2, 3"
    with pytest.raises(UnsupportedFormatError, match=expected):
        fmt.decode_commit(fmt.encode_json(newer))


@given(tilings(), st.integers(1, 3), st.integers(1, 2), st.data())
def test_a_missing_shard_is_a_gap(
    tiling: tuple[tuple[int, ...], tuple[int, ...]], num_nodes: int, per_node: int, data: st.DataObject
) -> None:
    shape, block = tiling
    parts = make_parts(shape, block, num_nodes, per_node)
    holders = [i for i, p in enumerate(parts) if any(a.name == "w" for a in p.arrays)]
    i = data.draw(st.sampled_from(holders))
    arrays = list(parts[i].arrays)
    w = arrays[0]
    j = data.draw(st.integers(0, len(w.shards) - 1))
    arrays[0] = msgspec.structs.replace(w, shards=w.shards[:j] + w.shards[j + 1 :])
    parts[i] = msgspec.structs.replace(parts[i], arrays=arrays)
    with pytest.raises(ShardLayoutError, match="gap"):
        merge_parts(parts)


@given(tilings(), st.integers(1, 3), st.integers(1, 2), st.data())
def test_a_duplicated_shard_is_an_overlap(
    tiling: tuple[tuple[int, ...], tuple[int, ...]], num_nodes: int, per_node: int, data: st.DataObject
) -> None:
    shape, block = tiling
    parts = make_parts(shape, block, num_nodes, per_node)
    holders = [p for p in parts if any(a.name == "w" for a in p.arrays)]
    dup = data.draw(st.sampled_from(data.draw(st.sampled_from(holders)).arrays[0].shards))
    i = data.draw(st.integers(0, len(parts) - 1))
    dup = msgspec.structs.replace(dup, rank=i * per_node)
    extra = ArrayRecord("w", "float32", list(shape), list(block), [dup])
    parts[i] = msgspec.structs.replace(parts[i], arrays=[*parts[i].arrays, extra])
    with pytest.raises(ShardLayoutError, match="overlap"):
        merge_parts(parts)


@pytest.mark.parametrize(
    "change",
    [
        {"shape": [16, 4]},
        {"torch_dtype": "bfloat16"},
        {"chunks": [2, 4]},
        {"codec": "zstd"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_parts_disagreeing_on_an_array_are_rejected(change: dict[str, object]) -> None:
    parts = make_parts((8, 4), (4, 4), num_nodes=2, per_node=1)
    assert all(p.arrays[0].name == "w" for p in parts)
    arrays = list(parts[1].arrays)
    arrays[0] = msgspec.structs.replace(arrays[0], **change)
    parts[1] = msgspec.structs.replace(parts[1], arrays=arrays)
    with pytest.raises(ShardLayoutError, match="disagree"):
        merge_parts(parts)


@pytest.mark.parametrize(
    "change", [{"step": 8}, {"world_size": 3}, {"num_nodes": 3}], ids=lambda c: next(iter(c))
)
def test_parts_of_different_saves_are_rejected(change: dict[str, object]) -> None:
    parts = make_parts((8, 4), (4, 4), num_nodes=2, per_node=1)
    parts[1] = msgspec.structs.replace(parts[1], **change)
    with pytest.raises(ShardLayoutError, match="disagree"):
        merge_parts(parts)


def test_no_parts_is_an_error() -> None:
    with pytest.raises(ShardLayoutError):
        merge_parts([])


def test_part_manifest_json_round_trip() -> None:
    part = make_parts((6, 5), (4, 5), num_nodes=1, per_node=2)[0]
    assert fmt.decode_part(fmt.encode_json(part)) == part


# --- names ----------------------------------------------------------------------------------------
@given(st.integers(min_value=0, max_value=10**12))
def test_step_dir_round_trips(step: int) -> None:
    assert fmt.parse_step_dir(fmt.step_dir(step)) == step


@pytest.mark.parametrize(
    "name",
    ["step_", "step_x", "step_-1", "xstep_1", "step_1/", "step_1\n", "step_01", "step_\u0663", "latest"],
    ids=repr,
)
def test_parse_step_dir_ignores_other_names(name: str) -> None:
    assert fmt.parse_step_dir(name) is None


@given(st.text(max_size=12))
def test_a_parsed_step_dir_names_itself(name: str) -> None:
    step = fmt.parse_step_dir(name)
    assert step is None or fmt.step_dir(step) == name


def test_negative_step_is_rejected() -> None:
    with pytest.raises(InvalidKeyError):
        fmt.step_dir(-1)
