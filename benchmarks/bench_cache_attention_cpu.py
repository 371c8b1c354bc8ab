"""CPU CacheAttention decode against the machine's measured memory bandwidth, in one script.

  bandwidth : numpy on large arrays (256 MiB, far beyond the last-level cache): np.copyto on one
              thread and on two threads (halves; numpy drops the GIL while copying), counting bytes
              read + written, and a STREAM-like triad a = b + s * c (counted as STREAM does, 12 bytes per
              float32 element, although numpy makes two passes). The reference is the highest of them.
              For information, also a read-only figure (np.sum on one and two threads): attention only
              reads, and on small VMs one core's reads alone get about half of what a copy moves.
  read kernel: a STREAM-like READ kernel (sum of a 256 MiB float32 array with 8 independent vector
              accumulators), compiled here with the system C compiler (-O2 -march=native) and called
              through ctypes on one thread and on two (halves, the GIL released): the bytes a core
              pair can read, the quantity attention needs; also the same sum as 8 interleaved streams
              (faster on VMs whose prefetcher follows one stream per 4 KiB page). Decode attention's
              "% of read" is against the best two-thread read figure of the two; "% of copy" against the numpy copy reference (read + write bytes,
              STREAM's count). Without a C compiler the read kernel is skipped (reported as "-").
  attention : one CacheAttention node through ORT (CPU EP, IOBinding, caches bound in place),
              SmolLM2-135M shapes (9 query heads, 3 KV heads, head size 64, float32, BNSH caches),
              one new token (decode) over L = 2K / 8K / 32K keys, batch 1 and 4. GB/s = bytes of K and
              V read per call (2 * B * Hkv * L * D * 4) / time per call.
              cold: one cache pair per layer, enough layers for >= 256 MiB of K/V, run one after the
                    other like a model's layers, so every call reads its K/V from DRAM, not from L3;
                    one Python run_with_iobinding per layer (~20-40 us of Python and ORT per call).
              graph: the same layers as nodes of one model and one run (a decoder step's situation).
              hot : the same layer over and over (its K/V partly cache-resident where it fits in L3).
              Each figure is the median of many timed passes after a warm-up.

  The machine may be shared: with --compare DIR the script alternates, round by round, between the
  library in DIR (e.g. a copy of an older build) and the installed one, each in a fresh process, and
  reports the medians over rounds.

    python benchmarks/bench_cache_attention_cpu.py [--threads 2,1] [--rounds 3] [--compare OLD_LIB_DIR]
                                                   [--isa best,avx2,baseline] [--spin]
                                                   [--out benchmarks/results/cache_attention_cpu.md]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import numpy as np

from _report import emit  # benchmarks/ is on sys.path when a script runs

HQ, HKV, D = 9, 3, 64
CASES = [(1, 2048), (1, 8192), (1, 32768), (4, 2048), (4, 8192), (4, 32768)]  # (batch, keys)
COLD_BYTES = 256 << 20
OLD_DIR = "OLD_DIR"


def _median_time(fn, passes: int, min_time: float = 0.05) -> float:
    """Median over `passes` of the mean time per call of `fn` in a pass of >= min_time seconds."""
    fn()
    fn()
    reps = 1
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, math.ceil(min_time / one))
    samples = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def bandwidth(passes: int = 9) -> dict:
    n = (256 << 20) // 4
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)
    c = np.full(n, 2.0, np.float32)
    t1 = _median_time(lambda: np.copyto(dst, src), passes)
    half = n // 2
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def copy2():
        list(pool.map(lambda s: np.copyto(dst[s], src[s]), [slice(0, half), slice(half, n)]))

    t2 = _median_time(copy2, passes)
    pool.shutdown()

    def triad():
        np.multiply(c, np.float32(3.0), out=dst)
        np.add(dst, src, out=dst)

    t3 = _median_time(triad, passes)
    res = {"copy_1t": 2 * src.nbytes / t1 / 1e9, "copy_2t": 2 * src.nbytes / t2 / 1e9,
           "triad_1t": 3 * src.nbytes / t3 / 1e9}
    res["reference"] = max(res.values())
    t4 = _median_time(lambda: src.sum(), passes)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    t5 = _median_time(lambda: list(pool.map(lambda s: src[s].sum(), [slice(0, half), slice(half, n)])), passes)
    pool.shutdown()
    res["read_1t"], res["read_2t"] = src.nbytes / t4 / 1e9, src.nbytes / t5 / 1e9
    del src, dst, c
    res.update(read_bandwidth(passes))
    return res


_READ_C = r"""
#include <stddef.h>
typedef float v16 __attribute__((vector_size(64)));
float ortkv_bench_read(const float* p, size_t n) {  /* n: a multiple of 128 floats, p 64-byte aligned */
  v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
  for (size_t i = 0; i < n; i += 128) {
    const v16* q = (const v16*)(p + i);
    a0 += q[0]; a1 += q[1]; a2 += q[2]; a3 += q[3]; a4 += q[4]; a5 += q[5]; a6 += q[6]; a7 += q[7];
  }
  v16 s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
  float t = 0;
  for (int i = 0; i < 16; ++i) t += s[i];
  return t;
}
/* The same bytes as 8 interleaved streams (the range cut in 8 parts, 256 bytes of each in turn): a core
   whose hardware prefetcher follows one stream per 4 KiB page reads more this way on some VMs. */
