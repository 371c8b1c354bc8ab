"""CacheUpdate benchmarks, each reported as a ratio against the obvious baseline, measured in one run.

  CPU   : CacheUpdate throughput (through ORT, IOBinding, in place) / numpy's copy of the same bytes
          (cache[:, :, p:p+n] = values).
  memory: the demo's peak RSS growth while decoding, ortkv (in place) vs the Concat copy baseline,
          for a 256 MiB K+V cache (each variant in its own process).
  CUDA  : (--cuda) CacheUpdate bandwidth on the CUDA EP / a device-to-device copy of the same bytes
          (torch.Tensor.copy_), wall clock after warm-up with the device synchronized.

    python benchmarks/bench_cache_update.py [--cuda] [--skip-memory] [--out benchmarks/results/x.md]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper

import ortkv
from ortkv.demo import DemoConfig, compare
from ortkv.graph import make_cache_update, mark_mutable, set_alias_of

from _report import emit  # benchmarks/ is on sys.path when a script runs

# (label, batch, heads, capacity, head_size, n)
CASES = [
    ("decode step B4 H8 D64", 4, 8, 4096, 64, 1),
    ("decode step B32 H32 D128", 32, 32, 2048, 128, 1),
    ("prefill 512 B4 H8 D64", 4, 8, 4096, 64, 512),
    ("prefill 2048 B4 H32 D128", 4, 32, 4096, 128, 2048),
]


def _model(provider_cuda: bool = False):
    dims = ["B", "H", "C", "D"]
    node = make_cache_update("cache", "values", "position", "updated_cache", name="cu")
    g = helper.make_graph([node], "bench", [helper.make_tensor_value_info("cache", TP.FLOAT, dims),
                                            helper.make_tensor_value_info("values", TP.FLOAT, ["B", "H", "N", "D"]),
                                            helper.make_tensor_value_info("position", TP.INT64, [])],
                          [helper.make_tensor_value_info("updated_cache", TP.FLOAT, dims)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)], ir_version=10)
    mark_mutable(m, "cache")
    set_alias_of(m, "updated_cache", "cache")
    return m


def _session(cuda: bool):
    so = ort.SessionOptions()
    so.register_custom_ops_library(ortkv.get_library_path())
    if cuda:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    providers = ["CUDAExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    return ort.InferenceSession(_model().SerializeToString(), so, providers=providers)


def _timeit(fn, min_time=0.3, min_iters=20) -> float:
    for _ in range(5):
        fn()
    iters, t0 = 0, time.perf_counter()
    while iters < min_iters or time.perf_counter() - t0 < min_time:
        fn()
        iters += 1
    return (time.perf_counter() - t0) / iters


def bench_cpu(rows):
    sess = _session(False)
    for label, b, h, cap, d, n in CASES:
        cache = np.zeros((b, h, cap, d), np.float32)
        cache.fill(1)
        values = np.random.default_rng(0).standard_normal((b, h, n, d), dtype=np.float32)
        pos = cap - n
        io = sess.io_binding()
        v = ort.OrtValue.ortvalue_from_numpy(cache)
        io.bind_ortvalue_input("cache", v)
        io.bind_ortvalue_output("updated_cache", v)
        io.bind_cpu_input("values", values)
        io.bind_cpu_input("position", np.array(pos, np.int64))
        t_ours = _timeit(lambda: sess.run_with_iobinding(io))
        assert io.get_outputs()[0].data_ptr() == cache.ctypes.data

        def numpy_copy():
            cache[:, :, pos:pos + n] = values

        t_np = _timeit(numpy_copy)
        nbytes = values.nbytes
        rows.append((label, nbytes, nbytes / t_ours / 1e9, nbytes / t_np / 1e9, t_np / t_ours))


def bench_cuda(rows):
    import torch

    sess = _session(True)
    for label, b, h, cap, d, n in CASES:
        cache = torch.ones((b, h, cap, d), device="cuda")
        values = torch.randn((b, h, n, d), device="cuda")
        src = values.clone()
        dst = torch.empty_like(values)
        pos = cap - n
        io = sess.io_binding()
        io.bind_input("cache", "cuda", 0, TP.FLOAT, list(cache.shape), cache.data_ptr())
        io.bind_output("updated_cache", "cuda", 0, TP.FLOAT, list(cache.shape), cache.data_ptr())
        io.bind_input("values", "cuda", 0, TP.FLOAT, list(values.shape), values.data_ptr())
        io.bind_cpu_input("position", np.array(pos, np.int64))

        def ours():
            sess.run_with_iobinding(io)
            torch.cuda.synchronize()

        def d2d():
            dst.copy_(src)
            torch.cuda.synchronize()

        t_ours, t_copy = _timeit(ours), _timeit(d2d)
        assert io.get_outputs()[0].data_ptr() == cache.data_ptr()
        assert torch.equal(cache[:, :, pos:pos + n], values)
        k_ours, k_copy = _kernel_times(torch, ours, d2d)
        nbytes = values.numel() * 4
        rows.append((label, nbytes, nbytes / t_ours / 1e9, nbytes / t_copy / 1e9, t_copy / t_ours,
                     nbytes / k_ours / 1e9 if k_ours else None, nbytes / k_copy / 1e9 if k_copy else None))


def _kernel_times(torch, ours, d2d, iters=20):
    """Device time per call of the CacheUpdate kernel and of the DtoD copy, read from CUPTI through
    torch.profiler (it sees every kernel in the process, including those ORT launches for ortkv)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            ours()
        for _ in range(iters):
            d2d()
    mine = [e.time_range.elapsed_us() for e in prof.events() if "CacheUpdateKernel" in e.name]
    copy = [e.time_range.elapsed_us() for e in prof.events() if "Memcpy DtoD" in e.name]
    avg = lambda xs: (sum(xs) / len(xs) * 1e-6) if xs else None  # noqa: E731
    return avg(mine), avg(copy)


