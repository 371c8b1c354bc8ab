"""ortkv.MatMulQ4 (custom_ops/include/ortkv/matmul_q4.h): a Q4_1 matrix kept exactly, int8 activations.
Every ISA path (forced with the node attribute ``isa``) against a numpy reference of the same arithmetic
(the int8 activation quantization included: Note [MatMulQ4 arithmetic]) and, separately, against the exact
float product within the bound that quantization allows (|x^ - x| <= e / 2 per element); odd shapes, batch dims, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from conftest import cpu_flags, ort_session
from ortkv.generate import weights
from ortkv.graph import check

ISAS = ("scalar", "avx2", "avx512vnni")


FLAGS = cpu_flags()
RUNNABLE = {"scalar": True, "avx2": {"avx2", "fma", "f16c"} <= FLAGS,
            "avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"} <= FLAGS}


def isa_param(isa):
    return pytest.param(isa, marks=pytest.mark.skipif(not RUNNABLE[isa], reason=f"this CPU cannot run the {isa} path"))


def q4_1(rng, N, K, scale=0.02):
    """A random Q4_1 matrix as the GGUF has them: float16 d and m, levels straddling 0 (m ~ -8 d)."""
    kb = K // 32
    codes = rng.integers(0, 16, (N, kb, 32))
    d = (rng.random((N, kb)) * scale + 1e-3).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(4, 11, (N, kb))).astype(np.float16).astype(np.float32)
    return weights.Q4Weight((codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), d,
                            np.zeros((N, (kb + 1) // 2), np.uint8), K, N, 4, 32, mins=m)


def quantize_blocks(x: np.ndarray):
    """The kernel's activation quantization in float32, per block of 32: (a int, e float32)."""
    xb = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    a = np.rint((xb * inv).astype(np.float32)).astype(np.int64)
    e = (amax / np.float32(127)).astype(np.float32)
    return a, e


def activation_terms(x: np.ndarray, terms: int):
    """[(a, e)] per int8 term (Note [MatMulQ4 activation terms]): the second quantizes the first's residual."""
    x = np.asarray(x, np.float32)
    a1, e1 = quantize_blocks(x)
    parts = [(a1, e1)]
    if terms == 2:
        resid = (x.reshape(a1.shape) - e1 * a1.astype(np.float32)).astype(np.float32)
        parts.append(quantize_blocks(resid.reshape(x.shape)))
    return parts


def reference(x: np.ndarray, w: weights.Q4Weight, terms: int = 1) -> np.ndarray:
    """Note [MatMulQ4 arithmetic] in numpy: y = sum_b d e sum_i q a + m s with s = e sum(a) (the dequantized
    activations' block sum), the integer dots exact, the float terms in float64 (the kernel's float32 sums
    differ from these only by rounding)."""
    q = w.codes().astype(np.int64)  # [N, KB, 32]
    y = 0.0
    for a, e in activation_terms(x, terms):
        s = e[..., 0].astype(np.float64) * a.sum(-1)  # [..., KB]
        dots = np.einsum("...bi,nbi->...nb", a, q)  # exact integers
        y = y + s @ w.mins.T.astype(np.float64) + np.einsum(
            "...nb,nb,...b->...n", dots.astype(np.float64), w.scales.astype(np.float64), e[..., 0].astype(np.float64))
    return y


