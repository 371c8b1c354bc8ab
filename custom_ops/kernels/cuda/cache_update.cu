// CUDA CacheUpdate: the copies of Note [CacheUpdate layout] (ortkv/cache_update.h) as one kernel
// launch per chunk of up to 256 rows. Positions are host values (the op declares `position` as a CPU
// input) and travel in the kernel's parameter block, so a launch needs no host-to-device copy and no
// allocation. The block is sized to the batch (8, 64 or 256 positions) because a larger parameter
// block costs launch latency, which dominates a decode step's small copy.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "ortkv/cache_update.h"

namespace ortkv {
namespace {

template <int kMaxRows>
struct LaunchArgs {
  unsigned char* cache;         // chunk's first row
  const unsigned char* values;  // chunk's first row
  int64_t rows, outer, capacity, run, token_vecs;  // run: vectors per (row, outer) pair
  int64_t positions[kMaxRows];
};

// grid.y walks the (row, outer) pairs, grid.x the vectors of one pair's contiguous run: one 64-bit
// division per pair and block, none per element.
template <typename Vec, int kMaxRows>
__global__ void CacheUpdateKernel(const LaunchArgs<kMaxRows> a) {
  const int64_t pairs = a.rows * a.outer;
  for (int64_t pair = blockIdx.y; pair < pairs; pair += gridDim.y) {
    const Vec* src = reinterpret_cast<const Vec*>(a.values) + pair * a.run;
    Vec* dst = reinterpret_cast<Vec*>(a.cache) + (pair * a.capacity + a.positions[pair / a.outer]) * a.token_vecs;
    for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < a.run;
         k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[k] = src[k];
    }
  }
}

template <typename Vec, int kMaxRows>
cudaError_t Launch(const CacheUpdateView& v, int64_t r0, int64_t rows, int vec, cudaStream_t stream) {
  LaunchArgs<kMaxRows> a;
  a.rows = rows;
  a.outer = v.outer;
  a.capacity = v.capacity;
  a.token_vecs = v.token_bytes / vec;
  a.run = v.n * a.token_vecs;
  a.cache = static_cast<unsigned char*>(v.cache) + r0 * v.outer * v.capacity * v.token_bytes;
  a.values = static_cast<const unsigned char*>(v.values) + r0 * v.outer * v.n * v.token_bytes;
  for (int64_t r = 0; r < rows; ++r) a.positions[r] = v.position(r0 + r);
  const int64_t pairs = rows * v.outer;
  const int threads = static_cast<int>(std::min<int64_t>(256, (a.run + 31) / 32 * 32));
  const int64_t blocks_x = std::min<int64_t>((a.run + threads - 1) / threads, 1024);
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, blocks_x)),
                  static_cast<unsigned>(std::min<int64_t>(pairs, 65535)));
  CacheUpdateKernel<Vec, kMaxRows><<<grid, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <int kMaxRows>
cudaError_t LaunchVec(const CacheUpdateView& v, int64_t r0, int64_t rows, int vec, cudaStream_t s) {
  switch (vec) {
    case 16: return Launch<uint4, kMaxRows>(v, r0, rows, vec, s);
    case 8: return Launch<uint2, kMaxRows>(v, r0, rows, vec, s);
    case 4: return Launch<uint32_t, kMaxRows>(v, r0, rows, vec, s);
    case 2: return Launch<uint16_t, kMaxRows>(v, r0, rows, vec, s);
    default: return Launch<uint8_t, kMaxRows>(v, r0, rows, vec, s);
  }
}

}  // namespace

Status CacheUpdateCuda(const CacheUpdateView& v, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const uintptr_t align = reinterpret_cast<uintptr_t>(v.cache) | reinterpret_cast<uintptr_t>(v.values) |
                          static_cast<uintptr_t>(v.token_bytes);
  int vec = 16;
  while (vec > 1 && (align % vec) != 0) vec /= 2;
  constexpr int64_t kChunk = 256;
  for (int64_t r0 = 0; r0 < v.rows; r0 += kChunk) {
    const int64_t rows = std::min<int64_t>(kChunk, v.rows - r0);
    cudaError_t err = rows <= 8    ? LaunchVec<8>(v, r0, rows, vec, stream)
                      : rows <= 64 ? LaunchVec<64>(v, r0, rows, vec, stream)
                                   : LaunchVec<256>(v, r0, rows, vec, stream);
    if (err != cudaSuccess) {
      return Status(Code::kRuntime, std::string("CacheUpdate CUDA launch failed: ") + cudaGetErrorName(err) +
                                        ": " + cudaGetErrorString(err));
    }
  }
  return Status::Ok();
}

}  // namespace ortkv
