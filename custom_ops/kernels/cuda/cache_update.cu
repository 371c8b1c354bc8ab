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

namespace ortkv {
namespace {

struct LaunchArgs {
  unsigned char* cache;
  const unsigned char* values;
  const int64_t* positions;  // device memory
  int64_t position_stride;
  int64_t rows, outer, capacity, n, token_vecs, token_bytes;
  int token_major;
  DeviceRangeCheck ranges;
  ortkv_device_error* err;
  int32_t label;
};

// The first byte and one past the last byte that copy `pair` writes (pair < pairs()).
__device__ __forceinline__ void Span(const LaunchArgs& a, int64_t pair, int64_t pos, uint64_t* first, uint64_t* last) {
  const uint64_t base = reinterpret_cast<uint64_t>(a.cache);
  if (a.token_major) {
    const int64_t r = pair % a.rows, t = pair / a.rows;
    *first = base + static_cast<uint64_t>(((pos + t) * a.rows + r) * a.token_bytes);
    *last = *first + static_cast<uint64_t>(a.token_bytes);
  } else {
    *first = base + static_cast<uint64_t>((pair * a.capacity + pos) * a.token_bytes);
    *last = *first + static_cast<uint64_t>(a.n * a.token_bytes);
  }
}

__device__ __forceinline__ int64_t Pairs(const LaunchArgs& a) { return a.token_major ? a.rows * a.n : a.rows * a.outer; }
__device__ __forceinline__ int64_t PairRow(const LaunchArgs& a, int64_t pair) {
  return a.token_major ? pair % a.rows : pair / a.outer;
}

// 0 when the row's position is good, else ORTKV_DERR_NEGATIVE / ORTKV_DERR_CAPACITY.
__device__ __forceinline__ int CheckPosition(const LaunchArgs& a, int64_t p) {
  if (p < 0) return ORTKV_DERR_NEGATIVE;
  if (p > a.capacity - a.n) return ORTKV_DERR_CAPACITY;
  return 0;
}

// 0, or the index + 1 of the first protected range that [first, last) overlaps.
__device__ __forceinline__ int HitRange(const LaunchArgs& a, uint64_t first, uint64_t last) {
  for (int i = 0; i < a.ranges.count; ++i)
    if (first < a.ranges.hi[i] && a.ranges.lo[i] < last) return i + 1;
  return 0;
}

// Block 0's thread 0, only when the block found a bad row: the first bad row, in row order.
__device__ void Report(const LaunchArgs& a) {
  if (a.err == nullptr) return;  // word [0]: CacheUpdate (Note [CUDA deferred errors])
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t p = a.positions[r * a.position_stride];
    const int c = CheckPosition(a, p);
    if (c == 0) continue;
    a.err->label = a.label;
    a.err->row = static_cast<int32_t>(r);
    a.err->position = p;
    a.err->n = a.n;
    a.err->capacity = a.capacity;
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(&a.err->code) = c;
    return;
  }
  for (int64_t pair = 0; pair < Pairs(a); ++pair) {
    const int64_t r = PairRow(a, pair);
    const int64_t p = a.positions[r * a.position_stride];
    uint64_t first, last;
    Span(a, pair, p, &first, &last);
    const int hit = HitRange(a, first, last);
    if (hit == 0) continue;
    a.err->label = a.label;
    a.err->row = static_cast<int32_t>(r);
    a.err->position = p;
    a.err->n = a.n;
    a.err->capacity = a.capacity;
    a.err->hit_addr = a.ranges.lo[hit - 1];
    a.err->first = first;
    a.err->last = last;
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(&a.err->code) =
        a.ranges.kind[hit - 1] == ORTKV_RANGE_UNCOMMITTED ? ORTKV_DERR_UNCOMMITTED : ORTKV_DERR_READONLY;
    return;
  }
}

// Every block first checks every row (batch is small: one load per row and thread stride), so no
// block writes unless all rows are good. Then grid.y walks the copies, grid.x the vectors of one copy.
template <typename Vec>
__global__ void CacheUpdateKernel(const LaunchArgs a) {
  int bad = 0;
  for (int64_t r = threadIdx.x; r < a.rows; r += blockDim.x)
    bad |= CheckPosition(a, a.positions[r * a.position_stride]);
  if (a.ranges.count > 0) {
    for (int64_t pair = threadIdx.x; pair < Pairs(a) && !bad; pair += blockDim.x) {
      const int64_t p = a.positions[PairRow(a, pair) * a.position_stride];
      if (CheckPosition(a, p) != 0) continue;  // counted above
      uint64_t first, last;
      Span(a, pair, p, &first, &last);
      bad |= HitRange(a, first, last);
    }
  }
  if (__syncthreads_or(bad)) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) Report(a);
    return;
  }
  const int64_t run = a.token_major ? a.token_vecs : a.n * a.token_vecs;  // vectors per copy
  const int64_t pairs = Pairs(a);
  for (int64_t pair = blockIdx.y; pair < pairs; pair += gridDim.y) {
    const int64_t r = PairRow(a, pair);
    const int64_t pos = a.positions[r * a.position_stride];
    const Vec* src = reinterpret_cast<const Vec*>(a.values) + pair * run;
    Vec* dst;
    if (a.token_major) {
      const int64_t t = pair / a.rows;
      dst = reinterpret_cast<Vec*>(a.cache) + ((pos + t) * a.rows + r) * a.token_vecs;
    } else {
      dst = reinterpret_cast<Vec*>(a.cache) + (pair * a.capacity + pos) * a.token_vecs;
    }
    for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < run;
         k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[k] = src[k];
    }
  }
}

template <typename Vec>
cudaError_t Launch(const LaunchArgs& a, int64_t pairs, cudaStream_t stream) {
  const int64_t run = a.token_major ? a.token_vecs : a.n * a.token_vecs;
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
  a.cache = static_cast<unsigned char*>(v.cache);
  a.values = static_cast<const unsigned char*>(v.values);
  a.positions = v.positions;
  a.position_stride = v.position_stride;
  a.rows = v.rows;
  a.outer = v.outer;
  a.capacity = v.capacity;
  a.n = v.n;
  a.token_vecs = v.token_bytes / vec;
  a.token_bytes = v.token_bytes;
  a.token_major = v.token_major ? 1 : 0;
  a.ranges = ranges;
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
