// CUDA CacheAttention: Note [CacheAttention] and Note [CacheAttention CUDA] in ortkv/cache_attention.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "ortkv/cache_attention.h"
#include "ortkv/core.h"

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

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromF<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

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
  int64_t chunk = (L + S - 1) / S;
  if (chunk < kAttnCudaMinChunk) chunk = kAttnCudaMinChunk;
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

// One block per (unit, query head): merges the S chunks' (acc, m, l) into the output.
template <typename T>
__global__ void CombineKernel(const Args a) {
  const int64_t G = a.Hq / a.Hkv;
  const int64_t uh = blockIdx.x;  // unit * G + g
  const int64_t g = uh % G, unit = uh / G;
  const int64_t t = unit % a.T, hk = (unit / a.T) % a.Hkv, b = unit / (a.T * a.Hkv);
  const int64_t S = a.splits;
  const float* p = a.partial + uh * S * (a.D + 2);
  float mx = -INFINITY;
  for (int64_t c = 0; c < S; ++c) mx = fmaxf(mx, p[c * (a.D + 2) + a.D]);
  T* o = static_cast<T*>(a.out) + ((b * a.T + t) * a.Hq + hk * G + g) * a.D;
  for (int d = threadIdx.x; d < a.D; d += blockDim.x) {
    float den = 0.0f, num = 0.0f;
    for (int64_t c = 0; c < S; ++c) {
      const float* pc = p + c * (a.D + 2);
      const float mc = pc[a.D];
      if (mc == -INFINITY) continue;  // an empty chunk (chunk 0 never is)
      const float w = __expf(mc - mx);
      den += w * pc[a.D + 1];
      num += w * pc[d];
    }
    o[d] = FromF<T>(num / den);
  }
}

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
  const int threads = static_cast<int>(std::min<int64_t>(256, (v.D + 31) / 32 * 32));
  CombineKernel<T><<<static_cast<unsigned>(v.units() * G), threads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

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
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaError_t e;
  switch (v.elem_type) {
    case kFloat16: e = Launch<__half>(v, a, stream); break;
    case kBFloat16: e = Launch<__nv_bfloat16>(v, a, stream); break;
    default: e = Launch<float>(v, a, stream); break;
  }
  if (e != cudaSuccess) {
    return Status(Code::kRuntime, std::string("CacheAttention CUDA launch failed: ") + cudaGetErrorName(e) + ": " +
                                      cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace ortkv
