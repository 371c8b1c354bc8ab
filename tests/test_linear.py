"""ortkv.Linear on the CPU (Note [Linear] in custom_ops/include/ortkv/linear.h): Y = X W^T against a float64 numpy
reference for float32 and float16 (computed in float32, rounded once), M = 1, 3, 8, 9, 40 and 3-D X; the
refusals (K mismatch, ranks, K % 8, types, attribute) with their messages and the output bytes untouched; the graph
checker's rule; and the float16 decoders built with Linear (Note [Linear projections] in builder.py) against the
MatMul ones on the CPU."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from conftest import ort_session
from ortkv.graph import check

NP = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}


def linear_model(K, N, x_shape, onnx_type=TP.FLOAT, w=None, w_type=None, name="lin", w_shape=(), **attrs):
    """x [x_shape] -> Linear(x, W) -> y; W an initializer ([N, K] random unless given) or a graph input "w"."""
    node = helper.make_node("Linear", ["x", "w"], ["y"], domain="ortkv", name=name, **attrs)
    inputs = [helper.make_tensor_value_info("x", onnx_type, x_shape)]
    inits = []
    if w is None:
        inputs.append(helper.make_tensor_value_info("w", onnx_type if w_type is None else w_type,
                                                    [N, K] if w_shape == () else w_shape))
    else:
        inits.append(numpy_helper.from_array(w, "w"))
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", onnx_type, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def session(model, threads=2):
    return ort_session(model, threads=threads)


def bound(x, w, out_type):
    """|Y - X W^T| allowed: float32 summation of K products (gamma_K = K 2^-24 times sum |x w|, the textbook
    worst case) plus, for float16 outputs, half an ulp of the float16 result (2^-11 relative)."""
    xa, wa = np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    b = x.shape[-1] * 2.0 ** -24 * (xa @ wa.T)
    if out_type == np.float16:
        b = b + 2.0 ** -11 * np.abs(x.astype(np.float64) @ w.astype(np.float64).T) + 2.0 ** -25  # + subnormal step
    return b


def check_close(y, x, w, out_type):
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert y.dtype == out_type and y.shape == ref.shape
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(err <= bound(x, w, out_type)), float(err.max())


@pytest.mark.parametrize("onnx_type", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 40])
def test_linear_matches_numpy(rng, onnx_type, M):
    np_t = NP[onnx_type]
    K, N = 72, 37
    x = rng.standard_normal((M, K)).astype(np_t)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np_t)
    (y,) = session(linear_model(K, N, [M, K], onnx_type, w=w)).run(None, {"x": x})
    check_close(y, x, w, np_t)


@pytest.mark.parametrize("onnx_type", [TP.FLOAT, TP.FLOAT16])
def test_linear_3d_x_and_decoder_shapes(rng, onnx_type):
    """X [B, T, K] (M = B T) on the decoder's shapes: K 576 / 1536, N 960 / 576 (W a graph input)."""
    np_t = NP[onnx_type]
    for K, N in ((576, 960), (1536, 576)):
        x = rng.standard_normal((2, 5, K)).astype(np_t)
        w = (rng.standard_normal((N, K)) * 0.05).astype(np_t)
        (y,) = session(linear_model(K, N, ["b", "t", K], onnx_type)).run(None, {"x": x, "w": w})
        assert y.shape == (2, 5, N)
        check_close(y.reshape(10, N), x.reshape(10, K), w, np_t)


def test_linear_float16_is_float32_math_rounded_once(rng):
    """float16 in, float32 accumulation, one rounding: equal to numpy's float32 product rounded to float16 up to
    the order of the float32 additions (at most one float16 ulp apart)."""
    K, N = 256, 64
    x = rng.standard_normal((4, K)).astype(np.float16)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float16)
    (y,) = session(linear_model(K, N, [4, K], TP.FLOAT16, w=w)).run(None, {"x": x})
    ref = (x.astype(np.float32) @ w.astype(np.float32).T).astype(np.float16)
    ulps = np.abs(y.view(np.int16).astype(np.int32) - ref.view(np.int16).astype(np.int32))
    assert ulps.max() <= 1 and (ulps == 0).mean() > 0.9


