// Linear's checks and its CPU kernels (Note [Linear] in ortkv/linear.h): float32 through the tile kernel of
// Note [Linear CPU GEMV] (AVX-512 or AVX2 + FMA), and the reference path (plain dot products with 8 independent
// float32 partial sums per (row, column), so the compiler vectorizes them) for float16 (computed in float32) and
// for float32 on a CPU without AVX2 + FMA or with ORTKV_CPU_ISA=baseline. The caller parallelizes over columns.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sstream>
#include <vector>

#include "attention_block.h"  // CpuIsaOnce (Note [CPU attention ISA dispatch])
#include "codecs.h"
#include "ortkv/linear.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ortkv {

Status PlanLinear(const std::string& node, const TensorArg& x, const TensorArg& w, LinearView* view) {
  const NodeWhere where{"Linear", node};
  Message m;  // Note [Messages on the error path only]: this runs for every Linear node of every step
  if (x.dims.empty()) {
    m << where << ": input X '" << x.name << "' is a scalar; it must be [..., K] (rank >= 1)";
    return Status(Code::kInvalidArgument, m.str());
  }
  if (w.dims.size() != 2) {
    m << where << ": weight W '" << w.name << "' is " << ShapeText(w.dims) << " (rank " << w.dims.size()
      << "); it must be [N, K] (rank 2, torch's Linear layout: W^T of MatMul's B)";
    return Status(Code::kInvalidArgument, m.str());
  }
  if (x.elem_type != w.elem_type) {
    m << where << ": X '" << x.name << "' is " << ElemTypeName(x.elem_type) << " but W '" << w.name << "' is "
      << ElemTypeName(w.elem_type) << "; both must have the same float type";
    return Status(Code::kInvalidArgument, m.str());
  }
  const int64_t K = x.dims.back(), N = w.dims[0];
  if (w.dims[1] != K) {
    m << where << ": X '" << x.name << "' " << ShapeText(x.dims) << " has K = " << K << " but W '" << w.name << "' "
      << ShapeText(w.dims) << " has K = " << w.dims[1]
      << "; W must be [N, K] with X's last dim as K (transpose a MatMul weight)";
    return Status(Code::kInvalidArgument, m.str());
  }
  if (K % kLinearKMultiple != 0) {
    m << where << ": K = " << K << " (X '" << x.name << "' " << ShapeText(x.dims)
      << ") is not a multiple of 8; Linear reads W in 16-byte vectors of 8 elements: use MatMul for this matrix";
    return Status(Code::kInvalidArgument, m.str());
  }
  int64_t M = 1;
  for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
  view->x = x.data;
  view->w = w.data;
  view->M = M;
  view->K = K;
  view->N = N;
  view->elem_type = x.elem_type;
  return Status::Ok();
}

namespace {

// float16 bits -> float32 through a 256 KiB table built once (exact: codecs::F16BitsToF32 per entry): the
// conversion where the CPU has no F16C.
const float* HalfTable() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = codecs::F16BitsToF32(static_cast<uint16_t>(h));
    return t;
  }();
  return table.data();
}

// n float16 values -> float32, exact either way: F16C's vcvtph2ps 8 at a time where the CPU has it (checked once;
// the function is compiled for it alone, so the library still loads on any x86-64), else the table.
#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void HalfToFloatF16c(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = HalfTable()[src[i]];
}
#endif

void HalfToFloat(const uint16_t* src, float* dst, int64_t n) {
#if defined(__x86_64__)
  static const bool f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  if (f16c) return HalfToFloatF16c(src, dst, n);
#endif
  const float* table = HalfTable();
  for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
}