def model(w_pack, x_shape, isa=None, act_terms=None, K=None, N=None, name="mm", x_type=TP.FLOAT, inits=None):
    attrs = {"K": w_pack.K if K is None else K, "N": w_pack.N if N is None else N}
    if isa is not None:
        attrs["isa"] = isa
    if act_terms is not None:
        attrs["act_terms"] = act_terms
    node = helper.make_node("MatMulQ4", ["x", "codes", "scales", "mins"], ["y"], domain="ortkv", name=name, **attrs)
    inits = inits or [numpy_helper.from_array(w_pack.codes, "codes"), numpy_helper.from_array(w_pack.scales, "scales"),
                      numpy_helper.from_array(w_pack.mins, "mins")]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", x_type, x_shape)],
                          [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def session(m, threads=2):
    return ort_session(m, threads=threads)


def run(w, x, isa="auto", act_terms=None, threads=2):
    p = weights.pack_matmul_q4(w)
    (y,) = session(model(p, list(x.shape), isa, act_terms), threads).run(None, {"x": x})
    return y


# -- the layout -----------------------------------------------------------------------------------------------

def test_pack_is_the_documented_layout_and_exact():
    """Note [MatMulQ4 layout]: codes[t, b, g, c, j] = q[16t + c, b, 4g + j] | q[.., 16 + 4g + j] << 4; d and m
    float16 bit for bit; columns past N zero."""
    rng = np.random.default_rng(1)
    w = q4_1(rng, 37, 96)
    p = weights.pack_matmul_q4(w)
    assert p.codes.shape == (3, 3, 256) and p.codes.dtype == np.uint8
    assert p.scales.shape == p.mins.shape == (3, 3, 16) and p.scales.dtype == p.mins.dtype == np.float16
    q = w.codes()
    c5 = p.codes.reshape(3, 3, 4, 16, 4)
    for t, b, g, c, j in [(0, 0, 0, 0, 0), (1, 2, 3, 15, 3), (2, 1, 2, 4, 1), (0, 2, 1, 7, 2)]:
        n = 16 * t + c
        assert c5[t, b, g, c, j] == q[n, b, 4 * g + j] | (q[n, b, 16 + 4 * g + j] << 4)
        assert p.scales[t, b, c] == np.float16(w.scales[n, b]) and p.mins[t, b, c] == np.float16(w.mins[n, b])
    assert not c5[2, :, :, 5:].any() and not p.scales[2, :, 5:].any() and not p.mins[2, :, 5:].any()
    # every code round-trips
    un = np.stack([c5 & 0x0F, c5 >> 4], axis=2)  # [T, KB, 2, 4, 16, 4]
    back = un.transpose(0, 4, 1, 2, 3, 5).reshape(48, 3, 32)[:37]
    np.testing.assert_array_equal(back, q)


def test_pack_refuses_what_it_cannot_carry():
    rng = np.random.default_rng(2)
    w8 = weights.quantize_q8(np.ones((4, 64), np.float32))
    with pytest.raises(ortkv.OrtkvError, match=r"pack_matmul_q4 needs a Q4_1 matrix \(bits 4, block 32, minimums\); "
                                               r"got bits 8, block 32, minimums no"):
        weights.pack_matmul_q4(w8)
    w = q4_1(rng, 4, 64)
    w.scales = w.scales + np.float32(1e-7)  # not a float16 value any more
    with pytest.raises(ortkv.OrtkvError, match=r"a block scale or minimum is not a float16 value"):
        weights.pack_matmul_q4(w)
    w = q4_1(rng, 4, 64)
    w.zero_points = np.full_like(w.zero_points, 0x11)
    with pytest.raises(ortkv.OrtkvError, match=r"nonzero 4-bit zero points"):
        weights.pack_matmul_q4(w)


# -- the arithmetic, every path ---------------------------------------------------------------------------------

SHAPES = [  # (x shape, N): M = 1, 7, 64, batch dims; N a multiple of 16 and not; K from 32 to 1536
    ((1, 576), 960), ((7, 1536), 576), ((64, 96), 37), ((2, 3, 64), 20), ((1, 1, 32), 1), ((5, 576), 3072 + 3),
]


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS])
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("shape,N", SHAPES)
def test_matches_the_numpy_reference_of_the_same_arithmetic(isa, terms, shape, N):
    rng = np.random.default_rng(N + shape[-1] + terms)
    K = shape[-1]
    w = q4_1(rng, N, K)
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 3, shape[:-1] + (1,)).astype(np.float32)
    y = run(w, x, isa, terms)
    assert y.shape == shape[:-1] + (N,) and y.dtype == np.float32
    ref = reference(x, w, terms)
    # the same integer dots: only float32 rounding of ~K / 32 block terms apart
    scale = np.abs(x).reshape(-1, K).max() * np.abs(w.dequantize()).sum(0).max()
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * scale)


def _quantization_bound(x, w, terms):
    """y = x^ @ W, so |y - x @ W| <= sum_b e_last / 2 * sum_i |w_i| over the block (w = d q + m)."""
    e = activation_terms(x, terms)[-1][1]
    wabs = np.abs(w.dequantize().astype(np.float64)).T.reshape(w.N, -1, 32).sum(-1)  # [N, KB]
    return np.einsum("...b,nb->...n", e[..., 0].astype(np.float64) / 2, wabs)


