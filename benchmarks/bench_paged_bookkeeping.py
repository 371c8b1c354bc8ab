"""Host bookkeeping of a paged decode step (ortkv.paged.PagedKVCache, the paged runner's cache): reserve before the
run + advance after it, incremental (Note [Incremental advance], shipped) vs the walk over every page of every row
(ortkv.reference.page_policy, how it was done before), alternating in one process.

SmolLM2-135M's pool (30 layers, 3 KV heads, head size 64, pages of 16) on the host arena; rows prefilled to
`held` tokens, then one token per row per step. Median microseconds per step over --steps steps (a step that
opens or requantizes a page included: the pool's own work, the same in both), per policy: one format (f16) and
recency (1 sink page + 4 newest F16, the rest INT4: one page requantized per row every 16 steps).

    python benchmarks/bench_paged_bookkeeping.py [--steps 64] [--rounds 3]
        [--out benchmarks/results/paged_bookkeeping.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from ortkv.paged import PagedKVCache, PagePool, policy_from_config
from ortkv.reference.page_policy import walk_advance, walk_reserve
from ortkv.vmm import Governor

from _report import emit  # benchmarks/ is on sys.path when a script runs

POLICIES = {"f16": dict(kv_format="f16"),
            "recency": dict(kv_policy={"sink_pages": 1, "recent_pages": 4, "recent": "f16", "old": "int4"})}


def run(variant: str, policy: str, batch: int, held: int, steps: int) -> float:
    """Median us per step (reserve + advance) of `steps` one-token steps after a prefill to `held` tokens."""
    per_seq = -(-(held + steps + 1) // 16)
    pool = PagePool(30, 3, 64, 16, np.float32, "cpu", Governor(64 << 30), max_pages=batch * per_seq)
    try:
        cache = PagedKVCache(pool, batch, per_seq, policy_from_config(**POLICIES[policy]))
        reserve, advance = ((cache.reserve, cache.advance) if variant == "incremental" else
                            (lambda n: walk_reserve(cache, n), lambda n: walk_advance(cache, n)))
        lengths = np.full(batch, held, np.int64)
        reserve(lengths)
        advance(lengths)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            reserve(lengths + 1)
            lengths += 1
            advance(lengths)
            times.append(time.perf_counter_ns() - t0)
        return statistics.median(times) / 1e3
    finally:
        pool.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lines = [f"# Paged decode step, host bookkeeping ({platform.node()}, {time.strftime('%Y-%m-%d %H:%M')})", "",
             f"command: `python benchmarks/bench_paged_bookkeeping.py --steps {a.steps} --rounds {a.rounds}`", "",
             "reserve + advance per one-token step, us (median of the steps; median of the rounds, the two variants "
             "alternating). walk = every page of every row each step (before); incremental = Note [Incremental "
             "advance] (shipped).", "",
             "| policy | rows x tokens held | walk us | incremental us | incremental / walk |",
             "|---|---|---:|---:|---:|"]
    for policy in POLICIES:
        for batch, held in ((1, 1024), (1, 8192), (8, 1024), (8, 4096), (32, 4096)):
            r = {"walk": [], "incremental": []}
            for _ in range(a.rounds):
                for v in r:
                    r[v].append(run(v, policy, batch, held, a.steps))
            w, i = statistics.median(r["walk"]), statistics.median(r["incremental"])
            lines.append(f"| {policy} | {batch} x {held:,} | {w:,.0f} | {i:,.0f} | {i / w:.3f} |")
            print(lines[-1], flush=True)
    return emit("\n".join(lines), a.out)


if __name__ == "__main__":
    raise SystemExit(main())
