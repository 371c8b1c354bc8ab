"""numpy reference codecs for the per-page KV formats.

Same formats, scales and byte layout as the C++ codecs (custom_ops/codecs, Note [Page formats]), written
independently and vectorized: a page encoded by one decodes in the other, and encoding is byte-exact
between them on finite inputs.

A page holds ``[2 (K, V), kv_heads, page_size, head_size]`` values. Its bytes are, each section starting
on a 16-byte boundary::

    K payload [kv_heads, page_size, row_bytes] | V payload | K scales [kv_heads, page_size, n] float16 | V scales

Per (K or V, head, token) row: INT8 and FP8_E4M3 keep one float16 scale ``s`` (symmetric), INT4 and INT2
keep ``s`` and a float16 minimum ``m`` (asymmetric); F16 and BF16 keep none. INT4_KC and INT2_KC quantize
V like INT4 / INT2 but keys per (head, channel) over the page's tokens (K scales [kv_heads, head_size, 2]),
so their keys are only encoded with the whole page. ``s`` is rounded up and
``m`` down to float16, and codes are computed against the stored values, so the error bounds hold:

    INT8, INT4, INT2:  |x - decode(x)| <= s / 2
    FP8_E4M3:          |x - decode(x)| <= 2**-4 * |x| + 2**-10 * s   (3 mantissa bits; subnormal step)

(each up to one float32 rounding). The scaled formats refuse rows holding inf or NaN.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..errors import CacheInputError

SECTION_ALIGN = 16


class PageFormat(enum.IntEnum):
    F16 = 0
    BF16 = 1
    INT8 = 2
    FP8_E4M3 = 3
    INT4 = 4
    INT2 = 5
    INT4_KC = 6  # keys per (head, channel) over the page, values per row
    INT2_KC = 7


PAYLOAD_BITS = {PageFormat.F16: 16, PageFormat.BF16: 16, PageFormat.INT8: 8, PageFormat.FP8_E4M3: 8,
                PageFormat.INT4: 4, PageFormat.INT2: 2, PageFormat.INT4_KC: 4, PageFormat.INT2_KC: 2}
SCALES_PER_ROW = {PageFormat.F16: 0, PageFormat.BF16: 0, PageFormat.INT8: 1, PageFormat.FP8_E4M3: 1,
                  PageFormat.INT4: 2, PageFormat.INT2: 2, PageFormat.INT4_KC: 2, PageFormat.INT2_KC: 2}
QMAX = {PageFormat.INT8: 127.0, PageFormat.FP8_E4M3: 448.0, PageFormat.INT4: 15.0, PageFormat.INT2: 3.0}
KEYS_PER_CHANNEL = {PageFormat.INT4_KC: PageFormat.INT4, PageFormat.INT2_KC: PageFormat.INT2}  # -> row quantizer


def row_format(fmt) -> PageFormat:
    fmt = PageFormat(int(fmt))
    return KEYS_PER_CHANNEL.get(fmt, fmt)


@dataclass(frozen=True)
class PageLayout:
    row_bytes: int
    scale_row_bytes: int
    k_payload: int
    v_payload: int
    k_scales: int
    v_scales: int
    page_bytes: int
    ideal_bytes: int


def _align(n: int) -> int:
    return -(-n // SECTION_ALIGN) * SECTION_ALIGN


def check_shape(fmt, kv_heads: int, page_size: int, head_size: int) -> PageFormat:
    try:
        fmt = PageFormat(int(fmt))
    except ValueError:
        raise CacheInputError(f"page format {fmt} is not a page format (0 F16, 1 BF16, 2 INT8, 3 FP8_E4M3, "
                              f"4 INT4, 5 INT2, 6 INT4_KC, 7 INT2_KC)") from None
    if min(kv_heads, page_size, head_size) <= 0:
        raise CacheInputError(f"page shape [kv_heads={kv_heads} page_size={page_size} head_size={head_size}] "
                              f"must be positive")
    per_byte = max(1, 8 // PAYLOAD_BITS[fmt])
    if head_size % per_byte:
        raise CacheInputError(f"{fmt.name} packs {per_byte} channels per byte, so head_size must be a multiple "
                              f"of {per_byte}; got head_size={head_size} (store such pages as "
                              f"F16/BF16/INT8/FP8_E4M3)")
    return fmt


def layout(fmt, kv_heads: int, page_size: int, head_size: int) -> PageLayout:
    fmt = check_shape(fmt, kv_heads, page_size, head_size)
    rows = kv_heads * page_size
    row_bytes = head_size * PAYLOAD_BITS[fmt] // 8
    scale_row_bytes = 2 * SCALES_PER_ROW[fmt]
    v_scales = rows * scale_row_bytes
    k_scales = kv_heads * head_size * scale_row_bytes if fmt in KEYS_PER_CHANNEL else v_scales
    payload = _align(rows * row_bytes)
    return PageLayout(row_bytes, scale_row_bytes, 0, payload, 2 * payload, 2 * payload + _align(k_scales),
                      2 * payload + _align(k_scales) + _align(v_scales),
                      2 * rows * row_bytes + k_scales + v_scales)


# ---- float8 e4m3fn (bias 7, max 448, no inf), saturating --------------------------------------------
def f32_to_e4m3(v: np.ndarray) -> np.ndarray:
    """e4m3fn codes (uint8) of float32 values: round-to-nearest-even, |v| > 448 and inf saturate to
    +-448, NaN -> 0x7F."""
    v = np.asarray(v, np.float32)
    a = np.abs(v).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        _, e = np.frexp(a)  # a = f * 2**e, f in [0.5, 1): the unbiased exponent is e - 1
        normal = a >= 2.0 ** -6
        # normal: 1.mmm * 2**(e-1) -> q = rint(a * 2**(4 - e)) in [8, 16]; subnormal: q = rint(a * 2**9)
        q = np.where(normal, np.rint(np.ldexp(a, np.where(normal, 4 - e, 0))), np.rint(a * 512.0))
        q = np.nan_to_num(q, nan=0.0, posinf=0.0)
        code = np.where(normal, (e - 1 + 7) * 8 + q - 8, q)
        code = np.where(np.isfinite(code), code, 0x7E)
    code = np.minimum(code, 0x7E)
    code = np.where(a > 448.0, 0x7E, code).astype(np.uint8)
    code = code | np.where(np.signbit(v), np.uint8(0x80), np.uint8(0))
    return np.where(np.isnan(v), np.uint8(0x7F), code).astype(np.uint8)


def e4m3_to_f32(c: np.ndarray) -> np.ndarray:
    c = np.asarray(c, np.uint8).astype(np.int32)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m / 512.0, np.ldexp(1.0 + m / 8.0, e - 7))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


# ---- float16 helpers -----------------------------------------------------------------------------------
def _f16_ceil(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = v.astype(np.float16)
    return np.where(h.astype(np.float32) < v, np.nextafter(h, np.float16(np.inf)), h).astype(np.float16)


def _f16_floor(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = v.astype(np.float16)
    return np.where(h.astype(np.float32) > v, np.nextafter(h, np.float16(-np.inf)), h).astype(np.float16)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16), round-to-nearest-even; NaN -> quiet NaN."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), ((u >> 16) | 0x40).astype(np.uint16), rounded)


# ---- rows --------------------------------------------------------------------------------------------------
def row_scales(fmt, x: np.ndarray, what: str = "row") -> np.ndarray:
    """float16 scales [..., scales_per_row] of rows x [..., n] (s; or s and the minimum). Raises
    CacheInputError for non-finite values or a scale beyond float16."""
    name = PageFormat(int(fmt)).name
    fmt = row_format(fmt)
    x = np.asarray(x, np.float32)
    finite = np.isfinite(x).all(axis=-1)
    if not finite.all():
        where = [int(i) for i in np.argwhere(~finite)[0]]
        raise CacheInputError(f"{name} {what} {where} holds inf or NaN; the scaled formats refuse "
                              f"non-finite values (store the page as F16/BF16, or fix the values)")
    qmax = np.float32(QMAX[fmt])
    with np.errstate(over="ignore", invalid="ignore"):
        if fmt in (PageFormat.INT8, PageFormat.FP8_E4M3):
            s16 = _f16_ceil(np.abs(x).max(axis=-1) / qmax)
            bad = ~np.isfinite(s16)
            scales = s16[..., None]
        else:
            m16 = _f16_floor(x.min(axis=-1))
            rng = x.max(axis=-1) - m16.astype(np.float32)
            s16 = _f16_ceil(rng / qmax)
            bad = ~np.isfinite(m16) | ~np.isfinite(s16) | ~np.isfinite(rng)
            scales = np.stack([s16, m16], axis=-1)
    if bad.any():
        where = [int(i) for i in np.argwhere(bad)[0]]
        raise CacheInputError(f"{name} {what} {where} needs a scale or minimum beyond float16 "
                              f"(|x| too large); store the page as BF16")
    return scales.astype(np.float16)


def _quantize(fmt, x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Codes of x against the given float16 scales (broadcast): int8 / e4m3 bytes, or unpacked
    INT4 / INT2 codes."""
    fmt = row_format(fmt)
    s = scales[..., 0:1].astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        if fmt == PageFormat.INT8:
            return np.clip(np.rint(np.where(s > 0, x / s, np.float32(0))), -127, 127).astype(np.int8).view(np.uint8)
        if fmt == PageFormat.FP8_E4M3:
            return f32_to_e4m3(np.where(s > 0, x / s, np.float32(0)))
        m = scales[..., 1:2].astype(np.float32)
        return np.clip(np.rint(np.where(s > 0, (x - m) / s, np.float32(0))), 0, QMAX[fmt]).astype(np.uint8)


