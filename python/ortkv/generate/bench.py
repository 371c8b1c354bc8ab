"""``ortkv bench``: ortkv against onnxruntime-genai (share-buffer and not) and a Concat copy model, in
one run, on the same prompts and weights. Every cell runs in a fresh process (its peak RSS is its own);
ratios are against GenAI share-buffer. Writes results/<stamp>/bench_generate.md, .json and a PNG plot.

    ortkv bench [--quick] [--prompt-tokens 16 512] [--new-tokens 256 1024] [--max-length 2048 8192]
                [--batch 1 4] [--variants ortkv genai-share genai copy] [--out results]
    ortkv bench --device cuda[:N]   float16 on the GPU: prompt 16 / 1024, 256 new tokens, max_length 2048 / 8192,
                batch 1 / 8 / 32; variants ortkv (CUDA graph), ortkv-nograph, genai-share, genai, copy, and
                llama.cpp where $ORTKV_LLAMACPP_BENCH names a driver (Note [llama.cpp hook])
    ortkv bench --cpu-baseline llamacpp [--llamacpp-bin PATH] [--weights q4] [--repeats 3] [--threads N]
                llama.cpp's decode tokens/s on the same GGUF beside the ortkv variants (default: ortkv), CPU,
                alternating runs, medians (Note [CPU baseline]); grid: prompt 16, 256 new tokens,
                max_length 2048 / 8192, batch 1 / 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

from ..errors import OrtkvError
from .cli import run_worker
from .config import GenAIConfig, set_device
from .runners import RUNNERS

CUDA_VARIANTS = ("ortkv", "ortkv-nograph", "genai-share", "genai", "copy")
CUDA_GRID = {"prompt_tokens": [16, 1024], "new_tokens": [256], "max_length": [2048, 8192], "batch": [1, 8, 32]}

# Note [llama.cpp hook]
# The GPU bench runs llama.cpp only through a driver named by $ORTKV_LLAMACPP_BENCH (ortkv builds nothing of
# llama.cpp): an executable called once per cell as
#     $ORTKV_LLAMACPP_BENCH --model GGUF --batch B --prompt-tokens P --new-tokens N --ctx MAX_LENGTH
# that prints, as its last stdout line, one JSON object with decode_tok_s and prefill_tok_s (all sequences),
# and optionally kv_bytes and peak_device_above_load. A wrapper around llama.cpp's llama-batched-bench or a
# small llama_decode_bench program fits. Its row is labelled llama.cpp; a failure is reported in the table,
# never silently dropped.
# The CPU baseline (--cpu-baseline llamacpp) calls the same driver with `--threads T` added (ortkv's
# intra_op_num_threads in the same run); benchmarks/llamacpp/llama_decode_bench.cpp is such a driver.
LLAMACPP_ENV = "ORTKV_LLAMACPP_BENCH"


def run_llamacpp(gguf: str, pt: int, nt: int, ml: int, b: int, exe: str | None = None, threads: int | None = None) -> dict:
    import subprocess

    exe = exe or os.environ[LLAMACPP_ENV]
    cmd = [exe, "--model", gguf, "--batch", str(b), "--prompt-tokens", str(pt), "--new-tokens", str(nt), "--ctx", str(ml)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": f"{exe} exited {out.returncode}: {out.stderr.strip()[-300:]}"}
    try:
        r = json.loads(out.stdout.strip().splitlines()[-1])
        float(r["decode_tok_s"]), float(r["prefill_tok_s"])
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        return {"error": f"{exe} printed no JSON line with decode_tok_s and prefill_tok_s ({exc!r})"}
    return r


def worker_overrides(device: str, variant: str, ml: int, nt: int) -> tuple[str, dict]:
    """(runner, overrides) of one bench cell: the CUDA device and, for the ortkv rows, CUDA graph on or off."""
    overrides = {"search.max_length": ml, "ortkv.max_new_tokens": nt}
    if device == "cpu":
        return variant, overrides
    cfg = GenAIConfig()
    set_device(cfg, device, cuda_graph=variant == "ortkv")
    overrides["model.decoder.session_options"] = cfg.model.decoder.session_options
    return ("ortkv" if variant == "ortkv-nograph" else variant), overrides

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
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N (float16, the GPU grid, Note "
                   "[llama.cpp hook] for the llama.cpp row)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", help="default: 16 512 (cuda: 16 1024)")
    p.add_argument("--new-tokens", type=int, nargs="+", help="default: 256 1024 (cuda: 256)")
    p.add_argument("--max-length", type=int, nargs="+", help="default: 2048 8192")
    p.add_argument("--batch", type=int, nargs="+", help="default: 1 4 (cuda: 1 8 32)")
    p.add_argument("--variants", nargs="+", choices=CUDA_VARIANTS,
                   help=f"default: {' '.join(RUNNERS)} (cuda: {' '.join(CUDA_VARIANTS)}); ortkv-nograph is CUDA only")
    p.add_argument("--quick", action="store_true", help="one small cell (prompt 16, 64 new tokens, max_length 2048, "
                   "batch 1) to check the set-up")
    p.add_argument("--out", default="results")
    p.add_argument("--cpu-baseline", choices=["llamacpp"], help="CPU: llama.cpp's decode tokens/s on the same GGUF in "
                   "the same run (Note [CPU baseline]); default variants: ortkv")
    p.add_argument("--llamacpp-bin", metavar="PATH", help=f"the llama.cpp driver (default: ${LLAMACPP_ENV}, else the "
                   "one benchmarks/llamacpp/build.sh built in the ortkv cache, else that script is run)")
    p.add_argument("--weights", choices=["float32", "q4", "q8"], nargs="+", help="the ortkv weights (default: the "
                   "config's; with --cpu-baseline: q4, the GGUF's own 4-bit blocks; --cpu-baseline takes several, e.g. "
                   "q4 q8, each an ortkv variant of its own in the same alternating runs)")
    p.add_argument("--cache-layout", choices=["BNSH", "BSNH", "SBNH"], help="--cpu-baseline: the ortkv caches' layout "
                   "(default: the config's, BNSH on the CPU; BSNH takes K / V flat, 60 nodes fewer per SmolLM2 step: "
                   "Note [CacheUpdate flat values])")
    p.add_argument("--repeats", type=int, default=3, help="--cpu-baseline: runs of each variant per cell, "
                   "alternating (default 3; medians)")
    p.add_argument("--threads", type=int, help="--cpu-baseline: threads for ortkv (intra_op_num_threads) and "
                   "llama.cpp alike (default: the CPUs this process may use)")
    a = p.parse_args(argv)
    if a.cpu_baseline:
        return cpu_baseline(p, a)
    if a.weights and len(a.weights) > 1:
        p.error(f"--weights {' '.join(a.weights)}: several weights only with --cpu-baseline; give one")
    cuda = a.device != "cpu"
    grid = CUDA_GRID if cuda else {"prompt_tokens": [16, 512], "new_tokens": [256, 1024], "max_length": [2048, 8192],
                                   "batch": [1, 4]}
    for key, default in grid.items():
        if getattr(a, key) is None:
            setattr(a, key, default)
    if a.variants is None:
        a.variants = list(CUDA_VARIANTS if cuda else RUNNERS)
    if not cuda and "ortkv-nograph" in a.variants:
        p.error("ortkv-nograph (the ortkv decoder without CUDA graph capture) needs --device cuda[:N]")
    if a.quick:
        a.prompt_tokens, a.new_tokens, a.max_length, a.batch = [16], [64], [2048], [1]
    from .models import build_models, gguf_path, tokenizer_for

    cfg = GenAIConfig()
    if cuda:
        set_device(cfg, a.device)
    cfg.validate()
    tok = tokenizer_for(cfg)
    build_models(cfg, ("ortkv", "genai", "copy"))  # once, before any timing
    llamacpp = cuda and bool(os.environ.get(LLAMACPP_ENV))
    variants = list(a.variants) + (["llama.cpp"] if llamacpp else [])
    cells = list(itertools.product(a.prompt_tokens, a.new_tokens, a.max_length, a.batch))
    rows = []
    for (pt, nt, ml, b) in _progress(cells, len(cells)):
        prompts = prompt_ids(tok, pt, b)
        cell = {"prompt_tokens": pt, "new_tokens": nt, "max_length": ml, "batch": b, "runs": {}}
        for v in a.variants:
            runner, overrides = worker_overrides(a.device, v, ml, nt)
            if a.weights:
                overrides["ortkv.weights"] = a.weights[0]
            try:
                r = run_worker(runner, None, overrides, prompts)
            except OrtkvError as exc:  # one failing cell is reported in the table, the grid goes on
                cell["runs"][v] = {"error": str(exc).strip().splitlines()[-1][:300]}
                print(f"  prompt {pt} new {nt} max_length {ml} batch {b} {v:<13} FAILED: {cell['runs'][v]['error']}",
                      file=sys.stderr)
                continue
            for k in ("texts", "prompt_ids", "prompts") + (("rss_per_step", "kv_bytes_per_step") if cuda else ()):
                r.pop(k, None)
            r["variant"] = v
            cell["runs"][v] = r
            mem = (f"KV committed {r['kv_committed_bytes'] / 2**20:7.1f} MiB for {r['kv_live_bytes'] / 2**20:7.1f} live"
                   if cuda else f"peak RSS above load {r['peak_rss_above_load'] / 2**20:7.1f} MiB")
            print(f"  prompt {pt} new {nt} max_length {ml} batch {b} {v:<13} decode {r['decode_tok_s']:8.1f} tok/s  "
                  f"{mem}", file=sys.stderr)
        if llamacpp:
            cell["runs"]["llama.cpp"] = run_llamacpp(str(gguf_path(cfg)), pt, nt, ml, b)
        rows.append(cell)
    out = Path(a.out) / time.strftime("bench_%Y%m%d_%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_generate.json").write_text(json.dumps(rows))
    table = markdown_cuda(rows, variants, a.device) if cuda else markdown(rows, a.variants)
    (out / "bench_generate.md").write_text(table + "\n")
    if cuda:
        plot_cuda(rows, variants, out / "bench_generate.png")
    else:
        plot(rows, a.variants, out / "bench_generate.png")
    print(table)
    print(f"\nwritten to {out}/")
    return 0


# Note [CPU baseline]
# `ortkv bench --cpu-baseline llamacpp` puts llama.cpp's CPU decode speed on the same GGUF beside ortkv's,
# in one run: per cell (prompt, new tokens, max_length, batch) every variant runs --repeats times, the
# variants alternating (ortkv, ..., llama.cpp, ortkv, ..., llama.cpp, ...), so that a load that comes and
# goes on a shared machine falls on all of them; the table holds the medians and each variant's ratio to
# llama.cpp. Both sides do the same work: B copies of ONE prompt of P tokens prefilled together, then N
# new tokens per row greedily, decode_tok_s = (N - 1) x B / decode seconds (the first new token comes from
# the prefill), the same thread count (ortkv's intra_op_num_threads = the driver's --threads), max_length
# positions per row (the driver's n_ctx = max_length x B, one KV stream per row, f16 K/V). ortkv runs with
# --weights q4 by default: the GGUF's Q4_1 blocks as ortkv.MatMulQ4 (weights.py Note [Fast 4-bit path]).
# Both sides warm up the same way: the driver runs an untimed prefill + one step before it times (its
# default), and each ortkv worker likewise (ortkv.warmup: an untimed 2-token generation on the same runner,
# then a fresh cache for the timed one). Without it the first generation in a process paid its cold costs
# (ORT's first runs, first-touched pages) in the decode figure: q8 measured 14.8 ms per token cold against
# 12.8 ms for the third generation in one process, where llama.cpp's figure never included them.
# The driver (Note [llama.cpp hook]) is, in order: --llamacpp-bin, $ORTKV_LLAMACPP_BENCH, the one
# benchmarks/llamacpp/build.sh left in the ortkv cache, else that script run from the ortkv checkout the
# command runs in (it fetches llama.cpp's prebuilt libraries and headers from npm, version pinned).
LLAMACPP_VERSION = "3.22.1"  # node-llama-cpp's, as benchmarks/llamacpp/fetch.sh pins it
CPU_GRID = {"prompt_tokens": [16], "new_tokens": [256], "max_length": [2048, 8192], "batch": [1, 4]}


def find_llamacpp(explicit: str | None, log=print) -> str:
    """The llama.cpp driver's path (Note [CPU baseline]), building it only as the last resort."""
    import subprocess

    from .assets import cache_dir

    for path, origin in ((explicit, "--llamacpp-bin"), (os.environ.get(LLAMACPP_ENV), f"${LLAMACPP_ENV}")):
        if path:
            if not os.access(path, os.X_OK):
                raise OrtkvError(f"{origin} {path}: no executable there; pass the llama_decode_bench that "
                                 "benchmarks/llamacpp/build.sh prints")
            return path
    built = cache_dir() / f"llamacpp-{LLAMACPP_VERSION}" / "lib" / "llama_decode_bench"
    if os.access(built, os.X_OK):
        return str(built)
    here = Path.cwd().resolve()
    script = next((d / "benchmarks" / "llamacpp" / "build.sh" for d in (here, *here.parents)
                   if (d / "benchmarks" / "llamacpp" / "build.sh").is_file()), None)
    if script is None:
        raise OrtkvError(f"no llama.cpp driver: {built} does not exist and {here} is not inside an ortkv checkout "
                         f"(benchmarks/llamacpp/build.sh builds one); pass --llamacpp-bin PATH or set {LLAMACPP_ENV}")
    log(f"ortkv bench: building the llama.cpp driver with {script} (npm fetch of node-llama-cpp {LLAMACPP_VERSION}) ...")
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        raise OrtkvError(f"{script} failed ({out.returncode}): {out.stderr.strip()[-300:]}; fix that or pass "
                         "--llamacpp-bin PATH")
    return out.stdout.strip().splitlines()[-1]


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def cpu_baseline(p, a) -> int:
    if a.device != "cpu":
        p.error("--cpu-baseline compares CPU decoding: leave --device out (or --device cpu)")
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: give 1 or more (3 for medians)")
    if a.threads is not None and a.threads < 1:
        p.error(f"--threads {a.threads}: give 1 or more")
    if a.variants and "ortkv-nograph" in a.variants:
        p.error("ortkv-nograph (the ortkv decoder without CUDA graph capture) needs --device cuda[:N]")
    for key, default in CPU_GRID.items():
        if getattr(a, key) is None:
            setattr(a, key, default)
    if a.quick:
        a.prompt_tokens, a.new_tokens, a.max_length, a.batch, a.repeats = [16], [64], [2048], [1], 1
    weights_list = list(dict.fromkeys(a.weights or ["q4"]))
    # one column per (runner, weights); named "ortkv q8" etc. when several weights run
    plain = list(a.variants or ["ortkv"])
    variants = [f"{v} {w}" if len(weights_list) > 1 else v for w in weights_list for v in plain]
    weights_of = {(f"{v} {w}" if len(weights_list) > 1 else v): (v, w) for w in weights_list for v in plain}
    weights = " ".join(weights_list)
    threads = a.threads or len(os.sched_getaffinity(0))
    exe = find_llamacpp(a.llamacpp_bin, log=lambda m: print(m, file=sys.stderr))
    from .models import build_models, gguf_path, tokenizer_for

    layout = {"ortkv.cache_layout": a.cache_layout} if a.cache_layout else {}
    for w in weights_list:
        cfg = GenAIConfig()
        cfg.ortkv.weights = w
        if a.cache_layout:
            cfg.ortkv.cache_layout = a.cache_layout
        cfg.validate()
        build_models(cfg, sorted({"genai" if v.startswith("genai") else v for v in plain}))  # once, before any timing
    tok = tokenizer_for(cfg)
    gguf = str(gguf_path(cfg))
    load0 = os.getloadavg()[0]
    cells = list(itertools.product(a.prompt_tokens, a.new_tokens, a.max_length, a.batch))
    rows = []
    for (pt, nt, ml, b) in _progress(cells, len(cells)):
        prompts = [prompt_ids(tok, pt, 1)[0]] * b  # one prompt, b rows (as the driver)
        runs = {v: [] for v in variants + ["llama.cpp"]}
        for rep in range(a.repeats):
            for v in variants + ["llama.cpp"]:
                if v == "llama.cpp":
                    r = run_llamacpp(gguf, pt, nt, ml, b, exe=exe, threads=threads)
                else:
                    runner, w = weights_of[v]
                    overrides = {"search.max_length": ml, "ortkv.max_new_tokens": nt, "ortkv.weights": w,
                                 "ortkv.intra_op_num_threads": threads, "ortkv.warmup": True, **layout}
                    try:
                        r = run_worker(runner, None, overrides, prompts)
                    except OrtkvError as exc:
                        r = {"error": str(exc).strip().splitlines()[-1][:300]}
                    for k in ("texts", "prompt_ids", "prompts", "rss_per_step", "kv_bytes_per_step"):
                        r.pop(k, None)
                runs[v].append(r)
                msg = (f"FAILED: {r['error']}" if "error" in r else f"decode {r['decode_tok_s']:8.1f} tok/s")
                print(f"  prompt {pt} new {nt} max_length {ml} batch {b} run {rep + 1}/{a.repeats} {v:<12} {msg}",
                      file=sys.stderr)
        rows.append({"prompt_tokens": pt, "new_tokens": nt, "max_length": ml, "batch": b, "runs": runs,
                     "median": {v: summarize(rs) for v, rs in runs.items()}})
    meta = {"weights": weights, "cache_layout": a.cache_layout or "default", "threads": threads, "repeats": a.repeats, "llamacpp_bin": exe, "gguf": gguf,
            "load_avg_start": load0, "load_avg_end": os.getloadavg()[0], "variants": variants}
    out = Path(a.out) / time.strftime("bench_cpu_%Y%m%d_%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cpu_llamacpp.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    table = markdown_cpu_baseline(rows, variants + ["llama.cpp"], meta)
    (out / "bench_cpu_llamacpp.md").write_text(table + "\n")
    print(table)
    print(f"\nwritten to {out}/")
    return 0


def summarize(runs: list[dict]) -> dict:
    """Medians of the successful runs (decode / prefill tok/s, ms per step), their count and the first error."""
    ok = [r for r in runs if "error" not in r]
    m = {"ok": len(ok), "of": len(runs)}
    if len(ok) < len(runs):
        m["error"] = next(r["error"] for r in runs if "error" in r)
    for key in ("decode_tok_s", "prefill_tok_s", "median_step_ms", "kv_bytes"):
        vals = [float(r[key]) for r in ok if r.get(key) is not None]
        if vals:
            m[key] = _median(vals)
    if ok:
        m["decode_runs"] = [float(r["decode_tok_s"]) for r in ok]
    return m


def markdown_cpu_baseline(rows, variants, meta) -> str:
    lines = [f"# ortkv bench --cpu-baseline llamacpp ({platform.node()}, {time.strftime('%Y-%m-%d %H:%M')})", "",
             f"ortkv weights {meta['weights']}, cache layout {meta.get('cache_layout', 'default')}, {meta['threads']} "
             f"threads for every variant, {meta['repeats']} "
             "alternating runs per variant and cell, medians; vs llama.cpp: the variant's median over llama.cpp's "
             f"(same GGUF); load average (1 min) {meta['load_avg_start']:.1f} at the start, "
             f"{meta['load_avg_end']:.1f} at the end", "",
             "| prompt | new | max_length | batch | variant | decode tok/s | vs llama.cpp | runs (decode tok/s) | "
             "ms/step | prefill tok/s | vs llama.cpp | KV bytes |",
             "|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for c in rows:
        base = c["median"]["llama.cpp"]
        for v in variants:
            m = c["median"][v]
            head = f"| {c['prompt_tokens']} | {c['new_tokens']} | {c['max_length']} | {c['batch']} | {v} | "
            if not m["ok"]:
                lines.append(head + f"failed: {m['error']} |" + " |" * 6)
                continue
            ratio = lambda k: f"{m[k] / base[k]:.2f}" if base.get(k) else "-"  # noqa: E731
            runs = ", ".join(f"{x:.1f}" for x in m["decode_runs"]) + ("" if m["ok"] == m["of"] else
                                                                      f" ({m['of'] - m['ok']} failed: {m['error']})")
            kv = f"{m['kv_bytes'] / 2**20:.1f} MiB" if "kv_bytes" in m else "-"
            step = f"{m['median_step_ms']:.2f}" if "median_step_ms" in m else "-"
            lines.append(head + f"{m['decode_tok_s']:.1f} | {ratio('decode_tok_s')} | {runs} | {step} | "
                         f"{m['prefill_tok_s']:.1f} | {ratio('prefill_tok_s')} | {kv} |")
    return "\n".join(lines)


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


def _cell(r: dict | None, key: str, fmt: str, scale: float = 1.0) -> str:
    if r is None or "error" in r or r.get(key) is None:
        return "-"
    return format(r[key] / scale, fmt)


def markdown_cuda(rows, variants, device: str) -> str:
    """The GPU table: decode / prefill tokens/s (all sequences) with the ratio to the better of GenAI
    share-buffer and llama.cpp, ms per step, KV committed vs live, peak device memory above the loaded
    model, and whether the greedy tokens equal GenAI share-buffer's."""
    lines = [f"# ortkv bench --device {device} ({platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}), float16", "",
             "ratio: decode tok/s over the better of genai-share and llama.cpp in the cell; committed/live: KV bytes "
             "resident over the bytes the tokens fill (genai-share preallocates max_length); same: greedy tokens "
             "equal to genai-share's", "",
             "| prompt | new | max_length | batch | variant | decode tok/s | ratio | ms/step (median) | prefill tok/s | "
             "KV committed | KV live | committed/live | peak device above load | same |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in rows:
        runs = c["runs"]
        best = max([runs[v]["decode_tok_s"] for v in ("genai-share", "llama.cpp")
                    if v in runs and "error" not in runs[v]] or [0.0])
        base = runs.get("genai-share", {})
        for v in variants:
            r = runs.get(v)
            head = f"| {c['prompt_tokens']} | {c['new_tokens']} | {c['max_length']} | {c['batch']} | {v} | "
            if r is None or "error" in r:
                lines.append(head + f"failed: {(r or {}).get('error', 'not run')} |" + " |" * 8)
                continue
            ratio = f"{r['decode_tok_s'] / best:.2f}" if best else "-"
            live, committed = r.get("kv_live_bytes"), r.get("kv_committed_bytes", r.get("kv_bytes"))
            frac = f"{committed / live:.2f}" if live and committed is not None else "-"
            same = ("yes" if r.get("new_ids") == base.get("new_ids") else "no") if "new_ids" in r and "new_ids" in base else "-"
            lines.append(head + f"{r['decode_tok_s']:.1f} | {ratio} | {_cell(r, 'median_step_ms', '.2f')} | "
                         f"{r['prefill_tok_s']:.1f} | {_cell(r, 'kv_committed_bytes', '.1f', 2**20)} MiB | "
                         f"{_cell(r, 'kv_live_bytes', '.1f', 2**20)} MiB | {frac} | "
                         f"{_cell(r, 'peak_device_above_load', '.1f', 2**20)} MiB | {same} |")
    return "\n".join(lines)


def plot_cuda(rows, variants, path: Path) -> None:
    """Decode tokens/s per cell and variant (left), KV committed per cell (right); skipped without matplotlib
    (the GPU machine may lack it: draw it elsewhere from bench_generate.json with plot_cuda)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (draw it later: python -c \"import json, pathlib; from "
              "ortkv.generate.bench import plot_cuda; d = pathlib.Path('DIR'); rows = json.loads((d / "
              "'bench_generate.json').read_text()); plot_cuda(rows, list(rows[0]['runs']), d / 'bench_generate.png')\")",
              file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5))
    labels = [f"p{c['prompt_tokens']}\nL{c['max_length']}\nb{c['batch']}" for c in rows]
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs = [k + i * width for k in range(len(rows))]
        ax1.bar(xs, [c["runs"].get(v, {}).get("decode_tok_s", 0) or 0 for c in rows], width, label=v)
        ax2.bar(xs, [(c["runs"].get(v, {}).get("kv_committed_bytes") or 0) / 2**20 for c in rows], width, label=v)
    for ax, ylabel in ((ax1, "decode tokens/s (all sequences)"), (ax2, "KV committed (MiB)")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rows))], labels, fontsize=6)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    ax1.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
