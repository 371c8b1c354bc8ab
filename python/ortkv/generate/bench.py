"""``ortkv bench``: ortkv against onnxruntime-genai (share-buffer and not) and a Concat copy model, in
one run, on the same prompts and weights. Every cell runs in a fresh process (its peak RSS is its own);
ratios are against GenAI share-buffer. Writes results/<stamp>/bench_generate.md, .json and a PNG plot.

    ortkv bench [--quick] [--prompt-tokens 16 512] [--new-tokens 256 1024] [--max-length 2048 8192]
                [--batch 1 4] [--variants ortkv genai-share genai copy] [--out results]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

from .cli import run_worker
from .config import GenAIConfig
from .runners import RUNNERS

TEXT = ("ONNX Runtime runs models exported from many frameworks. A key-value cache stores the keys and values "
        "of every token a language model has seen, so that each new token attends to the past without "
        "recomputing it. Updating that cache in place, without a second cache-sized buffer, is what this "
        "benchmark measures, side by side with onnxruntime-genai and a plain copy. ")


def prompt_ids(tokenizer, tokens: int, batch: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * (1 + (tokens * (batch + 1)) // 60))
    return [ids[17 * b: 17 * b + tokens] for b in range(batch)]


def _progress(iterable, total):
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc="ortkv bench", unit="run")
    except ImportError:
        return iterable


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ortkv bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[16, 512])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--max-length", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--variants", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    p.add_argument("--quick", action="store_true", help="one small cell (prompt 16, 64 new tokens, max_length 2048, "
                   "batch 1) to check the set-up")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    if a.quick:
        a.prompt_tokens, a.new_tokens, a.max_length, a.batch = [16], [64], [2048], [1]
    from .models import build_models, tokenizer_for

    cfg = GenAIConfig().validate()
    tok = tokenizer_for(cfg)
    build_models(cfg, ("ortkv", "genai", "copy"))  # once, before any timing
    cells = list(itertools.product(a.prompt_tokens, a.new_tokens, a.max_length, a.batch))
    rows = []
    for (pt, nt, ml, b) in _progress(cells, len(cells)):
        prompts = prompt_ids(tok, pt, b)
        overrides = {"search.max_length": ml, "ortkv.max_new_tokens": nt}
        cell = {"prompt_tokens": pt, "new_tokens": nt, "max_length": ml, "batch": b, "runs": {}}
        for v in a.variants:
            r = run_worker(v, None, overrides, prompts)
            for k in ("texts", "prompt_ids", "prompts"):
                r.pop(k)
            cell["runs"][v] = r
            print(f"  prompt {pt} new {nt} max_length {ml} batch {b} {v:<12} decode {r['decode_tok_s']:7.1f} tok/s"
                  f"  peak RSS above load {r['peak_rss_above_load'] / 2**20:7.1f} MiB", file=sys.stderr)
        rows.append(cell)
    out = Path(a.out) / time.strftime("bench_%Y%m%d_%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_generate.json").write_text(json.dumps(rows))
    table = markdown(rows, a.variants)
    (out / "bench_generate.md").write_text(table + "\n")
    plot(rows, a.variants, out / "bench_generate.png")
    print(table)
    print(f"\nwritten to {out}/")
    return 0


def markdown(rows, variants) -> str:
    base = "genai-share" if "genai-share" in variants else variants[0]
    lines = [f"# ortkv bench ({platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}); ratios against {base}", "",
             "| prompt | new | max_length | batch | variant | decode tok/s | ratio | prefill tok/s | ratio | "
             "peak RSS above load | KV resident | same tokens |", "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in rows:
        b = c["runs"][base]
        for v in variants:
            r = c["runs"][v]
            lines.append(f"| {c['prompt_tokens']} | {c['new_tokens']} | {c['max_length']} | {c['batch']} | {v} | "
                         f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / b['decode_tok_s']:.2f} | "
                         f"{r['prefill_tok_s']:.1f} | {r['prefill_tok_s'] / b['prefill_tok_s']:.2f} | "
                         f"{r['peak_rss_above_load'] / 2**20:.1f} MiB | {r['kv_bytes'] / 2**20:.1f} MiB | "
                         f"{'yes' if r['new_ids'] == b['new_ids'] else 'no'} |")
    return "\n".join(lines)


def plot(rows, variants, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    big = max(rows, key=lambda c: (c["max_length"], c["new_tokens"], c["prompt_tokens"], -c["batch"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for v in variants:
        r = big["runs"][v]
        ax1.plot([x / 2**20 for x in r["rss_per_step"]], label=v)
    ax1.set_title(f"resident memory per step (prompt {big['prompt_tokens']}, max_length {big['max_length']}, "
                  f"batch {big['batch']})")
    ax1.set_xlabel("decode step")
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend()
    labels = [f"p{c['prompt_tokens']} n{c['new_tokens']}\nL{c['max_length']} b{c['batch']}" for c in rows]
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax2.bar([k + i * width for k in range(len(rows))], [c["runs"][v]["decode_tok_s"] for c in rows], width, label=v)
    ax2.set_xticks([k + 0.4 - width / 2 for k in range(len(rows))], labels, fontsize=6)
    ax2.set_ylabel("decode tokens/s")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