def bench_memory(mib: int):
    cfg = DemoConfig.for_cache_mib(mib, steps=32, batch=4, heads=16, head_size=64)
    lines = []
    res = compare(cfg, out=lines.append)
    return cfg, res, lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", action="store_true", help="also measure the CUDA kernel (needs onnxruntime-gpu, torch)")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--memory-mib", type=int, default=256)
    p.add_argument("--out", help="also write the Markdown report to this file")
    a = p.parse_args(argv)
    report = [f"# bench_cache_update ({platform.node()}, onnxruntime {ort.__version__}, "
              f"{time.strftime('%Y-%m-%d %H:%M')})", "", f"command: `python {' '.join(sys.argv)}`", ""]
    head = "| case | bytes written | ortkv GB/s | {b} GB/s | ratio ortkv/{b} |\n|---|---:|---:|---:|---:|"
    if not a.skip_cpu:
        rows = []
        bench_cpu(rows)
        report += ["## CPU: CacheUpdate (ORT, IOBinding, in place) vs numpy slice assignment", "",
                   head.format(b="numpy")]
        report += [f"| {r[0]} | {r[1]:,} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.2f} |" for r in rows] + [""]
    if a.cuda:
        rows = []
        bench_cuda(rows)
        report += ["## CUDA: CacheUpdate (ORT CUDA EP) vs device-to-device copy of the same bytes", "",
                   "Wall: one ORT run (IOBinding, synchronized) vs one `torch.Tensor.copy_` (synchronized). "
                   "Kernel: device time of the CacheUpdate kernel vs the DtoD memcpy, from CUPTI (torch.profiler).", "",
                   "| case | bytes written | wall GB/s ortkv | wall GB/s d2d | wall ratio | kernel GB/s ortkv | "
                   "kernel GB/s d2d | kernel ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        fmt = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
        for r in rows:
            kr = f"{r[5] / r[6]:.2f}" if r[5] and r[6] else "n/a"
            report.append(f"| {r[0]} | {r[1]:,} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f} | {fmt(r[5])} | {fmt(r[6])} | {kr} |")
        report.append("")
    if not a.skip_memory:
        cfg, res, lines = bench_memory(a.memory_mib)
        o, c = res["ortkv"], res["copy"]
        report += [f"## Memory: demo decode with a {a.memory_mib} MiB K+V cache (batch {cfg.batch}, {cfg.heads} heads x "
                   f"{cfg.head_size}, {cfg.context} context tokens, {cfg.steps} steps)", "", "```", *lines, "```", ""]
        if o["peak_rss_growth_decode"] is not None:
            report.append(f"peak RSS growth while decoding: ortkv {o['peak_rss_growth_decode'] / 2**20:.1f} MiB, "
                          f"copy {c['peak_rss_growth_decode'] / 2**20:.1f} MiB "
                          f"(copy - ortkv = {(c['peak_rss_growth_decode'] - o['peak_rss_growth_decode']) / 2**20:.1f} MiB,"
                          f" {(c['peak_rss_growth_decode'] - o['peak_rss_growth_decode']) / cfg.kv_bytes(cfg.cap):.2f} x "
                          f"the cache)")
    return emit("\n".join(report), a.out)


if __name__ == "__main__":
    sys.exit(main())
