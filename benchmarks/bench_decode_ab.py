"""Two cached builds of the float32 ortkv decoder, A/B, on the CPU: per round one child process per build (the
builds alternating, the first one swapped every round), each: the decoder's OrtkvRunner, one untimed greedy
generation, then --steps greedy decode steps after prefilling a prompt (_report.timed_decode); the step's wall
and ORT's run_with_iobinding inside it (medians). Reported per build: the medians over rounds, the median over
rounds of the per-round ratio B / A, and whether each prompt's greedy tokens are the same in every build.

A build is a model-cache tag (models.BUILD_TAG with its weights part, e.g. f32-v4 for ORT's MatMul projections,
f32lin-v4 for ortkv.Linear: Note [Linear projections] in builder.py); a tag that is not in the cache is refused
(it cannot be rebuilt by another version of the builder).

    python benchmarks/bench_decode_ab.py --tags f32-v4,f32lin-v4 [--rounds 5] [--steps 128] [--threads 2]
                                         [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _report import emit, timed_decode  # benchmarks/ is on sys.path when a script runs

PROMPTS = ("The capital of France is", "Once upon a time, there was a little robot who")


def _dir(tag: str):
    from ortkv.generate.assets import cache_dir

    return cache_dir() / "models" / f"smollm2-135m-{tag}"


def child(tag: str, steps: int, threads: int) -> dict:
    from ortkv.generate import runners
    from ortkv.generate.assets import smollm2_gguf
    from ortkv.generate.cli import apply_overrides
    from ortkv.generate.config import GenAIConfig
    from ortkv.generate.weights import load_tokenizer

    cfg = apply_overrides(GenAIConfig(), {"ortkv.weights": "float32", "ortkv.intra_op_num_threads": threads})
    tok = load_tokenizer(smollm2_gguf(log=lambda *x: None))
    r = runners.OrtkvRunner(_dir(tag) / "ortkv" / "model.onnx", cfg)
    out = {"tokens": {}}
    for i, prompt in enumerate(PROMPTS):
        wall, ort_s, toks = timed_decode(r, tok.encode(prompt), steps)
        out["tokens"][prompt] = toks
        if i == len(PROMPTS) - 1:  # the timed figures: the last prompt's pass
            out["wall"] = 1e3 * statistics.median(wall)
            out["run"] = 1e3 * statistics.median(ort_s)
    r.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tags", required=True, help="A,B: two model-cache tags, e.g. f32-v4,f32lin-v4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.threads)))
        return 0
    tags = args.tags.split(",")
    if len(tags) != 2:
        ap.error("--tags takes exactly two tags, A,B")
    for t in tags:
        if not (_dir(t) / "ortkv" / "model.onnx").exists():
            print(f"no cached decoder {_dir(t) / 'ortkv' / 'model.onnx'}: build it with the ortkv version that "
                  f"makes tag {t!r} (e.g. `ortkv generate --weights float32`)", file=sys.stderr)
            return 1
    load0 = os.getloadavg()[0]
    res = {t: [] for t in tags}
    for rnd in range(args.rounds):
        for t in (tags if rnd % 2 == 0 else tags[::-1]):
            cmd = [sys.executable, os.path.abspath(__file__), "--tags", args.tags, "--child", t, "--steps",
                   str(args.steps), "--threads", str(args.threads)]
            res[t].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True)
                                     .stdout.strip().splitlines()[-1]))
        a, b = res[tags[0]][-1], res[tags[1]][-1]
        print(f"round {rnd + 1}: {tags[0]} {a['wall']:.2f} ms, {tags[1]} {b['wall']:.2f} ms", file=sys.stderr)
    med = lambda t, k: statistics.median(x[k] for x in res[t])  # noqa: E731
    ratios = [b["wall"] / a["wall"] for a, b in zip(res[tags[0]], res[tags[1]])]
    lines = [
        f"`python benchmarks/bench_decode_ab.py --tags {args.tags} --rounds {args.rounds} --steps {args.steps} "
        f"--threads {args.threads}`; float32 ortkv decoder, batch 1, {args.steps} greedy decode steps after the "
        f"prompt {PROMPTS[-1]!r}, one child process per build and round, alternating.",
        "",
        "| build | step wall ms (median over rounds) | ORT run ms | walls per round |",
        "|---|---:|---:|---|",
    ]
    for t in tags:
        lines.append(f"| {t} | {med(t, 'wall'):.2f} | {med(t, 'run'):.2f} | "
                     + ", ".join(f"{x['wall']:.2f}" for x in res[t]) + " |")
    lines += ["", f"**{tags[1]} / {tags[0]} step wall: {statistics.median(ratios):.3f}** (median of the per-round "
              "ratios: " + ", ".join(f"{r:.3f}" for r in ratios) + ")", ""]
    for p in PROMPTS:
        seqs = [x["tokens"][p] for t in tags for x in res[t]]
        first = next((i for i in range(args.steps) if len({s[i] for s in seqs}) > 1), None)
        lines.append(f"greedy tokens of {p!r} ({args.steps} steps): "
                     + ("the same in every run of both builds" if first is None else
                        f"DIFFER from step {first} on"))
    lines += ["", f"load average (1 min) on {os.cpu_count()} CPUs: {load0:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end"]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
