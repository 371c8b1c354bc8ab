// CUDA CacheAttention: Note [CacheAttention] and Note [CacheAttention CUDA] in ortkv/cache_attention.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "ortkv/cache_attention.h"
#include "ortkv/core.h"
#include "device_common.cuh"
#include "tile_mma.cuh"

namespace ortkv {
namespace {

constexpr int kWarps = 4;          // 128 threads per block
constexpr int kThreads = kWarps * 32;
constexpr int kEPT = 8;            // elements of a key row per thread
constexpr int kUnroll = 4;         // keys in flight per key group

// 8 elements of T as raw 16-byte words: one for 2-byte types, two for float32.
template <typename T>
struct Raw {
  static constexpr int kWords = sizeof(T) * kEPT / 16;
  uint4 w[kWords];
};

// Loads elements [d0, d0 + 8) of a row (zeros past D). VEC: one or two aligned 16-byte loads.
template <typename T, bool VEC>
__device__ __forceinline__ Raw<T> LoadRow(const T* row, int d0, int D) {
  Raw<T> r;
  if (VEC) {
    if (d0 < D) {
      const uint4* p = reinterpret_cast<const uint4*>(row + d0);
#pragma unroll
      for (int i = 0; i < Raw<T>::kWords; ++i) r.w[i] = __ldg(p + i);
    } else {
#pragma unroll
      for (int i = 0; i < Raw<T>::kWords; ++i) r.w[i] = make_uint4(0, 0, 0, 0);
    }
  } else {
    T* e = reinterpret_cast<T*>(r.w);
#pragma unroll
    for (int i = 0; i < kEPT; ++i) e[i] = d0 + i < D ? row[d0 + i] : FromF<T>(0.0f);
  }
  return r;
}

template <typename T>
__device__ __forceinline__ void ToFloats(const Raw<T>& r, float* f) {
  const T* e = reinterpret_cast<const T*>(r.w);
#pragma unroll
  for (int i = 0; i < kEPT; ++i) f[i] = ToF(e[i]);
}

struct Args {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int64_t* start;
  int64_t start_stride;
  int64_t B, T, Hq, Hkv, D, C, row_stride, tok_stride, head_stride;
  float scale;
  int64_t splits, head_blocks;
  float* partial;
  ortkv_device_error* err;
  int32_t label;
  int tpk;  // threads per key row: a power of two >= D / 8, <= 32
};

// Block 0's thread 0: the first row with a bad start, if any (Note [CUDA deferred errors]: one
// reporter per launch, into the CacheAttention word).
__device__ void ReportStart(const Args& a) {
  if (a.err == nullptr) return;
  int64_t row = 0, start = 0;
  int code = 0;
  for (; row < a.B; ++row) {
    start = a.start[row * a.start_stride];
    if (start < 0 || start > a.C - a.T) {
      code = start < 0 ? ORTKV_DERR_NEGATIVE : ORTKV_DERR_CAPACITY;
      break;
    }
  }
  if (code == 0) return;
  a.err->label = a.label;
  a.err->row = static_cast<int32_t>(row);
  a.err->position = start;
  a.err->n = a.T;
  a.err->capacity = a.C;
  __threadfence_system();
  *reinterpret_cast<volatile int32_t*>(&a.err->code) = code;
}

// One block: unit (b, hk, t), head block hb (query heads hb * GM ...), key chunk `split`.
template <typename T, bool VEC, int GM>
__global__ void __launch_bounds__(kThreads) AttentionKernel(const Args a) {
  __shared__ float s_m[kWarps][GM];
  __shared__ float s_l[kWarps][GM];
  __shared__ float s_acc[kWarps][GM][kAttnCudaMaxHeadSize];

  const int64_t S = a.splits;
  int64_t blk = blockIdx.x;
  const int64_t split = blk % S;
  blk /= S;
  const int64_t hb = blk % a.head_blocks;
  const int64_t unit = blk / a.head_blocks;
  const int64_t t = unit % a.T;
  const int64_t hk = (unit / a.T) % a.Hkv;
  const int64_t b = unit / (a.T * a.Hkv);
  const int64_t G = a.Hq / a.Hkv;
  const int64_t g0 = hb * GM;
  const int gn = static_cast<int>(G - g0 < GM ? G - g0 : GM);
  const int D = static_cast<int>(a.D);

  // start on the device, clamped (Note [CacheAttention CUDA]); one block per row reports it
  if (blockIdx.x == 0 && threadIdx.x == 0) ReportStart(a);
  int64_t st = a.start[b * a.start_stride];
  const int64_t hi = a.C - a.T;
  if (st < 0 || st > hi) st = st < 0 ? 0 : hi;
  const int64_t L = st + t + 1;  // keys [0, L)
  int64_t chunk = (L + S - 1) / S;  // SplitKeys<1>'s rule, written out (its SASS, device_common.cuh)
  if (chunk < kAttnCudaClusterChunk) chunk = kAttnCudaClusterChunk;
  const int64_t j0 = split * chunk < L ? split * chunk : L;
  const int64_t j1 = j0 + chunk < L ? j0 + chunk : L;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tpk = a.tpk;
  const int sub = lane & (tpk - 1);
  const int kg = tid / tpk;                  // key group in the block
  const int nkg = kThreads / tpk;            // key groups per block
  const int d0 = sub * kEPT;

  // the group's query heads, pre-scaled, in registers
  const T* qp = static_cast<const T*>(a.q) + ((b * a.T + t) * a.Hq + hk * G + g0) * a.D;
  float qf[GM][kEPT];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g < gn) {
      Raw<T> r = LoadRow<T, VEC>(qp + g * a.D, d0, D);
      ToFloats<T>(r, qf[g]);
#pragma unroll
      for (int i = 0; i < kEPT; ++i) qf[g][i] *= a.scale;
    } else {
#pragma unroll
      for (int i = 0; i < kEPT; ++i) qf[g][i] = 0.0f;
    }
  }
  float m[GM], l[GM], acc[GM][kEPT];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kEPT; ++i) acc[g][i] = 0.0f;
  }

  const T* kbase = static_cast<const T*>(a.k) + b * a.row_stride + hk * a.head_stride;
  const T* vbase = static_cast<const T*>(a.v) + b * a.row_stride + hk * a.head_stride;
  // every thread runs the same iterations (the shuffles below need the whole warp); invalid keys
  // are neither loaded nor counted
  for (int64_t base = j0; base < j1; base += static_cast<int64_t>(nkg) * kUnroll) {
    Raw<T> kr[kUnroll], vr[kUnroll];
    bool ok[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + static_cast<int64_t>(u) * nkg + kg;
      ok[u] = j < j1;
      if (ok[u]) {
        kr[u] = LoadRow<T, VEC>(kbase + j * a.tok_stride, d0, D);
        vr[u] = LoadRow<T, VEC>(vbase + j * a.tok_stride, d0, D);
      }
    }
    // scores of the kUnroll keys for every head (the shuffles need the whole warp: keys past j1 score 0
    // and are masked below), then one online-softmax step per head for the kUnroll keys together: one
    // rescale of (l, acc) and kUnroll + 1 exponentials per head, not 2 per key
    float sc[GM][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[kEPT];
      if (ok[u]) {
        ToFloats<T>(kr[u], kf);
      } else {
#pragma unroll
        for (int i = 0; i < kEPT; ++i) kf[i] = 0.0f;
      }
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kEPT; ++i) s = fmaf(qf[g][i], kf[i], s);
        for (int off = tpk >> 1; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        sc[g][u] = ok[u] ? s : -INFINITY;
      }
    }
    if (!ok[0]) continue;  // no key of this group in this iteration (ok[u] implies ok[0])
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      float mb = sc[g][0];
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) mb = fmaxf(mb, sc[g][u]);
      const float mn = fmaxf(m[g], mb);
      const float corr = __expf(m[g] - mn);  // 0 on the first keys (m = -inf, mn finite)
      l[g] *= corr;
