// Device helpers shared by the CUDA kernels: float <-> the element types (float, __half, __nv_bfloat16),
// base-2 exponentials for the online softmax, the cp.async copies of the streaming attention kernels and
// their end-of-block merge arrays.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ortkv/cache_attention.h"

namespace ortkv {
namespace {

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

// A split's keys [*j0, *j1) of a row's keys [0, L) (Note [Cluster split chunks] in cache_attention.h): chunks of
// ceil(L / S) keys, at least kAttnCudaClusterChunk, rounded up to whole tiles of TILE keys where TILE > 1 (no tile
// read by two blocks), so that a short row's later splits are empty. (Returning the pair as a struct instead changed
// the sm_90 SASS of every caller; through pointers it is the inline rule's, instruction for instruction, except in
// the dense v1 kernel, which therefore keeps the rule written out.)
template <int TILE>
__device__ __forceinline__ void SplitKeys(int64_t L, int64_t S, int64_t split, int64_t* j0, int64_t* j1) {
  int64_t chunk = (L + S - 1) / S;
  if (chunk < kAttnCudaClusterChunk) chunk = kAttnCudaClusterChunk;
  if (TILE > 1) chunk = (chunk + TILE - 1) / TILE * TILE;
  *j0 = split * chunk < L ? split * chunk : L;
  *j1 = *j0 + chunk < L ? *j0 + chunk : L;
}

// A launch with attributes: `cluster` > 1 groups each run of `cluster` consecutive blocks into one thread-block
// cluster (sm_90+; Note [Cluster merge] in tile_mma.cuh), `programmatic` makes it a programmatic dependent (below).
// False, with the error cleared, when the launch is refused.
template <typename... Params, typename... Args>
bool LaunchEx(void (*kernel)(Params...), unsigned grid, unsigned block, size_t smem, cudaStream_t stream,
              unsigned cluster, bool programmatic, const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (programmatic) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}
// Launches `kernel` as a programmatic dependent of the kernel before it on `stream` (sm_90+: it may start before
// that kernel completes and orders itself with griddepcontrol.wait; a CUDA graph keeps the edge). False, with the
// error cleared, when the launch is refused: the caller then launches plainly.
template <typename... Params, typename... Args>
bool LaunchProgrammatic(void (*kernel)(Params...), unsigned grid, unsigned block, size_t smem, cudaStream_t stream,
                        const Args&... args) {
  return LaunchEx(kernel, grid, block, smem, stream, 0u, true, args...);
}

// 2^x in one instruction (ex2.approx: relative error ~2^-22; 2^-inf = +0).
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// N bytes global -> shared without a register round trip (16: .cg, bypassing L1; 4 / 8: .ca).
template <int N>
__device__ __forceinline__ void CpAsync(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(N) : "memory");
  }
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The end-of-block merge of W warps' online-softmax states (m, l, acc) for GM query heads.
template <int W, int GM>
struct WarpMerge {
  float m[W][GM];
  float l[W][GM];
  float acc[W][GM][kAttnCudaMaxHeadSize];
};

// Merges a block's S split partials p[S][D + 2] (acc[0..D), m, l; m in base 2 when LOG2) into out[0..D), for
// the combine kernels (dense and paged). Every thread of the block takes part (blockDim.x == kMergeThreads,
// D <= kMergeThreads, S <= kAttnCudaMaxSplits): the splits' (m, l) are staged in shared memory by all threads
// at once, then the threads share the splits for the sums, so the loads of one merge are issued together
// rather than one dependent chain per output element (~6 us per node at 22 splits on the H200 before). A split
// with m = -inf (no keys, or refused) weighs nothing; out is 0 where no split had keys.
constexpr int kMergeThreads = 256;
// Note [Combine in one load round]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The combine merges each output element's S split partials. With P parts per element (P a power of two, the
// block D x P threads, whole warps) and S <= kOneRoundPer * P, the P adjacent lanes of element d take the splits
// part, part + P, ... and issue all their (m, l, acc[d]) loads at once; the max and the sums go through shuffles:
// one round of loads, no barrier. The staged merge below (kMergeThreads threads) takes three dependent rounds (m,
// then l, then acc) and four barriers. The combine's footprint matters as much as its rounds: it is a
// programmatic dependent of the attention, and its blocks become resident beside the attention's (and wait
// there) only if they fit in what those leave of the SM (a first version with one thread per element and 32
// splits in registers did not fit and was 1 us slower per node; the paged attention's two blocks of 229
// registers leave ~6K registers of an SM). So the combine is launched with CombineThreads(S, D) threads: the
// fewest that merge in one round; kMergeThreads, and the staged merge, only where none does.
// H200 harness (benchmarks/cuda/attention_sweep.cu, paged_sweep.cu; SmolLM2 heads, early start): a dense node with no
// combine at all takes 14.3 us at 8K x 8 and 4.4 us at 8K x 1; with the staged combine 16.7 and 7.2.
constexpr int kOneRoundPer = 8;
// The parts P per element when a block of `threads` (whole warps, at most kMergeThreads) merges S splits in one
// round, else 0. Host (CombineThreads) and device (MergeSplits) both ask it; one division, the rest by
// multiplication and masks (the device evaluates it between two attention nodes).
__host__ __device__ constexpr int OneRoundParts(int threads, int S, int D) {
  const int parts = D > 0 ? threads / D : 0;
  return parts > 0 && parts * D == threads && (threads & 31) == 0 && threads <= kMergeThreads &&
                 (parts & (parts - 1)) == 0 && S <= kOneRoundPer * parts
             ? parts
             : 0;
}
inline int CombineThreads(int64_t S, int64_t D) {
  for (int64_t t = D; t <= kMergeThreads; t *= 2)
    if (OneRoundParts(static_cast<int>(t), static_cast<int>(S), static_cast<int>(D)) > 0) return static_cast<int>(t);
  return kMergeThreads;
}
template <typename T, bool LOG2>
__device__ __forceinline__ void MergeSplitsOneRound(const float* p, int S, int D, int parts, T* out) {
  // parts is a power of two: shifts, not divisions (this is the latency between two attention nodes)
  const int tid = threadIdx.x, d = tid >> (__ffs(parts) - 1), part = tid & (parts - 1), P = D + 2;
  float m[kOneRoundPer], l[kOneRoundPer], acc[kOneRoundPer];
#pragma unroll
  for (int i = 0; i < kOneRoundPer; ++i) {
    const int s = part + i * parts;
    m[i] = s < S ? p[s * P + D] : -INFINITY;
    l[i] = s < S ? p[s * P + D + 1] : 0.0f;
    acc[i] = s < S ? p[s * P + d] : 0.0f;
  }
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kOneRoundPer; ++i) mx = fmaxf(mx, m[i]);
  for (int o = 1; o < parts; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float num = 0.0f, den = 0.0f;
#pragma unroll
  for (int i = 0; i < kOneRoundPer; ++i) {
    const float f = m[i] == -INFINITY ? 0.0f : LOG2 ? Exp2(m[i] - mx) : __expf(m[i] - mx);
    den += f * l[i];
    num += f * acc[i];
  }
  for (int o = 1; o < parts; o <<= 1) {
    den += __shfl_xor_sync(0xffffffffu, den, o);
    num += __shfl_xor_sync(0xffffffffu, num, o);
  }
  if (part == 0) out[d] = FromF<T>(den > 0.0f ? num / den : 0.0f);  // d < D: the block is D x parts threads
}

template <typename T, bool LOG2>
__device__ void MergeSplits(const float* p, int S, int D, T* out) {
  // Note [Combine in one load round]: blockDim.x from CombineThreads (kMergeThreads where no block size merges
  // in one round)
  if (const int parts = OneRoundParts(static_cast<int>(blockDim.x), S, D))
    return MergeSplitsOneRound<T, LOG2>(p, S, D, parts, out);
  __shared__ float w[kAttnCudaMaxSplits];
  __shared__ float red[kMergeThreads];
  __shared__ float warp_v[kMergeThreads / 32];
  const int P = D + 2, tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
  float mx = -INFINITY;
  for (int s = tid; s < S; s += kMergeThreads) {
    w[s] = p[s * P + D];
    mx = fmaxf(mx, w[s]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) warp_v[wp] = mx;
  __syncthreads();
  mx = warp_v[0];
#pragma unroll
  for (int i = 1; i < kMergeThreads / 32; ++i) mx = fmaxf(mx, warp_v[i]);
  __syncthreads();  // warp_v is reused below
  float den = 0.0f;
  for (int s = tid; s < S; s += kMergeThreads) {
    const float ms = w[s];
    const float f = ms == -INFINITY ? 0.0f : LOG2 ? Exp2(ms - mx) : __expf(ms - mx);
    w[s] = f;
    den += f * p[s * P + D + 1];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) den += __shfl_xor_sync(0xffffffffu, den, off);
  if (lane == 0) warp_v[wp] = den;
  __syncthreads();  // w[] is complete too
  den = 0.0f;
#pragma unroll
  for (int i = 0; i < kMergeThreads / 32; ++i) den += warp_v[i];
  const int groups = kMergeThreads / D;  // threads d, d + D, ... share the splits of element d
  const int d = tid % D, grp = tid / D;
  float num = 0.0f;
  if (grp < groups) {
#pragma unroll 4
    for (int s = grp; s < S; s += groups) num += w[s] * p[s * P + d];
  }
  red[tid] = num;
  __syncthreads();
  if (tid < D) {
    for (int i = 1; i < groups; ++i) num += red[i * D + tid];
    out[tid] = FromF<T>(den > 0.0f ? num / den : 0.0f);
  }
}

// A combine kernel's block: (unit, query head g) = blockIdx.x, the units (b, hk, t) ordered as the attention
// kernels' (t fastest, then hk, then b) over Tq query tokens; its S partials merged into that output row.
template <typename T, bool LOG2>
__device__ __forceinline__ void CombineUnitHead(const float* partial, void* out, int64_t S, int64_t Tq, int64_t Hq,
                                                int64_t Hkv, int64_t D) {
  const int64_t G = Hq / Hkv;
  const int64_t uh = blockIdx.x;  // unit * G + g
  const int64_t g = uh % G, unit = uh / G;
  const int64_t t = unit % Tq, hk = (unit / Tq) % Hkv, b = unit / (Tq * Hkv);
  MergeSplits<T, LOG2>(partial + uh * S * (D + 2), static_cast<int>(S), static_cast<int>(D),
                       static_cast<T*>(out) + ((b * Tq + t) * Hq + hk * G + g) * D);
}

}  // namespace
}  // namespace ortkv
