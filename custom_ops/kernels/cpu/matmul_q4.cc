// MatMulQ4 on the CPU: Note [MatMulQ4 layout], Note [MatMulQ4 arithmetic], Note [MatMulQ4 dispatch] in
// ortkv/matmul_q4.h.
#include "ortkv/matmul_q4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include <immintrin.h>  // used only inside the #pragma GCC target regions below

namespace ortkv {
namespace {

constexpr int kRows = 4;  // rows of X per pass over a tile

// IEEE half -> float, portable (the scalar path; the SIMD paths use vcvtph2ps).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3FFu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline int32_t Load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One block of 32 values to int8: a = round(x * 127 / amax), e = amax / 127 (Note [MatMulQ4 arithmetic]);
// *sum = e * sum(a), the block sum of the dequantized values. The AVX2 / AVX-512 copies below give the same
// bytes (Note [MatMulQ4 activation quantization]).
float QuantizeBlock(const float* x, int8_t* q, float* sum) {
  float amax = 0.0f;
  for (int i = 0; i < kQ4Block; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t total = 0;
  for (int i = 0; i < kQ4Block; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    total += q[i];
  }
  const float e = amax / 127.0f;
  *sum = e * static_cast<float>(total);
  return e;
}

// ---- scalar -------------------------------------------------------------------------------------------
template <int R, int S>
void TileScalar(const MatMulQ4View& v, int64_t t, int64_t m0) {
  const int64_t KB = v.blocks();
  const uint8_t* wc = v.codes + t * KB * kQ4TileBytes;
  const uint16_t* ws = v.scales + t * KB * kQ4TileCols;
  const uint16_t* wm = v.mins + t * KB * kQ4TileCols;
  float acc[R][kQ4TileCols] = {};
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* line = wc + b * kQ4TileBytes;
    for (int c = 0; c < kQ4TileCols; ++c) {
      const float d = HalfToFloat(ws[b * kQ4TileCols + c]), m = HalfToFloat(wm[b * kQ4TileCols + c]);
      for (int r = 0; r < R; ++r) {
        const int64_t kb = (m0 + r) * KB + b;
        for (int sp = 0; sp < S; ++sp) {
          const int8_t* a = v.xq + (kb * S + sp) * kQ4Block;
          int32_t dot = 0;
          for (int g = 0; g < 4; ++g) {
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = line[g * 64 + c * 4 + j];
              dot += static_cast<int32_t>(byte & 0x0F) * a[4 * g + j] + static_cast<int32_t>(byte >> 4) * a[16 + 4 * g + j];
            }
          }
          acc[r][c] += d * v.xe[kb * S + sp] * static_cast<float>(dot);
        }
        acc[r][c] += m * v.xs[kb];
      }
    }
  }
  const int64_t n0 = t * kQ4TileCols, cols = std::min<int64_t>(kQ4TileCols, v.N - n0);
  for (int r = 0; r < R; ++r) std::memcpy(v.y + (m0 + r) * v.N + n0, acc[r], static_cast<size_t>(cols) * sizeof(float));
}

}  // namespace

// Note [MatMulQ4 prefetch]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A decode step reads each projection's codes once, from DRAM, in three streams per tile (codes, d, m), and a
// tile's codes are only KB * 256 bytes (4.6 KiB at K = 576): the hardware's L2 streamer restarts at every 4 KiB
// page and never got far ahead, so the loop waited on memory with the VNNI units mostly idle. Each block now
// prefetches the codes kQ4PrefetchBlocks blocks ahead (its 4 lines) and, every other block, the d and m lines
// that far ahead. The tiles of a ParallelFor task are contiguous, so the prefetches past a tile's end fetch the
// next tile's first blocks; past the array's end they are dropped (a prefetch never faults).
#ifndef ORTKV_Q4_PREFETCH_BLOCKS
#define ORTKV_Q4_PREFETCH_BLOCKS 8
#endif
constexpr int64_t kQ4PrefetchBlocks = ORTKV_Q4_PREFETCH_BLOCKS;

