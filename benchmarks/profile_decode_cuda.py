"""Where a CUDA decode step's time goes: every CUDA kernel (and copy / memset) of N greedy decode steps of the ortkv
runner, grouped by kernel name, from CUPTI through torch.profiler (it records every kernel of the process, ORT's
included). --cache arena paged profiles the dense (arena) runner and then the paged runner with F16 pages (the
paged decoder, Note [Paged decoder on CUDA]; --kv-format another page format) in one process. Needs a GPU and torch.

    python benchmarks/profile_decode_cuda.py --batch 8 --steps 32 [--graph] [--max-length 2048] [--cache arena paged]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--graph", action="store_true", help="decode as a CUDA graph (kernels still listed by CUPTI)")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--cache", nargs="+", default=["arena"], choices=["arena", "paged"])
    p.add_argument("--kv-format", default="f16", help="the paged runner's page format (kv_format)")
    a = p.parse_args()
    for cache in a.cache:
        profile_one(a, cache)


def profile_one(a, cache: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ortkv.generate.config import GenAIConfig, set_device
    from ortkv.generate.runners import make_runner

    cfg = GenAIConfig()
    set_device(cfg, "cuda:0", cuda_graph=a.graph)
    if cache == "paged":
        cfg.ortkv.cache = "paged"
        cfg.ortkv.kv_format = a.kv_format
    cfg = cfg.validate()
    r = make_runner("ortkv", cfg)
    r.start(a.batch, a.max_length)
    ids = np.full((a.batch, a.prompt_tokens), 504, np.int64)
    tok = r.prefill_tokens(ids, np.full(a.batch, a.prompt_tokens))
    for _ in range(8):  # warm-up (and graph capture)
        tok = r.step_tokens(tok)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            tok = r.step_tokens(tok)
        wall = (time.perf_counter() - t0) / a.steps
    def dt(e):  # self device time (us); torch renamed self_cuda_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    dev = sorted(prof.key_averages(), key=lambda e: -dt(e))
    total = sum(dt(e) for e in dev)
    print(f"{cache} cache{' ' + a.kv_format if cache == 'paged' else ''}, batch {a.batch}, max length {a.max_length}, graph {a.graph}: wall {wall * 1e3:.3f} ms/step, "
          f"CUDA kernel time {total / a.steps / 1e3:.3f} ms/step, kernels/step {sum(e.count for e in dev if dt(e) > 0) / a.steps:.0f}")
    print(f"{'us/step':>9} {'calls/step':>10}  kernel")
    for e in dev[: a.rows]:
        t = dt(e)
        if t <= 0:
            break
        print(f"{t / a.steps:9.1f} {e.count / a.steps:10.1f}  {e.key[:110]}")
    r.close()


if __name__ == "__main__":
    main()
