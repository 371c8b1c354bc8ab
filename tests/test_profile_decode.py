"""benchmarks/profile_decode.py --floor (issue 12): the session of a decoder's MatMulNBits nodes alone, the
floor a decode step's time is compared with, must run exactly the decoder's projections on its own weights."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from ortkv.generate import builder, models, weights
from ortkv.generate.assets import smollm2_gguf

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def profile_decode():
    sys.path.insert(0, str(BENCH))  # the script imports benchmarks/_report.py
    try:
        spec = importlib.util.spec_from_file_location("profile_decode", BENCH / "profile_decode.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def _dequantized(inits: dict, node) -> np.ndarray:
    """[K, N] float32 from a MatMulNBits node's bits-8 initializers, in numpy: (code - zero point) * scale."""
    attrs = {a.name: a.i for a in node.attribute}
    assert attrs["bits"] == 8
    K, N, block = attrs["K"], attrs["N"], attrs["block_size"]
    codes = inits[node.input[1]].astype(np.float64)  # [N, K / block, block]
    scales = inits[node.input[2]].astype(np.float64)  # [N, K / block]
    zp = inits[node.input[3]].astype(np.float64) if len(node.input) > 3 and node.input[3] else np.full_like(scales, 128)
    return ((codes - zp[..., None]) * scales[..., None]).reshape(N, K).T


def test_matmulnbits_only_runs_the_decoders_projections_on_its_weights(profile_decode, tmp_path):
    w8, _ = weights.load(smollm2_gguf(), layers=2, fmt="q8")
    path = models.save_decoder(builder.build(w8, "ortkv", max_positions=64), tmp_path, "ortkv")
    decoder = onnx.load(str(path))
    mm = [n for n in decoder.graph.node if n.op_type == "MatMulNBits"]
    assert len(mm) == 2 * 4 + 1  # QKV, output, gate/up, down per layer, and the LM head

    only, feeds, count = profile_decode._matmulnbits_only(path)
    model = onnx.load_from_string(only)
    assert count == len(mm) and [n.name for n in model.graph.node] == [n.name for n in mm]
    assert sorted(feeds) == ["x1536", "x576"]  # one token's activations per K: hidden and ffn
    inits = {t.name: numpy_helper.to_array(t) for t in decoder.graph.initializer}
    sess = ort.InferenceSession(only, providers=["CPUExecutionProvider"])
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    for node in mm:
        K = next(a.i for a in node.attribute if a.name == "K")
        ref = feeds[f"x{K}"][0, 0].astype(np.float64) @ _dequantized(inits, node)
        got = outs[node.output[0]].reshape(-1)
        assert got.shape == ref.shape, node.name
        # accuracy_level 4: int8 activations per block of 32, ~1 % of the output's scale
        assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max(), node.name
