// The CPU attention block kernel shared by CacheAttention (cache_attention.cc) and PagedCacheAttention
// (paged_attention.cc): 16-float vectors, the online softmax over one block of keys for the G query
// heads of a KV-head group, and the split-K merge. Private to the CPU kernels; every helper is
// always inlined, so it compiles inside each instruction-set copy of the callers' RunTask
// (Note [CPU attention ISA dispatch]).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "ortkv/cache_attention.h"
#include "ortkv/status.h"

#define ORTKV_INLINE inline __attribute__((always_inline))

// The 64-byte vector helpers are always inlined: no vector crosses a call, so the ABI note GCC gives
// for them (passing AVX-512 vectors without AVX-512 enabled) does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace ortkv {
namespace attn_cpu {

// Note [CacheAttention vectors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The hot loops use GCC vector extensions of 16 floats, not intrinsics: one source that the
// instruction-set copies of RunTask (Note [CPU attention ISA dispatch]) compile to one zmm register
// (AVX-512), two ymm (AVX2 + FMA) or four xmm (baseline SSE2), so one build runs everywhere at the
// width the CPU has (only float16 page rows use F16C / AVX-512 intrinsics, paged_attention_task.inc). V16u is the unaligned,
// may_alias view used to load and store rows of the caches, the query and the accumulators. Head
// sizes 16, 32, 48, 64 (SmolLM2), 80, 96, 128 and 256 take this path; others take plain loops the
// compiler vectorizes (BlockAny).
typedef float V16 __attribute__((vector_size(64)));
typedef float V16u __attribute__((vector_size(64), may_alias, aligned(4)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

ORTKV_INLINE V16 Load(const float* p) { return *reinterpret_cast<const V16u*>(p); }
ORTKV_INLINE void Store(float* p, V16 x) { *reinterpret_cast<V16u*>(p) = x; }
ORTKV_INLINE float Sum(V16 x) {
  const V8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const V4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Note [CacheAttention score transpose]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A key's score is the sum of the 16 lanes of q * k accumulated over the head dimension. Summing the
// lanes of each key on its own costs ~10 shuffles and adds per key, more than the key's FMAs; for 16
// keys at once, a tree of 15 two-vector (shuffle, shuffle, add) steps turns the 16 accumulators into
// one vector of 16 scores (lane j: key j), ~3 instructions per key.
ORTKV_INLINE V16 Half(V16 a, V16 b) {  // [a:8 partials of each of 2 keys...]: pairwise halves
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
ORTKV_INLINE V16 Quarter(V16 a, V16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
ORTKV_INLINE V16 Eighth(V16 a, V16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
ORTKV_INLINE V16 Sixteenth(V16 a, V16 b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
// x[j] holds key j's 16 partial products; returns the 16 sums in key order.
ORTKV_INLINE V16 Sum16(const V16* x) {
  V16 h[8], q[4], e[2];
  for (int i = 0; i < 8; ++i) h[i] = Half(x[2 * i], x[2 * i + 1]);
  for (int i = 0; i < 4; ++i) q[i] = Quarter(h[2 * i], h[2 * i + 1]);
  for (int i = 0; i < 2; ++i) e[i] = Eighth(q[2 * i], q[2 * i + 1]);
  return Sixteenth(e[0], e[1]);
}

// exp(x) for x <= 0 (scores minus their maximum), 16 at a time: 2^n * p(r) with n = round(x log2 e),
// |r| <= 1/2 and a degree-6 polynomial for 2^r (relative error ~2e-7). n is rounded by adding and
// subtracting 1.5 * 2^23, whose low mantissa bits then hold n (no floor, no conversion: written as
// plain vector arithmetic, it stays vectorized in every clone). Inputs below -87 give ~1e-38, not 0.
typedef int32_t V16i __attribute__((vector_size(64)));
typedef int32_t V8i __attribute__((vector_size(32)));
// V: a float vector, VI: the int32 vector of its width.
template <class V, class VI>
ORTKV_INLINE V ExpNonPositiveOf(V x) {
  const V lo = V{} - 87.0f, magic = V{} + 12582912.0f;
  x = x < lo ? lo : x;
  const V t = x * 1.44269504088896341f;
  const V f = t + magic;
  const V r = t - (f - magic);
  V p = V{} + 1.54035303933816e-4f;
  p = p * r + 1.33335581464284e-3f;
  p = p * r + 9.61812910762848e-3f;
  p = p * r + 5.55041086648216e-2f;
  p = p * r + 2.40226506959101e-1f;
  p = p * r + 6.93147180559945e-1f;
  p = p * r + 1.0f;
  const VI bits = ((reinterpret_cast<const VI&>(f) - reinterpret_cast<const VI&>(magic)) + 127) << 23;
  return p * reinterpret_cast<const V&>(bits);
}
ORTKV_INLINE V16 ExpNonPositive(V16 x) { return ExpNonPositiveOf<V16, V16i>(x); }
ORTKV_INLINE V8 ExpNonPositive(V8 x) { return ExpNonPositiveOf<V8, V8i>(x); }

// The state of one task: the group's G query heads (pre-multiplied by the scale), and per head the
// running max m, the running sum l of exp(score - m) and the unnormalized output acc (G x D).
struct State {
  const float* qs;
  float* sc;  // G x kAttnBlockKeys scores of the current block
  float* acc;
  float* m;
  float* l;
};

// Online-softmax update of head g with the n scores of a block already in sc: rescales what was
// accumulated when the maximum grows, turns the scores into weights, returns the rescale factor.
// Slots [n, kAttnBlockKeys) of sc are scratch: -inf for the maximum, 0 for the sum (no key is read
// for them, and the value loop stops at n).
ORTKV_INLINE float Softmax(const State& s, int64_t g, int64_t n) {
  constexpr int64_t KB = kAttnBlockKeys;
  static_assert(KB % 16 == 0, "whole vectors of scores");
  float* sc = s.sc + g * KB;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t j = n; j < KB; ++j) sc[j] = -inf;
  V16 mv = Load(sc);
  for (int64_t j = 16; j < KB; j += 16) {
    const V16 x = Load(sc + j);
    mv = mv > x ? mv : x;
  }
  float bmax = mv[0];
  for (int i = 1; i < 16; ++i) bmax = std::max(bmax, mv[i]);
  const float mnew = std::max(s.m[g], bmax);
  const float alpha = std::exp(s.m[g] - mnew);  // 0 on the first block (m = -inf)
  V16 sv = V16{};
  const V16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t j = 0; j < KB; j += 16) {
    const V16 e = ExpNonPositive(Load(sc + j) - mnew);
    const V16 p = lane + static_cast<int32_t>(j) < static_cast<int32_t>(n) ? e : V16{};  // padding: 0
    Store(sc + j, p);
    sv += p;
  }
  s.l[g] = s.l[g] * alpha + Sum(sv);
  s.m[g] = mnew;
  return alpha;
}

// Note [CPU attention row sources]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// BlockRows (attention_block_rows.inc) reads the keys and values of a block through a row source:
// Chunk(j, i) gives channels [16 i, 16 i + 16) of row j of the block as floats in a vector register,
// converted from whatever the rows are stored as: float32 here (a dense cache, or rows a paged block
// decoded into a buffer), float16 and bfloat16 page rows in paged_attention_task.inc (F16C /
// AVX-512 conversions where the CPU has them; Note [PagedCacheAttention in registers]).
struct F32Rows {  // rows of float32 with a stride of ts floats (a dense cache, or decoded rows)
  const float* p;
  int64_t ts;
  ORTKV_INLINE V16 Chunk(int64_t j, int i) const { return Load(p + j * ts + 16 * i); }
};

// Row scales of a source (Note [Paged codes in registers] in paged_attention_task.inc): kN = 0 for rows of floats
// (every source above), 1 where row j's values are Chunk * s[j], 2 where they are Chunk * s[j] + m[j].
template <class S, class = void>
struct RowScalesOf {
  static constexpr int kN = 0;
};
template <class S>
struct RowScalesOf<S, std::void_t<decltype(S::kScales)>> {
  static constexpr int kN = S::kScales;
};

// Note [CPU attention native width]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The 16-float vectors of BlockRows are one zmm in the AVX-512 copy but two ymm in the AVX2 copy and
// four xmm in the baseline one, and there GCC lowers them badly: the score loop's 16 accumulators
// (32 ymm for 16 registers) and the value loop's p[j] * row (a scalar broadcast to a two-register
// vector, built through the stack) spill, and the AVX2 copy ran at ~2.6 GB/s, slower than the
// baseline one (benchmarks/cpu_attention_kernel_driver.cc, one thread, K/V in L2: avx512 18.7,
// avx2 3.4, baseline 4.4 GB/s). The dense float32 kernel (BlockNative) is therefore
// written for a vector of W floats, W the width of the copy's registers (kLanes: 16 AVX-512,
// 8 AVX2, 4 baseline): scores W keys at a time (a W-key transpose tree, as Note [CacheAttention
// score transpose] for 16), the query read from L1 next to each key chunk, and the value pass in
// passes of at most 8 accumulator registers per head, for two heads at once where their
// accumulators fit (ValuesHeads: each value chunk is loaded once for both heads, even and odd keys
// in two accumulator sets per head). Three heads per load in one set each measured ~6 % faster from
// DRAM in the driver, but its summation order moved the q4 / q8 teacher-forced agreement with
// llama.cpp from 215 to 212 of 224 positions (tests/test_q4.py asks >= 213); with two sets per head
// the AVX-512 copy sums in BlockRows' order and its outputs are the old kernel's, bit for bit. The softmax between
// them stays on the 16-float helpers (a few instructions per key). The paged kernel runs its
// float32 rows (blocks it decoded into a buffer) through BlockNative too; float16 / bfloat16 pages read in
// place go through BlockRows / BlockRowsHeads in the AVX-512 copy (their row sources convert 16 channels per
// call) and BlockRowsHeads8 in the AVX2 copy (Note [Paged CPU AVX2 decode] in paged_attention_task.inc).
// Same driver, old and new kernel alternating on a loaded machine (load ~5), one thread, GB/s with
// K/V in L2 (128 keys) / from DRAM (8K keys): avx2 1.6 -> 8.3 / 1.3 -> 3.4, baseline 1.8 -> 4.0 /
// 1.3 -> 2.6, avx512 9.3 -> 12.3 / 3.8 -> 4.1 (one head per value pass).
template <int W>
struct VecOf;
template <>
struct VecOf<16> {
  typedef V16 T;
  typedef V16u U;
};
template <>
struct VecOf<8> {
  typedef V8 T;
  typedef float U __attribute__((vector_size(32), may_alias, aligned(4)));
};
template <>
struct VecOf<4> {
  typedef V4 T;
  typedef float U __attribute__((vector_size(16), may_alias, aligned(4)));
};

template <int W>
ORTKV_INLINE typename VecOf<W>::T LoadN(const float* p) {
  return *reinterpret_cast<const typename VecOf<W>::U*>(p);
}
template <int W>
ORTKV_INLINE void StoreN(float* p, typename VecOf<W>::T x) {
  *reinterpret_cast<typename VecOf<W>::U*>(p) = x;
}

ORTKV_INLINE float HSum(V16 x) { return Sum(x); }
ORTKV_INLINE float HSum(V8 x) {
  const V4 b = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
ORTKV_INLINE float HSum(V4 b) { return (b[0] + b[2]) + (b[1] + b[3]); }

// x[j] holds key j's W partial products; returns the W sums in key order (W = 16, 8, 4).
ORTKV_INLINE V16 SumKeys(const V16* x) { return Sum16(x); }
ORTKV_INLINE V8 SumKeys(const V8* x) {
  V8 h[4], q[2];
  for (int i = 0; i < 4; ++i)  // [a: 4 partials, b: 4 partials]
    h[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // [a a b b c c d d]
    q[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(h[2 * i], h[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(q[0], q[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(q[0], q[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
ORTKV_INLINE V4 SumKeys(const V4* x) {
  const V4 h0 = __builtin_shufflevector(x[0], x[1], 0, 1, 4, 5) + __builtin_shufflevector(x[0], x[1], 2, 3, 6, 7);
  const V4 h1 = __builtin_shufflevector(x[2], x[3], 0, 1, 4, 5) + __builtin_shufflevector(x[2], x[3], 2, 3, 6, 7);
  return __builtin_shufflevector(h0, h1, 0, 2, 4, 6) + __builtin_shufflevector(h0, h1, 1, 3, 5, 7);
}

// Accumulator registers per value pass: the largest divisor of NC that is at most 8.
constexpr int ValueRegs(int nc) {
  int r = 8;
  while (nc % r != 0) --r;
  return r;
}

// acc += p v over the block's n value rows for the H heads [g0, g0 + H) at once: each value chunk is
// loaded once for all H heads (Note [CPU attention native width]).
template <int W, int D, int H, bool kTwo>
ORTKV_INLINE void ValuesHeads(const State& s, int64_t g0, const float* alpha, const float* v, int64_t ts, int64_t n) {
  typedef typename VecOf<W>::T VN;
  constexpr int NC = D / W;
  constexpr int R = ValueRegs(NC);
  for (int c0 = 0; c0 < NC; c0 += R) {
    const float* vc = v + c0 * W;
    VN av[H][R], bv[H][R];  // kTwo: even keys in av, odd keys in bv (two FMA chains per register)
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
        av[h][i] = LoadN<W>(s.acc + (g0 + h) * D + (c0 + i) * W) * alpha[g0 + h], bv[h][i] = VN{};
    const float* p = s.sc + g0 * kAttnBlockKeys;
    int64_t j = 0;
    if (kTwo) {
      for (; j + 2 <= n; j += 2) {
        VN x[R], y[R];
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) x[i] = LoadN<W>(vc + j * ts + i * W), y[i] = LoadN<W>(vc + (j + 1) * ts + i * W);
#pragma GCC unroll 4
        for (int h = 0; h < H; ++h) {
          const float p0 = p[h * kAttnBlockKeys + j], p1 = p[h * kAttnBlockKeys + j + 1];
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i) av[h][i] += p0 * x[i], bv[h][i] += p1 * y[i];
        }
      }
    }
    for (; j < n; ++j) {
      VN x[R];
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) x[i] = LoadN<W>(vc + j * ts + i * W);
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) {
        const float ph = p[h * kAttnBlockKeys + j];
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) av[h][i] += ph * x[i];
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) StoreN<W>(s.acc + (g0 + h) * D + (c0 + i) * W, kTwo ? av[h][i] + bv[h][i] : av[h][i]);
  }
}

// One block of n float32 keys (rows k, v with stride ts floats) for all G heads, head size D, in
// vectors of W floats (Note [CPU attention native width]).
template <int W, int D>
ORTKV_INLINE void BlockNative(const State& s, int64_t G, const float* k, const float* v, int64_t ts, int64_t n) {
  typedef typename VecOf<W>::T VN;
  static_assert(D % W == 0, "whole vectors per row");
  constexpr int NC = D / W;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = s.qs + g * D;
    float* sc = s.sc + g * kAttnBlockKeys;
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      VN a[W];
#pragma GCC unroll 16
      for (int x = 0; x < W; ++x) {
        const float* kr = k + (j + x) * ts;
        VN t = LoadN<W>(qg) * LoadN<W>(kr);
#pragma GCC unroll 16
        for (int i = 1; i < NC; ++i) t += LoadN<W>(qg + i * W) * LoadN<W>(kr + i * W);
        a[x] = t;
      }
      StoreN<W>(sc + j, SumKeys(a));
    }
    for (; j < n; ++j) {
      const float* kr = k + j * ts;
      VN t = LoadN<W>(qg) * LoadN<W>(kr);
      for (int i = 1; i < NC; ++i) t += LoadN<W>(qg + i * W) * LoadN<W>(kr + i * W);
      sc[j] = HSum(t);
    }
  }
  // weights of every head, then acc += p v with each value chunk loaded once for two heads (the same
  // even / odd summation order per head as BlockRows: the AVX-512 copy's outputs are bit-identical)
  float alpha[64];  // at most 64 query heads per KV head (the plan's limit)
  for (int64_t g = 0; g < G; ++g) alpha[g] = Softmax(s, g, n);
  constexpr int R = ValueRegs(NC);
  int64_t g = 0;
  if (R <= 4) {  // two heads at once, even / odd keys in two accumulator sets: 2 x 2 x R <= 16 registers
    for (; g + 2 <= G; g += 2) ValuesHeads<W, D, 2, true>(s, g, alpha, v, ts, n);
    for (; g < G; ++g) ValuesHeads<W, D, 1, true>(s, g, alpha, v, ts, n);
  }
  for (; g < G; ++g) ValuesHeads<W, D, 1, (2 * R <= 8)>(s, g, alpha, v, ts, n);
}

// Any head size: the same steps with plain loops.
ORTKV_INLINE void BlockAny(const State& s, int64_t G, int64_t D, const float* k, const float* v, int64_t ts,
                           int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = s.qs + g * D;
    float* sc = s.sc + g * kAttnBlockKeys;
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = k + j * ts;
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t d = 0;
      for (; d + 8 <= D; d += 8)
        for (int x = 0; x < 8; ++x) lane[x] += qg[d + x] * kj[d + x];
      float t = 0;
      for (; d < D; ++d) t += qg[d] * kj[d];
      sc[j] = t + ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float alpha = Softmax(s, g, n);
    const float* p = s.sc + g * kAttnBlockKeys;
    float* ag = s.acc + g * D;
    for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + j * ts;
      for (int64_t d = 0; d < D; ++d) ag[d] += p[j] * vj[d];
    }
  }
}

// Note [CPU attention ISA dispatch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The wheel runs on any x86-64, so each op's task function is compiled three times from one source
// (cache_attention_task.inc, paged_attention_task.inc), each copy under its own `#pragma GCC target`:
//   kAvx512   AVX-512 F/BW/VL/DQ + F16C + FMA: one zmm per 16 floats, float16 rows by vcvtph2ps zmm
//   kAvx2     AVX2 + FMA + F16C: two ymm per 16 floats, vcvtph2ps ymm
//   kBaseline x86-64 (SSE2): four xmm per 16 floats, float16 converted on bits
// The vector helpers above carry no target of their own and are always inlined, so each copy gets
// them at its width (GCC lowers the generic vectors after inlining). The plan picks the copy once
// per process: the best the CPU reports (__builtin_cpu_supports), or the one named by the
// environment variable ORTKV_CPU_ISA (baseline, avx2, avx512), read at the first attention plan of
// the process. The override exists so that the tests run the narrower copies on a wide machine
// (tests/test_cpu_attention_isa.py) and so that a suspected miscompile can be ruled out in the field;
// a value the CPU cannot run, or a misspelt one, is refused with E_INPUT rather than ignored.
enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* CpuIsaName(CpuIsa i) {
  return i == CpuIsa::kAvx512 ? "avx512" : i == CpuIsa::kAvx2 ? "avx2" : "baseline";
}

inline CpuIsa BestCpuIsa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
    return CpuIsa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return CpuIsa::kAvx2;
  return CpuIsa::kBaseline;
}

struct CpuIsaChoice {
  CpuIsa isa;
  std::string error;  // empty: ORTKV_CPU_ISA is unset or valid
};

// Decided once per process (Note [CPU attention ISA dispatch]).
inline const CpuIsaChoice& CpuIsaOnce() {
  using Choice = CpuIsaChoice;
  static const Choice choice = [] {
    const CpuIsa best = BestCpuIsa();
    const char* env = std::getenv("ORTKV_CPU_ISA");
    if (env == nullptr || *env == 0) return Choice{best, ""};
    CpuIsa want;
    if (std::strcmp(env, "baseline") == 0) {
      want = CpuIsa::kBaseline;
    } else if (std::strcmp(env, "avx2") == 0) {
      want = CpuIsa::kAvx2;
    } else if (std::strcmp(env, "avx512") == 0) {
      want = CpuIsa::kAvx512;
    } else {
      return Choice{best, std::string("environment variable ORTKV_CPU_ISA='") + env +
                              "' is not one of baseline, avx2, avx512; unset it to use the best this CPU has (" +
                              CpuIsaName(best) + ")"};
    }
    if (static_cast<int>(want) > static_cast<int>(best))
      return Choice{best, std::string("environment variable ORTKV_CPU_ISA=") + env +
                              " asks for instructions this CPU lacks (its best is " + CpuIsaName(best) +
                              "); unset it or choose " + CpuIsaName(best) + " or narrower"};
    return Choice{want, ""};
  }();
  return choice;
}

// For the plans: refuses a bad ORTKV_CPU_ISA, naming "`op` node '`node`'"; the message is built only for a refusal
// (Note [Messages on the error path only]).
inline Status CheckCpuIsa(const char* op, const std::string& node) {
  const CpuIsaChoice& c = CpuIsaOnce();
  if (c.error.empty()) return Status::Ok();
  Message m;
  m << NodeWhere{op, node} << ": " << c.error;
  return Status(Code::kInvalidArgument, m.str());
}

// Note [CacheAttention CPU split-K]: split the keys only while units are too few to fill the threads,
// and never into chunks shorter than kAttnMinSplitKeys (the longest row, max_keys, decides).
inline int64_t CpuSplits(int64_t units, int64_t max_keys) {
  if (units <= 0 || units >= kAttnTargetTasks) return 1;
  return std::max<int64_t>(1, std::min((kAttnTargetTasks + units - 1) / units, max_keys / kAttnMinSplitKeys));
}

#ifndef ORTKV_CPU_QUERY_TILES  // 0: no tiles (an A/B knob for benchmarks)
#define ORTKV_CPU_QUERY_TILES 1
#endif
// Query tokens per unit of a CPU attention node (Note [Paged CPU query tiles] in paged_attention_task.inc), 1 for
// none: tiles run in the AVX-512 and AVX2 copies at head sizes 16..128 (multiples of 16), with up to 64 / G tokens a
// tile (kCpuTileLanes; 32 / G where 64 / G would leave too few tiles), where the tile's rows fill at least half of
// the lanes its kernel computes together (a part: 32 in the AVX-512 copy; 16, two ymm, in the AVX2 one: fewer rows
// compute them anyway, and a decode of 2 tokens at G = 3 would do ~5x the FMAs of the per-token path) and the tiles
// alone keep the threads busy (no split-K).
inline int64_t CpuQueryTile(int64_t B, int64_t Hkv, int64_t T, int64_t G, int64_t D, int64_t max_keys) {
  const CpuIsa isa = CpuIsaOnce().isa;
  if (!ORTKV_CPU_QUERY_TILES || isa == CpuIsa::kBaseline || D % 16 != 0 || D > 128 || G > 16) return 1;
  if (max_keys >= std::numeric_limits<int32_t>::max() - 1) return 1;  // the lanes' key limits are int32 (TileStart)
  const int64_t part = isa == CpuIsa::kAvx512 ? 32 : 16;
  for (const int64_t lanes : {kCpuTileLanes, kCpuTileLanes / 2}) {  // the wider tile where it keeps the threads busy
    const int64_t tile = std::min<int64_t>(T, lanes / G);
    if (tile >= 2 && 2 * tile * G >= part && CpuSplits(B * Hkv * ((T + tile - 1) / tile), max_keys) == 1) return tile;
  }
  return 1;
}

// Split-K merge (Note [CacheAttention CPU split-K]) of head g of one unit: its S chunk partials
// [acc G x D, m G, l G] at part + c * G * (D + 2) into the normalized output row og[D].
inline void MergeSplits(const float* part, int64_t S, int64_t G, int64_t D, int64_t g, float* og) {
  const int64_t P = G * (D + 2);
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < S; ++c) mx = std::max(mx, part[c * P + G * D + g]);  // chunk 0 is never empty
  float den = 0;
  std::fill(og, og + D, 0.0f);
  for (int64_t c = 0; c < S; ++c) {
    const float* pc = part + c * P;
    const float w = std::exp(pc[G * D + g] - mx);  // 0 for an empty chunk (m = -inf)
    if (w == 0.0f) continue;
    den += w * pc[G * D + G + g];
    for (int64_t d = 0; d < D; ++d) og[d] += w * pc[g * D + d];
  }
  const float inv = 1.0f / den;
  for (int64_t d = 0; d < D; ++d) og[d] *= inv;
}

}  // namespace attn_cpu
}  // namespace ortkv
