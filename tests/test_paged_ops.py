"""PagedCacheUpdate / PagedCacheAttention (CPU) and _ortkv.paged_requantize against the numpy oracle
(ortkv.reference.paged) over the same pool bytes: every format alone and all of them in one pool in
shuffled slot order, page boundaries, ragged rows, poisoned bytes past each row's length, -1 page ids,
float16 / bfloat16; every refusal names what is wrong and leaves the pool's bytes untouched."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from conftest import digest, ort_session
from ortkv import _ortkv, errors
from ortkv.errors import CacheInputError, from_native
from ortkv.reference.codecs import KEYS_PER_CHANNEL, PageFormat, decode_page, encode_page, layout
from ortkv.reference.paged import (paged_cache_attention_ref, paged_cache_update_ref, paged_requantize_ref,
                                   slot_bytes)

ALL = list(PageFormat)
DIRECT = [f for f in ALL if f not in KEYS_PER_CHANNEL]  # formats that take direct row writes
ONNX = {"float32": TP.FLOAT, "float16": TP.FLOAT16, "bfloat16": TP.BFLOAT16, "float64": TP.DOUBLE}
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# ---- pools ---------------------------------------------------------------------------------------------------
def build_pool(rng, formats, *, num_layers, kv_heads, page_size, head_size, shuffle=True, poison=None):
    """A pool holding one page per entry of `formats` (page id = index), slots in shuffled order with
    16-byte gaps, every layer encoded from standard normal values by the reference encoder."""
    sizes = [slot_bytes(f, num_layers, kv_heads, page_size, head_size) for f in formats]
    order = rng.permutation(len(formats)) if shuffle else np.arange(len(formats))
    directory = np.zeros((len(formats), 2), np.int64)
    off = 16
    for pid in order:
        directory[pid] = (int(formats[pid]), off)
        off += sizes[pid] + 16 * int(rng.integers(0, 3))
    pool = np.zeros(off + 32, np.uint8)
    for pid, fmt in enumerate(formats):
        pb = layout(fmt, kv_heads, page_size, head_size).page_bytes
        for layer in range(num_layers):
            vals = rng.standard_normal((2, kv_heads, page_size, head_size)).astype(np.float32)
            o = int(directory[pid, 1]) + layer * pb
            pool[o:o + pb] = encode_page(fmt, vals)
    return pool, directory


def poison_rows(pool, directory, page_table, lengths, *, num_layers, kv_heads, page_size, head_size):
    """0xFF (NaN in float16 / bfloat16 / the float16 scales, -1 codes) into every row at or past each
    sequence's length: payload and per-row scales of K and V, every layer."""
    from ortkv.reference.codecs import _sections

    for b, n in enumerate(lengths):
        for i, pid in enumerate(page_table[b]):
            if pid < 0:
                continue
            first = max(0, n - i * page_size)
            if first >= page_size:
                continue
            fmt = PageFormat(int(directory[pid, 0]))
            lay = layout(fmt, kv_heads, page_size, head_size)
            for layer in range(num_layers):
                o = int(directory[pid, 1]) + layer * lay.page_bytes
                page = pool[o:o + lay.page_bytes]
                for kv, (p, s) in enumerate(_sections(fmt, lay, page, kv_heads, page_size, head_size)):
                    p[:, first:] = 0xFF
                    if not (kv == 0 and fmt in KEYS_PER_CHANNEL):
                        s.view(np.uint16)[:, first:] = 0xFFFF


def table_for(rows: list[list[int]], max_pages: int) -> np.ndarray:
    t = np.full((len(rows), max_pages), -1, np.int32)
    for b, r in enumerate(rows):
        t[b, :len(r)] = r
    return t


