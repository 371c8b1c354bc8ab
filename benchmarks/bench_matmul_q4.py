"""One projection, four ways, on SmolLM2-135M's shapes (issue 12): ortkv.MatMulQ4 (Q4_1 exactly, Note [MatMulQ4
layout] in custom_ops/include/ortkv/matmul_q4.h) with one int8 activation term (the decoders') and two, against onnxruntime's
MatMulNBits 4-bit (uint8 zero points, accuracy_level 4) alone, MatMulNBits 4-bit + the Q4_1 minimum term
(Reshape + ReduceSum + MatMul + Add: the old q4 graph, genai's today) and MatMulNBits 8-bit (weights q8,
Note [8-bit from Q4_1]).

Each session holds --copies nodes of the same shape on DIFFERENT random weights fed the same x, so that
the weights stream from memory as in a decode step (SmolLM2's 30 layers do not fit a cache); the figure is
the run's time divided by the copies. The variants alternate within a round (a load that comes and goes
falls on all), medians over the rounds, and the median of the per-round ratios to MatMulQ4.

    python benchmarks/bench_matmul_q4.py [--rounds 7] [--threads 2] [--m 1,4] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from ortkv.generate import weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit  # noqa: E402

SHAPES = [("QKV", 576, 960), ("output", 576, 576), ("gate/up", 576, 3072), ("down", 1536, 576)]
VARIANTS = ["MatMulQ4 (1 term)", "MatMulQ4 (2 terms)", "MatMulNBits 4-bit", "MatMulNBits 4-bit + minimum term",
            "MatMulNBits 8-bit"]


def q4_1(rng, N, K):
    kb = K // 32
    codes = rng.integers(0, 16, (N, kb, 32))
    d = (rng.random((N, kb)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(4, 11, (N, kb))).astype(np.float16).astype(np.float32)
    return weights.Q4Weight((codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), d,
                            np.zeros((N, (kb + 1) // 2), np.uint8), K, N, 4, 32, mins=m)


def build(variant, K, N, M, copies, seed=0):
    rng = np.random.default_rng(seed)
    nodes, inits = [], [numpy_helper.from_array(np.array([0, K // 32, 32], np.int64), "shape_blocks"),
                        numpy_helper.from_array(np.array([-1], np.int64), "axis_last")]
    for i in range(copies):
        w = q4_1(rng, N, K)
        if variant.startswith("MatMulQ4"):
            p = weights.pack_matmul_q4(w)
            inits += [numpy_helper.from_array(p.codes, f"c{i}"), numpy_helper.from_array(p.scales, f"s{i}"),
                      numpy_helper.from_array(p.mins, f"m{i}")]
            nodes.append(helper.make_node("MatMulQ4", ["x", f"c{i}", f"s{i}", f"m{i}"], [f"y{i}"], domain="ortkv",
                                          K=K, N=N, act_terms=2 if "2 terms" in variant else 1))
            continue
        if variant == "MatMulNBits 8-bit":
            w = weights.q8_from_q4_1(w)
        inits += [numpy_helper.from_array(w.packed, f"c{i}"), numpy_helper.from_array(w.scales, f"s{i}"),
                  numpy_helper.from_array(w.zero_points, f"z{i}")]
        with_mins = variant.endswith("minimum term")
        nodes.append(helper.make_node("MatMulNBits", ["x", f"c{i}", f"s{i}", f"z{i}"], [f"p{i}" if with_mins else f"y{i}"],
                                      domain="com.microsoft", K=K, N=N, bits=w.bits, block_size=32, accuracy_level=4))
        if with_mins:
            if i == 0:  # one block sum per input, shared (as the builder does)
                nodes += [helper.make_node("Reshape", ["x", "shape_blocks"], ["xb"]),
                          helper.make_node("ReduceSum", ["xb", "axis_last"], ["xs"], keepdims=0)]
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.mins.T), f"M{i}"))
            nodes += [helper.make_node("MatMul", ["xs", f"M{i}"], [f"t{i}"]),
                      helper.make_node("Add", [f"p{i}", f"t{i}"], [f"y{i}"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [M, K])],
                          [helper.make_tensor_value_info(f"y{i}", TP.FLOAT, None) for i in range(copies)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                                               helper.make_opsetid("ortkv", 1)], ir_version=10)


def session(model, threads):
    so = ort.SessionOptions()
    so.register_custom_ops_library(ortkv.get_library_path())
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copies", type=int, default=30, help="nodes of one shape per session, on different weights")
    p.add_argument("--runs", type=int, default=10, help="timed runs per round and variant (after 3 untimed)")
    p.add_argument("--m", default="1", help="rows of x, comma-separated (1: a decode step at batch 1)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    load0 = os.getloadavg()[0]
    lines = [f"# MatMulQ4 vs MatMulNBits, one projection (SmolLM2-135M shapes), {a.threads} threads",
             "", f"`python benchmarks/bench_matmul_q4.py --rounds {a.rounds} --threads {a.threads} --m {a.m} "
             f"--copies {a.copies}`, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; microseconds per node "
             f"({a.copies} nodes of one shape on different weights per session, {a.runs} runs per round, variants "
             f"alternating, medians of {a.rounds} rounds); ratio: the median of the per-round ratios of the variant "
             "to MatMulQ4 with one int8 activation term, as the q4 decoders run it (> 1: MatMulQ4 faster).", "",
             "| shape (K x N) | M | " + " | ".join(VARIANTS) + " |", "|---|---:|" + "---:|" * len(VARIANTS)]
    for M in (int(x) for x in a.m.split(",")):
        for label, K, N in SHAPES:
            sess = {v: session(build(v, K, N, M, a.copies), a.threads) for v in VARIANTS}
            x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
            times = {v: [] for v in VARIANTS}
            for _ in range(a.rounds):
                for v, s in sess.items():
                    for _ in range(3):
                        s.run(None, {"x": x})
                    t = time.perf_counter()
                    for _ in range(a.runs):
                        s.run(None, {"x": x})
                    times[v].append((time.perf_counter() - t) / a.runs / a.copies * 1e6)
            base = times[VARIANTS[0]]
            cells = []
            for v in VARIANTS:
                ratio = statistics.median(t / b for t, b in zip(times[v], base))
                cells.append(f"{statistics.median(times[v]):.1f}" + ("" if v == VARIANTS[0] else f" ({ratio:.2f}x)"))
            lines.append(f"| {label} ({K} x {N}) | {M} | " + " | ".join(cells) + " |")
            print(lines[-1], file=sys.stderr)
            del sess
    lines += ["", f"1-minute load average: {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
              f"({os.cpu_count()} CPUs)."]
    return emit("\n".join(lines), a.out)


if __name__ == "__main__":
    sys.exit(main())
