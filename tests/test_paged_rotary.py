"""PagedRotaryCacheUpdate (CPU; Note [PagedRotaryCacheUpdate] in custom_ops/include/ortkv/paged.h) against the numpy
oracle ortkv.reference.paged.paged_rotary_cache_update_ref: the pool's bytes and q_rot exactly, every direct format,
float32 / float16 / bfloat16; every refusal names what is wrong and leaves the pool and q_rot untouched."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from conftest import ort_session
from ortkv.errors import CacheInputError, CapacityError, from_native
from ortkv.reference.paged import paged_rotary_cache_update_ref
from test_paged_ops import DIRECT, NP, ONNX, _bind, _model, build_pool, table_for
from ortkv.reference.codecs import PageFormat


def rotary_update_model(dtype, layer, num_layers, heads, kv_heads, page_size, fill=False):
    ins = ["pool", "directory", "page_table", "qkv", "position", "cos", "sin"] + (["page_fill"] if fill else [])
    node = helper.make_node("PagedRotaryCacheUpdate", ins, ["pool_out", "q_rot"], name="rupd", domain="ortkv",
                            layer=layer, num_layers=num_layers, num_heads=heads, kv_num_heads=kv_heads,
                            page_size=page_size)
    vi = helper.make_tensor_value_info
    return _model(node, [vi("pool", TP.UINT8, ["P"]), vi("directory", TP.INT64, ["N", 2]),
                         vi("page_table", TP.INT32, ["B", "M"]), vi("qkv", ONNX[dtype], ["B", "T", "W"]),
                         vi("position", TP.INT64, ["B"]), vi("cos", ONNX[dtype], ["R", "D2"]),
                         vi("sin", ONNX[dtype], ["R", "D2"])] + ([vi("page_fill", TP.INT32, ["B", "M"])] if fill else []),
                  [vi("pool_out", TP.UINT8, ["P"]), vi("q_rot", ONNX[dtype], ["B", "T", "Q"])])


@functools.lru_cache(maxsize=None)
def rotary_update_session(dtype, layer, num_layers, heads, kv_heads, page_size, fill=False):
    return ort_session(rotary_update_model(dtype, layer, num_layers, heads, kv_heads, page_size, fill))


def run_rotary_update(pool, directory, table, qkv, position, cos, sin, q_out, *, layer, num_layers, heads, kv_heads,
                      page_size, dtype="float32", out=None, fill=None):
    """One bound run: the pool bound as input and output (or `out` as the output, to test the alias check), q_rot
    into `q_out`."""
    sess = rotary_update_session(dtype, layer, num_layers, heads, kv_heads, page_size, fill is not None)
    io = sess.io_binding()
    keep = [_bind(io, "pool", pool, TP.UINT8), _bind(io, "directory", directory, TP.INT64),
            _bind(io, "page_table", table, TP.INT32), _bind(io, "qkv", qkv, ONNX[dtype]),
            _bind(io, "position", np.broadcast_to(np.asarray(position, np.int64), (table.shape[0],)), TP.INT64),
            _bind(io, "cos", cos, ONNX[dtype]), _bind(io, "sin", sin, ONNX[dtype]),
            _bind(io, "pool_out", pool if out is None else out, TP.UINT8, output=True),
            _bind(io, "q_rot", q_out, ONNX[dtype], output=True)]
    if fill is not None:
        keep.append(_bind(io, "page_fill", fill, TP.INT32))
    try:
        sess.run_with_iobinding(io)
    except Exception as exc:  # noqa: BLE001 - typed below
        raise from_native(exc) from exc
    del keep


def tables(rows, D, dtype, rng=None):
    """Rotary tables [rows, D / 2] (SmolLM2's theta), of `dtype`."""
    inv = 1.0 / (100000.0 ** (np.arange(0, D, 2) / D))
    ang = np.arange(rows)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32).astype(NP[dtype]), np.sin(ang).astype(np.float32).astype(NP[dtype])


