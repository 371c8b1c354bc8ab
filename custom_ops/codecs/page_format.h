// Per-page KV formats: what a page of the paged cache holds, byte for byte.
//
// Framework-free and usable from host and CUDA device code (functions are ORTKV_HD). The codecs that
// fill and read these bytes are in codecs.h; the numpy reference with the same layout is
// python/ortkv/reference/codecs.py.
//
// Note [Page formats]
// ~~~~~~~~~~~~~~~~~~~
// A page holds [2 (K, V), kv_heads, page_size, head_size] values of one logical element type (float16
// or bfloat16). Each page picks its own physical format; every format decodes to float32 in registers
// (the kernel converts to the logical type) with the same page shape. A "row" is the head_size values
// of one (K or V, head, token).
//
//   format     payload bits   float16 scales                quantizer
//   F16        16             none                          IEEE binary16, round-to-nearest-even
//   BF16       16             none                          bfloat16, round-to-nearest-even
//   INT8       8              s per row                     symmetric, q = rint(x / s) in [-127, 127]
//   FP8_E4M3   8              s per row                     e4m3fn(x / s), RNE, saturating at 448
//   INT4       4              (s, m) per row                asymmetric, q = rint((x - m) / s) in [0, 15]
//   INT2       2              (s, m) per row                asymmetric, q = rint((x - m) / s) in [0, 3]
//   INT4_KC    4              K: (s, m) per (head, channel) over the page's tokens; V: per row
//   INT2_KC    2              K: (s, m) per (head, channel) over the page's tokens; V: per row
//
// Granularity, per format:
//   * INT8, FP8_E4M3: symmetric, one scale per (K or V, head, token) row. 8 bits leave enough levels
//     that outlier channels cost little (measured on SmolLM2's keys: 1.1 % / 2.1 % relative RMS), zero
//     decodes to exactly zero, and a decode step's single token is encoded on its own: direct writes,
//     no other byte of the page changes.
//   * INT4, INT2: asymmetric (s, minimum) per row, for K and V: direct writes work and the scale bytes
//     (4 per row) do not depend on the page size. With 16 or 4 levels a symmetric grid would waste half
//     of them on a skewed row, hence the minimum.
//   * INT4_KC, INT2_KC: KIVI's choice. Keys have outlier CHANNELS (large in the same channels for every
//     token, before and after RoPE), so a per-token scale is set by the outliers and the other channels
//     share a few levels; per-channel key scales over the page's tokens fix that. Measured on SmolLM2-
//     135M's cached keys (benchmarks/results/page_formats.md): INT2 keys 64 % relative RMS error per
//     token vs 15-26 % per channel, INT4 13 % vs 3-5 %. Values stay per token (their error is spread
//     evenly over channels). The cost: (1) key scale bytes are 4 * head_size per (head, page), i.e.
//     4 * head_size / page_size per key row, the same as per token at page_size == head_size, more
//     below (page_size 16, head_size 64: 16 bytes per row vs 4); (2) the K half of a page can only be
//     encoded whole: PageView::EncodeRow refuses K rows (RowResult::kNeedsFullPage). A page still
//     being filled therefore stays F16/BF16 and is requantized (EncodePage) when full: KIVI's residual
//     window, expressed as pages. V rows of a KC page accept direct writes.
//   * INT2 values per token are coarse (49 % relative RMS on SmolLM2's values, 4 levels for 64
//     channels); KIVI quantizes values in groups of channels. A grouped-V variant is the next
//     refinement if INT2 pages are to hold more than old, rarely attended tokens.
//   * KVQuant's pre-RoPE keys need the model to cache keys before RoPE (a graph change, not a format);
//     its float sink tokens need no special format: the pages holding them simply stay F16/BF16.
//
// Scales are float16: they halve the scale bytes against float32 (INT2 with head_size 128: 4 bytes of
// scales per 32 bytes of payload instead of 8, i.e. 12.5 % of overhead instead of 25 %), and the
// codec never loses accuracy to the narrow scale: s is rounded UP to the next float16 (and the INT4/
// INT2 minimum DOWN), and the quantizer then divides by the stored, rounded value, so the stated error
// bounds hold with the stored scale. A row whose scale or minimum does not fit float16 is refused
// (only possible with bfloat16 or float32 inputs: INT8 |x| > 65504 * 127, FP8 |x| > 65504 * 448,
// INT4/INT2 minimum < -65504 or max - min > 65504 * 15 or * 3): store that page as BF16.
//
// Non-finite inputs: the scaled formats REFUSE inf and NaN (EncodeRow returns RowResult::kNonFinite and
// writes nothing; EncodePage checks every row and channel before writing any byte); F16 and BF16 store
// every value as the logical type does (overflow to inf, NaN stays NaN), since they are that type.
//
// Packing: the payload of a row is head_size codes in channel order. INT8 codes are two's complement
// bytes, FP8 codes are e4m3fn bytes. INT4 and INT4_KC: channel c sits in byte c / 2, in the LOW nibble
// for even c and the HIGH nibble for odd c. INT2 and INT2_KC: channel c sits in byte c / 4 at bits
// 2 * (c % 4) (channel 0 in the two lowest bits). So head_size must be even for the INT4 formats and a
// multiple of 4 for the INT2 formats.
//
// Page layout (offsets from the page's first byte; every section starts on a 16-byte boundary so that
// kernels can use 16-byte vector loads, and the page size is a multiple of 16):
//
//   K payload  [kv_heads][page_size][row_bytes]          row_bytes = head_size * bits / 8
//   V payload  [kv_heads][page_size][row_bytes]
//   K scales   [kv_heads][page_size][scales_per_row] float16   ([kv_heads][head_size][2] for *_KC)
//   V scales   [kv_heads][page_size][scales_per_row] float16
//
// The padding is at most 4 * 15 bytes per page; for page_size >= 16 and head_size a multiple of 16 it
// is zero, so bytes per page equal the ideal (payload + scales) exactly (tests/test_codecs.py checks
// the 5 % goal on a grid of shapes).
//
// Physical form for ONNX Runtime (what PagedCacheUpdate / PagedCacheAttention take; Note [Paged cache
// physical form] in ortkv/paged.h): ORT cannot bind a sequence of differently typed tensors, so the
// cache is
//   * ONE uint8 pool [pool_bytes] holding every page slot (in ortkv.paged a view of a VMM arena: each
//     format has its own slab at a fixed offset of the reservation, committed granule by granule as
//     slots are taken, so no format's share is fixed up front and a slot is exactly its format's size:
//     any mix wastes no slot bytes);
//   * a page directory, int64 [num_pages, 2] = (format, byte offset of the page's slot in the pool);
//     a page id covers page_size tokens of EVERY layer: its slot holds num_layers pages of this codec
//     back to back, layer l at offset + l * LayoutOf(format, shape).page_bytes;
//   * per sequence page tables, int32 [batch, max_pages_per_seq] of page ids (-1 = none), and the
//     sequence positions as today.
// A kernel resolves page id -> (format, offset) -> PageView::Make(pool + offset + layer * page_bytes,
// format, shape) and calls PageView::DecodeRow / EncodeRow in registers. Requantizing a page into another
// format is DecodePage + EncodePage of each layer into a free slot of the other format's slab and one
// directory write (paged_requantize).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define ORTKV_HD __host__ __device__ __forceinline__
#else
#define ORTKV_HD inline
#endif