#pragma unroll
      for (int i = 0; i < kEPT; ++i) acc[g][i] *= corr;
      m[g] = mn;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) sc[g][u] = __expf(sc[g][u] - mn);  // 0 for a masked key
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!ok[u]) break;
      float vf[kEPT];
      ToFloats<T>(vr[u], vf);
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float p = sc[g][u];
        l[g] += p;
#pragma unroll
        for (int i = 0; i < kEPT; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
      }
    }
  }

  // merge the key groups: max over the groups, then rescaled sums (lanes xor >= tpk: other groups
  // of the warp with the same `sub`), then across warps through shared memory
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mw = m[g];
    for (int off = 16; off >= tpk; off >>= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, off));
    if (lane == 0) s_m[warp][g] = mw;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mb = s_m[0][g];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mb = fmaxf(mb, s_m[w][g]);
    const float f = m[g] == -INFINITY ? 0.0f : __expf(m[g] - mb);
    float lw = l[g] * f;
    float aw[kEPT];
#pragma unroll
    for (int i = 0; i < kEPT; ++i) aw[i] = acc[g][i] * f;
    for (int off = 16; off >= tpk; off >>= 1) {
      lw += __shfl_xor_sync(0xffffffffu, lw, off);
#pragma unroll
      for (int i = 0; i < kEPT; ++i) aw[i] += __shfl_xor_sync(0xffffffffu, aw[i], off);
    }
    if (lane < tpk) {
#pragma unroll
      for (int i = 0; i < kEPT; ++i)
        if (d0 + i < D) s_acc[warp][g][d0 + i] = aw[i];
      if (lane == 0) s_l[warp][g] = lw;
    }
    m[g] = mb;  // the block's max (also on threads of groups that saw no key)
  }
  __syncthreads();
  // write: thread x of the block handles (head g, dim d) pairs
  for (int x = tid; x < gn * D; x += kThreads) {
    const int g = x / D, d = x % D;
    float lb = 0.0f, ab = 0.0f, mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      lb += s_l[w][g];
      ab += s_acc[w][g][d];
    }
    for (int w = 0; w < kWarps; ++w) mb = fmaxf(mb, s_m[w][g]);
    const int64_t head = hk * G + g0 + g;
    if (S == 1) {
      T* o = static_cast<T*>(a.out) + ((b * a.T + t) * a.Hq + head) * a.D;
      o[d] = FromF<T>(ab / lb);
    } else {
      float* p = a.partial + ((unit * G + g0 + g) * S + split) * (a.D + 2);
      p[d] = ab;
      if (d == 0) {
        p[a.D] = mb;
        p[a.D + 1] = lb;
      }
    }
  }
}

// One block per (unit, query head): merges the S chunks' (acc, m, l) into the output. LOG2: the
// partials' m is in base 2 (the v2 kernel's scores carry log2(e), Note [CacheAttention CUDA v2]).
template <typename T, bool LOG2>
__global__ void __launch_bounds__(kMergeThreads) CombineKernel(const Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // launched as a programmatic dependent of the v2 / v3 attention (Note [CacheAttention CUDA v2 waves]):
  // wait for that grid to complete and its partials to be visible (a no-op for a plain launch)
  asm volatile("griddepcontrol.launch_dependents;" :::);  // a programmatic dependent may start (it waits)
  if (LOG2) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  CombineUnitHead<T, LOG2>(a.partial, a.out, a.splits, a.T, a.Hq, a.Hkv, a.D);
}

