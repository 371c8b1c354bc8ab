"""SBNH (seq_axis 0: [capacity, batch, kv_heads, head_size], token-major) on the CPU: CacheUpdate and
CacheAttention against the numpy oracle, the refusals, and the graph checker's rules for the layout
(Note [CacheUpdate SBNH])."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from conftest import DTYPES, cache_attention_model, cache_update_model, ort_session, run_bound
from ortkv.graph import check, check_model, make_cache_attention, make_cache_update, mark_mutable, set_alias_of
from ortkv.reference import cache_attention_ref, cache_update_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("vector", [False, True])
def test_update_sbnh_matches_oracle(rng, dtype, n, vector):
    np_type, onnx_type = DTYPES[dtype]
    C, B, H, D = 10, 4, 3, 8
    cache = rng.standard_normal((C, B, H, D)).astype(np.float32).astype(np_type)
    values = rng.standard_normal((n, B, H, D)).astype(np.float32).astype(np_type)
    position = rng.integers(0, C - n + 1, size=B) if vector else np.int64(C - n)
    expected = cache_update_ref(cache, values, position, 0)
    assert expected.tobytes() != cache.tobytes()
    sess = ort_session(cache_update_model(onnx_type, 4, 0, vector_position=vector))
    assert run_bound(sess, cache, values, position, onnx_type) == cache.ctypes.data
    assert cache.tobytes() == expected.tobytes()


def test_update_sbnh_token_prefix_holds_every_row():
    """The point of the layout: after writing P tokens to every row, bytes [0, P * batch * token) of
    the cache hold all of them and nothing else was touched."""
    C, B, H, D, P = 8, 3, 2, 4, 5
    cache = np.zeros((C, B, H, D), np.float32)
    values = np.ones((P, B, H, D), np.float32)
    run_bound(ort_session(cache_update_model(TP.FLOAT, 4, 0, vector_position=True)), cache, values,
              np.zeros(B, np.int64), TP.FLOAT)
    flat = cache.reshape(-1)
    assert (flat[:P * B * H * D] == 1).all() and (flat[P * B * H * D:] == 0).all()


def test_update_sbnh_refusals_leave_cache_unchanged(rng):
    cache = rng.standard_normal((6, 2, 2, 4)).astype(np.float32)
    before = cache.tobytes()
    sess = ort_session(cache_update_model(TP.FLOAT, 4, 0, vector_position=True))
    with pytest.raises(Exception, match=r"E_CAPACITY.*row 1: position 4 \+ n 3 = 7 exceeds capacity 6"):
        run_bound(sess, cache, np.ones((3, 2, 2, 4), np.float32), np.array([0, 4]), TP.FLOAT)
    with pytest.raises(Exception, match=r"has 3 entries but 'cache' has batch size 2 \(axis 1 of shape"):
        run_bound(sess, cache, np.ones((1, 2, 2, 4), np.float32), np.array([0, 1, 2]), TP.FLOAT)
    assert cache.tobytes() == before


@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("T", [1, 5])
def test_attention_sbnh_matches_oracle_and_ignores_tails(rng, heads, T):
    Hq, Hkv = heads
    B, C, D = 3, 700, 64  # 700 keys: the split-K path for one-token decode
    start = np.array([0, 333, C - T])
    q = rng.standard_normal((B, T, Hq * D), dtype=np.float32)
    k = rng.standard_normal((C, B, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((C, B, Hkv, D), dtype=np.float32)
    for b in range(B):  # NaN past each row's valid length: must never be read
        k[start[b] + T:, b] = np.nan
        v[start[b] + T:, b] = np.nan
    (out,) = ort_session(cache_attention_model(Hq, Hkv, 0)).run(None, {"q": q, "k": k, "v": v, "start": start})
    expected = cache_attention_ref(q, k, v, start, Hq, Hkv, seq_axis=0)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-5)


def test_attention_sbnh_batch_mismatch_refused(rng):
    q = np.zeros((3, 1, 64), np.float32)
    k = np.zeros((8, 2, 1, 64), np.float32)  # batch 2 on axis 1
    with pytest.raises(Exception, match=r"holds batch 2, 1 KV heads of size 64; expected batch 3"):
        ort_session(cache_attention_model(1, 1, 0)).run(None, {"q": q, "k": k, "v": k, "start": np.zeros(3, np.int64)})


def _decode_model(layout_ok=True):
    kv = ["C", "B", 3, 64]
    nodes = [make_cache_update("k", "k_new", "position", "k_out", name="upd_k", seq_axis=0),
             make_cache_update("v", "v_new", "position", "v_out", name="upd_v", seq_axis=0),
             make_cache_attention("q", "k_out", "v_out", "position", "out", name="attn", num_heads=9,
                                  kv_num_heads=3, seq_axis=0 if layout_ok else 1)]
    ins = [helper.make_tensor_value_info("q", TP.FLOAT, ["B", "T", 576]),
           helper.make_tensor_value_info("k", TP.FLOAT, kv), helper.make_tensor_value_info("v", TP.FLOAT, kv),
           helper.make_tensor_value_info("k_new", TP.FLOAT, ["T", "B", 3, 64]),
           helper.make_tensor_value_info("v_new", TP.FLOAT, ["T", "B", 3, 64]),
           helper.make_tensor_value_info("position", TP.INT64, ["B"])]
    outs = [helper.make_tensor_value_info("out", TP.FLOAT, ["B", "T", 576]),
            helper.make_tensor_value_info("k_out", TP.FLOAT, kv),
            helper.make_tensor_value_info("v_out", TP.FLOAT, kv)]
    model = helper.make_model(helper.make_graph(nodes, "decode", ins, outs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                              ir_version=10)
    for name in ("k", "v"):
        mark_mutable(model, name)
        set_alias_of(model, name + "_out", name)
    return model


def _errors(model, **dims):
    return [f for f in check(model, dims=dims or None, plan=False).findings if f.severity == "error"]


def test_checker_accepts_sbnh_decode_model():
    check_model(_decode_model())
    assert _errors(_decode_model()) == []
    assert _errors(_decode_model(), C=16, B=2, T=1) == []


def test_checker_reads_the_sbnh_batch_on_axis_1():
    """The rules take the SBNH cache's batch from axis 1: a query of batch 3 over caches of batch 2 is
    an error (with the rules of BSNH, axis 0 would have been read: 16 against 3)."""
    model = _decode_model()
    for vi in model.graph.input:
        if vi.name in ("k", "v"):
            vi.type.tensor_type.shape.dim[0].dim_value = 16
            vi.type.tensor_type.shape.dim[1].dim_value = 2
        if vi.name == "q":
            vi.type.tensor_type.shape.dim[0].dim_value = 3
    msgs = [f.message for f in _errors(model)]
    assert any("dim 0 of 'q'" in m and "is 3 but dim 1 of 'k_out'" in m and "is 2 (batch)" in m for m in msgs), msgs


def test_cpu_attention_float16_refused_not_cast():
    """Note [CacheAttention CPU types]: a float16 CacheAttention on the CPU provider is refused by the
    kernel with a named error; ORT must not wrap it in Casts (a float32 copy of the caches per run)."""
    node = make_cache_attention("q", "k", "v", "start", "out", name="att", num_heads=4, kv_num_heads=2)
    f16 = lambda n, s: helper.make_tensor_value_info(n, TP.FLOAT16, s)  # noqa: E731
    g = helper.make_graph([node], "g", [f16("q", [2, 1, 16]), f16("k", [2, 8, 2, 4]), f16("v", [2, 8, 2, 4]),
                                        helper.make_tensor_value_info("start", TP.INT64, [])],
                          [f16("out", [2, 1, 16])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                          ir_version=10)
    sess = ort_session(m)
    kv = np.ones((2, 8, 2, 4), np.float16)
    with pytest.raises(Exception, match=r"E_INPUT.*CacheAttention node 'att': query, key and value must be float32 "
                                        r"on the CPU \(got float16, float16, float16\)"):
        sess.run(None, {"q": np.ones((2, 1, 16), np.float16), "k": kv, "v": kv, "start": np.array(3)})
