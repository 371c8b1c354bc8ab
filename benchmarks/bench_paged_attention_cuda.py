"""CUDA PagedCacheAttention decode per page format against dense CUDA CacheAttention on the same tokens,
with ORT only (no torch, no cupy). SmolLM2-135M heads (9 query / 3 KV heads of 64) unless --heads says otherwise
(e.g. 32/8/128, Llama-3-8B's: a node that moves 5.3x the bytes per key), float16 queries.

  dense : ortkv CacheAttention over BSNH float16 caches [B, L, Hkv, D] (start = L - 1).
  F16 / INT8 / INT4 : ortkv PagedCacheAttention over one pool of pages of that format (pages of 16
          tokens, page ids shuffled so that consecutive pages are not adjacent in the pool), default kernel
          (Note [Paged CUDA v3]: tensor cores).
  F16 in order : F16 pages in pool order (row b's pages b * L / 16 ...): what the shuffle costs.
  F16 promised : F16 pages, the nodes' page_format = "F16" (what ortkv's single-format F16 policy builds on CUDA):
          the uniform 16-bit kernel (Note [Paged CUDA uniform 16-bit]).
  F16 static : F16 promised, and the nodes' static_tables = 1 (their directory and table are graph inputs: what
          ortkv's paged decoder builds): no late-page check after the wait (Note [Paged CUDA static tables]).
  INT4 static : INT4 pages (every-format kernel) with static_tables = 1.
  INT4 uniform : INT4 static, and the nodes' page_format = "INT4" (what ortkv's single-format INT4 policy builds on
          CUDA): the uniform INT4 kernel at head size 64 (Note [Paged CUDA uniform INT4]).
  INT8 uniform : INT8 pages, the nodes' page_format = "INT8" and static_tables = 1 (what ortkv's single-format INT8
          policy builds on CUDA): the uniform INT8 kernel at head size 64 (Note [Paged CUDA uniform INT8]), a node
          of one row (cells LxB with B = 1) in its 64-key steps, every other node in 32-key steps.
  INT8 promised : INT8 uniform captured with ORTKV_PAGED_UNIFORM_INT8=0: the every-format kernel, for the A/B.
  INT8 row32 : INT8 uniform captured with ORTKV_PAGED_INT8_ROW_STEP=32: every node in the kernel's 32-key steps
          (single rows too; the A/B for the 64-key single-row steps).
  F16 v2 / INT4 v2 : the same, captured with ORTKV_CUDA_ATTENTION=v2 (Note [Paged CUDA v2]), for the A/B.
R nodes of one kind in one model, each over its own cache / pool, so one call reads R caches one after the
other. R: as many nodes as --kind-gib (2) GiB of F16 caches hold, up to --max-nodes (256; at least 8): >= 256 MiB
of caches (K/V come from HBM, not from L2) except in nodes of < 1 MiB, which stay in L2 either way. Every kind of a
cell is alive at once: all 18 kinds at 8K x 8 come to ~27 GB of caches by their sizes, so a smaller GPU needs a
lower --kind-gib or fewer --kinds. Many nodes spread the fixed
cost of an ORT run (the call, the graph launch, the synchronization; ~10-17 us on an H100, from dense 16 x 1 at 64
and 256 nodes: 2.3 and 2.1-2.2 us a node). Until 2026-12-06 R was at most 64 (and >= 256 MiB of caches): that cost
added ~0.2 us to every short node and pulled their ratios toward 1 (F16 static / dense at 128 / 512 keys x 1 row
1.08 / 1.09 with 64 nodes, 1.10-1.11 / 1.10-1.11 with 256, one H100 lease). Sessions run with enable_cuda_graph=1.
Each figure is the median over --rounds rounds (the kinds alternate inside a round) of the median of --reps timed
calls after a warm-up; the time per node is the call time / R.
Cache contents: the dense caches are random float16 values; a pool holds --distinct-pages (64) pages encoded from
random values, repeated through it, so that a row's tiles differ as in a generation. Until 2026-12-06 every page of
a pool was the same page (--distinct-pages 1): every key tile of a row alike, the online softmax's maximum set by
the first tile. Measured, that moved F16 static / dense by <= 0.01 (64 nodes both ways, same lease).
  ORT-PA : onnxruntime's own com.microsoft.PagedAttention (CUDA, one float16 block cache [blocks, 16, Hkv, D] per
          node, same shuffled block tables); it also writes the step's one new key / value row into its cache
          (past_seqlens = L - 1), which ortkv's figure leaves to PagedCacheUpdate. It runs in a CUDA graph when
          the op allows capture; otherwise without one (the table says which).

A cell is LxB (L keys per row, B rows; the dense caches hold L positions and the page tables L / 16 entries) or
LxB@C: the same rows in caches of C positions and page tables of C / 16 entries (the rest -1), as in a generation,
whose caches and tables are as wide as its max length: the kernels take their split counts from that width (start
is on the device), so a short row in a wide table pays for empty splits. ORT-PA's tables stay L / 16 wide.

    python benchmarks/bench_paged_attention_cuda.py [--rounds 3] [--reps 20] [--cells 8192x1,8192x8,32768x1,32768x8]
                                                    [--kinds dense,F16,...] [--heads 9/3/64]
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
CELLS = "8192x1,8192x8,32768x1,32768x8"  # keys L x rows B
FORMATS = [PageFormat.F16, PageFormat.INT8, PageFormat.INT4]
V2_FORMATS = [PageFormat.F16, PageFormat.INT4]  # also timed with the previous kernel (ORTKV_CUDA_ATTENTION=v2)
KIND_BYTES = 2 << 30  # F16 cache bytes a kind may hold (every kind of a cell is alive at once)
DISTINCT_PAGES = 64


def _model(nodes, inputs, outputs):
    g = helper.make_graph(nodes, "bench", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def _session(model, graph=True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.register_custom_ops_library(ortkv.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graph else "0"})])


def _dev(arr):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), "cuda", 0)


def _reps(B, L, max_nodes=256, kind_bytes=KIND_BYTES):
    """Nodes per model: as many as kind_bytes of F16 caches hold, up to max_nodes (at least 8), so that the fixed
    cost of a run (ORT, the graph launch, the synchronization: ~10-20 us) is spread over many nodes and the kernels'
    differences show. Below max_nodes the caches hold kind_bytes (default 2 GiB; >= 256 MiB comes from HBM, not
    from L2); nodes of less than 256 MiB / max_nodes (1 MiB: < ~1.4K key-rows at SmolLM2's heads) stay in L2 either
    way."""
    per = 2 * B * L * HKV * D * 2
    return max(8, min(max_nodes, int(kind_bytes) // per))


def dense_case(rng, B, L, R, C=None):
    """R CacheAttention nodes over caches of C (default L) positions, start = L - 1."""
    C = C or L
    vi = helper.make_tensor_value_info
    nodes, inputs = [], [vi("q", TP.FLOAT16, [B, 1, HQ * D]), vi("start", TP.INT64, [B])]
    outs, feeds = [], {}
    for r in range(R):
        nodes.append(make_cache_attention("q", f"k{r}", f"v{r}", "start", f"o{r}", name=f"a{r}", num_heads=HQ,
                                          kv_num_heads=HKV, seq_axis=1))
        inputs += [vi(f"k{r}", TP.FLOAT16, [B, C, HKV, D]), vi(f"v{r}", TP.FLOAT16, [B, C, HKV, D])]
        outs.append(vi(f"o{r}", TP.FLOAT16, [B, 1, HQ * D]))
        kv = rng.standard_normal((B, C, HKV, D)).astype(np.float16)
        feeds[f"k{r}"] = feeds[f"v{r}"] = kv
    feeds["q"] = rng.standard_normal((B, 1, HQ * D)).astype(np.float16)
    feeds["start"] = np.full(B, L - 1, np.int64)
    return _model(nodes, inputs, outs), feeds, [o.name for o in outs]


def paged_case(rng, B, L, R, fmt, shuffled=True, promise=False, C=None, static=False, distinct=None):
    """One pool per node; every row L tokens over shuffled pages of `fmt` (in pool order when not `shuffled`;
    the pool holds `distinct` pages encoded from random values, repeated); `promise`:
    the nodes' page_format attribute names `fmt`; C: the page table's width in tokens (default L; entries past the
    row's pages are -1); `static`: the nodes' static_tables = 1."""
    W = (C or L) // PS
    extra = ({"page_format": fmt.name} if promise else {}) | ({"static_tables": 1} if static else {})
    vi = helper.make_tensor_value_info
    n_pages = B * (L // PS)
    pb = layout(fmt, HKV, PS, D).page_bytes
    # `distinct` pages of random values, repeated through the pool (the docstring: cache contents)
    n_distinct = max(1, min(distinct or DISTINCT_PAGES, n_pages))
    block = np.concatenate([encode_page(fmt, rng.standard_normal((2, HKV, PS, D)).astype(np.float32))
                            for _ in range(n_distinct)])
    pool = np.tile(block, -(-n_pages // n_distinct))[: n_pages * pb]
    directory = np.stack([np.full(n_pages, int(fmt), np.int64), np.arange(n_pages, dtype=np.int64) * pb], axis=1)
    order = rng.permutation(n_pages) if shuffled else np.arange(n_pages)
    table = np.full((B, W), -1, np.int32)
    table[:, :L // PS] = order.astype(np.int32).reshape(B, L // PS)
    nodes, inputs, outs, feeds = [], [vi("q", TP.FLOAT16, [B, 1, HQ * D]), vi("start", TP.INT64, [B]),
                                      vi("directory", TP.INT64, [n_pages, 2]), vi("table", TP.INT32, [B, W])], [], {}
    for r in range(R):
        nodes.append(helper.make_node("PagedCacheAttention", ["q", f"pool{r}", "directory", "table", "start"], [f"o{r}"],
                                      name=f"a{r}", domain="ortkv", num_heads=HQ, kv_num_heads=HKV, layer=0,
                                      num_layers=1, page_size=PS, **extra))
        inputs.append(vi(f"pool{r}", TP.UINT8, [n_pages * pb]))
        outs.append(vi(f"o{r}", TP.FLOAT16, [B, 1, HQ * D]))
        feeds[f"pool{r}"] = pool
    feeds.update(q=rng.standard_normal((B, 1, HQ * D)).astype(np.float16), start=np.full(B, L - 1, np.int64),
                 directory=directory, table=table)
    return _model(nodes, inputs, outs), feeds, [o.name for o in outs]


def ort_paged_case(rng, B, L, R, outputs3):
    """R com.microsoft.PagedAttention nodes, each over its own float16 key / value block caches."""
    vi = helper.make_tensor_value_info
    n_blocks = B * (L // PS)
    table = rng.permutation(n_blocks).astype(np.int32).reshape(B, L // PS)
    nodes = []
    inputs = [vi("q", TP.FLOAT16, [B, HQ * D]), vi("k", TP.FLOAT16, [B, HKV * D]), vi("v", TP.FLOAT16, [B, HKV * D]),
              vi("cu", TP.INT32, [B + 1]), vi("past", TP.INT32, [B]), vi("table", TP.INT32, [B, L // PS])]
    outs, feeds = [], {}
    for r in range(R):
        o = [f"o{r}"] + ([f"kco{r}", f"vco{r}"] if outputs3 else [])
        nodes.append(helper.make_node("PagedAttention", ["q", "k", "v", f"kc{r}", f"vc{r}", "cu", "past", "table"], o,
                                      name=f"a{r}", domain="com.microsoft", num_heads=HQ, kv_num_heads=HKV))
        inputs += [vi(f"kc{r}", TP.FLOAT16, [n_blocks, PS, HKV, D]), vi(f"vc{r}", TP.FLOAT16, [n_blocks, PS, HKV, D])]
        outs.append(vi(f"o{r}", TP.FLOAT16, [B, HQ * D]))
        if outputs3:
            outs += [vi(f"kco{r}", TP.FLOAT16, [n_blocks, PS, HKV, D]), vi(f"vco{r}", TP.FLOAT16, [n_blocks, PS, HKV, D])]
        kv = rng.standard_normal((n_blocks, PS, HKV, D)).astype(np.float16)
        feeds[f"kc{r}"] = kv
        feeds[f"vc{r}"] = kv.copy()
    feeds.update(q=rng.standard_normal((B, HQ * D)).astype(np.float16),
                 k=rng.standard_normal((B, HKV * D)).astype(np.float16),
                 v=rng.standard_normal((B, HKV * D)).astype(np.float16),
                 cu=np.arange(B + 1, dtype=np.int32), past=np.full(B, L - 1, np.int32), table=table)
    return _model(nodes, inputs, outs), feeds, [o.name for o in outs]


class Runner:
    def __init__(self, model, feeds, outputs, graph=True, alias=None):
        self.sess = _session(model, graph)
        self.vals = {k: _dev(v) for k, v in feeds.items()}
        self.io = self.sess.io_binding()
        for k, v in self.vals.items():
            self.io.bind_ortvalue_input(k, v)
        q = feeds["q"]
        alias = alias or {}
        self.outs = [self.vals[alias[o]] if o in alias else _dev(np.zeros(q.shape, np.float16))
                     for o in outputs]  # fixed addresses for the graph
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


def ort_paged_runner(rng, B, L, R):
    """(runner, captured in a CUDA graph, why not measured): tries the op's two output forms and the graph."""
    errors = []
    for outputs3 in (False, True):
        model, feeds, outs = ort_paged_case(rng, B, L, R, outputs3)
        alias = {f"kco{r}": f"kc{r}" for r in range(R)} | {f"vco{r}": f"vc{r}" for r in range(R)}
        for graph in (True, False):
            try:
                return Runner(model, feeds, outs, graph=graph, alias=alias), graph, None
            except Exception as e:  # noqa: BLE001 - reported in the table's note
                errors.append(f"{'3 outputs' if outputs3 else '1 output'}, graph {graph}: {str(e).splitlines()[0][:200]}")
    return None, False, "not measured: " + "; ".join(errors)


def main():
    global HQ, HKV, D, DISTINCT_PAGES
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--cells", default=CELLS, help="LxB[@C],...: keys per row x rows [@ cache / page table width in "
                   "tokens, default L]")
    p.add_argument("--kinds", default="", help="comma-separated subset of the kinds (default: all); ratios whose "
                   "kinds were not run print -")
    p.add_argument("--heads", default=f"{HQ}/{HKV}/{D}",
                   help="query heads / KV heads / head size (default SmolLM2-135M's; e.g. 32/8/128 for Llama-3-8B's)")
    p.add_argument("--max-nodes", type=int, default=256,
                   help="the most nodes a model (default 256; at most 64 before 2026-12-06)")
    p.add_argument("--kind-gib", type=float, default=KIND_BYTES / 2**30,
                   help="F16 cache GiB a kind's model may hold (default 2; every kind of a cell is alive at once)")
    p.add_argument("--distinct-pages", type=int, default=DISTINCT_PAGES,
                   help=f"distinct random pages repeated through each pool (default {DISTINCT_PAGES}; 1: one page "
                   "everywhere)")
    p.add_argument("--out", default="benchmarks/results/paged_attention_cuda.md")
    a = p.parse_args()
    if a.max_nodes < 1 or a.distinct_pages < 1 or a.kind_gib <= 0:
        p.error("--max-nodes and --distinct-pages must be >= 1 and --kind-gib > 0")
    DISTINCT_PAGES = a.distinct_pages
    try:
        HQ, HKV, D = (int(x) for x in a.heads.split("/"))
    except ValueError:
        p.error(f"--heads {a.heads!r}: expected three integers Hq/Hkv/D, e.g. 32/8/128")
    if HKV < 1 or HQ < HKV or HQ % HKV or D not in (64, 128):
        p.error(f"--heads {a.heads}: the query heads must be a positive multiple of the KV heads (>= 1) and the head "
                "size 64 or 128")
    cells = []
    for c in a.cells.split(","):
        try:
            lb, _, width = c.partition("@")
            L, B = (int(x) for x in lb.split("x"))
            C = int(width) if width else L
        except ValueError:
            p.error(f"--cells: {c!r} is not LxB or LxB@C (e.g. 8192x1 or 16x1@2048)")
        if L < 1 or B < 1 or L % PS or C % PS or C < L:
            p.error(f"--cells: {c!r} needs L, B >= 1, L and C multiples of the page size {PS}, and C >= L")
        cells.append((L, B, C))
    rng = np.random.default_rng(0)
    kinds = (["dense"] + [f.name for f in FORMATS] +
             ["F16 promised", "F16 static", "INT4 static", "INT4 uniform", "INT8 promised", "INT8 uniform",
              "INT8 row32", "F16 in order"] +
             [f"{f.name} v2" for f in V2_FORMATS] + ["dense plain", "F16 plain", "INT4 plain", "ORT-PA"])
    if a.kinds:
        wanted = a.kinds.split(",")
        unknown = [k for k in wanted if k not in kinds]
        if unknown:
            p.error(f"--kinds: unknown {unknown}; the kinds are {kinds}")
        kinds = [k for k in kinds if k in wanted]
    ratios = [("F16", "dense"), ("F16 promised", "dense"), ("F16 static", "dense"), ("F16 in order", "dense"),
              ("INT8", "F16"), ("INT4", "F16"), ("INT4", "F16 promised"), ("INT4 static", "F16 static"),
              ("INT4 uniform", "F16 static"), ("INT4 uniform", "INT4 static"), ("INT8 promised", "F16 static"),
              ("INT8 uniform", "F16 static"), ("INT8 uniform", "INT8 promised"), ("INT8 row32", "F16 static"),
              ("INT8 uniform", "INT8 row32"),
              ("F16", "F16 v2"), ("INT4", "INT4 v2"),
              ("F16 plain", "dense plain"), ("INT4 plain", "F16 plain"), ("F16", "F16 plain"), ("F16", "ORT-PA"),
              ("F16 promised", "ORT-PA")]
    names = {("F16", "F16 v2"): "F16 v3 / v2", ("INT4", "INT4 v2"): "INT4 v3 / v2",
             ("F16 plain", "dense plain"): "plain: F16 / dense", ("INT4 plain", "F16 plain"): "plain: INT4 / F16"}
    lines = ["# PagedCacheAttention (CUDA) vs dense CacheAttention, decode", "",
             f"Heads {HQ}/{HKV}/{D} (query / KV / size), float16 queries, pages of {PS} tokens, CUDA graphs; microseconds per "
             f"node (median of {a.rounds} rounds x median of {a.reps} calls). `python "
             f"benchmarks/bench_paged_attention_cuda.py --cells {a.cells} --heads {a.heads} --max-nodes {a.max_nodes} "
             f"--distinct-pages {a.distinct_pages}"
             + (f" --kinds '{a.kinds}'" if a.kinds else "") + "`", "",
             "| L | B | R | " + " | ".join(f"{k} us" for k in kinds) + " | " +
             " | ".join(names.get(r, f"{r[0]} / {r[1]}") for r in ratios) + " | ORT-PA graph |",
             "|---|---|---|" + "---|" * (len(kinds) + len(ratios) + 1)]
    pa_note = None
    for L, B, C in cells:
        R = _reps(B, L, a.max_nodes, a.kind_gib * 2**30)
        runners = {}
        want = set(kinds)
        if "dense" in want:
            runners["dense"] = Runner(*dense_case(rng, B, L, R, C))
        for f in FORMATS:
            if f.name in want:
                runners[f.name] = Runner(*paged_case(rng, B, L, R, f, C=C))
        if "F16 promised" in want:
            runners["F16 promised"] = Runner(*paged_case(rng, B, L, R, PageFormat.F16, promise=True, C=C))
        if "F16 static" in want:
            runners["F16 static"] = Runner(*paged_case(rng, B, L, R, PageFormat.F16, promise=True, C=C, static=True))
        if "INT4 static" in want:
            runners["INT4 static"] = Runner(*paged_case(rng, B, L, R, PageFormat.INT4, C=C, static=True))
        if "INT4 uniform" in want:
            runners["INT4 uniform"] = Runner(*paged_case(rng, B, L, R, PageFormat.INT4, promise=True, C=C,
                                                         static=True))
        if "INT8 uniform" in want:
            runners["INT8 uniform"] = Runner(*paged_case(rng, B, L, R, PageFormat.INT8, promise=True, C=C,
                                                         static=True))
        for kind, var, value in (("INT8 promised", "ORTKV_PAGED_UNIFORM_INT8", "0"),
                                 ("INT8 row32", "ORTKV_PAGED_INT8_ROW_STEP", "32")):
            if kind in want:
                os.environ[var] = value  # read when the graph is captured (in Runner())
                try:
                    runners[kind] = Runner(*paged_case(rng, B, L, R, PageFormat.INT8, promise=True, C=C, static=True))
                finally:
                    del os.environ[var]
        if "F16 in order" in want:
            runners["F16 in order"] = Runner(*paged_case(rng, B, L, R, PageFormat.F16, shuffled=False, C=C))
        os.environ["ORTKV_CUDA_ATTENTION"] = "v2"  # read when the graph is captured (in Runner())
        try:
            for f in V2_FORMATS:
                if f"{f.name} v2" in want:
                    runners[f"{f.name} v2"] = Runner(*paged_case(rng, B, L, R, f, C=C))
        finally:
            del os.environ["ORTKV_CUDA_ATTENTION"]
        os.environ["ORTKV_CUDA_EARLY"] = "0"  # plain launches (Note [CUDA attention early start]), read at capture
        try:
            if "dense plain" in want:
                runners["dense plain"] = Runner(*dense_case(rng, B, L, R, C))
            if "F16 plain" in want:
                runners["F16 plain"] = Runner(*paged_case(rng, B, L, R, PageFormat.F16, C=C))
            if "INT4 plain" in want:
                runners["INT4 plain"] = Runner(*paged_case(rng, B, L, R, PageFormat.INT4, C=C))
        finally:
            del os.environ["ORTKV_CUDA_EARLY"]
        pa_graph = False
        if "ORT-PA" in want:
            runners["ORT-PA"], pa_graph, why = ort_paged_runner(rng, B, L, R)
            if runners["ORT-PA"] is None:
                del runners["ORT-PA"]
                pa_note = why
        kinds_now = [k for k in kinds if k in runners]
        per = {k: [] for k in kinds_now}
        for _ in range(a.rounds):
            for k in kinds_now:
                per[k].append(runners[k].time(a.reps) / R * 1e6)
        med = {k: statistics.median(v) for k, v in per.items()}
        row = f"| {L if C == L else f'{L} @ {C}'} | {B} | {R} | "
        row += " | ".join(f"{med[k]:.1f}" if k in med else "-" for k in kinds)
        row += " | " + " | ".join(f"{med[x] / med[y]:.2f}" if x in med and y in med else "-" for x, y in ratios)
        row += f" | {('yes' if pa_graph else 'no') if 'ORT-PA' in med else '-'} |"
        lines.append(row)
        print(row, flush=True)
        del runners
    if pa_note:
        lines += ["", f"com.microsoft.PagedAttention: {pa_note}"]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