# ---- models ---------------------------------------------------------------------------------------------------
def _model(node, inputs, outputs):
    g = helper.make_graph([node], "paged", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def update_model(dtype, layer, num_layers, kv_heads, page_size, value_dtype=None, fill=False):
    """One PagedCacheUpdate node; `fill`: with the optional page_fill input (Note [Page fill])."""
    ins = ["pool", "directory", "page_table", "key", "value", "position"] + (["page_fill"] if fill else [])
    node = helper.make_node("PagedCacheUpdate", ins, ["pool_out"], name="upd", domain="ortkv", layer=layer,
                            num_layers=num_layers, kv_num_heads=kv_heads, page_size=page_size)
    vi = helper.make_tensor_value_info
    return _model(node, [vi("pool", TP.UINT8, ["P"]), vi("directory", TP.INT64, ["N", 2]),
                         vi("page_table", TP.INT32, ["B", "M"]), vi("key", ONNX[dtype], ["B", "T", "W"]),
                         vi("value", ONNX[value_dtype or dtype], ["B", "T", "W"]), vi("position", TP.INT64, ["B"])]
                  + ([vi("page_fill", TP.INT32, ["B", "M"])] if fill else []),
                  [vi("pool_out", TP.UINT8, ["P"])])


def attention_model(dtype, num_heads, kv_heads, layer, num_layers, page_size, scale=None, fill=False,
                    page_format=None, static_tables=None):
    """One PagedCacheAttention node; `fill`: with the optional page_fill input (Note [Page fill]); `page_format`:
    the attribute (every page must have that format); `static_tables`: the attribute (the tables are graph inputs)."""
    attrs = dict(num_heads=num_heads, kv_num_heads=kv_heads, layer=layer, num_layers=num_layers, page_size=page_size)
    if scale is not None:
        attrs["scale"] = scale
    if page_format is not None:
        attrs["page_format"] = page_format
    if static_tables is not None:
        attrs["static_tables"] = static_tables
    ins = ["query", "pool", "directory", "page_table", "start"] + (["page_fill"] if fill else [])
    node = helper.make_node("PagedCacheAttention", ins, ["out"], name="attn", domain="ortkv", **attrs)
    vi = helper.make_tensor_value_info
    return _model(node, [vi("query", ONNX[dtype], ["B", "T", "W"]), vi("pool", TP.UINT8, ["P"]),
                         vi("directory", TP.INT64, ["N", 2]), vi("page_table", TP.INT32, ["B", "M"]),
                         vi("start", TP.INT64, ["B"])] + ([vi("page_fill", TP.INT32, ["B", "M"])] if fill else []),
                  [vi("out", ONNX[dtype], ["B", "T", "W"])])


@functools.lru_cache(maxsize=None)
def update_session(dtype, layer, num_layers, kv_heads, page_size, value_dtype=None, fill=False):
    return ort_session(update_model(dtype, layer, num_layers, kv_heads, page_size, value_dtype, fill))


@functools.lru_cache(maxsize=None)
def attention_session(dtype, num_heads, kv_heads, layer, num_layers, page_size, scale=None, fill=False,
                      page_format=None, static_tables=None):
    return ort_session(attention_model(dtype, num_heads, kv_heads, layer, num_layers, page_size, scale, fill,
                                       page_format, static_tables))


def _bind(io, name, arr, onnx_type, output=False):
    arr = np.ascontiguousarray(arr)
    (io.bind_output if output else io.bind_input)(name, "cpu", 0, onnx_type, list(arr.shape), arr.ctypes.data)
    return arr


def run_update(pool, directory, table, key, value, position, *, layer, num_layers, kv_heads, page_size,
               dtype="float32", out=None, value_dtype=None, fill=None, fill_type=TP.INT32):
    """One bound run: the pool bound as input and output (or `out` as the output, to test the alias check);
    `fill`: page_fill bound too (declared int32, bound as `fill_type`)."""
    sess = update_session(dtype, layer, num_layers, kv_heads, page_size, value_dtype, fill is not None)
    io = sess.io_binding()
    keep = [_bind(io, "pool", pool, TP.UINT8), _bind(io, "directory", directory, TP.INT64),
            _bind(io, "page_table", table, TP.INT32), _bind(io, "key", key, ONNX[dtype]),
            _bind(io, "value", value, ONNX[value_dtype or dtype]),
            _bind(io, "position", np.broadcast_to(np.asarray(position, np.int64), (table.shape[0],)), TP.INT64),
            _bind(io, "pool_out", pool if out is None else out, TP.UINT8, output=True)]
    if fill is not None:
        keep.append(_bind(io, "page_fill", fill, fill_type))
    try:
        sess.run_with_iobinding(io)
    except Exception as exc:  # noqa: BLE001 - typed below
        raise from_native(exc) from exc
    del keep


def run_attention(q, pool, directory, table, start, *, num_heads, kv_heads, layer, num_layers, page_size,
                  dtype="float32", scale=None, fill=None, page_format=None, static_tables=None):
    sess = attention_session(dtype, num_heads, kv_heads, layer, num_layers, page_size, scale, fill is not None,
                             page_format, static_tables)
    io = sess.io_binding()
    out = np.zeros(q.shape, NP[dtype])
    keep = [_bind(io, "query", q, ONNX[dtype]), _bind(io, "pool", pool, TP.UINT8),
            _bind(io, "directory", directory, TP.INT64), _bind(io, "page_table", table, TP.INT32),
            _bind(io, "start", np.broadcast_to(np.asarray(start, np.int64), (q.shape[0],)), TP.INT64),
            _bind(io, "out", out, ONNX[dtype], output=True)]
    if fill is not None:
        keep.append(_bind(io, "page_fill", fill, TP.INT32))
    try:
        sess.run_with_iobinding(io)
    except Exception as exc:  # noqa: BLE001
        raise from_native(exc) from exc
    del keep
    return out


def _logical(dtype):
    return None if dtype != "bfloat16" else "bfloat16"


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(NP[dtype])


# ---- PagedCacheUpdate ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", DIRECT, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_update_bytes_equal_reference_encoder(rng, fmt, dtype):
    """Two rows with their own pages and positions, 5 tokens crossing page boundaries (page_size 4), layer
    1 of 2: the pool's bytes equal the reference encoder's exactly, every other byte unchanged."""
    NL, H, PS, D = 2, 2, 4, 16
    pool, directory = build_pool(rng, [fmt] * 6, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[4, 1, 5], [0, 3, 2]], 4)
    key, value = _rand(rng, (2, 5, H * D), dtype), _rand(rng, (2, 5, H * D), dtype)
    position = np.array([3, 6])
    want = paged_cache_update_ref(pool, directory, table, key.view(np.uint16) if dtype == "bfloat16" else key,
                                  value.view(np.uint16) if dtype == "bfloat16" else value, position, layer=1,
                                  num_layers=NL, kv_num_heads=H, page_size=PS, logical=_logical(dtype))
    assert digest(want) != digest(pool)
    run_update(pool, directory, table, key, value, position, layer=1, num_layers=NL, kv_heads=H, page_size=PS,
               dtype=dtype)
    np.testing.assert_array_equal(pool, want)