// Block b of a tile (codes line, its d / m rows ws / wm): the codes kQ4PrefetchBlocks blocks ahead and, every
// other block, the d and m lines that far ahead (32 bytes of each per block).
inline void PrefetchAhead(const uint8_t* line, const uint16_t* ws, const uint16_t* wm, int64_t b) {
  if constexpr (kQ4PrefetchBlocks > 0) {
    const char* pf = reinterpret_cast<const char*>(line + kQ4PrefetchBlocks * kQ4TileBytes);
    for (int g = 0; g < 4; ++g) _mm_prefetch(pf + 64 * g, _MM_HINT_T0);
    if ((b & 1) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(ws + (b + kQ4PrefetchBlocks) * kQ4TileCols), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wm + (b + kQ4PrefetchBlocks) * kQ4TileCols), _MM_HINT_T0);
    }
  }
}

// ---- AVX2 (+ F16C, FMA) ----------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace q4_avx2 {

// One block of 16 columns for R rows, as two halves of 8 columns (a ymm of 8 int32 lanes each).
template <int R, int S>
void Tile(const MatMulQ4View& v, int64_t t, int64_t m0) {
  const int64_t KB = v.blocks();
  const uint8_t* wc = v.codes + t * KB * kQ4TileBytes;
  const uint16_t* ws = v.scales + t * KB * kQ4TileCols;
  const uint16_t* wm = v.mins + t * KB * kQ4TileCols;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* line = wc + b * kQ4TileBytes;
    PrefetchAhead(line, ws, wm, b);  // Note [MatMulQ4 prefetch]
    for (int h = 0; h < 2; ++h) {
      __m256i lo[4], hi[4];
      for (int g = 0; g < 4; ++g) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + g * 64 + h * 32));
        lo[g] = _mm256_and_si256(w, low);
        hi[g] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + b * kQ4TileCols + h * 8)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + b * kQ4TileCols + h * 8)));
      for (int r = 0; r < R; ++r) {
        const int64_t kb = (m0 + r) * KB + b;
        for (int sp = 0; sp < S; ++sp) {
          const int8_t* a = v.xq + (kb * S + sp) * kQ4Block;
          // |q a| <= 15 * 127: 2 products per maddubs lane, 8 of those summed stay within int16 (30480)
          __m256i s16 = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(Load32(a)));
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(Load32(a + 16))));
          for (int g = 1; g < 4; ++g) {
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[g], _mm256_set1_epi32(Load32(a + 4 * g))));
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[g], _mm256_set1_epi32(Load32(a + 16 + 4 * g))));
          }
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
          acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(v.xe[kb * S + sp])), acc[r][h]);
        }
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(v.xs[kb]), acc[r][h]);
      }
    }
  }
  const int64_t n0 = t * kQ4TileCols, cols = std::min<int64_t>(kQ4TileCols, v.N - n0);
  for (int r = 0; r < R; ++r) {
    float* out = v.y + (m0 + r) * v.N + n0;
    if (cols == kQ4TileCols) {
      _mm256_storeu_ps(out, acc[r][0]);
      _mm256_storeu_ps(out + 8, acc[r][1]);
    } else {
      alignas(32) float tmp[kQ4TileCols];
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      std::memcpy(out, tmp, static_cast<size_t>(cols) * sizeof(float));
    }
  }
}

// QuantizeBlock, 8 lanes at a time (Note [MatMulQ4 activation quantization]).
float QuantizeBlock(const float* x, int8_t* q, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), mx);  // a NaN lane keeps mx, as std::max(amax, nan)
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m256 vi = _mm256_set1_ps(inv);
  __m256i a[4];
  for (int i = 0; i < 4; ++i) a[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi));  // nearest even, as nearbyint
  const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(a[0], a[1]), _mm256_add_epi32(a[2], a[3]));
  __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
  s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4E));
  s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1));
  const int32_t total = _mm_cvtsi128_si32(s2);
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it
  const __m256i ab = _mm256_packs_epi32(a[0], a[1]), cd = _mm256_packs_epi32(a[2], a[3]);
  const __m256i abcd = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), abcd);
  const float e = amax / 127.0f;
  *sum = e * static_cast<float>(total);
  return e;
}

}  // namespace q4_avx2
#pragma GCC pop_options

