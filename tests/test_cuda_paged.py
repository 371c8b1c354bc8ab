"""PagedCacheUpdate / PagedCacheAttention on the CUDA execution provider (Note [Paged CUDA]) against the
numpy oracle (ortkv.reference.paged) and the CPU op over the same pool bytes, every input (positions /
starts, directory, page table included) in device memory: every format alone and all mixed in a shuffled
pool, page sizes 16 / 64, ragged rows, T = 1 and 5, GQA, head sizes 64 / 128, an 8K-token split-K case,
poisoned bytes past each row's length, every refusal reported through the device error word with the pool
bytes unchanged, CUDA update bytes == CPU update bytes, and a CUDA-graph replay. Skipped with a reason
where there is no CUDA provider or device."""

from __future__ import annotations

import contextlib
import functools
import os
import re

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

import ortkv
from ortkv.reference.codecs import PageFormat
from ortkv.reference.paged import paged_cache_attention_ref, paged_cache_update_ref, slot_bytes
from conftest import input_from_add, start_from_add
from test_paged_ops import (ALL, DIRECT, NP, ONNX, attention_model, build_pool, poison_rows,  # noqa: F401
                            run_update, table_for, update_model)

pytestmark = pytest.mark.cuda


def _cuda_reason():
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (the CPU wheel); install onnxruntime-gpu"
    try:
        ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", 0)
    except Exception as exc:  # noqa: BLE001 - any failure means no usable device
        return f"no CUDA device usable by onnxruntime ({exc})"
    try:
        from ortkv import _ortkv

        _ortkv.cuda_take_error()
    except Exception as exc:  # noqa: BLE001
        return f"ortkv extension unavailable ({exc})"
    return None


_REASON = _cuda_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

import onnxruntime as ort  # noqa: E402

from ortkv import _ortkv  # noqa: E402