// Note [Linear CPU GEMV]
// ~~~~~~~~~~~~~~~~~~~~~~
// A float32 decode step is its weights read once (M = 1: 538 MB per token for SmolLM2-135M, 121 projections
// and the tied LM head), so the kernel's job is to stream W at the machine's read bandwidth, not to compute.
// (On AMD CPUs M = 1 reads W one row at a time instead: Note [Linear GEMV one stream].) Each tile takes
// kGemvRows = 4 rows of W (4 independent FMA chains per X row, and 4 x 4 = 16 accumulators at
// M = 4, half of AVX-512's registers) against up to kChunkM rows of X (4 with AVX-512, 2 with AVX2: its 16
// registers), k kLanes floats at a time; the last 8 floats of a K that is 8 mod 16 are a masked AVX-512 load
// (the op's K % 8 contract; nothing past a row is read). M > kChunkM runs the group of W again from L1 for each
// further chunk of X rows, so W leaves memory once per task whatever M is (prefill: the caller's tasks are
// <= 64 rows of X, ~150 KB, in L2).
// Prefetch: while a group runs, the group kGemvAheadRows = 8 rows further on is prefetched into L1, one
// prefetcht0 per cache line of it (18 KB ahead at K = 576, 48 KB at K = 1536). The hardware's L2 streamer stops
// at each 4 KiB page and restarts slowly; the software prefetch runs across pages. Only inside the task's
// columns (the last two groups of a task are not prefetched: the next rows belong to another task's thread).
// Measured (a standalone driver over the decoder's 121 matrices + LM head, 538 MB, 2 threads, alternated,
// numpy read 22.3-23.4 GB/s in the same minutes): no prefetch 21.1-22.8 GB/s, prefetcht0 1 group ahead 23.0-
// 23.4, 2 groups ahead 23.3-24.1, prefetcht1 20.9-21.3, prefetcht2 21.4, prefetchnta 4.5-8.8 (!); 8 rows per
// tile 21.0-23.7, 2 rows 21.3-22.6. ORT's MLAS MatMul on the same bytes: ~20.8 GB/s (weight_bound.md).
// The caller (linear_op.cc) splits a decode call's N into contiguous ranges of columns, one task each (Note [Linear
// GEMV tasks]).
// Instruction sets: the tile kernel is compiled for AVX-512 (F/DQ) and AVX2 + FMA under `#pragma GCC target`
// and picked once per process like the attention kernels (CpuIsaOnce, Note [CPU attention ISA dispatch]:
// ORTKV_CPU_ISA=avx2 / baseline forces a narrower one; baseline is the reference path below).
// Summation order: per (m, n) kLanes partial sums over k, then a tree of them: within float32 rounding of the
// reference, not bit-equal to it, to the other instruction set or to MLAS.
//
// Note [Linear SwiGLU epilogue]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Linear(X, W, activation="swiglu") (CPU, float32): W [N, K] is [wg; wu] (gate rows, then up rows, N even) and
// Y [..., N / 2] = silu(X wg^T) * (X wu^T): the fused gate / up projection and the SwiGLU op (Note [SwiGLU]) in one
// node, so a float32 decode step has 30 nodes fewer and the [1, 3072] product never leaves the task. A task takes
// output columns [j0, j1): the gate rows j0.. straight into Y, the up rows h + j0.. into a per-thread scratch (grown
// once, reused), then Y = (g * (1 / (1 + exp(-g)))) * u, the SwiGLU op's association, with a vector exp (Cephes'
// expf: range reduction by ln 2 in two parts, degree-5 polynomial) instead of std::exp per element (the SwiGLU
// op's, ~20 ns each: 1536 per layer). silu(g) on 200,001 points of [-80, 88] against float64: within 3.0 float32
// ulps (AVX-512 and AVX2), the same formula with std::exp 3.1, so the difference to the SwiGLU op is rounding
// noise. The baseline path keeps std::exp.
constexpr int64_t kGemvRows = kLinearCpuGemvRows;
constexpr int64_t kGemvAheadRows = 8;
// Note [Linear GEMV tasks]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A decode call's columns are split into up to kLinearCpuGemvTasks = 16 contiguous ranges (none under 64 KB of W),
// which ORT's ParallelFor hands out one at a time to whichever thread is free. With 4 ranges (before) the calling
// thread, once it had no range left, waited for the intra-op worker's last one: instrumented on the 2-core AMD VM
// (SmolLM2 float32 decode, 121 Linear calls a step), the worker began within ~1 us but its ranges ran ~12 % slower
// than the caller's (67 vs 60 us), and the caller idled 17.6-20.4 us per call after its last range (~2.3 ms of a
// ~20 ms step; perf showed the caller 9-12 % of the step in ORT's spin-wait). With 32 ranges that wait fell to
// 4-5 us per call. In the decoder, one process switching between the two every 16 steps (30 alternations, block
// medians): 16 ranges took 0.968x the time of 4 (quartiles 0.933 / 1.004); 8 ranges 0.964x and 32 or 64 ranges
// 1.11x in a noisier run of 16 alternations: more, shorter streams cost the prefetcher what the balance gains.
//
// Note [Linear GEMV one stream]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With ONE row of X (a batch-1 decode step, the float32 decoder's hot path) there is nothing to reuse a W row for,
// and the tile kernel's four rows at once are four interleaved streams 4 * K bytes apart. How such a call reads W
// (GemvM1) is decided once per process: on AMD CPUs one row at a time, start to end (each task one contiguous
// stream of W: its rows are adjacent in memory), prefetching with prefetchnta the line kSeqAheadBytes further on
// (kStreamNta); elsewhere the 4-row tile as measured on the Intel VM (kTile). The environment variable
// ORTKV_LINEAR_M1 = tile / stream / stream-nta overrides it (A/B runs; the tests run every path on any CPU).
// M >= 2 always takes the tile kernel (W read once for all rows of X).
// Measured on a 2-core AMD EPYC (Zen 4) VM with a standalone driver over the decoder's 121 matrices + the LM head
// (538 MB of random floats, 2 threads handing off per matrix, 3 alternated runs of 20 passes each): the tile read
// 25-27 GB/s where numpy's sum reads ~36; one row at a time 34.5-35.0 without software prefetch, 35.0-35.7 with
// prefetcht0 256 bytes ahead (512: 32.9-33.1, 768: 32.6-33.4; 8 accumulators instead of 4: 29.5-34.1), and with
// prefetchnta instead 33.0-34.7 vs 32.0-32.9. In the float32 decoder (`ortkv generate --warmup --weights float32`,
// 128 tokens, 4 alternated pairs of processes) prefetchnta gave 53.2 / 66.4 / 68.3 / 59.8 tok/s against 47.9 / 63.0
// / 51.9 / 47.4 (ORT's profiler: Linear kernels 20.1 -> 17.3 ms a step). Random values matter on that VM: with a
// periodic fill the host merged equal pages and "bandwidth" read 48-50 GB/s. Not measured on Intel, where the tile
// kernel with prefetchnta 8 rows ahead read 4.5-8.8 GB/s (Note [Linear CPU GEMV]): Intel keeps the tile until the
// stream is measured there.
// The one-row stream sums into ONE accumulator in the tile kernel's order: Note [Linear row-count invariance].
//
// Note [Linear row-count invariance]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Y[m, n] is one sum in one order, set by K and the process's instruction set alone: with AVX-512 / AVX2, kLanes
// partial sums over k ascending (FMA), the half tail, then Sum (the reference path: Dot's 8 partial sums);
// whichever path computes it (the tile at any chunk of rows, the one-row stream, either prefetch), whichever task
// or thread, whatever M is. So row m of a call with M rows is the same bytes as that row alone, which is what
// logits_start relies on (Note [Logits from logits_start] in python/ortkv/generate/builder.py: the last position's
// logits computed alone equal the last row of all positions, so a runner's output does not depend on how many
// positions it asked for). Until 2026-12-06 the stream kept 4 accumulators (a0..a3 over the 4 vectors of each
// 64-float step, added at the end): within rounding of the tile, not bit-equal, and on an AMD EPYC CI machine
// (where the stream is the default) the many-sequence forward's last positions differed from all_logits' in the
// last bits (tests/test_logits_start.py). One dependent FMA chain per row costs the stream nothing measurable: it
// allows 64 bytes per FMA latency (4 cycles), ~16 B/cycle per core, where memory gives each of the 2 cores
// ~17 GB/s (~6 B/cycle). Measured: benchmarks/results/linear_cpu.md (the 2026-12-06 A/B of the two streams).
// Tested: test_float32_kernel_row_count_same_bytes (every one-row path, in a child each).
constexpr int64_t kSeqAheadBytes = 256;

