"""ortkv.Linear on the CUDA execution provider (Note [Linear] in custom_ops/include/ortkv/linear.h), skipped with a
reason where there is no GPU: the GEMV (M <= 8, Note [Linear GEMV]) and the cuBLAS path (M > 8, Note [Linear cuBLAS])
against a float64 numpy reference for float16 and bfloat16 on the decoder's shapes, rows_per_warp variants bit for
bit, the refusals (K % 8, float32, unaligned X) with Y untouched, CUDA graph replays with changed inputs equal to
uncaptured runs, ORT's profile (every Linear node on CUDAExecutionProvider) and the float16 SmolLM2 decoder's greedy
tokens with Linear against the MatMul decoder. Buffers are torch CUDA tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from conftest import DTYPES
from test_cuda import _to_torch, _torch
from test_cuda_fused import _profiled_greedy_decode

pytestmark = pytest.mark.cuda
# one ulp of the output type, relative: the result is rounded once from fp32 (half an ulp), the other half covers
# an fp32 -> output rounding of a split-K partial sum that cuBLAS may choose for M > 8
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # SmolLM2's QKV, output, gate / up, down
MS = list(range(1, 10)) + [16, 64, 1000]


def _host(t, np_type):
    torch = _torch()
    torch.cuda.synchronize()
    return t.contiguous().cpu().view(torch.uint8).numpy().view(np_type).reshape(tuple(t.shape))


def _model(specs, onnx_type, **attrs):
    """One Linear node per (x name, w name, y name, M, K, N) in specs; X and W graph inputs (bound on the device)."""
    nodes, inputs, outputs = [], [], []
    for x, w, y, M, K, N in specs:
        nodes.append(helper.make_node("Linear", [x, w], [y], domain="ortkv", name=f"lin_{y}", **attrs))
        inputs += [helper.make_tensor_value_info(x, onnx_type, [M, K]), helper.make_tensor_value_info(w, onnx_type, [N, K])]
        outputs.append(helper.make_tensor_value_info(y, onnx_type, [M, N]))
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def _session(model, graph=False, profile=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # Linear must run on CUDA
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    so.register_custom_ops_library(ortkv.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graph else "0"})])


def _bind(sess, onnx_type, bufs):
    """An IOBinding of every buffer by name (the model's inputs and outputs) at its device address."""
    io = sess.io_binding()
    names_in = {i.name for i in sess.get_inputs()}
    for name, t in bufs.items():
        if name in names_in:
            io.bind_input(name, "cuda", 0, onnx_type, list(t.shape), t.data_ptr())
        else:
            io.bind_output(name, "cuda", 0, onnx_type, list(t.shape), t.data_ptr())
    return io


def _run(sess, onnx_type, bufs):
    _torch().cuda.synchronize()  # buffers written through torch's stream are complete before ORT's reads them
    sess.run_with_iobinding(_bind(sess, onnx_type, bufs))


def _case(rng, dtype, M, K, N):
    np_type = DTYPES[dtype][0]
    x = rng.standard_normal((M, K)).astype(np.float32).astype(np_type)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32).astype(np_type)
    return x, w


def _check(y, x, w, dtype):
    """|y - x w^T| <= K 2^-24 sum |x w| (fp32 accumulation, worst case) + one ulp of the output type x |ref|."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    bound = x.shape[1] * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64).T) + ULP[dtype] * np.abs(ref) + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    assert np.isfinite(y.astype(np.float32)).all()
    assert (err <= bound).all(), (float(err.max()), float((err / bound).max()))


def _linear(rng, dtype, M, K, N, **attrs):
    onnx_type = DTYPES[dtype][1]
    x, w = _case(rng, dtype, M, K, N)
    bufs = {"x": _to_torch(x), "w": _to_torch(w), "y": _to_torch(np.zeros((M, N), DTYPES[dtype][0]))}
    _run(_session(_model([("x", "w", "y", M, K, N)], onnx_type, **attrs)), onnx_type, bufs)
    return x, w, _host(bufs["y"], DTYPES[dtype][0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_linear_matches_float64_reference(rng, dtype, M, shape):
    K, N = shape
    x, w, y = _linear(rng, dtype, M, K, N)
    _check(y, x, w, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("M", [1, 2, 4, 8, 9, 32])
def test_cuda_linear_lm_head(rng, dtype, M):
    """The tied LM head's shape: K 576, N 49152 (GEMV for M <= 8, cuBLAS above)."""
    x, w, y = _linear(rng, dtype, M, 576, 49152)
    _check(y, x, w, dtype)


