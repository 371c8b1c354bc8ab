"""CUDA PagedCacheAttention decode per page format against dense CUDA CacheAttention on the same tokens,
with ORT only (no torch, no cupy). SmolLM2-135M heads (9 query / 3 KV heads of 64), float16 queries.

  dense : ortkv CacheAttention over BSNH float16 caches [B, L, 3, 64] (start = L - 1).
  F16 / INT8 / INT4 : ortkv PagedCacheAttention over one pool of pages of that format (pages of 16
          tokens, page ids shuffled so that consecutive pages are not adjacent in the pool).
R nodes of one kind in one model, each over its own cache / pool, so one call reads R caches one after the
other (R chosen so that they hold >= 256 MiB of F16 bytes: K/V come from HBM, not from L2). Sessions run
with enable_cuda_graph=1. Each figure is the median over --rounds rounds (the kinds alternate inside a
round) of the median of --reps timed calls after a warm-up; the time per node is the call time / R.
com.microsoft.PagedAttention is not measured here yet (its schema in onnxruntime-gpu 1.31 was not checked).

    python benchmarks/bench_paged_attention_cuda.py [--rounds 3] [--reps 20]
                                                    [--out benchmarks/results/paged_attention_cuda.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from onnx import TensorProto as TP
from onnx import helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ortkv  # noqa: E402
from ortkv.graph import make_cache_attention  # noqa: E402
from ortkv.reference.codecs import PageFormat, encode_page, layout  # noqa: E402

HQ, HKV, D, PS = 9, 3, 64, 16
LENGTHS = [8192, 32768]
BATCHES = [1, 8]
FORMATS = [PageFormat.F16, PageFormat.INT8, PageFormat.INT4]
TARGET_BYTES = 256 << 20


def _model(nodes, inputs, outputs):
    g = helper.make_graph(nodes, "bench", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def _session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.register_custom_ops_library(ortkv.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])


def _dev(arr):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), "cuda", 0)


def _reps(B, L):
    per = 2 * B * L * HKV * D * 2
    return max(1, min(64, TARGET_BYTES // per))


def dense_case(rng, B, L, R):
    vi = helper.make_tensor_value_info
    nodes, inputs = [], [vi("q", TP.FLOAT16, [B, 1, HQ * D]), vi("start", TP.INT64, [B])]
    outs, feeds = [], {}
    for r in range(R):
        nodes.append(make_cache_attention("q", f"k{r}", f"v{r}", "start", f"o{r}", name=f"a{r}", num_heads=HQ,
                                          kv_num_heads=HKV, seq_axis=1))
        inputs += [vi(f"k{r}", TP.FLOAT16, [B, L, HKV, D]), vi(f"v{r}", TP.FLOAT16, [B, L, HKV, D])]
        outs.append(vi(f"o{r}", TP.FLOAT16, [B, 1, HQ * D]))
        kv = rng.standard_normal((B, L, HKV, D)).astype(np.float16)
        feeds[f"k{r}"] = feeds[f"v{r}"] = kv
    feeds["q"] = rng.standard_normal((B, 1, HQ * D)).astype(np.float16)
    feeds["start"] = np.full(B, L - 1, np.int64)
    return _model(nodes, inputs, outs), feeds, [o.name for o in outs]


def paged_case(rng, B, L, R, fmt):
    """One pool per node; every row L tokens over shuffled pages of `fmt` (the pages' bytes are one encoded
    random page repeated: the decode work is the same for any bytes)."""
    vi = helper.make_tensor_value_info
    n_pages = B * (L // PS)
    pb = layout(fmt, HKV, PS, D).page_bytes
    page = encode_page(fmt, rng.standard_normal((2, HKV, PS, D)).astype(np.float32))
    directory = np.stack([np.full(n_pages, int(fmt), np.int64), np.arange(n_pages, dtype=np.int64) * pb], axis=1)
    table = rng.permutation(n_pages).astype(np.int32).reshape(B, L // PS)
    nodes, inputs, outs, feeds = [], [vi("q", TP.FLOAT16, [B, 1, HQ * D]), vi("start", TP.INT64, [B]),
                                      vi("directory", TP.INT64, [n_pages, 2]), vi("table", TP.INT32, [B, L // PS])], [], {}
    for r in range(R):
        nodes.append(helper.make_node("PagedCacheAttention", ["q", f"pool{r}", "directory", "table", "start"], [f"o{r}"],
                                      name=f"a{r}", domain="ortkv", num_heads=HQ, kv_num_heads=HKV, layer=0,
                                      num_layers=1, page_size=PS))
        inputs.append(vi(f"pool{r}", TP.UINT8, [n_pages * pb]))
        outs.append(vi(f"o{r}", TP.FLOAT16, [B, 1, HQ * D]))
        feeds[f"pool{r}"] = np.tile(page, n_pages)
    feeds.update(q=rng.standard_normal((B, 1, HQ * D)).astype(np.float16), start=np.full(B, L - 1, np.int64),
                 directory=directory, table=table)
    return _model(nodes, inputs, outs), feeds, [o.name for o in outs]


class Runner:
    def __init__(self, model, feeds, outputs):
        self.sess = _session(model)
        self.vals = {k: _dev(v) for k, v in feeds.items()}
        self.io = self.sess.io_binding()
        for k, v in self.vals.items():
            self.io.bind_ortvalue_input(k, v)
        q = feeds["q"]
        self.outs = [_dev(np.zeros(q.shape, np.float16)) for _ in outputs]  # fixed addresses for the graph
        for o, v in zip(outputs, self.outs):
            self.io.bind_ortvalue_output(o, v)
        for _ in range(3):  # warm-up and the graph capture
            self.sess.run_with_iobinding(self.io)
        from ortkv import _ortkv

        err = _ortkv.cuda_take_error()
        if err is not None:
            raise RuntimeError(err)

    def time(self, reps):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self.sess.run_with_iobinding(self.io)  # synchronizes at the end of the run
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/paged_attention_cuda.md")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    kinds = ["dense"] + [f.name for f in FORMATS]
    lines = ["# PagedCacheAttention (CUDA) vs dense CacheAttention, decode", "",
             f"SmolLM2 heads {HQ}/{HKV}/{D}, float16 queries, pages of {PS} tokens, CUDA graphs; microseconds per "
             f"node (median of {a.rounds} rounds x median of {a.reps} calls). `python "
             "benchmarks/bench_paged_attention_cuda.py`", "",
             "| L | B | R | " + " | ".join(f"{k} us" for k in kinds) + " | F16 / dense | INT8 / F16 | INT4 / F16 |",
             "|---|---|---|" + "---|" * (len(kinds) + 3)]
    for L in LENGTHS:
        for B in BATCHES:
            R = _reps(B, L)
            runners = {"dense": Runner(*dense_case(rng, B, L, R))}
            for f in FORMATS:
                runners[f.name] = Runner(*paged_case(rng, B, L, R, f))
            per = {k: [] for k in kinds}
            for _ in range(a.rounds):
                for k in kinds:
                    per[k].append(runners[k].time(a.reps) / R * 1e6)
            med = {k: statistics.median(v) for k, v in per.items()}
            row = f"| {L} | {B} | {R} | " + " | ".join(f"{med[k]:.1f}" for k in kinds)
            row += f" | {med['F16'] / med['dense']:.2f} | {med['INT8'] / med['F16']:.2f} | {med['INT4'] / med['F16']:.2f} |"
            lines.append(row)
            print(row, flush=True)
            del runners
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
