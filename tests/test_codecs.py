"""Per-page KV formats: the C++ codecs (custom_ops/codecs, through ortkv._ortkv._testing) against the
numpy reference (ortkv.reference.codecs): layout, byte-exact encoding, round-trip error bounds per
format, edge cases, refusals that leave the page untouched, direct row writes, bytes vs the ideal."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ortkv._ortkv import _testing as T
from ortkv.errors import CacheInputError, from_native
from ortkv.reference import codecs as R

F = R.PageFormat
ALL = list(F)
SCALED = [F.INT8, F.FP8_E4M3, F.INT4, F.INT2, F.INT4_KC, F.INT2_KC]
KC = [F.INT4_KC, F.INT2_KC]  # keys per channel over the page
SHAPES = [(1, 16, 64), (2, 16, 128), (3, 8, 64), (1, 4, 8), (2, 3, 12)]  # last two need padding


def native_error(call, *args) -> CacheInputError:
    with pytest.raises(RuntimeError) as info:
        call(*args)
    err = from_native(info.value)
    assert isinstance(err, CacheInputError), str(info.value)
    return err


def cpp_encode(fmt, x):
    page = np.zeros(R.layout(fmt, *x.shape[1:]).page_bytes, np.uint8)
    T.codec_encode_page(int(fmt), x, page)
    return page


def data(rng, shape, kind):
    """Test data of a few kinds, as float32 (f16-representable unless kind says otherwise)."""
    row_scale = rng.uniform(0.01, 20.0, (*shape[:-1], 1))
    if kind == "normal":
        x = rng.standard_normal(shape) * row_scale
    elif kind == "skewed":  # one-sided rows (a symmetric grid wastes half its levels)
        x = np.abs(rng.standard_normal(shape)) * row_scale + 3.0
    elif kind == "outliers":  # a few large channels, as pre-RoPE keys have
        x = rng.standard_normal(shape)
        x[..., :: max(1, shape[-1] // 4)] *= 50.0
    elif kind == "tiny":  # float32 values whose scales land in float16 subnormals
        return (rng.standard_normal(shape) * 1e-5).astype(np.float32)
    elif kind == "float32":  # not float16-representable, wide range
        return (rng.standard_normal(shape) * np.exp(rng.uniform(-8, 8, (*shape[:-1], 1)))).astype(np.float32)
    else:
        raise ValueError(kind)
    return x.astype(np.float16).astype(np.float32)


KINDS = ["normal", "skewed", "outliers", "tiny", "float32"]


# ---- layout and bytes --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES + [(8, 32, 96), (4, 1, 8)])
def test_layout_matches_reference(fmt, shape):
    lay = R.layout(fmt, *shape)
    assert T.codec_layout(int(fmt), *shape) == lay.__dict__
    kv, ps, hs = shape
    bits = {F.F16: 16, F.BF16: 16, F.INT8: 8, F.FP8_E4M3: 8, F.INT4: 4, F.INT2: 2, F.INT4_KC: 4, F.INT2_KC: 2}[fmt]
    scale_bytes = {F.F16: 0, F.BF16: 0, F.INT8: 2, F.FP8_E4M3: 2}.get(fmt, 4)
    k_scale_bytes = kv * hs * 4 if fmt in KC else kv * ps * scale_bytes
    assert lay.ideal_bytes == 2 * kv * ps * hs * bits // 8 + kv * ps * scale_bytes + k_scale_bytes
    for off in (lay.k_payload, lay.v_payload, lay.k_scales, lay.v_scales, lay.page_bytes):
        assert off % 16 == 0
    assert lay.page_bytes - lay.ideal_bytes <= 4 * 15


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_bytes_per_page_within_5_percent_of_ideal(fmt):
    checked = 0
    for kv in (1, 2, 3, 4, 8):
        for ps in (8, 16, 32, 64, 128, 256):
            for hs in (32, 64, 80, 96, 128, 256):
                lay = R.layout(fmt, kv, ps, hs)
                assert lay.page_bytes <= 1.05 * lay.ideal_bytes, (kv, ps, hs, lay)
                if ps >= 16 and hs % 16 == 0:
                    assert lay.page_bytes == lay.ideal_bytes  # no padding at all (Note [Page formats])
                checked += 1
    assert checked == 180


# ---- scalar conversions ------------------------------------------------------------------------------
def test_fp8_e4m3_matches_ml_dtypes_on_every_code_and_tie():
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], np.uint8)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    pos = np.unique(np.abs(values))
    mids = (pos[:-1].astype(np.float64) + pos[1:]) / 2  # exact ties: round to the even code
    rng = np.random.default_rng(1)
    x = np.concatenate([values, mids, -mids, rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 0.01,
                        np.nextafter(mids, 0), np.nextafter(mids, 1000)]).astype(np.float32)
    want = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got_cpp = T.codec_scalar("e4m3", x).astype(np.uint8)
    got_ref = R.f32_to_e4m3(x)
    assert np.array_equal(got_ref, want)
    assert np.array_equal(got_cpp, want)
    dec = R.e4m3_to_f32(codes)
    assert np.array_equal(dec, values)


def test_fp8_e4m3_saturates_and_keeps_nan():
    x = np.array([448, 449, 463.9, 464, 465, 480, 1e30, np.inf, -464, -np.inf, np.nan], np.float32)
    want = np.array([0x7E] * 8 + [0xFE, 0xFE, 0x7F], np.uint8)
    assert np.array_equal(T.codec_scalar("e4m3", x).astype(np.uint8), want)
    assert np.array_equal(R.f32_to_e4m3(x), want)


@pytest.mark.parametrize("conv", ["f16", "bf16"])
def test_f16_bf16_conversions_round_to_nearest_even(conv):
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = np.concatenate([x, np.array([65504, 65519.99, 65520, 1e6, -np.inf, np.inf, 2.0**-24, 2.0**-25,
                                     1.5 * 2.0**-25, 2.0**-26, 0.0, -0.0], np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):
        ref = (x.astype(np.float16) if conv == "f16" else x.astype(ml_dtypes.bfloat16)).astype(np.float32)
    got = T.codec_scalar(conv, x)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # signed zeros too


# ---- encode: C++ == numpy, byte for byte -------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("kind", KINDS)
def test_encode_page_byte_exact_cpp_vs_numpy(fmt, kind):
    rng = np.random.default_rng([int(fmt), KINDS.index(kind)])
    for shape in SHAPES:
        if shape[2] % max(1, 8 // R.PAYLOAD_BITS[fmt]):
            continue
        x = data(rng, (2, *shape), kind)
        ref = R.encode_page(fmt, x)
        cpp = cpp_encode(fmt, x)
        diff = np.flatnonzero(ref != cpp)
        assert diff.size == 0, f"{fmt.name} {kind} {shape}: bytes differ at {diff[:8]}"
        # and each side decodes the other's page to the same values
        dec_ref = R.decode_page(fmt, cpp, *shape)
        dec_cpp = T.codec_decode_page(int(fmt), *shape, ref)
        assert np.array_equal(dec_ref, dec_cpp)


# ---- round-trip error bounds ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_within_analytic_bound(fmt, kind):
    """INT8/INT4/INT2: |err| <= s/2 with s the stored scale; s <= (absmax or range)/qmax rounded up by
    one float16 step. FP8: |err| <= 2^-4 |x| + 2^-10 s. F16/BF16 (on float32 inputs): half an ulp."""
    rng = np.random.default_rng([7, int(fmt), KINDS.index(kind)])
    x = data(rng, (2, 4, 32, 64), kind)
    dec = T.codec_decode_page(int(fmt), 4, 32, 64, cpp_encode(fmt, x))
    err = np.abs(dec - x)
    bound = R.page_round_trip_bound(fmt, x)
    assert (err <= bound).all(), f"max err/bound {(err / bound).max()}"
    if fmt in (F.F16, F.BF16) and kind not in ("float32", "tiny"):
        if fmt == F.F16:
            assert np.array_equal(dec, x)  # the inputs are float16 values: lossless
        return
    assert (err / bound).max() > 0.4  # the bound is attained (up to sampling), not vacuous
    if fmt in KC:  # keys: s/2 per channel; the bound is attained there too
        assert (err[0] / bound[0]).max() > 0.4
        cols = np.swapaxes(x[0], -1, -2)
        scales = R.row_scales(fmt, cols)
        assert (scales[..., 1].astype(np.float32) <= cols.min(axis=-1)).all()
        assert (scales[..., 0].astype(np.float64) >= (cols.max(axis=-1) - scales[..., 1]) / R.QMAX[R.row_format(fmt)]
                * (1 - 2.0**-23)).all()
    elif fmt in SCALED:
        _, scales = R.encode_rows(fmt, x)
        s = scales[..., 0].astype(np.float64)
        if fmt in (F.INT8, F.FP8_E4M3):
            ideal = np.abs(x).max(axis=-1) / R.QMAX[fmt]
        else:
            ideal = (x.max(axis=-1) - scales[..., 1].astype(np.float64)) / R.QMAX[fmt]
            assert (scales[..., 1].astype(np.float32) <= x.min(axis=-1)).all()  # minimum rounded down
        assert (s >= ideal * (1 - 2.0**-23)).all()  # rounded up: no clipping at the row's extremes
        assert (s <= ideal * (1 + 2.0**-10) + 2.0**-24).all()  # by at most one float16 step


def test_error_per_format_is_ordered():
    """On the same rows, fewer bits give larger errors: a sanity check of the table in the Note."""
    rng = np.random.default_rng(3)
    x = data(rng, (2, 4, 32, 128), "normal")
    rms = {}
    for fmt in [F.F16, F.BF16, F.INT8, F.FP8_E4M3, F.INT4, F.INT2]:
        dec = T.codec_decode_page(int(fmt), 4, 32, 128, cpp_encode(fmt, x))
        rms[fmt] = float(np.sqrt(np.mean((dec - x) ** 2) / np.mean(x**2)))
    assert rms[F.F16] == 0.0
    assert 0 < rms[F.BF16] < rms[F.INT8] < rms[F.FP8_E4M3] < rms[F.INT4] < rms[F.INT2] < 0.5, rms


# ---- edge cases --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_all_zero_page_decodes_to_exact_zeros(fmt):
    x = np.zeros((2, 2, 16, 64), np.float32)
    page = cpp_encode(fmt, x)
    assert np.array_equal(page, R.encode_page(fmt, x))
    dec = T.codec_decode_page(int(fmt), 2, 16, 64, page)
    assert np.array_equal(dec, x) and not np.signbit(dec).any()


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_constant_rows(fmt):
    c = np.array([-3.0, -0.5, 0.0, 1e-5, 7.25, 1000.0], np.float32).astype(np.float16).astype(np.float32)
    x = np.broadcast_to(c[:, None], (2, 1, 6, 64)).astype(np.float32).copy()  # tokens of constant rows
    page = cpp_encode(fmt, x)
    assert np.array_equal(page, R.encode_page(fmt, x))
    dec = T.codec_decode_page(int(fmt), 1, 6, 64, page)
    assert (np.abs(dec - x) <= R.page_round_trip_bound(fmt, x)).all()
    if fmt in (F.F16, F.INT4, F.INT2):  # scale 0, minimum = the constant: exact
        assert np.array_equal(dec, x)
    if fmt in KC:  # values per row: exact; keys per channel see the 6 different constants
        assert np.array_equal(dec[1], x[1]) and not np.array_equal(dec[0], x[0])
    assert np.all(dec == dec[..., :1])  # a constant row stays constant


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_refused_by_scaled_formats_page_untouched(fmt, bad):
    rng = np.random.default_rng(4)
    x = data(rng, (2, 2, 8, 64), "normal")
    x[1, 1, 5, 17] = bad
    if fmt in (F.F16, F.BF16):  # the wide formats store what the logical type stores
        dec = T.codec_decode_page(int(fmt), 2, 8, 64, cpp_encode(fmt, x))
        assert np.array_equal(np.isnan(dec), np.isnan(x))
        assert dec[1, 1, 5, 17] == bad or np.isnan(bad)
        assert np.array_equal(R.decode_page(fmt, R.encode_page(fmt, x), 2, 8, 64)[1, 1, 5, 17:18],
                              dec[1, 1, 5, 17:18], equal_nan=True)
        return
    page = np.full(R.layout(fmt, 2, 8, 64).page_bytes, 0xA5, np.uint8)
    before = page.copy()
    err = native_error(T.codec_encode_page, int(fmt), x, page)
    assert np.array_equal(page, before)
    msg = str(err)
    assert f"{fmt.name} page: V row [head=1 token=5] holds inf or NaN" in msg and "page unchanged" in msg
    assert "F16/BF16" in msg
    where = r"V row \[head, token\] \[1, 5\]" if fmt in KC else r"row \[kv, head, token\] \[1, 1, 5\]"
    with pytest.raises(CacheInputError, match=rf"{fmt.name} {where} holds inf or NaN"):
        R.encode_page(fmt, x)
    if fmt in KC:  # in the keys: named by channel
        x[1, 1, 5, 17] = 0.0
        x[0, 1, 2, 17] = bad
        err = native_error(T.codec_encode_page, int(fmt), x, page)
        assert np.array_equal(page, before)
        assert f"{fmt.name} page: K channel [head=1 channel=17] holds inf or NaN" in str(err)
        with pytest.raises(CacheInputError, match=rf"{fmt.name} K channel \[head, channel\] \[1, 17\] holds"):
            R.encode_page(fmt, x)


@pytest.mark.parametrize("fmt", SCALED, ids=lambda f: f.name)
def test_scale_beyond_float16_refused_page_untouched(fmt):
    x = np.zeros((2, 1, 4, 8), np.float32)
    x[0, 0, 2, :2] = (-2.0**25, 2.0**25)  # bfloat16-sized values: the float16 scale cannot hold them
    page = np.full(R.layout(fmt, 1, 4, 8).page_bytes, 0x3C, np.uint8)
    before = page.copy()
    err = native_error(T.codec_encode_page, int(fmt), x, page)
    assert np.array_equal(page, before)
    where = "K channel [head=0 channel=0]" if fmt in KC else "K row [head=0 token=2]"
    assert f"{fmt.name} page: {where} needs a scale or minimum beyond float16" in str(err)
    assert "store the page as BF16" in str(err)
    with pytest.raises(CacheInputError, match="beyond float16"):
        R.encode_page(fmt, x)
    T.codec_encode_page(int(F.BF16), x, page2 := np.zeros(R.layout(F.BF16, 1, 4, 8).page_bytes, np.uint8))
    assert np.array_equal(T.codec_decode_page(int(F.BF16), 1, 4, 8, page2), x)  # the remedy works


def test_bad_shapes_and_formats_refused():
    msg = str(native_error(T.codec_layout, int(F.INT4), 1, 4, 7))
    assert "INT4 packs 2 channels per byte, so head_size must be a multiple of 2; got head_size=7" in msg
    assert "head_size must be a multiple of 4; got head_size=6" in str(native_error(T.codec_layout, int(F.INT2_KC), 1, 4, 6))
    assert "page format 9 is not a page format" in str(native_error(T.codec_layout, 9, 1, 4, 8))
    assert "page format -1 is not a page format" in str(native_error(T.codec_layout, -1, 1, 4, 8))
    assert "must be positive" in str(native_error(T.codec_layout, 0, 0, 4, 8))
    with pytest.raises(CacheInputError, match="multiple of 4; got head_size=6"):
        R.layout(F.INT2, 1, 4, 6)
    with pytest.raises(CacheInputError, match="page format 9"):
        R.layout(9, 1, 4, 8)


# ---- packing order (Note [Page formats]) -------------------------------------------------------------
def test_packing_order():
    x = np.zeros((2, 1, 1, 16), np.float32)
    x[...] = np.arange(16)  # minimum 0, range 15: INT4 codes are the channel numbers
    page = cpp_encode(F.INT4, x)
    lay = R.layout(F.INT4, 1, 1, 16)
    assert list(page[:4]) == [0x10, 0x32, 0x54, 0x76]  # channel 2i low nibble, 2i+1 high nibble
    assert list(page[lay.k_scales:lay.k_scales + 4].view(np.float16)) == [1.0, 0.0]  # s, minimum
    x[...] = np.arange(16) % 4  # range 3: INT2 codes are c % 4
    page = cpp_encode(F.INT2, x)
    assert list(page[:4]) == [0xE4] * 4  # channel 4i + j at bits 2j


# ---- direct writes of one row --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_direct_row_write_changes_only_that_row(fmt):
    rng = np.random.default_rng(5)
    shape = (2, 16, 64)
    x = data(rng, (2, *shape), "normal")
    page = cpp_encode(fmt, x)
    before = page.copy()
    row = data(rng, (64,), "skewed")
    T.codec_encode_row(int(fmt), 2, 16, page, 1, 1, 9, row)
    x[1, 1, 9] = row
    assert np.array_equal(page, R.encode_page(fmt, x))  # == encoding the whole page with the new row
    lay = R.layout(fmt, *shape)
    changed = np.flatnonzero(page != before)
    r = 16 + 9  # V, head 1, token 9
    allowed = set(range(lay.v_payload + r * lay.row_bytes, lay.v_payload + (r + 1) * lay.row_bytes))
    allowed |= set(range(lay.v_scales + r * lay.scale_row_bytes, lay.v_scales + (r + 1) * lay.scale_row_bytes))
    assert changed.size > 0 and set(changed.tolist()) <= allowed


@pytest.mark.parametrize("fmt", SCALED, ids=lambda f: f.name)
def test_direct_row_write_refusals_leave_page_untouched(fmt):
    rng = np.random.default_rng(6)
    page = cpp_encode(fmt, data(rng, (2, 2, 16, 64), "normal"))
    before = page.copy()
    row = data(rng, (64,), "normal")
    row[3] = np.nan
    err = native_error(T.codec_encode_row, int(fmt), 2, 16, page, 1, 1, 4, row)
    assert f"{fmt.name} page: V row [head=1 token=4] holds inf or NaN" in str(err)
    row[3] = 1.0
    err = native_error(T.codec_encode_row, int(fmt), 2, 16, page, 1, 2, 4, row)
    assert "row (kv=1, head=2, token=4) is outside the page [2, 2, 16]; page unchanged" in str(err)
    native_error(T.codec_encode_row, int(fmt), 2, 16, page, 0, 0, 16, row)
    assert np.array_equal(page, before)


@pytest.mark.parametrize("fmt", KC, ids=lambda f: f.name)
def test_keys_per_channel_refuse_a_direct_key_row_write_page_untouched(fmt):
    rng = np.random.default_rng(8)
    page = cpp_encode(fmt, data(rng, (2, 2, 16, 64), "outliers"))
    before = page.copy()
    err = native_error(T.codec_encode_row, int(fmt), 2, 16, page, 0, 1, 3, data(rng, (64,), "normal"))
    msg = str(err)
    assert f"{fmt.name} page: K row [head=1 token=3]: keys are scaled per channel over the page" in msg
    assert "fill the page as F16/BF16 and encode it whole when full" in msg and "page unchanged" in msg
    assert np.array_equal(page, before)


@pytest.mark.parametrize("fmt", KC, ids=lambda f: f.name)
def test_requantize_full_f16_page_into_keys_per_channel(fmt):
    """KIVI's residual window as pages: a page fills in F16 by direct writes, and once full it is decoded
    and encoded whole into the narrow format; the result equals encoding the values directly."""
    rng = np.random.default_rng(9)
    x = data(rng, (2, 2, 16, 64), "outliers")
    wide = np.zeros(R.layout(F.F16, 2, 16, 64).page_bytes, np.uint8)
    for t in range(16):
        for kv in range(2):
            for h in range(2):
                T.codec_encode_row(int(F.F16), 2, 16, wide, kv, h, t, x[kv, h, t])
    full = T.codec_decode_page(int(F.F16), 2, 16, 64, wide)
    assert np.array_equal(full, x)
    assert np.array_equal(cpp_encode(fmt, full), R.encode_page(fmt, x))


@pytest.mark.parametrize("fmt", KC, ids=lambda f: f.name)
def test_keys_per_channel_beat_per_token_on_outlier_channels(fmt):
    """The reason the *_KC formats exist (Note [Page formats]): keys with outlier channels."""
    rng = np.random.default_rng(10)
    offset = np.zeros(64)
    offset[[3, 17, 40, 41]] = (20.0, -20.0, 15.0, -25.0)  # channels large for every token (KIVI, Fig. 2)
    x = (rng.standard_normal((2, 4, 64, 64)) + offset).astype(np.float16).astype(np.float32)
    per_token = R.row_format(fmt)
    rms = {}
    for f in (fmt, per_token):
        dec = T.codec_decode_page(int(f), 4, 64, 64, cpp_encode(f, x))
        rms[f] = [float(np.sqrt(np.mean((dec[kv] - x[kv]) ** 2) / np.mean(x[kv] ** 2))) for kv in range(2)]
    assert rms[fmt][0] < 0.25 * rms[per_token][0], rms  # keys: per channel at least 4x as accurate
    assert rms[fmt][1] == rms[per_token][1]  # values: the same quantizer


KERNEL = r"""
#include "codecs.h"
using namespace ortkv::codecs;
// What a PagedCacheAttention / PagedCacheUpdate kernel does: a PageView per page, rows in registers.
__global__ void RoundTrip(uint8_t* page, int32_t format, PageShape shape, const float* in, float* out, int* status) {
  const PageView v = PageView::Make(page, static_cast<PageFormat>(format), shape);
  const int kv = blockIdx.x, head = blockIdx.y, token = threadIdx.x;
  float row[256];
  const float* src = in + ((kv * shape.kv_heads + head) * shape.page_size + token) * shape.head_size;
  status[(kv * shape.kv_heads + head) * shape.page_size + token] = static_cast<int>(v.EncodeRow(kv, head, token, src));
  v.DecodeRow(kv, head, token, row);
  for (int c = 0; c < shape.head_size; ++c) out[(src - in) + c] = row[c];
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_codec_headers_compile_as_cuda_device_code(tmp_path):
    """custom_ops/codecs is framework-free host AND device code (ORTKV_HD): a kernel using PageView
    compiles with nvcc (and with host warnings as errors)."""
    root = Path(__file__).resolve().parents[1] / "custom_ops"
    src = tmp_path / "k.cu"
    src.write_text(KERNEL)
    cmd = ["nvcc", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o"), "-arch=sm_80", f"-I{root / 'codecs'}",
           f"-I{root / 'include'}", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "k.o").stat().st_size > 0
