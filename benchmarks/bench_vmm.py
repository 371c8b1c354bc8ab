"""VMM arena benchmarks, each side by side with its baseline in one run.

  1. commit and release latency per granule (one granule per call, and one call for all);
  2. growing a buffer by one granule: Arena.commit at the end (no copy, same pointer) vs allocate a
     bigger buffer and copy (numpy on the host, torch on CUDA), at 64 MiB, 512 MiB and 4 GiB;
  3. committed bytes vs live bytes for SmolLM2-135M's cache geometry (30 layers, 3 KV heads, head
     size 64, float16, capacity 8192) in BNSH, BSNH and token-major at 100, 1000 and 8000 tokens.

    python benchmarks/bench_vmm.py [--device cpu|cuda:0] [--sizes-mib 64 512 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np

from ortkv.vmm import LAYOUTS, Arena, CacheGeometry, committed_bytes_for, cuda_available, live_bytes

from _report import emit  # benchmarks/ is on sys.path when a script runs

SMOLLM2 = CacheGeometry(layers=30, kv_heads=3, head_size=64, capacity=8192, batch=1, dtype_bytes=2)


def _sync(device):
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def commit_release_latency(device: str, granules: int) -> dict:
    with Arena(1 << 40 if device != "cpu" else 1 << 36, device) as a:
        g = a.granule
        t0 = time.perf_counter()
        for i in range(granules):
            a.commit(g, offset=i * g)
        t_commit = (time.perf_counter() - t0) / granules
        t0 = time.perf_counter()
        a.release()
        t_release = (time.perf_counter() - t0) / granules
        t0 = time.perf_counter()
        a.commit(granules * g)
        t_bulk = (time.perf_counter() - t0) / granules
        a.release()
    return {"granule": g, "granules": granules, "commit_us": t_commit * 1e6, "release_us": t_release * 1e6,
            "bulk_commit_us": t_bulk * 1e6}


def grow_vs_copy(device: str, size: int, reps: int = 5) -> dict:
    """Median time to grow a `size`-byte buffer by one granule: commit vs allocate + copy."""
    with Arena(size + (reps + 1) * (64 << 20), device) as a:
        g = a.granule
        a.commit(size)
        times = []
        base = a.base
        for k in range(reps):
            t0 = time.perf_counter()
            a.commit(g, offset=size + k * g)
            times.append(time.perf_counter() - t0)
        assert a.base == base
        t_commit = float(np.median(times))
    times = []
    if device == "cpu":
        old = np.ones(size, np.uint8)
        for _ in range(reps):
            t0 = time.perf_counter()
            new = np.empty(size + g, np.uint8)
            new[:size] = old
            new[size:] = 0  # touch the new granule, as the commit backs it
            times.append(time.perf_counter() - t0)
            del new
        del old
    else:
        import torch

        old = torch.ones(size, dtype=torch.uint8, device=device)
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            new = torch.empty(size + g, dtype=torch.uint8, device=device)
            new[:size].copy_(old)
            _sync(device)
            times.append(time.perf_counter() - t0)
            del new
        del old
        torch.cuda.empty_cache()
    t_copy = float(np.median(times))
    return {"size": size, "granule": g, "commit_ms": t_commit * 1e3, "copy_ms": t_copy * 1e3, "ratio": t_copy / t_commit}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--granules", type=int, default=0, help="granules for the latency test (default: 4096 "
                   "on the host, 256 on CUDA)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.device != "cpu":
        ok, why = cuda_available()
        if not ok:
            print(f"CUDA arena unavailable: {why}", file=sys.stderr)
            return 2
    n = a.granules or (4096 if a.device == "cpu" else 256)
    lines = [f"# bench_vmm on {a.device} ({platform.node()}, {time.strftime('%Y-%m-%d %H:%M')})", "",
             f"command: `python {' '.join(sys.argv)}`", ""]
    lat = commit_release_latency(a.device, n)
    lines += ["## Commit / release latency per granule", "",
              f"granule {lat['granule']} bytes, {lat['granules']} granules: commit one at a time "
              f"{lat['commit_us']:.2f} us/granule, release {lat['release_us']:.2f} us/granule, commit all in one call "
              f"{lat['bulk_commit_us']:.2f} us/granule", ""]
    lines += ["## Grow by one granule: Arena.commit vs allocate + copy", "",
              "| buffer | commit one granule (ms) | allocate + copy (ms) | copy / commit |", "|---:|---:|---:|---:|"]
    for mib in a.sizes_mib:
        r = grow_vs_copy(a.device, mib << 20)
        lines.append(f"| {mib} MiB | {r['commit_ms']:.3f} | {r['copy_ms']:.3f} | {r['ratio']:.0f}x |")
    lines += ["", "## Committed vs live bytes, SmolLM2-135M cache (30 layers x K,V; 3 KV heads x 64; float16; "
              "capacity 8192)", "", "| layout | tokens | live | committed (4 KiB granule) | ratio | "
              "committed (2 MiB granule) | ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for layout in LAYOUTS:
        for tokens in (100, 1000, 8000):
            live = live_bytes(SMOLLM2, tokens)
            c4 = committed_bytes_for(layout, SMOLLM2, tokens, 4096)
            c2m = committed_bytes_for(layout, SMOLLM2, tokens, 2 << 20)
            lines.append(f"| {layout} | {tokens} | {live:,} | {c4:,} | {c4 / live:.2f} | {c2m:,} | {c2m / live:.2f} |")
    lines.append(f"\nfull capacity: {SMOLLM2.total_bytes:,} bytes")
    return emit("\n".join(lines), a.out)


if __name__ == "__main__":
    sys.exit(main())