// ---- AVX512-VNNI -----------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace q4_vnni {

template <int R, int S>
void Tile(const MatMulQ4View& v, int64_t t, int64_t m0) {
  const int64_t KB = v.blocks();
  const uint8_t* wc = v.codes + t * KB * kQ4TileBytes;
  const uint16_t* ws = v.scales + t * KB * kQ4TileCols;
  const uint16_t* wm = v.mins + t * KB * kQ4TileCols;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* line = wc + b * kQ4TileBytes;
    PrefetchAhead(line, ws, wm, b);  // Note [MatMulQ4 prefetch]
    __m512i lo[4], hi[4];
    for (int g = 0; g < 4; ++g) {
      const __m512i w = _mm512_loadu_si512(line + g * 64);
      lo[g] = _mm512_and_si512(w, low);
      hi[g] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + b * kQ4TileCols)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wm + b * kQ4TileCols)));
    for (int r = 0; r < R; ++r) {
      const int64_t kb = (m0 + r) * KB + b;
      for (int sp = 0; sp < S; ++sp) {
        const int8_t* a = v.xq + (kb * S + sp) * kQ4Block;
        // two independent vpdpbusd chains (low and high halves of the block), added at the end
        __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], _mm512_set1_epi32(Load32(a)));
        __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], _mm512_set1_epi32(Load32(a + 16)));
        for (int g = 1; g < 4; ++g) {
          s0 = _mm512_dpbusd_epi32(s0, lo[g], _mm512_set1_epi32(Load32(a + 4 * g)));
          s1 = _mm512_dpbusd_epi32(s1, hi[g], _mm512_set1_epi32(Load32(a + 16 + 4 * g)));
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(v.xe[kb * S + sp])), acc[r]);
      }
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(v.xs[kb]), acc[r]);
    }
  }
  const int64_t n0 = t * kQ4TileCols, cols = std::min<int64_t>(kQ4TileCols, v.N - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1u);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(v.y + (m0 + r) * v.N + n0, keep, acc[r]);
}

// QuantizeBlock, 16 lanes at a time (Note [MatMulQ4 activation quantization]).
float QuantizeBlock(const float* x, int8_t* q, float* sum) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  // max(|v|, m) returns m where v is NaN: NaN lanes are skipped, as std::max(amax, nan) does
  const __m512 mx = _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps()));
  const float amax = _mm512_reduce_max_ps(mx);
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m512 vi = _mm512_set1_ps(inv);
  const __m512i a0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vi)), a1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vi));
  const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(a0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(a1));
  const float e = amax / 127.0f;
  *sum = e * static_cast<float>(total);
  return e;
}

}  // namespace q4_vnni
#pragma GCC pop_options

namespace {

using TileFn = void (*)(const MatMulQ4View&, int64_t, int64_t);

template <int R, int S>
TileFn PickIsa(Q4Isa isa) {
  switch (isa) {
    case Q4Isa::kAvx512Vnni: return q4_vnni::Tile<R, S>;
    case Q4Isa::kAvx2: return q4_avx2::Tile<R, S>;
    case Q4Isa::kScalar: break;
  }
  return TileScalar<R, S>;
}

template <int R>
TileFn Pick(const MatMulQ4View& v) {
  return v.act_terms == 2 ? PickIsa<R, 2>(v.isa) : PickIsa<R, 1>(v.isa);
}

}  // namespace

const char* Q4IsaName(Q4Isa isa) {
  switch (isa) {
    case Q4Isa::kAvx512Vnni: return "avx512vnni";
    case Q4Isa::kAvx2: return "avx2";
    case Q4Isa::kScalar: break;
  }
  return "scalar";
}

