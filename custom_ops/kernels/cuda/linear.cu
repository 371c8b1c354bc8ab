// CUDA Linear at small M: the GEMV of Note [Linear GEMV] (Note [Linear] in ortkv/linear.h for the op).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "device_common.cuh"
#include "ortkv/linear.h"

// Note [Linear GEMV]
// ~~~~~~~~~~~~~~~~~~
// Y [M, N] = X [M, K] @ W^T, W [N, K] row-major, M <= 8 (a decode step's rows), float16 / bfloat16, fp32
// accumulators. A decode projection reads 0.66-3.5 MB of W (56.6 MB for the LM head) and touches X [M, K]
// (<= 24 KiB): the kernel is a read of W, and the time goes to keeping enough of W's bytes in flight.
//   * One warp per RPW consecutive output rows (template parameter, 1, 2 or 4; 2 by default: two rows' loads
//     in flight per lane for one pass over X), 4 warps per block, ceil(N / (4 RPW)) blocks: for the decoder's
//     shapes 72 (N = 576) to 6,144 (the LM head) blocks, no split along K, so no atomics and no workspace.
//   * Lane l of a warp reads the 16-byte vectors l, l + 32, ... of its rows (8 elements each: K % 8 == 0),
//     so a warp's 32 loads of one step are 512 contiguous bytes of a row. Up to kUnroll = 8 vectors per lane
//     and row are loaded into registers BEFORE any FMA (K <= 2048 in one batch of loads: every decoder
//     projection; longer rows go by in batches of 2048 elements), with ld.global.nc.L1::no_allocate: W is
//     read exactly once per call and must not evict X from L1.
//   * The first batch of W loads is issued before the block stages X [M, K] into shared memory (16-byte
//     copies, one __syncthreads), so the staging hides under the loads' latency. X then comes from shared
//     memory for every row of the block.
//   * Each lane keeps RPW x M fp32 sums; one butterfly of warp shuffles (xor 16 .. 1) per sum, then lane
//     r M + m stores Y[m, n0 + r], rounded once to the output type.
// Nothing is allocated, nothing synchronizes with the host: one launch on the node's stream, capturable in
// a CUDA graph. On sm_90+ the kernel lets programmatic dependents start at its start (they wait for it before
// reading y; only ortkv's paged update launches so after it). The host checks (in the op) K % 8, the path (LinearUsesGemv: M <= 8 at most, X within
// kLinearGemvMaxXBytes; Note [Linear path choice]) and 16-byte
// aligned X and W, and refuses anything else by name.

namespace ortkv {
namespace {

constexpr int kWarps = 4;   // warps per block
constexpr int kUnroll = 8;  // 16-byte vectors per lane and row loaded before the FMAs

__device__ __forceinline__ uint4 LoadStream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float2 Pair(uint32_t bits, __half) {
  __half2 h;
  memcpy(&h, &bits, 4);
  return __half22float2(h);
}
__device__ __forceinline__ float2 Pair(uint32_t bits, __nv_bfloat16) {
  __nv_bfloat162 h;
  memcpy(&h, &bits, 4);
  return __bfloat1622float2(h);
}

// acc += dot(w, x) over one vector of 8 elements
template <typename T>
__device__ __forceinline__ float Dot8(const uint4& w, const uint4& x, float acc) {
  const uint32_t wb[4] = {w.x, w.y, w.z, w.w}, xb[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = Pair(wb[i], T()), b = Pair(xb[i], T());
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

template <typename T, int M, int RPW>
__global__ void __launch_bounds__(kWarps * 32) LinearGemvKernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                 T* __restrict__ y, int K, int N) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // a programmatic dependent (PagedRotaryCacheUpdate's kernel after a QKV projection) may start its page
  // resolution now; it waits for this grid before reading y (Note [Paged CUDA resolved update])
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  extern __shared__ uint4 xs[];  // [M, K / 8]
  const int nvec = K / 8;
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * RPW;
  const int rows_here = N - n0;  // rows r < rows_here exist
  const uint4* row0 = reinterpret_cast<const uint4*>(w) + static_cast<int64_t>(rows_here > 0 ? n0 : 0) * nvec + lane;
  uint4 wv[RPW][kUnroll];
  auto load = [&](int base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32;
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        wv[r][u] = make_uint4(0, 0, 0, 0);
        if (r < rows_here && i + lane < nvec) wv[r][u] = LoadStream(row0 + static_cast<int64_t>(r) * nvec + i);
      }
    }
  };
  load(0);  // in flight while X is staged
  const uint4* xg = reinterpret_cast<const uint4*>(x);
  for (int i = threadIdx.x; i < M * nvec; i += kWarps * 32) xs[i] = xg[i];
  __syncthreads();
  if (rows_here <= 0) return;  // a warp past N (after the barrier: every warp took part in the staging)
  float acc[RPW][M];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  }
  for (int base = 0;;) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < nvec) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const uint4 xv = xs[m * nvec + i];
