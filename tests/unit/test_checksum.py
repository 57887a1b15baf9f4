"""The chunk checksum: ckptd's crc32c gives the crc32c package's value (the one zarr's codec appends), in one
call or continued piece by piece, on every buffer type the read and write paths pass it."""

from __future__ import annotations

import crc32c as reference
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.writer import checksum
from ckptd.writer.checksum import crc32c


def test_the_fast_implementation_is_the_one_in_use() -> None:
    assert checksum.IMPLEMENTATION == "fastcrc"


def test_known_values() -> None:
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"abc") == reference.crc32c(b"abc")


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=5000), cuts=st.lists(st.integers(0, 5000), max_size=4))
def test_same_value_as_the_reference_whole_and_in_pieces(data: bytes, cuts: list[int]) -> None:
    want = reference.crc32c(data)
    assert crc32c(data) == want
    value, at = 0, 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        value = crc32c(memoryview(data)[at:cut], value)
        at = cut
    assert value == want


def test_large_numpy_views_and_a_flipped_bit() -> None:
    rng = np.random.default_rng(7)
    block = rng.integers(0, 256, size=(3 << 20) + 5, dtype=np.uint8)
    assert crc32c(block.data) == reference.crc32c(block.tobytes())
    assert crc32c(block[1:].data) == reference.crc32c(block[1:].tobytes())
    good = crc32c(block.data)
    block[1 << 20] ^= 0x10
    assert crc32c(block.data) != good


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
def test_combining_two_values_gives_the_value_of_the_joined_bytes(a: bytes, b: bytes) -> None:
    assert checksum.crc32c_combine(crc32c(a), crc32c(b), len(b)) == reference.crc32c(a + b)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=400), piece=st.integers(1, 64))
def test_a_chunk_sum_is_the_whole_value_and_each_piece_s(data: bytes, piece: int) -> None:
    old = checksum.PIECE_BYTES
    checksum.PIECE_BYTES = piece
    try:
        got = checksum.chunk_sum(memoryview(data))
    finally:
        checksum.PIECE_BYTES = old
    assert got.crc32c == reference.crc32c(data)
    want = [reference.crc32c(data[a : a + piece]) for a in range(0, len(data), piece)]
    assert got.pieces == (checksum.pack_pieces(want) if len(data) > piece else b"")
    assert [checksum.piece_value(got.pieces, i) for i in range(len(got.pieces) // 4)] == (want if got.pieces else [])