@pytest.mark.parametrize("M", [1, 3, 8])
def test_cuda_rows_per_warp_variants_are_bit_identical(rng, M):
    """rows_per_warp changes which warp computes a row, not the order of its sums: the same bits."""
    outs = []
    for rpw in (1, 2, 4):
        x, w, y = _linear(np.random.default_rng(7), "float16", M, 1536, 963, rows_per_warp=rpw)  # N not a multiple
        outs.append(y.tobytes())
        _check(y, x, w, "float16")
    assert outs[0] == outs[1] == outs[2]


def test_cuda_linear_refusals_leave_y_untouched(rng):
    torch = _torch()
    np_type, onnx_type = DTYPES["float16"]
    sentinel = lambda shape: _to_torch(np.full(shape, 7.0, np_type))  # noqa: E731
    # K % 8: refused by name at the first run
    x, w = _case(rng, "float16", 2, 12, 8)
    bufs = {"x": _to_torch(x), "w": _to_torch(w), "y": sentinel((2, 8))}
    with pytest.raises(Exception, match=r"Linear node 'lin_y': K = 12 \(X 'x' \[2, 12\]\) is not a multiple of 8; "
                                        r"Linear reads W in 16-byte vectors of 8 elements: use MatMul for this matrix"):
        _run(_session(_model([("x", "w", "y", 2, 12, 8)], onnx_type)), onnx_type, bufs)
    assert (_host(bufs["y"], np_type) == 7).all()
    # X not on a 16-byte boundary (a view 2 bytes into a buffer): refused, never read in pieces
    x, w = _case(rng, "float16", 1, 64, 8)
    base = _to_torch(np.concatenate([np.zeros(1, np_type), x.ravel()]))
    bufs = {"x": base[1:].view(1, 64), "w": _to_torch(w), "y": sentinel((1, 8))}
    with pytest.raises(Exception, match=r"Linear node 'lin_y': 'x' at 0x[0-9a-f]+ is not 16-byte aligned; the GEMV "
                                        r"reads it in 16-byte vectors"):
        _run(_session(_model([("x", "w", "y", 1, 64, 8)], onnx_type)), onnx_type, bufs)
    assert (_host(bufs["y"], np_type) == 7).all()
    # float32 on CUDA: the remedy is MatMul
    x32 = rng.standard_normal((1, 64)).astype(np.float32)
    w32 = rng.standard_normal((8, 64)).astype(np.float32)
    y32 = _to_torch(np.full((1, 8), 7.0, np.float32))
    with pytest.raises(Exception, match=r"Linear node 'lin_y': X 'x' is float32; the CUDA kernel takes float16 or "
                                        r"bfloat16 \(float32 on CUDA: use MatMul\)"):
        _run(_session(_model([("x", "w", "y", 1, 64, 8)], TP.FLOAT)), TP.FLOAT,
             {"x": _to_torch(x32), "w": _to_torch(w32), "y": y32})
    torch.cuda.synchronize()
    assert (y32.cpu().numpy() == 7).all()


