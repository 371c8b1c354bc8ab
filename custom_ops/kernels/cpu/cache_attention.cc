// CPU CacheAttention (Note [CacheAttention] and Note [CacheAttention CPU split-K] in
// ortkv/cache_attention.h): one pass over each unit's keys in L1-sized blocks with an online softmax,
// all G query heads of a KV-head group per key block, split over key chunks when one sequence must
// keep every core reading.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "ortkv/cache_attention.h"

#define ORTKV_INLINE inline __attribute__((always_inline))

// The 64-byte vector helpers are always inlined: no vector crosses a call, so the ABI note GCC gives
// for them (passing AVX-512 vectors without AVX-512 enabled) does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace ortkv {
namespace {

Status Bad(const std::string& node, const std::string& what) {
  return Status(Code::kInvalidArgument, "CacheAttention node '" + node + "': " + what);
}

// Note [CacheAttention vectors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The hot loops use GCC vector extensions of 16 floats, not intrinsics: one source that the
// target_clones of RunTask compile to one zmm register (AVX-512), two ymm (AVX2 + FMA) or four xmm
// (baseline SSE2), so one build runs everywhere at the width the CPU has. V16u is the unaligned,
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
ORTKV_INLINE V16 ExpNonPositive(V16 x) {
  const V16 lo = V16{} - 87.0f, magic = V16{} + 12582912.0f;
  x = x < lo ? lo : x;
  const V16 t = x * 1.44269504088896341f;
  const V16 f = t + magic;
  const V16 r = t - (f - magic);
  V16 p = V16{} + 1.54035303933816e-4f;
  p = p * r + 1.33335581464284e-3f;
  p = p * r + 9.61812910762848e-3f;
  p = p * r + 5.55041086648216e-2f;
  p = p * r + 2.40226506959101e-1f;
  p = p * r + 6.93147180559945e-1f;
  p = p * r + 1.0f;
  const V16i bits = ((reinterpret_cast<const V16i&>(f) - reinterpret_cast<const V16i&>(magic)) + 127) << 23;
  return p * reinterpret_cast<const V16&>(bits);
}

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

// One block of n keys (rows k, v with stride ts) for all G heads, head size DV * 16.
template <int DV>
ORTKV_INLINE void BlockVec(const State& s, int64_t G, const float* k, const float* v, int64_t ts, int64_t n) {
  constexpr int D = DV * 16;
  for (int64_t g = 0; g < G; ++g) {  // scores: the head's query stays in registers, the block's keys in L1
    V16 qv[DV];
    for (int i = 0; i < DV; ++i) qv[i] = Load(s.qs + g * D + 16 * i);
    float* sc = s.sc + g * kAttnBlockKeys;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {  // Note [CacheAttention score transpose]
      V16 a[16];
      for (int x = 0; x < 16; ++x) {
        const float* kj = k + (j + x) * ts;
        a[x] = qv[0] * Load(kj);
        for (int i = 1; i < DV; ++i) a[x] += qv[i] * Load(kj + 16 * i);
      }
      Store(sc + j, Sum16(a));
    }
    for (; j < n; ++j) {
      const float* kj = k + j * ts;
      V16 a = qv[0] * Load(kj);
      for (int i = 1; i < DV; ++i) a += qv[i] * Load(kj + 16 * i);
      sc[j] = Sum(a);
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // weights, then acc += p_j v_j: the head's accumulator in registers
    const float alpha = Softmax(s, g, n);
    const float* p = s.sc + g * kAttnBlockKeys;
    V16 av[DV], bv[DV];  // two sets of accumulators: even and odd keys, two independent FMA chains
    for (int i = 0; i < DV; ++i) av[i] = Load(s.acc + g * D + 16 * i) * alpha, bv[i] = V16{};
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      const float* vj = v + j * ts;
      for (int i = 0; i < DV; ++i) {
        av[i] += p[j] * Load(vj + 16 * i);
        bv[i] += p[j + 1] * Load(vj + ts + 16 * i);
      }
    }
    if (j < n)
      for (int i = 0; i < DV; ++i) av[i] += p[j] * Load(v + j * ts + 16 * i);
    for (int i = 0; i < DV; ++i) Store(s.acc + g * D + 16 * i, av[i] + bv[i]);
  }
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

template <int DV>
ORTKV_INLINE void KeysVec(const State& s, int64_t G, const float* k, const float* v, int64_t ts, int64_t j0,
                          int64_t j1) {
  for (int64_t jb = j0; jb < j1; jb += kAttnBlockKeys)
    BlockVec<DV>(s, G, k + jb * ts, v + jb * ts, ts, std::min(kAttnBlockKeys, j1 - jb));
}

// One task (see CacheAttentionView): keys [j0, j1) of one unit, compiled for AVX-512, for AVX2 + FMA
// and for the baseline ISA; the loader picks the best the CPU has (GCC target_clones).
__attribute__((target_clones("avx512f", "arch=haswell", "default"))) void RunTask(const CacheAttentionView& a,
                                                                                  int64_t task, float* scratch) {
  const int64_t G = a.group(), D = a.D, S = a.splits;
  const int64_t unit = task / S, split = task % S;
  const int64_t t = unit % a.T;
  const int64_t hk = (unit / a.T) % a.Hkv;
  const int64_t b = unit / (a.T * a.Hkv);
  const int64_t L = a.start[b * a.start_stride] + t + 1;  // keys [0, start + t]
  const int64_t chunk = (L + S - 1) / S;
  const int64_t j0 = std::min(L, split * chunk), j1 = std::min(L, j0 + chunk);
  const float* k = a.k + b * a.row_stride + hk * a.head_stride;
  const float* v = a.v + b * a.row_stride + hk * a.head_stride;
  const float* q = a.q + (b * a.T + t) * a.Hq * D + hk * G * D;  // the group's G query heads
  float* qs = scratch + G * kAttnBlockKeys;
  // split > 1: acc, m and l are the task's partial (read by CacheAttentionCombine); else scratch
  float* acc = S > 1 ? a.partial + task * G * (D + 2) : qs + G * D;
  State s{qs, scratch, acc, acc + G * D, acc + G * D + G};
  for (int64_t i = 0; i < G * D; ++i) qs[i] = q[i] * a.scale;
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(s.m, s.m + G, -std::numeric_limits<float>::infinity());
  std::fill(s.l, s.l + G, 0.0f);
  const int64_t ts = a.tok_stride;
  switch (D) {
    case 16: KeysVec<1>(s, G, k, v, ts, j0, j1); break;
    case 32: KeysVec<2>(s, G, k, v, ts, j0, j1); break;
    case 48: KeysVec<3>(s, G, k, v, ts, j0, j1); break;
    case 64: KeysVec<4>(s, G, k, v, ts, j0, j1); break;
    case 80: KeysVec<5>(s, G, k, v, ts, j0, j1); break;
    case 96: KeysVec<6>(s, G, k, v, ts, j0, j1); break;
    case 128: KeysVec<8>(s, G, k, v, ts, j0, j1); break;
    case 256: KeysVec<16>(s, G, k, v, ts, j0, j1); break;
    default:
      for (int64_t jb = j0; jb < j1; jb += kAttnBlockKeys)
        BlockAny(s, G, D, k + jb * ts, v + jb * ts, ts, std::min(kAttnBlockKeys, j1 - jb));
  }
  if (S > 1) return;
  float* out = a.out + (b * a.T + t) * a.Hq * D + hk * G * D;
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / s.l[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
  }
}

}  // namespace

namespace {

// The shape facts both kernels need, after the checks that do not read `start`.
struct Shapes {
  int64_t B, T, Hkv, D, C, row_stride, tok_stride, head_stride, start_stride;
};

Status CheckShapes(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                   const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, int64_t seq_axis, Shapes* sh) {
  std::ostringstream m;
  if (q.dims.size() != 3 || k.dims.size() != 4 || v.dims != k.dims) {
    m << "expected query [B, T, Hq*D] and equal key/value caches of rank 4; got '" << q.name << "' rank "
      << q.dims.size() << ", '" << k.name << "' rank " << k.dims.size() << ", '" << v.name << "' rank " << v.dims.size()
      << (v.dims != k.dims && v.dims.size() == k.dims.size() ? " (key and value shapes differ)" : "");
    return Bad(node, m.str());
  }
  if (num_heads <= 0 || kv_num_heads <= 0 || num_heads % kv_num_heads != 0 || num_heads / kv_num_heads > 64) {
    m << "num_heads " << num_heads << " must be a positive multiple of kv_num_heads " << kv_num_heads
      << " (at most 64 query heads per KV head)";
    return Bad(node, m.str());
  }
  // Note [CacheAttention SBNH]: seq_axis 0 is [capacity, batch, kv_heads, head_size], token-major.
  const bool bsnh = seq_axis == 1, sbnh = seq_axis == 0;
  if (!bsnh && !sbnh && seq_axis != 2 && seq_axis != -2) {
    m << "seq_axis " << seq_axis << " must be 1 (BSNH), 2 / -2 (BNSH) or 0 (SBNH)";
    return Bad(node, m.str());
  }
  const int64_t B = q.dims[0], T = q.dims[1];
  const int64_t kB = sbnh ? k.dims[1] : k.dims[0];
  const int64_t C = bsnh ? k.dims[1] : sbnh ? k.dims[0] : k.dims[2];
  const int64_t Hkv = bsnh || sbnh ? k.dims[2] : k.dims[1];
  const int64_t D = k.dims[3];
  if (kB != B || Hkv != kv_num_heads || q.dims[2] != num_heads * D) {
    m << "'" << q.name << "' is [" << B << ", " << T << ", " << q.dims[2] << "] but the cache '" << k.name
      << "' holds batch " << kB << ", " << Hkv << " KV heads of size " << D << "; expected batch " << B
      << ", kv_num_heads " << kv_num_heads << " and a query width of num_heads * D = " << num_heads * D;
    return Bad(node, m.str());
  }
  if (T > C) {
    m << "'" << q.name << "' holds " << T << " query tokens but the cache '" << k.name << "' has capacity " << C
      << "; a block of new tokens must fit in the cache";
    return Status(Code::kCapacity, "CacheAttention node '" + node + "': " + m.str());
  }
  if (start.elem_type != kInt64 || start.dims.size() > 1 || (start.dims.size() == 1 && start.dims[0] != B)) {
    m << "'" << start.name << "' must be an int64 scalar or a vector of " << B << " start positions";
    return Bad(node, m.str());
  }
  sh->B = B;
  sh->T = T;
  sh->Hkv = Hkv;
  sh->D = D;
  sh->C = C;
  sh->start_stride = start.dims.size() == 1 ? 1 : 0;
  sh->row_stride = sbnh ? Hkv * D : C * Hkv * D;
  sh->tok_stride = bsnh ? Hkv * D : sbnh ? B * Hkv * D : D;
  sh->head_stride = bsnh || sbnh ? D : C * D;
  return Status::Ok();
}

}  // namespace

Status PlanCacheAttention(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                          const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, float scale,
                          int64_t seq_axis, float* out, CacheAttentionView* view) {
  std::ostringstream m;
  if (q.elem_type != kFloat32 || k.elem_type != kFloat32 || v.elem_type != kFloat32) {
    m << "query, key and value must be float32 on the CPU (got " << ElemTypeName(q.elem_type) << ", "
      << ElemTypeName(k.elem_type) << ", " << ElemTypeName(v.elem_type) << ")";
    return Bad(node, m.str());
  }
  Shapes sh;
  ORTKV_RETURN_IF_ERR(CheckShapes(node, q, k, v, start, num_heads, kv_num_heads, seq_axis, &sh));
  const int64_t B = sh.B, T = sh.T, C = sh.C, D = sh.D, stride = sh.start_stride;
  const int64_t* s = static_cast<const int64_t*>(start.data);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = s[b * stride];
    if (p < 0 || p > C - T) {
      m << "CacheAttention node '" << node << "': row " << b << ": position " << p << " + n " << T << " = "
        << p + T << " exceeds capacity " << C << " of '" << k.name << "'";
      if (p < 0) return Bad(node, "start " + std::to_string(p) + " for row " + std::to_string(b) + " is negative");
      return Status(Code::kCapacity, m.str());
    }
    max_keys = std::max(max_keys, p + T);
  }
  view->q = static_cast<const float*>(q.data);
  view->k = static_cast<const float*>(k.data);
  view->v = static_cast<const float*>(v.data);
  view->out = out;
  view->start = s;
  view->start_stride = stride;
  view->B = B;
  view->T = T;
  view->Hq = num_heads;
  view->Hkv = sh.Hkv;
  view->D = D;
  view->C = C;
  view->row_stride = sh.row_stride;
  view->tok_stride = sh.tok_stride;
  view->head_stride = sh.head_stride;
  view->scale = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(D));
  // Note [CacheAttention CPU split-K]: split the keys only while units are too few to fill the
  // threads, and never into chunks shorter than kAttnMinSplitKeys (the longest row decides).
  const int64_t units = view->units();
  view->splits = 1;
  if (units > 0 && units < kAttnTargetTasks)
    view->splits = std::max<int64_t>(1, std::min((kAttnTargetTasks + units - 1) / units, max_keys / kAttnMinSplitKeys));
  view->partial = nullptr;
  return Status::Ok();
}

