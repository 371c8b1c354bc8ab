"""CacheAttention (CPU) against the numpy oracle: GQA ratios, decode and prefill, rows of different
lengths in one batch, both cache layouts; and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from conftest import ort_session
from ortkv.graph import make_cache_attention
from ortkv.reference import cache_attention_ref


def _model(num_heads, kv_heads, seq_axis=1, vector=True):
    node = make_cache_attention("q", "k", "v", "start", "out", name="attn", num_heads=num_heads,
                                kv_num_heads=kv_heads, seq_axis=seq_axis)
    kv = ["B", "C", "H", "D"] if seq_axis == 1 else ["B", "H", "C", "D"]
    g = helper.make_graph([node], "attn", [helper.make_tensor_value_info("q", TP.FLOAT, ["B", "T", "W"]),
                                           helper.make_tensor_value_info("k", TP.FLOAT, kv),
                                           helper.make_tensor_value_info("v", TP.FLOAT, kv),
                                           helper.make_tensor_value_info("start", TP.INT64, ["B"] if vector else [])],
                          [helper.make_tensor_value_info("out", TP.FLOAT, ["B", "T", "W"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("seq_axis", [1, 2])
def test_matches_reference(rng, heads, kv_heads, T, seq_axis):
    B, C, D = 3, 40, 16
    start = np.array([0, 13, 40 - T])  # empty row, middle, last slot
    q = rng.standard_normal((B, T, heads * D), dtype=np.float32)
    shape = (B, C, kv_heads, D) if seq_axis == 1 else (B, kv_heads, C, D)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    sess = ort_session(_model(heads, kv_heads, seq_axis))
    (out,) = sess.run(None, {"q": q, "k": k, "v": v, "start": start})
    np.testing.assert_allclose(out, cache_attention_ref(q, k, v, start, heads, kv_heads, seq_axis=seq_axis),
                               rtol=2e-5, atol=2e-5)


def test_reads_only_valid_prefix(rng):
    """Keys past a row's valid length are never read: poisoning them with NaN changes nothing."""
    B, C, H, D = 2, 32, 2, 8
    k = rng.standard_normal((B, C, H, D), dtype=np.float32)
    v = rng.standard_normal((B, C, H, D), dtype=np.float32)
    start = np.array([5, 20])
    k[0, 6:], v[0, 6:], k[1, 21:], v[1, 21:] = np.nan, np.nan, np.nan, np.nan
    q = rng.standard_normal((B, 1, 2 * H * D), dtype=np.float32)
    (out,) = ort_session(_model(2 * H, H)).run(None, {"q": q, "k": k, "v": v, "start": start})
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, cache_attention_ref(q, k, v, start, 2 * H, H), rtol=2e-5, atol=2e-5)


def test_scalar_start(rng):
    q = rng.standard_normal((2, 3, 32), dtype=np.float32)
    k = rng.standard_normal((2, 10, 2, 16), dtype=np.float32)
    v = rng.standard_normal((2, 10, 2, 16), dtype=np.float32)
    (out,) = ort_session(_model(2, 2, vector=False)).run(None, {"q": q, "k": k, "v": v, "start": np.array(4)})
    np.testing.assert_allclose(out, cache_attention_ref(q, k, v, 4, 2, 2), rtol=2e-5, atol=2e-5)


def test_refusals(rng):
    q = rng.standard_normal((1, 4, 32), dtype=np.float32)
    k = rng.standard_normal((1, 10, 2, 16), dtype=np.float32)
    sess = ort_session(_model(2, 2))
    with pytest.raises(Exception, match=r"E_CAPACITY.*position 8 \+ n 4 = 12 exceeds capacity 10 of 'k'"):
        sess.run(None, {"q": q, "k": k, "v": k, "start": np.array([8])})
    with pytest.raises(Exception, match=r"E_INPUT.*start -1 for row 0 is negative"):
        sess.run(None, {"q": q, "k": k, "v": k, "start": np.array([-1])})
    bad = ort_session(_model(3, 2))
    with pytest.raises(Exception, match=r"num_heads 3 must be a positive multiple of kv_num_heads 2"):
        bad.run(None, {"q": rng.standard_normal((1, 1, 48), dtype=np.float32), "k": k, "v": k, "start": np.array([0])})
    with pytest.raises(Exception, match=r"query width of num_heads \* D = 32"):
        sess.run(None, {"q": rng.standard_normal((1, 1, 30), dtype=np.float32), "k": k, "v": k, "start": np.array([0])})
