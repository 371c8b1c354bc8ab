"""Paged CUDA generation, decode speed: ortkv's dense (arena) runner and the paged runner with F16 pages as it ships
(PagedRotaryCacheUpdate, Note [PagedRotaryCacheUpdate]; the resolved update, one launch of a block per 16 store
jobs, launched as a programmatic dependent of the QKV projection; page table buckets, Note [Page table buckets]),
against the paged runner with that update launched plainly (ORTKV_CUDA_PAGED_UPDATE=plain while it captures) and
with the memset + check + store kernels (=two), with --one-block the update in ONE block (=one), with --unfused the
paged runner on the unfused base (Split + 2 RotaryEmbedding +
PagedCacheUpdate: paged_model_path(fused_rotary=False)), with --full-table the paged runner binding the whole
max_length table (TABLE_BUCKET_MIN raised past it), with --walk the paged runner whose host bookkeeping walks
every page of every row each step (ortkv.reference.page_policy: before Note [Incremental advance]), and with
--page-commits the paged runner committing page by page (COMMIT_AHEAD_TOKENS 0: a fresh graph capture after every
granule, as before Note [Paged decoder on CUDA]'s commit-ahead; compare the mean column), and with --kv-formats
int8,int4 the paged runner with every page of that format (kv_format; INT4 pages run the uniform INT4 kernel,
Note [Paged CUDA uniform INT4]; INT8 pages the uniform INT8 kernel, Note [Paged CUDA uniform INT8]), and with
--every-format-int8 the paged runner with INT8 pages on the every-format kernel (ORTKV_PAGED_UNIFORM_INT8=0 while
it captures), with --int8-row32 on the uniform INT8 kernel whose single rows take 32-key steps as every other
node (ORTKV_PAGED_INT8_ROW_STEP=32; as shipped they take 64-key steps).
SmolLM2-135M float16, CUDA graph, greedy. One process; per cell the variants alternate, --rounds times, and the
table holds each one's median ms per decode step and its ratio to the dense runner's, the prefill's ms, the mean ms
per step over all steps (a step that captures a new CUDA graph, after the pool or the arena committed, counts
there and not in the median), and the paged runners' decode graph ids in the last round (each captured afresh).

    python benchmarks/bench_paged_generate_cuda.py [--batch 1 8] [--max-length 2048 8192] [--prompt-tokens 16]
        [--new-tokens 128] [--rounds 3] [--one-block] [--unfused] [--full-table] [--walk] [--page-commits]
        [--kv-formats int8,int4] [--uniform-int8]
        [--out benchmarks/results/paged_generate_cuda.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _report import emit  # benchmarks/ is on sys.path when a script runs


def main(argv=None) -> int:
    from ortkv.generate import paged as paged_module
    from ortkv.generate.config import GenAIConfig, set_device
    from ortkv.generate.loop import generate
    from ortkv.generate.models import tokenizer_for
    from ortkv.generate.paged import PagedRunner, paged_model_path
    from ortkv.generate.runners import make_runner
    from ortkv.paged import PagedKVCache
    from ortkv.reference.page_policy import walk_advance, walk_reserve

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-length", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--full-table", action="store_true", help="also the paged runner binding the whole table")
    p.add_argument("--unfused", action="store_true", help="also the paged runner on the unfused base")
    p.add_argument("--one-block", action="store_true", help="also the paged runner with the update in one block")
    p.add_argument("--walk", action="store_true", help="also the paged runner walking every page each step")
    p.add_argument("--page-commits", action="store_true", help="also the paged runner committing page by page")
    p.add_argument("--kv-formats", default="",
                   help="comma-separated page formats, each also run as a paged runner (e.g. int8,int4)")
    p.add_argument("--every-format-int8", action="store_true",
                   help="also the paged runner with INT8 pages on the every-format kernel (ORTKV_PAGED_UNIFORM_INT8=0)")
    p.add_argument("--int8-row32", action="store_true",
                   help="also the paged runner with INT8 pages, single rows in 32-key steps "
                        "(ORTKV_PAGED_INT8_ROW_STEP=32)")
    p.add_argument("--no-update-variants", action="store_true",
                   help="leave out the plain and two-kernel update variants")
    p.add_argument("--out", help="append the table to this markdown file")
    a = p.parse_args(argv)

    variants = ["dense", "paged f16"]
    variants += [] if a.no_update_variants else ["paged f16 plain update", "paged f16 two-kernel update"]
    variants += [f"paged {f.strip().lower()}" for f in a.kv_formats.split(",") if f.strip()]
    variants += ["paged int8 every-format kernel"] if a.every_format_int8 else []
    variants += ["paged int8 row32"] if a.int8_row32 else []
    variants += ["paged f16 one-block update"] if a.one_block else []
    variants += ["paged f16 unfused rotary"] if a.unfused else []
    variants += ["paged f16 full table"] if a.full_table else []
    variants += ["paged f16 walk bookkeeping"] if a.walk else []
    variants += ["paged f16 page-by-page commits"] if a.page_commits else []
    shipped_ahead = paged_module.COMMIT_AHEAD_TOKENS
    shipped_steps = PagedKVCache.reserve, PagedKVCache.advance
    # the variables a variant sets while it runs (read at each launch: the capture keeps them)
    variant_env = {"plain update": ("ORTKV_CUDA_PAGED_UPDATE", "plain"),
                   "one-block update": ("ORTKV_CUDA_PAGED_UPDATE", "one"),
                   "two-kernel update": ("ORTKV_CUDA_PAGED_UPDATE", "two"),
                   "every-format kernel": ("ORTKV_PAGED_UNIFORM_INT8", "0"),
                   "row32": ("ORTKV_PAGED_INT8_ROW_STEP", "32")}
    shipped_min = paged_module.TABLE_BUCKET_MIN

    def config(variant: str, ml: int) -> GenAIConfig:
        cfg = GenAIConfig()
        set_device(cfg, a.device, True)
        cfg.search.max_length = ml
        if variant != "dense":
            cfg.ortkv.cache = "paged"
            cfg.ortkv.kv_format = variant.split()[1]  # "paged FMT ..."
        return cfg.validate()

    tok = tokenizer_for(config("dense", 2048))
    text = "The history of the printing press begins in the fifteenth century, when " * (8 + a.prompt_tokens // 10)
    prompt = tok.encode(text)[: a.prompt_tokens]
    assert len(prompt) == a.prompt_tokens, (len(prompt), a.prompt_tokens)
    rows = []
    for ml in a.max_length:
        runners = {v: (PagedRunner(paged_model_path(config(v, ml), fused_rotary=False), config(v, ml))
                       if v.endswith("unfused rotary") else make_runner("ortkv", config(v, ml))) for v in variants}
        try:
            for batch in a.batch:
                ids = [list(prompt) for _ in range(batch)]
                runs = {v: [] for v in variants}
                prefill = {v: [] for v in variants}
                mean = {v: [] for v in variants}  # every step, graph captures included (a median hides them)
                graphs = {}  # the paged runners' decode graph ids of the last round (Note [Paged decoder on CUDA])
                tokens = {}
                for r in range(a.rounds + 1):  # round 0 warms up (captures, first loads): not counted
                    for v in variants:
                        paged_module.TABLE_BUCKET_MIN = 1 << 40 if v.endswith("full table") else shipped_min
                        walk = v.endswith("walk bookkeeping")
                        steps = (walk_reserve, walk_advance) if walk else shipped_steps
                        PagedKVCache.reserve, PagedKVCache.advance = steps
                        paged_module.COMMIT_AHEAD_TOKENS = 0 if v.endswith("page-by-page commits") else shipped_ahead
                        env = [var for suffix, var in variant_env.items() if v.endswith(suffix)]
                        os.environ.update(env)
                        cfg = runners[v].cfg
                        g = generate(runners[v], ids, cfg.search, a.new_tokens, -1, 2)
                        for name, _ in env:
                            os.environ.pop(name, None)
                        if r > 0:
                            runs[v].append(g.median_step_ms)
                            prefill[v].append(g.prefill_s * 1e3)
                            mean[v].append(g.decode_s / max(g.decode_steps, 1) * 1e3)
                        graphs[v] = getattr(runners[v], "decode_graphs", None)
                        tokens[v] = g.new_ids
                paged_module.TABLE_BUCKET_MIN = shipped_min
                PagedKVCache.reserve, PagedKVCache.advance = shipped_steps
                paged_module.COMMIT_AHEAD_TOKENS = shipped_ahead
                dense = statistics.median(runs["dense"])
                for v in variants:
                    ms = statistics.median(runs[v])
                    pre, avg = statistics.median(prefill[v]), statistics.median(mean[v])
                    rows.append((a.prompt_tokens, a.new_tokens, ml, batch, v, ms, ms / dense,
                                 " ".join(f"{x:.3f}" for x in runs[v]), tokens[v] == tokens["dense"], pre, avg,
                                 "-" if graphs[v] is None else graphs[v]))
                    print(f"max_length {ml} batch {batch} {v:22s} {ms:.3f} ms/step ({ms / dense:.3f}x dense), "
                          f"mean {avg:.3f} ms/step, prefill {pre:.1f} ms", flush=True)
        finally:
            for r in runners.values():
                r.close()
    head = (f"\n## {time.strftime('%Y-%m-%d %H:%M')} UTC, `python benchmarks/bench_paged_generate_cuda.py "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
            "| prompt | new | max_length | batch | variant | ms/step (median of rounds) | vs dense | rounds "
            "| same tokens as dense | prefill ms (median) | mean ms/step (all steps, median of rounds) "
            "| decode graphs |\n|---:|---:|---:|---:|---|---:|---:|---|---|---:|---:|---:|\n")
    table = head + "".join(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.3f} | {r[6]:.3f} | {r[7]} | "
                           f"{'yes' if r[8] else 'no'} | {r[9]:.1f} | {r[10]:.3f} | {r[11]} |\n" for r in rows)
    return emit(table, a.out, append=True)


if __name__ == "__main__":
    sys.exit(main())
