// CUDA CacheUpdate: the copies of Note [CacheUpdate layout] / Note [CacheUpdate SBNH]
// (ortkv/cache_update.h) as one kernel launch. Positions are read from DEVICE memory, so the launch
// needs no host copy, no host sync and no allocation (a step can be captured as a CUDA graph); the
// checks that need their values run on the device before any store (Note [CUDA deferred errors]).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "ortkv/cache_update.h"
#include "ortkv/core.h"
#include "cache_write_check.cuh"

namespace ortkv {
namespace {

struct LaunchArgs {
  CacheWriteCheck c;  // the cache, positions and geometry (cache_write_check.cuh)
  const unsigned char* values;
  int64_t token_vecs;
  ortkv_device_error* err;  // word [0]: CacheUpdate (Note [CUDA deferred errors])
  int32_t label;
};

// Every block first checks every row (batch is small: one load per row and thread stride), so no
// block writes unless all rows are good. Then grid.y walks the copies, grid.x the vectors of one copy.
template <typename Vec>
__global__ void CacheUpdateKernel(const LaunchArgs a) {
  const CacheWriteCheck& c = a.c;
  if (__syncthreads_or(ThreadFindsBadWrite(c))) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) ReportBadWrite(c, a.err, a.label);
    return;
  }
  const int64_t run = c.token_major ? a.token_vecs : c.n * a.token_vecs;  // vectors per copy
  const int64_t pairs = CheckPairs(c);
  for (int64_t pair = blockIdx.y; pair < pairs; pair += gridDim.y) {
    const int64_t r = CheckPairRow(c, pair);
    const int64_t pos = c.positions[r * c.position_stride];
    const Vec* src = reinterpret_cast<const Vec*>(a.values) + pair * run;
    Vec* dst;
    if (c.token_major) {
      const int64_t t = pair / c.rows;
      dst = reinterpret_cast<Vec*>(c.cache) + ((pos + t) * c.rows + r) * a.token_vecs;
    } else {
      dst = reinterpret_cast<Vec*>(c.cache) + (pair * c.capacity + pos) * a.token_vecs;
    }
    for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < run;
         k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[k] = src[k];
    }
  }
}

template <typename Vec>
cudaError_t Launch(const LaunchArgs& a, int64_t pairs, cudaStream_t stream) {
  const int64_t run = a.c.token_major ? a.token_vecs : a.c.n * a.token_vecs;
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(64, (run + 31) / 32 * 32)));
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((run + threads - 1) / threads, 1024)),
                  static_cast<unsigned>(std::min<int64_t>(pairs, 65535)));
  CacheUpdateKernel<Vec><<<grid, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

Status CacheUpdateCuda(const CacheUpdateView& v, const DeviceRangeCheck& ranges, void* error_word, int32_t label,
                       void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const uintptr_t align = reinterpret_cast<uintptr_t>(v.cache) | reinterpret_cast<uintptr_t>(v.values) |
                          static_cast<uintptr_t>(v.token_bytes);
  int vec = 16;
  while (vec > 1 && (align % vec) != 0) vec /= 2;
  LaunchArgs a;
  a.c = MakeCacheWriteCheck(v, ranges);
  a.values = static_cast<const unsigned char*>(v.values);
  a.token_vecs = v.token_bytes / vec;
  a.err = static_cast<ortkv_device_error*>(error_word);
  a.label = label;
  cudaError_t err;
  switch (vec) {
    case 16: err = Launch<uint4>(a, v.pairs(), stream); break;
    case 8: err = Launch<uint2>(a, v.pairs(), stream); break;
    case 4: err = Launch<uint32_t>(a, v.pairs(), stream); break;
    case 2: err = Launch<uint16_t>(a, v.pairs(), stream); break;
    default: err = Launch<uint8_t>(a, v.pairs(), stream); break;
  }
  if (err != cudaSuccess) {
    return Status(Code::kRuntime, std::string("CacheUpdate CUDA launch failed: ") + cudaGetErrorName(err) + ": " +
                                      cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace ortkv