def test_update_every_direct_format_in_one_pool(rng):
    """All six direct formats as the pages of three rows (shuffled slots), T = 7 across three pages each,
    scalar-like equal positions and a large batch that takes the thread pool."""
    NL, H, PS, D = 3, 3, 4, 64
    formats = [DIRECT[i % len(DIRECT)] for i in range(30)]
    pool, directory = build_pool(rng, formats, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    ids = rng.permutation(30)
    B = 10
    table = table_for([list(ids[3 * b:3 * b + 3]) for b in range(B)], 3)
    key, value = _rand(rng, (B, 7, H * D), "float32"), _rand(rng, (B, 7, H * D), "float32")
    position = rng.integers(0, 6, size=B)
    want = paged_cache_update_ref(pool, directory, table, key, value, position, layer=2, num_layers=NL,
                                  kv_num_heads=H, page_size=PS)
    run_update(pool, directory, table, key, value, position, layer=2, num_layers=NL, kv_heads=H, page_size=PS)
    np.testing.assert_array_equal(pool, want)


def test_update_stores_inf_in_f16_pages(rng):
    """F16/BF16 pages store what the logical type holds (inf, NaN); only scaled formats refuse."""
    NL, H, PS, D = 1, 1, 4, 16
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.BF16], num_layers=NL, kv_heads=H, page_size=PS,
                                 head_size=D)
    table = table_for([[0], [1]], 1)
    key = _rand(rng, (2, 1, D), "float32")
    key[:, 0, 3] = np.inf
    key[1, 0, 5] = np.nan
    want = paged_cache_update_ref(pool, directory, table, key, key, [1, 2], layer=0, num_layers=NL, kv_num_heads=H,
                                  page_size=PS)
    run_update(pool, directory, table, key, key, [1, 2], layer=0, num_layers=NL, kv_heads=H, page_size=PS)
    np.testing.assert_array_equal(pool, want)
    f16 = layout(PageFormat.F16, 1, 4, 16).page_bytes
    page0 = decode_page(PageFormat.F16, pool[directory[0, 1]:directory[0, 1] + f16], 1, 4, 16)
    assert np.isposinf(page0[0, 0, 1, 3]) and np.isposinf(page0[1, 0, 1, 3])
    page1 = decode_page(PageFormat.BF16, pool[directory[1, 1]:directory[1, 1] + f16], 1, 4, 16)
    assert np.isposinf(page1[0, 0, 2, 3]) and np.isnan(page1[0, 0, 2, 5])


# ---- update refusals: message and untouched bytes ----------------------------------------------------------------
def _refused(exc_type, fragments, pool, *args, **kw):
    before = digest(pool)
    with pytest.raises(exc_type) as info:
        run_update(pool, *args, **kw)
    for f in fragments:
        assert f in str(info.value), str(info.value)
    assert digest(pool) == before, "a refused call changed the pool"
    return info.value


@pytest.fixture
def small(rng):
    """A pool of pages [F16, INT8, INT4_KC, INT4, F16, F16] (ids 0-5), 2 layers, Hkv 2, page_size 4, D 16;
    two rows whose tables are [0, 1, -1] and [4, 3, -1]."""
    NL, H, PS, D = 2, 2, 4, 16
    fmts = [PageFormat.F16, PageFormat.INT8, PageFormat.INT4_KC, PageFormat.INT4, PageFormat.F16, PageFormat.F16]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[0, 1], [4, 3]], 3)
    key, value = _rand(rng, (2, 3, H * D), "float32"), _rand(rng, (2, 3, H * D), "float32")
    return dict(pool=pool, directory=directory, table=table, key=key, value=value, kw=dict(layer=1, num_layers=NL,
                                                                                             kv_heads=H, page_size=PS))


def _upd(s, position, *, table=None, directory=None, key=None, value=None, fragments=(), exc=CacheInputError, **kw):
    kw = {**s["kw"], **kw}
    return _refused(exc, fragments, s["pool"], s["directory"] if directory is None else directory,
                    s["table"] if table is None else table, s["key"] if key is None else key,
                    s["value"] if value is None else value, position, **kw)


def test_refuses_missing_page(small):
    # row 1 at 3..5 needs page 1 (id 3) -- fine -- row 0 at 6..8 needs page index 2 = -1
    _upd(small, [6, 0], fragments=["PagedCacheUpdate node '", "': row 0 needs page 2 of its page table 'page_table' (tokens [8, 12)",
                                   "the entry is -1", "Nothing was written"])


def test_refuses_page_id_out_of_directory(small):
    t = small["table"].copy()
    t[1, 0] = 6
    _upd(small, [0, 0], table=t, fragments=["page id 6 is outside the directory 'directory' of 6 pages"])


def test_refuses_bad_format_and_offsets(small):
    d = small["directory"].copy()
    d[4, 0] = 9
    _upd(small, [0, 0], directory=d, fragments=["page 4 format 9, not a page format"])
    d = small["directory"].copy()
    d[4, 1] = small["pool"].size - 16
    _upd(small, [0, 0], directory=d, fragments=["places page 4 (F16, 2 layers x", "inside the pool 'pool' of"])
    d = small["directory"].copy()
    d[4, 1] += 2
    _upd(small, [0, 0], directory=d, fragments=["not a multiple of 16"])
    d[4, 1] = -16
    _upd(small, [0, 0], directory=d, fragments=["at offset -16"])


def test_refuses_keys_into_kc_page(small):
    t = small["table"].copy()
    t[1, 1] = 2  # INT4_KC
    _upd(small, [0, 3], table=t, fragments=["row 1 writes tokens into page 2", "INT4_KC page", "paged_requantize"])


def test_refuses_non_finite_into_scaled_page_after_valid_rows(small):
    """Row 0 is valid (F16 and INT8 pages); row 1's last token holds NaN for its INT4 page: nothing of row 0
    is written either."""
    v = small["value"].copy()
    v[1, 2, 17] = np.nan
    _upd(small, [2, 2], value=v, fragments=["INT4 page", "'value' [row 1, token 2, head 1] into page 3",
                                            "inf or NaN", "nothing was written"])
    v = small["value"].copy()
    v[0, 2, 0] = 1e9  # INT8 scale 1e9 / 127 > 65504
    _upd(small, [2, 2], value=v, fragments=["INT8 page", "beyond float16", "store the page as BF16"])


