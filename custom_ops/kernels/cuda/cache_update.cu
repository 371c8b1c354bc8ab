// CUDA CacheUpdate: the copies of Note [CacheUpdate layout] (ortkv/cache_update.h) as one grid-stride
// kernel per chunk of up to kRowsPerLaunch rows. Positions are host values (the op declares
// `position` as a CPU input) and travel in the kernel's parameter block, so a launch needs no
// host-to-device copy and no allocation.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "ortkv/cache_update.h"

namespace ortkv {
namespace {

constexpr int kRowsPerLaunch = 256;  // 2 KiB of int64 positions in the parameter block

struct LaunchArgs {
  unsigned char* cache;         // chunk's first row
  const unsigned char* values;  // chunk's first row
  int64_t rows, outer, capacity, n, token_vecs;  // token_vecs: token bytes / sizeof(Vec)
  int64_t positions[kRowsPerLaunch];
};

template <typename Vec>
__global__ void CacheUpdateKernel(const LaunchArgs a) {
  const int64_t run = a.n * a.token_vecs;  // vectors per (row, outer) pair
  const int64_t total = a.rows * a.outer * run;
  const Vec* src = reinterpret_cast<const Vec*>(a.values);
  Vec* dst = reinterpret_cast<Vec*>(a.cache);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pair = i / run;
    const int64_t k = i - pair * run;
    const int64_t r = pair / a.outer;
    dst[(pair * a.capacity + a.positions[r]) * a.token_vecs + k] = src[i];
  }
}

template <typename Vec>
cudaError_t Launch(const LaunchArgs& a, cudaStream_t stream) {
  const int64_t total = a.rows * a.outer * a.n * a.token_vecs;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65535 * 8);
  CacheUpdateKernel<Vec><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

Status CacheUpdateCuda(const CacheUpdateView& v, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const uintptr_t align = reinterpret_cast<uintptr_t>(v.cache) | reinterpret_cast<uintptr_t>(v.values) |
                          static_cast<uintptr_t>(v.token_bytes);
  int vec = 16;
  while (vec > 1 && (align % vec) != 0) vec /= 2;
  for (int64_t r0 = 0; r0 < v.rows; r0 += kRowsPerLaunch) {
    LaunchArgs a;
    a.rows = std::min<int64_t>(kRowsPerLaunch, v.rows - r0);
    a.outer = v.outer;
    a.capacity = v.capacity;
    a.n = v.n;
    a.token_vecs = v.token_bytes / vec;
    a.cache = static_cast<unsigned char*>(v.cache) + r0 * v.outer * v.capacity * v.token_bytes;
    a.values = static_cast<const unsigned char*>(v.values) + r0 * v.outer * v.n * v.token_bytes;
    for (int64_t r = 0; r < a.rows; ++r) a.positions[r] = v.position(r0 + r);
    cudaError_t err;
    switch (vec) {
      case 16: err = Launch<uint4>(a, stream); break;
      case 8: err = Launch<uint2>(a, stream); break;
      case 4: err = Launch<uint32_t>(a, stream); break;
      case 2: err = Launch<uint16_t>(a, stream); break;
      default: err = Launch<uint8_t>(a, stream); break;
    }
    if (err != cudaSuccess) {
      return Status(Code::kRuntime, std::string("CacheUpdate CUDA launch failed: ") + cudaGetErrorName(err) +
                                        ": " + cudaGetErrorString(err));
    }
  }
  return Status::Ok();
}

}  // namespace ortkv
