"""Requantize on a CUDA page pool: the device kernels (Note [Requantize on CUDA]) against the host-staged path
that builds without the CUDA kernels use (Note [Requantize on a CUDA pool]), on SmolLM2's page shape (30 layers,
3 KV heads, head size 64, pages of 16 tokens, float16 logical). Each round requantizes N F16 pages holding
random values into one narrow format, alternating the two paths; figures are microseconds per page (the whole
pool.requantize call: slot bookkeeping, directory row, the conversion and its synchronizations), medians of
the rounds.

    python benchmarks/bench_requantize_cuda.py [--pages 200] [--rounds 3] [--formats int8,int4,int4_kc]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ortkv import paged
from ortkv.paged import PagePool, parse_format
from ortkv.reference import codecs as rc
from ortkv.reference.codecs import PageFormat as F

LAYERS, HEADS, D, PS = 30, 3, 64, 16


def one_round(n, fmt, staged):
    kernel = paged._cuda_requantize_kernel
    if staged:
        paged._cuda_requantize_kernel = lambda: None
    try:
        with PagePool(LAYERS, HEADS, D, PS, np.float16, device="cuda:0", max_pages=2 * n + 8) as pool:
            values = np.random.default_rng(0).standard_normal((LAYERS, 2, HEADS, PS, D)).astype(np.float32)
            slot = np.concatenate([rc.encode_page(F.F16, values[layer]) for layer in range(LAYERS)])
            pages = [pool.alloc(F.F16) for _ in range(n)]
            for p in pages:
                pool.write_bytes(pool.offset_of(p), slot)
            t0 = time.perf_counter()
            for p in pages:
                pool.requantize(p, fmt)
            us = (time.perf_counter() - t0) / n * 1e6
            return us, pool.bytes_staged / n
    finally:
        paged._cuda_requantize_kernel = kernel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="int8,int4,int4_kc")
    args = ap.parse_args()
    if paged._cuda_requantize_kernel() is None:
        raise SystemExit("this build has no CUDA kernels (_ortkv.paged_requantize_cuda)")
    print("| format | device us / page | staged us / page | staged / device | bytes staged / page (staged path) |")
    print("|---|---:|---:|---:|---:|")
    for name in args.formats.split(","):
        fmt = parse_format(name)
        dev, stg, staged_bytes = [], [], 0
        for _ in range(args.rounds):
            dev.append(one_round(args.pages, fmt, False)[0])
            us, staged_bytes = one_round(args.pages, fmt, True)
            stg.append(us)
        d, s = statistics.median(dev), statistics.median(stg)
        print(f"| {fmt.name} | {d:.1f} | {s:.1f} | {s / d:.2f} | {staged_bytes:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