Status PlanCacheAttentionCuda(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                              const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, float scale,
                              int64_t seq_axis, void* out, int sm_count, CacheAttentionCudaView* view) {
  std::ostringstream m;
  const size_t es = ElemSize(q.elem_type);
  if (es == 0 || k.elem_type != q.elem_type || v.elem_type != q.elem_type) {
    m << "query, key and value must share one of float32, float16, bfloat16 (got " << ElemTypeName(q.elem_type)
      << ", " << ElemTypeName(k.elem_type) << ", " << ElemTypeName(v.elem_type) << ")";
    return Bad(node, m.str());
  }
  Shapes sh;
  ORTKV_RETURN_IF_ERR(CheckShapes(node, q, k, v, start, num_heads, kv_num_heads, seq_axis, &sh));
  if (sh.D > kAttnCudaMaxHeadSize) {
    m << "head size " << sh.D << " of '" << k.name << "' is larger than the CUDA kernel's " << kAttnCudaMaxHeadSize
      << "; run this node on the CPU provider (float32) or use heads of at most " << kAttnCudaMaxHeadSize;
    return Bad(node, m.str());
  }
  view->q = q.data;
  view->k = k.data;
  view->v = v.data;
  view->out = out;
  view->start = static_cast<const int64_t*>(start.data);
  view->start_stride = sh.start_stride;
  view->elem_type = q.elem_type;
  view->B = sh.B;
  view->T = sh.T;
  view->Hq = num_heads;
  view->Hkv = sh.Hkv;
  view->D = sh.D;
  view->C = sh.C;
  view->row_stride = sh.row_stride;
  view->tok_stride = sh.tok_stride;
  view->head_stride = sh.head_stride;
  view->scale = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(sh.D));
  const uintptr_t align = reinterpret_cast<uintptr_t>(q.data) | reinterpret_cast<uintptr_t>(k.data) |
                          reinterpret_cast<uintptr_t>(v.data) | static_cast<uintptr_t>(sh.D * es) |
                          static_cast<uintptr_t>(sh.tok_stride * es) | static_cast<uintptr_t>(sh.head_stride * es) |
                          static_cast<uintptr_t>(sh.row_stride * es);
  view->vec = align % 16 == 0;
  // Note [CacheAttention CUDA]: split along the keys until there are ~4 blocks per SM, from the capacity.
  const int64_t head_blocks = (view->group() + kAttnCudaHeads - 1) / kAttnCudaHeads;
  const int64_t blocks = view->units() * head_blocks;
  const int64_t target = 4 * static_cast<int64_t>(std::max(sm_count, 1));
  view->splits = 1;
  if (blocks > 0 && blocks < target) {
    const int64_t by_keys = std::max<int64_t>(1, sh.C / kAttnCudaMinChunk);
    view->splits = std::min<int64_t>({(target + blocks - 1) / blocks, by_keys, kAttnCudaMaxSplits});
  }
  view->partial = nullptr;
  return Status::Ok();
}

void CacheAttentionCpu(const CacheAttentionView& a, int64_t begin, int64_t end, float* scratch) {
  for (int64_t task = begin; task < end; ++task) RunTask(a, task, scratch);
}

void CacheAttentionCombine(const CacheAttentionView& a) {
  const int64_t S = a.splits, G = a.group(), D = a.D, P = G * (D + 2);
  if (S <= 1) return;
  for (int64_t unit = 0; unit < a.units(); ++unit) {
    const int64_t t = unit % a.T, hk = (unit / a.T) % a.Hkv, b = unit / (a.T * a.Hkv);
    const float* part = a.partial + unit * S * P;  // tasks unit * S ... unit * S + S - 1
    float* out = a.out + (b * a.T + t) * a.Hq * D + hk * G * D;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < S; ++c) mx = std::max(mx, part[c * P + G * D + g]);  // chunk 0 is never empty
      float den = 0;
      float* og = out + g * D;
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
  }
}

}  // namespace ortkv
