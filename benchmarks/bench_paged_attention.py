"""PagedCacheAttention (each page format, page_size 16 and 64) against dense CacheAttention on the same
tokens, CPU.

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head size 64), one new token (decode) over
L = 2K and 8K keys, batch 1 and 4, through ORT (CPU EP, IOBinding, caches and pool bound in place,
intra-op threads as given). Dense: float32 BNSH caches [B, 3, L, 64]. Paged: one layer, every page of
one format, each sequence's pages scattered over the pool in shuffled order (a real pool after some
churn). Each round times every variant once (median time per call of a pass >= 50 ms), alternating
dense and paged within the round; the report gives the median over rounds and the ratio to dense.
The machine may be shared: alternating rounds keep a slow moment from landing on one variant only.
"x dense" is the median over rounds of each round's paged / dense time ratio (the two measured next
to each other); "% read" compares the bytes read per second with the two-thread STREAM-like read
kernel of bench_cache_attention_cpu.py, measured in this script before and after the rounds (these
calls are hot: one layer repeated, so small cases can sit partly in the caches and exceed 100 %).

    python benchmarks/bench_paged_attention.py [--rounds 5] [--threads 2] [--lib LIB]
                                               [--cases 1x2048,4x8192] [--page-sizes 16,64] [--tokens 1]
                                               [--out benchmarks/results/paged_attention_cpu.md]

--tokens T: T query tokens a row, the last T of its L keys (a prefill of the whole row when T = L; Note [Paged CPU
query tiles]); 1 (a decode step) by default.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import statistics
import sys
import time

import numpy as np

from _report import emit  # benchmarks/ is on sys.path when a script runs

HQ, HKV, D = 9, 3, 64
CASES = [(1, 2048), (4, 2048), (1, 8192), (4, 8192)]  # (batch, keys)
PAGE_SIZES = (16, 64)


def _time(fn, min_time: float = 0.05) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    reps = max(1, math.ceil(min_time / max(time.perf_counter() - t0, 1e-7)))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


LIB = None  # --lib: the custom-op library to load (default: the installed ortkv's)


def _session(node, inputs, outputs, threads):
    import onnxruntime as ort
    from onnx import helper

    import ortkv

    g = helper.make_graph([node], "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                          ir_version=10)
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIB or ortkv.get_library_path())
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def dense_session(threads):
    from onnx import TensorProto as TP
    from onnx import helper

    from ortkv.graph import make_cache_attention

    vi = helper.make_tensor_value_info
    node = make_cache_attention("q", "k", "v", "start", "out", name="attn", num_heads=HQ, kv_num_heads=HKV, seq_axis=2)
    kv = ["B", "H", "C", "D"]
    return _session(node, [vi("q", TP.FLOAT, ["B", "T", "W"]), vi("k", TP.FLOAT, kv), vi("v", TP.FLOAT, kv),
                           vi("start", TP.INT64, ["B"])], [vi("out", TP.FLOAT, ["B", "T", "W"])], threads)


def paged_session(page_size, threads):
    from onnx import TensorProto as TP
    from onnx import helper

    vi = helper.make_tensor_value_info
    node = helper.make_node("PagedCacheAttention", ["q", "pool", "directory", "page_table", "start"], ["out"],
                            name="attn", domain="ortkv", num_heads=HQ, kv_num_heads=HKV, layer=0, num_layers=1,
                            page_size=page_size)
    return _session(node, [vi("q", TP.FLOAT, ["B", "T", "W"]), vi("pool", TP.UINT8, ["P"]),
                           vi("directory", TP.INT64, ["N", 2]), vi("page_table", TP.INT32, ["B", "M"]),
                           vi("start", TP.INT64, ["B"])], [vi("out", TP.FLOAT, ["B", "T", "W"])], threads)


def build_pool(fmt: int, page_size: int, tokens: np.ndarray, rng):
    """tokens [2, B, Hkv, L, D] float32 -> (pool, directory, page_table): page i of row b is a shuffled slot."""
    from ortkv import _ortkv

    t = _ortkv._testing
    _, B, H, L, Dh = tokens.shape
    per_row = L // page_size
    n = B * per_row
    pb = t.codec_layout(fmt, H, page_size, Dh)["page_bytes"]
    pool = np.zeros(n * pb, np.uint8)
    slots = rng.permutation(n)
    directory = np.stack([np.full(n, fmt, np.int64), slots.astype(np.int64) * pb], axis=1)
    table = np.arange(n, dtype=np.int32).reshape(B, per_row)
    for b in range(B):
        for i in range(per_row):
            pid = b * per_row + i
            vals = np.ascontiguousarray(tokens[:, b, :, i * page_size:(i + 1) * page_size])
            o = int(directory[pid, 1])
            t.codec_encode_page(fmt, vals, pool[o:o + pb])
    return pool, directory, table


def main(argv=None) -> int:
    import onnxruntime as ort

    from ortkv.reference.codecs import PageFormat

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default=",".join(f.name for f in PageFormat))
    p.add_argument("--lib", help="the custom-op library (default: the installed one)")
    p.add_argument("--cases", help="BATCHxKEYS,... (default " + ",".join(f"{b}x{k}" for b, k in CASES) + ")")
    p.add_argument("--page-sizes", default=",".join(str(x) for x in PAGE_SIZES))
    p.add_argument("--tokens", type=int, default=1, help="query tokens a row (the last of its keys)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    global LIB
    LIB = a.lib
    from bench_cache_attention_cpu import read_bandwidth

    formats = [PageFormat[x] for x in a.formats.split(",")]
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")] if a.cases else CASES
    page_sizes = [int(x) for x in a.page_sizes.split(",")]
    load0 = os.getloadavg()[0]
    bw0 = read_bandwidth(5).get("kread_2t")
    rng = np.random.default_rng(0)
    dense = dense_session(a.threads)
    paged = {ps: paged_session(ps, a.threads) for ps in page_sizes}
    rows = []
    for B, L in cases:
        tokens = rng.standard_normal((2, B, HKV, L, D), dtype=np.float32)
        T = a.tokens
        q = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((B, T, HQ * D), dtype=np.float32))
        st = ort.OrtValue.ortvalue_from_numpy(np.full(B, L - T, np.int64))
        out = ort.OrtValue.ortvalue_from_numpy(np.zeros((B, T, HQ * D), np.float32))
        variants = {}
        io = dense.io_binding()
        keep = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(tokens[0])),
                ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(tokens[1]))]
        for name, v in (("q", q), ("k", keep[0]), ("v", keep[1]), ("start", st)):
            io.bind_ortvalue_input(name, v)
        io.bind_ortvalue_output("out", out)
        variants["dense f32"] = (dense, io, 2 * B * HKV * L * D * 4)
        for ps in page_sizes:
            for fmt in formats:
                pool, directory, table = build_pool(int(fmt), ps, tokens, rng)
                io = paged[ps].io_binding()
                vals = [ort.OrtValue.ortvalue_from_numpy(x) for x in (pool, directory, table)]
                keep += vals
                for name, v in zip(("pool", "directory", "page_table"), vals):
                    io.bind_ortvalue_input(name, v)
                io.bind_ortvalue_input("q", q)
                io.bind_ortvalue_input("start", st)
                io.bind_ortvalue_output("out", out)
                variants[f"{fmt.name} ps{ps}"] = (paged[ps], io, pool.nbytes)
        times = {k: [] for k in variants}
        for _ in range(a.rounds):
            for k, (sess, io, _) in variants.items():
                times[k].append(_time(lambda s=sess, i=io: s.run_with_iobinding(i)))
        for k, (_, _, nbytes) in variants.items():
            t = statistics.median(times[k])
            ratio = statistics.median(x / d for x, d in zip(times[k], times["dense f32"]))
            rows.append((B, L, k, t * 1e6, nbytes / 2**20, nbytes / t / 1e9, ratio))
        del keep, variants
    bw1 = read_bandwidth(5).get("kread_2t")
    bws = [x for x in (bw0, bw1) if x]
    rbw = statistics.mean(bws) if bws else None
    lines = [
        "# PagedCacheAttention vs dense CacheAttention (CPU)",
        "",
        f"Command: `python benchmarks/bench_paged_attention.py {' '.join(shlex.quote(x) for x in (argv or sys.argv[1:]))}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, ORT {ort.__version__}, intra-op threads "
        f"{a.threads}, {time.strftime('%Y-%m-%d %H:%M')}. SmolLM2-135M heads (Hq 9, Hkv 3, D 64), "
        f"{'one decode token' if a.tokens == 1 else f'{a.tokens} query tokens a row (the last of them)'} "
        f"over L keys; median over {a.rounds} alternating rounds. KV MiB: bytes of K and V (dense float32) or of the "
        f"pages read. x dense: median over rounds of the round's paged / dense ratio.  ",
        "Read kernel (two threads, 256 MiB): "
        + (" / ".join(f"{x:.1f}" for x in bws) + " GB/s before / after the rounds" if bws else "no C compiler")
        + f". Load average (1 min) on {os.cpu_count()} CPUs: {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
        "",
        "| batch | L | variant | us / call | KV MiB | GB/s | % read | x dense |",
        "|---:|---:|:---|---:|---:|---:|---:|---:|",
    ]
    for B, L, k, us, mib, gbs, ratio in rows:
        pr = f"{100 * gbs / rbw:.0f} %" if rbw else "-"
        lines.append(f"| {B} | {L} | {k} | {us:.1f} | {mib:.2f} | {gbs:.1f} | {pr} | {ratio:.2f} |")
    return emit("\n".join(lines), a.out)


if __name__ == "__main__":
    raise SystemExit(main())