def test_refuses_capacity_and_negative_position(small):
    e = _upd(small, [10, 0], exc=errors.CapacityError,
             fragments=["row 0: position 10 + tokens 3 = 13 exceeds the page table's capacity of 3 pages x 4 tokens = 12"])
    assert "[ortkv:" not in str(e)
    _upd(small, [0, -1], fragments=["position -1 for row 1 of 'position' is negative"])


def test_refuses_two_rows_writing_one_shared_page_row(small):
    t = small["table"].copy()
    t[1, 0] = 0  # both rows start with page 0
    _upd(small, [1, 0], table=t, fragments=["rows 0 and 1 both write row", "of page 0", "copy on write"])


def test_refuses_bad_shapes_and_attributes(small):
    _upd(small, [0, 0], key=small["key"][:, :, :31], value=small["value"][:, :, :31],
         fragments=["width 31 must be kv_num_heads (2) * head_size"])
    _upd(small, [0, 0], key=small["key"].astype(np.float16), dtype="float16", value_dtype="float32",
         fragments=["key 'key' and value 'value' must both be float32, float16 or bfloat16 (got float16 and float32)"])
    _upd(small, [0, 0], key=small["key"].astype(np.float64), value=small["value"].astype(np.float64), dtype="float64",
         fragments=["(got float64 and float64)"])
    _upd(small, [0, 0], layer=2, fragments=["attribute layer=2 must be in [0, num_layers=2)"])
    # head size 17: row 0's F16 page 0 takes it, row 1's INT4 page 3 (page index 1) refuses the shape
    k = np.zeros((2, 1, 34), np.float32)  # head size 17
    _upd(small, [0, 4], key=k, value=k, fragments=["page 3: INT4 packs 2 channels per byte",
                                                   "got head_size=17"])


def test_refuses_unaliased_output(small):
    other = np.zeros_like(small["pool"])
    _upd(small, [0, 0], out=other, exc=errors.AliasError,
         fragments=["output 'pool_out'", "is not the storage of the pool 'pool'", "bind ONE buffer"])
    assert not other.any()


def test_refuses_write_into_protected_range(small):
    pool, d = small["pool"], small["directory"]
    addr = pool.ctypes.data + int(d[4, 1]) + layout(PageFormat.F16, 2, 4, 16).page_bytes  # page 4, layer 1
    rid = _ortkv.protect_range(_ortkv.DEVICE_CPU, 0, addr, 16, "shared prefix")
    try:
        _upd(small, [0, 0], exc=errors.ImmutableStorageError,
             fragments=["row 1 token 0 would write into the page layer", "'shared prefix'", "copy on write"])
    finally:
        _ortkv.unprotect_range(rid)


