"""Heap allocations (malloc calls) per decode step of the ortkv SmolLM2 decoder on the CPU: the whole step (session
wrapper + ORT run) and the ORT run alone. A counting malloc shim is compiled here (cc), and the script re-runs itself
with it preloaded; ORT's own allocations (each node's output OrtValue, ...) are in the count too.

    python benchmarks/step_allocations.py [--weights float32,q4] [--steps 60]

Note [Input slots] (custom_ops/ort/ort_util.h) is what this counts: the op adapters' per-run TensorArgs, dims
vectors, strings and std::function arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdatomic.h>
static atomic_ulong n_malloc;
static void* (*real_malloc)(size_t);
void* malloc(size_t s) {
  if (!real_malloc) real_malloc = dlsym(RTLD_NEXT, "malloc");
  atomic_fetch_add_explicit(&n_malloc, 1, memory_order_relaxed);
  return real_malloc(s);
}
unsigned long ortkv_malloc_count(void) { return atomic_load(&n_malloc); }
"""

PROMPT_IDS = [1, 9690, 2409, 253, 655, 28, 665, 588, 253, 1165, 8325, 653]


def measure(weights: str, steps: int) -> tuple[int, int]:
    from _report import greedy_steps  # benchmarks/ is on sys.path when a script runs
    from ortkv.generate import runners
    from ortkv.generate.cli import apply_overrides
    from ortkv.generate.config import GenAIConfig

    count = ctypes.CDLL(None).ortkv_malloc_count
    count.restype = ctypes.c_ulong
    cfg = apply_overrides(GenAIConfig(), {"ortkv.weights": weights})
    runner = runners.make_runner("ortkv", cfg, log=lambda *a: None)
    sess = runner.sess.session
    run, inside = sess.run_with_iobinding, []

    def counted(io, run_options=None):
        before = count()
        run(io, run_options)
        inside.append(count() - before)

    sess.run_with_iobinding = counted
    per_step = greedy_steps(runner, PROMPT_IDS, steps, count)
    half = steps // 3  # the first steps may still grow buffers
    return int(np.median(per_step[half:])), int(np.median(inside[-(steps - half):]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="float32")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        for w in a.weights.split(","):
            step, ort_run = measure(w, a.steps)
            print(f"| {w} | {step} | {ort_run} |", flush=True)
        return
    with tempfile.TemporaryDirectory() as d:
        src, lib = Path(d) / "count.c", Path(d) / "libcount.so"
        src.write_text(SHIM)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(src), "-o", str(lib), "-ldl"], check=True)
        env = dict(os.environ, LD_PRELOAD=str(lib))
        print("| weights | mallocs per decode step (median) | of which inside the ORT run |")
        print("|---|---:|---:|", flush=True)
        subprocess.run([sys.executable, __file__, "--child", "--weights", a.weights, "--steps", str(a.steps)],
                       env=env, check=True)


if __name__ == "__main__":
    main()
