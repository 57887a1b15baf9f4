"""Protocol fuzzing against a live ``ckptd serve``: random, truncated and hostile frames over many concurrent
connections never stop the daemon from serving, never touch a committed step, and leave its memory outside
the arena where it was.

Hypothesis draws batches of frames; each batch goes out at once over its own connections (one frame per
connection), while a well-behaved client keeps saving. Afterwards a normal client saves, the step commits
and reads back bit-exact, and the daemon's anonymous memory is back near its baseline.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NonInteractiveExampleWarning

from ckptd.client import CheckpointClient, Placement
from ckptd.client.protocol import DEFAULT_MAX_FRAME, HEADER, PROTOCOL_VERSION, decode_reply
from ckptd.client.reader import load
from ckptd.testing.fixtures import tree_digest
from ckptd.testing.launch import DaemonProcess

pytestmark = pytest.mark.timeout(600)

MiB = 1 << 20
# --- frame strategies ----------------------------------------------------------------------------------
U64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
SMALL = st.integers(min_value=-4, max_value=1 << 16)
INTS = st.one_of(SMALL, U64)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
KEYS = st.one_of(
    st.sampled_from(["w", "../x", "/etc/passwd", "a//b", "_parts/node-0.json", "COMMITTED", "latest", "", ".", "a/.."]),
    st.text(max_size=40),
    st.text(min_size=300, max_size=600),
)
DTYPES = st.one_of(
    st.sampled_from(["float32", "bfloat16", "int8", "bool", "complex64", "object", ""]), st.text(max_size=8)
)
SHAPES = st.lists(INTS, max_size=5)


def _shard_meta() -> st.SearchStrategy[dict[str, object]]:
    return st.fixed_dictionaries({
        "key": KEYS, "dtype": DTYPES, "global_shape": SHAPES, "global_offset": SHAPES, "shape": SHAPES,
        "chunk_shape": SHAPES, "slot": INTS,
    })


PLAIN = st.recursive(
    st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)
MESSAGES = st.one_of(
    st.fixed_dictionaries({"type": st.just("hello"), "v": st.just(PROTOCOL_VERSION), "pid": INTS, "rank": INTS}),
    st.fixed_dictionaries({
        "type": st.just("lease"), "v": st.just(PROTOCOL_VERSION), "step": INTS, "rank": INTS,
        "sizes": st.lists(st.one_of(st.integers(-8, 4096), U64), max_size=64), "timeout_s": FLOATS,
    }),
    st.fixed_dictionaries({
        "type": st.just("save"), "v": st.just(PROTOCOL_VERSION), "lease_id": INTS, "step": INTS, "rank": INTS,
        "world_size": INTS, "node": INTS, "num_nodes": INTS, "local_world_size": INTS,
        "shards": st.lists(_shard_meta(), max_size=4),
        "objects": st.dictionaries(st.text(max_size=8), PLAIN, max_size=3),
        "sidecars": st.dictionaries(st.text(max_size=70), st.text(max_size=30), max_size=2),
    }),
    st.fixed_dictionaries({"type": st.just("release"), "v": st.just(PROTOCOL_VERSION), "lease_id": INTS}),
    # a short wait: a long one only parks this connection, which the test does not wait for
    st.fixed_dictionaries({"type": st.just("status"), "v": st.just(PROTOCOL_VERSION), "step": INTS,
                           "wait_s": st.one_of(st.floats(-1, 0.2), st.just(float("nan")))}),
    st.dictionaries(st.text(max_size=10), PLAIN, max_size=6),  # anything at all
    st.fixed_dictionaries({"type": st.sampled_from(["hello", "lease", "save", "welcome", "error"]), "v": PLAIN}),
)


def _framed(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "garbage_body", "truncated", "huge_length", "hostile", "hostile_tail"]))
    if kind == "random":
        return draw(st.binary(max_size=256))
    if kind == "garbage_body":
        return _framed(draw(st.binary(max_size=512)))
    if kind == "huge_length":
        return HEADER.pack(draw(st.integers(DEFAULT_MAX_FRAME + 1, 2**32 - 1))) + draw(st.binary(max_size=16))
    body = msgspec.msgpack.encode(draw(MESSAGES))
    if kind == "truncated":
        return _framed(body)[: draw(st.integers(1, len(body) + 3))]
    if kind == "hostile_tail":  # a valid frame followed by junk on the same connection
        return _framed(body) + draw(st.binary(min_size=1, max_size=64))
    return _framed(body)


def _send(path: str, frame: bytes) -> str:
    """One connection, one frame: the outcome is a decoded reply type, 'closed' or 'silent'."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        s.connect(path)
        try:
            s.sendall(frame)
            header = s.recv(HEADER.size, socket.MSG_WAITALL)
            if len(header) < HEADER.size:
                return "closed"
            (n,) = HEADER.unpack(header)
            body = s.recv(n, socket.MSG_WAITALL)
            return type(decode_reply(body)).__name__
        except TimeoutError:
            return "silent"  # e.g. a truncated frame the daemon is still waiting to complete
        except (ConnectionResetError, BrokenPipeError):
            return "closed"


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