// Note [CacheAttention CUDA v2]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The decode kernel for float16 / bfloat16 caches with 16-byte aligned rows (view.vec), head size
// <= 256: the default; ORTKV_CUDA_ATTENTION=v1 selects the first kernel (AttentionKernel above) for
// A/B runs, and float32 or unaligned caches always take it. Same units, head blocks, split chunks,
// workspace layout and clamping as Note [CacheAttention CUDA] (the plan is shared); what changes is
// how a block streams its chunk, because decode must keep HBM busy and the first kernel did not: it
// loaded 4 keys, waited for them, computed, and only then loaded the next 4, so a warp had nothing in
// flight while it computed, and half of the device's bandwidth went unused (1.5 TB/s at 8K x 8).
//   * Each thread copies its own 16-byte pieces of K and V (8 elements of one key row, TPK threads
//     per row as before, 4 keys per thread per stage) with cp.async into a PRIVATE slot of a
//     3-stage shared-memory ring ([stage][key][K|V][thread], so a warp's slots are contiguous: no
//     bank conflicts). It reads back only what it copied itself, so cp.async.wait_group alone orders
//     copy and use: no __syncthreads in the loop. While stage i is computed, stages i+1 and i+2 are
//     in flight (32 KiB per block, ~4 blocks per SM by shared memory: 128 KiB in flight per SM).
//   * The slot refilled in iteration i is the one consumed in iteration i-1 (its values were used
//     by then), never the one being read.
//   * Scores are in base 2: q is pre-scaled by scale * log2(e), so each weight is one ex2.approx.
//     The partials' m is in base 2 too, hence CombineKernel<T, true>.
//   * The online softmax rescales (l, acc) only when a head's running max grows: after the first
//     keys of a chunk it rarely does, and a warp where no thread needs it skips the 9 multiplies per
//     head (exact: m is always the max of the scores seen).
// The ring is reused for the end-of-block merge (after wait_group 0 and a barrier), so the block
// stays within 48 KiB of static shared memory.
namespace v2 {

constexpr int kU = 4;       // keys per thread (key group) per stage
constexpr int kStages = 3;  // ring depth: kStages - 1 stages in flight while one is computed
constexpr int kSlotWords = kU * 2 * kThreads;  // uint4 words per stage
constexpr int kRingBytes = kStages * kSlotWords * 16;

template <int GM>
using Merge = WarpMerge<kWarps, GM>;
static_assert(sizeof(Merge<kAttnCudaHeads>) <= kRingBytes, "the merge arrays must fit in the ring");
static_assert(kRingBytes <= 48 * 1024, "static shared memory limit");

__device__ __forceinline__ void Unpack8(const uint4& w, float* f, const __half*) {
  const __half2* h = reinterpret_cast<const __half2*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void Unpack8(const uint4& w, float* f, const __nv_bfloat16*) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// One block: unit (b, hk, t), head block hb, key chunk `split` (as AttentionKernel). T is __half or
// __nv_bfloat16; TPK (threads per key row) is 8, 16 or 32 with TPK * 8 >= D; rows are 16-byte aligned.
template <typename T, int TPK, int GM>
__global__ void __launch_bounds__(kThreads) AttentionKernelV2(const Args a) {
  __shared__ __align__(16) unsigned char smem[kRingBytes];
  uint4* ring = reinterpret_cast<uint4*>(smem);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);  // the combine may be scheduled (it waits)
#endif
  constexpr int kNkg = kThreads / TPK;  // key groups per block
  constexpr int64_t kPerIt = static_cast<int64_t>(kNkg) * kU;  // keys per iteration

  const int64_t S = a.splits;
  int64_t blk = blockIdx.x;
  const int64_t split = blk % S;
  blk /= S;
  const int64_t hb = blk % a.head_blocks;
  const int64_t unit = blk / a.head_blocks;
  const int64_t t = unit % a.T;
  const int64_t hk = (unit / a.T) % a.Hkv;
  const int64_t b = unit / (a.T * a.Hkv);
  const int64_t G = a.Hq / a.Hkv;
  const int64_t g0 = hb * GM;
  const int gn = static_cast<int>(G - g0 < GM ? G - g0 : GM);
  const int D = static_cast<int>(a.D);

  if (blockIdx.x == 0 && threadIdx.x == 0) ReportStart(a);
  int64_t st = a.start[b * a.start_stride];
  const int64_t hi = a.C - a.T;
  if (st < 0 || st > hi) st = st < 0 ? 0 : hi;
  const int64_t L = st + t + 1;  // keys [0, L)
  int64_t j0, j1;
  SplitKeys<1>(L, S, split, &j0, &j1);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane & (TPK - 1);
  const int kg = tid / TPK;
  const int d0 = sub * kEPT;
  const bool dv = d0 < D;  // this thread holds real elements of a row (D < TPK * 8 leaves some idle)

  // the group's query heads in registers, pre-scaled into base 2
  const float qscale = a.scale * 1.4426950408889634f;
  const T* qp = static_cast<const T*>(a.q) + ((b * a.T + t) * a.Hq + hk * G + g0) * a.D;
  float qf[GM][kEPT];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g < gn) {
      Raw<T> r = LoadRow<T, true>(qp + g * a.D, d0, D);
      ToFloats<T>(r, qf[g]);
#pragma unroll
      for (int i = 0; i < kEPT; ++i) qf[g][i] *= qscale;
    } else {
#pragma unroll
      for (int i = 0; i < kEPT; ++i) qf[g][i] = 0.0f;
    }
  }
  float m[GM], l[GM], acc[GM][kEPT];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kEPT; ++i) acc[g][i] = 0.0f;
  }

  // the next stage to copy: its first key (u = 0) and that key's K / V pieces; stages are copied in
  // order, so these pointers just advance (no 64-bit multiply per key)
  const int64_t ts = a.tok_stride;
  int64_t jn = j0 + kg;
  const T* kn = static_cast<const T*>(a.k) + b * a.row_stride + hk * a.head_stride + d0 + jn * ts;
  const T* vn = static_cast<const T*>(a.v) + b * a.row_stride + hk * a.head_stride + d0 + jn * ts;
  const int64_t n_it = (j1 - j0 + kPerIt - 1) / kPerIt;  // the same for every thread of the block
  int stage_in = 0;  // ring slot of the next stage to copy
  // copies the next stage: keys jn + u * kNkg, u < kU, those < j1 (none once past the chunk)
  auto issue = [&]() {
    if (dv) {
      uint4* slot = ring + stage_in * kSlotWords + tid;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (jn + u * kNkg < j1) {
          CpAsync<16>(slot + (2 * u) * kThreads, kn + u * kNkg * ts);
          CpAsync<16>(slot + (2 * u + 1) * kThreads, vn + u * kNkg * ts);
        }
      }
    }
    CpAsyncCommit();  // one group per stage, empty ones included: the wait below counts groups
    jn += kPerIt;
    kn += kPerIt * ts;
    vn += kPerIt * ts;
    stage_in = stage_in + 1 == kStages ? 0 : stage_in + 1;
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue();

  int64_t jc = j0 + kg;  // the first key (u = 0) of the stage being computed
  int stage = 0;
  for (int64_t it = 0; it < n_it; ++it, jc += kPerIt, stage = stage + 1 == kStages ? 0 : stage + 1) {
    CpAsyncWait<kStages - 2>();  // stages 0..it have landed (it + kStages - 1 groups were committed)
    issue();                     // refills the slot consumed in iteration it - 1
    const uint4* slot = ring + stage * kSlotWords + tid;
    bool ok[kU];
    float sc[GM][kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      ok[u] = jc + u * kNkg < j1;
      float kf[kEPT];
      if (ok[u] && dv) {
        Unpack8(slot[(2 * u) * kThreads], kf, static_cast<const T*>(nullptr));
      } else {
#pragma unroll
        for (int i = 0; i < kEPT; ++i) kf[i] = 0.0f;
      }
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kEPT; ++i) s = fmaf(qf[g][i], kf[i], s);
#pragma unroll
        for (int off = TPK >> 1; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        sc[g][u] = ok[u] ? s : -INFINITY;
      }
    }
    if (!ok[0]) continue;  // no key of this group in this iteration (ok[u] implies ok[0])
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      float mb = sc[g][0];
#pragma unroll
      for (int u = 1; u < kU; ++u) mb = fmaxf(mb, sc[g][u]);
      if (mb > m[g]) {  // the running max grows: rescale (0 on the first keys: m = -inf)
        const float corr = Exp2(m[g] - mb);
        l[g] *= corr;
#pragma unroll
        for (int i = 0; i < kEPT; ++i) acc[g][i] *= corr;
        m[g] = mb;
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) sc[g][u] = Exp2(sc[g][u] - m[g]);  // 0 for a masked key
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (!ok[u]) break;
      float vf[kEPT];
      if (dv) {
        Unpack8(slot[(2 * u + 1) * kThreads], vf, static_cast<const T*>(nullptr));
      } else {
#pragma unroll
        for (int i = 0; i < kEPT; ++i) vf[i] = 0.0f;
      }
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float p = sc[g][u];
        l[g] += p;