#define ORTKV_GEMV_INLINE inline __attribute__((always_inline))

// exp for the SwiGLU epilogue (Note [Linear SwiGLU epilogue]): Cephes' expf, exp(x) = 2^n exp(r) with
// n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts), exp(r) = 1 + r + r^2 P(r) with P of degree 5.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// Note [Linear GEMV one stream]: how a one-row call reads W.
enum class GemvM1 : int { kTile = 0, kStream = 1, kStreamNta = 2 };

struct GemvM1Choice {
  GemvM1 mode;
  std::string error;  // empty: ORTKV_LINEAR_M1 is unset or valid
};

const GemvM1Choice& GemvM1Once() {
  static const GemvM1Choice choice = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const GemvM1 best = __builtin_cpu_is("amd") ? GemvM1::kStreamNta : GemvM1::kTile;
#else
    const GemvM1 best = GemvM1::kTile;
#endif
    const char* env = std::getenv("ORTKV_LINEAR_M1");
    if (env == nullptr || *env == 0) return GemvM1Choice{best, ""};
    if (std::strcmp(env, "tile") == 0) return GemvM1Choice{GemvM1::kTile, ""};
    if (std::strcmp(env, "stream") == 0) return GemvM1Choice{GemvM1::kStream, ""};
    if (std::strcmp(env, "stream-nta") == 0) return GemvM1Choice{GemvM1::kStreamNta, ""};
    return GemvM1Choice{best, std::string("environment variable ORTKV_LINEAR_M1='") + env +
                                  "' is not one of tile, stream, stream-nta; unset it for this CPU's default (" +
                                  (best == GemvM1::kTile ? "tile" : "stream-nta") + ")"};
  }();
  return choice;
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx2,fma")
namespace gemv_avx512 {
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kChunkM = 4;
constexpr bool kHalfTail = true;
ORTKV_GEMV_INLINE Vec Zero() { return _mm512_setzero_ps(); }
ORTKV_GEMV_INLINE Vec Load(const float* p) { return _mm512_loadu_ps(p); }
ORTKV_GEMV_INLINE Vec LoadHalf(const float* p) { return _mm512_maskz_loadu_ps(0x00FF, p); }
ORTKV_GEMV_INLINE Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
ORTKV_GEMV_INLINE float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
ORTKV_GEMV_INLINE Vec Splat(float f) { return _mm512_set1_ps(f); }
ORTKV_GEMV_INLINE void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
ORTKV_GEMV_INLINE Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
ORTKV_GEMV_INLINE Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
ORTKV_GEMV_INLINE Vec Div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
ORTKV_GEMV_INLINE Vec Neg(Vec a) { return _mm512_sub_ps(_mm512_setzero_ps(), a); }
// Note [Linear SwiGLU epilogue]: exp(x) = 2^n p(r); x clamped to [-104, 89] (exp is 0 / inf beyond in float32;
// max / min with x second keep a NaN), 2^n by vscalefps (0 below 2^-149, inf above 2^128).
ORTKV_GEMV_INLINE Vec ExpVec(Vec x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const Vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  Vec p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#include "linear_gemv.inc"
}  // namespace gemv_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace gemv_avx2 {
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kChunkM = 2;
constexpr bool kHalfTail = false;
ORTKV_GEMV_INLINE Vec Zero() { return _mm256_setzero_ps(); }
ORTKV_GEMV_INLINE Vec Load(const float* p) { return _mm256_loadu_ps(p); }
ORTKV_GEMV_INLINE Vec LoadHalf(const float* p) { return _mm256_loadu_ps(p); }  // unused: K % 8 == 0
ORTKV_GEMV_INLINE Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
ORTKV_GEMV_INLINE float Sum(Vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
ORTKV_GEMV_INLINE Vec Splat(float f) { return _mm256_set1_ps(f); }
ORTKV_GEMV_INLINE void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
ORTKV_GEMV_INLINE Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
ORTKV_GEMV_INLINE Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
ORTKV_GEMV_INLINE Vec Div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
ORTKV_GEMV_INLINE Vec Neg(Vec a) { return _mm256_sub_ps(_mm256_setzero_ps(), a); }
// Note [Linear SwiGLU epilogue]: as the AVX-512 one, x clamped to [-87, 88.7] so that 2^n is a normal float built
// from its exponent bits; above 88.7 the result is +inf (exp overflows there in float32).
ORTKV_GEMV_INLINE Vec ExpVec(Vec x0) {
  const Vec x = _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x0));
  const Vec n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  Vec p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const Vec e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x0, _mm256_set1_ps(88.7f), _CMP_GT_OQ));
}
#include "linear_gemv.inc"
}  // namespace gemv_avx2
#pragma GCC pop_options
#endif

