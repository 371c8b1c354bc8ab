"""Peak memory planned by ``ortkv.graph.check`` for the default model's decoders, side by side.

    python benchmarks/plan_variants.py [--out benchmarks/results/plan_smollm2.md]

One decode step (seq=1) at several capacities and batch sizes. The ortkv model holds each cache once
(its updates are in place); the copy model holds the past inputs and the Concat'ed present outputs.
The GenAI model is planned twice: as its graph alone (separate past and present values), and with
the aliases onnxruntime-genai's past_present_share_buffer makes by binding (share_buffer_aliases:
present K/V = past K/V, which needs past = present = capacity)."""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx

from ortkv.generate.config import GenAIConfig
from ortkv.generate.models import model_path
from ortkv.graph import check, share_buffer_aliases


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_smollm2.md"))
    args = p.parse_args()
    cfg = GenAIConfig().validate()
    models = {v: onnx.load(str(model_path(cfg, v)), load_external_data=False) for v in ("ortkv", "copy", "genai")}
    rows = []
    for batch in (1, 4):
        for cap in (2048, 8192):
            plans = {}
            for v in ("ortkv", "copy", "genai", "genai-share"):
                m = models[v.split("-")[0]]
                dims = ({"batch": batch, "seq": 1, "capacity": cap} if v == "ortkv"
                        else {"batch": batch, "seq": 1, "past_seq": cap, "total_seq": cap} if v == "genai-share"
                        else {"batch": batch, "seq": 1, "past_seq": cap - 1, "total_seq": cap})
                assumed = share_buffer_aliases(m) if v == "genai-share" else None
                r = check(m, dims=dims, bounds={"positions": (0, cap - 1)}, assume_aliases=assumed)
                r.raise_for_errors()
                plans[v] = r.plan
            base = plans["ortkv"]
            kinds = {v: pl.bytes_by_kind(at_peak=True) for v, pl in plans.items()}
            for v, pl in plans.items():
                k = kinds[v]
                kv = k["cache"] + k["input"] + k["output"]
                above = pl.peak_bytes - k["initializer"]
                ratio = above / (base.peak_bytes - kinds["ortkv"]["initializer"])
                rows.append(f"| {batch} | {cap} | {v} | {mib(pl.peak_bytes)} | {mib(above)} | {mib(kv)} "
                            f"| {len(pl.in_place)} | {ratio:.2f} |")
    text = "\n".join([
        "# Planned peak memory of the SmolLM2-135M decoders (`python benchmarks/plan_variants.py`)",
        "",
        "One decode step (seq=1), float32 weights (625.1 MiB of initializers), caches float32.",
        "Columns: peak (MiB, everything live at the peak step), peak above initializers, bytes of caches,",
        "graph inputs and graph outputs (logits included) live at the peak, in-place updates, and the peak",
        "above initializers relative to ortkv.",
        "",
        "| batch | capacity | variant | peak MiB | above weights MiB | caches + inputs + outputs MiB | in place | ratio |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "genai: the graph alone (past and present are separate values in it). genai-share: the same graph with",
        "the aliases onnxruntime-genai's past_present_share_buffer makes at run time by binding present K/V to",
        "the past K/V buffers (`ortkv check --share-buffer`); nothing in that graph states them.",
        "",
    ])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
