// Row and page codecs for the per-page KV formats (Note [Page formats] in page_format.h).
//
// Everything above the "host only" line is ORTKV_HD (host and CUDA device), allocation-free and
// exception-free: a kernel builds a PageView for a page and calls DecodeRow / EncodeRow in registers.
// The host-only part (ValidateShape, EncodePage, DecodePage) returns ortkv::Status.
//
// Note [Codec arithmetic]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Encoding is bit-exact between this file and the numpy reference: every step is one IEEE float32
// operation (absmax, max - min, divide by the stored scale) followed by a round-to-nearest-even to
// the code, and the float16 / bfloat16 / e4m3fn conversions are done on bits here (no intrinsics, no
// dependence on the rounding mode). Quantizers DIVIDE by the stored scale (never multiply by a
// reciprocal), so a build must not use fast-math for this code. Decoding is q * s (+ m): exact up to
// one float32 rounding (a device compiler may fuse it into an fma, which is only more accurate).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "page_format.h"
#include "ortkv/status.h"

namespace ortkv {
namespace codecs {

// ---- scalar conversions ------------------------------------------------------------------------
ORTKV_HD uint32_t BitsOf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
ORTKV_HD float FloatOf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// m >> shift, rounded to nearest, ties to even (1 <= shift <= 31).
ORTKV_HD uint32_t ShiftRne(uint32_t m, uint32_t shift) {
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// float32 -> IEEE binary16 bits, round-to-nearest-even; overflow -> inf; NaN -> quiet NaN.
ORTKV_HD uint16_t F32ToF16Bits(float f) {
  const uint32_t x = BitsOf(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                                              // below 2^-14: subnormal
    const uint32_t e = ax >> 23;
    if (e == 0) return static_cast<uint16_t>(sign);
    const uint32_t shift = 126u - e;  // value * 2^24 = m24 * 2^(e - 126)
    if (shift >= 25u) return static_cast<uint16_t>(sign);
    return static_cast<uint16_t>(sign | ShiftRne((ax & 0x7FFFFFu) | 0x800000u, shift));
  }
  return static_cast<uint16_t>(sign | ShiftRne(ax - ((127u - 15u) << 23), 13u));
}

ORTKV_HD float F16BitsToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0) {
    const float v = static_cast<float>(m) * (1.0f / 16777216.0f);  // m * 2^-24, exact
    return (h & 0x8000u) ? -v : v;
  }
  if (e == 31) return FloatOf(sign | 0x7F800000u | (m << 13));
  return FloatOf(sign | ((e + 112u) << 23) | (m << 13));
}

// float32 -> bfloat16 bits, round-to-nearest-even; NaN -> quiet NaN.
ORTKV_HD uint16_t F32ToBF16Bits(float f) {
  const uint32_t x = BitsOf(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}
ORTKV_HD float BF16BitsToF32(uint16_t b) { return FloatOf(static_cast<uint32_t>(b) << 16); }

// n float32 values rounded to a 16-bit logical type and back in place (`logical`: ONNX's element type number, 10
// float16 or 16 bfloat16; anything else leaves them): what a kernel fed that type would hold. Both requantizes
// (kernels/cpu/paged_requantize.cc, kernels/cuda/paged_requantize.cu) round decoded pages with it.
ORTKV_HD void RoundToLogical(float* x, int64_t n, int32_t logical) {
  if (logical == 10) {
    for (int64_t i = 0; i < n; ++i) x[i] = F16BitsToF32(F32ToF16Bits(x[i]));
  } else if (logical == 16) {
    for (int64_t i = 0; i < n; ++i) x[i] = BF16BitsToF32(F32ToBF16Bits(x[i]));
  }
}

// float32 -> float8 e4m3fn (bias 7, no inf, 0x7F / 0xFF NaN, max 448), round-to-nearest-even,
// SATURATING: |x| > 448 (inf included) -> +-448. NaN -> 0x7F (the scaled codecs refuse NaN first).
ORTKV_HD uint8_t F32ToE4M3(float f) {
  const uint32_t x = BitsOf(f);
  const uint32_t sign = (x >> 24) & 0x80u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return 0x7Fu;
  const int32_t e = static_cast<int32_t>(ax >> 23) - 127;  // unbiased float32 exponent
  uint32_t code;
  if (e > 8) {
    code = 0x7Eu;
  } else if (e >= -6) {  // normal e4m3: 1.mmm * 2^e, exponent field e + 7
    const uint32_t q = ShiftRne((ax & 0x7FFFFFu) | 0x800000u, 20u);  // in [8, 16]
    code = (static_cast<uint32_t>(e + 7) << 3) + (q - 8u);           // q == 16 carries into e
    if (code > 0x7Eu) code = 0x7Eu;
  } else {  // subnormal e4m3: q * 2^-9, q in [0, 8] (8 is the smallest normal, code 0x08)
    const uint32_t shift = static_cast<uint32_t>(14 - e);
    code = (ax < 0x00800000u || shift >= 25u) ? 0u : ShiftRne((ax & 0x7FFFFFu) | 0x800000u, shift);
  }
  return static_cast<uint8_t>(sign | code);
}

ORTKV_HD float E4M3ToF32(uint8_t c) {
  const uint32_t e = (c >> 3) & 0xFu;
  const uint32_t m = c & 7u;
  float v;
  if ((c & 0x7Fu) == 0x7Fu) return FloatOf(0x7FC00000u);
  if (e == 0) {
    v = static_cast<float>(m) * (1.0f / 512.0f);
  } else {
    v = FloatOf(((e + 120u) << 23) | (m << 20));
  }
  return (c & 0x80u) ? -v : v;
}

// The next float16 above / below a finite value (bits in, bits out).
ORTKV_HD uint16_t F16NextUp(uint16_t h) {
  if (h == 0x8000u) return 0x0001u;
  return static_cast<uint16_t>((h & 0x8000u) ? h - 1u : h + 1u);
}
ORTKV_HD uint16_t F16NextDown(uint16_t h) {
  if (h == 0x0000u) return 0x8001u;
  return static_cast<uint16_t>((h & 0x8000u) ? h + 1u : h - 1u);
}
// float16 at or above v (v finite); may be inf when v > 65504.
ORTKV_HD uint16_t F16Ceil(float v) {
  uint16_t h = F32ToF16Bits(v);
  if (F16BitsToF32(h) < v) h = F16NextUp(h);
  return h;
}
ORTKV_HD uint16_t F16Floor(float v) {
  uint16_t h = F32ToF16Bits(v);
  if (F16BitsToF32(h) > v) h = F16NextDown(h);
  return h;
}
ORTKV_HD bool F16IsFinite(uint16_t h) { return (h & 0x7C00u) != 0x7C00u; }

// ---- rows ----------------------------------------------------------------------------------------
enum class RowResult : int32_t {
  kOk = 0,
  kNonFinite = 1,      // a scaled format was given inf or NaN: nothing written
  kScaleOverflow = 2,  // the row's scale or minimum does not fit float16: nothing written
  kNeedsFullPage = 3,  // a K row of a KeysPerChannel format: only EncodePage can write keys
};

// The per-row quantizer a format uses for its rows: the *_KC formats' V rows (and their keys' channels)
// use INT4 / INT2's asymmetric quantizer.
ORTKV_HD PageFormat RowFormat(PageFormat f) {
  return f == PageFormat::kInt4KC ? PageFormat::kInt4 : (f == PageFormat::kInt2KC ? PageFormat::kInt2 : f);
}

// Largest code magnitude of the symmetric formats, levels - 1 of the asymmetric ones.
ORTKV_HD float QMax(PageFormat f) {
  switch (f) {
    case PageFormat::kInt8: return 127.0f;
    case PageFormat::kFp8E4M3: return 448.0f;
    case PageFormat::kInt4:
    case PageFormat::kInt4KC: return 15.0f;
    case PageFormat::kInt2:
    case PageFormat::kInt2KC: return 3.0f;
    default: return 0.0f;
  }
}

// The float16 scales of n values x[0], x[stride], ... (scales[0] = s, scales[1] = minimum for the
// asymmetric formats), without writing anything. Returns kOk, kNonFinite or kScaleOverflow.
ORTKV_HD RowResult RowScales(PageFormat f, const float* x, int32_t n, uint16_t* scales, int64_t stride = 1) {
  const int32_t ns = ScalesPerRow(f);
  if (ns == 0) return RowResult::kOk;
  float lo = x[0], hi = x[0], amax = 0.0f;
  for (int32_t c = 0; c < n; ++c) {
    const float v = x[c * stride];
    if (!(v - v == 0.0f)) return RowResult::kNonFinite;  // inf - inf and NaN are NaN
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    const float a = v < 0.0f ? -v : v;
    amax = a > amax ? a : amax;
  }
  if (ns == 1) {
    const uint16_t s = F16Ceil(amax / QMax(f));
    if (!F16IsFinite(s)) return RowResult::kScaleOverflow;
    scales[0] = s;
    return RowResult::kOk;
  }
  const uint16_t m = F16Floor(lo);
  if (!F16IsFinite(m)) return RowResult::kScaleOverflow;
  const float range = hi - F16BitsToF32(m);
  if (!(range - range == 0.0f)) return RowResult::kScaleOverflow;
  const uint16_t s = F16Ceil(range / QMax(f));
  if (!F16IsFinite(s)) return RowResult::kScaleOverflow;
  scales[0] = s;
  scales[1] = m;
  return RowResult::kOk;
}

// Encode one row of head_size values into payload (row_bytes) and scales (ScalesPerRow float16).
// On any result other than kOk nothing is written.
ORTKV_HD RowResult EncodeRow(PageFormat f, const float* x, int32_t head_size, uint8_t* payload,
                             uint16_t* scales) {
  f = RowFormat(f);
  uint16_t sc[2] = {0, 0};
  const RowResult r = RowScales(f, x, head_size, sc);
  if (r != RowResult::kOk) return r;
  const float s = F16BitsToF32(sc[0]);
  const float m = F16BitsToF32(sc[1]);
  switch (f) {
    case PageFormat::kF16:
      for (int32_t c = 0; c < head_size; ++c) {
        const uint16_t h = F32ToF16Bits(x[c]);
        memcpy(payload + 2 * c, &h, 2);
      }
      return r;
    case PageFormat::kBF16:
      for (int32_t c = 0; c < head_size; ++c) {
        const uint16_t h = F32ToBF16Bits(x[c]);
        memcpy(payload + 2 * c, &h, 2);
      }
      return r;
    case PageFormat::kInt8:
      for (int32_t c = 0; c < head_size; ++c) {
        float q = s > 0.0f ? rintf(x[c] / s) : 0.0f;
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        payload[c] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
      break;
    case PageFormat::kFp8E4M3:
      for (int32_t c = 0; c < head_size; ++c) payload[c] = s > 0.0f ? F32ToE4M3(x[c] / s) : 0u;
      break;
    case PageFormat::kInt4:
    case PageFormat::kInt2: {
      const int32_t bits = PayloadBits(f);
      const int32_t per_byte = 8 / bits;
      const float qmax = QMax(f);
      for (int32_t b = 0; b < head_size / per_byte; ++b) {
        uint32_t byte = 0;
        for (int32_t j = 0; j < per_byte; ++j) {
          float q = s > 0.0f ? rintf((x[b * per_byte + j] - m) / s) : 0.0f;
          q = q > qmax ? qmax : (q < 0.0f ? 0.0f : q);
          byte |= static_cast<uint32_t>(q) << (bits * j);
        }
        payload[b] = static_cast<uint8_t>(byte);
      }
      break;
    }
    default:
      break;
  }
  for (int32_t i = 0; i < ScalesPerRow(f); ++i) scales[i] = sc[i];
  return r;
}

ORTKV_HD void DecodeRow(PageFormat f, const uint8_t* payload, const uint16_t* scales, int32_t head_size,
                        float* out) {
  switch (RowFormat(f)) {
    case PageFormat::kF16:
      for (int32_t c = 0; c < head_size; ++c) {
        uint16_t h;
        memcpy(&h, payload + 2 * c, 2);
        out[c] = F16BitsToF32(h);
      }
      return;
    case PageFormat::kBF16:
      for (int32_t c = 0; c < head_size; ++c) {
        uint16_t h;
        memcpy(&h, payload + 2 * c, 2);
        out[c] = BF16BitsToF32(h);
      }
      return;
    case PageFormat::kInt8: {
      const float s = F16BitsToF32(scales[0]);
      for (int32_t c = 0; c < head_size; ++c) out[c] = static_cast<float>(static_cast<int8_t>(payload[c])) * s;
      return;
    }
    case PageFormat::kFp8E4M3: {
      const float s = F16BitsToF32(scales[0]);
      for (int32_t c = 0; c < head_size; ++c) out[c] = E4M3ToF32(payload[c]) * s;
      return;
    }
    case PageFormat::kInt4:
    case PageFormat::kInt2: {
      const float s = F16BitsToF32(scales[0]);
      const float m = F16BitsToF32(scales[1]);
      const int32_t bits = PayloadBits(f);
      const uint32_t mask = (1u << bits) - 1u;
      for (int32_t c = 0; c < head_size; ++c) {
        const uint32_t q = (payload[(c * bits) / 8] >> ((c * bits) % 8)) & mask;
        out[c] = static_cast<float>(q) * s + m;
      }
      return;
    }
    default:
      return;
  }
}

// Keys of a *_KC format: a token's row of codes with per-channel (s, m) pairs, channel_scales[2c] = s_c,
// channel_scales[2c + 1] = m_c.
ORTKV_HD void DecodeKeyRowPerChannel(PageFormat f, const uint8_t* payload, const uint16_t* channel_scales,
                                     int32_t head_size, float* out) {
  const int32_t bits = PayloadBits(f);
  const uint32_t mask = (1u << bits) - 1u;
  for (int32_t c = 0; c < head_size; ++c) {
    const uint32_t q = (payload[(c * bits) / 8] >> ((c * bits) % 8)) & mask;
    out[c] = static_cast<float>(q) * F16BitsToF32(channel_scales[2 * c]) + F16BitsToF32(channel_scales[2 * c + 1]);
  }
}

// Encode the keys of one head of a *_KC page: keys [page_size][head_size] float32 (row stride
// head_size), channel scales computed over the page's tokens. Returns the first channel's failure
// (nothing written) or kOk.
// Byte column b of per-channel keys (channels b * per_byte .. b * per_byte + per_byte - 1, whose codes share that
// byte of every row): their scales, then their codes in every row. Columns own disjoint channels and bytes, so they
// may be encoded in any order or at once (the CUDA requantize runs one thread per column); the channels must have
// passed RowScales (EncodeKeysPerChannel checks them all first).
ORTKV_HD void EncodeKeyColumn(PageFormat f, const float* keys, int32_t page_size, int32_t head_size, uint8_t* payload,
                              uint64_t row_bytes, uint16_t* channel_scales, int32_t b) {
  const int32_t bits = PayloadBits(f);
  const int32_t per_byte = 8 / bits;
  const float qmax = QMax(f);
  for (int32_t j = 0; j < per_byte; ++j) {
    const int32_t c = b * per_byte + j;
    RowScales(f, keys + c, page_size, channel_scales + 2 * c, head_size);
  }
  for (int32_t t = 0; t < page_size; ++t) {
    const float* x = keys + static_cast<int64_t>(t) * head_size;
    uint32_t byte = 0;
    for (int32_t j = 0; j < per_byte; ++j) {
      const int32_t c = b * per_byte + j;
      const float s = F16BitsToF32(channel_scales[2 * c]);
      const float m = F16BitsToF32(channel_scales[2 * c + 1]);
      float q = s > 0.0f ? rintf((x[c] - m) / s) : 0.0f;
      q = q > qmax ? qmax : (q < 0.0f ? 0.0f : q);
      byte |= static_cast<uint32_t>(q) << (bits * j);
    }
    payload[t * row_bytes + b] = static_cast<uint8_t>(byte);
  }
}

ORTKV_HD RowResult EncodeKeysPerChannel(PageFormat f, const float* keys, int32_t page_size, int32_t head_size,
                                        uint8_t* payload, uint64_t row_bytes, uint16_t* channel_scales) {
  for (int32_t c = 0; c < head_size; ++c) {
    uint16_t sc[2];
    const RowResult r = RowScales(f, keys + c, page_size, sc, head_size);
    if (r != RowResult::kOk) return r;
  }
  for (int32_t b = 0; b < head_size / (8 / PayloadBits(f)); ++b)
    EncodeKeyColumn(f, keys, page_size, head_size, payload, row_bytes, channel_scales, b);
  return RowResult::kOk;
}

// ---- one page ------------------------------------------------------------------------------------
// A page's bytes with its format and shape. kv = 0 for K, 1 for V.
struct PageView {
  uint8_t* base = nullptr;
  PageFormat format = PageFormat::kF16;
  PageShape shape;
  PageLayout layout;

  ORTKV_HD static PageView Make(uint8_t* base, PageFormat f, PageShape s) {
    PageView v;
    v.base = base;
    v.format = f;
    v.shape = s;
    v.layout = LayoutOf(f, s);
    return v;
  }
  ORTKV_HD uint64_t RowIndex(int32_t head, int32_t token) const {
    return static_cast<uint64_t>(head) * static_cast<uint64_t>(shape.page_size) + static_cast<uint64_t>(token);
  }
  ORTKV_HD uint8_t* PayloadRow(int32_t kv, int32_t head, int32_t token) const {
    return base + (kv ? layout.v_payload : layout.k_payload) + RowIndex(head, token) * layout.row_bytes;
  }
  // The scales of a row; for the keys of a *_KC format, the head's channel scales [head_size][2].
  ORTKV_HD uint16_t* ScaleRow(int32_t kv, int32_t head, int32_t token) const {
    if (kv == 0 && KeysPerChannel(format)) {
      return reinterpret_cast<uint16_t*>(base + layout.k_scales +
                                         static_cast<uint64_t>(head) * shape.head_size * layout.scale_row_bytes);
    }
    return reinterpret_cast<uint16_t*>(base + (kv ? layout.v_scales : layout.k_scales) +
                                       RowIndex(head, token) * layout.scale_row_bytes);
  }
  ORTKV_HD void DecodeRow(int32_t kv, int32_t head, int32_t token, float* out) const {
    if (kv == 0 && KeysPerChannel(format)) {
      DecodeKeyRowPerChannel(format, PayloadRow(0, head, token), ScaleRow(0, head, token), shape.head_size, out);
      return;
    }
    codecs::DecodeRow(format, PayloadRow(kv, head, token), ScaleRow(kv, head, token), shape.head_size, out);
  }
  // A direct write of one token's row: only that row's payload and scales change. Every format but the
  // keys of a *_KC format (kNeedsFullPage: fill the page as F16/BF16 and EncodePage it when full).
  ORTKV_HD RowResult EncodeRow(int32_t kv, int32_t head, int32_t token, const float* in) const {
    if (kv == 0 && KeysPerChannel(format)) return RowResult::kNeedsFullPage;
    return codecs::EncodeRow(format, in, shape.head_size, PayloadRow(kv, head, token), ScaleRow(kv, head, token));
  }
};

// ---- host only -------------------------------------------------------------------------------------
inline Status ValidateShape(int32_t format, PageShape s) {
  if (!IsValidFormat(format)) {
    return Status(Code::kInvalidArgument, "page format " + std::to_string(format) +
                                              " is not a page format (0 F16, 1 BF16, 2 INT8, 3 FP8_E4M3, "
                                              "4 INT4, 5 INT2, 6 INT4_KC, 7 INT2_KC)");
  }
  const PageFormat f = static_cast<PageFormat>(format);
  if (s.kv_heads <= 0 || s.page_size <= 0 || s.head_size <= 0) {
    return Status(Code::kInvalidArgument,
                  std::string("page shape [kv_heads=") + std::to_string(s.kv_heads) +
                      " page_size=" + std::to_string(s.page_size) + " head_size=" + std::to_string(s.head_size) +
                      "] must be positive");
  }
  if (s.head_size % HeadSizeMultiple(f) != 0) {
    return Status(Code::kInvalidArgument,
                  std::string(FormatName(f)) + " packs " + std::to_string(HeadSizeMultiple(f)) +
                      " channels per byte, so head_size must be a multiple of " +
                      std::to_string(HeadSizeMultiple(f)) + "; got head_size=" + std::to_string(s.head_size) +
                      " (store such pages as F16/BF16/INT8/FP8_E4M3)");
  }
  return Status::Ok();
}

// where: "K row [head=1 token=4]" or "K channel [head=1 channel=7]".
inline Status RowError(RowResult r, PageFormat f, const std::string& where) {
  if (r == RowResult::kNeedsFullPage) {
    return Status(Code::kInvalidArgument, std::string(FormatName(f)) + " page: " + where +
                                              ": keys are scaled per channel over the page, so a key row cannot "
                                              "be written alone; fill the page as F16/BF16 and encode it whole "
                                              "when full (EncodePage); page unchanged");
  }
  if (r == RowResult::kNonFinite) {
    return Status(Code::kInvalidArgument, std::string(FormatName(f)) + " page: " + where +
                                              " holds inf or NaN; the scaled formats refuse non-finite "
                                              "values (store the page as F16/BF16, or fix the values); "
                                              "page unchanged");
  }
  return Status(Code::kInvalidArgument, std::string(FormatName(f)) + " page: " + where +
                                            " needs a scale or minimum beyond float16 (|x| too large); "
                                            "store the page as BF16; page unchanged");
}

// Encode a whole page from values [2][kv_heads][page_size][head_size] float32. Every row is checked
// before any byte is written: on error the page is unchanged. Padding bytes are zeroed.
inline std::string RowName(int32_t kv, int32_t head, int32_t token) {
  return std::string(kv ? "V" : "K") + " row [head=" + std::to_string(head) + " token=" + std::to_string(token) + "]";
}

// Encode a whole page from values [2][kv_heads][page_size][head_size] float32 (also the requantization of
// a full page: DecodePage of the wide page, then EncodePage into the narrow one). Every row (and, for
// the keys of a *_KC format, every channel) is checked before any byte is written: on error the page is
// unchanged. Padding bytes are zeroed.
inline Status EncodePage(const PageView& page, const float* values) {
  ORTKV_RETURN_IF_ERR(ValidateShape(static_cast<int32_t>(page.format), page.shape));
  const PageShape& s = page.shape;
  const bool kc = KeysPerChannel(page.format);
  const auto at = [&](int32_t kv, int32_t h, int32_t t) {
    return values + ((static_cast<uint64_t>(kv) * s.kv_heads + h) * s.page_size + t) * s.head_size;
  };
  uint16_t sc[2];
  for (int32_t kv = 0; kv < 2; ++kv)
    for (int32_t h = 0; h < s.kv_heads; ++h) {
      if (kv == 0 && kc) {
        for (int32_t c = 0; c < s.head_size; ++c) {
          const RowResult r = RowScales(page.format, at(0, h, 0) + c, s.page_size, sc, s.head_size);
          if (r != RowResult::kOk) {
            return RowError(r, page.format,
                            "K channel [head=" + std::to_string(h) + " channel=" + std::to_string(c) + "]");
          }
        }
        continue;
      }
      for (int32_t t = 0; t < s.page_size; ++t) {
        const RowResult r = RowScales(RowFormat(page.format), at(kv, h, t), s.head_size, sc);
        if (r != RowResult::kOk) return RowError(r, page.format, RowName(kv, h, t));
      }
    }
  memset(page.base, 0, page.layout.page_bytes);
  for (int32_t kv = 0; kv < 2; ++kv)
    for (int32_t h = 0; h < s.kv_heads; ++h) {
      if (kv == 0 && kc) {
        EncodeKeysPerChannel(page.format, at(0, h, 0), s.page_size, s.head_size, page.PayloadRow(0, h, 0),
                             page.layout.row_bytes, page.ScaleRow(0, h, 0));
        continue;
      }
      for (int32_t t = 0; t < s.page_size; ++t) page.EncodeRow(kv, h, t, at(kv, h, t));
    }
  return Status::Ok();
}

// Decode a whole page into out [2][kv_heads][page_size][head_size] float32.
inline Status DecodePage(const PageView& page, float* out) {
  ORTKV_RETURN_IF_ERR(ValidateShape(static_cast<int32_t>(page.format), page.shape));
  const PageShape& s = page.shape;
  for (int32_t kv = 0; kv < 2; ++kv)
    for (int32_t h = 0; h < s.kv_heads; ++h)
      for (int32_t t = 0; t < s.page_size; ++t) {
        const uint64_t row = (static_cast<uint64_t>(kv) * s.kv_heads + h) * s.page_size + t;
        page.DecodeRow(kv, h, t, out + row * s.head_size);
      }
  return Status::Ok();
}

// Encode one row directly into a page (a decode step's write). On error the page is unchanged.
inline Status EncodeRowInto(const PageView& page, int32_t kv, int32_t head, int32_t token, const float* row) {
  ORTKV_RETURN_IF_ERR(ValidateShape(static_cast<int32_t>(page.format), page.shape));
  const PageShape& s = page.shape;
  if (kv < 0 || kv > 1 || head < 0 || head >= s.kv_heads || token < 0 || token >= s.page_size) {
    return Status(Code::kInvalidArgument, "row (kv=" + std::to_string(kv) + ", head=" + std::to_string(head) +
                                              ", token=" + std::to_string(token) + ") is outside the page [2, " +
                                              std::to_string(s.kv_heads) + ", " + std::to_string(s.page_size) +
                                              "]; page unchanged");
  }
  const RowResult r = page.EncodeRow(kv, head, token, row);
  if (r != RowResult::kOk) return RowError(r, page.format, RowName(kv, head, token));
  return Status::Ok();
}

}  // namespace codecs
}  // namespace ortkv