float ortkv_bench_read8(const float* p, size_t n) {  /* n: a multiple of 8 * 64 floats */
  v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
  size_t part = n / 8;
  for (size_t i = 0; i < part; i += 64)
    for (int s = 0; s < 8; ++s) {
      const v16* q = (const v16*)(p + s * part + i);
      a0 += q[0]; a1 += q[1]; a2 += q[2]; a3 += q[3];
    }
  v16 s = (a0 + a1) + (a2 + a3);
  float t = 0;
  for (int i = 0; i < 16; ++i) t += s[i];
  return t;
}
"""


def read_kernel():
    """The STREAM-like read kernels (one stream, eight streams) as Python callables f(array_slice) -> float,
    or None without a compiler."""
    import ctypes
    import shutil
    import tempfile

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    d = tempfile.mkdtemp(prefix="ortkv_read_")
    src, lib = os.path.join(d, "read.c"), os.path.join(d, "read.so")
    with open(src, "w") as f:
        f.write(_READ_C)
    r = subprocess.run([cc, "-O2", "-march=native", "-shared", "-fPIC", src, "-o", lib], capture_output=True)
    if r.returncode != 0:
        return None
    fns = []
    for name in ("ortkv_bench_read", "ortkv_bench_read8"):
        fn = getattr(ctypes.CDLL(lib), name)
        fn.restype = ctypes.c_float
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fns.append(lambda a, fn=fn: fn(a.ctypes.data, a.size))
    return fns


def read_bandwidth(passes: int = 9) -> dict:
    """GB/s read by the read kernel over 256 MiB on one thread and on two (halves); {} without a compiler."""
    fns = read_kernel()
    if fns is None:
        return {}
    n = (256 << 20) // 4
    raw = np.ones(n + 16, np.float32)
    off = (-raw.ctypes.data % 64) // 4
    src = raw[off:off + n]  # 64-byte aligned
    half = n // 2
    res = {}
    pool = concurrent.futures.ThreadPoolExecutor(2)
    for tag, fn in zip(("", "8"), fns):
        t1 = _median_time(lambda: fn(src), passes)
        t2 = _median_time(lambda: list(pool.map(fn, [src[:half], src[half:]])), passes)
        res[f"kread{tag}_1t"], res[f"kread{tag}_2t"] = src.nbytes / t1 / 1e9, src.nbytes / t2 / 1e9
    pool.shutdown()
    return res


def _layers_model(n: int):
    """n CacheAttention nodes in one graph, each over its own k{i} / v{i} (a decoder's layers, run one after the
    other by ORT's executor in ONE run: no Python between them), all reading the same q and start."""
    from onnx import TensorProto as TP
    from onnx import helper

    from ortkv.graph import make_cache_attention

    kv = ["B", "H", "C", "D"]
    nodes, ins, outs = [], [helper.make_tensor_value_info("q", TP.FLOAT, ["B", "T", "W"]),
                            helper.make_tensor_value_info("start", TP.INT64, ["B"])], []
    for i in range(n):
        nodes.append(make_cache_attention("q", f"k{i}", f"v{i}", "start", f"out{i}", name=f"attn{i}", num_heads=HQ,
                                          kv_num_heads=HKV, seq_axis=2))
        ins += [helper.make_tensor_value_info(f"k{i}", TP.FLOAT, kv), helper.make_tensor_value_info(f"v{i}", TP.FLOAT, kv)]
        outs.append(helper.make_tensor_value_info(f"out{i}", TP.FLOAT, ["B", "T", "W"]))
    g = helper.make_graph(nodes, "attn_layers", ins, outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def attention(lib: str, threads: int, passes: int = 15, cases=None, spin: bool = False) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.intra_op_num_threads = threads
    # default: idle pool threads sleep instead of spinning: on a shared machine a spinning worker takes
    # the core the calling thread needs. --spin keeps ORT's default (spinning), as the decoders run.
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    sess = ort.InferenceSession(_layers_model(1).SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    res = {}
    for b, keys in cases or CASES:
        per_layer = 2 * b * HKV * keys * D * 4
        layers = max(3, math.ceil(COLD_BYTES / per_layer))
        kvs = []
        k0 = rng.standard_normal((b, HKV, keys, D), dtype=np.float32)
        for _ in range(layers):  # distinct buffers (same values): a model's layers
            kvs.append((k0.copy(), (k0 * 0.5).copy()))
        start = np.full(b, keys - 1, np.int64)  # the new token is the last of L = keys valid tokens
        q = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((b, 1, HQ * D), dtype=np.float32))
        st = ort.OrtValue.ortvalue_from_numpy(start)
        out = ort.OrtValue.ortvalue_from_numpy(np.zeros((b, 1, HQ * D), np.float32))
        ios = []
        for k, v in kvs:
            io = sess.io_binding()
            io.bind_ortvalue_input("q", q)
            io.bind_ortvalue_input("k0", ort.OrtValue.ortvalue_from_numpy(k))
            io.bind_ortvalue_input("v0", ort.OrtValue.ortvalue_from_numpy(v))
            io.bind_ortvalue_input("start", st)
            io.bind_ortvalue_output("out0", out)
            ios.append(io)
        run = sess.run_with_iobinding

        def cold():
            for io in ios:
                run(io)

        t_cold = _median_time(cold, passes) / layers
        t_hot = _median_time(lambda: run(ios[0]), passes)
        # graph: the same layers as nodes of ONE model, one run per pass (what a decoder's step does)
        gsess = ort.InferenceSession(_layers_model(layers).SerializeToString(), so, providers=["CPUExecutionProvider"])
        gio = gsess.io_binding()
        gio.bind_ortvalue_input("q", q)
        gio.bind_ortvalue_input("start", st)
        for i, (k, v) in enumerate(kvs):
            gio.bind_ortvalue_input(f"k{i}", ort.OrtValue.ortvalue_from_numpy(k))
            gio.bind_ortvalue_input(f"v{i}", ort.OrtValue.ortvalue_from_numpy(v))
            gio.bind_ortvalue_output(f"out{i}", ort.OrtValue.ortvalue_from_numpy(np.zeros((b, 1, HQ * D), np.float32)))
        t_graph = _median_time(lambda: gsess.run_with_iobinding(gio), passes) / layers
        res[f"B{b} L{keys}"] = {"bytes": per_layer, "layers": layers, "cold_us": t_cold * 1e6, "hot_us": t_hot * 1e6,
                                "cold_gbs": per_layer / t_cold / 1e9, "hot_gbs": per_layer / t_hot / 1e9,
                                "graph_us": t_graph * 1e6, "graph_gbs": per_layer / t_graph / 1e9}
        del ios, kvs, gio, gsess
    return res


def measure(lib: str, threads: list[int], cases=None, spin: bool = False) -> dict:
    return {"bandwidth": bandwidth(), "attention": {str(t): attention(lib, t, cases=cases, spin=spin) for t in threads}}


def _parse_cases(text: str | None):
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",")] if text else None