def test_reference_is_the_product_of_the_dequantized_activations():
    """y = x^ @ W with x^ = the sum of e a over the terms: the arithmetic in one line (minimum term included)."""
    rng = np.random.default_rng(11)
    w = q4_1(rng, 40, 96)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    for terms in (1, 2):
        xh = sum(e.astype(np.float64) * a for a, e in activation_terms(x, terms)).reshape(3, 96)
        np.testing.assert_allclose(reference(x, w, terms), xh @ w.dequantize().astype(np.float64), rtol=1e-9,
                                   atol=1e-9)


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS])
@pytest.mark.parametrize("terms", [1, 2])
def test_within_the_quantization_bound_of_the_exact_product(isa, terms):
    rng = np.random.default_rng(40 + terms)
    w = q4_1(rng, 300, 1536)
    x = rng.standard_normal((3, 1536)).astype(np.float32)
    y = run(w, x, isa, terms)
    exact = x.astype(np.float64) @ w.dequantize().astype(np.float64)
    bound = _quantization_bound(x, w, terms)
    float_slack = 1e-5 * np.abs(x).max() * np.abs(w.dequantize()).sum(0)
    assert (np.abs(y - exact) <= bound + float_slack).all()
    rel = np.abs(y - exact).max() / np.abs(exact).max()
    # one int8 term: ~0.5 % of the output range here; two terms: float-like
    assert rel < (1e-2 if terms == 1 else 1e-4), rel
    if terms == 2:
        assert bound.max() < 0.02 * _quantization_bound(x, w, 1).max()


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS[1:]])
def test_simd_paths_agree_with_the_scalar_path(isa):
    rng = np.random.default_rng(9)
    w = q4_1(rng, 200, 640)
    x = rng.standard_normal((9, 640)).astype(np.float32)
    a, b = run(w, x, "scalar"), run(w, x, isa)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())


