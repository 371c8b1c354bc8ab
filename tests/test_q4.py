"""The 4-bit CPU weight path (issue 12; Note [Fast 4-bit path] in python/ortkv/generate/weights.py):
Q4_1 matrices kept exactly, as ortkv.MatMulQ4 (the ortkv and copy decoders) or in MatMulNBits' fast form
(codes, uint8 zero points, block minimums added as blocksum(x) @ M: the genai decoder), the Q8_0 tied
embedding / LM head as 8-bit blocks (GatherBlockQuantized, MatMulNBits).
Checked against numpy dequantizations of the same packed blocks, for form (no float zero points, no float32
copy of a whole weight, every node on the CPU provider) and for agreement with llama.cpp."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from ortkv.generate import builder, weights
from ortkv.generate.assets import smollm2_gguf
from ortkv.generate.cli import apply_overrides
from ortkv.generate.config import GenAIConfig
from ortkv.generate.reference import load_reference, top1_agreement
from ortkv.generate.runners import make_runner

REFERENCE = Path(__file__).resolve().parent / "data" / "smollm2_llamacpp_reference.json"
IDS = np.array([[504, 3575, 282, 4649, 314, 7042, 30]])


@pytest.fixture(scope="module")
def gguf():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def two_layers(gguf):
    w4, _ = weights.load(gguf, layers=2, fmt="q4")
    w32, _ = weights.load(gguf, layers=2)
    return w4, w32


def _copy_logits(model, layers=2):
    sess = ortkv.MutableCacheSession(model)  # the copy graph has no caches: a plain run
    T = IDS.shape[1]
    past = {n: np.zeros((1, 3, 0, 64), np.float32) for i in range(layers) for n in builder.genai_names(i)[:2]}
    (out,) = sess.run(["logits"], {"input_ids": IDS, "attention_mask": np.ones((1, T), np.int64),
                                   "position_ids": np.arange(T)[None], **past})
    return out


def _dequantized(w4: weights.LlamaWeights) -> weights.LlamaWeights:
    """The same packed blocks dequantized in numpy: a float32 LlamaWeights for the float32 graph."""
    layers = [{k: (v.dequantize() if isinstance(v, weights.Q4Weight) else v) for k, v in lw.items()}
              for lw in w4.layers]
    return weights.LlamaWeights(w4.config, embed=w4.embed_q.dequantize().T.copy(), final_norm=w4.final_norm,
                                layers=layers)


def test_packed_blocks_are_the_gguf_values_exactly(two_layers):
    """The 4-bit codes + scales + minimums and the 8-bit embedding reproduce gguf's own dequantization."""
    w4, w32 = two_layers
    for lw4, lw32 in zip(w4.layers, w32.layers):
        for name in ("wq", "wk", "wv", "wo", "wg", "wu", "wd"):
            q = lw4[name]
            assert q.bits == 4 and q.block_size == 32 and q.zero_points.dtype == np.uint8
            assert not q.zero_points.any()  # zero points 0: w = d * q + m, the minimum outside MatMulNBits
            np.testing.assert_allclose(q.dequantize(), lw32[name], rtol=0, atol=1e-6)
    assert w4.embed_q.bits == 8 and w4.embed_q.zero_points is None
    np.testing.assert_array_equal(w4.embed_q.dequantize().T, w32.embed)


@pytest.mark.parametrize("bits,K,N,zp", [(4, 576, 960, True), (4, 1536, 576, True), (8, 576, 4096, False),
                                        (8, 576, 960, True), (8, 1536, 576, True)])