@pytest.fixture(scope="module")
def daemon(module_sockdir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, str]]:
    root = str(tmp_path_factory.mktemp("fuzz") / "ckpt")
    d = DaemonProcess(root, os.path.join(module_sockdir, "fuzz.sock"), "--arena-size", "64MiB", "--no-prefault",
                      "--part-timeout", "5", log_path=os.path.join(str(tmp_path_factory.getbasetemp()), "fuzz.log"))
    d.wait_ready()
    yield d, root
    d.stop(timeout=20)


def _send_batch(path: str, batch: list[bytes]) -> Counter[str]:
    """Every frame of ``batch`` at once, each over its own connection; how many of each outcome."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return Counter(pool.map(lambda f: _send(path, f), batch))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(frames(), min_size=4, max_size=24))
def test_fuzzed_frames_leave_daemon_serving(daemon: tuple[DaemonProcess, str], batch: list[bytes]) -> None:
    d, _root = daemon
    _send_batch(d.socket, batch)
    assert d.proc.poll() is None, "the daemon died"


def test_fuzzing_reached_the_decoder_and_the_handlers(daemon: tuple[DaemonProcess, str]) -> None:
    """The frames these strategies draw are not all dropped at the door: typed error replies and real replies
    both come back. Its own draw (derandomized: the same batches on every run), so it holds run alone too."""
    d, _root = daemon
    outcomes: Counter[str] = Counter()

    @settings(max_examples=12, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch=st.lists(frames(), min_size=4, max_size=24))
    def fuzz(batch: list[bytes]) -> None:
        outcomes.update(_send_batch(d.socket, batch))

    fuzz()
    assert d.proc.poll() is None, "the daemon died"
    assert outcomes["ErrorReply"] > 20, outcomes
    assert sum(n for k, n in outcomes.items() if k not in ("ErrorReply", "closed", "silent")) > 0, outcomes


def test_after_fuzzing_a_normal_client_saves_bit_exact(daemon: tuple[DaemonProcess, str]) -> None:
    """Runs after the fuzzing above (same module daemon): the daemon still serves, committed steps are
    untouched, and memory outside the arena is back near the baseline taken before more fuzzing."""
    d, root = daemon
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    w = torch.randn(1 << 16)
    client.save(1_000_001, {"w": w}).wait(60)
    committed = tree_digest(os.path.join(root, "step_1000001"))
    baseline = _rss_anon(d.proc.pid)

    # one more round of fuzzing, directly (no hypothesis shrinking), heavier on hostile and huge frames
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        batch = [frames().example() for _ in range(400)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda f: _send(d.socket, f), batch))
    assert d.proc.poll() is None, "the daemon died"

    x = torch.randn(3, 1000)
    client.save(1_000_002, {"w": w, "x": x}).wait(60)
    out = load(root, 1_000_002, {"w": torch.empty_like(w), "x": torch.empty_like(x)})
    assert torch.equal(out["w"], w) and torch.equal(out["x"], x)
    assert tree_digest(os.path.join(root, "step_1000001")) == committed, "a committed step changed"
    client.close()
    # allocator slack: the daemon frees what the connections held; fragmentation may keep a little
    deadline = time.monotonic() + 60  # the daemon gets there in its own time on a loaded runner
    while _rss_anon(d.proc.pid) > baseline + 24 * MiB and time.monotonic() < deadline:
        time.sleep(0.2)
    grown = _rss_anon(d.proc.pid) - baseline
    assert grown <= 24 * MiB, f"daemon memory outside the arena grew by {grown / MiB:.1f} MiB after fuzzing"