#pragma unroll
        for (int i = 0; i < kEPT; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
      }
    }
  }
  CpAsyncWait<0>();  // only empty groups can be left; the ring becomes the merge arrays below
  __syncthreads();
  Merge<GM>& mg = *reinterpret_cast<Merge<GM>*>(smem);

  // merge the key groups as AttentionKernel does, in base 2
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mw = m[g];
#pragma unroll
    for (int off = 16; off >= TPK; off >>= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, off));
    if (lane == 0) mg.m[warp][g] = mw;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mb = mg.m[0][g];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mb = fmaxf(mb, mg.m[w][g]);
    const float f = m[g] == -INFINITY ? 0.0f : Exp2(m[g] - mb);
    float lw = l[g] * f;
    float aw[kEPT];
#pragma unroll
    for (int i = 0; i < kEPT; ++i) aw[i] = acc[g][i] * f;
#pragma unroll
    for (int off = 16; off >= TPK; off >>= 1) {
      lw += __shfl_xor_sync(0xffffffffu, lw, off);
#pragma unroll
      for (int i = 0; i < kEPT; ++i) aw[i] += __shfl_xor_sync(0xffffffffu, aw[i], off);
    }
    if (lane < TPK) {
#pragma unroll
      for (int i = 0; i < kEPT; ++i)
        if (d0 + i < D) mg.acc[warp][g][d0 + i] = aw[i];
      if (lane == 0) mg.l[warp][g] = lw;
    }
  }
  __syncthreads();
  for (int x = tid; x < gn * D; x += kThreads) {
    const int g = x / D, d = x % D;
    float lb = 0.0f, ab = 0.0f, mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      lb += mg.l[w][g];
      ab += mg.acc[w][g][d];
      mb = fmaxf(mb, mg.m[w][g]);
    }
    const int64_t head = hk * G + g0 + g;
    if (S == 1) {
      T* o = static_cast<T*>(a.out) + ((b * a.T + t) * a.Hq + head) * a.D;
      o[d] = FromF<T>(ab / lb);
    } else {
      float* p = a.partial + ((unit * G + g0 + g) * S + split) * (a.D + 2);
      p[d] = ab;
      if (d == 0) {
        p[a.D] = mb;
        p[a.D + 1] = lb;
      }
    }
  }
}

// The current device's SM count and compute capability major (cached per device; 0 if a query fails).
struct DeviceInfo {
  int sms = 0, major = 0;
};
DeviceInfo CurrentDevice() {
  static std::atomic<int> sms[64], majors[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  DeviceInfo d;
  if (dev >= 0 && dev < 64 && (d.sms = sms[dev].load(std::memory_order_relaxed)) != 0) {
    d.major = majors[dev].load(std::memory_order_relaxed);
    return d;
  }
  d.sms = CudaSmCount(dev);
  if (cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    d.major = 0;
  }
  if (dev >= 0 && dev < 64) {
    majors[dev].store(d.major, std::memory_order_relaxed);
    sms[dev].store(d.sms, std::memory_order_relaxed);
  }
  return d;
}

// Note [CacheAttention CUDA v2 waves]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The plan's split count S aims at ~4 blocks per SM, rounding up: at 32/8/128 x 8K x batch 8 that is
// 64 units x 9 = 576 blocks where 528 fit at once, and the last 48 then run alone, half of the time
// at a fraction of the bandwidth. v2 takes the largest S' <= S that still fits in ONE wave: S' =
// max(1, min(S, resident / base)), where base = units x head blocks and resident = blocks per SM
// (from the occupancy calculator, for this kernel) x SMs. The workspace for S covers S' (the partial
// index uses S'), S' does not depend on `start` (graph-stable), and with S' = 1 the block writes the
// output itself (no combine launch).
// On sm_90+ the combine is launched as a programmatic dependent (PDL): every attention block
// triggers at its start, so the combine grid is scheduled while the attention runs and its blocks
// wait in griddepcontrol.wait until the attention grid has completed with its partials visible;
// the launch gap between the two kernels is hidden. Such launches are captured into CUDA graphs as
// programmatic edges. If the launch is refused, it falls back to a plain launch.
int64_t WaveSplits(int64_t planned, int64_t base, int per_sm) {
  if (planned <= 1 || base <= 0) return 1;
  const int64_t resident = static_cast<int64_t>(per_sm) * CurrentDevice().sms;
  if (resident <= 0) return planned;
  return std::max<int64_t>(1, std::min<int64_t>(planned, resident / base));
}

// 48 KiB of shared memory per block: ask for the largest shared-memory carveout once per kernel, so
// that the SM's L1/shared split leaves room for 4 blocks (cp.async.cg bypasses L1 anyway), then ask
// the occupancy calculator how many blocks fit per SM. Both are hints: a failure is cleared and the
// launch goes on (neither is a stream operation, so both are allowed while ORT captures a graph).
template <typename T, int TPK, int GM>
cudaError_t LaunchOne(const CacheAttentionCudaView& v, Args a, cudaStream_t stream) {
  static const int per_sm = [] {
    if (cudaFuncSetAttribute(AttentionKernelV2<T, TPK, GM>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, AttentionKernelV2<T, TPK, GM>, kThreads, 0) !=
            cudaSuccess ||
        n < 1) {
      (void)cudaGetLastError();
      n = 4;  // the plan's own assumption
    }
    return n;
  }();
  const int64_t base = v.units() * a.head_blocks;
  a.splits = WaveSplits(v.splits, base, per_sm);  // Note [CacheAttention CUDA v2 waves]
  AttentionKernelV2<T, TPK, GM><<<static_cast<unsigned>(base * a.splits), kThreads, 0, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || a.splits == 1) return e;
  const int threads = CombineThreads(a.splits, v.D);  // Note [Combine in one load round]
  const unsigned combine_blocks = static_cast<unsigned>(v.units() * v.group());
  if (CurrentDevice().major >= 9 && LaunchProgrammatic(CombineKernel<T, true>, combine_blocks, threads, 0, stream, a))
    return cudaSuccess;
  CombineKernel<T, true><<<combine_blocks, threads, 0, stream>>>(a);  // refused or before sm_90: a plain launch
  return cudaGetLastError();
}