inline float Dot(const float* x, const float* w, int64_t K) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t k = 0; k < K; k += 8) {  // K % 8 == 0 (PlanLinear)
    for (int j = 0; j < 8; ++j) acc[j] += x[k + j] * w[k + j];
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

Status CheckLinearCpuIsa(const std::string& node) {
  if (!GemvM1Once().error.empty()) {  // the first call of each node refuses a misspelt ORTKV_LINEAR_M1
    return Status(Code::kInvalidArgument, "Linear node '" + node + "': " + GemvM1Once().error);
  }
  return attn_cpu::CheckCpuIsa("Linear", node);
}

void LinearCpu(const LinearView& v, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t K = v.K, N = v.N;
  if (v.elem_type == kFloat32) {
    const float* x = static_cast<const float*>(v.x);
    const float* w = static_cast<const float*>(v.w);
    float* y = static_cast<float*>(v.y);
#if defined(__x86_64__)
    switch (attn_cpu::CpuIsaOnce().isa) {  // Note [Linear CPU GEMV]; the op refused a bad ORTKV_CPU_ISA
      case attn_cpu::CpuIsa::kAvx512:
        return gemv_avx512::Run(x, w, y, K, N, m0, m1, n0, n1, GemvM1Once().mode);
      case attn_cpu::CpuIsa::kAvx2:
        return gemv_avx2::Run(x, w, y, K, N, m0, m1, n0, n1, GemvM1Once().mode);
      case attn_cpu::CpuIsa::kBaseline:
        break;
    }
#endif
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m = m0; m < m1; ++m) y[m * N + n] = Dot(x + m * K, w + n * K, K);
    }
    return;
  }
  // float16: the task's X rows converted once, each W row once per task, into float32 buffers
  const uint16_t* x = static_cast<const uint16_t*>(v.x);
  const uint16_t* w = static_cast<const uint16_t*>(v.w);
  uint16_t* y = static_cast<uint16_t*>(v.y);
  thread_local std::vector<float> xf, wf;
  xf.resize(static_cast<size_t>((m1 - m0) * K));
  wf.resize(static_cast<size_t>(K));
  HalfToFloat(x + m0 * K, xf.data(), (m1 - m0) * K);
  for (int64_t n = n0; n < n1; ++n) {
    HalfToFloat(w + n * K, wf.data(), K);
    for (int64_t m = m0; m < m1; ++m) {
      y[m * N + n] = codecs::F32ToF16Bits(Dot(xf.data() + (m - m0) * K, wf.data(), K));
    }
  }
}

