"""Where one decode step of the ortkv SmolLM2 decoder spends its time on the CPU (issue 12): ORT's own
profile of N steps, per op type (nodes per step, kernel time per step), and the gap between the step's
wall time and the sum of its kernels (ORT's per-node framework overhead plus the Python session wrapper).

    python benchmarks/profile_decode.py [--weights float32,q4] [--steps 64] [--out FILE]
                                        [--build-tags v2,v3 --rounds 3]
    python benchmarks/profile_decode.py --floor --weights q8,q4 --rounds 5 [--threads 2] [--steps 128]
    python benchmarks/profile_decode.py --options "base;session.intra_op.allow_spinning=0" --weights float32
                                        --rounds 5 [--threads 2] [--steps 128]
    python benchmarks/profile_decode.py --greedy-cost [--rounds 7]

--floor splits an UNPROFILED decode step (the profiler adds ~14 us per node, which inflates a 600-node step
~1.7x): the wall time of runner.step(), ORT's run inside it (run_with_iobinding, timed), and the time of the
decoder's MatMulNBits nodes alone (a session holding only them and their weights, fed one token's
activations: the floor that MLAS's kernels set). ORT run - floor is every other node plus ORT's gaps between
nodes; wall - ORT run is the Python around the run (session wrapper, output binding). One session lives at a
time (two sessions alive in one process ran ~5-8 % apart even on one decoder), alternating per round.

--options A/B-tests session options on the decoder, unprofiled: variants separated by ";", each "base" or
comma-separated KEY=VALUE session config entries (SessionOptions.add_session_config_entry), plus opt_level=
BASIC|EXTENDED|ALL (graph_optimization_level) and inter_op=N (inter_op_num_threads); one child process per
variant and round (one untimed generation, then --steps decode steps), the variants alternating within each
round; reported: the median step wall / ORT run per variant and the median over rounds of each round's ratio
to base (the fairer figure: the VM's bandwidth moves between rounds, much less within one).

--greedy-cost measures what Note [Greedy in the decoder]'s nodes would cost a float32 CPU step: a session of
an Identity [1, 1, V] -> logits, with and without the greedy nodes (Slice, ArgMax, IsNaN, Cast, Pad, ArgMax,
Concat, as builder.py makes them), against the numpy greedy pick (Sampler) on the logits; alternating.

--build-tags profiles the decoders cached under each build tag (models.BUILD_TAG's last part: v2 is the
graph before Note [Fused decoder layer], v3 after; a missing one is built by THIS ortkv's builder, so an
old tag is only "before" where an older ortkv cached it), alternating the tags --rounds times, and reports
each tag's nodes per step, per-op kernel time and the median step times over the rounds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import ortkv
from ortkv.generate import models, runners
from ortkv.generate.cli import apply_overrides
from ortkv.generate.config import GenAIConfig

from _report import emit, greedy_steps, timed_decode  # benchmarks/ is on sys.path when a script runs

PROMPT_IDS = [1, 9690, 2409, 253, 655, 28, 665, 588, 253, 1165, 8325, 653]  # any in-vocabulary ids


def _ortkv_runner(cfg, adjust):
    """The ortkv runner of cfg, its session options changed by adjust(so) (runners._session_options
    is wrapped while the runner is made, then restored)."""
    plain = runners._session_options

    def adjusted(c, *args, **kwargs):  # (cfg, path, owner): Note [Weights on huge pages]
        so = plain(c, *args, **kwargs)
        adjust(so)
        return so

    runners._session_options = adjusted
    try:
        return runners.make_runner("ortkv", cfg, log=lambda *a: None)
    finally:
        runners._session_options = plain


def profile(weights: str, steps: int, prefix: str, tag: str | None = None) -> dict:
    cfg = apply_overrides(GenAIConfig(), {"ortkv.weights": weights})
    saved_tag = models.BUILD_TAG
    if tag is not None:
        models.BUILD_TAG = "smollm2-135m-{weights}-" + tag
        if not models.model_path(cfg, "ortkv", log=lambda *a: None).exists():
            raise SystemExit(f"no decoder for build tag {tag}")

    def profiled(so):
        so.enable_profiling = True
        so.profile_file_prefix = prefix

    try:
        r = _ortkv_runner(cfg, profiled)
    finally:
        models.BUILD_TAG = saved_tag
    walls = greedy_steps(r, PROMPT_IDS, steps, time.perf_counter)
    trace = json.loads(Path(r.sess.session.end_profiling()).read_text())
    r.close()
    runs = [e for e in trace if e.get("cat") == "Session" and e["name"] == "model_run"]
    kernels = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    # the decode steps are the last `steps` model runs; keep their kernels
    first = runs[-steps]["ts"]
    kernels = [e for e in kernels if e["ts"] >= first]
    per_op = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        per_op[e["args"]["op_name"]][0] += 1
        per_op[e["args"]["op_name"]][1] += e["dur"]
    providers = collections.Counter(e["args"]["provider"] for e in kernels)
    run_us = float(np.median([e["dur"] for e in runs[-steps:]]))
    return {"weights": weights, "steps": steps, "wall_ms": 1e3 * float(np.median(walls)), "run_us": run_us,
            "kernel_us": sum(v[1] for v in per_op.values()) / steps, "nodes": len(kernels) / steps,
            "per_op": {k: (v[0] / steps, v[1] / steps) for k, v in per_op.items()}, "providers": dict(providers)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="float32,q4")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out")
    ap.add_argument("--build-tags", help="e.g. v2,v3: before / after, alternating (see above)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the build tags (medians over them)")
    ap.add_argument("--floor", action="store_true", help="unprofiled step split: wall, ORT run, MatMulNBits alone")
    ap.add_argument("--threads", type=int, default=2, help="--floor: intra_op_num_threads")
    ap.add_argument("--options", help='A/B of session options: "base;KEY=VALUE,KEY=VALUE;..." (see above)')
    ap.add_argument("--options-child", help=argparse.SUPPRESS)
    ap.add_argument("--greedy-cost", action="store_true", help="the greedy nodes' cost on the CPU vs numpy's pick")
    a = ap.parse_args()
    if a.options_child is not None:
        print(json.dumps(options_child(a.weights, a.options_child, a.threads, a.steps)))
        return 0
    if a.options:
        return options(a)
    if a.greedy_cost:
        return greedy_cost(a)
    if a.build_tags:
        return compare(a)
    if a.floor:
        return floor(a)
    report = [f"# One ortkv decode step, profiled (SmolLM2-135M, batch 1, CPU, {os.cpu_count()} CPUs, "
              f"{time.strftime('%Y-%m-%d %H:%M')})", "",
              f"command: `python benchmarks/profile_decode.py --weights {a.weights} --steps {a.steps}`; "
              "medians / means over the decode steps after a 12-token prefill; times from ORT's profiler "
              "(enable_profiling), wall from Python around runner.step().", ""]
    with tempfile.TemporaryDirectory() as tmp:
        for w in a.weights.split(","):
            p = profile(w, a.steps, str(Path(tmp) / w))
            gap = p["run_us"] - p["kernel_us"]
            report += [f"## weights {w}", "",
                       f"step wall {p['wall_ms']:.2f} ms (Python + session wrapper + ORT run); ORT model_run "
                       f"{p['run_us'] / 1e3:.2f} ms; kernels {p['kernel_us'] / 1e3:.2f} ms in {p['nodes']:.0f} "
                       f"nodes; ORT's overhead between kernels {gap / 1e3:.2f} ms ({100 * gap / p['run_us']:.0f} % "
                       f"of the run, {gap / max(p['nodes'], 1):.1f} us per node); outside ORT "
                       f"{p['wall_ms'] - p['run_us'] / 1e3:.2f} ms. Providers: {p['providers']}.", "",
                       "| op type | nodes per step | kernel us per step | share of kernel time |", "|---|---:|---:|---:|"]
            for op, (n, us) in sorted(p["per_op"].items(), key=lambda kv: -kv[1][1]):
                report.append(f"| {op} | {n:.0f} | {us:.0f} | {100 * us / p['kernel_us']:.1f} % |")
            report.append("")
    report.append(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min)")
    return emit("\n".join(report), a.out)


def compare(a) -> int:
    tags = a.build_tags.split(",")
    report = [f"# ortkv decode step, build tags {', '.join(tags)} alternated {a.rounds} round(s) (SmolLM2-135M, "
              f"batch 1, CPU, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')})", "",
              f"command: `python benchmarks/profile_decode.py --weights {a.weights} --steps {a.steps} --build-tags "
              f"{a.build_tags} --rounds {a.rounds}`; per round and tag: {a.steps} decode steps after a 12-token "
              "prefill, ORT's profiler on; the step times are medians over the steps, then over the rounds "
              f"(1-minute load average at the start: {os.getloadavg()[0]:.1f})", ""]
    with tempfile.TemporaryDirectory() as tmp:
        for w in a.weights.split(","):
            runs = {t: [] for t in tags}
            for k in range(a.rounds):
                for t in tags:
                    runs[t].append(profile(w, a.steps, str(Path(tmp) / f"{w}_{t}_{k}"), t))
            report += [f"## weights {w}", "", "| tag | nodes per step | ORT run ms (median) | kernels ms | gap ms | "
                       "step wall ms (median) | decode tok/s (1 / wall) | wall per round |", "|---|---:|---:|---:|---:|---:|---:|---|"]
            for t in tags:
                rs = runs[t]
                wall = float(np.median([r["wall_ms"] for r in rs]))
                run = float(np.median([r["run_us"] for r in rs])) / 1e3
                kern = float(np.median([r["kernel_us"] for r in rs])) / 1e3
                report.append(f"| {t} | {rs[0]['nodes']:.0f} | {run:.2f} | {kern:.2f} | {run - kern:.2f} | {wall:.2f} | "
                              f"{1e3 / wall:.1f} | {', '.join(format(r['wall_ms'], '.1f') for r in rs)} |")
            report.append("")
            ops = sorted({op for t in tags for op in runs[t][0]["per_op"]},
                         key=lambda op: -max(runs[t][0]["per_op"].get(op, (0, 0))[1] for t in tags))
            report += ["| op type | " + " | ".join(f"{t} nodes | {t} us/step" for t in tags) + " |",
                       "|---|" + "---:|---:|" * len(tags)]
            for op in ops:
                cells = []
                for t in tags:
                    n = [r["per_op"].get(op, (0, 0.0)) for r in runs[t]]
                    cells.append(f"{n[0][0]:.0f} | {float(np.median([x[1] for x in n])):.0f}")
                report.append(f"| {op} | " + " | ".join(cells) + " |")
            report.append("")
    report.append(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min)")
    return emit("\n".join(report), a.out)


def _matmulnbits_only(path: Path):
    """(serialized model of the decoder's MatMulNBits nodes alone, one input per K, every output returned;
    feeds: one token's activations per K)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper

    m = onnx.load(str(path))  # with its external data: the weights are the decoder's own
    inits = {t.name: t for t in m.graph.initializer}
    nodes, used, ins, outs = [], [], {}, []
    for n in m.graph.node:
        if n.op_type not in ("MatMulNBits", "MatMulQ4"):  # MatMulQ4: the q4 projections (Note [Fast 4-bit path])
            continue
        K = next(a.i for a in n.attribute if a.name == "K")
        ins.setdefault(K, helper.make_tensor_value_info(f"x{K}", TP.FLOAT, [1, 1, K]))
        node = helper.make_node(n.op_type, [f"x{K}", *n.input[1:]], [n.output[0]], name=n.name, domain=n.domain)
        node.attribute.extend(n.attribute)
        nodes.append(node)
        used += [i for i in n.input[1:] if i in inits and i not in used]
        outs.append(helper.make_tensor_value_info(n.output[0], TP.FLOAT, None))
    graph = helper.make_graph(nodes, "matmulnbits_only", list(ins.values()), outs, [inits[u] for u in used])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid("ortkv", 1)], ir_version=m.ir_version)
    rng = np.random.default_rng(0)
    feeds = {f"x{K}": rng.standard_normal((1, 1, K)).astype(np.float32) for K in ins}
    return model.SerializeToString(), feeds, len(nodes)


