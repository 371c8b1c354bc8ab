"""The memory planner's transient bytes beside what one decode step measurably adds to resident memory.

    python benchmarks/plan_vs_measured.py [--capacity 8192] [--out benchmarks/results/plan_vs_measured_cpu.md]

For the ortkv and copy decoders of the default model (float32, batch 1, CPU): load the session, make the
caches (resident, caller-owned), reset the kernel's peak-RSS mark, run one decode step at the last
position, and read the peak. The planner's figure to compare is its peak minus the bytes that already
exist before the run (initializers and graph inputs, caches included): what the run itself must
allocate. ORT runs without its CPU arena here so freed buffers are not held back.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import ortkv
from ortkv._memory import peak_rss_bytes, reset_peak, rss_bytes
from ortkv.generate.builder import genai_names, ortkv_names
from ortkv.generate.config import GenAIConfig
from ortkv.generate.models import model_path
from ortkv.graph import check


def mib(n) -> str:
    return f"{n / 2**20:.1f}"


def measure(variant: str, path: str, cfg, cap: int) -> int:
    d = cfg.model.decoder
    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = False
    so.intra_op_num_threads = 2
    layers, hkv, head = d.num_hidden_layers, d.num_key_value_heads, d.head_size
    if variant == "ortkv":
        sess = ortkv.MutableCacheSession(path, sess_options=so, providers=["CPUExecutionProvider"])
        caches = [np.zeros((1, hkv, cap, head), np.float32) for _ in range(2 * layers)]
        for i in range(layers):
            k, v, _, _ = ortkv_names(i)
            sess.bind_cache(k, caches[2 * i])
            sess.bind_cache(v, caches[2 * i + 1])
        feeds = {"input_ids": np.array([[1]], np.int64), "positions": np.array([cap - 1], np.int64)}
        run = lambda: sess.run(["logits"], feeds)  # noqa: E731
    else:
        so.register_custom_ops_library(ortkv.get_library_path())
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        feeds = {"input_ids": np.array([[1]], np.int64), "attention_mask": np.ones((1, cap), np.int64),
                 "position_ids": np.array([[cap - 1]], np.int64)}
        for i in range(layers):
            k, v, _, _ = genai_names(i)
            feeds[k] = np.zeros((1, hkv, cap - 1, head), np.float32)
            feeds[v] = np.zeros((1, hkv, cap - 1, head), np.float32)
        run = lambda: sess.run(None, feeds)  # noqa: E731
    run()  # first run: ORT's one-time allocations (kernel state, thread pools) are not the plan's business
    gc.collect()
    if not reset_peak():
        raise SystemExit("this kernel refuses /proc/self/clear_refs; cannot reset the peak-RSS mark")
    before = rss_bytes()
    out = run()
    grown = peak_rss_bytes() - before
    del out
    return grown


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--capacity", type=int, default=8192)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_vs_measured_cpu.md"))
    args = p.parse_args()
    cfg = GenAIConfig().validate()
    cap = args.capacity
    rows = []
    for variant, dims in (("ortkv", {"batch": 1, "seq": 1, "capacity": cap}),
                          ("copy", {"batch": 1, "seq": 1, "past_seq": cap - 1, "total_seq": cap})):
        path = str(model_path(cfg, variant))
        report = check(onnx.load(path, load_external_data=False), dims=dims).raise_for_errors()
        k = report.plan.bytes_by_kind(at_peak=True)
        planned = report.plan.peak_bytes - k["initializer"] - k["input"] - k["cache"]
        measured = measure(variant, path, cfg, cap)
        rows.append(f"| {variant} | {mib(k['cache'] + k['input'])} | {mib(planned)} | {mib(measured)} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        f"# Planned vs measured: what one decode step allocates (`python benchmarks/plan_vs_measured.py "
        f"--capacity {cap}`)",
        "",
        f"SmolLM2-135M float32, batch 1, CPU, position {cap - 1} of capacity {cap}; ORT without its CPU arena.",
        "Planned: the planner's peak minus initializers, graph inputs and caches (they exist before the run).",
        "Measured: peak RSS during the second run minus RSS just before it (/proc/self VmHWM, reset first).",
        "",
        "| variant | caches + inputs before the run MiB | planned run allocations MiB | measured peak RSS growth MiB |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
