"""CUDA CacheAttention decode against the GPU's measured device-to-device copy bandwidth, side by side
with com.microsoft.GroupQueryAttention on the same shapes, for both ortkv kernels (A/B in one run).

  copy      : cudaMemcpyAsync device-to-device of a 1 GiB buffer, --reps copies between two CUDA events
              (through torch or cupy when present, else ctypes to the libcudart that onnxruntime's CUDA
              provider loaded). A copy of n bytes reads n and writes n bytes of HBM, so its figure is
              2n / time: the memory traffic the device sustains. The attention kernels only read, so
              "x / copy" compares bytes read per second with that traffic (a kernel at 100 % moves as
              many bytes per second as the copy does). For continuity the table header also gives
              ORT's Identity node on a 1 GiB float16 buffer, counted the same way, and n / time.
  attention : R nodes of one kind in one model, each over its own cache pair, so one call reads
              R pairs one after the other like a model's layers (R chosen so that the pairs hold
              >= 256 MiB: the K/V come from HBM, not from the 50 MB L2). Decode: one new token per row,
              every row holding L keys (start = L - 1). GB/s = bytes of K and V read per node
              (2 * B * Hkv * L * D * 2) / time per node.
                v3    : ortkv CacheAttention (seq_axis 1, BSNH caches [B, L, Hkv, D]), default kernel
                        (Note [CacheAttention CUDA v3]).
                v2, v1: the same model and caches in sessions of their own run with
                        ORTKV_CUDA_ATTENTION=v2 / v1 (the older kernels; the variable is read at each
                        launch, so it is set before each of that session's calls, capture included).
                gqa   : com.microsoft.GroupQueryAttention, BNSH past/present bound to ONE buffer of
                        L tokens (GenAI's share-buffer decode: seqlens_k = L - 1, the new key/value
                        written at slot L - 1 by the op).
                sdpa  : torch.nn.functional.scaled_dot_product_attention (when torch with CUDA is present),
                        float16 caches [B, Hkv, L, D] (BNSH) and the Hq / Hkv query heads of each KV head
                        folded into the query length ([B, Hkv, Hq / Hkv, D]: a decode step's grouped query
                        attention with no K/V repeat or copy; torch picks its backend), R calls captured in one
                        torch CUDA graph and timed the same way (replay + synchronize per call).
  Every session runs with enable_cuda_graph=1 (ORT captures the whole call once and replays it), so
  the figures are GPU time plus one replay + synchronization per call, not per-node launch cost.
  Cells run from the biggest caches down (ORT's arena keeps freed chunks; the table is in argument order).
  Each figure is the median over --rounds rounds (the kinds alternate inside a round) of the median
  of --reps timed calls after a warm-up.

    python benchmarks/bench_cache_attention_cuda.py [--rounds 3] [--reps 20] [--min-nodes N] [--lengths 1024,8192,...]
                                                    [--batches 1,8,64] [--heads 9/3/64,32/8/128]
                                                    [--copy auto|torch|cupy|cudart]
                                                    [--out benchmarks/results/cache_attention_cuda.md]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import math
import os
import statistics
import sys
import time

import numpy as np
from onnx import TensorProto as TP
from onnx import helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit  # noqa: E402

import ortkv  # noqa: E402
from ortkv.graph import make_cache_attention  # noqa: E402

HEADS = [(9, 3, 64), (32, 8, 128)]  # SmolLM2-135M; a Llama-8B-like layer
KERNEL_ENV = "ORTKV_CUDA_ATTENTION"
KINDS = ("v3", "v3-plain", "v2", "v1", "gqa", "sdpa")
DEFAULT_KINDS = ("v3", "v3-plain", "v2", "gqa", "sdpa")
EARLY_ENV = "ORTKV_CUDA_EARLY"  # v3-plain: v3 launched plainly, not early (Note [CUDA attention early start])
LENGTHS = [1024, 8192, 32768, 131072]
BATCHES = [1, 8, 64]
POOL_BYTES = 256 << 20
MIN_NODES, MAX_BYTES = 1, 40 << 30  # --min-nodes, --max-gib


def _nodes(pair):
    """Nodes (cache pairs) per call: enough pairs for POOL_BYTES (at most 16), and at least --min-nodes where
    --max-gib allows. Every call pays one graph replay and a synchronize (~10-20 us) spread over its nodes: at 8K keys
    x 8 rows of SmolLM2's heads (6 nodes) that is ~2 us of a ~18 us node, so --min-nodes 32 times the nodes more
    than the calls."""
    base = max(1, min(16, math.ceil(POOL_BYTES / pair)))
    return max(base, min(MIN_NODES, MAX_BYTES // pair))


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


def _time(call, reps):
    """Median wall time of call() (one whole call: a graph replay and its synchronize) after three untimed ones
    (ORT's warm-up run, the capture, one replay)."""
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def identity_case(nbytes=1 << 30):
    """ORT's Identity on the CUDA EP over nbytes: (read + write) bytes per second."""
    n = nbytes // 2
    model = _model([helper.make_node("Identity", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TP.FLOAT16, [n])],
                   [helper.make_tensor_value_info("y", TP.FLOAT16, [n])])
    sess = _session(model)
    x, y = _dev([n]), _dev([n])
    io = sess.io_binding()
    io.bind_ortvalue_input("x", x)
    io.bind_ortvalue_output("y", y)
    return lambda reps: 2 * nbytes / _time(lambda: sess.run_with_iobinding(io), reps), (x, y, sess)


def _memcpy_torch(nbytes, reps):
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA device")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)  # cudaMemcpyAsync device-to-device
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _memcpy_cupy(nbytes, reps):
    import cupy

    src = cupy.empty(nbytes, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    dst[...] = src
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, 0)  # 3: device to device
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3


def _libcudart():
    """The CUDA runtime onnxruntime's CUDA provider loaded (a loaded soname resolves to it), else one
    from the nvidia-* wheels or the system."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    import onnxruntime as ort

    roots = [os.path.dirname(ort.__file__)] + [os.path.join(p, "nvidia") for p in sys.path if p]
    for root in roots:
        names += sorted(glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True))
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise RuntimeError("no libcudart found (tried " + ", ".join(names[:3]) + " and the nvidia wheels)")


def _memcpy_cudart(nbytes, reps):
    rt = _libcudart()
    vp = ctypes.c_void_p

    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed with cudaError {rc}")

    src, dst, ev0, ev1 = vp(), vp(), vp(), vp()
    check(rt.cudaMalloc(ctypes.byref(src), ctypes.c_size_t(nbytes)), "cudaMalloc")
    check(rt.cudaMalloc(ctypes.byref(dst), ctypes.c_size_t(nbytes)), "cudaMalloc")
    try:
        check(rt.cudaEventCreate(ctypes.byref(ev0)), "cudaEventCreate")
        check(rt.cudaEventCreate(ctypes.byref(ev1)), "cudaEventCreate")
        copy = lambda: check(rt.cudaMemcpyAsync(dst, src, ctypes.c_size_t(nbytes), 3, vp(0)),  # noqa: E731
                             "cudaMemcpyAsync")
        copy()  # warm-up
        check(rt.cudaEventRecord(ev0, vp(0)), "cudaEventRecord")
        for _ in range(reps):
            copy()
        check(rt.cudaEventRecord(ev1, vp(0)), "cudaEventRecord")
        check(rt.cudaEventSynchronize(ev1), "cudaEventSynchronize")
        ms = ctypes.c_float()
        check(rt.cudaEventElapsedTime(ctypes.byref(ms), ev0, ev1), "cudaEventElapsedTime")
        rt.cudaEventDestroy(ev0)
        rt.cudaEventDestroy(ev1)
        return ms.value / 1e3
    finally:
        rt.cudaFree(src)
        rt.cudaFree(dst)


_FILL = {}


def fill_random(values):
    """Fills device OrtValues (float16) with a 64 MiB block of standard-normal values, repeated, by
    device-to-device cudaMemcpy through libcudart: realistic scores for the online softmax (zeros
    would make every score equal and the running max never move). Returns False if libcudart is
    not available (the caches then hold whatever the allocator gave)."""
    if "rt" not in _FILL:
        try:
            _FILL["rt"] = _libcudart()
        except RuntimeError:
            _FILL["rt"] = None
        block = np.random.default_rng(1).standard_normal(32 << 20).astype(np.float16)  # 64 MiB
        _FILL["src"] = _dev(None, value=block)
    rt, src = _FILL["rt"], _FILL["src"]
    if rt is None:
        return False
    block = 64 << 20
    for v in values:
        n, dst, off = 2 * math.prod(v.shape()), v.data_ptr(), 0
        while off < n:
            c = min(block, n - off)
            rc = rt.cudaMemcpy(ctypes.c_void_p(dst + off), ctypes.c_void_p(src.data_ptr()), ctypes.c_size_t(c), 3)
            if rc != 0:
                raise RuntimeError(f"cudaMemcpy (cache fill) failed with cudaError {rc}")
            off += c
    return True


def memcpy_case(nbytes=1 << 30, backend="auto"):
    """A device-to-device cudaMemcpyAsync of nbytes timed with CUDA events: (read + write) bytes per
    second, and the backend used. auto: torch, then cupy, then ctypes to libcudart."""
    errors = []
    backends = {"torch": _memcpy_torch, "cupy": _memcpy_cupy, "cudart": _memcpy_cudart}
    for name, fn in backends.items() if backend == "auto" else [(backend, backends[backend])]:
        try:
            fn(nbytes, 1)
        except Exception as exc:  # noqa: BLE001 - try the next backend, report all if none works
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        return (lambda reps, fn=fn: 2 * nbytes * reps / fn(nbytes, reps)), name
    raise RuntimeError("no way to time a device-to-device cudaMemcpy: " + "; ".join(errors))


def attention_case(kind, Hq, Hkv, D, L, B, shared=None):
    """A timing function for one kind (v3, v2, v1: ortkv; gqa) and what must stay alive. v2 and v1 reuse v3's
    device buffers (`shared`: the second value returned for the first ortkv kind) in a session of their own."""
    pair = 2 * B * L * Hkv * D * 2
    R = _nodes(pair)
    nodes, ins, outs, keep = [], [], [], []
    ortkv_kind = kind in ("v1", "v2", "v3", "v3-plain")
    if shared is not None:
        feeds = shared[1]
    else:
        q = _dev(None, value=np.random.default_rng(0).standard_normal((B, 1, Hq * D)).astype(np.float16))
        feeds = {"q": q}
    ins.append(helper.make_tensor_value_info("q", TP.FLOAT16, [B, 1, Hq * D]))
    if ortkv_kind:
        if shared is None:
            feeds["start"] = _dev(None, value=np.full(B, L - 1, np.int64))
        ins.append(helper.make_tensor_value_info("start", TP.INT64, [B]))
        for i in range(R):
            nodes.append(make_cache_attention("q", f"k{i}", f"v{i}", "start", f"o{i}", name=f"a{i}", num_heads=Hq,
                                              kv_num_heads=Hkv, seq_axis=1))
            for c in "kv":
                ins.append(helper.make_tensor_value_info(f"{c}{i}", TP.FLOAT16, [B, L, Hkv, D]))
                if shared is None:
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
    if shared is None:
        caches = [v for name, v in feeds.items() if name[0] in "kvp" and name != "kn"]
        _FILL["filled"] = fill_random(caches)
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

    def run(reps):
        if ortkv_kind:  # the kernel is chosen at each launch (the capture included): set it every time
            os.environ[KERNEL_ENV] = kind.split("-")[0]
            if kind == "v3-plain":
                os.environ[EARLY_ENV] = "0"
        try:
            return pair * R / _time(lambda: sess.run_with_iobinding(io), reps)
        finally:
            os.environ.pop(KERNEL_ENV, None)
            os.environ.pop(EARLY_ENV, None)

    return run, (keep, feeds)


def sdpa_case(Hq, Hkv, D, L, B):
    """torch's scaled_dot_product_attention on the decode shape (see the docstring): a timing function and what
    must stay alive. Raises if torch or its CUDA device is missing (the table then says so)."""
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA device")
    pair = 2 * B * L * Hkv * D * 2
    R = _nodes(pair)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hkv, Hq // Hkv, D, device="cuda", dtype=torch.float16, generator=gen)
    ks = [torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(R)]
    vs = [torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(R)]
    outs = [None] * R
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (backend choice, workspaces)
        for i in range(R):
            F.scaled_dot_product_attention(q, ks[i], vs[i])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(R):
            outs[i] = F.scaled_dot_product_attention(q, ks[i], vs[i])

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    return (lambda reps: pair * R / _time(replay, reps)), (q, ks, vs, outs, graph)


def run_cell(kinds, Hq, Hkv, D, L, B, rounds, reps):
    """One cell: every kind built (the ortkv kinds on one set of buffers), then `rounds` rounds alternating
    the kinds; returns ({kind: median GB/s}, note)."""
    res = {k: [] for k in kinds}
    note = ""
    fns = {}
    for kind in kinds:
        first = next((k for k in fns if k not in ("gqa", "sdpa")), None)  # ortkv kinds share one set of buffers
        try:
            if kind == "sdpa":
                fns[kind] = sdpa_case(Hq, Hkv, D, L, B)
            else:
                fns[kind] = attention_case(kind, Hq, Hkv, D, L, B,
                                           shared=fns[first][1] if kind != "gqa" and first else None)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            note += f"{kind}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} "
    for _ in range(rounds):
        for kind, (fn, _) in list(fns.items()):
            try:
                res[kind].append(fn(reps))
            except Exception as exc:  # noqa: BLE001
                note += f"{kind}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} "
                del fns[kind]
    fns.clear()
    if "sdpa" in kinds and "torch" in sys.modules:  # the cell's torch buffers back to the device
        sys.modules["torch"].cuda.empty_cache()
    return {k: statistics.median(v) for k, v in res.items() if v}, note.strip()


def _fmt_table(rows, copy_bw):
    gb = lambda x: f"{x / 1e9:.0f}" if x else "-"  # noqa: E731
    pct = lambda x: f"{x / copy_bw:.0%}" if x else "-"  # noqa: E731
    ratio = lambda x, y: f"{x / y:.2f}" if x and y else "-"  # noqa: E731
    lines = ["| Hq/Hkv/D | keys L | batch | K+V MiB per node | v3 GB/s | v3 / copy | v3 plain GB/s | v3 plain / copy | "
             "v2 GB/s | v2 / copy | v1 GB/s | GQA GB/s | GQA / copy | SDPA GB/s | SDPA / copy | v3 / v3 plain | "
             "v3 / v2 | v3 / GQA | v3 / SDPA | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for Hq, Hkv, D, L, B, med, note in rows:
        a, ap_, o, v1, g = med.get("v3"), med.get("v3-plain"), med.get("v2"), med.get("v1"), med.get("gqa")
        sd = med.get("sdpa")
        mib = 2 * B * L * Hkv * D * 2 / (1 << 20)
        lines.append(f"| {Hq}/{Hkv}/{D} | {L} | {B} | {mib:.1f} | {gb(a)} | {pct(a)} | {gb(ap_)} | {pct(ap_)} | "
                     f"{gb(o)} | {pct(o)} | {gb(v1)} | {gb(g)} | {pct(g)} | {gb(sd)} | {pct(sd)} | {ratio(a, ap_)} | "
                     f"{ratio(a, o)} | {ratio(a, g)} | {ratio(a, sd)} | {note} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--heads", default=",".join(f"{q}/{k}/{d}" for q, k, d in HEADS),
                    help="Hq/Hkv/D shapes, comma-separated")
    ap.add_argument("--max-gib", type=float, default=40.0, help="skip shapes whose R cache pairs exceed this")
    ap.add_argument("--copy", choices=["auto", "torch", "cupy", "cudart"], default="auto",
                    help="how to run the cudaMemcpy reference (auto: the first that works, in this order)")
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"comma-separated, of {KINDS}")
    ap.add_argument("--min-nodes", type=int, default=1,
                    help="at least this many attention nodes (cache pairs) per call (default: as many as 256 MiB needs)")
    ap.add_argument("--out")
    args = ap.parse_args()
    global MIN_NODES, MAX_BYTES
    MIN_NODES, MAX_BYTES = max(1, args.min_nodes), int(args.max_gib * (1 << 30))
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds takes a comma-separated list of {KINDS}, not {args.kinds!r}")
    import onnxruntime as ort

    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    ident_fn, ident_keep = identity_case()  # also loads the CUDA provider (and its libcudart)
    memcpy_fn, memcpy_backend = memcpy_case(backend=args.copy)
    idents, copies = [], []
    for _ in range(args.rounds):
        idents.append(ident_fn(args.reps))
        copies.append(memcpy_fn(args.reps))
    del ident_keep
    copy_bw, ident_bw = statistics.median(copies), statistics.median(idents)
    cells = [(Hq, Hkv, D, L, B) for Hq, Hkv, D in heads for L in map(int, args.lengths.split(","))
             for B in map(int, args.batches.split(","))]
    # Cells with the biggest caches first: ORT's arena keeps the chunks a cell freed, and a later cell with
    # bigger caches would find only smaller free chunks and run out of device memory (seen at 128K x 64 after
    # 32K x 64); smaller caches split the big chunks. The table keeps the order of the arguments.
    pair_bytes = [2 * B * L * Hkv * D * 2 for Hq, Hkv, D, L, B in cells]
    done = {}
    for c in sorted(range(len(cells)), key=lambda c: -pair_bytes[c]):  # the biggest buffers first
        Hq, Hkv, D, L, B = cells[c]
        pair = pair_bytes[c]
        if pair * _nodes(pair) > args.max_gib * (1 << 30):
            done[c] = (Hq, Hkv, D, L, B, {}, "skipped: over --max-gib")
            continue
        done[c] = (Hq, Hkv, D, L, B) + run_cell(kinds, Hq, Hkv, D, L, B, args.rounds, args.reps)
        print(done[c], flush=True)
    rows = [done[c] for c in range(len(cells))]
    cmd = " ".join(["python", "benchmarks/bench_cache_attention_cuda.py"] + sys.argv[1:])
    lines = [f"# CUDA CacheAttention decode vs device-to-device copy (onnxruntime {ort.__version__}, float16, BSNH)",
             "", f"Command: `{cmd}` (CUDA graph replays; see the script's docstring).", "",
             f"Device-to-device cudaMemcpy (through {memcpy_backend}, 1 GiB, CUDA events, read + write counted): "
             f"**{copy_bw / 1e9:.0f} GB/s** = {copy_bw / 2e9:.0f} GB/s copied (rounds: "
             f"{', '.join(f'{c / 1e9:.0f}' for c in copies)}). ORT Identity, same size and count: "
             f"{ident_bw / 1e9:.0f} GB/s. Host load (1 min): {os.getloadavg()[0]:.2f}.", "",
             "v3: the default kernel (Note [CacheAttention CUDA v3]); v2, v1: `ORTKV_CUDA_ATTENTION=v2` / `v1` "
             "(the older kernels, for A/B); GQA: com.microsoft.GroupQueryAttention (share-buffer); SDPA: torch's "
             "scaled_dot_product_attention, query heads folded into the query length; "
             "GB/s = bytes of K and V read per node / time; x / copy = that over the copy's read + write bytes/s. "
             + ("Caches hold standard-normal float16 values (a 64 MiB block repeated)."
                if _FILL.get("filled") else "Caches were NOT filled (no libcudart): their contents are arbitrary."),
             ""]
    lines += _fmt_table(rows, copy_bw)
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
