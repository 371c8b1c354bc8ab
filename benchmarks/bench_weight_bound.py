"""Float32 decode against the weight-read bound, in one script (issue: CPU decode).

A batch-1 decode step of a float32 model reads every weight matrix once: on a CPU whose caches hold a
small fraction of them, the step cannot be faster than (bytes of weights read per token) / (memory read
bandwidth). This script measures both in one process tree, alternating, and reports ortkv's decode rate
as a fraction of that bound.

  bytes per token : from the ortkv decoder's initializers: every tensor read whole per step (MatMul /
                    Gemm / MatMulNBits weights, the tied LM head, norm weights), not the tables that a
                    Gather or RotaryEmbedding reads one row of (embedding, cos/sin caches).
  bandwidth       : numpy reading a 512 MiB array (np.sum and np.max over parts on `threads` threads;
                    numpy drops the GIL in reductions), best of several passes: the memory read rate the
                    weights can be streamed at. Also the copy rate (read + written bytes) for information.
  decode          : `ortkv generate --json` (float32 weights, batch 1, `--tokens` new tokens), the
                    decode_tok_s it reports; rounds alternate bandwidth and decode.

    python benchmarks/bench_weight_bound.py [--rounds 3] [--tokens 256] [--threads 2]
                                            [--out benchmarks/results/weight_bound.md]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from _report import emit  # benchmarks/ is on sys.path when a script runs

PROMPT = "Once upon a time, there was a little robot who"
WHOLE_READ_OPS = {"MatMul", "Gemm", "MatMulNBits", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                  "RMSNormalization", "Mul", "Add"}
_ITEMSIZE = {1: 4, 2: 1, 3: 1, 5: 2, 6: 4, 7: 8, 10: 2, 11: 8, 16: 2}


def weight_bytes_per_token(model_path: Path) -> tuple[int, int]:
    """(bytes read whole per decode step, bytes of all initializers) of a decoder."""
    m = onnx.load(str(model_path), load_external_data=False)
    readers: dict[str, set[str]] = {}
    for n in m.graph.node:
        for i in n.input:
            readers.setdefault(i, set()).add(n.op_type)
    whole = total = 0
    for t in m.graph.initializer:
        nbytes = int(np.prod(t.dims, dtype=np.int64)) * _ITEMSIZE.get(t.data_type, 4)
        total += nbytes
        if readers.get(t.name, set()) & WHOLE_READ_OPS:
            whole += nbytes
    return whole, total


def read_bandwidth(threads: int, mib: int = 512, passes: int = 5) -> tuple[float, float]:
    """(read GB/s, copy GB/s counting read + written bytes), best of `passes`."""
    n = (mib << 20) // 4
    a = np.ones(n, dtype=np.float32)
    b = np.empty_like(a)
    parts = np.array_split(np.arange(n), threads)
    bounds = [(p[0], p[-1] + 1) for p in parts]
    best_r = best_c = 0.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(passes):
            for reduce in (np.sum, np.max):  # np.max streams faster than np.sum's pairwise adds
                t0 = time.perf_counter()
                list(pool.map(lambda r: float(reduce(a[r[0]:r[1]])), bounds))
                best_r = max(best_r, a.nbytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            list(pool.map(lambda r: np.copyto(b[r[0]:r[1]], a[r[0]:r[1]]), bounds))
            best_c = max(best_c, 2 * a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best_r, best_c


def decode_rate(tokens: int) -> float:
    cmd = [sys.executable, "-c", "import sys; from ortkv.cli import main; sys.exit(main())", "generate", "--json", "--weights", "float32", "--variant", "ortkv",
           "--max-new-tokens", str(tokens), "--prompt", PROMPT]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return float(rows[-1]["decode_tok_s"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    decode_rate(8)  # builds the float32 decoder on first use (not timed)
    from ortkv.generate.cache import models_root

    candidates = sorted(models_root().glob("*f32*/ortkv/model.onnx"))
    if not candidates:
        print("no float32 ortkv decoder in the model cache", file=sys.stderr)
        return 1
    model = candidates[-1]
    per_token, total = weight_bytes_per_token(model)

    reads, copies, rates = [], [], []
    for r in range(args.rounds):
        rd, cp = read_bandwidth(args.threads)
        reads.append(rd)
        copies.append(cp)
        rates.append(decode_rate(args.tokens))
        print(f"round {r + 1}: read {rd:.1f} GB/s, copy {cp:.1f} GB/s, decode {rates[-1]:.1f} tok/s", file=sys.stderr)
    rd, cp, tok = statistics.median(reads), statistics.median(copies), statistics.median(rates)
    bound = rd * 1e9 / per_token
    lines = [
        "# Float32 decode vs the weight-read bound (CPU)",
        "",
        f"`python benchmarks/bench_weight_bound.py --rounds {args.rounds} --tokens {args.tokens} "
        f"--threads {args.threads}`; decoder `{model.parent.parent.name}/ortkv`, prompt {PROMPT!r}, batch 1, "
        f"{os.cpu_count()} CPUs. Medians of {args.rounds} alternating rounds.",
        "",
        "| quantity | value |",
        "|---|---:|",
        f"| weight bytes read per token (MatMul weights, LM head, norms) | {per_token / 1e6:.1f} MB |",
        f"| all initializers (incl. embedding and rotary tables read one row at a time) | {total / 1e6:.1f} MB |",
        f"| memory read bandwidth, numpy sum/max on {args.threads} thread(s) | {rd:.1f} GB/s |",
        f"| copy bandwidth (read + written), for information | {cp:.1f} GB/s |",
        f"| weight-read bound = bandwidth / bytes per token | {bound:.1f} tok/s |",
        f"| ortkv decode, float32 | {tok:.1f} tok/s |",
        f"| **fraction of the bound** | **{tok / bound:.2f}** |",
        "",
        "Per round (read GB/s, copy GB/s, decode tok/s): "
        + "; ".join(f"{a:.1f}, {b:.1f}, {c:.1f}" for a, b, c in zip(reads, copies, rates)),
    ]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
