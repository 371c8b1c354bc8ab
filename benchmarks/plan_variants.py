"""Peak memory planned by ``ortkv.graph.check`` for the default model's decoders, side by side.

    python benchmarks/plan_variants.py [--out benchmarks/results/plan_smollm2.md]

One decode step (seq=1) at several capacities and batch sizes. The ortkv model holds each cache once
(its updates are in place); the copy model holds the past inputs and the Concat'ed present outputs.
The GenAI model as a graph also has separate past and present values: onnxruntime-genai's
past_present_share_buffer makes them one buffer by binding, outside the graph, so the plan of its
graph shows what the graph alone promises."""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx

from ortkv.generate.config import GenAIConfig
from ortkv.generate.models import model_path
from ortkv.graph import check


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
            for v, m in models.items():
                dims = ({"batch": batch, "seq": 1, "capacity": cap} if v == "ortkv"
                        else {"batch": batch, "seq": 1, "past_seq": cap - 1, "total_seq": cap})
                r = check(m, dims=dims, bounds={"positions": (0, cap - 1)})
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
        "The genai row is the graph alone: onnxruntime-genai's past_present_share_buffer binds past and",
        "present to one buffer at run time, which no annotation in that graph states or a planner can see.",
        "",
    ])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
