"""The Megatron layout sidecar schema (ckptd.writer.layout): pure, torch-free, versioned, and able to read
the sidecars earlier releases wrote."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from ckptd.writer.errors import CorruptCheckpointError, InvalidRequestError
from ckptd.writer.format import sidecar_name
from ckptd.writer.layout import (
    BucketLayout,
    BufferLayout,
    MegatronLayout,
    ModelPiece,
    ParamLayout,
    decode_layout,
    encode_layout,
)

# Written by the hand-written JSON encoder of ckptd.client.megatron.MegatronLayout.to_json before the
# layout became a msgspec schema (json.dumps(asdict(layout), sort_keys=True, separators=(",", ":"))):
# a SwiGLU-style param with two pieces, a param this DP rank owns no slice of (group index null), bf16.
OLD_SIDECAR = (
    '{"buffers":[{"buckets":[{"end":3072,"index":0,"numel_unpadded":3072,"params":[{"bucket_id":0,"end":1024,'
    '"group_index":0,"group_order":3,"model_pieces":[{"global_offset":[0,0,0],"global_shape":[2,64,16],'
    '"key":"decoder.layers.mlp.linear_fc1.weight","prepend_axis_num":1,"replica_id":[0,0,0],"view_offset":0,'
    '"view_shape":[32,16],"view_stride":[16,1]},{"global_offset":[0,32,0],"global_shape":[2,64,16],'
    '"key":"decoder.layers.mlp.linear_fc1.weight","prepend_axis_num":1,"replica_id":[0,0,0],"view_offset":512,'
    '"view_shape":[32,16],"view_stride":[16,1]}],"name":"module.decoder.layers.0.mlp.linear_fc1.weight",'
    '"shape":[64,16],"start":0},{"bucket_id":0,"end":3072,"group_index":null,"group_order":null,"model_pieces":'
    '[{"global_offset":[0,0],"global_shape":[128,16],"key":"embedding.word_embeddings.weight","prepend_axis_num":0,'
    '"replica_id":[0,0,1],"view_offset":0,"view_shape":[128,16],"view_stride":[16,1]}],'
    '"name":"module.embedding.word_embeddings.weight","shape":[128,16],"start":1024}],"start":0}],"dp_rank":1,'
    '"dp_size":2,"gbuf_index":0,"grad_dtype":"float32","index":0,"is_expert":false,"model_chunk":0,'
    '"mp":"tp0.pp0","optimizer_index":0,"param_dtype":"bfloat16","replica_id":0}],"dp_rank":1,"dp_size":2,'
    '"megatron_core_version":"0.16.1","model_prefix":"model/","optim_prefix":"optim/","pp_rank":0,"pp_size":1,'
    '"tp_rank":0,"tp_size":1,"version":1}'
)


def _expected() -> MegatronLayout:
    key = "decoder.layers.mlp.linear_fc1.weight"
    p1 = ModelPiece(key, (2, 64, 16), (0, 0, 0), 1, 0, (32, 16), (16, 1), (0, 0, 0))
    p2 = ModelPiece(key, (2, 64, 16), (0, 32, 0), 1, 512, (32, 16), (16, 1), (0, 0, 0))
    q = ModelPiece("embedding.word_embeddings.weight", (128, 16), (0, 0), 0, 0, (128, 16), (16, 1), (0, 0, 1))
    pa = ParamLayout("module.decoder.layers.0.mlp.linear_fc1.weight", 0, 1024, 0, (64, 16), (p1, p2), 0, 3)
    pb = ParamLayout("module.embedding.word_embeddings.weight", 1024, 3072, 0, (128, 16), (q,), None, None)
    bucket = BucketLayout(0, 0, 3072, 3072, (pa, pb))
    buf = BufferLayout(0, 0, 0, 0, "bfloat16", "float32", False, "tp0.pp0", 2, 1, 0, (bucket,))
    return MegatronLayout(0, 1, 0, 1, 1, 2, (buf,), megatron_core_version="0.16.1")


def test_old_sidecar_decodes_and_reencodes_byte_identically() -> None:
    layout = decode_layout(OLD_SIDECAR)
    assert layout == _expected()
    assert MegatronLayout.from_json(OLD_SIDECAR.encode()) == layout
    # same bytes, so the same content address: a resumed run reuses the sidecar an older run stored
    assert encode_layout(layout) == layout.to_json() == OLD_SIDECAR
    assert sidecar_name(layout.to_json()) == hashlib.sha256(OLD_SIDECAR.encode()).hexdigest() + ".json"


def test_layout_arithmetic() -> None:
    layout = _expected()
    ((buf, bucket),) = list(layout.buckets())
    assert bucket.padded_numel == 3072 and buf.slice_numel(bucket) == 1536
    pa, pb = bucket.params
    assert buf.owned_range(bucket, pa) is None  # DP rank 1 owns [1536, 3072)
    assert buf.owned_range(bucket, pb) == ((0, 1536), (512, 2048))
    assert layout.bucket_key(buf, bucket, "exp_avg") == "optim/tp0.pp0/buf0/bucket0/exp_avg"
    assert layout.bucket_prefix(buf, bucket) == "optim/tp0.pp0/buf0/bucket0/"
    assert layout.model_key(pa.model_pieces[1].key) == "model/decoder.layers.mlp.linear_fc1.weight"
    assert pa.model_pieces[1].region() == (slice(0, 1), slice(32, 64), slice(0, 16))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (OLD_SIDECAR.replace('"version":1', '"version":2'), InvalidRequestError),
        (OLD_SIDECAR.replace(',"version":1', ""), InvalidRequestError),  # no version at all
        (OLD_SIDECAR.replace('"version":1', '"version":true'), InvalidRequestError),
        ("not json", CorruptCheckpointError),
        ("[1, 2]", CorruptCheckpointError),
        ('{"version": 1}', CorruptCheckpointError),  # right version, not a layout
        (OLD_SIDECAR.replace('"tp_rank":0', '"tp_rank":"zero"'), CorruptCheckpointError),
    ],
    ids=["version-2", "no-version", "version-bool", "garbage", "not-an-object", "empty", "wrong-type"],
)
def test_bad_sidecars_raise_typed_errors(text: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_layout(text)


def test_schema_imports_no_torch() -> None:
    code = "import sys, ckptd.writer.layout, ckptd.writer.format\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