bool Q4IsaSupported(Q4Isa isa) {
  switch (isa) {
    case Q4Isa::kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Q4Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Q4Isa::kScalar: break;
  }
  return true;
}

Q4Isa Q4IsaBest() {
  if (Q4IsaSupported(Q4Isa::kAvx512Vnni)) return Q4Isa::kAvx512Vnni;
  if (Q4IsaSupported(Q4Isa::kAvx2)) return Q4Isa::kAvx2;
  return Q4Isa::kScalar;
}

Status ParseQ4Isa(const std::string& node, const std::string& name, Q4Isa* out) {
  if (name == "auto" || name.empty()) {
    *out = Q4IsaBest();
    return Status::Ok();
  }
  for (Q4Isa isa : {Q4Isa::kAvx512Vnni, Q4Isa::kAvx2, Q4Isa::kScalar}) {
    if (name != Q4IsaName(isa)) continue;
    if (!Q4IsaSupported(isa)) {
      return Status(Code::kInvalidArgument,
                    "MatMulQ4 node '" + node + "': attribute isa='" + name + "' but this CPU cannot run it (best: " +
                        Q4IsaName(Q4IsaBest()) + "); remove the attribute or set isa='auto'");
    }
    *out = isa;
    return Status::Ok();
  }
  return Status(Code::kInvalidArgument, "MatMulQ4 node '" + node + "': attribute isa='" + name +
                                            "' is not one of 'auto', 'avx512vnni', 'avx2', 'scalar'");
}

Status PlanMatMulQ4(const std::string& node, const TensorArg& x, const TensorArg& codes, const TensorArg& scales,
                    const TensorArg& mins, int64_t K, int64_t N, MatMulQ4View* view) {
  const std::string where = "MatMulQ4 node '" + node + "': ";
  const std::string remedy = "; repack the Q4_1 matrix with ortkv.generate.weights.pack_matmul_q4 (Note [MatMulQ4 layout])";
  if (K <= 0 || K % kQ4Block != 0) {
    return Status(Code::kInvalidArgument, where + "attribute K=" + std::to_string(K) + " (X '" + x.name + "' " +
                                              ShapeText(x.dims) +
                                              ") is not a positive multiple of 32 (the Q4_1 block); MatMulQ4 takes "
                                              "only such K: use MatMul or MatMulNBits for this matrix");
  }
  if (N <= 0) {
    return Status(Code::kInvalidArgument,
                  where + "attribute N=" + std::to_string(N) + " is missing or < 1; set N to the output width");
  }
  if (x.elem_type != kFloat32) {
    return Status(Code::kInvalidArgument, where + "input '" + x.name + "' has element type " +
                                              std::to_string(x.elem_type) + "; MatMulQ4 takes float32 X (type 1)");
  }
  if (x.dims.empty() || x.dims.back() != K) {
    return Status(Code::kInvalidArgument, where + "input '" + x.name + "' has shape " + ShapeText(x.dims) +
                                              "; its last dimension must be K=" + std::to_string(K) +
                                              " (the node's attribute)");
  }
  const int64_t KB = K / kQ4Block, T = (N + kQ4TileCols - 1) / kQ4TileCols;
  const std::vector<int64_t> want_codes{T, KB, kQ4TileBytes}, want_scales{T, KB, kQ4TileCols};
  const std::string nk = " for K=" + std::to_string(K) + ", N=" + std::to_string(N);
  if (codes.elem_type != kUint8 || codes.dims != want_codes) {
    return Status(Code::kInvalidArgument, where + "codes '" + codes.name + "' are " +
                                              (codes.elem_type != kUint8 ? "of element type " + std::to_string(codes.elem_type) + ", "
                                                                         : std::string()) +
                                              "shape " + ShapeText(codes.dims) + "; expected uint8 " + ShapeText(want_codes) + nk + remedy);
  }
  for (const TensorArg* s : {&scales, &mins}) {
    const char* what = s == &scales ? "scales" : "mins";
    if (s->elem_type != kFloat16 || s->dims != want_scales) {
      return Status(Code::kInvalidArgument, where + what + " '" + s->name + "' are " +
                                                (s->elem_type != kFloat16 ? "of element type " + std::to_string(s->elem_type) + ", "
                                                                          : std::string()) +
                                                "shape " + ShapeText(s->dims) + "; expected float16 " + ShapeText(want_scales) + nk +
                                                remedy);
    }
  }
  int64_t M = 1;
  for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
  view->x = static_cast<const float*>(x.data);
  view->codes = static_cast<const uint8_t*>(codes.data);
  view->scales = static_cast<const uint16_t*>(scales.data);
  view->mins = static_cast<const uint16_t*>(mins.data);
  view->M = M;
  view->K = K;
  view->N = N;
  return Status::Ok();
}

