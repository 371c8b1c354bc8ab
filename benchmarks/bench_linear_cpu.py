"""ortkv.Linear's float32 CPU kernel (Note [Linear CPU GEMV] in custom_ops/kernels/cpu/linear.cc) against ORT's
MatMul (MLAS) on the SmolLM2-135M decoder's projection shapes and its tied LM head, at M = 1 (a batch-1 decode
step; --ms for more), float32, on the CPU.

  case   : one model of R nodes of one kind, each with its OWN weight and reading the same X [M, K], each Y a
           graph output bound once to a numpy buffer (IOBinding); R is chosen so that the R weights hold
           >= --pool-mib MiB (256 by default: 5x this VM's 48 MiB L3), so every node reads its weight from
           memory as a decode step's 121 projections do (the LM head alone is 113 MB: R = 3).
             matmul : ONNX MatMul, W [K, N] (the float32 decoder's form; ORT prepacks B for MLAS's SGEMM)
             linear : ortkv.Linear, W [N, K] (the same values transposed)
  timing : per round and shape, both sessions are created (creation order alternating between rounds: two
           sessions alive in one process can differ by their creation order) and run one after the other in
           that order, each --reps timed calls after 2 untimed ones in one block (not interleaved call by call:
           the idle session's spinning intra-op worker would take a CPU from the running one); ms per node =
           median call / R. GB/s = the weight's bytes (N K 4) / ms per node. Each figure: the median over --rounds
           rounds; the ratio is the median of the per-round ratios (matmul ms / linear ms: > 1 = Linear faster).
  threads: ORT's intra-op threads (--threads, 2 by default), as the decoder's sessions.

    python benchmarks/bench_linear_cpu.py [--rounds 5] [--reps 15] [--ms 1] [--pool-mib 256] [--threads 2]
                                          [--shapes qkv,o,gate_up,down,lm_head] [--out benchmarks/results/linear_cpu.md]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit  # noqa: E402

import ortkv  # noqa: E402

# (name, K, N): SmolLM2-135M's per-layer projections (x 30 layers) and the tied LM head
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]
KINDS = ("matmul", "linear")


def _model(kind: str, M: int, K: int, N: int, R: int, w: np.ndarray) -> bytes:
    nodes, inits, outputs = [], [], []
    for r in range(R):
        w = w.copy()
        w[0, 0] = r / R  # R distinct tensors: nothing for ORT to share
        if kind == "matmul":
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"w{r}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{r}"], [f"y{r}"], name=f"mm{r}"))
        else:
            inits.append(numpy_helper.from_array(w, f"w{r}"))
            nodes.append(helper.make_node("Linear", ["x", f"w{r}"], [f"y{r}"], domain="ortkv", name=f"lin{r}"))
        outputs.append(helper.make_tensor_value_info(f"y{r}", TP.FLOAT, [M, N]))
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", TP.FLOAT, [M, K])], outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)],
                          ir_version=10)
    return m.SerializeToString()


class _Case:
    """One session of R nodes with X and every Y bound once."""

    def __init__(self, model: bytes, x: np.ndarray, R: int, N: int, threads: int):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = threads
        so.register_custom_ops_library(ortkv.get_library_path())
        self.sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        self.io = self.sess.io_binding()
        self.io.bind_cpu_input("x", x)
        self.ys = [np.empty((x.shape[0], N), np.float32) for _ in range(R)]
        for r, y in enumerate(self.ys):
            self.io.bind_output(f"y{r}", "cpu", 0, np.float32, list(y.shape), y.ctypes.data)
        for _ in range(3):
            self.sess.run_with_iobinding(self.io)

    def run(self) -> float:
        t = time.perf_counter()
        self.sess.run_with_iobinding(self.io)
        return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ms", default="1")
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.ms.split(",")]
    want = args.shapes.split(",")
    shapes = [s for s in SHAPES if s[0] in want]
    rng = np.random.default_rng(0)
    load0 = os.getloadavg()[0]
    res: dict = {}  # (shape, M) -> {kind: [ms per node per round]}
    for rnd in range(args.rounds):
        for name, K, N in shapes:
            R = max(1, math.ceil((args.pool_mib << 20) / (N * K * 4)))
            w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
            for M in ms:
                x = rng.standard_normal((M, K)).astype(np.float32)
                kinds = KINDS if rnd % 2 == 0 else KINDS[::-1]
                cases = {kind: _Case(_model(kind, M, K, N, R, w), x, R, N, args.threads) for kind in kinds}
                w0 = w.astype(np.float64)
                w0[0, 0] = 0.0  # node 0's weight
                ref0 = x.astype(np.float64) @ w0.T
                for kind, c in cases.items():  # both compute the product (a wrong kernel must not be timed)
                    assert np.allclose(c.ys[0], ref0, rtol=1e-4, atol=1e-4), (kind, name, M)
                # one kind's calls in a block, after 2 untimed calls: an idle session's intra-op worker keeps
                # spinning for a while after its last run, and calls interleaved one by one ran both kinds at
                # ~10 GB/s on 2 CPUs (3 busy threads) where either alone streams at ~20+
                times = {k: [] for k in kinds}
                for kind in kinds:
                    cases[kind].run()
                    cases[kind].run()
                    times[kind] = [cases[kind].run() for _ in range(args.reps)]
                del cases
                for kind in KINDS:
                    res.setdefault((name, M, K, N, R), {}).setdefault(kind, []).append(
                        1e3 * statistics.median(times[kind]) / R)
        print(f"round {rnd + 1} done", file=sys.stderr)
    lines = [
        "# ortkv.Linear vs ORT MatMul (MLAS), float32, CPU",
        "",
        f"`python benchmarks/bench_linear_cpu.py --rounds {args.rounds} --reps {args.reps} --ms {args.ms} "
        f"--pool-mib {args.pool_mib} --threads {args.threads}`; {os.cpu_count()} CPUs, {args.threads} intra-op "
        f"threads. ms per node: medians of {args.reps} alternated calls of R nodes / R, then the median over "
        f"{args.rounds} rounds; ratio: median of the per-round MatMul ms / Linear ms (> 1: Linear faster).",
        "",
        "| shape | K x N | M | R nodes | MatMul ms | MatMul GB/s | Linear ms | Linear GB/s | ratio | ratios per round |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    tot = {k: 0.0 for k in KINDS}
    for (name, M, K, N, R), t in res.items():
        gb = N * K * 4 / 1e9
        mm, li = statistics.median(t["matmul"]), statistics.median(t["linear"])
        ratios = [a / b for a, b in zip(t["matmul"], t["linear"])]
        if M == 1:
            per_step = 1 if name == "lm_head" else 30
            tot["matmul"] += per_step * mm
            tot["linear"] += per_step * li
        lines.append(f"| {name} | {K} x {N} | {M} | {R} | {mm:.4f} | {gb / mm * 1e3:.1f} | {li:.4f} | "
                     f"{gb / li * 1e3:.1f} | **{statistics.median(ratios):.3f}** | "
                     + ", ".join(f"{r:.3f}" for r in ratios) + " |")
    if all(s in want for s, _, _ in SHAPES) and 1 in ms:
        mb = sum((1 if s == "lm_head" else 30) * K * N * 4 for s, K, N in SHAPES) / 1e6
        lines += ["", f"A decode step's 121 projections at M = 1 (30 x each layer shape + the LM head, {mb:.1f} MB) "
                  f"from these medians: MatMul {tot['matmul']:.2f} ms ({mb / tot['matmul']:.1f} GB/s), Linear "
                  f"{tot['linear']:.2f} ms ({mb / tot['linear']:.1f} GB/s)."]
    lines += ["", f"load average (1 min) on {os.cpu_count()} CPUs: {load0:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end"]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
