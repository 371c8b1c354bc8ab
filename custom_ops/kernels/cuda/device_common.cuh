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

}  // namespace
}  // namespace ortkv