#pragma unroll
          for (int r = 0; r < RPW; ++r) acc[r][m] = Dot8<T>(wv[r][u], xv, acc[r][m]);
        }
      }
    }
    base += kUnroll * 32;
    if (base >= nvec) break;
    load(base);
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float s = acc[r][m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == r * M + m && r < rows_here) y[static_cast<int64_t>(m) * N + n0 + r] = FromF<T>(s);
    }
  }
}

template <typename T, int M, int RPW>
cudaError_t Launch(const LinearView& v, cudaStream_t stream) {
  const int rows_per_block = kWarps * RPW;
  const unsigned blocks = static_cast<unsigned>((v.N + rows_per_block - 1) / rows_per_block);
  const size_t smem = static_cast<size_t>(M * v.K) * sizeof(T);
  LinearGemvKernel<T, M, RPW><<<blocks, kWarps * 32, smem, stream>>>(
      static_cast<const T*>(v.x), static_cast<const T*>(v.w), static_cast<T*>(v.y), static_cast<int>(v.K),
      static_cast<int>(v.N));
  return cudaGetLastError();
}

template <typename T, int RPW>
cudaError_t LaunchM(const LinearView& v, cudaStream_t stream) {
  switch (v.M) {
    case 1: return Launch<T, 1, RPW>(v, stream);
    case 2: return Launch<T, 2, RPW>(v, stream);
    case 3: return Launch<T, 3, RPW>(v, stream);
    case 4: return Launch<T, 4, RPW>(v, stream);
    case 5: return Launch<T, 5, RPW>(v, stream);
    case 6: return Launch<T, 6, RPW>(v, stream);
    case 7: return Launch<T, 7, RPW>(v, stream);
    default: return Launch<T, 8, RPW>(v, stream);
  }
}

template <typename T>
cudaError_t LaunchRows(const LinearView& v, int rows_per_warp, cudaStream_t stream) {
  switch (rows_per_warp) {
    case 1: return LaunchM<T, 1>(v, stream);
    case 4: return LaunchM<T, 4>(v, stream);
    default: return LaunchM<T, 2>(v, stream);
  }
}

}  // namespace

Status LinearGemvCuda(const LinearView& v, int rows_per_warp, void* stream_ptr) {
  // the op checked these; a caller that did not gets a Status, never an out-of-bounds launch
  if (v.M < 1 || v.M > kLinearGemvMaxM || v.K % kLinearKMultiple != 0 || v.K < 1 || v.N < 1 ||
      v.N > (int64_t{1} << 30) || v.K > (int64_t{1} << 30) ||
      v.M * v.K * 2 > kLinearGemvMaxXBytes || (rows_per_warp != 1 && rows_per_warp != 2 && rows_per_warp != 4) ||
      reinterpret_cast<uintptr_t>(v.x) % 16 != 0 || reinterpret_cast<uintptr_t>(v.w) % 16 != 0) {
    return Status(Code::kInvalidArgument, "Linear GEMV: M = " + std::to_string(v.M) + ", K = " + std::to_string(v.K) +
                                              ", N = " + std::to_string(v.N) + ", rows_per_warp = " +
                                              std::to_string(rows_per_warp) + " is outside the kernel's range");
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaError_t err;
  switch (v.elem_type) {
    case kFloat16: err = LaunchRows<__half>(v, rows_per_warp, stream); break;
    case kBFloat16: err = LaunchRows<__nv_bfloat16>(v, rows_per_warp, stream); break;
    default: return Status(Code::kInvalidArgument, "Linear GEMV: float16 or bfloat16 only");
  }
  if (err == cudaSuccess) return Status::Ok();
  return Status(Code::kRuntime,
                std::string("Linear GEMV CUDA launch failed: ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace ortkv
