"""RotaryCacheUpdate and SwiGLU on the CUDA execution provider (Note [RotaryCacheUpdate], Note [SwiGLU] in
custom_ops/include/ortkv/rotary_cache_update.h), skipped with a reason where there is no GPU: the numpy oracles
for float32 / float16 / bfloat16 and every cache layout, the device-side refusals (Note [CUDA deferred errors])
with the caches' bytes untouched, and the fused decoder (Note [Fused ortkv layer]) profiled: every ortkv node on
CUDAExecutionProvider, and the same greedy tokens as the unfused graph. Buffers are torch CUDA tensors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import ortkv
from conftest import DTYPES
from ortkv.reference import rotary_cache_update_ref, swiglu_ref
from test_cuda import _to_torch, _torch
from test_rotary_cache_update import LAYOUTS, rotary_model, swiglu_model, tables, written_mask

pytestmark = pytest.mark.cuda
TOL = {"float32": 2e-5, "float16": 1e-2, "bfloat16": 6e-2}  # inputs ~N(0, 1): a few ulp of the output type


def _host(t, np_type):
    torch = _torch()
    torch.cuda.synchronize()
    return t.contiguous().cpu().view(torch.uint8).numpy().view(np_type).reshape(tuple(t.shape))


def _session(model, profile=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # the ortkv ops must run on CUDA
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    so.register_custom_ops_library(ortkv.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CUDAExecutionProvider"])


def _run(sess, onnx_type, bufs, pos, *, k_out=None):
    """One bound run: qkv, caches, tables and q_rot as torch tensors; positions copied to the device by ORT."""
    io = sess.io_binding()
    for name in ("qkv", "k", "v", "cos", "sin"):
        t = bufs[name]
        io.bind_input(name, "cuda", 0, onnx_type, list(t.shape), t.data_ptr())
    io.bind_cpu_input("pos", np.asarray(pos, np.int64))
    q = bufs["q"]
    io.bind_output("q", "cuda", 0, onnx_type, list(q.shape), q.data_ptr())
    ko = bufs["k"] if k_out is None else k_out
    io.bind_output("k_out", "cuda", 0, onnx_type, list(ko.shape), ko.data_ptr())
    io.bind_output("v_out", "cuda", 0, onnx_type, list(bufs["v"].shape), bufs["v"].data_ptr())
    sess.run_with_iobinding(io)


def _case(rng, dtype, B, T, H, Hkv, D, cap, seq_axis, vector):
    np_type = DTYPES[dtype][0]
    shape = LAYOUTS[seq_axis](B, Hkv, cap, D)
    qkv = rng.standard_normal((B, T, (H + 2 * Hkv) * D)).astype(np.float32).astype(np_type)
    k = rng.standard_normal(shape).astype(np.float32).astype(np_type)
    v = rng.standard_normal(shape).astype(np.float32).astype(np_type)
    cos, sin = [t.astype(np_type) for t in tables(cap, D)]
    pos = rng.integers(0, cap - T + 1, size=B).astype(np.int64) if vector else np.int64(cap - T)
    return qkv, k, v, cos, sin, pos


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_axis", [-2, 1, 0])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("vector", [True, False])
def test_cuda_rotary_cache_update_matches_reference(rng, dtype, seq_axis, T, heads, vector):
    np_type, onnx_type = DTYPES[dtype]
    H, Hkv = heads
    B, D, cap = 3, 64, 16
    qkv, k, v, cos, sin, pos = _case(rng, dtype, B, T, H, Hkv, D, cap, seq_axis, vector)
    q_ref, k_ref, v_ref = rotary_cache_update_ref(qkv, k, v, pos, cos, sin, H, Hkv, seq_axis)
    mask = written_mask(k.shape, pos, T, seq_axis)
    bufs = {"qkv": _to_torch(qkv), "k": _to_torch(k), "v": _to_torch(v), "cos": _to_torch(cos),
            "sin": _to_torch(sin), "q": _to_torch(np.zeros((B, T, H * D), np_type))}
    _run(_session(rotary_model(H, Hkv, seq_axis, onnx_type, vector=vector)), onnx_type, bufs, pos)
    assert ortkv._ortkv.cuda_take_error() is None
    tol = TOL[dtype]
    q, k_dev, v_dev = (_host(bufs[n], np_type) for n in ("q", "k", "v"))
    np.testing.assert_allclose(q.astype(np.float32), q_ref.astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(k_dev.astype(np.float32), k_ref.astype(np.float32), rtol=tol, atol=tol)
    assert v_dev.tobytes() == v_ref.tobytes()  # v is stored as it came
    assert k_dev[~mask].tobytes() == k[~mask].tobytes()  # nothing but the new tokens' slots is written


def test_cuda_rotary_prefill_of_many_tokens(rng):
    """2 x 300 tokens (more tokens than one block per token at a time) into SBNH float16 caches."""
    dtype, H, Hkv, D, B, T, cap = "float16", 9, 3, 64, 2, 300, 512
    np_type, onnx_type = DTYPES[dtype]
    qkv, k, v, cos, sin, _ = _case(rng, dtype, B, T, H, Hkv, D, cap, 0, True)
    pos = np.array([0, 200])
    q_ref, k_ref, v_ref = rotary_cache_update_ref(qkv, k, v, pos, cos, sin, H, Hkv, 0)
    bufs = {"qkv": _to_torch(qkv), "k": _to_torch(k), "v": _to_torch(v), "cos": _to_torch(cos),
            "sin": _to_torch(sin), "q": _to_torch(np.zeros((B, T, H * D), np_type))}
    _run(_session(rotary_model(H, Hkv, 0, onnx_type)), onnx_type, bufs, pos)
    np.testing.assert_allclose(_host(bufs["q"], np_type).astype(np.float32), q_ref.astype(np.float32), rtol=1e-2,
                               atol=1e-2)
    np.testing.assert_allclose(_host(bufs["k"], np_type).astype(np.float32), k_ref.astype(np.float32), rtol=1e-2,
                               atol=1e-2)
    assert _host(bufs["v"], np_type).tobytes() == v_ref.tobytes()


def test_cuda_rotary_errors_leave_caches_unchanged(rng):
    from ortkv import _ortkv

    np_type, onnx_type = DTYPES["float16"]
    H, Hkv, D, B, T, cap = 4, 2, 8, 2, 3, 8
    qkv, k, v, cos, sin, _ = _case(rng, "float16", B, T, H, Hkv, D, cap, -2, True)
    bufs = {"qkv": _to_torch(qkv), "k": _to_torch(k), "v": _to_torch(v), "cos": _to_torch(cos),
            "sin": _to_torch(sin), "q": _to_torch(np.zeros((B, T, H * D), np_type))}
    before = _host(bufs["k"], np_type).tobytes(), _host(bufs["v"], np_type).tobytes()
    state = lambda: (_host(bufs["k"], np_type).tobytes(), _host(bufs["v"], np_type).tobytes())  # noqa: E731
    sess = _session(rotary_model(H, Hkv, -2, onnx_type))
    # positions are on the device: checked there, reported after the run (Note [CUDA deferred errors])
    _run(sess, onnx_type, bufs, np.array([0, 6]))
    assert re.search(r"E_CAPACITY.*RotaryCacheUpdate node 'rcu': row 1: position 6 \+ n 3 = 9 exceeds capacity 8 "
                     r"of 'k'\. Nothing was written", _ortkv.cuda_take_error() or "")
    assert state() == before
    _run(sess, onnx_type, bufs, np.array([-2, 0]))
    assert state() == before
    with pytest.raises(Exception, match=r"E_INPUT.*RotaryCacheUpdate node 'rcu': position -2 for row 0 of 'k'"):
        _run(sess, onnx_type, bufs, np.array([0, 0]))  # the next run reports it
    assert state() == before and _ortkv.cuda_take_error() is None
    other = bufs["k"].clone()
    with pytest.raises(Exception, match=r"E_ALIAS.*output 'k_out' at 0x[0-9a-f]+ is not the storage of input 'k'"):
        _run(sess, onnx_type, bufs, np.array([0, 0]), k_out=other)
    assert state() == before and _host(other, np_type).tobytes() == before[0]
    # a write-protected token of the VALUE cache: row 0, head 1, position 2 (D float16 = 16 bytes)
    at = bufs["v"].data_ptr() + ((0 * Hkv + 1) * cap + 2) * D * 2
    rid = _ortkv.protect_range(_ortkv.DEVICE_CUDA, 0, at, 16, "shared prefix")
    try:
        _run(sess, onnx_type, bufs, np.array([1, 0]))  # row 0 writes positions 1..3
        err = _ortkv.cuda_take_error() or ""
        assert "[ortkv:E_READONLY]" in err and "RotaryCacheUpdate node 'rcu'" in err and "of 'v' would write" in err, err
        assert state() == before
    finally:
        assert _ortkv.unprotect_range(rid)
    with pytest.raises(Exception, match=r"rotary table 'cos' has shape \[4, 4\]"):
        short = dict(bufs, cos=bufs["cos"][:4].clone(), sin=bufs["sin"][:4].clone())
        _run(sess, onnx_type, short, np.array([0, 0]))
    assert state() == before


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (4, 3, 2 * 40), (70000, 2 * 3)])
def test_cuda_swiglu_matches_reference(rng, dtype, shape):
    np_type, onnx_type = DTYPES[dtype]
    x = (rng.standard_normal(shape) * 4).astype(np.float32).astype(np_type)
    xt, yt = _to_torch(x), _to_torch(np.zeros(shape[:-1] + (shape[-1] // 2,), np_type))
    sess = _session(swiglu_model(onnx_type, shape=[f"d{i}" for i in range(len(shape))]))
    io = sess.io_binding()
    io.bind_input("x", "cuda", 0, onnx_type, list(x.shape), xt.data_ptr())
    io.bind_output("y", "cuda", 0, onnx_type, list(yt.shape), yt.data_ptr())
    sess.run_with_iobinding(io)
    tol = TOL[dtype] * 4  # |y| up to ~50
    np.testing.assert_allclose(_host(yt, np_type).astype(np.float32), swiglu_ref(x).astype(np.float32), rtol=tol,
                               atol=tol)


def _providers_of(profile_path):
    with open(profile_path) as f:
        events = json.load(f)
    return [(e["args"]["op_name"], e["args"].get("provider")) for e in events
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def _profiled_greedy_decode(model, w, cap, profile_prefix):
    """A float16 SBNH ortkv decoder of `w` (batch 1, caches of `cap` tokens) through MutableCacheSession on CUDA
    with ORT's profiler: a 5-token prefill and 8 greedy decode steps. Returns the 9 picked tokens, the last
    position's logits of each run [9, 1, V] and the profile's (op, provider) per node run."""
    import onnxruntime as ort

    from ortkv.generate import builder

    Hkv, D = w.config.kv_heads, w.config.head_size
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = profile_prefix
    s = ortkv.MutableCacheSession(model, providers=["CUDAExecutionProvider"], sess_options=so)
    caches = {}  # kept alive while bound
    for i in range(len(w.layers)):
        for name in builder.ortkv_names(i)[:2]:
            caches[name] = ort.OrtValue.ortvalue_from_numpy(np.zeros((cap, 1, Hkv, D), np.float16), "cuda", 0)
            s.bind_cache(name, caches[name])
    ids = np.array([[504, 3575, 282, 4649, 314]])
    pos, tokens, logits = np.array([0]), [], []
    for _ in range(9):
        (out,) = s.run(["logits"], {"input_ids": ids, "positions": pos})
        logits.append(out[:, -1])
        pos = pos + ids.shape[1]
        ids = out[:, -1].argmax(-1)[:, None]
        tokens.append(int(ids[0, 0]))
    profile = _providers_of(s._session.end_profiling())
    s.close()
    return tokens, np.stack(logits), profile


def test_cuda_fused_decoder_runs_every_ortkv_node_on_cuda_and_keeps_the_tokens(tmp_path):
    """A 2-layer float16 SBNH ortkv decoder (Note [Fused ortkv layer]) through MutableCacheSession on CUDA:
    ORT's profile shows every RotaryCacheUpdate / SwiGLU / CacheAttention node on CUDAExecutionProvider, and
    prefill + 8 greedy decode steps give the unfused graph's tokens, logits within float16 noise."""
    from ortkv.generate import builder, weights
    from ortkv.generate.assets import smollm2_gguf

    w, _ = weights.load(smollm2_gguf(), layers=2)
    cap, runs = 64, {}
    for fused in (True, False):
        model = builder.build(w, "ortkv", max_positions=cap, dtype="float16", cache_layout="SBNH", fused=fused)
        ops = {n.op_type for n in model.graph.node}
        assert ({"RotaryCacheUpdate", "SwiGLU"} <= ops) == fused and ("CacheUpdate" in ops) != fused
        tokens, logits, profile = _profiled_greedy_decode(model, w, cap, str(tmp_path / f"decode_{fused}"))
        ours = [(op, p) for op, p in profile if op in ("RotaryCacheUpdate", "SwiGLU", "CacheAttention", "CacheUpdate")]
        assert ours and {p for _, p in ours} == {"CUDAExecutionProvider"}, ours
        if fused:
            assert sum(op == "RotaryCacheUpdate" for op, _ in ours) == 2 * 9  # 2 layers x 9 runs
            assert sum(op == "SwiGLU" for op, _ in ours) == 2 * 9
        runs[fused] = tokens, logits
    assert runs[True][0] == runs[False][0]
    np.testing.assert_allclose(runs[True][1], runs[False][1], atol=0.15, rtol=0.02)