// Note [Linear norm prologue]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A float32 decoder's every projection that follows a residual add and an RMSNorm (QKV, gate / up, the LM head) takes
// them as its prologue: Linear(x, W, skip, gamma, epsilon) -> (Y, x + skip), so the 60 SkipSimplifiedLayerNormalization
// nodes of SmolLM2's step go (each ~9-12 us under ORT's profiler in the decoder, where the weights just streamed
// have evicted its data: more than the 1.1 us it costs in a hot chain). The norm is computed once per call, on the
// calling thread, before the GEMV's tasks; same arithmetic as ORT's kernel (see linear.h).
void SkipRmsNormCpu(const float* x, const float* skip, const float* gamma, float epsilon, int64_t M, int64_t K,
                    float* out, float* sum) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    const float* sr = skip + m * K;
    float* o = out + m * K;
    float mean_square = 0.0f;
    for (int64_t h = 0; h < K; ++h) {
      const float val = xr[h] + sr[h];
      o[h] = val;
      mean_square += val * val;
    }
    if (sum != nullptr) std::memcpy(sum + m * K, o, static_cast<size_t>(K) * sizeof(float));
    mean_square = std::sqrt(mean_square / static_cast<float>(K) + epsilon);
    for (int64_t h = 0; h < K; ++h) o[h] = o[h] / mean_square * gamma[h];
  }
}