def test_linear_empty_rows_and_threads(rng):
    K, N = 16, 8
    w = rng.standard_normal((N, K)).astype(np.float32)
    (y,) = session(linear_model(K, N, ["m", K], w=w)).run(None, {"x": np.zeros((0, K), np.float32)})
    assert y.shape == (0, N)
    x = rng.standard_normal((100, K)).astype(np.float32)  # many tasks: rows and columns split
    one, two = (session(linear_model(K, N, ["m", K], w=w), t).run(None, {"x": x})[0] for t in (1, 2))
    assert one.tobytes() == two.tobytes()  # each (row, column) is computed by one task, in one order
    check_close(one, x, w, np.float32)


# -- refusals ----------------------------------------------------------------------------------------------------

def _bound_run(sess, x, w, y_shape, y_type=np.float32):
    """Run with X / W fed and Y preallocated (NaN sentinels), returning the error text and Y's bytes after."""
    y = ort.OrtValue.ortvalue_from_numpy(np.full(y_shape, np.nan, y_type))
    before = y.numpy().tobytes()
    io = sess.io_binding()
    io.bind_cpu_input("x", x)
    io.bind_cpu_input("w", w)
    io.bind_ortvalue_output("y", y)
    with pytest.raises(Exception) as e:
        sess.run_with_iobinding(io)
    return str(e.value), before == y.numpy().tobytes()


def test_linear_refusals_name_the_tensor_and_leave_y_untouched():
    sess = session(linear_model("k", "n", ["m", "k"]))
    f = np.float32
    msg, same = _bound_run(sess, np.ones((2, 16), f), np.ones((3, 24), f), [2, 3])
    assert "[ortkv:E_INPUT] Linear node 'lin': X 'x' [2, 16] has K = 16 but W 'w' [3, 24] has K = 24; W must be " \
           "[N, K] with X's last dim as K" in msg and same
    msg, same = _bound_run(sess, np.ones((2, 12), f), np.ones((3, 12), f), [2, 3])
    assert "Linear node 'lin': K = 12 (X 'x' [2, 12]) is not a multiple of 8; Linear reads W in 16-byte vectors of " \
           "8 elements: use MatMul for this matrix" in msg and same


def test_linear_refuses_bad_ranks_and_types(rng):
    w3 = session(linear_model(8, 4, None, w_shape=None))  # shapes unknown to ORT: the kernel checks them
    with pytest.raises(Exception, match=r"Linear node 'lin': weight W 'w' is \[1, 4, 8\] \(rank 3\); it must be "
                                        r"\[N, K\] \(rank 2"):
        w3.run(None, {"x": np.ones((2, 8), np.float32), "w": np.ones((1, 4, 8), np.float32)})
    with pytest.raises(Exception, match=r"Linear node 'lin': input X 'x' is a scalar; it must be \[\.\.\., K\]"):
        w3.run(None, {"x": np.array(1, np.float32), "w": np.ones((4, 8), np.float32)})
    mixed = session(linear_model(8, 4, [2, 8], TP.FLOAT, w=np.ones((4, 8), np.float16)))
    with pytest.raises(Exception, match=r"Linear node 'lin': X 'x' is float32 but W 'w' is float16; both must have "
                                        r"the same float type"):
        mixed.run(None, {"x": np.ones((2, 8), np.float32)})
    import ml_dtypes

    bf = session(linear_model(8, 4, [2, 8], TP.BFLOAT16, w=np.ones((4, 8), ml_dtypes.bfloat16)))
    with pytest.raises(Exception, match=r"Linear node 'lin': X 'x' is bfloat16; the CPU kernel takes float32 or "
                                        r"float16 \(bfloat16 runs on CUDAExecutionProvider\)"):
        x_bf = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ones((2, 8), ml_dtypes.bfloat16).view(np.uint16),
                                                               TP.BFLOAT16)
        bf.run_with_ort_values(["y"], {"x": x_bf})
    with pytest.raises(Exception, match=r"Linear node 'lin': attribute rows_per_warp=3 must be 1, 2 or 4"):
        session(linear_model(8, 4, [2, 8], w=np.ones((4, 8), np.float32), rows_per_warp=3))