@pytest.mark.parametrize("terms", [1, 2])
def test_activation_quantization_is_the_same_bytes_in_every_path(terms):
    """Note [MatMulQ4 activation quantization]: a selector W (w[n, k] = 1 where k == n: d 1, m 0) makes
    y[n] = e a[n] exactly (one float32 product), so y shows each path's int8 activations bit for bit: ties
    (x * 127 / amax = k + 0.5, rounded to even), negatives, a zero block, against numpy's rint and each other."""
    K = N = 128
    codes = np.zeros((N, K // 32, 32), np.int64)
    codes[np.arange(N), np.arange(N) // 32, np.arange(N) % 32] = 1
    w = weights.Q4Weight((codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8),
                         np.ones((N, K // 32), np.float32), np.zeros((N, K // 64), np.uint8), K, N, 4, 32,
                         mins=np.zeros((N, K // 32), np.float32))
    rng = np.random.default_rng(5)
    x = np.zeros((2, K), np.float32)
    x[0, :32] = np.concatenate([[127.0, -127.0], rng.integers(-126, 126, 30) + 0.5])  # inv = 1: every value a tie
    x[0, 32:64] = rng.standard_normal(32)
    x[0, 96:128] = rng.standard_normal(32) * 1e-3  # block 64:96 stays zero
    x[1] = rng.standard_normal(K) * 3
    (a, e), *_ = activation_terms(x, 1)
    expect = (a.astype(np.float32) * e).reshape(2, K)
    runs = {isa: run(w, x, isa, terms) for isa in ISAS if RUNNABLE[isa]}
    if terms == 1:  # one product a e per output: every path exactly the reference
        for isa, y in runs.items():
            np.testing.assert_array_equal(y, expect, err_msg=isa)
    else:  # e1 a1 + e2 a2: the SIMD paths fuse the second add (FMA) alike; the scalar path rounds it apart
        simd = [y for isa, y in runs.items() if isa != "scalar"]
        for y in simd[1:]:
            np.testing.assert_array_equal(y, simd[0])
        ref = reference(x, w, 2)
        for isa, y in runs.items():
            np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-30, err_msg=isa)
    assert (a[0, 0, 2:] % 2 == 0).all()  # the ties went to even


def test_zero_and_tiny_blocks_and_threads():
    """An all-zero activation block (e = 0) contributes only its minimum term, exactly 0; 1 and 2 threads agree."""
    rng = np.random.default_rng(3)
    w = q4_1(rng, 48, 128)
    x = rng.standard_normal((4, 128)).astype(np.float32)
    x[:, 32:64] = 0
    x[1] = 0
    x[2, 64:96] = 1e-30
    y1, y2 = run(w, x, threads=1), run(w, x, threads=2)
    np.testing.assert_array_equal(y1[1], 0)
    np.testing.assert_allclose(y2, y1, rtol=0, atol=1e-6 * np.abs(y1).max())
    np.testing.assert_allclose(y1, reference(x, w), rtol=0, atol=1e-5 * np.abs(y1).max())


# -- refusals -----------------------------------------------------------------------------------------------------

def _err(m, x):
    with pytest.raises(Exception) as info:
        session(m).run(None, {"x": x})
    return str(info.value)


def test_refuses_k_not_a_multiple_of_32():
    rng = np.random.default_rng(4)
    p = weights.pack_matmul_q4(q4_1(rng, 16, 64))
    msg = _err(model(p, [1, 48], K=48), np.ones((1, 48), np.float32))
    assert "[ortkv:E_INPUT] MatMulQ4 node 'mm': attribute K=48 (X 'x' [1, 48]) is not a positive multiple of 32" in msg
    assert "use MatMul or MatMulNBits for this matrix" in msg
    with pytest.raises(ortkv.OrtkvError, match=r"pack_matmul_q4: K=48 is not a multiple of 32"):
        w = q4_1(rng, 16, 64)
        w.K = 48
        weights.pack_matmul_q4(w)
    report = check(model(p, [1, 48], K=48), plan=False)
    assert any("attribute K=48 is not a multiple of 32" in f.message for f in report.findings), report.findings


def test_refuses_x_whose_last_dim_is_not_k():
    p = weights.pack_matmul_q4(q4_1(np.random.default_rng(5), 16, 64))
    msg = _err(model(p, [2, None]), np.ones((2, 96), np.float32))
    assert "MatMulQ4 node 'mm': input 'x' has shape [2, 96]; its last dimension must be K=64" in msg


@pytest.mark.parametrize("which,bad,expect", [
    ("codes", lambda p: p.codes[:, :1], r"codes 'codes' are shape [1, 1, 256]; expected uint8 [1, 2, 256] for K=64, N=16"),
    ("codes", lambda p: p.codes.astype(np.int8), r"codes 'codes' are of element type 3, shape [1, 2, 256]; expected uint8"),
    ("scales", lambda p: p.scales.astype(np.float32), r"scales 'scales' are of element type 1, shape [1, 2, 16]; "
                                                      r"expected float16 [1, 2, 16]"),
    ("mins", lambda p: np.concatenate([p.mins, p.mins]), r"mins 'mins' are shape [2, 2, 16]; expected float16 [1, 2, 16]"),
])
def test_refuses_wrong_packed_sizes_and_types(which, bad, expect):
    p = weights.pack_matmul_q4(q4_1(np.random.default_rng(6), 16, 64))
    arrays = {"codes": p.codes, "scales": p.scales, "mins": p.mins}
    arrays[which] = bad(p)
    m = model(p, [1, 64], inits=[numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in arrays.items()])
    msg = _err(m, np.ones((1, 64), np.float32))
    assert expect in msg and "repack the Q4_1 matrix with ortkv.generate.weights.pack_matmul_q4" in msg, msg
    report = check(m, plan=False)
    assert any(f"{which} '{which}'" in f.message and "pack_matmul_q4" in f.message for f in report.findings), \
        report.findings


def test_refuses_float16_x_instead_of_casting():
    p = weights.pack_matmul_q4(q4_1(np.random.default_rng(7), 16, 64))
    msg = _err(model(p, [1, 64], x_type=TP.FLOAT16), np.ones((1, 64), np.float16))
    assert "input 'x' has element type 10; MatMulQ4 takes float32 X" in msg


def test_refuses_bad_attributes():
    p = weights.pack_matmul_q4(q4_1(np.random.default_rng(8), 16, 64))
    with pytest.raises(Exception, match=r"MatMulQ4 node 'mm': attribute isa='avx9' is not one of 'auto', "
                                        r"'avx512vnni', 'avx2', 'scalar'"):
        session(model(p, [1, 64], isa="avx9"))
    with pytest.raises(Exception, match=r"attribute act_terms=3 must be 1 \(one int8 term per activation block\) "
                                        r"or 2"):
        session(model(p, [1, 64], act_terms=3))
    for isa in ISAS:
        if not RUNNABLE[isa]:
            with pytest.raises(Exception, match=rf"attribute isa='{isa}' but this CPU cannot run it"):
                session(model(p, [1, 64], isa=isa))
    findings = check(model(p, [1, 64], act_terms=3), plan=False).findings
    assert any("attribute act_terms=3; allowed: 1, 2" in f.message for f in findings), findings
    findings = check(model(p, [1, 64], isa="avx9"), plan=False).findings
    assert any("attribute isa=avx9; allowed: auto, avx512vnni, avx2, scalar" in f.message for f in findings), findings


def test_the_checker_infers_the_output_shape():
    p = weights.pack_matmul_q4(q4_1(np.random.default_rng(10), 37, 64))
    report = check(model(p, ["batch", "seq", 64]), plan=False)
    assert report.ok, report.findings
    y = report.shapes.type_of("y")
    assert y.elem == TP.FLOAT and len(y.shape) == 3 and y.shape[2] == 37, y
    assert y.shape[:2] == report.shapes.type_of("x").shape[:2]