template <typename T, int TPK>
cudaError_t LaunchTpk(const CacheAttentionCudaView& v, const Args& a, int gm, cudaStream_t stream) {
  switch (gm) {
    case 1: return LaunchOne<T, TPK, 1>(v, a, stream);
    case 2: return LaunchOne<T, TPK, 2>(v, a, stream);
    case 3: return LaunchOne<T, TPK, 3>(v, a, stream);
    case 4: return LaunchOne<T, TPK, 4>(v, a, stream);
    default: return LaunchOne<T, TPK, 8>(v, a, stream);
  }
}

// The attention and, when it splits the keys, the base-2 combine.
template <typename T>
cudaError_t Launch(const CacheAttentionCudaView& v, const Args& a, int gm, cudaStream_t stream) {
  if (v.D <= 64) return LaunchTpk<T, 8>(v, a, gm, stream);
  if (v.D <= 128) return LaunchTpk<T, 16>(v, a, gm, stream);
  return LaunchTpk<T, 32>(v, a, gm, stream);
}

}  // namespace v2


// Note [CacheAttention CUDA v3]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The decode kernel for float16 / bfloat16 caches with head size 64 or 128 and 16-byte aligned rows: the
// default (ORTKV_CUDA_ATTENTION=v2 / v1 select the older kernels for A/B runs). v2 (above) keeps HBM busy
// but spends ~24 warp instructions per key row on FP32 dot products, shuffles and value sums; at 8K keys x
// batch 8 of SmolLM2's heads that made it 1.4x slower than a kernel that only reads the same bytes, and its
// combine (one thread per output element looping over the splits' partials, a load latency each) added
// ~6 us per node on the H200. v3 takes Note [Paged CUDA v3]'s tensor-core tile (kernels/cuda/tile_mma.cuh)
// for a dense cache:
//   * A block is one unit (b, hk, t), up to 8 of its query heads and one key chunk (a multiple of 16 keys);
//     its warps take the chunk's 16-key tiles in turn (warp w: tiles w, w + NW, ...), each through its own
//     ST-deep cp.async ring of swizzled 16-bit K / V tiles: no block barrier inside the key loop.
//   * S = Q K^T and P V on mma.sync m16n8k16 (FP32 accumulators, Q and P rounded to the cache's 16-bit
//     type), online softmax in base 2, as the paged kernel; the keys of a tile past the chunk score -inf
//     and their value rows are zeroed (never copied: nothing past a row's length is read).
//   * The q fragments and `start` are loaded together, before the first copies (one latency, not two).
//   * With 2..8 splits and at most one block per SM (sm_90+; a decode step's short rows: 128 keys x 1 row
//     5.6 us vs 6.4 with the combine) the unit's split blocks are launched as one thread-block cluster: each
//     block leaves its merged (m, l, acc) in shared memory, cluster rank 0 reads them through distributed
//     shared memory and writes the output, so there is no partial workspace traffic and no second launch.
//     Only then: capping larger split counts at 8 costs more blocks than the merge saves (8K keys x 1 row:
//     13.2 us clustered at 8 splits vs 8.4 us unclustered at 132), clusters of 16 schedule badly, and a
//     grid that fills the SMs with clusters of big blocks left SMs idle (32/8/128 heads, 8K x 8, 4 splits
//     of 100 KiB blocks: 109 us clustered, 70.5 us with the combine).
//   * Otherwise the partials are merged by CombineKernel (MergeSplits in device_common.cuh: all loads of a
//     merge issued together; the combine it replaced looped over the splits one load at a time per output
//     element, ~6 us per node at 22 splits; since Note [Combine in one load round] up to 8 splits per lane,
//     one round of loads, launched small enough to wait resident beside the attention's blocks).
// H200, standalone (benchmarks/cuda/attention_sweep.cu, CUDA graph replays, float16, BSNH), us per node,
// v2 -> v3: 9/3/64 heads 8K x 8 25.8 -> 19.0, 8K x 1 15.1 -> 8.4, 131K x 1 62.1 -> 33.4, 128 keys x 1 (a
// decode step's layer) 7.7 -> 5.6; 32/8/128 heads 8K x 8 80.5 -> 70.5. A kernel that only reads the same
// bytes (no products) takes 14.4 us at 8K x 8 (its best split count): v3 alone is at 16.5 there, the
// merge adds the rest.
// Tried at 8K x 8 (same harness, 2026-12-01) and NOT kept, each slower or within noise: the last block of a
// unit merging the splits itself (threadfence + atomicInc counter, no combine launch): 21.7 us vs 19.1 with
// the combine (the fence, the atomic and the partial reads sit on the last block's critical path, where the
// programmatic-dependent combine overlaps its launch); L2 prefetch of the warp's tiles 2..8 ahead
// (prefetch.global.L2): kernel alone 16.45 -> 17.9 us, worse at every shape; launching v3 itself as a
// programmatic dependent of the kernel before it (griddepcontrol.wait first; Note [CUDA attention early start] now
// issues the first tiles before the wait, which is what gains): 19.1 vs 19.1, 8K x 1 8.8 vs 8.4,
// a decode layer (128 keys) 5.3 vs 5.6; 8 warps per block with a 2- or 3-slot ring, or 2 warps: the
// attention alone stays at 16.4-16.7 us for every block shape that fills one wave. A second session (same harness,
// its "cl" rows): the cluster merge with bigger blocks and fewer splits, more than one block per SM allowed,
// 8 warps x 3-slot rings at 4 splits 18.38 us, 8 warps x 2 slots at 8 splits 18.49, 4 warps x 4 slots at 8 splits
// 18.85, vs 19.15 for this kernel in the same run: at best 4 %, and the distributed-shared-memory merge itself
// costs ~1.8 us (17.08 us for the 8-split kernel alone), so not adopted.
// Note [CUDA attention early start]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On sm_90+ the decode attention kernels (CacheAttention v3 here, PagedCacheAttention v3 in paged_cuda.cu) are
// launched as programmatic dependents of the kernel before them on the stream (a CUDA graph keeps the edge), and
// both combines let their own dependents start at their start. A block may then become resident while the kernel
// before it still runs (its last blocks, or the previous attention's combine), and before griddepcontrol.wait it
// does only what that kernel cannot change:
//   * dense: reads `start` and issues its ring's prologue (each warp's first ST - 1 tiles) for rows < start;
//   * paged: reads `start` and resolves its first window (page table entries, directory rows, formats), the page
//     that holds row `start` included (checked after the wait: Note [Paged CUDA late pages] in paged_cuda.cu); the
//     uniform 16-bit kernel also issues its prologue's rows before `start` (as dense).
// After the wait it loads q, reads `start` again (if the kernel before wrote it, the block starts over from the
// new value: the dense prologue re-issued, the paged window resolved again), and copies the prologue's rows at
// or past `start` (this step's rows: the update just before writes them). The assumption: the kernel launched
// right before the attention writes neither cache rows before `start` nor the pages, table entries or directory
// rows of pages that end before it. ortkv's writers keep to it (CacheUpdate, RotaryCacheUpdate and
// PagedCacheUpdate write rows from their position on; a KC page is re-encoded by the step that writes its last
// row, read after the wait; the page pool's host-side edits run between two device synchronizes, Note [Page pool
// on CUDA]). A graph that rewrites older rows in the kernel just before the attention runs with ORTKV_CUDA_EARLY=0.
// H200, SmolLM2's heads (9 / 3 / 64), CUDA graphs of one attention node after another, early vs plain in one run:
// through ORT (benchmarks/bench_cache_attention_cuda.py, v3 vs v3-plain) 8K keys x 8 rows 56 -> 64 % of the copy's
// bandwidth, 8K x 1 16 -> 19 %, 32K x 1 38 -> 44 %, 32K x 8 77 -> 80 %; paged (bench_paged_attention_cuda.py)
// F16 pages 0.86-1.00x their plain time, INT4 pages at 32K x 8 34.6 -> 30.9 us. Harness (attention_sweep.cu):
// 8K x 8 19.0 -> 16.4-16.6 us. Tried and not kept: the warp's later tiles prefetched into L2 before the wait
// (prefetch.global.L2, one line per lane): 8K x 8 back at 18.9 us; dense rings 6 or 8 deep (more tiles before the
// wait): no faster (16.9 / 19.0 us at their best split counts); paged: the first window's tiles issued before the
// wait as well (paged_sweep, head size 64): F16 -4 %, INT8 -7 %, INT4 +1-3 % at 8K x 8, mixed, so paged keeps to
// the pages' metadata (benchmarks/results/paged_attention_cuda_h200.md, 2026-12-02 sixth session).
namespace v3 {

using tile16::kTile;
using tile16::LoadQueryPairs;
using tile16::MergeWarpTiles;
using tile16::Pack2;
using tile16::StreamWarpTiles;
using tile16::Sw;

constexpr int kHeads = 8;  // query heads per block: rows 0..7 of the mma's A
constexpr int64_t kMaxCluster = tile16::kMaxClusterRanks;  // the portable cluster size, what ClusterMerge reads

template <int D, int NW, int ST>
struct Cfg {
  static constexpr int kRegion = kTile * D * 2;      // one tile of K (or V), 16-bit values
  static constexpr int kStageBytes = 2 * kRegion;    // K, then V
  static constexpr int kWarpBytes = ST * kStageBytes;
  static constexpr int kRingBytes = NW * kWarpBytes;
  static constexpr int kCh = D / 8;                  // 16-byte chunks per row
  static constexpr size_t kMergeBytes =
      kRingBytes > sizeof(WarpMerge<NW, kHeads>) ? kRingBytes : sizeof(WarpMerge<NW, kHeads>);
  static constexpr size_t kFinOffset = (kMergeBytes + 15) / 16 * 16;  // CLUSTER: [kHeads][D + 2] floats
  static constexpr size_t kSmem = kFinOffset + kHeads * (D + 2) * sizeof(float);
};

template <typename T, int D, int NW, int ST, bool CLUSTER, bool EARLY = false>
__global__ void __launch_bounds__(NW * 32) AttentionKernelV3(const Args a) {
  using C = Cfg<D, NW, ST>;
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  extern __shared__ __align__(16) unsigned char dsm[];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);  // the combine may be scheduled (it waits)
#endif
  const int64_t S = a.splits;
  int64_t blk = blockIdx.x;
  const int64_t split = blk % S;
  blk /= S;
  const int64_t hb = blk % a.head_blocks;
  const int64_t unit = blk / a.head_blocks;
  const int64_t t = unit % a.T;
  const int64_t hk = (unit / a.T) % a.Hkv;
  const int64_t b = unit / (a.T * a.Hkv);
  const int64_t G = a.Hq / a.Hkv;
  const int64_t g0 = hb * kHeads;
  const int gn = static_cast<int>(G - g0 < kHeads ? G - g0 : kHeads);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;  // the mma's row (query head g0 + g) and column pair of this lane