RAW = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
TOL = {"float32": 2e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def _session(model, graph=False):
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.register_custom_ops_library(ortkv.get_library_path())
    opts = {"enable_cuda_graph": "1"} if graph else {}
    return ort.InferenceSession(model.SerializeToString(), so, providers=[("CUDAExecutionProvider", opts)])


@functools.lru_cache(maxsize=None)
def update_session(dtype, layer, num_layers, kv_heads, page_size, fill=False):
    return _session(update_model(dtype, layer, num_layers, kv_heads, page_size, fill=fill))


@functools.lru_cache(maxsize=None)
def attention_session(dtype, num_heads, kv_heads, layer, num_layers, page_size, fill=False, page_format=None,
                      static_tables=None):
    return _session(attention_model(dtype, num_heads, kv_heads, layer, num_layers, page_size, fill=fill,
                                    page_format=page_format, static_tables=static_tables))


def _dev(arr):
    arr = np.ascontiguousarray(arr)
    if arr.dtype == NP["bfloat16"]:
        arr = arr.view(np.uint16)
    return ort.OrtValue.ortvalue_from_numpy(arr, "cuda", 0)


def _bind(io, name, value, onnx_type, shape, output=False):
    (io.bind_output if output else io.bind_input)(name, "cuda", 0, onnx_type, list(shape), value.data_ptr())


def cuda_update(pool, directory, table, key, value, position, *, layer, num_layers, kv_heads, page_size,
                dtype="float32", fill=None, sess=None, computed=None):
    """One run on the device (`fill`: page_fill bound too); returns (pool bytes after, the deferred error or None).
    `sess`: another session of the update (default update_session's); `computed`: the input that session's node
    before computes (conftest.input_from_add), bound as `<name>_in`."""
    # the inputs are bound by raw device pointer with a declared type: ORT cannot see a mismatch (float16 data
    # declared float32 once read past the arrays and garbled every value), so check it here
    assert key.dtype == value.dtype and key.dtype in (np.dtype(NP[dtype]), np.dtype(RAW[dtype])), (key.dtype, dtype)
    sess = sess or update_session(dtype, layer, num_layers, kv_heads, page_size, fill is not None)
    io = sess.io_binding()
    pos = np.broadcast_to(np.asarray(position, np.int64), (table.shape[0],)).copy()
    pv = _dev(pool)
    vals = {"directory": (_dev(directory), TP.INT64, directory.shape), "page_table": (_dev(table), TP.INT32, table.shape),
            "key": (_dev(key), ONNX[dtype], key.shape), "value": (_dev(value), ONNX[dtype], value.shape),
            "position": (_dev(pos), TP.INT64, pos.shape)}
    if fill is not None:
        vals["page_fill"] = (_dev(fill), TP.INT32, fill.shape)
    _bind(io, "pool", pv, TP.UINT8, pool.shape)
    for name, (v, t, shape) in vals.items():
        _bind(io, f"{name}_in" if name == computed else name, v, t, shape)
    _bind(io, "pool_out", pv, TP.UINT8, pool.shape, output=True)
    sess.run_with_iobinding(io)
    return pv.numpy(), _ortkv.cuda_take_error()


def cuda_attention(q, pool, directory, table, start, *, num_heads, kv_heads, layer, num_layers, page_size,
                   dtype="float32", fill=None, page_format=None, static_tables=None):
    sess = attention_session(dtype, num_heads, kv_heads, layer, num_layers, page_size, fill is not None, page_format,
                             static_tables)
    io = sess.io_binding()
    st = np.broadcast_to(np.asarray(start, np.int64), (q.shape[0],)).copy()
    out = _dev(np.zeros(q.shape, RAW[dtype]))
    keep = [(_dev(q), "query", ONNX[dtype], q.shape), (_dev(pool), "pool", TP.UINT8, pool.shape),
            (_dev(directory), "directory", TP.INT64, directory.shape), (_dev(table), "page_table", TP.INT32, table.shape),
            (_dev(st), "start", TP.INT64, st.shape)]
    if fill is not None:
        keep.append((_dev(fill), "page_fill", TP.INT32, fill.shape))
    for v, name, t, shape in keep:
        _bind(io, name, v, t, shape)
    _bind(io, "out", out, ONNX[dtype], q.shape, output=True)
    sess.run_with_iobinding(io)
    got = out.numpy()
    if dtype == "bfloat16":
        got = (got.astype(np.uint32) << 16).view(np.float32)
    return got.astype(np.float32), keep[1][0].numpy(), _ortkv.cuda_take_error()


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(NP[dtype])


def _logical_arg(x, dtype):
    return x.view(np.uint16) if dtype == "bfloat16" else x


# ---- PagedCacheAttention -------------------------------------------------------------------------------------
def _attn_case(rng, formats, *, B, T, lengths, NL=2, H=3, G=3, PS=16, D=64, layer=1, dtype="float16", poison=True,
               runs=None, page_format=None, static_tables=None):
    """runs=R: each row's pages in table order take formats[0] for R pages, then formats[1] for R pages, ...
    (cycling), instead of formats spread over shuffled pages. page_format, static_tables: the node's attributes."""
    pages_per_row = [-(-n // PS) for n in lengths]
    if runs is None:
        fmts = [formats[i % len(formats)] for i in range(sum(pages_per_row))]
        fmts = [fmts[i] for i in rng.permutation(len(fmts))]
    else:
        fmts = [formats[(i // runs) % len(formats)] for n in pages_per_row for i in range(n)]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    if runs is None:
        ids = list(rng.permutation(len(fmts)))
        table = table_for([[int(ids.pop()) for _ in range(n)] for n in pages_per_row], max(pages_per_row) + 2)
    else:
        first = np.cumsum([0] + pages_per_row)
        table = table_for([list(range(first[b], first[b + 1])) for b in range(B)], max(pages_per_row) + 2)
    start = np.array(lengths) - T
    clean = pool.copy()
    if poison:
        poison_rows(pool, directory, table, lengths, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    q = _rand(rng, (B, T, H * G * D), dtype)
    got, after, err = cuda_attention(q, pool, directory, table, start, num_heads=H * G, kv_heads=H, layer=layer,
                                     num_layers=NL, page_size=PS, dtype=dtype, page_format=page_format,
                                     static_tables=static_tables)
    assert err is None, err
    assert after.tobytes() == pool.tobytes()  # read only
    want = paged_cache_attention_ref(_logical_arg(q, dtype), clean, directory, table, start, num_heads=H * G,
                                     kv_num_heads=H, layer=layer, num_layers=NL, page_size=PS,
                                     logical="bfloat16" if dtype == "bfloat16" else None)
    assert np.isfinite(got).all(), "a poisoned row past a sequence's length was read"
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    return got


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("PS", [16, 64])
@pytest.mark.parametrize("T", [1, 5])
def test_attention_each_format_alone(rng, fmt, PS, T):
    _attn_case(rng, [fmt], B=3, T=T, lengths=[PS * 2 + 5, 3 * PS, T], PS=PS)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("D", [64, 128])
def test_attention_every_format_in_one_pool_shuffled(rng, T, D):
    _attn_case(rng, ALL, B=3, T=T, lengths=[130, 37, 64], PS=16, D=D)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_attention_logical_types(rng, dtype):
    _attn_case(rng, ALL, B=2, T=2, lengths=[50, 20], dtype=dtype)


@pytest.mark.parametrize("heads", [(3, 3), (2, 4), (1, 9), (2, 8)], ids=lambda h: f"{h[0]}kv_g{h[1]}")
def test_attention_gqa(rng, heads):
    H, G = heads
    _attn_case(rng, [PageFormat.F16, PageFormat.INT8, PageFormat.INT4], B=2, T=3, lengths=[40, 9], H=H, G=G, PS=16)


def test_attention_unaligned_head_size_plain_loads(rng):
    """D = 20: not a multiple of 8, the element-by-element decode."""
    _attn_case(rng, [PageFormat.F16, PageFormat.INT8, PageFormat.INT4], B=2, T=3, lengths=[45, 7], PS=4, D=20, H=2,
               G=2)


@pytest.mark.parametrize("B", [1, 4])
def test_attention_split_k_8k_tokens(rng, B):
    """>= 8K tokens per row over pages of every format: many key chunks per unit, merged by the combine."""
    lengths = [8300, 17, 4096, 8193][:B]
    _attn_case(rng, ALL, B=B, T=1, lengths=lengths, PS=64, NL=1, layer=0)


@pytest.mark.parametrize("kernel", ["v2", "v3"])
@pytest.mark.parametrize("D,T,dtype", [(64, 1, "float16"), (128, 5, "float16"), (64, 3, "bfloat16"),
                                       (128, 1, "bfloat16")])
def test_attention_each_kernel_every_format(rng, monkeypatch, kernel, D, T, dtype):
    """The streaming kernel (Note [Paged CUDA v2]) and the tensor-core one (Note [Paged CUDA v3], the default for
    16-bit queries, head size 64 / 128, pages of a multiple of 16) each against the reference: every format in one
    pool, sequences ending inside a 16-key tile, a row of 8K keys (split, chunk edges inside tiles), G = 3 and 8."""
    monkeypatch.setenv("ORTKV_CUDA_ATTENTION", kernel)
    _attn_case(rng, ALL, B=3, T=T, lengths=[8203, 37, 16 + T], PS=16, D=D, NL=1, layer=0, dtype=dtype)
    _attn_case(rng, ALL, B=2, T=T, lengths=[301, 64], PS=32, D=D, H=2, G=8, dtype=dtype)


@pytest.mark.parametrize("kind", ["16bit", "INT8", "INT4"])
@pytest.mark.parametrize("PS", [16, 48])
@pytest.mark.parametrize("D,T,dtype", [(64, 1, "float16"), (128, 5, "float16"), (64, 3, "bfloat16"),
                                       (128, 1, "bfloat16")])
def test_attention_uniform_pages(rng, kind, PS, D, T, dtype):
    """Note [Paged CUDA uniform 16-bit]: page_format naming the queries' own 16-bit format (F16 / BF16) takes the
    dense-shaped kernel; INT4 under float16 queries at head size 64 its INT4 twin (Note [Paged CUDA uniform INT4]);
    INT8, and INT4 elsewhere, the every-format kernel, which checks the promise: against the reference
    with rows ending inside a tile, a row of 8K keys (split, chunk edges inside tiles), a page size that is not a
    power of two, G = 3 and 8."""
    fmt = PageFormat[kind] if kind != "16bit" else PageFormat.F16 if dtype == "float16" else PageFormat.BF16
    _attn_case(rng, [fmt], B=3, T=T, lengths=[8203, 37, PS + T], PS=PS, D=D, NL=1, layer=0, dtype=dtype,
               page_format=fmt.name)
    _attn_case(rng, [fmt], B=2, T=T, lengths=[301, 64], PS=PS, D=D, H=2, G=8, dtype=dtype, page_format=fmt.name)


@pytest.mark.parametrize("fmt", [PageFormat.F16, PageFormat.INT4, PageFormat.INT8], ids=lambda f: f.name)
@pytest.mark.parametrize("T", [1, 8])
def test_attention_uniform_pages_many_tiles_per_warp(rng, monkeypatch, fmt, T):
    """Enough (row, head, token) units that a node does not split (>= 4 blocks per SM), so each warp of a block
    walks more than 32 tiles of one long chunk: its page pointers are resolved in batches of 32 (Note [Paged CUDA
    uniform 16-bit]); T = 8: three batches. INT8: the uniform INT8 kernel (ORTKV_PAGED_UNIFORM_INT8=1)."""
    monkeypatch.setenv("ORTKV_PAGED_UNIFORM_INT8", "1")
    B, L = (66, 2100) if T == 1 else (9, 4100)
    _attn_case(rng, [fmt], B=B, T=T, lengths=[L - 5 * b for b in range(B)], H=8, G=1, PS=16, NL=1, layer=0,
               page_format=fmt.name)


@pytest.mark.parametrize("PS", [16, 48])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("early", ["1", "0"], ids=["early", "plain"])
@pytest.mark.parametrize("static", [None, 1], ids=["tables", "static_tables"])
@pytest.mark.parametrize("row_step", ["32", "64", "w8"], ids=["row32", "row64", "w8"])
def test_attention_uniform_int8_kernel(rng, monkeypatch, PS, T, early, static, row_step):
    """Note [Paged CUDA uniform INT8]: INT8 pages promised under float16 queries at head size 64, against the
    reference: rows ending inside a tile, a row of 8K keys (split, chunk edges inside tiles), single rows of 37 /
    600 / 2000 keys (one launch, 4 and 7 splits merged in a cluster), of 8K keys and of 32,800 keys (a table past
    32K keys: the long ring), a page size that is not a power of two, G = 3 and 8, launched early and plainly, with
    and without static tables. row64 (the default, ORTKV_PAGED_INT8_ROW_STEP unset): T = 1's single rows run the
    kernel's 64-key steps; every other node, and every node under row32 (ORTKV_PAGED_INT8_ROW_STEP=32), its 32-key
    steps; w8 (ORTKV_PAGED_U8_ROW_WARPS=8, Note [Uniform INT4 single-row warps]): the single rows in 8 warps a block
    and 32-key steps."""
    monkeypatch.setenv("ORTKV_PAGED_UNIFORM_INT8", "1")
    _row_step(monkeypatch, {"32": "INT8_row32", "64": "INT8", "w8": "INT8_w8"}[row_step])
    monkeypatch.setenv("ORTKV_CUDA_EARLY", early)
    kw = dict(D=64, dtype="float16", page_format="INT8", static_tables=static)
    _attn_case(rng, [PageFormat.INT8], B=3, T=T, lengths=[8203, 37, PS + T], PS=PS, NL=1, layer=0, **kw)
    _attn_case(rng, [PageFormat.INT8], B=2, T=T, lengths=[301, 64], PS=PS, H=2, G=8, **kw)
    for L in (37, 600, 2000, 8203, 32800):
        _attn_case(rng, [PageFormat.INT8], B=1, T=T, lengths=[L], PS=16, NL=1, layer=0, **kw)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("early", ["1", "0"], ids=["early", "plain"])
@pytest.mark.parametrize("static", [None, 1], ids=["tables", "static_tables"])
def test_attention_uniform_int4_single_row_warps(rng, monkeypatch, T, early, static):
    """Note [Uniform INT4 single-row warps] (ORTKV_PAGED_U4_ROW_WARPS=8): INT4 pages promised, one batch row (T = 1:
    8 warps a block in 32-key steps; T = 5: several query tokens, the 4-warp form) against the reference: rows of 37
    / 600 / 2000 keys (one launch; 4 and 7 splits merged in a cluster), 8K keys (32 splits and the combine; one
    32-key step a warp), 8,203 keys (a chunk edge inside a tile) and 32,800 keys (the long ring: several steps a
    warp), page sizes 16 and 48, G = 3 and 8, launched early and plainly, with and without static tables."""
    monkeypatch.setenv("ORTKV_PAGED_U4_ROW_WARPS", "8")
    monkeypatch.setenv("ORTKV_CUDA_EARLY", early)
    kw = dict(D=64, dtype="float16", page_format="INT4", static_tables=static)
    for L in (37, 600, 2000, 8192, 8203, 32800):
        _attn_case(rng, [PageFormat.INT4], B=1, T=T, lengths=[L], PS=16, NL=1, layer=0, **kw)
    _attn_case(rng, [PageFormat.INT4], B=1, T=T, lengths=[4100], PS=48, H=2, G=8, **kw)


def _single_row_kind(kind, dtype, mixed):
    """The page formats and the node's page_format of a single-row test's kind ("mixed": the formats `mixed`)."""
    if kind == "mixed":
        return mixed, None
    fmt = PageFormat[kind] if kind != "16bit" else PageFormat.F16 if dtype == "float16" else PageFormat.BF16
    return [fmt], fmt.name


def _row_step(monkeypatch, kind):
    """A single-row test's kind "INT8_row32": INT8 pages promised, the uniform INT8 kernel's single rows in 32-key
    steps (ORTKV_PAGED_INT8_ROW_STEP=32, Note [Paged CUDA uniform INT8]; "INT8": their default 64-key steps);
    "INT4_w8" / "INT8_w8": INT4 / INT8 pages promised, the uniform kernel's single rows in 8 warps a block and 32-key
    steps (ORTKV_PAGED_U4_ROW_WARPS=8 / ORTKV_PAGED_U8_ROW_WARPS=8, Note [Uniform INT4 single-row warps]); the kind
    without that suffix."""
    for name in ("ORTKV_PAGED_INT8_ROW_STEP", "ORTKV_PAGED_U4_ROW_WARPS", "ORTKV_PAGED_U8_ROW_WARPS"):
        monkeypatch.delenv(name, raising=False)
    if kind.endswith("_row32"):
        monkeypatch.setenv("ORTKV_PAGED_INT8_ROW_STEP", "32")
        return kind[: -len("_row32")]
    if kind.endswith("_w8"):
        base = kind[: -len("_w8")]
        monkeypatch.setenv("ORTKV_PAGED_U4_ROW_WARPS" if base == "INT4" else "ORTKV_PAGED_U8_ROW_WARPS", "8")
        return base
    return kind


@pytest.mark.parametrize("kind", ["mixed", "16bit", "INT4", "INT4_w8", "INT8", "INT8_row32", "INT8_w8"])
@pytest.mark.parametrize("L", [37, 600, 2000], ids=["one_split", "cluster4", "cluster7"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dtype,D", [("float16", 64), ("bfloat16", 128)])
@pytest.mark.parametrize("early", ["1", "0"], ids=["early", "plain"])
def test_attention_single_row_one_launch_and_cluster_merge(rng, monkeypatch, kind, L, T, dtype, D, early):
    """One batch row, its page table two pages wider than the row (the splits come from the table's width): L = 37,
    one split, the node is one launch (Note [Paged CUDA one-launch report]); L = 600 / 2000, 4 / 7 splits (chunks of
    128 keys, Note [Cluster split chunks]) merged inside a thread-block cluster (Note [Paged CUDA cluster merge];
    both kernels cluster 2..8 splits;
    before sm_90, or where the cluster launch is refused, the partials and the combine). Against the reference:
    every format in the row ("mixed", the every-format kernel), the queries' own 16-bit pages promised (the uniform
    kernel) or INT4 / INT8 pages promised (the uniform INT4 / INT8 kernels under float16 queries; INT8: T = 1 in the
    INT8 kernel's 64-key steps, INT8 row32: in its 32-key steps, ORTKV_PAGED_INT8_ROW_STEP=32); launched early
    (Note [CUDA attention early start]) or plainly (ORTKV_CUDA_EARLY=0: the cluster launch without the programmatic
    attribute, whose griddepcontrol.wait then returns at once)."""
    kind = _row_step(monkeypatch, kind)
    monkeypatch.setenv("ORTKV_CUDA_EARLY", early)
    fmts, page_format = _single_row_kind(kind, dtype, ALL)
    _attn_case(rng, fmts, B=1, T=T, lengths=[L], PS=16, D=D, NL=1, layer=0, dtype=dtype, page_format=page_format)


@pytest.mark.parametrize("static", [None, 1], ids=["tables", "static_tables"])
@pytest.mark.parametrize("kind", ["mixed", "16bit", "INT4", "INT4_w8", "INT8", "INT8_row32", "INT8_w8"])
@pytest.mark.parametrize("L,B", [(37, 1), (600, 1), (2000, 1), (8203, 3)])
@pytest.mark.parametrize("T", [1, 5])
def test_attention_static_tables(rng, monkeypatch, static, kind, L, B, T):
    """Note [Paged CUDA static tables]: with static_tables = 1 the kernels keep the pages they resolved before
    griddepcontrol.wait (no second look at the late pages). Against the reference and byte for byte the node
    without the attribute, on one split, 4 / 7 splits in a cluster and 8K-key rows: every format in the rows (the
    every-format kernel), F16 promised (the uniform kernel), INT4 and INT8 pages."""
    kind = _row_step(monkeypatch, kind)
    fmts, page_format = _single_row_kind(kind, "float16", ALL)
    lengths = [L - 7 * b for b in range(B)]
    seed = int(rng.integers(1 << 30))
    outs = [_attn_case(np.random.default_rng(seed), fmts, B=B, T=T, lengths=lengths, PS=16, NL=1, layer=0,
                       page_format=page_format, static_tables=st) for st in (None, static)]
    assert outs[0].tobytes() == outs[1].tobytes()


def _single_row_table(rng, monkeypatch, kind, W, NL, H, PS, D):
    """One batch row over a table of W pages of PS keys, all used, of the kind's formats (_row_step's variable set):
    the pool, directory, table and the node's page_format."""
    kind = _row_step(monkeypatch, kind)
    fmts, page_format = _single_row_kind(kind, "float16", [PageFormat.F16, PageFormat.INT8, PageFormat.INT4])
    pool, directory = build_pool(rng, [fmts[i % len(fmts)] for i in range(W)], num_layers=NL, kv_heads=H,
                                 page_size=PS, head_size=D)
    return pool, directory, table_for([list(range(W))], W), page_format


@pytest.mark.parametrize("static", [None, 1], ids=["tables", "static_tables"])
@pytest.mark.parametrize("kind", ["mixed", "16bit", "INT4", "INT4_w8", "INT8", "INT8_row32", "INT8_w8"])
@pytest.mark.parametrize("W", [3, 40, 128], ids=["one_split", "cluster4", "cluster8"])
@pytest.mark.parametrize("T", [1, 5])
def test_attention_single_row_reports_the_first_failure(rng, monkeypatch, kind, W, T, static):
    """One batch row over a table of W pages of 16 keys, all used: the last query token reaches the first key of the
    last page, the others stop before it. With one split (W = 3) the block of the last token reports (Note [Paged CUDA
    one-launch report]); with 4 / 8 splits (W = 40 / 128) the last page lies in the last split of a cluster and
    entry 5 in the first, and rank 0 of the last token's cluster reports the smallest of its ranks' keys (Note [Paged
    CUDA cluster merge], every kernel). Each refusal is reported once, with the row and
    the page, the smallest first (the CPU plan's order); the pool is untouched and the output finite; with nothing
    wrong the output is the reference's. The last page holds `start`'s row, resolved before the wait: with
    static_tables (Note [Paged CUDA static tables]) that first look is the report."""
    NL, H, G, PS, D = 1, 3, 3, 16, 64
    pool, directory, table, page_format = _single_row_table(rng, monkeypatch, kind, W, NL, H, PS, D)
    start = (W - 1) * PS - (T - 1)
    q = _rand(rng, (1, T, H * G * D), "float16")
    kw = dict(num_heads=H * G, kv_heads=H, layer=0, num_layers=NL, page_size=PS, dtype="float16",
              page_format=page_format, static_tables=static)
    before = pool.copy()

    def run(table, directory, start):
        out, after, err = cuda_attention(q, pool, directory, table, start, **kw)
        assert after.tobytes() == before.tobytes()
        assert np.isfinite(out).all()
        assert _ortkv.cuda_take_error() is None  # reported once, taken once
        return out, err

    out, err = run(table, directory, start)
    assert err is None, err
    want = paged_cache_attention_ref(q, before, directory, table, [start], num_heads=H * G, kv_num_heads=H, layer=0,
                                     num_layers=NL, page_size=PS)
    np.testing.assert_allclose(out, want, rtol=2e-3, atol=2e-3)
    missing = table.copy()
    missing[0, W - 1] = -1  # seen by the last token only (and by the last split)
    _, err = run(missing, directory, start)
    assert err is not None and "PagedCacheAttention node 'attn'" in err and "row 0" in err, err
    assert "the entry is -1 (no page)" in err, err
    first = min(5, W - 2)  # rank 0's pages; with one split the same block's
    bad_format = directory.copy()
    bad_format[first, 0] = 9
    _, err = run(missing, bad_format, start)
    assert err is not None and "row 0" in err and "format 9, not a page format" in err, err
    assert "the entry is -1" not in err, err
    _, err = run(table, directory, W * PS - T + 1)
    assert err is not None and f"exceeds the page table's capacity of {W * PS} tokens ('page_table')" in err, err


@pytest.mark.parametrize("kind", ["mixed", "16bit", "INT4", "INT8"])
@pytest.mark.parametrize("W", [40, 128], ids=["cluster4", "cluster8"])
def test_attention_cluster_nan_is_no_failure(rng, monkeypatch, kind, W):
    """Note [Cluster merge flag]: a clustered block with a bad page leaves l = NaN for rank 0, which then reads its
    ranks' failure keys. A NaN that comes from the data (here query head 0, whose l is NaN in every rank) takes the
    same path and must report nothing: no deferred error, the pool untouched, every other head's output the
    reference's (head 0's follows from NaN scores and is not checked). With one row of W pages of 16 keys (4 / 8
    splits in a cluster)."""
    NL, H, G, PS, D = 1, 3, 3, 16, 64
    pool, directory, table, page_format = _single_row_table(rng, monkeypatch, kind, W, NL, H, PS, D)
    start = W * PS - 1
    q = _rand(rng, (1, 1, H * G * D), "float16")
    q[0, 0, 5] = np.nan  # query head 0 (KV head 0's first): every rank of that cluster sees its l NaN
    before = pool.copy()
    out, after, err = cuda_attention(q, pool, directory, table, start, num_heads=H * G, kv_heads=H, layer=0,
                                     num_layers=NL, page_size=PS, dtype="float16", page_format=page_format,
                                     static_tables=1)
    assert err is None, err
    assert _ortkv.cuda_take_error() is None
    assert after.tobytes() == before.tobytes()
    heads = out.reshape(H * G, D)
    want = paged_cache_attention_ref(np.nan_to_num(q), before, directory, table, [start], num_heads=H * G,
                                     kv_num_heads=H, layer=0, num_layers=NL, page_size=PS).reshape(H * G, D)
    np.testing.assert_allclose(heads[1:], want[1:], rtol=2e-3, atol=2e-3)


def _rows_case(rng, kind, B, W, T, NL=1, H=3, G=3, PS=16, D=64):
    """B rows over their own W pages of 16 keys each (a table of W entries: one split), every key used by the last
    token; the pool, directory, table, start (one per row) and queries."""
    fmts, page_format = _single_row_kind(kind, "float16", [PageFormat.F16, PageFormat.INT8, PageFormat.INT4])
    pool, directory = build_pool(rng, [fmts[i % len(fmts)] for i in range(B * W)], num_layers=NL, kv_heads=H,
                                 page_size=PS, head_size=D)
    table = table_for([list(range(b * W, (b + 1) * W)) for b in range(B)], W)
    start = np.full(B, (W - 1) * PS - (T - 1), np.int64)
    q = _rand(rng, (B, T, H * G * D), "float16")
    kw = dict(num_heads=H * G, kv_heads=H, layer=0, num_layers=NL, page_size=PS)
    return pool, directory, table, start, q, page_format, kw


def _rows_scenarios(table, directory, start, W, PS):
    """(name, table, directory, start, the rows the report must name or None): nothing wrong, one row's last page
    gone, two rows bad (the smaller row is the report, though its bad page comes later in its table), nothing wrong
    again (the node's report words are back to their start), a row's start past the table."""
    one = table.copy()
    one[2, W - 1] = -1
    two = table.copy()
    two[3, 0] = -1
    two[1, W - 1] = -1
    fmt = directory.copy()
    fmt[table[3, 0], 0] = 9
    late = start.copy()
    late[2] = W * PS
    return [("clean", table, directory, start, None), ("row 2", one, directory, start, "row 2"),
            ("rows 1 and 3", two, directory, start, "row 1"), ("clean again", table, directory, start, None),
            ("row 3 format", table, fmt, start, "row 3"), ("row 2 start", table, directory, late, "row 2"),
            ("clean at last", table, directory, start, None)]


def _check_rows_run(where, out, err, want_row, q, pool, dirs, tab, st, kw, B, PS):
    """One scenario's run: finite output; with nothing wrong no report and the reference's output, else a report
    of this node naming exactly `want_row` among the B rows."""
    assert np.isfinite(out).all(), where
    if want_row is None:
        assert err is None, (where, err)
        want = paged_cache_attention_ref(q, pool, dirs, tab, st, num_heads=kw["num_heads"],
                                         kv_num_heads=kw["kv_heads"], layer=0, num_layers=1, page_size=PS)
        np.testing.assert_allclose(out, want, rtol=2e-3, atol=2e-3, err_msg=str(where))
    else:
        assert err is not None and "PagedCacheAttention node 'attn'" in err, (where, err)
        assert want_row in err and all(f"row {r}" not in err for r in range(B) if f"row {r}" != want_row), \
            (where, err)


@pytest.mark.parametrize("static", [None, 1], ids=["tables", "static_tables"])
@pytest.mark.parametrize("kind", ["mixed", "16bit", "INT4", "INT8"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("early", ["1", "0"], ids=["early", "plain"])
def test_attention_several_rows_one_split_last_block_reports(rng, monkeypatch, kind, T, static, early):
    """Four rows, one split (a table of 3 pages): no block can see every row, so the blocks count themselves into
    the node's two report words and the last one reports the smallest failure key (Note [Paged CUDA last block
    reports]; before, a second kernel scanned the blocks' keys). One session (one node, its words reused), run after
    run: each refusal reported once, naming the smallest bad row (the CPU plan's order), the pool untouched and the
    output finite; a clean run after a refused one reports nothing and matches the reference (the words were reset);
    launched early and plainly, every kernel (mixed formats, the uniform 16-bit kernel, INT4, INT8)."""
    monkeypatch.setenv("ORTKV_CUDA_EARLY", early)
    B, W, PS = 4, 3, 16
    pool, directory, table, start, q, page_format, kw = _rows_case(rng, kind, B, W, T)
    before = pool.copy()
    for name, tab, dirs, st, want_row in _rows_scenarios(table, directory, start, W, PS):
        out, after, err = cuda_attention(q, pool, dirs, tab, st, dtype="float16", page_format=page_format,
                                         static_tables=static, **kw)
        assert after.tobytes() == before.tobytes(), name
        assert _ortkv.cuda_take_error() is None, name  # reported once
        _check_rows_run(name, out, err, want_row, q, before, dirs, tab, st, kw, B, PS)


@pytest.mark.parametrize("kind", ["mixed", "16bit"])
def test_attention_several_rows_one_split_reports_in_a_cuda_graph(rng, kind):
    """The same scenarios replayed from one captured CUDA graph (enable_cuda_graph, every input in fixed device
    buffers changed in place): the node's report words persist across replays, so each replay must leave them as
    the next expects (Note [Paged CUDA last block reports])."""
    B, W, T, PS = 4, 3, 1, 16
    pool, directory, table, start, q, page_format, kw = _rows_case(rng, kind, B, W, T)
    sess = _session(attention_model("float16", kw["num_heads"], kw["kv_heads"], 0, 1, PS, page_format=page_format,
                                    static_tables=1), graph=True)
    dv = {"query": _dev(q), "pool": _dev(pool), "directory": _dev(directory), "page_table": _dev(table),
          "start": _dev(start)}
    types = {"query": TP.FLOAT16, "pool": TP.UINT8, "directory": TP.INT64, "page_table": TP.INT32, "start": TP.INT64}
    io = sess.io_binding()
    for name, val in dv.items():
        _bind(io, name, val, types[name], val.shape())
    out = _dev(np.zeros(q.shape, np.float16))
    _bind(io, "out", out, TP.FLOAT16, q.shape, output=True)
    scenarios = _rows_scenarios(table, directory, start, W, PS)
    for rnd in range(3):  # the first runs are ORT's uncaptured ones and the capture, the rest replays
        for name, tab, dirs, st, want_row in scenarios:
            dv["page_table"].update_inplace(np.ascontiguousarray(tab))
            dv["directory"].update_inplace(np.ascontiguousarray(dirs))
            dv["start"].update_inplace(np.ascontiguousarray(st))
            sess.run_with_iobinding(io)
            _check_rows_run((rnd, name), out.numpy().astype(np.float32), _ortkv.cuda_take_error(), want_row, q,
                            pool, dirs, tab, st, kw, B, PS)
    assert dv["pool"].numpy().tobytes() == pool.tobytes()


@pytest.mark.parametrize("D,T", [(64, 1), (128, 5)])
def test_attention_early_launch_equals_plain_launch(monkeypatch, D, T):
    """Note [CUDA attention early start]: the v3 kernel launched as a programmatic dependent (the default on
    sm_90+: a block resolves the pages that end before `start` before its wait) gives the same bytes as a plain
    launch (ORTKV_CUDA_EARLY=0), every format in one pool, rows whose step straddles a page."""
    outs = {}
    for early in ("0", "1"):
        monkeypatch.setenv("ORTKV_CUDA_EARLY", early)
        outs[early] = _attn_case(np.random.default_rng(7), ALL, B=3, T=T, lengths=[8203, 37, 16 + T], PS=16, D=D,
                                 NL=1, layer=0)
    assert outs["0"].tobytes() == outs["1"].tobytes()


def _run_bound(sess, q, pool, directory, table, start, *, table_name="page_table", start_name="start",
               directory_name="directory"):
    """One run of a float16 attention_model session (its page table / start inputs possibly renamed, for a node
    before that computes them) with every tensor bound on the device; the output as float32, no deferred error."""
    io = sess.io_binding()
    keep = [(_dev(q), "query", TP.FLOAT16, q.shape), (_dev(pool), "pool", TP.UINT8, pool.shape),
            (_dev(directory), directory_name, TP.INT64, directory.shape),
            (_dev(table), table_name, TP.INT32, table.shape), (_dev(start), start_name, TP.INT64, start.shape)]
    for v, name, t, shape in keep:
        _bind(io, name, v, t, shape)
    out = _dev(np.zeros(q.shape, np.float16))
    _bind(io, "out", out, TP.FLOAT16, q.shape, output=True)
    sess.run_with_iobinding(io)
    assert _ortkv.cuda_take_error() is None
    return out.numpy().astype(np.float32)


def _early_run_matches(sess, rng, pool, ref_pool, directory, table, lengths, what, *, H, G, PS, NL, D, bound_start=None,
                       **names):
    """One run of the early-launch tests: rows past each length poisoned, the output finite (`what` names the NaN
    that would have been read) and the oracle's over `ref_pool` (start = lengths - 1; `bound_start`: the start
    bound instead, for a node before that computes it)."""
    start = np.array(lengths) - 1
    poison_rows(pool, directory, table, lengths, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    q = _rand(rng, (len(lengths), 1, H * G * D), "float16")
    got = _run_bound(sess, q, pool, directory, table, start if bound_start is None else bound_start, **names)
    assert np.isfinite(got).all(), what
    want = paged_cache_attention_ref(q, ref_pool, directory, table, start, num_heads=H * G, kv_num_heads=H, layer=0,
                                     num_layers=NL, page_size=PS)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3, err_msg=what)


@pytest.mark.parametrize("uniform", [None, PageFormat.F16, PageFormat.INT4, PageFormat.INT8],
                         ids=["mixed", "uniform_f16", "uniform_int4", "uniform_int8"])
def test_attention_early_launch_rereads_start_written_by_the_node_before(rng, monkeypatch, uniform):
    """`start` computed on the GPU by the node right before PagedCacheAttention (an Add: the kernel an early
    launch overlaps; Note [CUDA attention early start]). Each run's start differs from the last one's in the same
    ORT buffer, so a block that resolved pages (and issued their tiles) for the stale value before its wait must
    start over from the new one: every run reads exactly its own keys (the rest poisoned) and matches the oracle.
    uniform: pages of that one format and page_format naming it (Note [Paged CUDA uniform 16-bit]: the dense-shaped
    kernel's prologue; INT8: the uniform INT8 kernel, ORTKV_PAGED_UNIFORM_INT8=1)."""
    monkeypatch.setenv("ORTKV_PAGED_UNIFORM_INT8", "1")
    H, G, PS, NL, D = 3, 3, 16, 1, 64
    lengths_max = 8200
    kinds = [uniform] if uniform else [PageFormat.F16, PageFormat.INT8, PageFormat.INT4]
    fmts = [kinds[i % len(kinds)] for i in range(2 * (-(-lengths_max // PS)))]
    pool0, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    n = -(-lengths_max // PS)
    table = table_for([list(range(n)), list(range(n, 2 * n))], n + 1)
    sess = _session(start_from_add(attention_model("float16", H * G, H, 0, NL, PS,
                                                   page_format=uniform.name if uniform else None)))
    for lengths in ([8200, 300], [17, 8000], [4097, 4096], [8200, 8200]):
        _early_run_matches(sess, rng, pool0.copy(), pool0, directory, table, lengths,
                           f"lengths {lengths}: a poisoned row past a sequence's length was read", H=H, G=G, PS=PS,
                           NL=NL, D=D, bound_start=np.array(lengths) - 2, start_name="start_in")


@pytest.mark.parametrize("uniform", [None, PageFormat.F16, PageFormat.INT4, PageFormat.INT8],
                         ids=["mixed", "uniform_f16", "uniform_int4", "uniform_int8"])
def test_attention_early_launch_page_table_written_by_the_node_before(rng, monkeypatch, uniform):
    """The page table computed on the GPU by the node right before PagedCacheAttention (an Add), `start` the
    same in every run. Each run maps the page that holds `start` to another page, and the page the run before
    used there is filled with NaN: the page holding `start` must be resolved after the wait (Note [CUDA attention
    early start]: what the kernel before writes of it is read after the wait), never from the last run's entry.
    INT8: the uniform INT8 kernel (ORTKV_PAGED_UNIFORM_INT8=1)."""
    monkeypatch.setenv("ORTKV_PAGED_UNIFORM_INT8", "1")
    H, G, PS, NL, D, B = 3, 3, 16, 1, 64, 2
    lengths = [8200, 300]
    n = -(-max(lengths) // PS)
    kinds = [uniform] if uniform else [PageFormat.F16, PageFormat.INT8, PageFormat.INT4]
    spares = list(range(2 * n, 2 * n + 4))  # row 0's two candidates for its last page, then row 1's
    fmts = [kinds[i % len(kinds)] for i in range(2 * n + 4)]
    pool0, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    sess = _session(input_from_add(attention_model("float16", H * G, H, 0, NL, PS,
                                                   page_format=uniform.name if uniform else None),
                                   "page_table", TP.INT32, 0))
    for r in range(4):
        rows = [list(range(n)), list(range(n, 2 * n))]
        used = [spares[r % 2], spares[2 + r % 2]]
        for b in range(B):
            rows[b][(lengths[b] - 1) // PS] = used[b]
        table = table_for(rows, n + 1)
        pool = pool0.copy()
        for pid in set(spares) - set(used):
            fmt = PageFormat(int(directory[pid, 0]))
            off = int(directory[pid, 1])
            pool[off:off + slot_bytes(fmt, NL, H, PS, D)] = 0xFF
        _early_run_matches(sess, rng, pool, pool0, directory, table, lengths,
                           f"run {r}: a NaN page (the last run's, or a row past a length) was read", H=H, G=G, PS=PS,
                           NL=NL, D=D, table_name="page_table_in")


@pytest.mark.parametrize("uniform", [None, PageFormat.F16, PageFormat.INT4, PageFormat.INT8],
                         ids=["mixed", "uniform_f16", "uniform_int4", "uniform_int8"])
@pytest.mark.parametrize("lengths", [[8200, 300], [16, 33]], ids=["long", "short"])
def test_attention_early_launch_directory_written_by_the_node_before(rng, monkeypatch, uniform, lengths):
    """The directory computed on the GPU by the node right before PagedCacheAttention (an Add), the page table and
    `start` the same in every run. Each run moves the page that holds `start` to another slot (a copy of its
    bytes) and fills the slot the run before used with NaN: what the attention resolved of that page before its
    wait must be checked after it (Note [CUDA attention early start]), never kept from the last run's row. INT8: the
    uniform INT8 kernel (ORTKV_PAGED_UNIFORM_INT8=1)."""
    monkeypatch.setenv("ORTKV_PAGED_UNIFORM_INT8", "1")
    H, G, PS, NL, D, B = 3, 3, 16, 1, 64, 2
    n = -(-max(lengths) // PS)
    kinds = [uniform] if uniform else [PageFormat.F16, PageFormat.INT8, PageFormat.INT4]
    fmts = [kinds[i % len(kinds)] for i in range(2 * n)]
    pool0, directory0 = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([list(range(n)), list(range(n, 2 * n))], n + 1)
    late = [int(table[b, (lengths[b] - 1) // PS]) for b in range(B)]
    sizes = [slot_bytes(PageFormat(int(directory0[p, 0])), NL, H, PS, D) for p in late]
    # each late page gets a second slot past the pool's end, holding the same bytes
    second = []
    end = -(-len(pool0) // 16) * 16
    for size in sizes:
        second.append(end)
        end += -(-size // 16) * 16
    pool_base = np.zeros(end, np.uint8)
    pool_base[:len(pool0)] = pool0
    for p, size, off in zip(late, sizes, second):
        pool_base[off:off + size] = pool0[directory0[p, 1]:directory0[p, 1] + size]
    sess = _session(input_from_add(attention_model("float16", H * G, H, 0, NL, PS,
                                                   page_format=uniform.name if uniform else None),
                                   "directory", TP.INT64, 0))
    for r in range(4):
        directory = directory0.copy()
        pool = pool_base.copy()
        for p, size, off in zip(late, sizes, second):
            old, new = (directory0[p, 1], off) if r % 2 else (off, directory0[p, 1])
            directory[p, 1] = new
            pool[old:old + size] = 0xFF  # the slot the other runs use
        _early_run_matches(sess, rng, pool, pool, directory, table, lengths,
                           f"run {r}: a NaN slot (the last run's, or a row past a length) was read", H=H, G=G, PS=PS,
                           NL=NL, D=D, directory_name="directory_in")


def test_attention_chunks_longer_than_one_page_window(rng):
    """Pages of 4 tokens, 4 rows x 8 query tokens (few splits): a block's key chunk spans > 256 pages, so the v2
    kernel resolves its pages in several windows (Note [Paged CUDA v2])."""
    _attn_case(rng, [PageFormat.F16, PageFormat.INT8, PageFormat.INT4, PageFormat.FP8_E4M3, PageFormat.INT2,
                     PageFormat.INT4_KC], B=4, T=8, lengths=[7000, 6990, 7001, 5000], PS=4, NL=1, layer=0)


@pytest.mark.parametrize("PS", [16, 48])
@pytest.mark.parametrize("T", [1, 8])
def test_attention_format_runs_switch_the_value_layout(rng, PS, T):
    """Runs of 256 pages per format (INT4, F16, INT8, then mixed) in table order: with T = 8 (few splits) a block's
    chunk spans several 256-page windows that are uniform INT4 / INT8 (decoded into the mma registers), uniform
    F16 (the shared-memory tile) or mixed, so the accumulator's dim layout changes between windows (Note [Paged
    CUDA v3 register decode]); T = 1: many splits, chunk edges inside the runs. PS 48: not a power of two."""
    mixed = [PageFormat.INT2, PageFormat.FP8_E4M3]
    runs = [PageFormat.INT4, PageFormat.F16, PageFormat.INT8, PageFormat.INT4, PageFormat.INT8]
    lengths = [PS * 256 * 5 + 7, PS * 256 * 2 + 100, 3 * PS + 1] if PS == 16 else [PS * 256 * 3 + 5, 1000, PS + 2]
    _attn_case(rng, runs, B=3, T=T, lengths=lengths, PS=PS, NL=1, layer=0, runs=256)
    _attn_case(rng, [PageFormat.INT4, PageFormat.INT4, PageFormat.INT8] + mixed, B=2, T=T, lengths=lengths[:2], PS=PS,
               NL=1, layer=0, runs=100)


@pytest.mark.parametrize("fmt", [PageFormat.INT4, PageFormat.INT8], ids=lambda f: f.name)
@pytest.mark.parametrize("T", [1, 5])
def test_attention_register_decode_head_size_128(rng, fmt, T):
    """Head size 128 through the register decode (Note [Paged CUDA v3 register decode]: wider lane quarters, two
    words per value row, 16 n-tiles), pages of one format, plus runs that switch to F16 windows; G = 8 too."""
    _attn_case(rng, [fmt], B=3, T=T, lengths=[16 * 300 + 3, 40, T + 1], PS=16, D=128, NL=1, layer=0, runs=256)
    _attn_case(rng, [fmt, PageFormat.F16], B=2, T=T, lengths=[16 * 600 + 9, 700], PS=16, D=128, H=2, G=8, NL=1, layer=0,
               runs=256)


def test_attention_page_size_one_takes_the_first_kernel(rng):
    """Pages of 1 token (not a multiple of 4): the first kernel, per key."""
    _attn_case(rng, [PageFormat.F16, PageFormat.INT8, PageFormat.INT4, PageFormat.FP8_E4M3, PageFormat.INT2],
               B=1, T=8, lengths=[2000], PS=1, NL=1, layer=0)


@pytest.mark.parametrize("PS,bad", [(4, 1180), (1, 700)])
def test_attention_bad_page_in_a_later_window_is_reported(rng, PS, bad):
    """A bad page past the first 256 pages of a block's chunk (PS 4: v2's second page window; PS 1: the first
    kernel): reported, nothing written, the output finite."""
    NL, H, D, T = 1, 3, 64, 8
    B, L = (4, 4800) if PS == 4 else (1, 1200)
    n = L // PS
    fmts = [PageFormat.F16, PageFormat.INT4]
    pool, directory = build_pool(rng, [fmts[i % 2] for i in range(n)], num_layers=NL, kv_heads=H, page_size=PS,
                                 head_size=D)
    table = table_for([list(range(n))] * B, n + 1)
    table[0, bad] = -1
    q = _rand(rng, (B, T, H * 3 * D), "float16")
    before = pool.copy()
    out, after, err = cuda_attention(q, pool, directory, table, np.full(B, L - T), num_heads=H * 3, kv_heads=H,
                                     layer=0, num_layers=NL, page_size=PS, dtype="float16")
    assert err is not None and "row 0" in err and "the entry is -1 (no page)" in err, err
    assert after.tobytes() == before.tobytes()
    assert np.isfinite(out).all()


def _attn_refusal_case(rng):
    NL, H, PS, D = 1, 2, 16, 64
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.INT8, PageFormat.INT4], num_layers=NL, kv_heads=H,
                                 page_size=PS, head_size=D)
    table = table_for([[0, 1], [2]], 3)
    q = _rand(rng, (2, 1, H * D), "float16")
    return pool, directory, table, q, dict(num_heads=H, kv_heads=H, layer=0, num_layers=NL, page_size=PS)


@pytest.mark.parametrize("case", ["missing", "outside", "format", "offset", "start", "negative"])
def test_attention_refusals_are_reported(rng, case):
    pool, directory, table, q, kw = _attn_refusal_case(rng)
    start = np.array([20, 5])
    frag = {"missing": "the entry is -1 (no page)", "outside": "page id 7 is outside the directory 'directory'",
            "format": "format 9, not a page format", "offset": "at offset 3, which is not a multiple of 16",
            "start": "exceeds the page table's capacity of 48 tokens ('page_table')", "negative": "is negative"}[case]
    if case == "missing":
        table[1, 0] = -1
    elif case == "outside":
        table[1, 0] = 7
    elif case == "format":
        directory[2, 0] = 9
    elif case == "offset":
        directory[2, 1] = 3
    elif case == "start":
        start[1] = 48
    else:
        start[1] = -2
    before = pool.copy()
    out, after, err = cuda_attention(q, pool, directory, table, start, dtype="float16", **kw)
    assert err is not None and "PagedCacheAttention node 'attn'" in err and "row 1" in err, err
    assert frag in err, err
    assert after.tobytes() == before.tobytes()
    assert _ortkv.cuda_take_error() is None  # taken once
    assert np.isfinite(out).all()
    # row 0 is good and its output right
    want = paged_cache_attention_ref(q[:1], before, directory, table[:1], start[:1], num_heads=kw["num_heads"],
                                     kv_num_heads=kw["kv_heads"], layer=0, num_layers=1, page_size=kw["page_size"])
    np.testing.assert_allclose(out[:1], want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("static", [None, 1], ids=["tables", "static_tables"])
@pytest.mark.parametrize("kernel", ["uniform", "v3_int4", "uniform_int8", "v3_int8", "v3", "v1"])
def test_attention_page_format_attribute_refuses_another_format(rng, monkeypatch, kernel, static):
    """A page of another format than the node's page_format promises is reported by every kernel (uniform: F16
    promised under float16 queries, an INT8 page; v3: INT4 or FP8_E4M3 promised, an F16 page; v1 (pages of 1
    token): INT4 promised, an F16 page), with the row, the page and the remedy; the pool untouched; the rows whose
    pages keep the promise right. A missing page under the uniform kernel is reported as by the others. The bad
    page holds the row's last keys (`start`'s page, resolved before the wait): with static_tables (Note [Paged
    CUDA static tables]) what was seen there is the report, with no second look. uniform_int8 / v3_int8: INT8
    promised, an F16 page, on the uniform INT8 kernel and, under ORTKV_PAGED_UNIFORM_INT8=0, on the every-format
    kernel (Note [Paged CUDA uniform INT8])."""
    monkeypatch.setenv("ORTKV_PAGED_UNIFORM_INT8", "1" if kernel == "uniform_int8" else "0")
    NL, H, D = 1, 2, 64
    PS = 1 if kernel == "v1" else 16
    good, bad = {"uniform": (PageFormat.F16, PageFormat.INT8), "v3_int4": (PageFormat.INT4, PageFormat.F16),
                 "uniform_int8": (PageFormat.INT8, PageFormat.F16), "v3_int8": (PageFormat.INT8, PageFormat.F16),
                 "v3": (PageFormat.FP8_E4M3, PageFormat.F16), "v1": (PageFormat.INT4, PageFormat.F16)}[kernel]
    n = -(-40 // PS)  # pages per row for 40 tokens
    pool, directory = build_pool(rng, [good] * (2 * n) + [bad], num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([list(range(n)), list(range(n, 2 * n))], n)
    table[1, n - 1] = 2 * n  # row 1's last page: the other format
    q = _rand(rng, (2, 1, H * D), "float16")
    start = np.array([39, 39])
    kw = dict(num_heads=H, kv_heads=H, layer=0, num_layers=NL, page_size=PS, dtype="float16", page_format=good.name,
              static_tables=static)
    before = pool.copy()
    out, after, err = cuda_attention(q, pool, directory, table, start, **kw)
    assert err is not None and "PagedCacheAttention node 'attn'" in err and "row 1" in err, err
    assert f"page {2 * n} is {bad.name}, not {good.name}, the format the node's page_format attribute promises" in err, err
    assert "Remedy: keep every page of this cache in that format" in err, err
    assert after.tobytes() == before.tobytes()
    assert np.isfinite(out).all()
    want = paged_cache_attention_ref(q[:1], before, directory, table[:1], start[:1], num_heads=H, kv_num_heads=H,
                                     layer=0, num_layers=NL, page_size=PS)
    np.testing.assert_allclose(out[:1], want, rtol=2e-3, atol=2e-3)
    if kernel in ("uniform", "uniform_int8"):
        table[1, n - 1] = -1
        out, after, err = cuda_attention(q, pool, directory, table, start, **kw)
        assert err is not None and "row 1" in err and "the entry is -1 (no page)" in err, err
        np.testing.assert_allclose(out[:1], want, rtol=2e-3, atol=2e-3)


# ---- PagedCacheUpdate ----------------------------------------------------------------------------------------
# Note [Paged CUDA resolved update]: up to 256 tokens and 2,048 row jobs, one launch whose every block checks the
# whole update and stores its share ("blocks", the default: a block per 16 store jobs, launched as a programmatic
# dependent of the kernel before on sm_90+, its pages resolved before griddepcontrol.wait), the same launched plainly
# under ORTKV_CUDA_PAGED_UPDATE=plain ("plain"), or all of it in one block under =one ("one_block"); the memset +
# check + store kernels take larger updates, or any under =two. Tests of updates run all four.
UPDATE_PATHS = ("one_block", "blocks", "plain", "two")


@contextlib.contextmanager
def update_path(path):
    old = os.environ.get("ORTKV_CUDA_PAGED_UPDATE")
    os.environ["ORTKV_CUDA_PAGED_UPDATE"] = {"two": "two", "one_block": "one", "blocks": "", "plain": "plain"}[path]
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ORTKV_CUDA_PAGED_UPDATE", None)
        else:
            os.environ["ORTKV_CUDA_PAGED_UPDATE"] = old


def _update_case(rng, formats, *, B, T, positions, NL=2, H=3, PS=16, D=64, layer=1, dtype="float16"):
    n_pages = [-(-(p + T) // PS) for p in positions]
    fmts = [formats[i % len(formats)] for i in range(sum(n_pages))]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    ids = list(rng.permutation(len(fmts)))
    table = table_for([[int(ids.pop()) for _ in range(n)] for n in n_pages], max(n_pages) + 1)
    key, value = _rand(rng, (B, T, H * D), dtype), _rand(rng, (B, T, H * D), dtype)
    return pool, directory, table, key, value, np.array(positions), dict(layer=layer, num_layers=NL, kv_heads=H,
                                                                         page_size=PS)


@pytest.mark.parametrize("fmt", DIRECT, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_update_bytes_equal_cpu_and_reference(rng, fmt, dtype):
    """Ragged rows crossing page boundaries: the CUDA bytes equal the CPU op's and the oracle's exactly."""
    pool, directory, table, key, value, pos, kw = _update_case(rng, [fmt], B=3, T=5, positions=[0, 14, 33],
                                                               dtype=dtype)
    with update_path("one_block"):  # 90 row jobs in one block under ORTKV_CUDA_PAGED_UPDATE=one
        got, err = cuda_update(pool, directory, table, key, value, pos, dtype=dtype, **kw)
    assert err is None, err
    for path in ("blocks", "two"):  # 6 blocks by default; the two kernels
        with update_path(path):
            got2, err = cuda_update(pool, directory, table, key, value, pos, dtype=dtype, **kw)
        assert err is None, (path, err)
        assert got2.tobytes() == got.tobytes(), path
    cpu = pool.copy()
    run_update(cpu, directory, table, key, value, pos, dtype=dtype, **kw)
    assert got.tobytes() == cpu.tobytes()
    want = paged_cache_update_ref(pool, directory, table, _logical_arg(key, dtype), _logical_arg(value, dtype), pos,
                                  kv_num_heads=kw["kv_heads"], layer=kw["layer"], num_layers=kw["num_layers"],
                                  page_size=kw["page_size"], logical="bfloat16" if dtype == "bfloat16" else None)
    assert got.tobytes() == want.tobytes()
    assert got.tobytes() != pool.tobytes()


@pytest.mark.parametrize("PS,D,T", [(16, 64, 1), (64, 128, 1), (64, 128, 5), (16, 128, 40)])
def test_update_all_direct_formats_mixed(rng, PS, D, T):
    pool, directory, table, key, value, pos, kw = _update_case(rng, DIRECT, B=4, T=T, positions=[0, 3, PS - 1, 2 * PS],
                                                               PS=PS, D=D)
    got, err = cuda_update(pool, directory, table, key, value, pos, dtype="float16", **kw)
    assert err is None, err
    cpu = pool.copy()
    run_update(cpu, directory, table, key, value, pos, dtype="float16", **kw)
    assert got.tobytes() == cpu.tobytes()


@pytest.mark.parametrize("path", UPDATE_PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmts", [DIRECT, [PageFormat.INT4], [PageFormat.INT8]], ids=["mixed", "INT4", "INT8"])
def test_update_zero_rows_and_signed_zero_minimum_match_cpu(rng, fmts, dtype, path):
    """Rows of zeros (both signs), a row's least or greatest value both -0.0 and 0.0 (either first), constant rows
    and a row of values ~1e-6 (float16 subnormal scales and minima: ScalesOf's directed conversions against the
    CPU's): the warp reductions keep the CPU's tie order (the first element wins), on every path; 16-bit sources take
    the resolved kernel's preloaded rows (Note [Resolved update preload]: each warp's first job checked and stored
    from its registers)."""
    pool, directory, table, key, value, pos, kw = _update_case(rng, fmts, B=2, T=3, positions=[0, 5], dtype=dtype)
    key[0, 0] = 0.0
    key[0, 1] = -0.0
    key[0, 1, ::3] = 0.0
    value[1, 2] = 1.5
    key[1, 2] = (rng.standard_normal(key.shape[-1]) * 1e-6).astype(key.dtype)  # scales among float16's subnormals
    for t, (first, second) in enumerate([(-0.0, 0.0), (0.0, -0.0)]):  # elements 5 and 40 of every head (64 each)
        value[0, t] = np.abs(value[0, t])  # the least value: zero of either sign
        value[1, t] = -np.abs(value[1, t])  # the greatest
        for b in range(2):
            value[b, t, 5::64], value[b, t, 40::64] = first, second
    with update_path(path):
        got, err = cuda_update(pool, directory, table, key, value, pos, dtype=dtype, **kw)
    assert err is None, err
    cpu = pool.copy()
    run_update(cpu, directory, table, key, value, pos, dtype=dtype, **kw)
    assert got.tobytes() == cpu.tobytes()


def _update_refusal(rng, mutate, fragment, code="E_INPUT", formats=(PageFormat.INT8, PageFormat.F16, PageFormat.INT4)):
    """Rows 0..2 at positions 0, 15 (crossing a page), 4, two tokens each; `mutate` breaks one thing (and may
    return new positions). The pool bytes must come back unchanged and the report name the problem, on both
    update paths (Note [Paged CUDA resolved update]: 36 row jobs, 3 blocks by default)."""
    pool, directory, table, key, value, pos, kw = _update_case(rng, list(formats), B=3, T=2, positions=[0, 15, 4],
                                                               NL=1, layer=0)
    pos = mutate(pool, directory, table, key, value, pos)
    pos = pos if pos is not None else np.array([0, 15, 4])
    before = pool.copy()
    for path in UPDATE_PATHS:
        with update_path(path):
            after, err = cuda_update(pool, directory, table, key, value, pos, dtype="float16", **kw)
        assert err is not None and "PagedCacheUpdate node 'upd'" in err, (path, err)
        assert f"[ortkv:{code}]" in err and fragment in err and "Nothing was written" in err, (path, err)
        assert after.tobytes() == before.tobytes(), f"a refused update changed the pool ({path})"
        assert _ortkv.cuda_take_error() is None


@pytest.mark.parametrize("path", UPDATE_PATHS)
def test_update_large_refusal_and_bytes(rng, path):
    """240 row jobs (15 blocks of the resolved kernel, 16 warps of one block 15 jobs each, or the check and store
    kernels): a non-finite value in the last row job (INT8 and INT4 pages: scaled, so it cannot be encoded) is
    refused with nothing written, and without it the bytes equal the CPU op's."""
    pool, directory, table, key, value, pos, kw = _update_case(rng, [PageFormat.INT8, PageFormat.INT4],
                                                               B=4, T=10, positions=[0, 15, 4, 30], NL=1, layer=0)
    bad = value.copy()
    bad[3, 9, 190] = np.nan  # row 3, token 9 (position 39), head 2
    with update_path(path):
        after, err = cuda_update(pool, directory, table, key, bad, pos, dtype="float16", **kw)
    assert err is not None and "'value' [row 3, position 39, head 2]" in err and "Nothing was written" in err, err
    assert after.tobytes() == pool.tobytes()
    with update_path(path):
        got, err = cuda_update(pool, directory, table, key, value, pos, dtype="float16", **kw)
    assert err is None, err
    cpu = pool.copy()
    run_update(cpu, directory, table, key, value, pos, dtype="float16", **kw)
    assert got.tobytes() == cpu.tobytes() and got.tobytes() != pool.tobytes()


@pytest.mark.parametrize("path", UPDATE_PATHS)
@pytest.mark.parametrize("fmt", [PageFormat.INT8, PageFormat.INT4], ids=lambda f: f.name)
def test_update_refuses_scale_overflow_on_each_path(rng, path, fmt):
    """Note [Resolved update check]: a float32 value whose row scale passes float16's range (1e9 / 127 for INT8;
    INT4's offset and range likewise) is refused on every update path, the resolved kernel's warp check included,
    naming the row and head, nothing written; with the largest value that fits (60000: scale 60000 / 127, and
    INT4's range 120000 / 15) the bytes equal the CPU op's."""
    pool, directory, table, key, value, pos, kw = _update_case(rng, [fmt], B=3, T=2, positions=[0, 17, 5], NL=1,
                                                               layer=0, dtype="float32")
    bad = value.copy()
    bad[1, 1, 64 + 63] = 1e9 if fmt == PageFormat.INT8 else -1e9  # row 1, token 1 (position 18), head 1, last lane
    with update_path(path):
        after, err = cuda_update(pool, directory, table, key, bad, pos, dtype="float32", **kw)
    assert err is not None and "'value' [row 1, position 18, head 1]" in err and "beyond float16" in err, err
    assert after.tobytes() == pool.tobytes()
    edge = value.copy()
    edge[1, 1, 64:128] = np.where(np.arange(64) % 2 == 0, 60000.0, -60000.0).astype(np.float32)
    with update_path(path):
        got, err = cuda_update(pool, directory, table, key, edge, pos, dtype="float32", **kw)
    assert err is None, err
    cpu = pool.copy()
    run_update(cpu, directory, table, key, edge, pos, dtype="float32", **kw)
    assert got.tobytes() == cpu.tobytes()


@pytest.mark.parametrize("path", UPDATE_PATHS)
@pytest.mark.parametrize("name", ["position", "page_table", "directory"])
def test_update_reads_inputs_written_by_the_node_before(rng, name, path):
    """The position, the page table or the directory computed on the GPU by the node right before PagedCacheUpdate
    (an Add into the same ORT buffer every run; Note [Paged CUDA resolved update]: the resolution before the wait is
    read again after it). Each run writes other rows (positions), other pages (a table permuted) or moves pages
    (directory rows swapped); its bytes equal the CPU op's on the values the Add computed, never the last run's."""
    B, T, H, PS, NL = 3, 1, 3, 16, 1
    fmts = [PageFormat.F16, PageFormat.INT8] * 6
    pool0, directory0 = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=64)
    addend = {"position": 1, "page_table": 0, "directory": 0}[name]
    kind = {"position": TP.INT64, "page_table": TP.INT32, "directory": TP.INT64}[name]
    sess = _session(input_from_add(update_model("float16", 0, NL, H, PS), name, kind, addend))
    for r in range(4):
        pos = np.array([3 + 5 * r, 17 + r, 31 - r], np.int64)
        ids = rng.permutation(len(fmts))[:3 * B]
        table = table_for([[int(i) for i in ids[3 * b:3 * b + 3]] for b in range(B)], 3)
        directory = directory0.copy()
        if name == "directory" and r % 2:  # row 0's page swaps slots with another page of its format
            a = int(table[0, pos[0] // PS])
            c = next(i for i in range(len(fmts)) if i != a and directory0[i, 0] == directory0[a, 0])
            directory[[a, c]] = directory[[c, a]]
        key, value = _rand(rng, (B, T, H * 64), "float16"), _rand(rng, (B, T, H * 64), "float16")
        kw = dict(dtype="float16", layer=0, num_layers=NL, kv_heads=H, page_size=PS)
        with update_path(path):  # the Add adds 0 to a table or directory, 1 to the bound positions
            got, err = cuda_update(pool0, directory, table, key, value, pos - addend if name == "position" else pos,
                                   sess=sess, computed=name, **kw)
        assert err is None, err
        cpu = pool0.copy()
        run_update(cpu, directory, table, key, value, pos, **kw)
        assert got.tobytes() == cpu.tobytes(), f"run {r}: the update did not write what the Add computed"


@pytest.mark.parametrize("T,B", [(257, 1), (129, 2)])
def test_update_past_the_resolved_limits_takes_the_two_kernels(rng, T, B):
    """More than 256 tokens (257 x 1: 1,542 row jobs; 129 x 2: 258 tokens) is past the resolved kernel's slots:
    the default takes the check and store kernels, the bytes equal the CPU op's, and a page row written twice by
    the last token is refused with nothing written."""
    PS = 16
    positions = [0] if B == 1 else [0, 200]
    pool, directory, table, key, value, pos, kw = _update_case(rng, [PageFormat.F16, PageFormat.INT8], B=B, T=T,
                                                               positions=positions, NL=1, layer=0, PS=PS)
    with update_path("blocks"):
        got, err = cuda_update(pool, directory, table, key, value, pos, dtype="float16", **kw)
    assert err is None, err
    cpu = pool.copy()
    run_update(cpu, directory, table, key, value, pos, dtype="float16", **kw)
    assert got.tobytes() == cpu.tobytes() and got.tobytes() != pool.tobytes()
    last = (positions[-1] + T - 1) // PS
    table[B - 1, last] = table[0, 0]  # the last token's page is row 0's first page: its row written twice or more
    with update_path("blocks"):
        after, err = cuda_update(pool, directory, table, key, value, pos, dtype="float16", **kw)
    assert err is not None and "both write row 0 of page" in err and "Nothing was written" in err, err
    assert after.tobytes() == pool.tobytes()


def test_update_long_prefill_row_owners(rng):
    """Note [Paged CUDA row owners]: 8 rows x 600 tokens (4,800 tokens: past the resolved kernel, the claim + check +
    store kernels) write the CPU op's bytes; a page row written twice, by another row (a shared page) or by the same
    row (a table listing a page twice), is refused with the CPU op's message (the first writer's row, the page and
    its row), nothing written."""
    PS, B, T = 16, 8, 600
    positions = [0, 16, 5, 0, 100, 33, 0, 7]
    pool, directory, table, key, value, pos, kw = _update_case(rng, [PageFormat.F16, PageFormat.INT8], B=B, T=T,
                                                               positions=positions, NL=1, layer=0, PS=PS)
    got, err = cuda_update(pool, directory, table, key, value, pos, dtype="float16", **kw)
    assert err is None, err
    cpu = pool.copy()
    run_update(cpu, directory, table, key, value, pos, dtype="float16", **kw)
    assert got.tobytes() == cpu.tobytes() and got.tobytes() != pool.tobytes()
    for b, e, b2, e2 in ((7, (7 + T - 1) // PS, 2, 3), (4, 20, 4, 7)):  # entry (b, e) lists row b2's page e2
        t = table.copy()
        t[b, e] = table[b2, e2]
        with pytest.raises(Exception) as cpu_err:
            run_update(pool.copy(), directory, t, key, value, pos, dtype="float16", **kw)
        want = re.search(r"rows \d+ and \d+ both write row \d+ of page \d+", str(cpu_err.value)).group(0)
        after, err = cuda_update(pool, directory, t, key, value, pos, dtype="float16", **kw)
        assert err is not None and want in err and "Nothing was written" in err, (want, err)
        assert after.tobytes() == pool.tobytes()


def test_update_refuses_missing_page(rng):
    def m(pool, d, t, k, v, p):
        t[2, 0] = -1
    _update_refusal(rng, m, "row 2 (position 4, 2 tokens) needs page 0 of its page table 'page_table' but the entry is -1")


def test_update_refuses_page_outside_directory(rng):
    def m(pool, d, t, k, v, p):
        t[1, 1] = 99
    _update_refusal(rng, m, "page id 99 is outside the directory 'directory'")


def test_update_refuses_bad_offset_and_format(rng):
    def m(pool, d, t, k, v, p):
        d[int(t[0, 0]), 1] = 8
    _update_refusal(rng, m, "at offset 8, which is not a multiple of 16")

    def m2(pool, d, t, k, v, p):
        d[int(t[0, 0]), 0] = 8
    _update_refusal(rng, m2, "format 8, not a page format")


def test_update_refuses_keys_into_kc_page(rng):
    def m(pool, d, t, k, v, p):
        d[int(t[1, 0]), 0] = int(PageFormat.INT4_KC)
    _update_refusal(rng, m, "INT4_KC: its keys are scaled per channel", formats=[PageFormat.F16])  # F16 slots hold it


def test_update_refuses_capacity_and_negative_position(rng):
    # the table has 3 columns of 16 tokens
    _update_refusal(rng, lambda *a: np.array([0, 15, 47]), "position 47 + tokens 2 = 49 exceeds the page table's "
                                                           "capacity of 48 tokens", code="E_CAPACITY")
    _update_refusal(rng, lambda *a: np.array([0, -1, 4]), "position -1 for row 1 is negative")


def test_update_refuses_shared_page_row(rng):
    def m(pool, d, t, k, v, p):
        t[2, 0] = t[0, 0]  # rows 0 and 2 both write page t[0, 0] rows 0..1 / 4..5: make them collide
        return np.array([0, 15, 0])
    _update_refusal(rng, m, "rows 0 and 2 both write row 0 of page")


def test_update_refuses_non_finite_after_valid_rows(rng):
    def m(pool, d, t, k, v, p):
        v[2, 1, 70] = np.inf  # head 1 of row 2's second token; earlier rows are valid
    _update_refusal(rng, m, "'value' [row 2, position 5, head 1]", formats=[PageFormat.INT8])


def test_update_refuses_unaliased_output(rng):
    pool, directory, table, key, value, pos, kw = _update_case(rng, [PageFormat.INT8], B=1, T=1, positions=[0])
    sess = update_session("float16", kw["layer"], kw["num_layers"], kw["kv_heads"], kw["page_size"])
    io = sess.io_binding()
    pv, other = _dev(pool), _dev(np.zeros_like(pool))
    _bind(io, "pool", pv, TP.UINT8, pool.shape)
    for name, arr, t in [("directory", directory, TP.INT64), ("page_table", table, TP.INT32),
                         ("key", key, TP.FLOAT16), ("value", value, TP.FLOAT16),
                         ("position", pos.astype(np.int64), TP.INT64)]:
        v = _dev(arr)
        io.bind_ortvalue_input(name, v)
    _bind(io, "pool_out", other, TP.UINT8, pool.shape, output=True)
    with pytest.raises(Exception, match=r"E_ALIAS.*is not the storage of the pool 'pool'"):
        sess.run_with_iobinding(io)
    assert pv.numpy().tobytes() == pool.tobytes()


def test_update_refuses_write_into_protected_range(rng):
    pool, directory, table, key, value, pos, kw = _update_case(rng, [PageFormat.INT8], B=1, T=1, positions=[3])
    sess = update_session("float16", kw["layer"], kw["num_layers"], kw["kv_heads"], kw["page_size"])
    io = sess.io_binding()
    pv = _dev(pool)
    _bind(io, "pool", pv, TP.UINT8, pool.shape)
    for name, arr in [("directory", directory), ("page_table", table), ("key", key), ("value", value),
                      ("position", pos.astype(np.int64))]:
        io.bind_ortvalue_input(name, _dev(arr))
    _bind(io, "pool_out", pv, TP.UINT8, pool.shape, output=True)
    rid = _ortkv.protect_range(1, 0, pv.data_ptr(), pool.nbytes, "shared prefix", 1)
    try:
        sess.run_with_iobinding(io)
        err = _ortkv.cuda_take_error()
    finally:
        _ortkv.unprotect_range(rid)
    assert err is not None and "[ortkv:E_READONLY]" in err and "'shared prefix'" in err, err
    assert pv.numpy().tobytes() == pool.tobytes()


# ---- PagedRotaryCacheUpdate (Note [PagedRotaryCacheUpdate]) --------------------------------------------------
@functools.lru_cache(maxsize=None)
def rotary_update_session(dtype, layer, num_layers, heads, kv_heads, page_size):
    from test_paged_rotary import rotary_update_model
    return _session(rotary_update_model(dtype, layer, num_layers, heads, kv_heads, page_size))


def cuda_rotary_update(pool, directory, table, qkv, position, cos, sin, *, layer, num_layers, heads, kv_heads,
                       page_size, dtype):
    """One run on the device; (pool bytes after, q_rot as float32 (NaN where not written), the deferred error)."""
    assert qkv.dtype == cos.dtype == sin.dtype and qkv.dtype in (np.dtype(NP[dtype]), np.dtype(RAW[dtype]))
    sess = rotary_update_session(dtype, layer, num_layers, heads, kv_heads, page_size)
    io = sess.io_binding()
    pos = np.broadcast_to(np.asarray(position, np.int64), (table.shape[0],)).copy()
    B, T, W = qkv.shape
    D = W // (heads + 2 * kv_heads)
    nan = {"float32": np.float32(np.nan), "float16": np.float16(np.nan), "bfloat16": np.uint16(0x7FC0)}[dtype]
    q = _dev(np.full((B, T, heads * D), nan, RAW[dtype]))
    pv = _dev(pool)
    keep = [(pv, "pool", TP.UINT8, pool.shape), (_dev(directory), "directory", TP.INT64, directory.shape),
            (_dev(table), "page_table", TP.INT32, table.shape), (_dev(qkv), "qkv", ONNX[dtype], qkv.shape),
            (_dev(pos), "position", TP.INT64, pos.shape), (_dev(cos), "cos", ONNX[dtype], cos.shape),
            (_dev(sin), "sin", ONNX[dtype], sin.shape)]
    for v, name, t, shape in keep:
        _bind(io, name, v, t, shape)
    _bind(io, "pool_out", pv, TP.UINT8, pool.shape, output=True)
    _bind(io, "q_rot", q, ONNX[dtype], (B, T, heads * D), output=True)
    sess.run_with_iobinding(io)
    got = q.numpy()
    if dtype == "bfloat16":
        got = (got.astype(np.uint32) << 16).view(np.float32)
    return pv.numpy(), got.astype(np.float32), _ortkv.cuda_take_error()


@pytest.mark.parametrize("fmt", [PageFormat.F16, PageFormat.INT8, PageFormat.INT4, PageFormat.FP8_E4M3],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("path", UPDATE_PATHS)
def test_rotary_update_bytes_and_q_equal_cpu_and_reference(rng, fmt, dtype, path):
    """The CPU op's pool bytes and q_rot exactly (one rotary form on both), and the oracle's; on both update paths
    (two rows x 5 tokens: 10 + 15 store jobs in one block, or the check and store kernels)."""
    from test_paged_rotary import case, run_rotary_update
    from ortkv.reference.paged import paged_rotary_cache_update_ref
    pool, directory, table, qkv, pos, cos, sin = case(rng, [fmt], dtype=dtype, D=64, PS=16, positions=(3, 14),
                                                      max_pages=3)
    kw = dict(layer=1, num_layers=2, heads=3, kv_heads=1, page_size=16)
    with update_path(path):
        got, q, err = cuda_rotary_update(pool, directory, table, qkv, pos, cos, sin, dtype=dtype, **kw)
    assert err is None, err
    cpu = pool.copy()
    q_cpu = np.zeros((2, 5, 3 * 64), NP[dtype])
    run_rotary_update(cpu, directory, table, qkv, pos, cos, sin, q_cpu, dtype=dtype, **kw)
    assert got.tobytes() == cpu.tobytes() and got.tobytes() != pool.tobytes()
    np.testing.assert_array_equal(q, q_cpu.astype(np.float32))
    raw = (lambda x: x.view(np.uint16)) if dtype == "bfloat16" else (lambda x: x)
    want, want_q = paged_rotary_cache_update_ref(pool, directory, table, raw(qkv), pos, raw(cos), raw(sin),
                                                 num_heads=3, kv_num_heads=1, layer=1, num_layers=2, page_size=16,
                                                 logical=dtype)
    assert got.tobytes() == want.tobytes()
    np.testing.assert_array_equal(q, want_q)


@pytest.mark.parametrize("path", UPDATE_PATHS)
def test_rotary_update_refusals_on_the_device(rng, path):
    """A position past the table and a non-finite rotated key into an INT8 page: reported after the run under
    PagedRotaryCacheUpdate's name, with the qkv tensor's name for the key; the pool untouched, q_rot not written."""
    from test_paged_rotary import case
    pool, directory, table, qkv, pos, cos, sin = case(rng, [PageFormat.INT8], dtype="float16", D=64, PS=16,
                                                      positions=(3, 14), max_pages=3)
    kw = dict(layer=1, num_layers=2, heads=3, kv_heads=1, page_size=16, dtype="float16")
    with update_path(path):
        after, q, err = cuda_rotary_update(pool, directory, table, qkv, np.array([3, 44]), cos, sin, **kw)
    assert err is not None and "PagedRotaryCacheUpdate node 'rupd'" in err and "[ortkv:E_CAPACITY]" in err, err
    assert "position 44 + tokens 5 = 49 exceeds the page table's capacity of 48 tokens" in err, err
    assert after.tobytes() == pool.tobytes() and np.isnan(q).all()
    bad = qkv.copy()
    bad[1, 4, 3 * 64 + 6] = np.inf
    with update_path(path):
        after, q, err = cuda_rotary_update(pool, directory, table, bad, pos, cos, sin, **kw)
    assert err is not None and "'qkv' (rotated k columns) [row 1, position 18, head 0]" in err, err
    assert "Nothing was written" in err, err
    assert after.tobytes() == pool.tobytes() and np.isnan(q).all()


@pytest.mark.parametrize("path", UPDATE_PATHS)
def test_rotary_update_rotary_table_bound_per_row_on_the_device(rng, path):
    """Tables of 19 rows (the page table reaches 48 positions) serve rows at 3 and 14 with 5 tokens each: the bytes
    and q_rot equal the CPU op's. Tables of 18 refuse row 1 (14 + 5 = 19) with the table's name, rows and remedy,
    before its pages (a missing page of row 1 is not what is reported); the pool untouched, q_rot not written."""
    from test_paged_rotary import case, run_rotary_update
    pool, directory, table, qkv, pos, cos, sin = case(rng, [PageFormat.INT8, PageFormat.F16], dtype="float16", D=64,
                                                      PS=16, positions=(3, 14), max_pages=3)
    kw = dict(layer=1, num_layers=2, heads=3, kv_heads=1, page_size=16)
    with update_path(path):
        got, q, err = cuda_rotary_update(pool, directory, table, qkv, pos, cos[:19], sin[:19], dtype="float16", **kw)
    assert err is None, err
    cpu = pool.copy()
    q_cpu = np.zeros((2, 5, 3 * 64), np.float16)
    run_rotary_update(cpu, directory, table, qkv, pos, cos[:19], sin[:19], q_cpu, dtype="float16", **kw)
    assert got.tobytes() == cpu.tobytes() and got.tobytes() != pool.tobytes()
    np.testing.assert_array_equal(q, q_cpu.astype(np.float32))
    table[1, 1] = -1
    with update_path(path):
        after, q, err = cuda_rotary_update(pool, directory, table, qkv, pos, cos[:18], sin[:18], dtype="float16", **kw)
    assert err is not None and "PagedRotaryCacheUpdate node 'rupd'" in err and "[ortkv:E_CAPACITY]" in err, err
    assert "row 1: position 14 + tokens 5 = 19 exceeds the rotary table 'cos' of 18 rows" in err, err
    assert "Remedy: build the rotary tables with >= 19 rows" in err and "Nothing was written" in err, err
    assert after.tobytes() == pool.tobytes() and np.isnan(q).all()


# ---- update then attention, and a CUDA graph ----------------------------------------------------------------
def _decode_model(H, G, PS, NL):
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("PagedCacheUpdate", ["pool", "directory", "page_table", "k", "v", "position"],
                              ["pool_out"], name="upd", domain="ortkv", layer=0, num_layers=NL, kv_num_heads=H,
                              page_size=PS),
             helper.make_node("PagedCacheAttention", ["q", "pool_out", "directory", "page_table", "position"], ["out"],
                              name="attn", domain="ortkv", num_heads=H * G, kv_num_heads=H, layer=0, num_layers=NL,
                              page_size=PS)]
    g = helper.make_graph(nodes, "decode", [vi("pool", TP.UINT8, ["P"]), vi("directory", TP.INT64, ["N", 2]),
                                            vi("page_table", TP.INT32, ["B", "M"]),
                                            vi("k", TP.FLOAT16, ["B", 1, H * 64]), vi("v", TP.FLOAT16, ["B", 1, H * 64]),
                                            vi("position", TP.INT64, ["B"]), vi("q", TP.FLOAT16, ["B", 1, H * G * 64])],
                          [vi("pool_out", TP.UINT8, ["P"]), vi("out", TP.FLOAT16, ["B", 1, H * G * 64])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_decode_loop_update_then_attention(rng, graph):
    """Twelve decode steps of two rows over F16 and INT8 pages, every input updated IN PLACE in the same
    device buffers (positions too), so a captured graph replays with new values; each step's output matches
    the oracle over the pool the oracle updated."""
    H, G, PS, NL, D, B, steps = 3, 3, 16, 1, 64, 2, 12
    fmts = [PageFormat.F16, PageFormat.INT8, PageFormat.F16, PageFormat.INT8]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[0, 1], [2, 3]], 2)
    pos = np.array([10, 3], np.int64)
    sess = _session(_decode_model(H, G, PS, NL), graph=graph)
    ref = pool.copy()
    k0, v0, q0 = (np.zeros((B, 1, w), np.float16) for w in (H * D, H * D, H * G * D))
    dv = {"pool": _dev(pool), "directory": _dev(directory), "page_table": _dev(table), "k": _dev(k0), "v": _dev(v0),
          "position": _dev(pos), "q": _dev(q0), "out": _dev(q0)}
    io = sess.io_binding()
    types = {"pool": TP.UINT8, "directory": TP.INT64, "page_table": TP.INT32, "position": TP.INT64}
    for name, val in dv.items():
        if name == "out":
            continue
        arr_shape = val.shape()
        _bind(io, name, val, types.get(name, TP.FLOAT16), arr_shape)
    _bind(io, "pool_out", dv["pool"], TP.UINT8, pool.shape, output=True)
    _bind(io, "out", dv["out"], TP.FLOAT16, q0.shape, output=True)
    for step in range(steps):
        k, v, q = (_rand(rng, a.shape, "float16") for a in (k0, v0, q0))
        p = pos + step
        for name, arr in (("k", k), ("v", v), ("q", q), ("position", p)):
            dv[name].update_inplace(np.ascontiguousarray(arr))
        sess.run_with_iobinding(io)
        assert _ortkv.cuda_take_error() is None
        ref = paged_cache_update_ref(ref, directory, table, k, v, p, layer=0, num_layers=NL, kv_num_heads=H,
                                     page_size=PS)
        want = paged_cache_attention_ref(q, ref, directory, table, p, num_heads=H * G, kv_num_heads=H, layer=0,
                                         num_layers=NL, page_size=PS)
        got = dv["out"].numpy().astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3, err_msg=f"step {step}")
        assert dv["pool"].numpy().tobytes() == ref.tobytes(), f"step {step}: pool bytes differ from the oracle's"
