"""The paged decoder's step on the CPU against the dense (arena) ortkv decoder: float32 SmolLM2-135M, F16 pages of 16,
greedy, 48 new tokens after the README prompt, one process, the variants alternating for --rounds rounds (round 0
not counted); median ms per decode step. --old names an older paged model directory (e.g. paged-ps16, a build
before Note [Paged decoder]'s Linear / SwiGLU base) to time beside the current one.

    python benchmarks/bench_paged_decoder_cpu.py [--rounds 5] [--old paged-ps16] [--out FILE]
                                                 [--prompt TEXT --repeat N] [--kv-formats f16,int8,int4]

--kv-formats times the paged decoder once per page format (genai_config's ortkv.kv_format; default f16 alone), each
beside the same dense decoder; "same tokens as dense" is then expected only of f16, and the column after it counts
the new tokens that agree with dense's before the first difference.

--repeat N feeds the prompt N times over (space-separated): a long context, e.g. --repeat 240 (~1,450 tokens of the
default prompt), where the attention's share of the step grows. The last column is the median over rounds of each
round's ratio to dense (the fairer figure on a noisy machine). The prefill columns: the prompt's forward (ms, median
over rounds) and the median of the rounds' prefill ratios to dense (Note [Paged CPU query tiles]).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _report import emit  # benchmarks/ is on sys.path when a script runs


def main(argv=None) -> int:
    from ortkv.generate.config import GenAIConfig
    from ortkv.generate.loop import generate
    from ortkv.generate.models import model_dir, model_path, tokenizer_for
    from ortkv.generate.paged import PagedRunner, paged_model_path
    from ortkv.generate.runners import OrtkvRunner

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--old", help="an older paged model's directory name under the model cache")
    p.add_argument("--kv-formats", default="f16", help="page formats to time, comma-separated (ortkv.kv_format)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    formats = [f.strip().lower() for f in a.kv_formats.split(",") if f.strip()]
    dense_cfg = GenAIConfig().validate()
    runners = {"dense": OrtkvRunner(model_path(dense_cfg, "ortkv"), dense_cfg)}
    for f in formats:
        cfg = GenAIConfig()
        cfg.ortkv.cache = "paged"
        cfg.ortkv.kv_format = f
        cfg = cfg.validate()
        runners["paged" if formats == ["f16"] else f"paged {f}"] = PagedRunner(paged_model_path(cfg), cfg)
    if a.old:
        runners[a.old] = PagedRunner(model_dir(cfg) / a.old / "model.onnx", cfg)
    ids = [tokenizer_for(cfg).encode(" ".join([a.prompt] * a.repeat))]
    if len(ids[0]) + a.new_tokens > cfg.search.max_length:
        p.error(f"{len(ids[0])} prompt tokens + {a.new_tokens} new exceed max_length {cfg.search.max_length}")
    runs = {v: [] for v in runners}
    prefill = {v: [] for v in runners}
    tokens = {}
    for r in range(a.rounds + 1):
        for v, run in runners.items():
            g = generate(run, ids, run.cfg.search, a.new_tokens, -1, 2)
            if r:
                runs[v].append(g.median_step_ms)
                prefill[v].append(g.prefill_s * 1e3)
            tokens[v] = g.new_ids[0]
    dense = statistics.median(runs["dense"])
    lines = [f"{len(ids[0])} prompt tokens, {a.new_tokens} new, {a.rounds} rounds", "",
             "| variant | ms/step (median) | vs dense | rounds | same tokens as dense | tokens agreeing | "
             "median of round ratios | prefill ms (median) | prefill: median of round ratios |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for v, xs in runs.items():
        m = statistics.median(xs)
        per_round = statistics.median(x / d for x, d in zip(xs, runs["dense"]))
        agree = next((i for i, (x, y) in enumerate(zip(tokens[v], tokens["dense"])) if x != y), len(tokens[v]))
        pre = statistics.median(prefill[v])
        pre_ratio = statistics.median(x / d for x, d in zip(prefill[v], prefill["dense"]))
        lines.append(f"| {v} | {m:.2f} | {m / dense:.2f} | {' '.join(f'{x:.2f}' for x in xs)} | "
                     f"{'yes' if tokens[v] == tokens['dense'] else 'no'} | {agree} | {per_round:.2f} | {pre:.0f} | "
                     f"{pre_ratio:.2f} |")
    for r in runners.values():
        r.close()
    return emit("\n".join(lines), a.out)


if __name__ == "__main__":
    sys.exit(main())