void LinearSwiGLUCpu(const LinearView& v, int64_t m0, int64_t m1, int64_t j0, int64_t j1) {
  const int64_t K = v.K, h = v.N / 2, mc = m1 - m0, cnt = j1 - j0;
  if (mc <= 0 || cnt <= 0) return;
  const float* x = static_cast<const float*>(v.x) + m0 * K;
  const float* w = static_cast<const float*>(v.w);
  float* y = static_cast<float*>(v.y) + m0 * h + j0;
#if defined(__x86_64__)
  const attn_cpu::CpuIsa isa = attn_cpu::CpuIsaOnce().isa;  // the op refused a bad ORTKV_CPU_ISA
  if (isa != attn_cpu::CpuIsa::kBaseline) {
    // gate columns straight into Y (row stride h), up columns into this thread's scratch, then Y = silu(Y) * up
    thread_local std::vector<float> up;
    if (up.size() < static_cast<size_t>(mc * cnt)) up.resize(static_cast<size_t>(mc * cnt));
    const GemvM1 one_row = GemvM1Once().mode;
    if (isa == attn_cpu::CpuIsa::kAvx512) {
      gemv_avx512::Run(x, w + j0 * K, y, K, h, 0, mc, 0, cnt, one_row);
      gemv_avx512::Run(x, w + (h + j0) * K, up.data(), K, cnt, 0, mc, 0, cnt, one_row);
      for (int64_t m = 0; m < mc; ++m) gemv_avx512::SwiGLUInPlace(y + m * h, up.data() + m * cnt, cnt);
    } else {
      gemv_avx2::Run(x, w + j0 * K, y, K, h, 0, mc, 0, cnt, one_row);
      gemv_avx2::Run(x, w + (h + j0) * K, up.data(), K, cnt, 0, mc, 0, cnt, one_row);
      for (int64_t m = 0; m < mc; ++m) gemv_avx2::SwiGLUInPlace(y + m * h, up.data() + m * cnt, cnt);
    }
    return;
  }
#endif
  for (int64_t m = 0; m < mc; ++m) {  // the reference: the SwiGLU op's arithmetic on the reference dot products
    for (int64_t j = 0; j < cnt; ++j) {
      const float g = Dot(x + m * K, w + (j0 + j) * K, K), u = Dot(x + m * K, w + (h + j0 + j) * K, K);
      const float sig = 1.0f / (1.0f + std::exp(-g));
      y[m * h + j] = (g * sig) * u;
    }
  }
}

}  // namespace ortkv
