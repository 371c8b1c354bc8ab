"""CUDA CacheAttention decode against the GPU's measured device-to-device copy bandwidth, side by side
with com.microsoft.GroupQueryAttention on the same shapes, with ORT only (no torch, no cupy).

  copy      : an ORT Identity node on the CUDA EP copying a 1 GiB float16 buffer into another one
              (cudaMemcpyAsync D2D inside ORT), counted as bytes read + written per call.
  attention : R nodes of one kind in one model, each over its own cache pair, so one call reads
              R pairs one after the other like a model's layers (R chosen so that the pairs hold
              >= 256 MiB: the K/V come from HBM, not from the 50 MB L2). Decode: one new token per row,
              every row holding L keys (start = L - 1). GB/s = bytes of K and V read per node
              (2 * B * Hkv * L * D * 2) / time per node.
                ortkv : ortkv CacheAttention (seq_axis 1, BSNH caches [B, L, Hkv, D]).
                gqa   : com.microsoft.GroupQueryAttention, BNSH past/present bound to ONE buffer of
                        L tokens (GenAI's share-buffer decode: seqlens_k = L - 1, the new key/value
                        written at slot L - 1 by the op).
  Every session runs with enable_cuda_graph=1 (ORT captures the whole call once and replays it), so
  the figures are GPU time plus one replay + synchronization per call, not per-node launch cost.
  Each figure is the median over --rounds rounds (the kinds alternate inside a round) of the median
  of --reps timed calls after a warm-up.

    python benchmarks/bench_cache_attention_cuda.py [--rounds 3] [--reps 20]
                                                    [--out benchmarks/results/cache_attention_cuda.md]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit  # noqa: E402

import ortkv  # noqa: E402
from ortkv.graph import make_cache_attention  # noqa: E402

HEADS = [(9, 3, 64), (32, 8, 128)]  # SmolLM2-135M; a Llama-8B-like layer
LENGTHS = [1024, 8192, 32768, 131072]
BATCHES = [1, 8, 64]
POOL_BYTES = 256 << 20


def _model(nodes, inputs, outputs):
    g = helper.make_graph(nodes, "bench", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1),
                                               helper.make_opsetid("com.microsoft", 1)], ir_version=10)


def _session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.register_custom_ops_library(ortkv.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])


def _dev(shape, dtype=np.float16, value=None):
    import onnxruntime as ort

    if value is not None:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), "cuda", 0)
    return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, "cuda", 0)


def _time(sess, io, reps):
    for _ in range(3):  # ORT's warm-up run, the capture, one replay
        sess.run_with_iobinding(io)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_case(nbytes=1 << 30):
    n = nbytes // 2
    model = _model([helper.make_node("Identity", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TP.FLOAT16, [n])],
                   [helper.make_tensor_value_info("y", TP.FLOAT16, [n])])
    sess = _session(model)
    x, y = _dev([n]), _dev([n])
    io = sess.io_binding()
    io.bind_ortvalue_input("x", x)
    io.bind_ortvalue_output("y", y)
    return lambda reps: 2 * nbytes / _time(sess, io, reps), (x, y, sess)


def attention_case(kind, Hq, Hkv, D, L, B):
    pair = 2 * B * L * Hkv * D * 2
    R = max(1, min(16, math.ceil(POOL_BYTES / pair)))
    nodes, ins, outs, keep = [], [], [], []
    q = _dev(None, value=np.random.default_rng(0).standard_normal((B, 1, Hq * D)).astype(np.float16))
    feeds = {"q": q}
    ins.append(helper.make_tensor_value_info("q", TP.FLOAT16, [B, 1, Hq * D]))
    if kind == "ortkv":
        feeds["start"] = _dev(None, value=np.full(B, L - 1, np.int64))
        ins.append(helper.make_tensor_value_info("start", TP.INT64, [B]))
        for i in range(R):
            nodes.append(make_cache_attention("q", f"k{i}", f"v{i}", "start", f"o{i}", name=f"a{i}", num_heads=Hq,
                                              kv_num_heads=Hkv, seq_axis=1))
            for c in "kv":
                ins.append(helper.make_tensor_value_info(f"{c}{i}", TP.FLOAT16, [B, L, Hkv, D]))
                feeds[f"{c}{i}"] = _dev([B, L, Hkv, D])
            outs.append(helper.make_tensor_value_info(f"o{i}", TP.FLOAT16, [B, 1, Hq * D]))
    else:
        feeds["kn"] = _dev(None, value=np.zeros((B, 1, Hkv * D), np.float16))
        feeds["seqlens_k"] = _dev(None, value=np.full(B, L - 1, np.int32))
        ins += [helper.make_tensor_value_info("kn", TP.FLOAT16, [B, 1, Hkv * D]),
                helper.make_tensor_value_info("seqlens_k", TP.INT32, [B]),
                helper.make_tensor_value_info("total_len", TP.INT32, [])]
        for i in range(R):
            nodes.append(helper.make_node("GroupQueryAttention", ["q", "kn", "kn", f"pk{i}", f"pv{i}", "seqlens_k",
                                                                  "total_len"], [f"o{i}", f"pk{i}_out", f"pv{i}_out"],
                                          domain="com.microsoft", name=f"g{i}", num_heads=Hq, kv_num_heads=Hkv))
            for c in ("pk", "pv"):
                ins.append(helper.make_tensor_value_info(f"{c}{i}", TP.FLOAT16, [B, Hkv, L, D]))
                outs.append(helper.make_tensor_value_info(f"{c}{i}_out", TP.FLOAT16, [B, Hkv, L, D]))
                feeds[f"{c}{i}"] = _dev([B, Hkv, L, D])
            outs.append(helper.make_tensor_value_info(f"o{i}", TP.FLOAT16, [B, 1, Hq * D]))
    sess = _session(_model(nodes, ins, outs))
    io = sess.io_binding()
    for name, value in feeds.items():
        io.bind_ortvalue_input(name, value)
    if kind == "gqa":
        io.bind_cpu_input("total_len", np.array(L, np.int32))
        for i in range(R):
            io.bind_ortvalue_output(f"pk{i}_out", feeds[f"pk{i}"])  # share-buffer: present IS past
            io.bind_ortvalue_output(f"pv{i}_out", feeds[f"pv{i}"])
    for i in range(R):
        o = _dev([B, 1, Hq * D])
        keep.append(o)
        io.bind_ortvalue_output(f"o{i}", o)
    keep += [feeds, sess]
    return lambda reps: pair * R / _time(sess, io, reps), (R, keep)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--max-gib", type=float, default=60.0, help="skip shapes whose R cache pairs exceed this")
    ap.add_argument("--out")
    args = ap.parse_args()
    import onnxruntime as ort

    copy_fn, copy_keep = copy_case()
    copies = [copy_fn(args.reps) for _ in range(args.rounds)]
    copy_bw = statistics.median(copies)
    rows = []
    for Hq, Hkv, D in HEADS:
        for L in map(int, args.lengths.split(",")):
            for B in map(int, args.batches.split(",")):
                pair = 2 * B * L * Hkv * D * 2
                if pair * max(1, min(16, math.ceil(POOL_BYTES / pair))) > args.max_gib * (1 << 30):
                    rows.append((Hq, Hkv, D, L, B, None, None, "skipped: too large"))
                    continue
                res = {"ortkv": [], "gqa": []}
                note = ""
                fns = {}
                for kind in ("ortkv", "gqa"):
                    try:
                        fns[kind] = attention_case(kind, Hq, Hkv, D, L, B)
                    except Exception as exc:  # noqa: BLE001 - reported in the table
                        note += f"{kind}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} "
                for _ in range(args.rounds):
                    for kind, (fn, _) in fns.items():
                        try:
                            res[kind].append(fn(args.reps))
                        except Exception as exc:  # noqa: BLE001
                            note += f"{kind}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} "
                            fns = {k: v for k, v in fns.items() if k != kind}
                            break
                fns.clear()
                med = {k: statistics.median(v) if v else None for k, v in res.items()}
                rows.append((Hq, Hkv, D, L, B, med["ortkv"], med["gqa"], note.strip()))
                print(rows[-1], flush=True)
    lines = [f"# CUDA CacheAttention decode vs device-to-device copy ({ort.__version__}, float16, BSNH)", "",
             "Command: `python benchmarks/bench_cache_attention_cuda.py "
             f"--rounds {args.rounds} --reps {args.reps}` (CUDA graph replays; see the script's docstring).", "",
             f"Device-to-device copy (ORT Identity, 1 GiB, read + write): **{copy_bw / 1e9:.0f} GB/s** "
             f"(rounds: {', '.join(f'{c / 1e9:.0f}' for c in copies)}).", "",
             "| Hq/Hkv/D | keys L | batch | ortkv GB/s | ortkv / copy | GQA GB/s | GQA / copy | ortkv / GQA | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for Hq, Hkv, D, L, B, a, g, note in rows:
        f = lambda x: f"{x / 1e9:.0f}" if x else "-"  # noqa: E731
        r = lambda x: f"{x / copy_bw:.0%}" if x else "-"  # noqa: E731
        lines.append(f"| {Hq}/{Hkv}/{D} | {L} | {B} | {f(a)} | {r(a)} | {f(g)} | {r(g)} | "
                     f"{(a / g):.2f} |" if a and g else
                     f"| {Hq}/{Hkv}/{D} | {L} | {B} | {f(a)} | {r(a)} | {f(g)} | {r(g)} | - |")
        lines[-1] += f" {note} |"
    del copy_keep
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
