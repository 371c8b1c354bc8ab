// CUDA CacheUpdate: the copies of Note [CacheUpdate layout] (ortkv/cache_update.h) as one kernel
// launch per chunk of up to kRowsPerLaunch rows. Positions are host values (the op declares
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

// grid.y walks the (row, outer) pairs, grid.x the vectors of one pair's contiguous run: one 64-bit
// division per pair and block, none per element.
template <typename Vec>
__global__ void CacheUpdateKernel(const LaunchArgs a) {
  const int64_t run = a.n * a.token_vecs;  // vectors per (row, outer) pair
  const int64_t pairs = a.rows * a.outer;
  for (int64_t pair = blockIdx.y; pair < pairs; pair += gridDim.y) {
    const Vec* src = reinterpret_cast<const Vec*>(a.values) + pair * run;
    Vec* dst = reinterpret_cast<Vec*>(a.cache) + (pair * a.capacity + a.positions[pair / a.outer]) * a.token_vecs;
    for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < run;
         k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[k] = src[k];
    }
  }
}

template <typename Vec>
cudaError_t Launch(const LaunchArgs& a, cudaStream_t stream) {
  const int64_t run = a.n * a.token_vecs;
  const int64_t pairs = a.rows * a.outer;
  const int threads = static_cast<int>(std::min<int64_t>(256, (run + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((run + threads - 1) / threads, 1024)),
                  static_cast<unsigned>(std::min<int64_t>(pairs, 65535)));
  CacheUpdateKernel<Vec><<<grid, threads, 0, stream>>>(a);
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
