"""What a new CUDA graph id costs onnxruntime: a chain of float16 MatMul + Add + Relu nodes (30 blocks, 211 nodes,
[1, 576] activations: a decoder step's node count and shapes, without ortkv), CUDAExecutionProvider with
enable_cuda_graph, IOBinding; for each of --ids graph ids, --runs runs timed one by one. The paged runner moves decode
to a new id after every pool commit (Note [Paged decoder on CUDA]), so this is what each commit costs on top of a
replay. Needs onnxruntime-gpu and a CUDA device.

    python benchmarks/bench_graph_capture_cuda.py [--ids 8] [--runs 12] [--out benchmarks/results/graph_capture_cuda.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from _report import emit  # benchmarks/ is on sys.path when a script runs


def chain_model(blocks: int = 30, width: int = 576):
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for b in range(blocks):
        for j in range(3):
            w, bias = f"w{b}_{j}", f"b{b}_{j}"
            inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) * 0.02).astype(np.float16), w))
            inits.append(numpy_helper.from_array(np.zeros(width, np.float16), bias))
            nodes += [helper.make_node("MatMul", [x, w], [f"m{b}_{j}"]),
                      helper.make_node("Add", [f"m{b}_{j}", bias], [f"a{b}_{j}"])]
            x = f"a{b}_{j}"
        nodes.append(helper.make_node("Relu", [x], [f"r{b}"]))
        x = f"r{b}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TP.FLOAT16, [1, width])],
                              [helper.make_tensor_value_info("y", TP.FLOAT16, [1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString(), len(nodes)


def main(argv=None) -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", type=int, default=8)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model, n_nodes = chain_model()
    sess = ort.InferenceSession(model, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    x = ort.OrtValue.ortvalue_from_numpy(np.ones((1, 576), np.float16), "cuda", 0)
    y = ort.OrtValue.ortvalue_from_shape_and_type([1, 576], np.float16, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", x)
    io.bind_ortvalue_output("y", y)
    rows = []
    for gid in range(1, a.ids + 1):
        ro = ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", str(gid))
        t = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            sess.run_with_iobinding(io, ro)
            t.append((time.perf_counter() - t0) * 1e3)
        rows.append(t)
    later = rows[1:]  # the session's first id also pays the session's warm-up
    replay = statistics.median(v for t in later for v in t[2:])
    first = statistics.median(t[0] for t in later)
    lines = [f"# A new CUDA graph id in onnxruntime {ort.__version__} ({n_nodes}-node float16 chain)", "",
             f"command: `python benchmarks/bench_graph_capture_cuda.py --ids {a.ids} --runs {a.runs}`", "",
             "| graph id | ms per run, in order |", "|---:|---|"]
    lines += [f"| {i + 1} | {' '.join(f'{v:.3f}' for v in t)} |" for i, t in enumerate(rows)]
    lines += ["", f"First run of a new id (ids 2..{a.ids}, median): **{first:.3f} ms**; a replay: **{replay:.3f} ms**; "
              f"a new id costs {first - replay:.3f} ms more than a replay ({first / replay:.1f}x)."]
    return emit("\n".join(lines), a.out)


if __name__ == "__main__":
    raise SystemExit(main())