// Note [MatMulQ4 activation quantization]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every call quantizes X's blocks of 32 before the tiles run (on the calling thread at M = 1). The scalar loop
// called libm's nearbyintf for every value (an x86-64 build without SSE4.1 has no inline rounding): ~600 calls
// for one K = 576 row. The AVX2 and AVX-512 copies (Intel Xeon VM, q4 decode step, `profile_decode.py --floor`,
// three alternated pairs: 4.19 / 4.30 / 4.40 ms against 4.77 / 4.65 / 4.67 with the scalar loop), picked
// with the node's kernels, round with cvtps2dq under the same (default, nearest-even) rounding mode as
// nearbyint, skip NaN lanes in the maximum as std::max does, and narrow with saturation (|a| <= 127, so never
// taken): the same bytes, e and sums as the scalar loop (tests/test_matmul_q4.py compares them).
namespace {
using QuantFn = float (*)(const float*, int8_t*, float*);

QuantFn PickQuant(Q4Isa isa) {
  switch (isa) {
    case Q4Isa::kAvx512Vnni: return q4_vnni::QuantizeBlock;
    case Q4Isa::kAvx2: return q4_avx2::QuantizeBlock;
    case Q4Isa::kScalar: break;
  }
  return QuantizeBlock;
}
}  // namespace

void MatMulQ4QuantizeRows(const MatMulQ4View& v, int64_t m0, int64_t m1) {
  const QuantFn quantize = PickQuant(v.isa);
  const int64_t KB = v.blocks(), S = v.act_terms;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < KB; ++b) {
      const float* x = v.x + m * v.K + b * kQ4Block;
      const int64_t kb = m * KB + b;
      int8_t* q = v.xq + kb * S * kQ4Block;
      float sum = 0.0f;
      const float e = quantize(x, q, &sum);
      v.xe[kb * S] = e;
      if (S == 2) {  // Note [MatMulQ4 activation terms]: the rounding residual as a second int8 term
        float res[kQ4Block], sum2 = 0.0f;
        for (int i = 0; i < kQ4Block; ++i) res[i] = x[i] - e * static_cast<float>(q[i]);
        v.xe[kb * S + 1] = quantize(res, q + kQ4Block, &sum2);
        sum += sum2;
      }
      v.xs[kb] = sum;
    }
  }
}

void MatMulQ4Tiles(const MatMulQ4View& v, int64_t t0, int64_t t1) {
  const TileFn f4 = Pick<4>(v), f3 = Pick<3>(v), f2 = Pick<2>(v), f1 = Pick<1>(v);
  static_assert(kRows == 4, "the row loop below unrolls 4 / 3 / 2 / 1");
  for (int64_t t = t0; t < t1; ++t) {
    int64_t m = 0;
    for (; m + 4 <= v.M; m += 4) f4(v, t, m);
    switch (v.M - m) {
      case 3: f3(v, t, m); break;
      case 2: f2(v, t, m); break;
      case 1: f1(v, t, m); break;
      default: break;
    }
  }
}

}  // namespace ortkv