# ---- PagedCacheAttention -----------------------------------------------------------------------------------------
def _attn_case(rng, formats, *, B, T, lengths, NL=2, H=3, G=3, PS=16, D=64, layer=1, dtype="float32",
               poison=True, scale=None):
    """Pages of `formats` assigned to rows in shuffled order; row b holds lengths[b] tokens after this
    block (start = lengths - T). Compares the op with the oracle on the same bytes."""
    pages_per_row = [-(-n // PS) for n in lengths]
    fmts = [formats[i % len(formats)] for i in range(sum(pages_per_row))]
    fmts = [fmts[i] for i in rng.permutation(len(fmts))]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    ids = list(rng.permutation(len(fmts)))
    rows = []
    for n in pages_per_row:
        rows.append([int(ids.pop()) for _ in range(n)])
    table = table_for(rows, max(pages_per_row) + 2)  # -1 beyond every row's pages
    start = np.array(lengths) - T
    clean = pool.copy()
    if poison:
        poison_rows(pool, directory, table, lengths, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    q = _rand(rng, (B, T, H * G * D), dtype)
    got = run_attention(q, pool, directory, table, start, num_heads=H * G, kv_heads=H, layer=layer, num_layers=NL,
                        page_size=PS, dtype=dtype, scale=scale)
    want = paged_cache_attention_ref(q.view(np.uint16) if dtype == "bfloat16" else q, clean, directory, table, start,
                                     num_heads=H * G, kv_num_heads=H, layer=layer, num_layers=NL, page_size=PS,
                                     scale=scale, logical=_logical(dtype))
    assert np.isfinite(got.astype(np.float32)).all()
    tol = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol, atol=tol)
    return got


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("PS", [16, 64])
def test_attention_each_format_alone(rng, fmt, PS):
    _attn_case(rng, [fmt], B=2, T=1, lengths=[PS * 2 + 5, 3 * PS], PS=PS)


def test_attention_every_format_in_one_pool_shuffled(rng):
    """All eight formats in one pool in shuffled slot order, three ragged rows, decode and a block of 5."""
    for T in (1, 5):
        _attn_case(rng, ALL, B=3, T=T, lengths=[130, 37, 64], PS=16)


@pytest.mark.parametrize("G,D", [(2, 64), (3, 64), (3, 32), (2, 16), (4, 64)])
@pytest.mark.parametrize("fmt", [PageFormat.F16, PageFormat.BF16, PageFormat.INT8, PageFormat.FP8_E4M3,
                                 PageFormat.INT4, PageFormat.INT2, PageFormat.INT4_KC, PageFormat.INT2_KC],
                         ids=lambda f: f.name)
def test_attention_pages_read_in_place_heads_in_the_key_loop(rng, G, D, fmt):
    """Note [Paged rows converted once] / [Paged codes in registers] / [Paged _KC keys in registers]: 2 or 3 query
    heads per KV head at head sizes <= 64 convert each row chunk (16-bit values, codes whose row scale and offset
    are applied to the score and the weight, or _KC key codes times their page's channel scales) once for all heads
    (8 keys per score batch, so lengths that leave 1-7 keys over); 4 heads keep BlockRows / the decoded blocks. The
    second case mixes the format with INT8 and F16 pages in one row."""
    _attn_case(rng, [fmt], B=3, T=1, lengths=[2 * 16 + 13, 5, 16 * 8 + 7], PS=16, D=D, H=2, G=G)
    _attn_case(rng, [fmt, PageFormat.INT8, PageFormat.F16], B=2, T=3, lengths=[70, 19], PS=16, D=D, H=2, G=G)


@pytest.mark.parametrize("T", [2, 8, 13, 40])
@pytest.mark.parametrize("D,G", [(64, 3), (32, 2), (20, 2)])
def test_attention_query_tiles(rng, T, D, G):
    """Note [Paged CPU query tiles]: T >= 2 tokens a row, up to 64 / G tokens a unit (G = 3: T = 40 is a tile of
    21 and one of 19, each with rows in both 32-lane parts; T = 13 one of 39 rows; G = 2: 32 and 8), each key block
    decoded once for the tile and read by every token up to its own causal limit (starts that leave a block partly
    seen), every format mixed in shuffled pages; head size 20 takes BlockAny."""
    _attn_case(rng, ALL if D % 4 == 0 else [PageFormat.F16], B=2, T=T, lengths=[T + 77, T + 3], PS=16, D=D, H=2, G=G)


@pytest.mark.parametrize("fmts", [[PageFormat.F16], ALL], ids=["F16", "all"])
def test_attention_query_tiles_of_32_lanes_where_64_are_too_few(rng, fmts):
    """CpuQueryTile: 100 tokens of one row at G = 3 over 620 keys would make 3 x 5 tiles of 64 lanes, too few to
    keep the threads busy without split-K (24 tasks), so the node takes tiles of 32 lanes (10 tokens: 30 units);
    then two rows of 60 tokens over 600 and 60 keys (18 units of 64 lanes, 36 of 32); F16 pages, then every format
    mixed."""
    _attn_case(rng, fmts, B=1, T=100, lengths=[620], PS=16, D=64, H=3, G=3)
    _attn_case(rng, fmts, B=2, T=60, lengths=[600, 60], PS=16, D=64, H=3, G=3)


def test_attention_query_tiles_keep_a_later_tokens_values_out(rng):
    """Note [Paged CPU query tiles]: a tile's tokens share each block, but a token's row never reads a later
    token's key or value: an inf in token 12's value leaves tokens 0-11 finite and equal to the reference (one
    tile of all 20 tokens, 60 rows over both 32-lane parts, G = 3), and reaches the later tokens of that head."""
    NL, H, G, D, PS, T = 1, 2, 3, 64, 16, 20
    pool, directory = build_pool(rng, [PageFormat.F16] * 2, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    vals = rng.standard_normal((2, H, PS, D)).astype(np.float32)
    vals[1, 0, 12, 5] = np.inf  # V, KV head 0, token 12
    o = int(directory[0, 1])
    pool[o:o + layout(PageFormat.F16, H, PS, D).page_bytes] = encode_page(PageFormat.F16, vals)
    table = table_for([[0, 1]], 2)
    q = _rand(rng, (1, T, H * G * D), "float32")
    kw = dict(layer=0, num_layers=NL, page_size=PS)
    got = run_attention(q, pool, directory, table, [0], num_heads=H * G, kv_heads=H, **kw)
    want = paged_cache_attention_ref(q, pool, directory, table, [0], num_heads=H * G, kv_num_heads=H, **kw)
    assert np.isfinite(got[0, :12]).all()
    np.testing.assert_allclose(got[0, :12], want[0, :12], rtol=2e-5, atol=2e-5)
    assert not np.isfinite(got[0, 12:, :G * D]).all()  # the group of KV head 0 from token 12 on
    np.testing.assert_allclose(got[0, :, G * D:], want[0, :, G * D:], rtol=2e-5, atol=2e-5)  # KV head 1: untouched


@pytest.mark.parametrize("D,PS", [(16, 4), (32, 8), (128, 16), (20, 4)])
def test_attention_head_sizes_and_page_sizes(rng, D, PS):
    """The vector path's head sizes, and a head size (20) that takes the plain loops."""
    _attn_case(rng, ALL if D % 4 == 0 else [PageFormat.F16], B=2, T=3, lengths=[45, 7], PS=PS, D=D, H=2, G=2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_logical_types(rng, dtype):
    got = _attn_case(rng, ALL, B=2, T=2, lengths=[50, 20], dtype=dtype)
    assert got.dtype == NP[dtype]


def test_attention_split_k_long_sequence(rng):
    """One sequence of 2,000 tokens: split-K (24 tasks) over pages of all formats, blocks spanning pages."""
    _attn_case(rng, ALL, B=1, T=1, lengths=[2000], PS=16, H=3, G=3)


def test_attention_scale_and_gqa(rng):
    _attn_case(rng, [PageFormat.INT8, PageFormat.F16], B=2, T=4, lengths=[40, 9], H=2, G=4, PS=8, scale=0.05)


def test_attention_poisoned_bytes_never_leak(rng):
    """With poisoned rows past every length the output equals the clean pool's (checked in _attn_case) and
    is finite; a page past the valid length may be -1 (the table has -1 columns)."""
    got = _attn_case(rng, ALL, B=2, T=1, lengths=[17, 33], PS=16, poison=True)
    assert np.isfinite(got).all()


def test_attention_refusals(rng):
    NL, H, PS, D = 1, 2, 4, 16
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.INT8], num_layers=NL, kv_heads=H, page_size=PS,
                                 head_size=D)
    table = table_for([[0, -1]], 2)
    q = _rand(rng, (1, 1, 2 * H * D), "float32")
    before = digest(pool)
    with pytest.raises(CacheInputError, match=r"PagedCacheAttention node '[^']*': row 0 needs page 1 of its page table 'page_table' .* the entry is -1"):
        run_attention(q, pool, directory, table, [4], num_heads=2 * H, kv_heads=H, layer=0, num_layers=NL,
                      page_size=PS)
    with pytest.raises(errors.CapacityError, match=r"start 8 \+ tokens 1 = 9 exceeds"):
        run_attention(q, pool, directory, table, [8], num_heads=2 * H, kv_heads=H, layer=0, num_layers=NL,
                      page_size=PS)
    with pytest.raises(CacheInputError, match=r"num_heads 3 must be a positive multiple of kv_num_heads 2"):
        run_attention(q[:, :, :48], pool, directory, table, [0], num_heads=3, kv_heads=H, layer=0, num_layers=NL,
                      page_size=PS)
    with pytest.raises(CacheInputError, match=r"attribute layer=1 must be in \[0, num_layers=1\)"):
        run_attention(q, pool, directory, table, [0], num_heads=2 * H, kv_heads=H, layer=1, num_layers=NL,
                      page_size=PS)
    assert digest(pool) == before


@pytest.mark.parametrize("name", ["F16", "f16", "INT4"])
def test_attention_page_format_attribute_keeps_the_output(rng, name):
    """The page_format attribute (Note [Paged CUDA uniform 16-bit]) is a checked promise: with every page in that
    format the output is the one without the attribute, bit for bit on the CPU (either case of the name)."""
    fmt = PageFormat[name.upper()]
    NL, H, PS, D = 2, 2, 16, 64
    pool, directory = build_pool(rng, [fmt] * 9, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[4, 0, 7, 2], [8, 1, 3]], 5)
    q = _rand(rng, (2, 1, 3 * H * D), "float32")
    kw = dict(num_heads=3 * H, kv_heads=H, layer=1, num_layers=NL, page_size=PS)
    plain = run_attention(q, pool, directory, table, [60, 40], **kw)
    promised = run_attention(q, pool, directory, table, [60, 40], page_format=name, **kw)
    assert promised.tobytes() == plain.tobytes()
    want = paged_cache_attention_ref(q, pool, directory, table, [60, 40], num_heads=3 * H, kv_num_heads=H, layer=1,
                                     num_layers=NL, page_size=PS)
    np.testing.assert_allclose(promised, want, rtol=2e-5, atol=2e-5)


def test_attention_page_format_attribute_refuses_another_format(rng):
    """A page of another format than page_format promises: refused with the row, the page and the remedy; the
    pool's bytes untouched; an unknown name refused when the session is made."""
    NL, H, PS, D = 1, 2, 16, 64
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.F16, PageFormat.INT8], num_layers=NL, kv_heads=H,
                                 page_size=PS, head_size=D)
    table = table_for([[0, 1], [1, 2]], 2)
    q = _rand(rng, (2, 1, H * D), "float32")
    kw = dict(num_heads=H, kv_heads=H, layer=0, num_layers=NL, page_size=PS)
    before = digest(pool)
    with pytest.raises(CacheInputError, match=r"PagedCacheAttention node 'attn': row 1 needs page 1 of its page table "
                                              r"'page_table' but page 2 is INT8, not F16, the format the node's "
                                              r"page_format attribute promises .* Remedy: keep every page"):
        run_attention(q, pool, directory, table, [20, 20], page_format="F16", **kw)
    assert digest(pool) == before
    run_attention(q[:1], pool, directory, table[:1], [20], page_format="F16", **kw)  # row 0's pages are F16
    with pytest.raises(Exception, match=r"attribute page_format = 'F17' is not a page format; use one of F16, BF16"):
        run_attention(q, pool, directory, table, [20, 20], page_format="F17", **kw)
    from ortkv.graph.op_contract import attribute_problems, contract_of

    node = attention_model("float32", H, H, 0, NL, PS, page_format="F17").graph.node[0]  # and the checker says so
    assert attribute_problems(node, contract_of(node))[0].startswith("attribute page_format=F17; allowed: , F16, f16")
    good = attention_model("float32", H, H, 0, NL, PS, page_format="int4").graph.node[0]
    assert attribute_problems(good, contract_of(good)) == []