def _graph_model(dtype, rng):
    """Three Linear nodes with initializer weights: decode-sized GEMVs (M 1 and 8) and a cuBLAS one (M 16)."""
    np_type, onnx_type = DTYPES[dtype]
    specs = [("x1", "w1", "y1", 1, 576, 960), ("x8", "w8", "y8", 8, 1536, 576), ("x16", "w16", "y16", 16, 576, 3072)]
    nodes, inputs, outputs, inits, ws = [], [], [], [], {}
    for x, w, y, M, K, N in specs:
        ws[w] = _case(rng, dtype, 1, K, N)[1]
        raw = numpy_helper.from_array(ws[w].view(np.uint16), w)
        raw.data_type = onnx_type  # bfloat16 / float16 bits as they are
        inits.append(raw)
        nodes.append(helper.make_node("Linear", [x, w], [y], domain="ortkv", name=f"lin_{y}"))
        inputs.append(helper.make_tensor_value_info(x, onnx_type, [M, K]))
        outputs.append(helper.make_tensor_value_info(y, onnx_type, [M, N]))
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)],
                              ir_version=10)
    return model, specs, ws, np_type, onnx_type


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_graph_replays_equal_uncaptured_runs(rng, tmp_path, dtype):
    """enable_cuda_graph: the GEMV and the cuBLAS GEMM (its handle made in ORT's uncaptured first runs, its
    workspace set, so the capture allocates nothing) replayed with new X values written into the same device
    buffers, five runs: every Y equals the uncaptured session's, bit for bit, and the reference within the bound.
    The uncaptured session is profiled: each Linear node ran on CUDAExecutionProvider."""
    model, specs, ws, np_type, onnx_type = _graph_model(dtype, rng)
    torch = _torch()
    captured, plain = _session(model, graph=True), _session(model, profile=str(tmp_path / "linear"))
    bufs = {s[0]: _to_torch(np.zeros((s[3], s[4]), np_type)) for s in specs}
    bufs.update({s[2]: _to_torch(np.zeros((s[3], s[5]), np_type)) for s in specs})
    io = _bind(captured, onnx_type, bufs)  # one binding, fixed addresses: what a captured graph replays
    for run in range(5):  # ORT runs uncaptured first, then captures, then replays
        xs = {s[0]: _case(rng, dtype, s[3], s[4], 1)[0] for s in specs}
        for name, x in xs.items():
            bufs[name].copy_(_to_torch(x))  # same address, new values
        torch.cuda.synchronize()
        captured.run_with_iobinding(io)
        got = {s[2]: _host(bufs[s[2]], np_type).copy() for s in specs}
        ref_bufs = {k: v.clone() for k, v in bufs.items()}
        _run(plain, onnx_type, ref_bufs)
        for x, w, y, *_ in specs:
            assert got[y].tobytes() == _host(ref_bufs[y], np_type).tobytes(), (run, y)
            _check(got[y], xs[x], ws[w], dtype)
    with open(plain.end_profiling()) as f:
        events = json.load(f)
    placed = [(e["args"]["op_name"], e["args"].get("provider")) for e in events
              if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    linear = [p for op, p in placed if op == "Linear"]
    assert len(linear) == 3 * 5 and set(linear) == {"CUDAExecutionProvider"}, placed


def test_cuda_decoder_linear_nodes_on_cuda_and_same_tokens_as_matmul(tmp_path):
    """A 2-layer float16 SBNH ortkv decoder through MutableCacheSession on CUDA, built with Linear (Note [Linear
    projections]) and with MatMul: ORT's profile shows every Linear node (4 per layer + the LM head) on
    CUDAExecutionProvider, and prefill + 8 greedy decode steps give the same tokens, logits within float16 noise."""
    from ortkv.generate import builder, weights
    from ortkv.generate.assets import smollm2_gguf

    w, _ = weights.load(smollm2_gguf(), layers=2)
    cap, runs = 64, {}
    for linear in (True, False):
        model = builder.build(w, "ortkv", max_positions=cap, dtype="float16", cache_layout="SBNH", linear=linear)
        tokens, logits, placed = _profiled_greedy_decode(model, w, cap, str(tmp_path / f"decode_{linear}"))
        lin = [p for op, p in placed if op == "Linear"]
        assert len(lin) == (9 * (2 * 4 + 1) if linear else 0) and set(lin) <= {"CUDAExecutionProvider"}, placed
        runs[linear] = tokens, logits
    assert runs[True][0] == runs[False][0]
    np.testing.assert_allclose(runs[True][1], runs[False][1], atol=0.15, rtol=0.02)


def test_cuda_smollm2_greedy_tokens_with_linear_equal_matmul(tmp_path):
    """The full float16 SmolLM2 decoder (CUDA graph, OrtkvRunner) with Linear and with MatMul: the same 32 greedy
    tokens for test_generate_cuda's prompts, except near ties (the two picks within 0.125 in the Linear model's
    float16 logits; printed)."""
    from test_generate_cuda import PROMPTS, _cfg, _run as run_steps

    from ortkv.generate import builder, weights
    from ortkv.generate.assets import smollm2_gguf
    from ortkv.generate.loop import generate
    from ortkv.generate.config import MAX_POSITIONS
    from ortkv.generate.models import save_decoder
    from ortkv.generate.runners import OrtkvRunner

    cfg = _cfg(cuda_graph=True, max_new_tokens=32)
    w, _ = weights.load(smollm2_gguf())
    # as models.build_models builds the cached decoder, but for the linear switch
    paths = {lin: save_decoder(builder.build(w, "ortkv", max_positions=MAX_POSITIONS, cache_layout=cfg.cache_layout,
                                             dtype=cfg.dtype, linear=lin), tmp_path, f"ortkv_{lin}")
             for lin in (True, False)}
    assert cfg.dtype == "float16"
    out = {}
    for lin, path in paths.items():
        r = OrtkvRunner(path, cfg)
        try:
            out[lin] = [generate(r, [p], cfg.search, 32, eos_id=-1, pad_id=2).new_ids[0] for p in PROMPTS]
        finally:
            r.close()
    flips = []
    for i, (a, b) in enumerate(zip(out[True], out[False])):
        assert len(a) == len(b) == 32
        if a != b:
            k = next(j for j in range(32) if a[j] != b[j])
            r = OrtkvRunner(paths[True], cfg)
            try:
                logits = run_steps(r, [list(PROMPTS[i]) + list(a[:k])], steps=0)[0, 0]
            finally:
                r.close()
            margin = float(logits[a[k]] - logits[b[k]])
            flips.append((i, k, margin))
    print("greedy flips Linear vs MatMul:", flips or "none")
    assert all(abs(m) <= 0.125 for _, _, m in flips), flips


def test_cuda_refuses_the_cpu_only_prologue_and_epilogue(rng):
    """Note [Linear norm prologue] and Note [Linear SwiGLU epilogue] are CPU float32 features: on CUDA a Linear with
    skip / gamma is refused by name at its run, one with activation="swiglu" when the session is made."""
    np_type, onnx_type = DTYPES["float16"]
    K, N = 64, 8
    w = numpy_helper.from_array((rng.standard_normal((N, K)) * 0.1).astype(np_type), "w")
    gamma = numpy_helper.from_array(np.ones(K, np_type), "gamma")
    node = helper.make_node("Linear", ["x", "w", "skip", "gamma"], ["y", "s"], domain="ortkv", name="lin")
    ins = [helper.make_tensor_value_info(n, onnx_type, [1, K]) for n in ("x", "skip")]
    outs = [helper.make_tensor_value_info(n, onnx_type, None) for n in ("y", "s")]
    m = helper.make_model(helper.make_graph([node], "g", ins, outs, [w, gamma]),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)], ir_version=10)
    x = rng.standard_normal((1, K)).astype(np_type)
    with pytest.raises(Exception, match=r"Linear node 'lin': the norm prologue \(skip, gamma\) is implemented for "
                                        r"float32 on the CPU only .*on CUDAExecutionProvider"):
        _session(m).run(None, {"x": x, "skip": x})
    with pytest.raises(Exception, match=r"Linear node 'lin_y': activation 'swiglu' has no CUDA kernel"):
        _session(_model([("x", "w", "y", 1, K, 2 * N)], onnx_type, activation="swiglu"))