  // the raw q pairs of this lane's fragments, loaded with `start` (neither waits for the other); EARLY: after
  // the wait (the previous kernel writes q)
  uint32_t qr[D / 16][2];
  const T* qp = static_cast<const T*>(a.q) + ((b * a.T + t) * a.Hq + hk * G + g0 + g) * a.D;
  if constexpr (!EARLY) {
    LoadQueryPairs<T, D>(qp, g, gn, c, qr);
    if (blockIdx.x == 0 && tid == 0) ReportStart(a);
  }
  const int64_t hi = a.C - a.T;
  const auto clamped_start = [&]() {
    const int64_t x = a.start[b * a.start_stride];
    return x < 0 ? int64_t{0} : x > hi ? hi : x;
  };
  const int64_t ts = a.tok_stride;
  const T* kb = static_cast<const T*>(a.k) + b * a.row_stride + hk * a.head_stride;
  const T* vb = static_cast<const T*>(a.v) + b * a.row_stride + hk * a.head_stride;
  uint8_t* wring = dsm + warp * C::kWarpBytes;
  int64_t st = clamped_start(), j0 = 0, j1 = 0, lim = 0;
  int mine = 0, next = 0, stage_in = 0;
  // keys [0, L) with L = st + t + 1, this block's chunk [j0, j1); lim: EARLY's prologue reads rows < lim only
  // (rows st.. are this step's, written by the kernel this one may overlap; Note [CUDA attention early start])
  const auto setup = [&](bool early_rows) {
    const int64_t L = st + t + 1;
    SplitKeys<kTile>(L, S, split, &j0, &j1);
    lim = early_rows ? (st < j1 ? st : j1) : j1;
    const int n_tiles = static_cast<int>((j1 - j0 + kTile - 1) / kTile);
    mine = n_tiles > warp ? (n_tiles - warp + NW - 1) / NW : 0;
    next = 0, stage_in = 0;
  };
  auto issue = [&]() {
    if (next < mine) {
      const int64_t k0 = j0 + static_cast<int64_t>(warp + next * NW) * kTile;
      const int64_t end = (EARLY && next < ST - 1) ? lim : j1;
      uint8_t* sg = wring + stage_in * C::kStageBytes;
#pragma unroll
      for (int i = lane; i < kTile * C::kCh; i += 32) {
        const int r = i / C::kCh, ch = i % C::kCh;
        if (k0 + r < end) {
          CpAsync<16>(sg + Sw<D>(r, ch), kb + (k0 + r) * ts + ch * 8);
          CpAsync<16>(sg + C::kRegion + Sw<D>(r, ch), vb + (k0 + r) * ts + ch * 8);
        }
      }
    }
    CpAsyncCommit();  // one group per tile, empty ones included: the wait below counts groups
    ++next;
    stage_in = stage_in + 1 == ST ? 0 : stage_in + 1;
  };
  setup(EARLY);
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) issue();
  if constexpr (EARLY) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous kernel's writes are visible from here