def test_attention_static_tables_attribute(rng):
    """static_tables = 1 (Note [Paged CUDA static tables]: a promise about who writes the tables, which only the CUDA
    kernels use): the CPU output is the one without it, bit for bit, bad pages still refused with the pool
    untouched; a value other than 0 / 1 refused when the session is made (and by the op contract), naming the node,
    the value and the rule."""
    NL, H, PS, D = 2, 2, 16, 64
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.INT8, PageFormat.INT4] * 3, num_layers=NL,
                                 kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[4, 0, 7, 2], [8, 1, 3]], 5)
    q = _rand(rng, (2, 1, 3 * H * D), "float32")
    kw = dict(num_heads=3 * H, kv_heads=H, layer=1, num_layers=NL, page_size=PS)
    plain = run_attention(q, pool, directory, table, [60, 40], **kw)
    for value in (0, 1):
        got = run_attention(q, pool, directory, table, [60, 40], static_tables=value, **kw)
        assert got.tobytes() == plain.tobytes()
    bad = table.copy()
    bad[1, 2] = -1
    before = digest(pool)
    with pytest.raises(CacheInputError, match=r"PagedCacheAttention node 'attn': row 1 .*page table 'page_table'"):
        run_attention(q, pool, directory, bad, [60, 40], static_tables=1, **kw)
    assert digest(pool) == before
    with pytest.raises(Exception, match=r"PagedCacheAttention node 'attn': attribute static_tables = 2 is not 0 or 1; "
                                        r"set 1 only when the directory and page table are graph inputs"):
        run_attention(q, pool, directory, table, [60, 40], static_tables=2, **kw)
    from ortkv.graph.op_contract import attribute_problems, contract_of

    node = attention_model("float32", H, H, 0, NL, PS, static_tables=2).graph.node[0]
    assert attribute_problems(node, contract_of(node))[0].startswith("attribute static_tables=2; allowed: 0, 1")