def floor(a) -> int:
    import onnxruntime as ort

    report = [f"# ortkv decode step without the profiler: wall, ORT run, MatMulNBits alone (SmolLM2-135M, batch 1, "
              f"CPU, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')})", "",
              f"command: `python benchmarks/profile_decode.py --floor --weights {a.weights} --rounds {a.rounds} "
              f"--threads {a.threads} --steps {a.steps}`; per round: the decoder ({a.steps} decode steps after a "
              f"12-token prefill, one untimed generation first), then its MatMulNBits / MatMulQ4 nodes alone ({a.steps} runs "
              "after 10 untimed), each in its own session, closed before the next; per round the medians, then the "
              f"median over the rounds. 1-minute load average at the start: {os.getloadavg()[0]:.1f}", "",
              "| weights | MatMulNBits / MatMulQ4 nodes | step wall ms | ORT run ms | those nodes alone ms | other nodes + ORT's gaps "
              "ms | Python around the run ms | wall per round |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for w in a.weights.split(","):
        cfg = apply_overrides(GenAIConfig(), {"ortkv.weights": w, "ortkv.intra_op_num_threads": a.threads})
        path = models.model_path(cfg, "ortkv", log=lambda *x: None)
        only, feeds, n_mm = _matmulnbits_only(path)
        walls, runs, floors = [], [], []
        ids = np.array([PROMPT_IDS], np.int64)
        for _ in range(a.rounds):
            r = runners.make_runner("ortkv", cfg, log=lambda *x: None)
            sess, ort_s = r.sess.session, []
            run = sess.run_with_iobinding

            def timed(io, run_options=None, run=run, ort_s=ort_s):
                t = time.perf_counter()
                run(io, run_options)
                ort_s.append(time.perf_counter() - t)

            sess.run_with_iobinding = timed
            for timed_pass in (False, True):
                r.start(1, 2048)
                logits = r.prefill(ids, np.array([ids.shape[1]], np.int64))
                ort_s.clear()
                wall = []
                for _ in range(a.steps):
                    nxt = np.array([int(np.argmax(logits[0]))], np.int64)
                    t = time.perf_counter()
                    logits = r.step(nxt)
                    wall.append(time.perf_counter() - t)
            r.close()
            walls.append(1e3 * float(np.median(wall)))
            runs.append(1e3 * float(np.median(ort_s)))
            so = ort.SessionOptions()
            so.register_custom_ops_library(ortkv.get_library_path())  # MatMulQ4
            so.intra_op_num_threads = a.threads
            so.log_severity_level = 3
            s = ort.InferenceSession(only, so, providers=["CPUExecutionProvider"])
            for _ in range(10):
                s.run(None, feeds)
            fl = []
            for _ in range(a.steps):
                t = time.perf_counter()
                s.run(None, feeds)
                fl.append(time.perf_counter() - t)
            del s
            floors.append(1e3 * float(np.median(fl)))
        wall, run, fl = (float(np.median(x)) for x in (walls, runs, floors))
        report.append(f"| {w} | {n_mm} | {wall:.2f} | {run:.2f} | {fl:.2f} | {run - fl:.2f} | {wall - run:.2f} | "
                      f"{', '.join(f'{x:.1f}' for x in walls)} |")
    report += ["", "MatMulNBits alone also returns every output to Python (121 small arrays, ~0.1 ms): the floor is "
               "a little high, the \"other nodes\" column a little low.", "",
               f"load average at the end: {os.getloadavg()[0]:.1f} (1 min)"]
    return emit("\n".join(report), a.out)


def _apply_variant(so, variant: str) -> None:
    import onnxruntime as ort

    if variant == "base":
        return
    for entry in variant.split(","):
        key, value = entry.split("=", 1)
        if key == "opt_level":
            so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, f"ORT_ENABLE_{value}")
        elif key == "inter_op":
            so.inter_op_num_threads = int(value)
        else:
            so.add_session_config_entry(key, value)