def test_graph_checker_rule():
    """op_rules: Y = X[..., :-1] + [N]; K mismatch, K % 8 and W's rank named; a good node checks clean."""
    ok = check(linear_model(576, 960, ["b", "t", 576], TP.FLOAT16, w=np.zeros((960, 576), np.float16)), plan=False)
    assert not [f for f in ok.findings if f.severity == "error"], ok.findings
    bad_k = check(linear_model(64, 8, ["b", 32], w=np.zeros((8, 64), np.float32)), plan=False)
    assert any("Linear node 'lin': dim 1 of 'x' [b, 32] is 32 but dim 1 of 'w' [8, 64] is 64 (K: W must be [N, K] "
               "with X's last dim as K)" in f.message for f in bad_k.findings), bad_k.findings
    odd = check(linear_model(12, 8, ["b", 12], w=np.zeros((8, 12), np.float32)), plan=False)
    assert any("K = 12 is not a multiple of 8; Linear reads W in 16-byte vectors of 8 elements: use MatMul"
               in f.message for f in odd.findings), odd.findings
    rank = check(linear_model(8, 8, ["b", 8], w=np.zeros((2, 8, 8), np.float32)), plan=False)
    assert any("W 'w' is [2, 8, 8]; it must be [N, K]" in f.message for f in rank.findings), rank.findings


def test_shape_inference_gives_n(rng):
    """The op's InferOutputShapeFn: Y [b, t, N] from X [b, t, K] and W [N, K] (ORT's own view of the output)."""
    sess = session(linear_model(16, 24, ["b", "t", 16], w=rng.standard_normal((24, 16)).astype(np.float32)))
    (y,) = sess.run(None, {"x": np.ones((2, 3, 16), np.float32)})
    assert y.shape == (2, 3, 24)


# -- the float16 decoders (Note [Linear projections] in builder.py) -----------------------------------------------

@pytest.fixture(scope="module")
def slice_weights():
    from ortkv.generate import weights
    from ortkv.generate.assets import smollm2_gguf

    w, _ = weights.load(smollm2_gguf(), layers=2)
    return w