def encode_rows(fmt, x: np.ndarray, what: str = "row") -> tuple[np.ndarray, np.ndarray]:
    """Encode rows x [..., head_size] (float32) -> (payload uint8 [..., row_bytes], scales float16
    [..., scales_per_row]). Raises CacheInputError for non-finite values or a scale beyond float16 in
    the scaled formats."""
    page_fmt, fmt = fmt, row_format(fmt)
    x = np.ascontiguousarray(x, np.float32)
    head_size = x.shape[-1]
    lead = x.shape[:-1]
    if fmt == PageFormat.F16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint8).reshape(*lead, 2 * head_size), np.zeros((*lead, 0), np.float16)
    if fmt == PageFormat.BF16:
        return _to_bf16_bits(x).view(np.uint8).reshape(*lead, 2 * head_size), np.zeros((*lead, 0), np.float16)
    scales = row_scales(page_fmt, x, what)
    q = _quantize(fmt, x, scales)
    if PAYLOAD_BITS[fmt] < 8:
        q = _pack(fmt, q)
    return np.ascontiguousarray(q), scales


def decode_rows(fmt, payload: np.ndarray, scales: np.ndarray, head_size: int) -> np.ndarray:
    """Inverse of encode_rows: float32 [..., head_size]."""
    fmt = row_format(fmt)
    payload = np.ascontiguousarray(payload, np.uint8)
    lead = payload.shape[:-1]
    if fmt == PageFormat.F16:
        return payload.view(np.float16).astype(np.float32).reshape(*lead, head_size)
    if fmt == PageFormat.BF16:
        bits = payload.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(*lead, head_size)
    s = scales[..., 0:1].astype(np.float32)
    if fmt == PageFormat.INT8:
        return payload.view(np.int8).astype(np.float32) * s
    if fmt == PageFormat.FP8_E4M3:
        return e4m3_to_f32(payload) * s
    return _unpack(fmt, payload, head_size).astype(np.float32) * s + scales[..., 1:2].astype(np.float32)