def options_child(weights: str, variant: str, threads: int, steps: int) -> dict:
    """One decoder session with the variant's options: (median step wall ms, median ORT run ms, tokens)."""
    cfg = apply_overrides(GenAIConfig(), {"ortkv.weights": weights, "ortkv.intra_op_num_threads": threads})
    r = _ortkv_runner(cfg, lambda so: _apply_variant(so, variant))
    wall, ort_s, toks = timed_decode(r, PROMPT_IDS, steps)
    r.close()
    return {"wall": 1e3 * float(np.median(wall)), "run": 1e3 * float(np.median(ort_s)), "tokens": toks}


def options(a) -> int:
    import subprocess

    variants = a.options.split(";")
    if variants[0] != "base":
        variants.insert(0, "base")
    load0 = os.getloadavg()[0]
    res = {v: [] for v in variants}
    for k in range(a.rounds):
        for v in variants:
            cmd = [sys.executable, os.path.abspath(__file__), "--options-child", v, "--weights", a.weights.split(",")[0],
                   "--threads", str(a.threads), "--steps", str(a.steps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            res[v].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {k + 1} {v}: wall {res[v][-1]['wall']:.2f} ms", file=sys.stderr)
    base = res["base"]
    report = [f"# Session options A/B, decode step unprofiled ({a.weights.split(',')[0]}, batch 1, {a.threads} threads, "
              f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')})", "",
              f"command: `python benchmarks/profile_decode.py --options \"{a.options}\" --weights {a.weights} --rounds "
              f"{a.rounds} --threads {a.threads} --steps {a.steps}`; per round and variant one child process: one "
              f"untimed generation, then {a.steps} decode steps after a 12-token prefill (medians); variants "
              f"alternate within a round. 1-minute load average at the start: {load0:.1f}", "",
              "| variant | step wall ms (median over rounds) | ORT run ms | wall / base (median of per-round ratios) | "
              "walls per round | greedy tokens as base |", "|---|---:|---:|---:|---|---|"]
    for v in variants:
        rs = res[v]
        ratio = float(np.median([x["wall"] / b["wall"] for x, b in zip(rs, base)]))
        same = all(x["tokens"] == base[0]["tokens"] for x in rs)
        report.append(f"| {v} | {np.median([x['wall'] for x in rs]):.2f} | {np.median([x['run'] for x in rs]):.2f} | "
                      f"{ratio:.3f} | {', '.join(format(x['wall'], '.1f') for x in rs)} | {'yes' if same else 'NO'} |")
    report += ["", f"load average at the end: {os.getloadavg()[0]:.1f} (1 min)"]
    return emit("\n".join(report), a.out)


def _greedy_model(greedy: bool, V: int) -> bytes:
    """Identity [1, 1, V] -> logits, plus (greedy) the greedy nodes of Note [Greedy in the decoder] in builder.py."""
    from onnx import TensorProto as TP
    from onnx import helper

    nodes = [helper.make_node("Identity", ["x"], ["logits"])]
    outs = [helper.make_tensor_value_info("logits", TP.FLOAT, [1, 1, V])]
    inits = []
    if greedy:
        inits = [helper.make_tensor("last", TP.INT64, [1], [-1]), helper.make_tensor("end", TP.INT64, [1], [2 ** 62]),
                 helper.make_tensor("axis1", TP.INT64, [1], [1]),
                 helper.make_tensor("pads", TP.INT64, [6], [0, 0, 0, 0, 0, 1]),
                 helper.make_tensor("half", TP.FLOAT, [], [0.5])]
        nodes += [helper.make_node("Slice", ["logits", "last", "end", "axis1"], ["lastpos"]),
                  helper.make_node("ArgMax", ["lastpos"], ["pick"], axis=2, keepdims=0, select_last_index=0),
                  helper.make_node("IsNaN", ["lastpos"], ["isnan"]),
                  helper.make_node("Cast", ["isnan"], ["isnan_f"], to=TP.FLOAT),
                  helper.make_node("Pad", ["isnan_f", "pads", "half"], ["padded"], mode="constant"),
                  helper.make_node("ArgMax", ["padded"], ["nan"], axis=2, keepdims=0, select_last_index=0),
                  helper.make_node("Concat", ["pick", "nan"], ["greedy"], axis=1)]
        outs.append(helper.make_tensor_value_info("greedy", TP.INT64, [1, 2]))
    g = helper.make_graph(nodes, "greedy_cost", [helper.make_tensor_value_info("x", TP.FLOAT, [1, 1, V])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


def greedy_cost(a) -> int:
    import onnxruntime as ort

    from ortkv.generate.loop import Sampler

    cfg = GenAIConfig()
    V = cfg.model.vocab_size
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.log_severity_level = 3
    x = np.random.default_rng(0).standard_normal((1, 1, V)).astype(np.float32)
    sess = {g: ort.InferenceSession(_greedy_model(g, V), so, providers=["CPUExecutionProvider"]) for g in (False, True)}
    pick = Sampler(cfg.search)
    load0 = os.getloadavg()[0]
    res = {False: [], True: []}
    for _ in range(max(a.rounds, 3)):
        for g in (False, True):
            s = sess[g]
            io = s.io_binding()
            io.bind_cpu_input("x", x)
            ts = []
            for _ in range(300):
                t = time.perf_counter()
                io.bind_output("logits", "cpu")
                if g:
                    io.bind_output("greedy", "cpu")
                s.run_with_iobinding(io)
                outs = io.get_outputs_as_ortvaluevector()
                tok = int(outs[1].numpy()[0, 0]) if g else int(pick(outs[0].numpy()[:, -1])[0])
                ts.append(time.perf_counter() - t)
            res[g].append(1e6 * float(np.median(ts)))
    assert tok == int(np.argmax(x))
    plain, greedy = float(np.median(res[False])), float(np.median(res[True]))
    report = [f"# The greedy nodes on the CPU vs numpy's pick ({a.threads} threads, V = {V}, "
              f"{time.strftime('%Y-%m-%d %H:%M')})", "",
              f"command: `python benchmarks/profile_decode.py --greedy-cost --rounds {a.rounds} --threads {a.threads}`; "
              "per round 300 runs of each session, alternating, medians; 1-minute load average at the start: "
              f"{load0:.1f}", "",
              "| per step | us (median over rounds) | per round |", "|---|---:|---|",
              f"| logits out + numpy greedy pick (Sampler: NaN check + argmax) | {plain:.1f} | "
              f"{', '.join(format(v, '.1f') for v in res[False])} |",
              f"| logits out + the greedy nodes in the graph, pick read from [1, 2] int64 | {greedy:.1f} | "
              f"{', '.join(format(v, '.1f') for v in res[True])} |",
              f"| the greedy nodes' net cost | {greedy - plain:+.1f} | |", "",
              f"load average at the end: {os.getloadavg()[0]:.1f} (1 min)"]
    return emit("\n".join(report), a.out)


if __name__ == "__main__":
    sys.exit(main())
