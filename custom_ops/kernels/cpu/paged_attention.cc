// CPU PagedCacheAttention (Note [PagedCacheAttention CPU] in ortkv/paged.h): CacheAttention's kernel
// (Note [CacheAttention CPU split-K]) over keys gathered block by block from each sequence's pages,
// each page decoded by its own format into a per-thread L1/L2 buffer.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "attention_block.h"
#include "ortkv/cache_attention.h"
#include "ortkv/paged.h"
#include "paged_common.h"

#include <immintrin.h>  // F16C / AVX-512 conversions, used only inside their #pragma GCC target regions


namespace ortkv {
namespace {

using codecs::PageFormat;
using codecs::PageView;

using namespace attn_cpu;  // NOLINT: the block kernel shared with CacheAttention (attention_block.h)

// ---- decoding a run of rows of one page -------------------------------------------------------------
// Rows [r, r + n) of (kv, head) of one page into out [n][D]: the floats PageView::DecodeRow gives, 16
// channels at a time in vector registers (DecodeRow's scalar conversions and per-channel bit
// arithmetic do not vectorize; head sizes that are not a multiple of 16 use it row by row).
// float16 and e4m3 are converted on bits (exact: normal numbers rebias the exponent, subnormals are
// m * 2^-24 / m * 2^-9, inf/NaN as DecodeRow), so nothing depends on F16C or denormals-are-zero.
typedef uint32_t V16w __attribute__((vector_size(64)));
typedef uint16_t V16h __attribute__((vector_size(32), may_alias, aligned(2)));
typedef uint8_t V16b __attribute__((vector_size(16), may_alias, aligned(1)));
typedef int8_t V16s __attribute__((vector_size(16), may_alias, aligned(1)));
typedef int16_t V16hs __attribute__((vector_size(32)));

// 8-bit -> 32-bit lanes through 16-bit lanes: GCC 12 scalarizes the direct conversion (16 moves and
// inserts), the two steps are one vpmovzxbw / vpmovsxbw and one widening move each.
ORTKV_INLINE V16w Widen(V16b b) { return __builtin_convertvector(__builtin_convertvector(b, V16h), V16w); }
ORTKV_INLINE V16i Widen(V16s b) { return __builtin_convertvector(__builtin_convertvector(b, V16hs), V16i); }

ORTKV_INLINE V16 AsFloat(V16w x) { return reinterpret_cast<const V16&>(x); }
ORTKV_INLINE V16 ToFloat(V16w x) { return __builtin_convertvector(reinterpret_cast<const V16i&>(x), V16); }

ORTKV_INLINE V16 Half16(const uint16_t* p) {
  const V16w x = __builtin_convertvector(*reinterpret_cast<const V16h*>(p), V16w);
  const V16w em = x & 0x7FFFu, sign = (x & 0x8000u) << 16;
  const V16 sub = ToFloat(em) * (1.0f / 16777216.0f);
  V16w r = em >= 0x7C00u ? ((em << 13) | 0x7F800000u) : ((em << 13) + (112u << 23));
  r = em < 0x400u ? reinterpret_cast<const V16w&>(sub) : r;
  return AsFloat(r | sign);
}

ORTKV_INLINE V16 E4M3x16(const uint8_t* p) {
  const V16w x = Widen(*reinterpret_cast<const V16b*>(p));
  const V16w em = x & 0x7Fu, sign = (x & 0x80u) << 24;
  const V16 sub = ToFloat(em) * (1.0f / 512.0f);
  V16w r = em < 8u ? reinterpret_cast<const V16w&>(sub) : ((em << 20) + (120u << 23));
  r |= sign;
  r = em == 0x7Fu ? V16w{} + 0x7FC00000u : r;
  return AsFloat(r);
}

// 16 codes of BITS (4 or 2) bits from 16 * BITS / 8 bytes: channel c in byte c * BITS / 8 at bit
// BITS * (c % (8 / BITS)) (Note [Page formats], packing).
template <int BITS>
ORTKV_INLINE V16 Codes16(const uint8_t* p) {
  V16b b = {};
  memcpy(&b, p, 16 * BITS / 8);
  V16b d;
  V16w sh;
  if constexpr (BITS == 4) {
    d = __builtin_shufflevector(b, b, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    sh = V16w{0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4};
  } else {
    d = __builtin_shufflevector(b, b, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    sh = V16w{0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6};
  }
  return ToFloat((Widen(d) >> sh) & ((1u << BITS) - 1u));
}

// 32 INT4 codes from one 16-byte load, as two vectors of 16 channels. Codes16<4>'s 8-byte memcpy into a
// zeroed vector costs a stack round trip per 16 channels (measured: INT4 pages decoded at half INT2's
// speed although they read twice the bytes, benchmarks/results/paged_attention_cpu.md).
ORTKV_INLINE void Codes32x4(const uint8_t* p, V16* lo, V16* hi) {
  const V16b b = *reinterpret_cast<const V16b*>(p);
  const V16w sh = V16w{0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4};
  const V16b d0 = __builtin_shufflevector(b, b, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const V16b d1 = __builtin_shufflevector(b, b, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  *lo = ToFloat((Widen(d0) >> sh) & 15u);
  *hi = ToFloat((Widen(d1) >> sh) & 15u);
}

template <int BITS>
ORTKV_INLINE void PackedRows(const uint8_t* payload, uint64_t rb, const uint16_t* sc, int64_t ns, bool per_channel,
                             int64_t n, int64_t D, float* out) {
  if (per_channel) {  // *_KC keys: q * s_c + m_c with the head's channel scales [D][2]
    if constexpr (BITS == 4) {
      // 32 channels per load, as the per-token rows below (Codes16's stack round trip): driver, 8K x 1, 2 threads,
      // AVX-512 copy, INT4_KC pages 2.10-2.11 -> 1.17-1.23x dense time (2026-12-05)
      if (D % 32 == 0) {
        for (int64_t c0 = 0; c0 < D; c0 += 32) {
          V16 s0, m0, s1, m1;
          for (int k = 0; k < 16; ++k) {
            s0[k] = codecs::F16BitsToF32(sc[2 * (c0 + k)]), m0[k] = codecs::F16BitsToF32(sc[2 * (c0 + k) + 1]);
            s1[k] = codecs::F16BitsToF32(sc[2 * (c0 + 16 + k)]), m1[k] = codecs::F16BitsToF32(sc[2 * (c0 + 16 + k) + 1]);
          }
          for (int64_t i = 0; i < n; ++i) {
            V16 lo, hi;
            Codes32x4(payload + i * rb + c0 / 2, &lo, &hi);
            Store(out + i * D + c0, lo * s0 + m0);
            Store(out + i * D + c0 + 16, hi * s1 + m1);
          }
        }
        return;
      }
    }
    for (int64_t c0 = 0; c0 < D; c0 += 16) {
      V16 s, m;
      for (int k = 0; k < 16; ++k) {
        s[k] = codecs::F16BitsToF32(sc[2 * (c0 + k)]);
        m[k] = codecs::F16BitsToF32(sc[2 * (c0 + k) + 1]);
      }
      for (int64_t i = 0; i < n; ++i) Store(out + i * D + c0, Codes16<BITS>(payload + i * rb + c0 * BITS / 8) * s + m);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float s = codecs::F16BitsToF32(sc[i * ns]), m = codecs::F16BitsToF32(sc[i * ns + 1]);
    if constexpr (BITS == 4) {
      if (D % 32 == 0) {
        for (int64_t c0 = 0; c0 < D; c0 += 32) {
          V16 lo, hi;
          Codes32x4(payload + i * rb + c0 / 2, &lo, &hi);
          Store(out + i * D + c0, lo * s + m);
          Store(out + i * D + c0 + 16, hi * s + m);
        }
        continue;
      }
    }
    for (int64_t c0 = 0; c0 < D; c0 += 16) Store(out + i * D + c0, Codes16<BITS>(payload + i * rb + c0 * BITS / 8) * s + m);
  }
}

ORTKV_INLINE void DecodeRun(const PageView& pg, int kv, int32_t head, int32_t r, int64_t n, int64_t D, float* out) {
  if (D % 16 != 0) {
    for (int64_t i = 0; i < n; ++i) pg.DecodeRow(kv, head, r + static_cast<int32_t>(i), out + i * D);
    return;
  }
  const uint8_t* payload = pg.PayloadRow(kv, head, r);
  const uint64_t rb = pg.layout.row_bytes;
  const uint16_t* sc = pg.ScaleRow(kv, head, r);
  const int64_t ns = codecs::ScalesPerRow(pg.format);
  switch (pg.format) {
    case PageFormat::kF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(payload);
      for (int64_t i = 0; i < n * D; i += 16) Store(out + i, Half16(h + i));
      return;
    }
    case PageFormat::kBF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(payload);
      for (int64_t i = 0; i < n * D; i += 16)
        Store(out + i, AsFloat(__builtin_convertvector(*reinterpret_cast<const V16h*>(h + i), V16w) << 16));
      return;
    }
    case PageFormat::kInt8:
      for (int64_t i = 0; i < n; ++i) {
        const float s = codecs::F16BitsToF32(sc[i]);
        for (int64_t c0 = 0; c0 < D; c0 += 16) {
          const V16s q = *reinterpret_cast<const V16s*>(payload + i * rb + c0);
          Store(out + i * D + c0, __builtin_convertvector(Widen(q), V16) * s);
        }
      }
      return;
    case PageFormat::kFp8E4M3:
      for (int64_t i = 0; i < n; ++i) {
        const float s = codecs::F16BitsToF32(sc[i]);
        for (int64_t c0 = 0; c0 < D; c0 += 16) Store(out + i * D + c0, E4M3x16(payload + i * rb + c0) * s);
      }
      return;
    case PageFormat::kInt4:
    case PageFormat::kInt4KC:
      PackedRows<4>(payload, rb, sc, ns, kv == 0 && pg.format == PageFormat::kInt4KC, n, D, out);
      return;
    case PageFormat::kInt2:
    case PageFormat::kInt2KC:
      PackedRows<2>(payload, rb, sc, ns, kv == 0 && pg.format == PageFormat::kInt2KC, n, D, out);
      return;
  }
}

// Note [CPU attention ISA dispatch]: the task three times, AVX-512, AVX2 + FMA + F16C, baseline.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace isa_avx512 {
#define ORTKV_ISA 2
constexpr int kLanes = 16;  // Note [CPU attention native width]
#include "paged_attention_task.inc"
#undef ORTKV_ISA
}  // namespace isa_avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#define ORTKV_ISA 1
constexpr int kLanes = 8;  // Note [CPU attention native width]
#include "paged_attention_task.inc"
#undef ORTKV_ISA
}  // namespace isa_avx2
#pragma GCC pop_options
namespace isa_baseline {
#define ORTKV_ISA 0
constexpr int kLanes = 4;  // Note [CPU attention native width]
#include "paged_attention_task.inc"
#undef ORTKV_ISA
}  // namespace isa_baseline

}  // namespace

int64_t PagedAttentionView::scratch_floats() const {
  const int64_t KB = kAttnBlockKeys;
  if (tile > 1) return 2 * KB * D + kCpuTileLanes * (2 * D + KB) + D;  // kbuf, vbuf, qt, ot, S, a row (Note [Paged CPU query tiles])
  return group() * (KB + 2 * D + 2) + 2 * KB * D;
}

Status PlanPagedCacheAttention(const std::string& node, const TensorArg& q, const TensorArg& pool,
                               const TensorArg& directory, const TensorArg& page_table, const TensorArg& start,
                               int64_t num_heads, const PagedAttrs& attrs, float scale, void* out,
                               PagedAttentionView* view, const TensorArg* page_fill) {
  static const std::string op = "PagedCacheAttention";  // once: no allocation per run
  Message m;  // Note [Messages on the error path only]
  if (q.elem_type != kFloat32 && q.elem_type != kFloat16 && q.elem_type != kBFloat16) {
    m << "query '" << q.name << "' must be float32, float16 or bfloat16 (got " << ElemTypeName(q.elem_type) << ")";
    return paged::Bad(op, node, m.str());
  }
  if (q.dims.size() != 3) {
    m << "query '" << q.name << "' must be [batch, tokens, num_heads * head_size]; got rank " << q.dims.size();
    return paged::Bad(op, node, m.str());
  }
  const int64_t kv = attrs.kv_num_heads;
  if (num_heads <= 0 || kv <= 0 || num_heads % kv != 0 || num_heads / kv > 64) {
    m << "num_heads " << num_heads << " must be a positive multiple of kv_num_heads " << kv
      << " (at most 64 query heads per KV head)";
    return paged::Bad(op, node, m.str());
  }
  const int64_t B = q.dims[0], T = q.dims[1], W = q.dims[2];
  if (W <= 0 || W % num_heads != 0) {
    m << "query '" << q.name << "' width " << W << " must be num_heads (" << num_heads << ") * head_size";
    return paged::Bad(op, node, m.str());
  }
  const int64_t D = W / num_heads;
  ORTKV_RETURN_IF_ERR(attn_cpu::CheckCpuIsa(op.c_str(), node));
  PagedPool& p = view->p;
  ORTKV_RETURN_IF_ERR(paged::ResolvePool(op, node, pool, directory, page_table, attrs, B, D, &p));
  ORTKV_RETURN_IF_ERR(ResolvePageFill(op, node, page_fill, page_table.name, B, &p, &view->fill_prefix));
  if (start.elem_type != kInt64 || start.dims.size() > 1 || (start.dims.size() == 1 && start.dims[0] != B)) {
    m << "start '" << start.name << "' must be an int64 scalar or a vector of " << B << " start positions";
    return paged::Bad(op, node, m.str());
  }
  const int64_t stride = start.dims.size() == 1 ? 1 : 0;
  const int64_t* st = static_cast<const int64_t*>(start.data);
  const int64_t ps = attrs.page_size;
  const NodeWhere where{op.c_str(), node};
  int64_t max_keys = 0;
  for (int64_t b = 0; b < B && T > 0; ++b) {
    const int64_t s = st[b * stride];
    if (s < 0) {
      m << "start " << s << " for row " << b << " of '" << start.name << "' is negative";
      return paged::Bad(op, node, m.str());
    }
    const int64_t cap = p.Total(b);
    if (s > cap - T) {
      if (page_fill == nullptr) {
        m << where << ": row " << b << ": start " << s << " + tokens " << T << " = " << s + T
          << " exceeds the page table's capacity of " << p.max_pages << " pages x " << ps << " tokens = " << cap << " ('"
          << page_table.name << "')";
      } else {  // Note [Page fill]
        m << where << ": row " << b << ": start " << s << " + tokens " << T << " = " << s + T
          << " exceeds the row's total fill of " << cap << " tokens ('" << page_fill->name << "' over '"
          << page_table.name << "'). Remedy: give the row entries (pages and fills) for every position it reads";
      }
      return Status(Code::kCapacity, m.str());
    }
    for (int64_t pi = 0; pi < p.max_pages && p.EntryBegin(b, pi) < s + T; ++pi) {
      if (p.EntryBegin(b, pi) == p.EntryBegin(b, pi + 1)) continue;  // fill 0: skipped, id not read
      ORTKV_RETURN_IF_ERR(CheckPage(where, p, pool.name, directory.name, page_table.name, b, pi, s + T));
      if (attrs.page_format >= 0) {
        const int64_t id = p.page_table[b * p.max_pages + pi], f = p.directory[2 * id];
        if (f != attrs.page_format) {
          m << where << ": row " << b << " needs page " << pi << " of its page table '" << page_table.name
            << "' but page " << id << " is " << codecs::FormatName(static_cast<PageFormat>(f)) << ", not "
            << codecs::FormatName(static_cast<PageFormat>(attrs.page_format))
            << ", the format the node's page_format attribute promises for every page ('" << directory.name
            << "'). Remedy: keep every page of this cache in that format (no requantize or demotion), or drop "
            << "the attribute (pages of any format).";
          return Status(Code::kInvalidArgument, m.str());
        }
      }
    }
    max_keys = std::max(max_keys, s + T);
  }
  view->q = q.data;
  view->out = out;
  view->elem_type = q.elem_type;
  view->start = st;
  view->start_stride = stride;
  view->B = B;
  view->T = T;
  view->Hq = num_heads;
  view->Hkv = kv;
  view->D = D;
  view->scale = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(D));
  view->tile = attn_cpu::CpuQueryTile(B, kv, T, num_heads / kv, D, max_keys);  // Note [Paged CPU query tiles]
  view->splits = attn_cpu::CpuSplits(view->units(), max_keys);
  view->partial = nullptr;
  return Status::Ok();
}

void PagedCacheAttentionCpu(const PagedAttentionView& a, int64_t begin, int64_t end, float* scratch) {
  void (*run)(const PagedAttentionView&, int64_t, float*) = isa_baseline::RunTask;
  switch (attn_cpu::CpuIsaOnce().isa) {  // the plan refused a bad ORTKV_CPU_ISA
    case attn_cpu::CpuIsa::kAvx512: run = isa_avx512::RunTask; break;
    case attn_cpu::CpuIsa::kAvx2: run = isa_avx2::RunTask; break;
    case attn_cpu::CpuIsa::kBaseline: break;
  }
  for (int64_t task = begin; task < end; ++task) run(a, task, scratch);
}

void PagedCacheAttentionCombine(const PagedAttentionView& a) {
  const int64_t S = a.splits, G = a.group(), D = a.D, P = G * (D + 2);
  if (S <= 1) return;
  std::vector<float> og(static_cast<size_t>(G * D));
  for (int64_t unit = 0; unit < a.units(); ++unit) {
    const int64_t t = unit % a.T, hk = (unit / a.T) % a.Hkv, b = unit / (a.T * a.Hkv);  // tile 1 (splits > 1)
    const float* part = a.partial + unit * S * P;
    for (int64_t g = 0; g < G; ++g) attn_cpu::MergeSplits(part, S, G, D, g, og.data() + g * D);
    paged::StoreRow(a.elem_type, a.out, (b * a.T + t) * a.Hq * D + hk * G * D, G * D, og.data());
  }
}

}  // namespace ortkv
