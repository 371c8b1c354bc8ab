"""RotaryCacheUpdate and SwiGLU on the CPU (Note [RotaryCacheUpdate], Note [SwiGLU] in
custom_ops/include/ortkv/rotary_cache_update.h) against the numpy oracles, every refusal with its message and
the caches' bytes untouched, and the graph tooling's description of both ops."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from conftest import digest, ort_session
from ortkv import _ortkv
from ortkv.graph import check, check_aliases, make_rotary_cache_update, make_swiglu, mark_mutable, set_alias_of
from ortkv.reference import rotary_cache_update_ref, rotary_interleaved_ref, swiglu_ref

# seq_axis -> the caches' shape from (B, Hkv, capacity, D)
LAYOUTS = {-2: lambda b, h, c, d: (b, h, c, d), 2: lambda b, h, c, d: (b, h, c, d),
           1: lambda b, h, c, d: (b, c, h, d), 0: lambda b, h, c, d: (c, b, h, d)}
OPSETS = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("ortkv", 1)]


def rotary_model(heads, kv_heads, seq_axis=-2, onnx_type=TP.FLOAT, *, vector=True, annotate=True):
    node = make_rotary_cache_update("qkv", "k", "v", "pos", "cos", "sin", "q", "k_out", "v_out", name="rcu",
                                    num_heads=heads, kv_num_heads=kv_heads, seq_axis=seq_axis)
    kv = ["c0", "c1", "c2", "c3"]
    g = helper.make_graph([node], "rcu", [helper.make_tensor_value_info("qkv", onnx_type, ["B", "T", "W"]),
                                          helper.make_tensor_value_info("k", onnx_type, kv),
                                          helper.make_tensor_value_info("v", onnx_type, kv),
                                          helper.make_tensor_value_info("pos", TP.INT64, ["B"] if vector else []),
                                          helper.make_tensor_value_info("cos", onnx_type, ["R", "half"]),
                                          helper.make_tensor_value_info("sin", onnx_type, ["R", "half"])],
                          [helper.make_tensor_value_info("q", onnx_type, ["B", "T", "Wq"]),
                           helper.make_tensor_value_info("k_out", onnx_type, kv),
                           helper.make_tensor_value_info("v_out", onnx_type, kv)])
    model = helper.make_model(g, opset_imports=OPSETS, ir_version=10)
    if annotate:
        for c in ("k", "v"):
            mark_mutable(model, c)
            set_alias_of(model, c + "_out", c)
    return model


def tables(rows, d, dtype=np.float32):
    inv = 10000.0 ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(rows, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def case(rng, B, T, H, Hkv, D, cap, seq_axis, vector, rows=None):
    qkv = rng.standard_normal((B, T, (H + 2 * Hkv) * D)).astype(np.float32)
    shape = LAYOUTS[seq_axis](B, Hkv, cap, D)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    pos = rng.integers(0, cap - T + 1, size=B).astype(np.int64) if vector else np.int64(cap - T)
    cos, sin = tables(cap if rows is None else rows, D)
    return qkv, k, v, pos, cos, sin


def run(sess, qkv, k, v, pos, cos, sin, *, k_out=None, v_out=None, q_out=None):
    """One run with k / v bound as their own outputs (or the given buffers); returns q_rot."""
    io = sess.io_binding()
    for name, a in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        io.bind_cpu_input(name, np.ascontiguousarray(a))
    io.bind_cpu_input("pos", np.asarray(pos, np.int64))
    io.bind_input("k", "cpu", 0, TP.FLOAT, list(k.shape), k.ctypes.data)
    io.bind_input("v", "cpu", 0, TP.FLOAT, list(v.shape), v.ctypes.data)
    ko = k if k_out is None else k_out
    vo = v if v_out is None else v_out
    if q_out is None:  # bound first: get_outputs() lists the outputs in binding order
        io.bind_output("q", "cpu")
    else:
        io.bind_output("q", "cpu", 0, TP.FLOAT, list(q_out.shape), q_out.ctypes.data)
    io.bind_output("k_out", "cpu", 0, TP.FLOAT, list(ko.shape), ko.ctypes.data)
    io.bind_output("v_out", "cpu", 0, TP.FLOAT, list(vo.shape), vo.ctypes.data)
    sess.run_with_iobinding(io)
    return io.get_outputs()[0].numpy()


def written_mask(shape, pos, T, seq_axis):
    """True where the op may write (the new tokens' slots of every row and head)."""
    mark = np.zeros(shape, np.float32)
    B = shape[1] if seq_axis == 0 else shape[0]
    Hkv, D = (shape[1], shape[3]) if seq_axis in (-2, 2) else (shape[2], shape[3])
    ones = np.ones(LAYOUTS[seq_axis](B, Hkv, T, D), np.float32)
    from ortkv.reference import cache_update_ref

    return cache_update_ref(mark, ones, pos, seq_axis).astype(bool)


@pytest.mark.parametrize("seq_axis", [-2, 2, 1, 0])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("vector", [True, False])
def test_matches_reference(rng, seq_axis, T, heads, vector):
    H, Hkv = heads
    B, D, cap = 3, 8, 12
    qkv, k, v, pos, cos, sin = case(rng, B, T, H, Hkv, D, cap, seq_axis, vector)
    q_ref, k_ref, v_ref = rotary_cache_update_ref(qkv, k, v, pos, cos, sin, H, Hkv, seq_axis)
    k0, v0 = k.copy(), v.copy()
    mask = written_mask(k.shape, pos, T, seq_axis)
    assert mask.sum() == B * T * Hkv * D
    q = run(ort_session(rotary_model(H, Hkv, seq_axis, vector=vector)), qkv, k, v, pos, cos, sin)
    np.testing.assert_allclose(q, q_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k, k_ref, rtol=1e-6, atol=1e-6)
    assert v.tobytes() == v_ref.tobytes()  # v is copied, not computed
    assert k[~mask].tobytes() == k0[~mask].tobytes() and v[~mask].tobytes() == v0[~mask].tobytes()
    assert not np.array_equal(k[mask], k0[mask])


def test_positions_near_capacity_and_a_long_prefill(rng):
    """The last slots of the caches, and a prefill of 70 tokens (more than one task of the thread pool)."""
    H, Hkv, D = 9, 3, 64
    sess = ort_session(rotary_model(H, Hkv, 0))
    for B, T, cap, pos in ((2, 1, 16, np.array([15, 3])), (2, 70, 80, np.array([10, 0]))):
        qkv, k, v, _, cos, sin = case(rng, B, T, H, Hkv, D, cap, 0, True)
        q_ref, k_ref, v_ref = rotary_cache_update_ref(qkv, k, v, pos, cos, sin, H, Hkv, 0)
        q = run(sess, qkv, k, v, pos, cos, sin)
        np.testing.assert_allclose(q, q_ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(k, k_ref, rtol=1e-6, atol=1e-6)
        assert v.tobytes() == v_ref.tobytes()


def test_rotation_is_bitwise_ort_rotary_embedding(rng):
    """q_rot (and the cached k) equal com.microsoft.RotaryEmbedding(interleaved=1) bit for bit on the CPU: the
    fused decoder keeps the unfused one's greedy tokens (tests/test_generate.py)."""
    H, Hkv, D, B, T, cap = 9, 3, 64, 2, 7, 32
    qkv, k, v, _, cos, sin = case(rng, B, T, H, Hkv, D, cap, 1, True)
    qkv *= 30  # magnitudes of real activations
    pos = np.array([3, 20], np.int64)
    q = run(ort_session(rotary_model(H, Hkv, 1)), qkv, k, v, pos, cos, sin)
    pid = pos[:, None] + np.arange(T)[None, :]
    nodes = [helper.make_node("RotaryEmbedding", ["x", "pid", "cos", "sin"], ["y"], domain="com.microsoft",
                              interleaved=1, num_heads=H)]
    g = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info("x", TP.FLOAT, [B, T, H * D]),
                                          helper.make_tensor_value_info("pid", TP.INT64, [B, T])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [B, T, H * D])],
                          [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")])
    ort_q = ort_session(helper.make_model(g, opset_imports=OPSETS, ir_version=10)).run(
        None, {"x": np.ascontiguousarray(qkv[..., :H * D]), "pid": pid})[0]
    assert q.tobytes() == ort_q.tobytes()
    np.testing.assert_allclose(q, rotary_interleaved_ref(qkv[..., :H * D], pid, cos, sin, H), rtol=1e-5, atol=1e-5)


# --- refusals: message, and not one byte of either cache written ---------------------------------------
def _refused(sess, qkv, k, v, pos, cos, sin, pattern, **kw):
    before = digest(k), digest(v)
    with pytest.raises(Exception, match=pattern):
        run(sess, qkv, k, v, pos, cos, sin, **kw)
    assert (digest(k), digest(v)) == before


def test_capacity_and_negative_positions_refused(rng):
    qkv, k, v, _, cos, sin = case(rng, 2, 3, 4, 2, 8, 8, -2, True)
    sess = ort_session(rotary_model(4, 2, -2))
    _refused(sess, qkv, k, v, np.array([0, 6]), cos, sin,
             r"E_CAPACITY.*RotaryCacheUpdate node 'rcu': row 1: position 6 \+ n 3 = 9 exceeds capacity 8 of 'k'.*"
             r"Nothing was written")
    _refused(sess, qkv, k, v, np.array([-1, 0]), cos, sin,
             r"E_INPUT.*RotaryCacheUpdate node 'rcu': position -1 for row 0 of 'k' is negative")
    _refused(sess, qkv, k, v, np.array([0, 0, 0]), cos, sin, r"'pos' has 3 entries but 'k' has batch size 2")


def test_alias_refused(rng):
    qkv, k, v, pos, cos, sin = case(rng, 2, 1, 4, 2, 8, 8, 1, True)
    sess = ort_session(rotary_model(4, 2, 1))
    other = v.copy()
    _refused(sess, qkv, k, v, pos, cos, sin,
             r"E_ALIAS.*RotaryCacheUpdate node 'rcu': output 'v_out' at 0x[0-9a-f]+ is not the storage of input 'v'",
             v_out=other)
    assert other.tobytes() == v.tobytes()
    _refused(sess, qkv, k, v, pos, cos, sin, r"E_ALIAS.*output 'k_out'.*not the storage of input 'k'",
             k_out=k.copy())
    q_on_cache = k.reshape(-1)[: 2 * 1 * 4 * 8].reshape(2, 1, 32)
    _refused(sess, qkv, k, v, pos, cos, sin, r"output 'q' at 0x[0-9a-f]+ overlaps the cache 'k'", q_out=q_on_cache)


def test_shape_and_type_errors_refused(rng):
    qkv, k, v, pos, cos, sin = case(rng, 2, 1, 4, 2, 8, 8, -2, True)
    sess = ort_session(rotary_model(4, 2, -2))
    _refused(sess, qkv[..., :-2].copy(), k, v, pos, cos, sin,
             r"'qkv' has shape \[2, 1, 62\]; it must be \[batch, tokens, \(num_heads \+ 2 kv_num_heads\) \* "
             r"head_size\] = \[batch, tokens, 8 \* head_size\]")
    bad_heads = np.zeros((2, 3, 8, 8), np.float32)
    _refused(sess, qkv, bad_heads, bad_heads.copy(), pos, cos, sin,
             r"cache 'k' has shape \[2, 3, 8, 8\]; it must be BNSH \[batch, kv_heads, capacity, head_size\] "
             r"\(seq_axis -2\) with batch 2, kv_heads 2 and head_size 8")
    _refused(sess, qkv, k, v, pos, cos[:5].copy(), sin[:5].copy(),
             r"rotary table 'cos' has shape \[5, 4\]; it must be \[rows, head_size / 2\] = \[rows, 4\] with rows >= "
             r"the caches' capacity 8")
    _refused(sess, qkv, k, v, pos, cos, sin[:, :2].copy(), r"rotary table 'sin' has shape \[8, 2\]")
    _refused(sess, qkv, k, v[:, :, :6].copy(), pos, cos, sin, r"cache 'v' has shape \[2, 2, 6, 8\] but 'k' has")
    same = k  # one buffer bound as both caches
    before = digest(k)
    with pytest.raises(Exception, match=r"caches 'k' and 'v' share memory"):
        run(sess, qkv, k, same, pos, cos, sin)
    assert digest(k) == before


def test_float16_refused_on_the_cpu(rng):
    sess = ort_session(rotary_model(4, 2, -2, TP.FLOAT16))
    qkv, k, v, pos, cos, sin = [a.astype(np.float16) for a in case(rng, 1, 1, 4, 2, 8, 8, -2, True)[:3]] + [None] * 3
    cos, sin = tables(8, 8, np.float16)
    pos = np.array([0], np.int64)
    before = digest(k), digest(v)
    io = sess.io_binding()
    for name, a in (("qkv", qkv), ("cos", cos), ("sin", sin), ("pos", pos)):
        io.bind_cpu_input(name, a)
    for name, a in (("k", k), ("v", v)):
        io.bind_input(name, "cpu", 0, TP.FLOAT16, list(a.shape), a.ctypes.data)
        io.bind_output(name + "_out", "cpu", 0, TP.FLOAT16, list(a.shape), a.ctypes.data)
    io.bind_output("q", "cpu")
    with pytest.raises(Exception, match=r"input 'qkv' is float16; the CPU kernel takes float32"):
        sess.run_with_iobinding(io)
    assert (digest(k), digest(v)) == before


def test_write_protected_rows_refused(rng):
    qkv, k, v, pos, cos, sin = case(rng, 1, 1, 4, 2, 8, 8, -2, True)
    pos = np.array([2])
    sess = ort_session(rotary_model(4, 2, -2))
    # value cache, head 1, token 2 is read-only (32 bytes)
    rid = _ortkv.protect_range(_ortkv.DEVICE_CPU, 0, v.ctypes.data + (8 + 2) * 8 * 4, 32, "shared prefix")
    try:
        _refused(sess, qkv, k, v, pos, cos, sin, r"E_READONLY.*RotaryCacheUpdate node 'rcu': row 0 of 'v' would write")
        run(sess, qkv, k, v, np.array([3]), cos, sin)  # token 3 is not protected
    finally:
        assert _ortkv.unprotect_range(rid)


def test_mutable_cache_session_runs_and_checks_both_aliases(rng):
    H, Hkv, D, cap = 4, 2, 8, 16
    qkv, k, v, pos, cos, sin = case(rng, 2, 1, H, Hkv, D, cap, 0, True)
    q_ref, k_ref, v_ref = rotary_cache_update_ref(qkv, k, v, pos, cos, sin, H, Hkv, 0)
    s = ortkv.MutableCacheSession(rotary_model(H, Hkv, 0))
    assert sorted(s.caches) == ["k", "v"]
    assert s.aliased_outputs("k") == ["k_out"] and s.aliased_outputs("v") == ["v_out"]
    s.bind_cache("k", k)
    s.bind_cache("v", v)
    q = s.run(["q"], {"qkv": qkv, "pos": pos, "cos": cos, "sin": sin})[0]
    np.testing.assert_allclose(q, q_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k, k_ref, rtol=1e-6, atol=1e-6)
    assert v.tobytes() == v_ref.tobytes()


# --- the graph tooling ----------------------------------------------------------------------------------
def test_checker_describes_the_op():
    model = rotary_model(9, 3, 0)
    assert not [f for f in check_aliases(model) if f.severity == "error"]
    assert check(model, plan=False).ok
    unmarked = rotary_model(9, 3, 0, annotate=False)  # aliases come from the op contract, annotated or not
    rules = {f.rule for f in check_aliases(unmarked) if f.severity == "error"}
    assert rules, "an unannotated RotaryCacheUpdate writes two unmarked inputs: the checker must refuse it"


def test_shape_rules_find_what_the_kernel_refuses():
    model = rotary_model(9, 3, -2)
    g = model.graph
    g.input[0].CopyFrom(helper.make_tensor_value_info("qkv", TP.FLOAT, [1, 1, 15 * 64 + 2]))
    report = check(model, plan=False)
    assert not report.ok
    assert any("'qkv' width 962 must be (num_heads + 2 kv_num_heads) * head_size" in f.message
               for f in report.findings), report.findings
    model = rotary_model(9, 3, -2)
    g = model.graph
    g.input[0].CopyFrom(helper.make_tensor_value_info("qkv", TP.FLOAT, [1, 1, 15 * 64]))
    g.input[1].CopyFrom(helper.make_tensor_value_info("k", TP.FLOAT, [1, 3, 64, 64]))
    g.input[4].CopyFrom(helper.make_tensor_value_info("cos", TP.FLOAT, [32, 32]))
    report = check(model, plan=False)
    assert any("rotary table 'cos' has 32 rows but the caches hold 64 positions" in f.message
               for f in report.findings), report.findings
    ok = rotary_model(9, 3, -2)
    ok.graph.input[0].CopyFrom(helper.make_tensor_value_info("qkv", TP.FLOAT, ["B", 1, 15 * 64]))
    assert check(ok, plan=False).ok


# --- SwiGLU ---------------------------------------------------------------------------------------------
def swiglu_model(onnx_type=TP.FLOAT, shape=("B", "T", "W")):
    g = helper.make_graph([make_swiglu("x", "y", name="act")], "swiglu",
                          [helper.make_tensor_value_info("x", onnx_type, list(shape))],
                          [helper.make_tensor_value_info("y", onnx_type, None)])
    return helper.make_model(g, opset_imports=OPSETS, ir_version=10)


@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (3, 5, 2 * 24), (70, 2 * 1100), (2,)])
def test_swiglu_matches_reference(rng, shape):
    x = (rng.standard_normal(shape) * 6).astype(np.float32)
    y = ort_session(swiglu_model(shape=[f"d{i}" for i in range(len(shape))])).run(None, {"x": x})[0]
    assert y.shape == shape[:-1] + (shape[-1] // 2,)
    np.testing.assert_allclose(y, swiglu_ref(x), rtol=2e-6, atol=1e-6)


def test_swiglu_close_to_the_unfused_graph(rng):
    """Against Split + x * Sigmoid(x) (ORT fuses it into QuickGelu) + Mul on the CPU: MLAS's logistic is an
    approximation (relative errors up to ~8 % where sigmoid(g) < 1e-4, absolute ones below 1e-5 here), so close,
    not bit for bit; SwiGLU's own accuracy is tested against float64 above."""
    F = 64
    x = (rng.standard_normal((4, 2 * F)) * 6).astype(np.float32)
    nodes = [helper.make_node("Split", ["x", "split"], ["g", "u"], axis=-1),
             helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["g", "s"], ["gs"]),
             helper.make_node("Mul", ["gs", "u"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TP.FLOAT, [4, 2 * F])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [4, F])],
                          [numpy_helper.from_array(np.array([F, F], np.int64), "split")])
    unfused = ort_session(helper.make_model(g, opset_imports=OPSETS, ir_version=10)).run(None, {"x": x})[0]
    fused = ort_session(swiglu_model(shape=[4, 2 * F])).run(None, {"x": x})[0]
    np.testing.assert_allclose(fused, unfused, rtol=1e-5, atol=1e-5)


def test_swiglu_errors():
    with pytest.raises(Exception, match=r"SwiGLU node 'act': input 'x' has shape \[2, 7\]; its last dim must be 2 \* F"):
        ort_session(swiglu_model(shape=["a", "b"])).run(None, {"x": np.zeros((2, 7), np.float32)})
    with pytest.raises(Exception, match=r"SwiGLU node 'act': input 'x' is float16; the CPU kernel takes float32"):
        ort_session(swiglu_model(TP.FLOAT16, shape=["a", "b"])).run(None, {"x": np.zeros((2, 8), np.float16)})
    report = check(swiglu_model(shape=[2, 7]), plan=False)
    assert any("odd last dim 7" in f.message for f in report.findings), report.findings
