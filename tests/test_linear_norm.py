"""ortkv.Linear's norm prologue (Note [Linear norm prologue] in custom_ops/kernels/cpu/linear.cc): Linear(x, W, skip,
gamma, epsilon) -> (y, x + skip) equals SkipSimplifiedLayerNormalization followed by Linear bit for bit (the same
float32 arithmetic as ORT's kernel), and a float64 numpy reference within float32 bounds; with the SwiGLU epilogue
too; M = 1 (one row), 3, 4 (tiles), 9 (chunks), 3-D X; the sum output optional; the refusals by name. And the
decoders built with it (Note [Norm in the projection] in builder.py): no SkipSimplifiedLayerNormalization left."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from test_linear import session, slice_weights  # noqa: F401 (a fixture)

EPS = 1e-5


def _model(K, N, x_shape, w, gamma, fused, sum_out=True, activation=None, skip_shape=None, gamma_name="gamma",
           x_type=TP.FLOAT):
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(gamma, gamma_name)]
    attrs = {} if activation is None else {"activation": activation}
    if fused:
        outs = ["y", "s"] if sum_out else ["y"]
        nodes = [helper.make_node("Linear", ["x", "w", "skip", gamma_name], outs, domain="ortkv", name="lin",
                                  epsilon=EPS, **attrs)]
    else:
        nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", gamma_name], ["h", "", "", "s"],
                                  domain="com.microsoft", epsilon=EPS),
                 helper.make_node("Linear", ["h", "w"], ["y"], domain="ortkv", name="lin", **attrs)]
    ins = [helper.make_tensor_value_info("x", x_type, x_shape),
           helper.make_tensor_value_info("skip", x_type, skip_shape or x_shape)]
    outs_vi = [helper.make_tensor_value_info("y", x_type, None)]
    if sum_out or not fused:
        outs_vi.append(helper.make_tensor_value_info("s", x_type, None))
    g = helper.make_graph(nodes, "g", ins, outs_vi, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1),
                                               helper.make_opsetid("com.microsoft", 1)], ir_version=10)


def _ref(x, skip, gamma, w, activation=None):
    s = x.astype(np.float64) + skip.astype(np.float64)
    h = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS) * gamma
    y = h @ w.astype(np.float64).T
    if activation == "swiglu":
        g, u = np.split(y, 2, axis=-1)
        y = g / (1 + np.exp(-g)) * u
    return y, s


@pytest.mark.parametrize("M", [1, 3, 4, 9])
@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_prologue_is_skip_norm_then_linear_bit_for_bit(rng, M, activation):
    K, N = 584, 202  # K = 8 mod 16, N even (SwiGLU) and not a multiple of 4
    x = rng.standard_normal((M, K)).astype(np.float32)
    skip = rng.standard_normal((M, K)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, K).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    feeds = {"x": x, "skip": skip}
    yf, sf = session(_model(K, N, [M, K], w, gamma, True, activation=activation)).run(None, feeds)
    yu, su = session(_model(K, N, [M, K], w, gamma, False, activation=activation)).run(None, feeds)
    assert yf.tobytes() == yu.tobytes() and sf.tobytes() == su.tobytes()
    y_ref, s_ref = _ref(x, skip, gamma, w, activation)
    np.testing.assert_array_equal(sf, (x + skip))  # the sum is one float32 add
    np.testing.assert_allclose(yf, y_ref, rtol=2e-4, atol=2e-4)


def test_prologue_3d_x_without_the_sum_output(rng):
    K, N = 576, 64
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    skip = rng.standard_normal((2, 3, K)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, K).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    (y,) = session(_model(K, N, [2, 3, K], w, gamma, True, sum_out=False)).run(None, {"x": x, "skip": skip})
    assert y.shape == (2, 3, N)
    np.testing.assert_allclose(y, _ref(x, skip, gamma, w)[0], rtol=2e-4, atol=2e-4)


def _refused(model, feeds, fragment):
    with pytest.raises(Exception) as e:
        session(model).run(None, feeds)
    assert fragment in str(e.value), str(e.value)


def test_prologue_refusals_name_the_tensors(rng):
    K, N = 16, 8
    w = np.ones((N, K), np.float32)
    gamma = np.ones(K, np.float32)
    x = np.ones((1, K), np.float32)
    # gamma without skip
    node = helper.make_node("Linear", ["x", "w", "", "gamma"], ["y"], domain="ortkv", name="lin")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, [1, K])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(gamma, "gamma")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)],
                          ir_version=10)
    _refused(m, {"x": x}, "Linear node 'lin': the norm prologue takes skip (input 2) and gamma (input 3) together; "
                          "only gamma is given")
    # skip of another shape
    _refused(_model(K, N, [1, K], w, gamma, True, skip_shape=[2, K]), {"x": x, "skip": np.ones((2, K), np.float32)},
             "Linear node 'lin': skip 'skip' [2, 16] must have X 'x''s shape [1, 16]")
    # gamma of another length
    _refused(_model(K, N, [1, K], w, np.ones(K + 8, np.float32), True), {"x": x, "skip": x},
             "gamma 'gamma' [24] must be [K] = [16]")
    # float16
    w16, g16, x16 = w.astype(np.float16), gamma.astype(np.float16), x.astype(np.float16)
    _refused(_model(K, N, [1, K], w16, g16, True, x_type=TP.FLOAT16), {"x": x16, "skip": x16},
             "the norm prologue (skip, gamma) is implemented for float32 on the CPU only (X 'x' is float16")


def test_float32_cpu_decoders_have_no_norm_nodes(slice_weights):
    """Note [Norm in the projection]: the float32 ortkv / copy decoders built with Linear hand every residual add +
    RMSNorm to the Linear that reads it (a 2-layer slice of SmolLM2): only layer 0's first norm stays a node; the
    float32 decoders with MatMul (genai's always; every variant's without linear=True) keep
    SkipSimplifiedLayerNormalization."""
    from ortkv.generate import builder

    for variant in builder.VARIANTS:
        for linear in (True, None):
            m = builder.build(slice_weights, variant, max_positions=64, dtype="float32", linear=linear)
            ops = [n.op_type for n in m.graph.node]
            if linear:  # linear=True asks for Linear in every variant (genai too)
                assert ops.count("SkipSimplifiedLayerNormalization") == 0 and ops.count("SimplifiedLayerNormalization") == 1
                fused = [n for n in m.graph.node if n.op_type == "Linear" and len(n.input) == 4]
                assert len(fused) == 4, variant  # gate / up of each layer, QKV of layer 1, the LM head
                assert sum(len(n.output) == 2 for n in fused) == 3  # the LM head's sum is not needed
            else:
                assert ops.count("SkipSimplifiedLayerNormalization") == 2 * 2, (variant, linear)