namespace ortkv {
namespace codecs {

enum class PageFormat : int32_t {
  kF16 = 0,
  kBF16 = 1,
  kInt8 = 2,
  kFp8E4M3 = 3,
  kInt4 = 4,
  kInt2 = 5,
  kInt4KC = 6,  // INT4 with keys per channel over the page (KIVI); values per token
  kInt2KC = 7,  // INT2 with keys per channel over the page (KIVI); values per token
};
constexpr int32_t kNumPageFormats = 8;
constexpr uint64_t kSectionAlign = 16;

ORTKV_HD bool IsValidFormat(int32_t f) { return f >= 0 && f < kNumPageFormats; }

inline const char* FormatName(PageFormat f) {
  switch (f) {
    case PageFormat::kF16: return "F16";
    case PageFormat::kBF16: return "BF16";
    case PageFormat::kInt8: return "INT8";
    case PageFormat::kFp8E4M3: return "FP8_E4M3";
    case PageFormat::kInt4: return "INT4";
    case PageFormat::kInt2: return "INT2";
    case PageFormat::kInt4KC: return "INT4_KC";
    case PageFormat::kInt2KC: return "INT2_KC";
  }
  return "?";
}

// Bits of payload per value.
ORTKV_HD int32_t PayloadBits(PageFormat f) {
  switch (f) {
    case PageFormat::kF16:
    case PageFormat::kBF16: return 16;
    case PageFormat::kInt8:
    case PageFormat::kFp8E4M3: return 8;
    case PageFormat::kInt4:
    case PageFormat::kInt4KC: return 4;
    case PageFormat::kInt2:
    case PageFormat::kInt2KC: return 2;
  }
  return 0;
}

// float16 scale values per row: 0 (F16, BF16), 1 (s: INT8, FP8), 2 (s, minimum: INT4, INT2).
ORTKV_HD int32_t ScalesPerRow(PageFormat f) {
  switch (f) {
    case PageFormat::kF16:
    case PageFormat::kBF16: return 0;
    case PageFormat::kInt8:
    case PageFormat::kFp8E4M3: return 1;
    case PageFormat::kInt4:
    case PageFormat::kInt2:
    case PageFormat::kInt4KC:
    case PageFormat::kInt2KC: return 2;
  }
  return 0;
}

// Keys scaled per (head, channel) over the page's tokens instead of per row: the K half of such a page
// can only be encoded whole (Note [Page formats]).
ORTKV_HD bool KeysPerChannel(PageFormat f) { return f == PageFormat::kInt4KC || f == PageFormat::kInt2KC; }

// Channels per payload byte must divide head_size: 1 for 8/16-bit formats, 2 for INT4, 4 for INT2.
ORTKV_HD int32_t HeadSizeMultiple(PageFormat f) {
  return PayloadBits(f) >= 8 ? 1 : 8 / PayloadBits(f);
}

struct PageShape {
  int32_t kv_heads = 0;
  int32_t page_size = 0;
  int32_t head_size = 0;
};

struct PageLayout {
  uint64_t row_bytes = 0;        // payload bytes of one row
  uint64_t scale_row_bytes = 0;  // scale bytes of one row (2 per float16 scale); of one channel for
                                 // the keys of a KeysPerChannel format
  uint64_t k_payload = 0;        // section offsets from the page's first byte
  uint64_t v_payload = 0;
  uint64_t k_scales = 0;
  uint64_t v_scales = 0;
  uint64_t page_bytes = 0;   // the page's size (a multiple of kSectionAlign)
  uint64_t ideal_bytes = 0;  // payload + scales, no padding
};

ORTKV_HD uint64_t AlignUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// The layout of a page; the shape must have passed ValidateShape (codecs.h).
ORTKV_HD PageLayout LayoutOf(PageFormat f, PageShape s) {
  PageLayout l;
  const uint64_t rows = static_cast<uint64_t>(s.kv_heads) * static_cast<uint64_t>(s.page_size);
  l.row_bytes = static_cast<uint64_t>(s.head_size) * PayloadBits(f) / 8;
  l.scale_row_bytes = 2u * static_cast<uint64_t>(ScalesPerRow(f));
  const uint64_t payload = rows * l.row_bytes;
  const uint64_t v_scales = rows * l.scale_row_bytes;
  const uint64_t channels = static_cast<uint64_t>(s.kv_heads) * static_cast<uint64_t>(s.head_size);
  const uint64_t k_scales = KeysPerChannel(f) ? channels * l.scale_row_bytes : v_scales;
  l.k_payload = 0;
  l.v_payload = AlignUp(payload, kSectionAlign);
  l.k_scales = l.v_payload + AlignUp(payload, kSectionAlign);
  l.v_scales = l.k_scales + AlignUp(k_scales, kSectionAlign);
  l.page_bytes = l.v_scales + AlignUp(v_scales, kSectionAlign);
  l.ideal_bytes = 2 * payload + k_scales + v_scales;
  return l;
}

}  // namespace codecs
}  // namespace ortkv