#endif
    LoadQueryPairs<T, D>(qp, g, gn, c, qr);
    if (blockIdx.x == 0 && tid == 0) ReportStart(a);
    const int64_t st2 = clamped_start();
    if (st2 != st) {  // `start` was written by the previous kernel: the prologue read the wrong rows, start again
      CpAsyncWait<0>();
      __syncwarp();
      st = st2;
      setup(false);
#pragma unroll
      for (int s = 0; s < ST - 1; ++s) issue();
    } else if (lim < j1) {  // the prologue tiles' rows [lim, j1): one more group, waited for at once
      bool any = false;
#pragma unroll
      for (int s = 0; s < ST - 1; ++s) {
        const int64_t k0 = j0 + static_cast<int64_t>(warp + s * NW) * kTile;
        if (s < mine && k0 + kTile > lim) {
          uint8_t* sg = wring + s * C::kStageBytes;
          for (int i = lane; i < kTile * C::kCh; i += 32) {
            const int r = i / C::kCh, ch = i % C::kCh;
            if (k0 + r >= lim && k0 + r < j1) {
              CpAsync<16>(sg + Sw<D>(r, ch), kb + (k0 + r) * ts + ch * 8);
              CpAsync<16>(sg + C::kRegion + Sw<D>(r, ch), vb + (k0 + r) * ts + ch * 8);
            }
          }
          any = true;
        }
      }
      if (any) {  // warp-uniform
        CpAsyncCommit();
        CpAsyncWait<0>();
      }
    }
  }

  float m, l, o[D / 8][4];
  StreamWarpTiles<BF, D, NW, ST, C::kStageBytes>(wring, qr, a.scale * 1.4426950408889634f, j0, j1, mine, warp, lane,
                                                 issue, m, l, o);  // base-2 scores
  __syncthreads();  // the ring becomes the merge arrays
  // CLUSTER: the block's merged (m, l, acc) of each head, for the cluster's rank 0 to read (after the ring)
  float* fin = reinterpret_cast<float*>(dsm + C::kFinOffset);  // [kHeads][D + 2]: acc, m, l
  MergeWarpTiles<NW, D>(*reinterpret_cast<WarpMerge<NW, kHeads>*>(dsm), m, l, o, gn,
                        [&](int gg, int d, float mb, float lb, float ab) {
                          if constexpr (CLUSTER) {
                            tile16::StoreFin<D>(fin, gg, d, mb, lb, ab);
                          } else if (S == 1) {
                            T* out = static_cast<T*>(a.out) + ((b * a.T + t) * a.Hq + hk * G + g0 + gg) * a.D;
                            out[d] = FromF<T>(ab / lb);
                          } else {
                            float* p = a.partial + ((unit * G + g0 + gg) * S + split) * (a.D + 2);
                            p[d] = ab;
                            if (d == 0) {
                              p[a.D] = mb;
                              p[a.D + 1] = lb;
                            }
                          }
                        });
  if constexpr (CLUSTER)  // the S blocks of this unit and head block form one cluster (split = rank)
    tile16::ClusterMerge<T, D>(
        fin, static_cast<int>(S), gn, tid, NW * 32,
        [&](int gg) { return static_cast<T*>(a.out) + ((b * a.T + t) * a.Hq + hk * G + g0 + gg) * a.D; });
}

template <typename T, int D, int NW, int ST>
int BlocksPerSm() {
  static const int per_sm = [] {
    using C = Cfg<D, NW, ST>;
    for (auto* k : {AttentionKernelV3<T, D, NW, ST, false>, AttentionKernelV3<T, D, NW, ST, true>,
                    AttentionKernelV3<T, D, NW, ST, false, true>, AttentionKernelV3<T, D, NW, ST, true, true>}) {
      (void)cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kSmem));
      (void)cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
      (void)cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    }
    (void)cudaGetLastError();
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, AttentionKernelV3<T, D, NW, ST, false>, NW * 32, C::kSmem) !=
            cudaSuccess ||
        n < 1) {
      (void)cudaGetLastError();
      n = 2;
    }
    return n;
  }();
  return per_sm;
}

// The attention with `splits` already chosen (a.splits), then the combine when it splits.
// CLUSTER (sm_90+, 2 <= splits <= kMaxCluster): the unit's split blocks form one thread-block cluster and merge
// through distributed shared memory, no combine launch; falls back to the partials + combine if refused.
template <typename T, int D, int NW, int ST>
cudaError_t LaunchWith(const Args& a, int64_t base, cudaStream_t stream, bool cluster, bool early = false) {
  using C = Cfg<D, NW, ST>;
  const unsigned blocks = static_cast<unsigned>(base * a.splits);
  if (cluster && a.splits > 1 &&
      LaunchEx(early ? AttentionKernelV3<T, D, NW, ST, true, true> : AttentionKernelV3<T, D, NW, ST, true>, blocks,
               NW * 32, C::kSmem, stream, static_cast<unsigned>(a.splits), early, a))
    return cudaSuccess;  // refused: the partials and the combine below
  if (!early || !LaunchProgrammatic(AttentionKernelV3<T, D, NW, ST, false, true>, blocks, NW * 32, C::kSmem, stream, a))
    AttentionKernelV3<T, D, NW, ST, false><<<blocks, NW * 32, C::kSmem, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || a.splits == 1) return e;
  const unsigned combine_blocks = static_cast<unsigned>(a.B * a.T * a.Hq);
  const int threads = CombineThreads(a.splits, a.D);  // Note [Combine in one load round]
  if (v2::CurrentDevice().major >= 9 && LaunchProgrammatic(CombineKernel<T, true>, combine_blocks, threads, 0, stream, a))
    return cudaSuccess;
  CombineKernel<T, true><<<combine_blocks, threads, 0, stream>>>(a);  // refused or before sm_90
  return cudaGetLastError();
}

template <typename T, int D, int NW, int ST>
cudaError_t LaunchCfg(const CacheAttentionCudaView& v, Args a, cudaStream_t stream) {
  a.head_blocks = (v.group() + kHeads - 1) / kHeads;
  const int64_t base = v.units() * a.head_blocks;
  a.splits = v2::WaveSplits(v.splits, base, BlocksPerSm<T, D, NW, ST>());  // Note [CacheAttention CUDA v2 waves]
  // Note [CacheAttention CUDA v3]: a cluster merge only for a grid of at most one block per SM with 2..8 splits
  const bool cluster = a.splits >= 2 && a.splits <= kMaxCluster && v2::CurrentDevice().major >= 9 &&
                       base * a.splits <= v2::CurrentDevice().sms;
  return LaunchWith<T, D, NW, ST>(a, base, stream, cluster,
                                  v2::CurrentDevice().major >= 9 && CudaEarlyLaunch());  // Note [CUDA attention early start]
}