def case(rng, formats, *, B=2, T=5, positions=(3, 6), H=3, Hkv=1, D=16, PS=4, NL=2, max_pages=4, dtype="float32",
         rows=None):
    n = sum(-(-(p + T) // PS) for p in positions)
    pool, directory = build_pool(rng, [formats[i % len(formats)] for i in range(max(n, 6))], num_layers=NL,
                                 kv_heads=Hkv, page_size=PS, head_size=D)
    ids = list(rng.permutation(len(directory)))
    table = table_for([[int(ids.pop()) for _ in range(-(-(p + T) // PS))] for p in positions], max_pages)
    qkv = (rng.standard_normal((B, T, (H + 2 * Hkv) * D)) * 2).astype(np.float32).astype(NP[dtype])
    cos, sin = tables(rows or max_pages * PS, D, dtype)
    return pool, directory, table, qkv, np.array(positions), cos, sin


def _ref_args(x, dtype):
    return x.view(np.uint16) if dtype == "bfloat16" else x


@pytest.mark.parametrize("fmt", DIRECT, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rotary_update_bytes_and_q_equal_reference(rng, fmt, dtype):
    """Two rows, 5 tokens crossing pages of 4, 3 query heads over 1 KV head, layer 1 of 2: the pool's bytes and
    q_rot equal the oracle's exactly; q_rot differs from the unrotated q (the rotary ran)."""
    pool, directory, table, qkv, pos, cos, sin = case(rng, [fmt], dtype=dtype)
    want, want_q = paged_rotary_cache_update_ref(pool, directory, table, _ref_args(qkv, dtype), pos,
                                                 _ref_args(cos, dtype), _ref_args(sin, dtype), num_heads=3,
                                                 kv_num_heads=1, layer=1, num_layers=2, page_size=4, logical=dtype)
    q = np.full((2, 5, 3 * 16), np.nan, NP[dtype])
    run_rotary_update(pool, directory, table, qkv, pos, cos, sin, q, layer=1, num_layers=2, heads=3, kv_heads=1,
                      page_size=4, dtype=dtype)
    assert pool.tobytes() == want.tobytes()
    np.testing.assert_array_equal(q.astype(np.float32), want_q)
    assert not np.array_equal(q.astype(np.float32), qkv[..., :48].astype(np.float32))


def _matches_oracle(pool, directory, table, qkv, pos, cos, sin, *, H, Hkv):
    """A float32 run (layer 1 of 2, pages of 4, head size 16): the pool's bytes and q_rot equal the oracle's."""
    want, want_q = paged_rotary_cache_update_ref(pool, directory, table, qkv, pos, cos, sin, num_heads=H,
                                                 kv_num_heads=Hkv, layer=1, num_layers=2, page_size=4)
    q = np.zeros(qkv.shape[:2] + (H * 16,), np.float32)
    run_rotary_update(pool, directory, table, qkv, pos, cos, sin, q, layer=1, num_layers=2, heads=H, kv_heads=Hkv,
                      page_size=4)
    assert pool.tobytes() == want.tobytes()
    np.testing.assert_array_equal(q, want_q)


def test_rotary_update_every_format_in_one_pool(rng):
    _matches_oracle(*case(rng, DIRECT, B=3, T=7, positions=(0, 5, 9), Hkv=2, H=4, max_pages=5), H=4, Hkv=2)


def _refused(exc_type, fragments, rng, mutate, *, formats=(PageFormat.INT8, PageFormat.F16)):
    pool, directory, table, qkv, pos, cos, sin = case(rng, list(formats))
    args = dict(pool=pool, directory=directory, table=table, qkv=qkv, position=pos, cos=cos, sin=sin)
    args = mutate(args) or args
    before = args["pool"].copy()
    q = np.full((2, 5, 48), 7.0, np.float32)
    with pytest.raises(exc_type) as e:
        run_rotary_update(args["pool"], args["directory"], args["table"], args["qkv"], args["position"], args["cos"],
                          args["sin"], q, layer=1, num_layers=2, heads=3, kv_heads=1, page_size=4)
    msg = str(e.value)
    assert "PagedRotaryCacheUpdate node 'rupd'" in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    assert args["pool"].tobytes() == before.tobytes(), "a refused update changed the pool"
    assert (q == 7.0).all(), "a refused update wrote q_rot"


def test_rotary_update_refuses_a_row_past_the_rotary_tables(rng):
    """Rows at 3 and 6, 5 tokens: tables of 10 rows refuse row 1 (6 + 5 = 11), naming the table, its rows and the
    remedy, after row 0's checks and before any page of row 1 (its missing page is not what is reported)."""
    def m(a):
        a["cos"], a["sin"] = a["cos"][:10], a["sin"][:10]
        a["table"][1, 2] = -1
    _refused(CapacityError, ["row 1: position 6 + tokens 5 = 11 exceeds the rotary table 'cos' of 10 rows",
                             "Remedy: build the rotary tables with >= 11 rows"], rng, m)


def test_rotary_update_tables_need_only_the_positions_written(rng):
    """Tables of 11 rows, shorter than the page table's reach (4 pages x 4 = 16 positions), serve rows at 3 and 6
    with 5 tokens each: the same bytes and q_rot as the oracle (a many-sequence table is wider than any row reaches)."""
    _matches_oracle(*case(rng, [PageFormat.INT8, PageFormat.F16], rows=11), H=3, Hkv=1)


def test_rotary_update_refuses_bad_qkv_width_and_tables(rng):
    def width(a):
        a["qkv"] = a["qkv"][..., :-2].copy()
    _refused(CacheInputError, ["qkv 'qkv' width 78 must be (num_heads 3 + 2 x kv_num_heads 1) * head_size"], rng, width)

    def half(a):
        a["cos"], a["sin"] = a["cos"][:, :4].copy(), a["sin"][:, :4].copy()
    _refused(CacheInputError, ["must both be [rows, head_size / 2 = 8]"], rng, half)


def test_rotary_update_refuses_position_and_page_problems(rng):
    _refused(CapacityError, ["position 13 + tokens 5 = 18 exceeds the page table's capacity of 4 pages x 4 "
                                  "tokens = 16"], rng, lambda a: a.update(position=np.array([3, 13])))
    _refused(CacheInputError, ["position -1 for row 1"], rng, lambda a: a.update(position=np.array([3, -1])))

    def missing(a):
        a["table"][1, 2] = -1
    _refused(CacheInputError, ["row 1", "page 2 of its page table", "-1"], rng, missing)


def test_rotary_update_refuses_non_finite_key_into_scaled_page(rng):
    def m(a):
        a["qkv"][1, 4, 3 * 16 + 5] = np.inf  # row 1, token 4: its k column 5 (rotated: inf or NaN)
    _refused(CacheInputError, ["qkv (rotated k columns)", "row 1"], rng, m, formats=(PageFormat.INT8,))


def test_rotary_update_refuses_unaliased_output(rng):
    pool, directory, table, qkv, pos, cos, sin = case(rng, [PageFormat.F16])
    other = np.zeros_like(pool)
    before = pool.copy()
    q = np.full((2, 5, 48), 7.0, np.float32)
    with pytest.raises(Exception, match=r"PagedRotaryCacheUpdate node 'rupd': output 'pool_out' .* is not the storage"):
        run_rotary_update(pool, directory, table, qkv, pos, cos, sin, q, layer=1, num_layers=2, heads=3, kv_heads=1,
                          page_size=4, out=other)
    assert pool.tobytes() == before.tobytes() and not other.any() and (q == 7.0).all()