def test_matmulnbits_node_matches_numpy_dequantization(bits, K, N, zp):
    """One MatMulNBits node in the builder's form (minimums added as the graph adds them) against
    x @ dequantize() in numpy: level 0 to float32 rounding, level 4 (int8 activations) within 1 %."""
    rng = np.random.default_rng(bits + K)
    kb = K // 32
    if bits == 4:
        codes = rng.integers(0, 16, (N, kb, 32))
        w = weights.Q4Weight((codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8),
                             rng.random((N, kb), np.float32) * 0.02, np.zeros((N, (kb + 1) // 2), np.uint8),
                             K, N, 4, 32, mins=-rng.random((N, kb), np.float32) * 0.15)
    else:
        w = weights.Q4Weight(rng.integers(1, 256, (N, kb, 32)).astype(np.uint8), rng.random((N, kb), np.float32) * 0.01,
                             rng.integers(0, 256, (N, kb)).astype(np.uint8) if zp else None, K, N, 8, 32)
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    ref = x @ w.dequantize().astype(np.float64)
    for level, tol in ((0, 1e-4), (4, 1e-2)):
        inits = [numpy_helper.from_array(w.packed, "B"), numpy_helper.from_array(w.scales, "S")]
        ins = ["x", "B", "S"] + (["Z"] if zp else [])
        if zp:
            inits.append(numpy_helper.from_array(w.zero_points, "Z"))
        nodes = [helper.make_node("MatMulNBits", ins, ["y0" if w.mins is not None else "y"], domain="com.microsoft",
                                  K=K, N=N, bits=bits, block_size=32, accuracy_level=level)]
        if w.mins is not None:
            inits += [numpy_helper.from_array(np.array([0, 0, kb, 32], np.int64), "shape"),
                      numpy_helper.from_array(np.array([-1], np.int64), "axis"),
                      numpy_helper.from_array(np.ascontiguousarray(w.mins.T), "M")]
            nodes += [helper.make_node("Reshape", ["x", "shape"], ["xb"]),
                      helper.make_node("ReduceSum", ["xb", "axis"], ["xs"], keepdims=0),
                      helper.make_node("MatMul", ["xs", "M"], ["m"]), helper.make_node("Add", ["y0", "m"], ["y"])]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [1, 3, K])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [1, 3, N])], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
        (y,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
        err = np.abs(y - ref).max() / np.abs(ref).max()
        assert err < tol, (level, err)


def test_q4_graph_computes_the_numpy_dequantized_model(two_layers):
    """The q4 copy graphs against the float32 graph of the SAME packed blocks dequantized in numpy. MatMulNBits
    + minimum term (the genai form, matmul_q4=False) at accuracy_level 0: float32 rounding. MatMulQ4 with two
    int8 activation terms (Note [MatMulQ4 activation terms]; the LM head at level 0): within ~1/250 of an int8
    step per block, a little looser. As shipped (MatMulQ4, the 8-bit LM head at level 4) and with one int8 term:
    the same top token at every position and logits within 2 % of their range."""
    w4, _ = two_layers
    ref = _copy_logits(builder.build(_dequantized(w4), "copy", max_positions=64))
    exact = _copy_logits(builder.build(w4, "copy", max_positions=64, accuracy_level=0, matmul_q4=False))
    np.testing.assert_allclose(exact, ref, rtol=1e-3, atol=2e-3)
    two_terms = _copy_logits(builder.build(w4, "copy", max_positions=64, accuracy_level=0))
    np.testing.assert_allclose(two_terms, ref, rtol=1e-3, atol=6e-3)
    for kw in ({}, {"accuracy_level": 4}):
        shipped = _copy_logits(builder.build(w4, "copy", max_positions=64, **kw))
        assert (shipped.argmax(-1) == ref.argmax(-1)).all(), kw
        assert np.abs(shipped - ref).max() < 0.02 * (ref.max() - ref.min()), kw


def _q4_ops(model: onnx.ModelProto):
    inits = {t.name: t for t in model.graph.initializer}
    return inits, [n for n in model.graph.node if n.op_type in ("MatMulNBits", "MatMulQ4", "GatherBlockQuantized", "MatMul",
                                                                "Gather")]


@pytest.mark.parametrize("variant", builder.VARIANTS)
def test_q4_graph_is_in_the_fast_form(two_layers, variant):
    """Issue 12: the old q4 graph gave MatMulNBits FLOAT zero points (MLAS then dequantizes the whole weight
    every call: ~5x slower than float32) and kept a float32 embedding and LM head. Now: the ortkv and copy
    variants carry every Q4_1 projection as one ortkv.MatMulQ4 (one int8 activation term); the genai variant
    (onnxruntime-genai loads no ortkv op) MatMulNBits with uint8 zero points and accuracy_level set; no float32
    weight larger than a minimums table, an 8-bit embedding lookup and LM head."""
    w4, _ = two_layers
    cfg = w4.config
    inits, nodes = _q4_ops(builder.build(w4, variant, max_positions=64))
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    q4op = [n for n in nodes if n.op_type == "MatMulQ4"]
    for n in nbits:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if len(n.input) > 3:
            assert inits[n.input[3]].data_type == TP.UINT8, f"{n.name}: float zero points miss the fast kernels"
        assert attrs["bits"] in (4, 8) and attrs["block_size"] == 32
        assert attrs.get("accuracy_level") == (0 if n.input[1].endswith("_wd_q4") else 4), n.name
    for n in q4op:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert n.domain == "ortkv" and attrs["act_terms"] == 1 and "isa" not in attrs, n.name
        assert [inits[i].data_type for i in n.input[1:]] == [TP.UINT8, TP.FLOAT16, TP.FLOAT16], n.name
    if variant == "genai":
        assert len(nbits) == 2 * 4 + 1 and not q4op  # per layer QKV, output, gate/up, down; the LM head
    else:
        assert len(nbits) == 1 and nbits[0].input[1] == "embed_q8" and len(q4op) == 2 * 4
        ops = collections.Counter(n.op_type for n in builder.build(w4, variant, max_positions=64).graph.node)
        # no minimum term: no ReduceSum; float MatMuls only in the copy model's attention (2 per layer)
        assert ops["ReduceSum"] == 0 and ops["MatMul"] == (2 * 2 if variant == "copy" else 0), ops
    # no float32 weight of a projection's size: the largest float32 MatMul operand is a minimums table
    for n in nodes:
        if n.op_type == "MatMul":
            for name in n.input:
                if name in inits:
                    assert np.prod(inits[name].dims) <= (cfg.ffn // 32) * cfg.hidden * 2, name
    lookups = [n.op_type for n in nodes if n.op_type in ("Gather", "GatherBlockQuantized") and n.input[0] in inits]
    assert lookups == ["GatherBlockQuantized"]  # the embedding; other Gathers read shapes
    big_float = [t.name for t in inits.values() if t.data_type == TP.FLOAT and np.prod(t.dims) >= cfg.vocab * cfg.hidden // 8]
    assert big_float == [], big_float  # no float32 embedding / LM head (its scales are 1/32 of it)


def test_q4_graph_has_four_matmulq4_per_layer(two_layers):
    w4, _ = two_layers
    model = builder.build(w4, "ortkv", max_positions=64)
    names = sorted(n.input[1] for n in model.graph.node if n.op_type == "MatMulQ4")
    assert names == sorted(f"l{i}_{k}_q4codes" for i in range(2) for k in ("wqkv", "wo", "wgu", "wd"))
    assert [n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits"] == ["embed_q8"]
    old = builder.build(w4, "ortkv", max_positions=64, matmul_q4=False)  # the genai form, on request
    names = sorted(n.input[1] for n in old.graph.node if n.op_type == "MatMulNBits")
    assert names == sorted([f"l{i}_{k}_q4" for i in range(2) for k in ("wqkv", "wo", "wgu", "wd")] + ["embed_q8"])
    assert not [n for n in old.graph.node if n.op_type == "MatMulQ4"]


def test_profile_every_node_on_cpu_and_no_dequantized_weights(two_layers, tmp_path):
    """A profiled run of the q4 copy graph: every node on CPUExecutionProvider, no DequantizeLinear / Cast
    of weights, and the node types are the ones the graph was built with (no float32 fallback subgraph)."""
    w4, _ = two_layers
    model = builder.build(w4, "copy", max_positions=64)
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "q4")
    sess = ortkv.MutableCacheSession(model, sess_options=so)
    past = {n: np.zeros((1, 3, 0, 64), np.float32) for i in range(2) for n in builder.genai_names(i)[:2]}
    for _ in range(3):
        sess.run(["logits"], {"input_ids": IDS[:, :1], "attention_mask": np.ones((1, 1), np.int64),
                              "position_ids": np.zeros((1, 1), np.int64), **past})
    trace = json.loads(Path(sess._session.end_profiling()).read_text())
    kernels = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    assert kernels
    providers = collections.Counter(e["args"]["provider"] for e in kernels)
    assert set(providers) == {"CPUExecutionProvider"}, providers
    ops = collections.Counter(e["args"]["op_name"] for e in kernels)
    assert ops["MatMulQ4"] == 3 * 8 and ops["MatMulNBits"] == 3 and ops["GatherBlockQuantized"] == 3, ops
    assert not {"DequantizeLinear", "MatMulInteger", "DynamicQuantizeLinear"} & set(ops), ops


def test_concat_n_refuses_mismatched_matrices(two_layers):
    w4, _ = two_layers
    with pytest.raises(ortkv.OrtkvError, match=r"concat_n: the matrices differ in K, bits, block size"):
        weights.concat_n([w4.layers[0]["wq"], w4.layers[0]["wd"]])  # K 576 and 1536


def test_q4_refuses_a_gguf_it_cannot_carry(tmp_path):
    from test_untrusted_input import write_gguf

    with pytest.raises(ortkv.OrtkvError, match=r"weights 'q4': embedding_length 8 is not a multiple of 32 \(the "
                                               r"block size of the 8-bit embedding / LM head\); use --weights float32"):
        weights.load(write_gguf(tmp_path / "tiny.gguf", context=64), fmt="q4")
    with pytest.raises(ortkv.OrtkvError, match=r"weights 'q4' need Q4_1 tensors; 'blk.0.attn_q.weight' is F32"):
        weights.load(write_gguf(tmp_path / "tiny32.gguf", context=64, hidden=32, heads=2, ffn=64), fmt="q4")


def test_q4_top1_agreement_with_llama_cpp():
    """Teacher-forced top-1 agreement with llama.cpp's continuations (float32 weights: 216/224 = 96.4 %;
    Note [Accuracy levels] in builder.py). The full q4 decoder is built once and cached."""
    if not REFERENCE.exists():
        pytest.skip(f"reference data not found at {REFERENCE}")
    ref = load_reference(REFERENCE)
    r = make_runner("ortkv", apply_overrides(GenAIConfig(), {"ortkv.weights": "q4"}))
    try:
        res = top1_agreement(r, ref["greedy"])
    finally:
        r.close()
    matches, total = sum(x["top1_matches"] for x in res), sum(x["positions"] for x in res)
    assert total == 224 and matches / total >= 0.95, res  # measured 217/224 (MatMulQ4)


# -- weights "q8": the Q4_1 blocks on MatMulNBits' 8-bit grid (Note [8-bit from Q4_1] in weights.py) -----------

def _q4_1(rng, N, K, mins=None):
    kb = K // 32
    codes = rng.integers(0, 16, (N, kb, 32))
    d = (rng.random((N, kb)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    m = (-rng.random((N, kb)) * 15 * d).astype(np.float16).astype(np.float32) if mins is None else mins
    return weights.Q4Weight((codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), d,
                            np.zeros((N, (kb + 1) // 2), np.uint8), K, N, 4, 32, mins=m)


def test_q8_from_q4_1_puts_the_16_levels_on_the_256_level_grid():
    """Where the block straddles 0 (m <= 0 <= m + 15 d): scale d / 17, codes 17 q exactly, the minimum moved by
    at most s / 2; anywhere (a block of positive values too): every value within s / 2 of the Q4_1 value."""
    rng = np.random.default_rng(7)
    w4 = _q4_1(rng, 64, 576)
    w8 = weights.q8_from_q4_1(w4)
    assert (w8.bits, w8.block_size, w8.K, w8.N, w8.mins) == (8, 32, 576, 64, None)
    assert w8.packed.shape == (64, 18, 32) and w8.packed.dtype == np.uint8
    assert w8.zero_points.shape == (64, 18) and w8.zero_points.dtype == np.uint8
    np.testing.assert_allclose(w8.scales, w4.scales / 17, rtol=1e-6)
    np.testing.assert_array_equal(w8.packed.astype(np.int32), 17 * w4.codes().astype(np.int32))
    np.testing.assert_array_equal(w8.zero_points.astype(np.int64), np.rint(-17.0 * w4.mins / w4.scales))
    ref = w4.dequantize().astype(np.float64)
    s = np.repeat(w8.scales.T, 32, axis=0)  # [K, N]
    err = np.abs(w8.dequantize() - ref)
    assert (err <= 0.5 * s * (1 + 1e-5) + 1e-9).all(), err.max()
    # blocks that do not straddle 0: all positive (m > 0) and all below 0 (m + 15 d < 0)
    kb = 576 // 32
    d = np.full((2, kb), 0.01, np.float32)
    w4b = _q4_1(rng, 2, 576, mins=np.stack([np.full(kb, 0.3, np.float32), np.full(kb, -0.5, np.float32)]))
    w4b.scales = d
    w8b = weights.q8_from_q4_1(w4b)
    err = np.abs(w8b.dequantize() - w4b.dequantize())
    assert (err <= 0.5 * np.repeat(w8b.scales.T, 32, axis=0) * (1 + 1e-4) + 1e-7).all(), err.max()
    assert w8b.zero_points[0].max() == 0 and w8b.zero_points[1].min() == 255  # 0 kept in the range


def test_q8_from_q4_1_refuses_what_is_not_q4_1():
    w8 = weights.quantize_q8(np.ones((4, 64), np.float32))
    with pytest.raises(ortkv.OrtkvError, match=r"q8_from_q4_1 needs a Q4_1 matrix \(bits 4, block 32, minimums\); "
                                               r"got bits 8, block 32, minimums no"):
        weights.q8_from_q4_1(w8)


def test_q8_weights_are_the_gguf_q4_1_values_within_a_34th_of_a_step(gguf, two_layers):
    w4, w32 = two_layers
    w8, _ = weights.load(gguf, layers=2, fmt="q8")
    assert w8.format == "q8"
    for lw8, lw4 in zip(w8.layers, w4.layers):
        for name in ("wq", "wk", "wv", "wo", "wg", "wu", "wd"):
            q8, q4 = lw8[name], lw4[name]
            assert q8.bits == 8 and q8.mins is None and q8.zero_points.dtype == np.uint8
            step = np.repeat(q4.scales.T, 32, axis=0)  # Q4_1's d per element, [K, N]
            assert (np.abs(q8.dequantize() - q4.dequantize()) <= step / 34 * (1 + 1e-4) + 1e-9).all(), name
    np.testing.assert_array_equal(w8.embed_q.packed, w4.embed_q.packed)  # the Q8_0 LM head unchanged


def test_q8_graph_has_no_minimum_term_and_runs_at_level_4(two_layers, gguf):
    """Four bits-8 MatMulNBits per layer (uint8 zero points, accuracy_level 4: MLAS has no fast 8-bit kernel at
    level 0, ffn_down included), no ReduceSum / float MatMul (the minimum term), Add + norm kept (unfused)."""
    w8, _ = weights.load(gguf, layers=2, fmt="q8")
    model = builder.build(w8, "ortkv", max_positions=64)
    inits = {t.name: t for t in model.graph.initializer}
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["MatMulNBits"] == 2 * 4 + 1 and ops["ReduceSum"] == 0 and ops["MatMul"] == 0, ops
    assert ops["SkipSimplifiedLayerNormalization"] == 0 and ops["SimplifiedLayerNormalization"] == 2 * 2 + 1, ops
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["bits"] == 8 and attrs["block_size"] == 32 and attrs["accuracy_level"] == 4, n.name
            if n.input[1] != "embed_q8":
                assert len(n.input) == 4 and inits[n.input[3]].data_type == TP.UINT8, n.name
    assert sorted(n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits") == sorted(
        [f"l{i}_{k}_q8" for i in range(2) for k in ("wqkv", "wo", "wgu", "wd")] + ["embed_q8"])


def test_q8_graph_computes_the_numpy_dequantized_model(gguf):
    """The q8 copy graph against the float32 graph of the same 8-bit blocks dequantized in numpy (level 4:
    int8 activations): the same top token at every position and logits within 2 % of their range."""
    w8, _ = weights.load(gguf, layers=2, fmt="q8")
    ref = _copy_logits(builder.build(_dequantized(w8), "copy", max_positions=64))
    got = _copy_logits(builder.build(w8, "copy", max_positions=64))
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(got - ref).max() < 0.02 * (ref.max() - ref.min())


def test_q8_refuses_a_gguf_it_cannot_carry(tmp_path):
    from test_untrusted_input import write_gguf

    with pytest.raises(ortkv.OrtkvError, match=r"weights 'q8' need Q4_1 tensors; 'blk.0.attn_q.weight' is F32"):
        weights.load(write_gguf(tmp_path / "tiny32.gguf", context=64, hidden=32, heads=2, ffn=64), fmt="q8")
    with pytest.raises(ortkv.OrtkvError, match=r"weights format 'q5': one of 'float32', 'q4', 'q8'"):
        weights.load(write_gguf(tmp_path / "tiny32.gguf", context=64, hidden=32, heads=2, ffn=64), fmt="q5")


def test_q8_top1_agreement_with_llama_cpp():
    """Teacher-forced top-1 agreement of the q8 decoder (measured 216/224 = 96.4 %, as float32 weights; with
    SkipSimplifiedLayerNormalization 211/224: Note [8-bit from Q4_1])."""
    if not REFERENCE.exists():
        pytest.skip(f"reference data not found at {REFERENCE}")
    ref = load_reference(REFERENCE)
    r = make_runner("ortkv", apply_overrides(GenAIConfig(), {"ortkv.weights": "q8"}))
    try:
        res = top1_agreement(r, ref["greedy"])
    finally:
        r.close()
    matches, total = sum(x["top1_matches"] for x in res), sum(x["positions"] for x in res)
    assert total == 224 and matches / total >= 0.95, res


def test_profile_decode_floor_times_the_matmulq4_nodes(two_layers, tmp_path):
    """benchmarks/profile_decode.py --floor: with q4 weights its 'projections alone' session holds the decoder's
    MatMulQ4 nodes (and the 8-bit LM head) on the decoder's own weights, and they compute x @ W."""
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("profile_decode", bench / "profile_decode.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(bench))
    from ortkv.generate import models

    w4, _ = two_layers
    path = models.save_decoder(builder.build(w4, "ortkv", max_positions=64), tmp_path, "ortkv")
    only, feeds, count = mod._matmulnbits_only(path)
    model = onnx.load_from_string(only)
    assert count == 2 * 4 + 1
    assert collections.Counter(n.op_type for n in model.graph.node) == {"MatMulQ4": 8, "MatMulNBits": 1}
    so = ort.SessionOptions()
    so.register_custom_ops_library(ortkv.get_library_path())
    sess = ort.InferenceSession(only, so, providers=["CPUExecutionProvider"])
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    q4 = {"l0_wqkv": concat_n3(w4.layers[0], ("wq", "wk", "wv")), "l1_wd": w4.layers[1]["wd"]}
    for node in model.graph.node:
        key = node.input[1].replace("_q4codes", "")
        if key not in q4:
            continue
        K = next(a.i for a in node.attribute if a.name == "K")
        ref = feeds[f"x{K}"][0, 0].astype(np.float64) @ q4[key].dequantize()
        got = outs[node.output[0]].reshape(-1)
        assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max(), key


def concat_n3(layer, names):
    return weights.concat_n([layer[n] for n in names])