template <typename T>
cudaError_t Launch(const CacheAttentionCudaView& v, const Args& a, cudaStream_t stream) {
  return v.D == 64 ? LaunchCfg<T, 64, 4, 4>(v, a, stream) : LaunchCfg<T, 128, 4, 3>(v, a, stream);
}

}  // namespace v3

template <typename T, bool VEC, int GM>
cudaError_t LaunchGM(const Args& a, int64_t blocks, cudaStream_t stream) {
  AttentionKernel<T, VEC, GM><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, bool VEC>
cudaError_t LaunchT(const Args& a, int gm, int64_t blocks, cudaStream_t stream) {
  switch (gm) {
    case 1: return LaunchGM<T, VEC, 1>(a, blocks, stream);
    case 2: return LaunchGM<T, VEC, 2>(a, blocks, stream);
    case 3: return LaunchGM<T, VEC, 3>(a, blocks, stream);
    case 4: return LaunchGM<T, VEC, 4>(a, blocks, stream);
    default: return LaunchGM<T, VEC, 8>(a, blocks, stream);
  }
}

template <typename T>
cudaError_t Launch(const CacheAttentionCudaView& v, const Args& a, cudaStream_t stream) {
  const int64_t G = v.group();
  const int gm = G <= 4 ? static_cast<int>(G) : 8;
  const int64_t blocks = v.units() * a.head_blocks * v.splits;
  cudaError_t e = v.vec ? LaunchT<T, true>(a, gm, blocks, stream) : LaunchT<T, false>(a, gm, blocks, stream);
  if (e != cudaSuccess || v.splits == 1) return e;
  const int threads = CombineThreads(v.splits, v.D);  // Note [Combine in one load round]
  CombineKernel<T, false><<<static_cast<unsigned>(v.units() * G), threads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

// ORTKV_CUDA_ATTENTION: unset or empty = the newest kernel that applies (CacheAttention: Note [CacheAttention
// CUDA v3], else v2; PagedCacheAttention: Note [Paged CUDA v3], else v2); "v1", "v2", "v3" pick one for A/B
// runs (a kernel that does not apply to a call falls back to an older one).
// Read at every launch (a captured CUDA graph keeps the kernel of its capture).
Status CudaAttentionKernelChoice(int* level) {
  const char* e = std::getenv("ORTKV_CUDA_ATTENTION");
  *level = 0;
  if (e == nullptr || *e == '\0') return Status::Ok();
  for (int v = 1; v <= 3; ++v) {
    const char name[3] = {'v', static_cast<char>('0' + v), '\0'};
    if (std::strcmp(e, name) == 0) {
      *level = v;
      return Status::Ok();
    }
  }
  return Status(Code::kInvalidArgument, std::string("ORTKV_CUDA_ATTENTION='") + e +
                                            "' is not a CUDA attention kernel; set v1, v2 or v3, or unset it");
}


// ORTKV_CUDA_EARLY: "0" launches the decode attention kernels plainly (for A/B runs); unset or anything else lets
// them start as programmatic dependents of the kernel before them on sm_90+ (Note [CUDA attention early start]).
// Read at every launch (a captured CUDA graph keeps the launches of its capture).
bool CudaEarlyLaunch() {
  const char* e = std::getenv("ORTKV_CUDA_EARLY");
  return !(e != nullptr && std::strcmp(e, "0") == 0);
}

Status CacheAttentionCuda(const CacheAttentionCudaView& v, void* stream_ptr) {
  if (v.units() == 0) return Status::Ok();
  if (v.splits > 1 && v.partial == nullptr) return Status(Code::kRuntime, "CacheAttention CUDA: no workspace");
  const int64_t G = v.group();
  const int gm = G <= 4 ? static_cast<int>(G) : 8;
  Args a;
  a.q = v.q;
  a.k = v.k;
  a.v = v.v;
  a.out = v.out;
  a.start = v.start;
  a.start_stride = v.start_stride;
  a.B = v.B;
  a.T = v.T;
  a.Hq = v.Hq;
  a.Hkv = v.Hkv;
  a.D = v.D;
  a.C = v.C;
  a.row_stride = v.row_stride;
  a.tok_stride = v.tok_stride;
  a.head_stride = v.head_stride;
  a.scale = v.scale;
  a.splits = v.splits;
  a.head_blocks = (G + gm - 1) / gm;
  a.partial = v.partial;
  a.err = v.error_word ? static_cast<ortkv_device_error*>(v.error_word) + 1 : nullptr;  // [1]: CacheAttention
  a.label = v.label;
  int tpk = 1;
  while (tpk * kEPT < v.D) tpk *= 2;
  a.tpk = tpk;
  const int64_t blocks = v.units() * a.head_blocks * v.splits;
  if (blocks > 0x7fffffff) {
    return Status(Code::kInvalidArgument, "CacheAttention CUDA: " + std::to_string(blocks) +
                                              " blocks exceed the grid limit; split the batch");
  }
  int level = 0;
  ORTKV_RETURN_IF_ERR(CudaAttentionKernelChoice(&level));
  const bool v2 = level != 1 && v.vec && v.D <= kAttnCudaMaxHeadSize &&
                  (v.elem_type == kFloat16 || v.elem_type == kBFloat16);  // Note [CacheAttention CUDA v2]
  const bool v3 = v2 && (level == 0 || level == 3) && v.v3_shape() &&
                  v.splits <= kAttnCudaMaxSplits && v2::CurrentDevice().major >= 8;  // Note [CacheAttention CUDA v3]
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaError_t e;
  switch (v.elem_type) {
    case kFloat16:
      e = v3 ? v3::Launch<__half>(v, a, stream) : v2 ? v2::Launch<__half>(v, a, gm, stream) : Launch<__half>(v, a, stream);
      break;
    case kBFloat16:
      e = v3   ? v3::Launch<__nv_bfloat16>(v, a, stream)
          : v2 ? v2::Launch<__nv_bfloat16>(v, a, gm, stream)
               : Launch<__nv_bfloat16>(v, a, stream);
      break;
    default: e = Launch<float>(v, a, stream); break;
  }
  if (e != cudaSuccess) {
    return Status(Code::kRuntime, std::string("CacheAttention CUDA launch failed: ") + cudaGetErrorName(e) + ": " +
                                      cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace ortkv