def test_builder_uses_linear_for_float16_and_cpu_float32_ortkv_and_copy(slice_weights):
    """Note [Linear projections]: Linear in the float16 ortkv and copy decoders, and in the float32 ones where the
    model cache builds them for the CPU (models.linear_projections); MatMul in genai's and in float32 otherwise."""
    from ortkv.generate import builder, models
    from ortkv.generate.cli import apply_overrides
    from ortkv.generate.config import GenAIConfig

    cpu = apply_overrides(GenAIConfig(), {"ortkv.weights": "float32"})
    assert cpu.device == "cpu" and cpu.dtype == "float32"
    assert models.model_dir(cpu).name.startswith("smollm2-135m-f32ln-")
    cuda = GenAIConfig()  # float32 on CUDA: MatMul (Linear's CUDA kernel is float16 / bfloat16), the "f32" tag
    cuda.model.decoder.session_options = {"log_id": "x", "provider_options": [{"cuda": {"device_id": "0"}}]}
    cuda.ortkv.dtype = "float32"
    assert (cuda.validate().device, cuda.dtype) == ("cuda:0", "float32")
    assert [models.linear_projections(cuda, v) for v in builder.VARIANTS] == [None] * 3
    assert models.model_dir(cuda).name.startswith("smollm2-135m-f32-")
    q4 = apply_overrides(GenAIConfig(), {"ortkv.weights": "q4"})
    assert [models.linear_projections(q4, v) for v in builder.VARIANTS] == [None] * 3
    for variant in builder.VARIANTS:
        for dtype in ("float32", "float16"):
            linear = models.linear_projections(cpu, variant) if dtype == "float32" else None
            assert linear == (True if dtype == "float32" and variant != "genai" else None)
            m = builder.build(slice_weights, variant, max_positions=64, dtype=dtype, cache_layout="SBNH",
                              linear=linear)
            ops = [n.op_type for n in m.graph.node]
            inits = {t.name for t in m.graph.initializer}
            if variant != "genai":
                # 4 projections per layer (fused QKV, output, fused gate / up, down) + the LM head; no MatMul but the
                # copy model's attention (2 per layer)
                assert ops.count("Linear") == 2 * 4 + 1, variant
                assert ops.count("MatMul") == (2 * 2 if variant == "copy" else 0), variant
                logits = "logits_float16" if dtype == "float16" else "logits"
                head = [n for n in m.graph.node if n.op_type == "Linear" and n.output[0] == logits]
                assert list(head[0].input[1:2]) == ["embed"]  # the table itself, [vocab, E]
                # float32: the final norm inside the head's Linear (Note [Norm in the projection] in builder.py)
                assert list(head[0].input[2:]) == ([head[0].input[2], "final_norm"] if dtype == "float32" else [])
                assert "lm_head" not in inits
                # the fused float32 ortkv layer: SwiGLU inside the gate / up Linear (Note [Linear SwiGLU epilogue])
                gu = [n for n in m.graph.node if n.op_type == "Linear" and n.output[0] == "l0_act"]
                in_linear = variant == "ortkv" and dtype == "float32"
                assert len(gu) == in_linear and ops.count("SwiGLU") == (2 if variant == "ortkv" and not in_linear else 0)
                if in_linear:
                    assert {a.name: a.s for a in gu[0].attribute if a.name == "activation"} == {"activation": b"swiglu"}
                w = {t.name: t for t in m.graph.initializer}["l0_wqkv"]
                assert list(w.dims) == [(9 + 2 * 3) * 64, 576]  # [N, K]
                # the checker's Linear rule accepts every node (CacheAttention's float16 finding is about its CPU kernel)
                mine = [f for f in check(m, plan=False).findings if "Linear" in f.message]
                assert not mine, mine
            else:
                assert "Linear" not in ops and "lm_head" in inits, (variant, dtype)
    forced = builder.build(slice_weights, "copy", max_positions=64, dtype="float16", linear=False)
    assert "Linear" not in [n.op_type for n in forced.graph.node]
    forced = builder.build(slice_weights, "genai", max_positions=64, dtype="float32", linear=True)
    assert [n.op_type for n in forced.graph.node].count("Linear") == 2 * 4 + 1
    plain = builder.build(slice_weights, "ortkv", max_positions=64, dtype="float32")  # the default: MatMul
    assert "Linear" not in [n.op_type for n in plain.graph.node]


def _copy_greedy(model, prompt, steps):
    """The copy decoder on the CPU: prefill, then ``steps`` greedy steps; (tokens, logits of every run)."""
    from ortkv.generate import builder

    sess = session(model)
    past = {n: np.zeros((1, 3, 0, 64), np.float16) for i in range(2) for n in builder.genai_names(i)[:2]}
    ids, tokens, logits, pos = np.array([prompt]), [], [], 0
    for _ in range(steps + 1):
        T = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, pos + T), np.int64),
                 "position_ids": np.arange(pos, pos + T)[None], **past}
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        for i in range(2):
            pk, pv, ok, ov = builder.genai_names(i)
            past[pk], past[pv] = out[ok], out[ov]
        logits.append(out["logits"][0])
        pos += T
        tokens.append(int(out["logits"][0, -1].argmax()))
        ids = np.array([[tokens[-1]]])
    return tokens, logits


@pytest.mark.parametrize("prompt", [[504, 3575, 282, 4649, 314], [1, 504, 3575, 282, 4649, 314, 7042, 30, 198]])
def test_float16_linear_decoder_matches_the_matmul_decoder_on_cpu(slice_weights, prompt):
    """The float16 copy decoder with Linear (float16 in, float32 accumulation, one rounding) against the same
    decoder with ORT's MatMul, on the CPU: logits within float16 noise, the same greedy tokens (prefill + 8)."""
    from ortkv.generate import builder

    runs = {lin: _copy_greedy(builder.build(slice_weights, "copy", max_positions=64, dtype="float16", linear=lin),
                              prompt, 8) for lin in (True, False)}
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        scale = np.abs(b).max()
        assert np.abs(a - b).max() <= 0.02 * scale, (np.abs(a - b).max(), scale)
        assert (a.argmax(-1) == b.argmax(-1)).all()