# ---- update then attention, one token at a time (a decode loop through ORT) ---------------------------------------
def test_decode_loop_matches_dense_attention(rng):
    """Prefill 9 tokens then 6 single-token steps into F16 pages through PagedCacheUpdate, attention after
    each step: equals dense attention over the float16-rounded keys and values."""
    from ortkv.reference import cache_attention_ref

    NL, H, G, PS, D = 1, 3, 3, 4, 64
    pool, directory = build_pool(rng, [PageFormat.F16] * 8, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[5, 2, 7, 0]], 4)
    k_all, v_all = _rand(rng, (1, 15, H * D), "float32"), _rand(rng, (1, 15, H * D), "float32")
    kw = dict(layer=0, num_layers=NL, kv_heads=H, page_size=PS)
    run_update(pool, directory, table, k_all[:, :9], v_all[:, :9], [0], **kw)
    for n in range(9, 15):
        if n > 9:
            run_update(pool, directory, table, k_all[:, n - 1:n], v_all[:, n - 1:n], [n - 1], **kw)
        q = _rand(rng, (1, 1, H * G * D), "float32")
        got = run_attention(q, pool, directory, table, [n - 1], num_heads=H * G, kv_heads=H, layer=0, num_layers=NL,
                            page_size=PS)
        kd = k_all[:, :n].astype(np.float16).astype(np.float32).reshape(1, n, H, D)
        vd = v_all[:, :n].astype(np.float16).astype(np.float32).reshape(1, n, H, D)
        want = cache_attention_ref(q, kd, vd, [n - 1], H * G, H)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# ---- paged_requantize --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("src", [PageFormat.F16, PageFormat.BF16, PageFormat.INT8, PageFormat.INT4_KC],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("dst", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("logical", ["float32", "float16", "bfloat16"])
def test_requantize_equals_reference(rng, src, dst, logical):
    NL, H, PS, D = 2, 2, 8, 16
    pool, directory = build_pool(rng, [src, dst], num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    want = paged_requantize_ref(pool, int(directory[0, 1]), src, int(directory[1, 1]), dst, NL, H, PS, D, logical)
    _ortkv.paged_requantize(pool, int(directory[0, 1]), int(src), int(directory[1, 1]), int(dst), NL, H, PS, D,
                            logical)
    np.testing.assert_array_equal(pool, want)


def _requant_refused(pool, args, *fragments):
    before = digest(pool)
    with pytest.raises(Exception) as info:
        try:
            _ortkv.paged_requantize(pool, *args)
        except RuntimeError as exc:
            raise from_native(exc) from exc
    for f in fragments:
        assert f in str(info.value), str(info.value)
    assert digest(pool) == before


def test_requantize_refusals(rng):
    NL, H, PS, D = 2, 2, 8, 16
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.INT8], num_layers=NL, kv_heads=H, page_size=PS,
                                 head_size=D)
    src, dst = int(directory[0, 1]), int(directory[1, 1])
    # a NaN in layer 1 of the F16 page: layer 0 encodes, layer 1 does not -> nothing written
    pb = layout(PageFormat.F16, H, PS, D).page_bytes
    pool[src + pb + 6:src + pb + 8] = np.array([np.nan], np.float16).view(np.uint8)
    _requant_refused(pool, (src, 0, dst, 2, NL, H, PS, D, "float32"), "layer 1:", "INT8 page", "inf or NaN",
                     "nothing was written")
    _requant_refused(pool, (src, 0, src + 16, 2, NL, H, PS, D, "float32"), "overlap")
    _requant_refused(pool, (src, 0, pool.size - 16, 2, NL, H, PS, D, "float32"), "not inside the pool")
    _requant_refused(pool, (src, 0, dst + 2, 2, NL, H, PS, D, "float32"), "16-byte aligned")
    _requant_refused(pool, (src, 0, dst, 4, NL, H, PS, 17, "float32"), "INT4 packs 2 channels per byte")
    _requant_refused(pool, (src, 0, dst, 2, NL, H, PS, D, "float64"), "logical must be")
    with pytest.raises(ValueError, match="writable, contiguous uint8"):
        _ortkv.paged_requantize(pool.view(np.int8), src, 0, dst, 2, NL, H, PS, D, "float32")
    ro = pool.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable, contiguous uint8"):
        _ortkv.paged_requantize(ro, src, 0, dst, 2, NL, H, PS, D, "float32")


