"""Where a paged CUDA decode step goes, per op type and execution provider (ORT's profiler, CUDA graphs off so
that every node is seen): the dense (arena) runner and the paged runner with each --kv-formats page format,
SmolLM2-135M, batch --batch, a --prompt-tokens prompt. Each op type is listed with its provider, so a node ORT
placed on the CPU shows.

    python benchmarks/profile_paged_cuda.py [--kv-formats f16,int4] [--batch 1] [--prompt-tokens 4000]
                                            [--steps 32] [--max-length 8192]
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

from ortkv.generate.config import GenAIConfig, set_device
from ortkv.generate.loop import generate
from ortkv.generate.models import tokenizer_for
from profile_decode import _ortkv_runner  # benchmarks/ is on sys.path when a script runs


def _profiling(prefix):
    def adjust(so):
        so.enable_profiling = True
        so.profile_file_prefix = prefix
    return adjust


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-formats", default="f16,int4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--max-length", type=int, default=8192)
    a = p.parse_args()
    variants = ["dense"] + [f"paged {f.strip().lower()}" for f in a.kv_formats.split(",") if f.strip()]
    for v in variants:
        cfg = GenAIConfig()
        set_device(cfg, "cuda", False)
        cfg.search.max_length = a.max_length
        if v != "dense":
            cfg.ortkv.cache = "paged"
            cfg.ortkv.kv_format = v.split()[1]
        cfg = cfg.validate()
        tok = tokenizer_for(cfg)
        text = "The history of the printing press begins in the fifteenth century, when " * (8 + a.prompt_tokens // 10)
        ids = [tok.encode(text)[: a.prompt_tokens] for _ in range(a.batch)]
        with tempfile.TemporaryDirectory() as tmp:
            r = _ortkv_runner(cfg, _profiling(str(Path(tmp) / "p")))  # the paged runner's options come from runners'
            g = generate(r, ids, cfg.search, a.steps, -1, 2)
            s = r.sess.session if hasattr(r.sess, "session") else r.sess
            trace = json.loads(Path(s.end_profiling()).read_text())
            r.close()
        runs = [e for e in trace if e.get("cat") == "Session" and e["name"] == "model_run"]
        steps = min(a.steps - 2, len(runs) - 1)
        first = runs[-steps]["ts"]
        kernels = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first]
        per = collections.defaultdict(lambda: [0, 0.0])
        for e in kernels:
            key = (e["args"]["op_name"], e["args"]["provider"])
            per[key][0] += 1
            per[key][1] += e["dur"]
        print(f"== {v}: median step {g.median_step_ms:.3f} ms; {len(kernels) / steps:.0f} nodes a step; "
              f"model_run {sorted(e['dur'] for e in runs[-steps:])[steps // 2]} us")
        for (op, prov), (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
            print(f"   {op:32s} {prov:24s} {n / steps:6.1f} nodes {us / steps:9.1f} us/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
