"""Float32 decode against the weight-read bound, in one script (issue: CPU decode).

A batch-1 decode step of a float32 model reads every weight matrix once: on a CPU whose caches hold a
small fraction of them, the step cannot be faster than (bytes of weights read per token) / (memory read
bandwidth). This script measures both in one process tree, alternating, and reports ortkv's decode rate
as a fraction of that bound.

  bytes per token : from the ortkv decoder's initializers: every tensor read whole per step (MatMul /
                    Gemm / MatMulNBits / ortkv.Linear weights, the tied LM head, norm weights), not the tables that a
                    Gather or RotaryEmbedding reads one row of (embedding, cos/sin caches).
  bandwidth       : numpy reading a 512 MiB array (np.sum and np.max over parts on `threads` threads;
                    numpy drops the GIL in reductions), best of several passes: the memory read rate the
                    weights can be streamed at. Also the copy rate (read + written bytes) for information.
  decode          : `ortkv generate --json --warmup` (float32 weights, batch 1, `--tokens` new tokens, after
                    an untimed 2-token warm-up on the same session), the decode_tok_s it reports; rounds alternate bandwidth and decode. The fraction is reported
                    twice: median decode / median bound, and the median of each round's own fraction (its
                    decode against the bandwidth measured just before it: the fairer one, since the VM's
                    bandwidth moves between rounds).
  --parts         : where a step's time goes, in the same rounds (one child process per round): the
                    decoder's unprofiled step (wall, and ORT's run_with_iobinding inside it), the
                    decoder's projection nodes ALONE (MatMul or ortkv.Linear: a session of just those
                    nodes on the decoder's own weights, M = 1, inputs and outputs bound once through
                    IOBinding; when they are Linear, also the same products as ORT MatMul nodes, MLAS, in
                    a session of their own after it) and the same products through numpy's BLAS (x @ W per
                    weight: another GEMV on the same bytes). The projections' GB/s against the read
                    bandwidth says whether the float32 GEMV or the rest of the step is what stands between
                    the decode rate and the bound.

  --paired        : per round, a child that decodes in segments of --segment-steps tokens, each between two
                    read-bandwidth probes: the fraction per segment, figures taken milliseconds apart.

    python benchmarks/bench_weight_bound.py [--rounds 3] [--tokens 256] [--threads 2] [--parts] [--paired]
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

from _report import emit, timed_decode  # benchmarks/ is on sys.path when a script runs

PROMPT = "Once upon a time, there was a little robot who"
WHOLE_READ_OPS = {"MatMul", "Gemm", "MatMulNBits", "Linear", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
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


def _ranges(n: int, threads: int) -> list[tuple[int, int]]:
    """[start, end) of `threads` contiguous parts of n elements."""
    return [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]


def _best_read(pool, a: np.ndarray, ranges, passes: int) -> float:
    """GB/s of the fastest whole read of `a`, each part of `ranges` by one thread of `pool`: np.sum and np.max,
    `passes` times each (np.max streams faster than np.sum's pairwise adds)."""
    best = 0.0
    for _ in range(passes):
        for reduce in (np.sum, np.max):
            t0 = time.perf_counter()
            list(pool.map(lambda r: float(reduce(a[r[0]:r[1]])), ranges))
            best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _random_floats(mib: int, seed: int) -> np.ndarray:
    # random values, as weights are: on a VM whose host merges equal pages, an array of ones (or any periodic
    # fill) can read from a handful of cached physical pages (48-60 "GB/s" seen on a 2-core EPYC VM)
    return np.random.default_rng(seed).random((mib << 20) // 4, dtype=np.float32)


def read_bandwidth(threads: int, mib: int = 512, passes: int = 5) -> tuple[float, float]:
    """(read GB/s, copy GB/s counting read + written bytes), best of `passes`."""
    a = _random_floats(mib, 0)
    b = np.empty_like(a)
    ranges = _ranges(a.size, threads)
    best_r = best_c = 0.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(passes):
            best_r = max(best_r, _best_read(pool, a, ranges, 1))
            t0 = time.perf_counter()
            list(pool.map(lambda r: np.copyto(b[r[0]:r[1]], a[r[0]:r[1]]), ranges))
            best_c = max(best_c, 2 * a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best_r, best_c


def decode_rate(tokens: int) -> float:
    """`ortkv generate`'s decode tokens/s, after its untimed warm-up generation (--warmup), the same warm-up the
    llama.cpp comparison gives both sides (Note [CPU baseline] in ortkv/generate/bench.py): without it the first
    decode step (~2x a step: ORT's first run of the decode shapes, first-touched pages) weighs on a 128-token
    figure."""
    cmd = [sys.executable, "-c", "import sys; from ortkv.cli import main; sys.exit(main())", "generate", "--json", "--weights", "float32", "--variant", "ortkv",
           "--warmup", "--max-new-tokens", str(tokens), "--prompt", PROMPT]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return float(rows[-1]["decode_tok_s"])


PROMPT_IDS = [1, 9690, 2409, 253, 655, 28, 665, 588, 253, 1165, 8325, 653]  # any in-vocabulary ids


def _projections_only(path: Path, form: str):
    """(serialized model of the decoder's projection nodes -- MatMul or ortkv.Linear whose weight is an
    initializer -- alone: one input per K, every output returned; feeds; the distinct weights as numpy arrays in
    the model's layout). form "as-built": each node as in the decoder; "matmul": every one as ONNX MatMul on
    [K, N] (a Linear's W [N, K] transposed once: ORT's MLAS on the same values, for comparison)."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    m = onnx.load(str(path))  # with its external data: the weights are the decoder's own
    inits = {t.name: t for t in m.graph.initializer}
    nodes, used, ins, outs, arrays = [], [], {}, [], {}
    for n in m.graph.node:
        if n.op_type not in ("MatMul", "Linear") or n.input[1] not in inits:
            continue
        dims = list(inits[n.input[1]].dims)
        K = int(dims[0] if n.op_type == "MatMul" else dims[1])
        ins.setdefault(K, helper.make_tensor_value_info(f"x{K}", TP.FLOAT, [1, 1, K]))
        op, wname = n.op_type, n.input[1]
        if form == "matmul" and n.op_type == "Linear":
            op, wname = "MatMul", n.input[1] + "_kn"
            if wname not in arrays:
                arrays[wname] = np.ascontiguousarray(numpy_helper.to_array(inits[n.input[1]]).T)
        elif wname not in arrays:
            arrays[wname] = numpy_helper.to_array(inits[n.input[1]])
        nodes.append(helper.make_node(op, [f"x{K}", wname], [n.output[0]], name=n.name,
                                      domain="ortkv" if op == "Linear" else ""))
        if op == "Linear":  # e.g. activation="swiglu" (Note [Linear SwiGLU epilogue]): the node as the decoder has it
            nodes[-1].attribute.extend(n.attribute)
        if wname not in used:
            used.append(wname)
        outs.append(helper.make_tensor_value_info(n.output[0], TP.FLOAT, None))
    graph = helper.make_graph(nodes, "projections_only", list(ins.values()), outs,
                              [numpy_helper.from_array(arrays[u], u) for u in used])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)],
                              ir_version=m.ir_version)
    rng = np.random.default_rng(0)
    feeds = {f"x{K}": rng.standard_normal((1, 1, K)).astype(np.float32) for K in ins}
    return model.SerializeToString(), feeds, {u: arrays[u] for u in used}


def _time_alone(model: bytes, feeds: dict, threads: int, steps: int, weights: dict | None = None) -> list:
    """Seconds per run of a projections-only session (inputs and outputs bound once). weights (name -> array): given
    to the session from huge pages, as the CPU runners give the decoder its weights (Note [Weights on huge pages])."""
    import onnxruntime as ort

    import ortkv
    from ortkv._memory import add_initializers, huge_page_copies

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.register_custom_ops_library(ortkv.get_library_path())
    keep = None
    if weights:
        mapping, copies = huge_page_copies(list(weights.values()))
        keep = (mapping, copies, add_initializers(so, list(weights), copies))
    s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    # inputs and every output bound once to numpy buffers: the timed run is the nodes and ORT's run, not
    # 121 output arrays allocated and handed to Python per run (s.run(None, feeds) did that: ~0.1 ms a run
    # counted as MatMul time, and so taken from "every other node + ORT's gaps")
    io = s.io_binding()
    for name, x in feeds.items():
        io.bind_cpu_input(name, x)
    names = [o.name for o in s.get_outputs()]
    for name in names:
        io.bind_output(name, "cpu")
    s.run_with_iobinding(io)
    outs = {}
    for name, v in zip(names, io.get_outputs()):  # the shapes ORT computed: buffers of those, bound once
        outs[name] = np.empty(v.shape(), np.float32)
        io.bind_output(name, "cpu", 0, np.float32, list(outs[name].shape), outs[name].ctypes.data)
    for _ in range(10):
        s.run_with_iobinding(io)
    mm = []
    for _ in range(steps):
        t = time.perf_counter()
        s.run_with_iobinding(io)
        mm.append(time.perf_counter() - t)
    del io, s, keep
    return mm


def parts(threads: int, steps: int) -> dict:
    """One child's split of a float32 decode step (ms): wall, ORT run, the projection nodes alone (as built, and
    as ORT MatMul when they are ortkv.Linear), numpy GEMV."""
    from ortkv.generate import models, runners
    from ortkv.generate.cli import apply_overrides
    from ortkv.generate.config import GenAIConfig

    cfg = apply_overrides(GenAIConfig(), {"ortkv.weights": "float32", "ortkv.intra_op_num_threads": threads})
    path = models.model_path(cfg, "ortkv", log=lambda *x: None)
    r = runners.make_runner("ortkv", cfg, log=lambda *x: None)
    wall, ort_s, _ = timed_decode(r, PROMPT_IDS, steps)
    r.close()
    model, feeds, ws = _projections_only(path, "as-built")
    ops = sorted({n.op_type for n in onnx.load_from_string(model).graph.node})
    alone = _time_alone(model, feeds, threads, steps, ws if ops == ["Linear"] else None)
    nodes = len(_count_nodes(model))
    del model
    mlas = alone
    if ops != ["MatMul"]:  # the same products as ORT MatMul nodes (MLAS: it prepacks them into memory of its own)
        mm_model, mm_feeds, ws = _projections_only(path, "matmul")
        mlas = _time_alone(mm_model, mm_feeds, threads, steps)
        del mm_model
    ws = list(ws.values())
    # ws: [K, N] either way (MatMul's layout) for numpy's x @ W
    xs = {w.shape[0]: np.ones((1, w.shape[0]), np.float32) for w in ws}
    for w in ws:
        xs[w.shape[0]] @ w
    blas = []
    for _ in range(max(10, steps // 4)):
        t = time.perf_counter()
        for w in ws:
            xs[w.shape[0]] @ w
        blas.append(time.perf_counter() - t)
    ms = lambda x: 1e3 * float(np.median(x))  # noqa: E731
    return {"wall": ms(wall), "run": ms(ort_s), "matmul": ms(alone), "mlas": ms(mlas), "blas": ms(blas),
            "matmul_bytes": int(sum(w.nbytes for w in ws)), "matmul_nodes": nodes, "ops": "/".join(ops)}



def paired(threads: int, segments: int, seg_steps: int, probe_mib: int = 512, passes: int = 5) -> dict:
    """One child: the float32 decoder's greedy decode in segments of seg_steps tokens, each segment between two
    read-bandwidth probes (np.sum and np.max over a probe_mib array of random values on `threads` threads, the best
    of `passes` passes each: read_bandwidth's array size and passes, so that the probe is as strict as the unpaired
    rounds' reference -- with 256 MiB and two passes it read 31-33 GB/s where read_bandwidth read 35-36 on the same
    VM minutes apart, which flattered the decoder by ~10 %), so that a segment's rate and the bandwidth it is compared with are taken within milliseconds of each
    other. Returns per segment: seconds per token (the step and the greedy pick, as a generation loop) and the mean
    of the two probes (GB/s)."""
    from ortkv.generate import runners
    from ortkv.generate.cli import apply_overrides
    from ortkv.generate.config import GenAIConfig

    cfg = apply_overrides(GenAIConfig(), {"ortkv.weights": "float32", "ortkv.intra_op_num_threads": threads})
    r = runners.make_runner("ortkv", cfg, log=lambda *x: None)
    timed_decode(r, PROMPT_IDS, 8)  # warm-up (ORT's first runs of the decode shapes)
    a = _random_floats(probe_mib, 1)
    ranges = _ranges(a.size, threads)
    pool = concurrent.futures.ThreadPoolExecutor(threads)

    def probe() -> float:  # read_bandwidth's method and passes
        return _best_read(pool, a, ranges, passes)

    probe()
    ids = np.array([PROMPT_IDS], np.int64)
    r.start(1, 2048)
    logits = r.prefill(ids, np.array([ids.shape[1]], np.int64))
    per_token, bws = [], []
    for _ in range(segments):
        b0 = probe()
        t0 = time.perf_counter()
        for _ in range(seg_steps):
            logits = r.step(np.array([int(np.argmax(logits[0]))], np.int64))
        per_token.append((time.perf_counter() - t0) / seg_steps)
        bws.append((b0 + probe()) / 2)
    pool.shutdown()
    r.close()
    return {"per_token": per_token, "bw": bws}


def _paired_child(threads: int, segments: int, seg_steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--paired-child", "--threads", str(threads), "--segments",
           str(segments), "--segment-steps", str(seg_steps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _count_nodes(model: bytes) -> list:
    return list(onnx.load_from_string(model).graph.node)


def _parts_child(threads: int, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--parts-child", "--threads", str(threads), "--tokens", str(steps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--parts", action="store_true", help="also split the step: wall, ORT run, projection nodes alone")
    ap.add_argument("--parts-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--paired", action="store_true", help="also, per round, a child that decodes in segments of "
                    "--segment-steps tokens, each between two bandwidth probes (the fraction per segment)")
    ap.add_argument("--segments", type=int, default=16)
    ap.add_argument("--segment-steps", type=int, default=8)
    ap.add_argument("--paired-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.parts_child:
        print(json.dumps(parts(args.threads, args.tokens)))
        return 0
    if args.paired_child:
        print(json.dumps(paired(args.threads, args.segments, args.segment_steps)))
        return 0

    decode_rate(8)  # builds the float32 decoder on first use (not timed)
    from ortkv.generate import models
    from ortkv.generate.cli import apply_overrides
    from ortkv.generate.config import GenAIConfig

    # the decoder `ortkv generate --weights float32` runs (this checkout's build tag), not whichever
    # float32 build of another version sorts last in the model cache
    model = Path(models.model_path(apply_overrides(GenAIConfig(), {"ortkv.weights": "float32"}), "ortkv",
                                   log=lambda *x: None))
    if not model.exists():
        print(f"no float32 ortkv decoder at {model}", file=sys.stderr)
        return 1
    per_token, total = weight_bytes_per_token(model)

    reads, copies, rates, splits, pairs = [], [], [], [], []
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        rd, cp = read_bandwidth(args.threads)
        reads.append(rd)
        copies.append(cp)
        rates.append(decode_rate(args.tokens))
        if args.parts:
            splits.append(_parts_child(args.threads, args.tokens))
        if args.paired:
            pairs.append(_paired_child(args.threads, args.segments, args.segment_steps))
        print(f"round {r + 1}: read {rd:.1f} GB/s, copy {cp:.1f} GB/s, decode {rates[-1]:.1f} tok/s", file=sys.stderr)
    rd, cp, tok = statistics.median(reads), statistics.median(copies), statistics.median(rates)
    fractions = [rate / (r * 1e9 / per_token) for r, rate in zip(reads, rates)]
    bound = rd * 1e9 / per_token
    lines = [
        "# Float32 decode vs the weight-read bound (CPU)",
        "",
        f"`python benchmarks/bench_weight_bound.py --rounds {args.rounds} --tokens {args.tokens} "
        f"--threads {args.threads}{' --parts' if args.parts else ''}`; decoder `{model.parent.parent.name}/ortkv`, prompt {PROMPT!r}, batch 1, "
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
        f"| fraction of the bound: median decode / median bound (over rounds) | {tok / bound:.2f} |",
        f"| **fraction of the bound: median of the per-round fractions** (each round's decode against the "
        f"bandwidth measured just before it) | **{statistics.median(fractions):.2f}** |",
        "",
        "Per round (read GB/s, copy GB/s, decode tok/s, fraction): "
        + "; ".join(f"{a:.1f}, {b:.1f}, {c:.1f}, {f:.2f}" for a, b, c, f in zip(reads, copies, rates, fractions)),
        "",
        "The per-round median is the fairer figure: a VM's bandwidth moves between rounds (16-24 GB/s in "
        "one run on an Intel VM, 33-56 GB/s on an AMD EPYC one), and the decode rate moves with it; dividing a median decode by a median bandwidth pairs "
        "figures from different rounds.",
    ]
    if splits:
        med = {k: statistics.median(x.get(k, x["matmul"]) for x in splits) for k in ("wall", "run", "matmul", "mlas",
                                                                                       "blas")}
        ops = splits[0].get("ops", "MatMul")
        mb = splits[0]["matmul_bytes"]
        bound_ms = per_token / (rd * 1e9) * 1e3
        lines += [
            "",
            f"## Where a step goes (--parts; {args.tokens} decode steps after a 12-token prefill, medians, then the "
            "median over rounds)",
            "",
            "| quantity | ms per step | GB/s of weights | vs read bandwidth |",
            "|---|---:|---:|---:|",
            f"| weight-read bound ({per_token / 1e6:.1f} MB at {rd:.1f} GB/s) | {bound_ms:.2f} | {rd:.1f} | 1.00 |",
            f"| decode step, wall (Python + session wrapper + ORT run) | {med['wall']:.2f} | "
            f"{per_token / med['wall'] / 1e6:.1f} | {bound_ms / med['wall']:.2f} |",
            f"| ORT run inside it | {med['run']:.2f} | | |",
            f"| the {splits[0]['matmul_nodes']} projection nodes alone ({ops}, M = 1, {mb / 1e6:.1f} MB"
            f"{', weights on huge pages as the runners give them' if ops == 'Linear' else ''}) | "
            f"{med['matmul']:.2f} | {mb / med['matmul'] / 1e6:.1f} | {mb / med['matmul'] / 1e6 / rd:.2f} |",
        ]
        if ops != "MatMul":
            lines.append(f"| the same products as ORT MatMul nodes alone (MLAS) | {med['mlas']:.2f} | "
                         f"{mb / med['mlas'] / 1e6:.1f} | {mb / med['mlas'] / 1e6 / rd:.2f} |")
        lines += [
            f"| the same products through numpy's BLAS (x @ W) | {med['blas']:.2f} | {mb / med['blas'] / 1e6:.1f} | "
            f"{mb / med['blas'] / 1e6 / rd:.2f} |",
            f"| every other node + ORT's gaps (ORT run - projections alone) | {med['run'] - med['matmul']:.2f} | | |",
            f"| Python around the run (wall - ORT run) | {med['wall'] - med['run']:.2f} | | |",
            "",
            "Per round (wall, run, projections alone, as MatMul alone, BLAS ms): "
            + "; ".join(f"{x['wall']:.2f}, {x['run']:.2f}, {x['matmul']:.2f}, {x.get('mlas', x['matmul']):.2f}, "
                        f"{x['blas']:.2f}" for x in splits),
        ]
    if pairs:
        # per segment: its decode rate against the mean of the probes taken just before and just after it
        fr = [[per_token / t / (bw * 1e9) for t, bw in zip(p_["per_token"], p_["bw"])] for p_ in pairs]
        flat = [f for x in fr for f in x]
        ms_tok = [1e3 * t for p_ in pairs for t in p_["per_token"]]
        bw_all = [b for p_ in pairs for b in p_["bw"]]
        lines += [
            "",
            f"## Paired (--paired): decode and bandwidth at the same moment ({args.segments} segments of "
            f"{args.segment_steps} tokens per round, each between two read-bandwidth probes)",
            "",
            "The decoder (the same float32 runner, greedy) decodes in segments; before and after each segment a "
            "probe reads 512 MiB of random floats with np.sum and np.max on the same threads (the best of five passes each, "
            "as the unpaired rounds' reference); a "
            "segment's fraction is its rate (bytes per token / seconds per token) over the mean of its two probes. "
            "On a VM whose bandwidth moves within seconds this pairs figures taken milliseconds apart, where the "
            "rounds above pair a bandwidth and a decode taken seconds apart.",
            "",
            "| quantity | value |",
            "|---|---:|",
            f"| segments | {len(flat)} |",
            f"| ms per token, median (min-max) | {statistics.median(ms_tok):.2f} ({min(ms_tok):.2f}-{max(ms_tok):.2f}) |",
            f"| probe GB/s, median (min-max) | {statistics.median(bw_all):.1f} ({min(bw_all):.1f}-{max(bw_all):.1f}) |",
            f"| **fraction of the bound, median over segments** | **{statistics.median(flat):.2f}** |",
            f"| fraction, 25th / 75th percentile | {float(np.percentile(flat, 25)):.2f} / {float(np.percentile(flat, 75)):.2f} |",
            "",
            "Per round (median fraction): " + ", ".join(f"{statistics.median(x):.2f}" for x in fr),
        ]
    lines += ["", f"load average (1 min) on {os.cpu_count()} CPUs: {load0:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end"]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