def _child(lib: str, threads: str, cases: str | None, isa: str, spin: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--lib", lib, "--threads", threads]
    if cases:
        cmd += ["--cases", cases]
    if spin:
        cmd.append("--spin")
    env = dict(os.environ)
    env.pop("ORTKV_CPU_ISA", None)
    if isa != "best":  # Note [CPU attention ISA dispatch]: the child's kernels are forced to this copy
        env["ORTKV_CPU_ISA"] = isa
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _gbs(x) -> str:
    return "-" if x is None else f"{x:.1f} GB/s"


def _med(results: list[dict], *path) -> float:
    vals = []
    for r in results:
        for p in path:
            r = r[p]
        vals.append(r)
    return statistics.median(vals)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", help="the ortkv custom-op library (default: the installed one)")
    p.add_argument("--compare", metavar="DIR", help="also measure DIR/libortkv.so (an older build), alternating")
    p.add_argument("--compare-label", default="an older build",
                   help="what the --compare library is, for the report (e.g. 'commit abc123')")
    p.add_argument("--threads", default="2,1", help="ORT intra-op thread counts, comma-separated (default 2,1)")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per library, alternating (default 3)")
    p.add_argument("--cases", help="BATCHxKEYS,... (default: all of " + ",".join(f"{b}x{k}" for b, k in CASES) + ")")
    p.add_argument("--isa", default="best", help="kernel copies to measure, comma-separated: best (the CPU's, "
                   "default), avx512, avx2, baseline (ORTKV_CPU_ISA in the child); each is one more column set")
    p.add_argument("--spin", action="store_true", help="let ORT's idle pool threads spin (ORT's default, what the "
                   "decoders use) instead of sleeping")
    p.add_argument("--out", help="also write the Markdown report to this file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(measure(a.lib, [int(x) for x in a.threads.split(",")], _parse_cases(a.cases), a.spin)))
        return 0
    import onnxruntime as ort

    import ortkv

    base = {"new": a.lib or ortkv.get_library_path()}
    if a.compare:
        base = {"old": os.path.join(a.compare, "libortkv.so"), **base}
    isas = a.isa.split(",")
    libs = {(f"{name} {isa}" if len(isas) > 1 else name): (lib, isa) for name, lib in base.items() for isa in isas}
    runs: dict[str, list] = {k: [] for k in libs}
    load0 = os.getloadavg()[0]
    for r in range(a.rounds):
        for name, (lib, isa) in libs.items():
            runs[name].append(_child(lib, a.threads, a.cases, isa, a.spin))
            print(f"round {r + 1}/{a.rounds} {name}: done", file=sys.stderr)
    allruns = [x for v in runs.values() for x in v]
    bw = {k: _med(allruns, "bandwidth", k) for k in ("copy_1t", "copy_2t", "triad_1t", "reference", "read_1t", "read_2t")}
    for k in ("kread_1t", "kread_2t", "kread8_1t", "kread8_2t"):
        bw[k] = _med(allruns, "bandwidth", k) if all(k in r["bandwidth"] for r in allruns) else None
    ref = bw["reference"]
    rref = max(bw["kread_2t"], bw["kread8_2t"]) if bw["kread_2t"] else None  # the best two-thread read
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    report = [f"# bench_cache_attention_cpu ({platform.node()}, {cpu}, {os.cpu_count()} CPUs, "
              f"onnxruntime {ort.__version__}, {time.strftime('%Y-%m-%d %H:%M')})", "",
              f"command: `python {shlex.join(OLD_DIR if x == a.compare else x for x in sys.argv)}`"
              + (f" (OLD_DIR held the libortkv.so of {a.compare_label})" if a.compare else ""), "",
              f"{a.rounds} rounds, each library in a fresh process per round, alternating "
              f"({' / '.join(libs)}); every figure is the median over rounds of per-round medians. The machine "
              "is shared with other builds (see the load average at the end), so single figures move by 10-30 %;"
              + (" ORT pool threads spin while idle (ORT's default, as in the decoders)." if a.spin else
                 " ORT pool threads sleep rather than spin while idle (session.intra_op.allow_spinning 0).")
              + (f" Kernel copies: {', '.join(isas)} (ORTKV_CPU_ISA in the child process; best = what the CPU has)."
                 if isas != ["best"] else ""), "",
              "## Measured memory bandwidth (256 MiB arrays, median over all rounds)", "",
              "| numpy copy, 1 thread | copy, 2 threads | triad, 1 thread (STREAM count) | **copy reference** (highest) | "
              "np.sum, 1 thread | np.sum, 2 threads | read kernel, 1 thread | read kernel, 2 threads | "
              "8-stream read, 1 thread | 8-stream read, 2 threads | **read reference** (best 2-thread read) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
              f"| {bw['copy_1t']:.1f} GB/s | {bw['copy_2t']:.1f} GB/s | {bw['triad_1t']:.1f} GB/s | **{ref:.1f} GB/s** | "
              f"{bw['read_1t']:.1f} GB/s | {bw['read_2t']:.1f} GB/s | {_gbs(bw['kread_1t'])} | {_gbs(bw['kread_2t'])} | "
              f"{_gbs(bw['kread8_1t'])} | {_gbs(bw['kread8_2t'])} | **{_gbs(rref)}** |", ""]
    for threads in a.threads.split(","):
        report += [f"## CacheAttention decode, {HQ} query heads / {HKV} KV heads x {D}, float32 BNSH, "
                   f"ORT intra-op threads {threads}", "",
                   "GB/s = K+V bytes read per call / time per call; % copy = of the copy reference (read + write "
                   "bytes), % read = of the read reference (the best two-thread read kernel, read bytes). cold: "
                   "rotating over a model's worth of layers (>= 256 MiB of K/V, read from DRAM), one Python "
                   "`run_with_iobinding` per layer; hot: one layer repeated; graph: the same layers as nodes of ONE "
                   "model, one run for all of them (as a decoder's step runs its layers: no Python between nodes, "
                   "ORT's own per-node cost included), time per node.", ""]
        head = "| case | K+V bytes/call | layers (cold) |"
        sep = "|---|---:|---:|"
        for name in libs:
            head += (f" {name} cold us | {name} cold GB/s | {name} cold % copy | {name} cold % read | {name} hot GB/s |"
                     f" {name} graph us | {name} graph GB/s | {name} graph % read |")
            sep += "---:|---:|---:|---:|---:|---:|---:|---:|"
        report += [head, sep]
        first = next(iter(runs.values()))[0]["attention"][threads]
        for case, info in first.items():
            row = f"| {case} | {info['bytes']:,} | {info['layers']} |"
            for name in libs:
                cold_us = _med(runs[name], "attention", threads, case, "cold_us")
                cold = _med(runs[name], "attention", threads, case, "cold_gbs")
                hot = _med(runs[name], "attention", threads, case, "hot_gbs")
                pr = f"{100 * cold / rref:.0f} %" if rref else "-"
                row += f" {cold_us:.0f} | {cold:.1f} | {100 * cold / ref:.0f} % | {pr} | {hot:.1f} |"
                if all("graph_us" in x["attention"][threads][case] for x in runs[name]):
                    g_us = _med(runs[name], "attention", threads, case, "graph_us")
                    g_gbs = _med(runs[name], "attention", threads, case, "graph_gbs")
                    row += f" {g_us:.0f} | {g_gbs:.1f} | {f'{100 * g_gbs / rref:.0f} %' if rref else '-'} |"
                else:  # an older library's child without the graph figures
                    row += " - | - | - |"
            report.append(row)
        report.append("")
    report += [f"load average (1 min) on {os.cpu_count()} CPUs: {load0:.1f} at the start, "
               f"{os.getloadavg()[0]:.1f} at the end", ""]
    return emit("\n".join(report), a.out)


if __name__ == "__main__":
    sys.exit(main())