def test_requantized_page_is_read_by_attention(rng):
    """F16 page filled, requantized to INT4_KC in a new slot, directory entry rewritten: attention reads it."""
    NL, H, PS, D = 1, 2, 16, 64
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.INT4_KC, PageFormat.F16], num_layers=NL,
                                 kv_heads=H, page_size=PS, head_size=D)
    _ortkv.paged_requantize(pool, int(directory[0, 1]), 0, int(directory[1, 1]), 6, NL, H, PS, D, "float16")
    d2 = directory.copy()
    d2[0] = (6, directory[1, 1])
    table = table_for([[0, 2]], 2)
    q = _rand(rng, (1, 1, 2 * H * D), "float32")
    got = run_attention(q, pool, d2, table, [20], num_heads=2 * H, kv_heads=H, layer=0, num_layers=NL, page_size=PS)
    want = paged_cache_attention_ref(q, pool, d2, table, [20], num_heads=2 * H, kv_num_heads=H, layer=0,
                                     num_layers=NL, page_size=PS)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# ---- a decoder layer through ortkv.MutableCacheSession -----------------------------------------------------------
def test_update_then_attention_through_mutable_cache_session(rng):
    """PagedCacheUpdate then PagedCacheAttention over the updated pool in one model, the pool bound once as
    a cache (READ_WRITE input aliased by pool_out) through MutableCacheSession: the session's alias checks
    accept the uint8 pool; three decode steps of two rows equal the oracles, and the pool is written in place."""
    import ortkv
    from ortkv.graph import check, mark_mutable, set_alias_of

    NL, H, G, PS, D = 2, 2, 2, 4, 16
    vi = helper.make_tensor_value_info
    paged = dict(layer=1, num_layers=NL, kv_num_heads=H, page_size=PS)
    upd = helper.make_node("PagedCacheUpdate", ["pool", "directory", "page_table", "key", "value", "position"],
                           ["pool_out"], name="upd", domain="ortkv", **paged)
    att = helper.make_node("PagedCacheAttention", ["query", "pool_out", "directory", "page_table", "position"],
                           ["out"], name="attn", domain="ortkv", num_heads=H * G, **paged)
    g = helper.make_graph([upd, att], "layer",
                          [vi("pool", TP.UINT8, ["P"]), vi("directory", TP.INT64, ["N", 2]),
                           vi("page_table", TP.INT32, ["B", "M"]), vi("key", TP.FLOAT, ["B", 1, H * D]),
                           vi("value", TP.FLOAT, ["B", 1, H * D]), vi("query", TP.FLOAT, ["B", 1, H * G * D]),
                           vi("position", TP.INT64, ["B"])],
                          [vi("pool_out", TP.UINT8, ["P"]), vi("out", TP.FLOAT, ["B", 1, H * G * D])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                              ir_version=10)
    mark_mutable(model, "pool")
    set_alias_of(model, "pool_out", "pool")
    report = check(model, plan=False)
    assert report.errors == [], report.errors
    assert not [f for f in report.findings if f.rule == "no-kernel"]
    fmts = [PageFormat.F16, PageFormat.INT8, PageFormat.INT4, PageFormat.BF16, PageFormat.FP8_E4M3, PageFormat.INT2]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[3, 0, 2], [5, 1, 4]], 3)
    position = np.array([2, 5])
    with ortkv.MutableCacheSession(model) as sess:
        sess.bind_cache("pool", pool)
        for _ in range(3):
            key, value = _rand(rng, (2, 1, H * D), "float32"), _rand(rng, (2, 1, H * D), "float32")
            q = _rand(rng, (2, 1, H * G * D), "float32")
            want_pool = paged_cache_update_ref(pool, directory, table, key, value, position, **paged)
            want = paged_cache_attention_ref(q, want_pool, directory, table, position, num_heads=H * G,
                                             kv_num_heads=H, layer=1, num_layers=NL, page_size=PS)
            (out,) = sess.run(["out"], {"directory": directory, "page_table": table, "key": key, "value": value,
                                        "query": q, "position": position})
            np.testing.assert_array_equal(pool, want_pool)  # written in place, byte for byte
            np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
            position = position + 1


def _checked(layer=0, num_layers=2, key_type=TP.FLOAT, table_type=TP.INT32, mutable=True, pos_shape=("B",)):
    from ortkv.graph import check, mark_mutable, set_alias_of

    vi = helper.make_tensor_value_info
    node = helper.make_node("PagedCacheUpdate", ["pool", "directory", "page_table", "key", "value", "position"],
                            ["pool_out"], name="upd", domain="ortkv", layer=layer, num_layers=num_layers,
                            kv_num_heads=2, page_size=4)
    g = helper.make_graph([node], "g", [vi("pool", TP.UINT8, ["P"]), vi("directory", TP.INT64, ["N", 2]),
                                        vi("page_table", table_type, ["B", 3]), vi("key", key_type, ["B", 1, 32]),
                                        vi("value", key_type, ["B", 1, 32]), vi("position", TP.INT64, list(pos_shape))],
                          [vi("pool_out", TP.UINT8, ["P"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                          ir_version=10)
    if mutable:
        mark_mutable(m, "pool")
    set_alias_of(m, "pool_out", "pool")
    return "\n".join(str(f) for f in check(m, plan=False).errors)


def test_checker_describes_paged_cache_update():
    """The checker applies the op contract: the pool must be a READ_WRITE input (the output IS its storage),
    layer < num_layers, float keys/values, an int32 page table."""
    assert _checked() == ""
    assert "pool" in _checked(mutable=False) and "READ_WRITE" in _checked(mutable=False)
    assert "attribute layer=2 must be in [0, num_layers=2)" in _checked(layer=2)
    assert "'key' is float64" in _checked(key_type=TP.DOUBLE)
    assert "'page_table' is int64" in _checked(table_type=TP.INT64)