# ---- pages ----------------------------------------------------------------------------------------------------
def _sections(fmt, lay: PageLayout, page: np.ndarray, kv_heads: int, page_size: int, head_size: int):
    """Views of (payload, scales) for K and V; the scales of *_KC keys are [kv_heads, head_size, 2]."""
    fmt = PageFormat(int(fmt))
    n = SCALES_PER_ROW[fmt]
    rows = kv_heads * page_size
    out = []
    for kv in range(2):
        p0 = (lay.k_payload, lay.v_payload)[kv]
        s0 = (lay.k_scales, lay.v_scales)[kv]
        per = head_size if (kv == 0 and fmt in KEYS_PER_CHANNEL) else page_size
        out.append((page[p0:p0 + rows * lay.row_bytes].reshape(kv_heads, page_size, lay.row_bytes),
                    page[s0:s0 + kv_heads * per * lay.scale_row_bytes].view(np.float16).reshape(kv_heads, per, n)))
    return out


def _pack(fmt, q: np.ndarray) -> np.ndarray:
    bits = PAYLOAD_BITS[PageFormat(int(fmt))]
    per_byte = 8 // bits
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per_byte, per_byte)
    return np.bitwise_or.reduce(q << (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8), axis=-1)


def _unpack(fmt, payload: np.ndarray, head_size: int) -> np.ndarray:
    bits = PAYLOAD_BITS[PageFormat(int(fmt))]
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    return ((payload[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*payload.shape[:-1], head_size)


def encode_keys_per_channel(fmt, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys [kv_heads, page_size, head_size] of a *_KC page -> (payload [kv_heads, page_size, row_bytes],
    channel scales float16 [kv_heads, head_size, 2]): the row quantizer applied to each channel's column."""
    fmt = PageFormat(int(fmt))
    cols = np.swapaxes(np.asarray(keys, np.float32), -1, -2)  # [kv_heads, head_size, page_size]
    scales = row_scales(fmt, cols, what="K channel [head, channel]")
    return _pack(fmt, np.swapaxes(_quantize(fmt, cols, scales), -1, -2)), scales


def decode_keys_per_channel(fmt, payload: np.ndarray, scales: np.ndarray, head_size: int) -> np.ndarray:
    q = _unpack(fmt, payload, head_size).astype(np.float32)  # [kv_heads, page_size, head_size]
    s, m = (scales[:, None, :, i].astype(np.float32) for i in (0, 1))
    return q * s + m


def encode_page(fmt, values: np.ndarray) -> np.ndarray:
    """values [2, kv_heads, page_size, head_size] -> page bytes (uint8 [page_bytes]; padding zero)."""
    values = np.asarray(values, np.float32)
    if values.ndim != 4 or values.shape[0] != 2:
        raise CacheInputError(f"page values must be [2, kv_heads, page_size, head_size]; got {list(values.shape)}")
    _, kv_heads, page_size, head_size = values.shape
    fmt = PageFormat(int(fmt))
    lay = layout(fmt, kv_heads, page_size, head_size)
    if fmt in KEYS_PER_CHANNEL:
        k = encode_keys_per_channel(fmt, values[0])
        v = encode_rows(fmt, values[1], what="V row [head, token]")
        parts = [k, v]
    else:
        payload, scales = encode_rows(fmt, values, what="row [kv, head, token]")
        parts = [(payload[0], scales[0]), (payload[1], scales[1])]
    page = np.zeros(lay.page_bytes, np.uint8)
    for (p, s), (payload, scales) in zip(_sections(fmt, lay, page, kv_heads, page_size, head_size), parts):
        p[...] = payload
        s[...] = scales
    return page


def decode_page(fmt, page: np.ndarray, kv_heads: int, page_size: int, head_size: int) -> np.ndarray:
    """page bytes -> values [2, kv_heads, page_size, head_size] float32."""
    lay = layout(fmt, kv_heads, page_size, head_size)
    fmt = PageFormat(int(fmt))
    page = np.ascontiguousarray(page, np.uint8).reshape(-1)
    if page.size != lay.page_bytes:
        raise CacheInputError(f"page has {page.size} bytes; a {fmt.name} page of "
                              f"[2, {kv_heads}, {page_size}, {head_size}] has {lay.page_bytes}")
    (kp, ks), (vp, vs) = _sections(fmt, lay, page, kv_heads, page_size, head_size)
    k = (decode_keys_per_channel(fmt, kp, ks, head_size) if fmt in KEYS_PER_CHANNEL
         else decode_rows(fmt, kp, ks, head_size))
    return np.stack([k, decode_rows(fmt, vp, vs, head_size)])


def round_trip_bound(fmt, x: np.ndarray) -> np.ndarray:
    """The analytic per-value error bound of encoding rows x [..., head_size] with fmt's row quantizer
    (plus float32 slack)."""
    fmt = row_format(fmt)
    x = np.asarray(x, np.float32)
    eps = np.float32(2.0 ** -22) * (np.abs(x) + np.abs(x).max(axis=-1, keepdims=True))
    if fmt == PageFormat.F16:
        return np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -25)
    if fmt == PageFormat.BF16:
        return np.abs(x) * 2.0 ** -8
    s = row_scales(fmt, x)[..., 0:1].astype(np.float32)
    if fmt == PageFormat.FP8_E4M3:
        return 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * s + eps
    return s / 2 + eps


def page_round_trip_bound(fmt, values: np.ndarray) -> np.ndarray:
    """round_trip_bound for a page [2, kv_heads, page_size, head_size]: per channel for *_KC keys."""
    fmt = PageFormat(int(fmt))
    values = np.asarray(values, np.float32)
    if fmt not in KEYS_PER_CHANNEL:
        return round_trip_bound(fmt, values)
    k_bound = np.swapaxes(round_trip_bound(fmt, np.swapaxes(values[0], -1, -2)), -1, -2)
    return np.stack([k_bound, round_trip_bound(fmt, values[1])])
