"""ortkv.Linear (Note [Linear] in custom_ops/include/ortkv/linear.h) against ORT's MatMul (cuBLAS) on CUDA, on the
SmolLM2-135M decoder's projection shapes and its tied LM head, at M = 1, 2, 4, 8 (our GEMV where LinearUsesGemv
picks it, Note [Linear path choice]; one variant per rows_per_warp) and 32 (both cuBLAS), float16.

  case   : one model of R nodes of one kind, each with its OWN weight and reading the same X [M, K], each Y a bound
           graph output; R is chosen so that the R weights hold >= --pool-mib MiB (256 by default: 5x the H200's
           50 MB L2), so every node reads its weight from HBM as a decode step's layers do.
             linear-rpwN : ortkv.Linear, W [N, K], attribute rows_per_warp = N (1, 2, 4; 2 is the default)
             matmul      : ONNX MatMul, W [K, N] (the decoder's former form; ORT's CUDA MatMul is a cuBLAS GEMM)
  timing : every session runs with enable_cuda_graph=1 (ORT captures the R nodes once and replays them), so a
           call is one replay + one synchronization; us per node = median call time / R (the replay's launch and
           the sync spread over R nodes). Each figure is the median over --rounds rounds (the kinds alternate
           inside a round) of the median of --reps timed calls after 3 warm-up calls (ORT's uncaptured run, the
           capture, one replay).
  GB/s   : the weight's bytes (N K 2) / us per node: a node reads its weight once and X from L2.

    python benchmarks/bench_linear_cuda.py [--rounds 5] [--reps 20] [--ms 1,2,4,8,32] [--pool-mib 256]
                                           [--kinds linear-rpw2,linear-rpw1,linear-rpw4,matmul]
                                           [--out benchmarks/results/linear_cuda.md]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit  # noqa: E402

import ortkv  # noqa: E402

# (name, K, N): SmolLM2-135M's per-layer projections (x 30 layers) and the tied LM head
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]
KINDS = ("linear-rpw2", "linear-rpw1", "linear-rpw4", "matmul")
MS = [1, 2, 4, 8, 32]


def _model(kind, M, K, N, R, w):
    nodes, inits, outputs = [], [], []
    for r in range(R):
        w = w.copy()
        w[0, 0] = np.float16(r / R)  # R distinct tensors: nothing for ORT to share
        if kind == "matmul":
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"w{r}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{r}"], [f"y{r}"], name=f"mm{r}"))
        else:
            inits.append(numpy_helper.from_array(w, f"w{r}"))
            nodes.append(helper.make_node("Linear", ["x", f"w{r}"], [f"y{r}"], domain="ortkv", name=f"lin{r}",
                                          rows_per_warp=int(kind.rsplit("rpw", 1)[1])))
        outputs.append(helper.make_tensor_value_info(f"y{r}", TP.FLOAT16, [M, N]))
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", TP.FLOAT16, [M, K])], outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def _case(kind, M, K, N, R, w, x):
    """A captured session of R nodes and its binding; returns a function timing `reps` calls (median us per node)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.register_custom_ops_library(ortkv.get_library_path())
    sess = ort.InferenceSession(_model(kind, M, K, N, R, w).SerializeToString(), so,
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    io = sess.io_binding()
    keep = [ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)]
    io.bind_ortvalue_input("x", keep[0])
    for r in range(R):
        keep.append(ort.OrtValue.ortvalue_from_shape_and_type([M, N], np.float16, "cuda", 0))
        io.bind_ortvalue_output(f"y{r}", keep[-1])
    for _ in range(3):  # ORT's uncaptured run, the capture, one replay
        sess.run_with_iobinding(io)

    def timed(reps):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            sess.run_with_iobinding(io)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / R * 1e6

    return timed, (sess, io, keep)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--pool-mib", type=int, default=256, help="weights per case (R copies of one shape's weight)")
    ap.add_argument("--max-nodes", type=int, default=512)
    ap.add_argument("--out")
    args = ap.parse_args()
    import onnxruntime as ort

    kinds = args.kinds.split(",")
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    for name, K, N in shapes:
        w = (rng.standard_normal((N, K)) / math.sqrt(K)).astype(np.float16)
        wbytes = N * K * 2
        R = max(1, min(args.max_nodes, math.ceil((args.pool_mib << 20) / wbytes)))
        for M in map(int, args.ms.split(",")):
            x = rng.standard_normal((M, K)).astype(np.float16)
            fns, res, note = {}, {k: [] for k in kinds}, ""
            for kind in kinds:
                try:
                    fns[kind] = _case(kind, M, K, N, R, w, x)
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    note += f"{kind}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} "
            for _ in range(args.rounds):
                for kind, (fn, _) in list(fns.items()):
                    res[kind].append(fn(args.reps))
            fns.clear()
            med = {k: statistics.median(v) for k, v in res.items() if v}
            rows.append((name, K, N, M, R, wbytes, med, note.strip()))
            print(rows[-1], flush=True)
    cmd = " ".join(["python", "benchmarks/bench_linear_cuda.py"] + sys.argv[1:])
    lines = [f"# ortkv.Linear vs MatMul (cuBLAS) on CUDA, float16 (onnxruntime {ort.__version__})", "",
             f"Command: `{cmd}` (CUDA graph replays of R nodes with their own weights; see the script's docstring). "
             f"Host load (1 min): {os.getloadavg()[0]:.2f}.", "",
             "us per node (GB/s of weight read). linear-rpwN: ortkv.Linear with rows_per_warp N (our GEMV where "
             "Note [Linear path choice] picks it, else cuBLAS GemmEx); matmul: ORT's MatMul. ratio: matmul / the fastest linear (> 1: Linear faster).",
             ""]
    head = "| shape | K | N | M | R | " + " | ".join(kinds) + " | ratio | note |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for name, K, N, M, R, wbytes, med, note in rows:
        cells = [f"{med[k]:.2f} ({wbytes / med[k] / 1e3:.0f})" if k in med else "-" for k in kinds]
        lin = [med[k] for k in kinds if k.startswith("linear") and k in med]
        ratio = f"{med['matmul'] / min(lin):.2f}" if lin and "matmul" in med else "-"
        lines.append(f"| {name} | {K} | {N} | {M} | {R} | " + " | ".join(cells) + f" | {ratio} | {note} |")
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
