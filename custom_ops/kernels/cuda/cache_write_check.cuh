// The device-side checks of a cache write (Note [CUDA deferred errors] in ortkv/core.h), shared by the CUDA
// kernels of CacheUpdate and RotaryCacheUpdate: every block checks every row before any store (position >= 0,
// position + n <= capacity, no write span in a protected range) and writes nothing if one is bad; block 0's
// thread 0 then reports the first bad row into the error word.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ortkv/cache_update.h"
#include "ortkv/core.h"

namespace ortkv {

// One cache written as Note [CacheUpdate layout] / Note [CacheUpdate SBNH] describe (positions in device memory).
struct CacheWriteCheck {
  unsigned char* cache;
  const int64_t* positions;  // device memory
  int64_t position_stride;
  int64_t rows, outer, capacity, n, token_bytes;
  int token_major;
  DeviceRangeCheck ranges;
};

inline CacheWriteCheck MakeCacheWriteCheck(const CacheUpdateView& v, const DeviceRangeCheck& ranges) {
  CacheWriteCheck c;
  c.cache = static_cast<unsigned char*>(v.cache);
  c.positions = v.positions;
  c.position_stride = v.position_stride;
  c.rows = v.rows;
  c.outer = v.outer;
  c.capacity = v.capacity;
  c.n = v.n;
  c.token_bytes = v.token_bytes;
  c.token_major = v.token_major ? 1 : 0;
  c.ranges = ranges;
  return c;
}

__device__ __forceinline__ int64_t CheckPairs(const CacheWriteCheck& a) {
  return a.token_major ? a.rows * a.n : a.rows * a.outer;
}
__device__ __forceinline__ int64_t CheckPairRow(const CacheWriteCheck& a, int64_t pair) {
  return a.token_major ? pair % a.rows : pair / a.outer;
}

// The first byte and one past the last byte that copy `pair` writes (pair < CheckPairs()).
__device__ __forceinline__ void CheckSpan(const CacheWriteCheck& a, int64_t pair, int64_t pos, uint64_t* first,
                                          uint64_t* last) {
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

// 0 when the row's position is good, else ORTKV_DERR_NEGATIVE / ORTKV_DERR_CAPACITY.
__device__ __forceinline__ int CheckPosition(const CacheWriteCheck& a, int64_t p) {
  if (p < 0) return ORTKV_DERR_NEGATIVE;
  if (p > a.capacity - a.n) return ORTKV_DERR_CAPACITY;
  return 0;
}

// 0, or the index + 1 of the first protected range that [first, last) overlaps.
__device__ __forceinline__ int HitRange(const CacheWriteCheck& a, uint64_t first, uint64_t last) {
  for (int i = 0; i < a.ranges.count; ++i)
    if (first < a.ranges.hi[i] && a.ranges.lo[i] < last) return i + 1;
  return 0;
}

// This thread's share of the block's check (threads stride over rows and copies): nonzero when it found a bad
// row. The caller combines the threads with __syncthreads_or before any store.
__device__ __forceinline__ int ThreadFindsBadWrite(const CacheWriteCheck& a) {
  int bad = 0;
  for (int64_t r = threadIdx.x; r < a.rows; r += blockDim.x) bad |= CheckPosition(a, a.positions[r * a.position_stride]);
  if (a.ranges.count > 0) {
    for (int64_t pair = threadIdx.x; pair < CheckPairs(a) && !bad; pair += blockDim.x) {
      const int64_t p = a.positions[CheckPairRow(a, pair) * a.position_stride];
      if (CheckPosition(a, p) != 0) continue;  // counted above
      uint64_t first, last;
      CheckSpan(a, pair, p, &first, &last);
      bad |= HitRange(a, first, last);
    }
  }
  return bad;
}

// One thread, only when the block found a bad row: reports the first bad row (rows in order, positions first,
// then protected ranges) into `err` with `label`; returns false when this cache had none (or err is null).
__device__ inline bool ReportBadWrite(const CacheWriteCheck& a, ortkv_device_error* err, int32_t label) {
  if (err == nullptr) return false;
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t p = a.positions[r * a.position_stride];
    const int c = CheckPosition(a, p);
    if (c == 0) continue;
    err->label = label;
    err->row = static_cast<int32_t>(r);
    err->position = p;
    err->n = a.n;
    err->capacity = a.capacity;
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(&err->code) = c;
    return true;
  }
  for (int64_t pair = 0; pair < CheckPairs(a); ++pair) {
    const int64_t r = CheckPairRow(a, pair);
    const int64_t p = a.positions[r * a.position_stride];
    uint64_t first, last;
    CheckSpan(a, pair, p, &first, &last);
    const int hit = HitRange(a, first, last);
    if (hit == 0) continue;
    err->label = label;
    err->row = static_cast<int32_t>(r);
    err->position = p;
    err->n = a.n;
    err->capacity = a.capacity;
    err->hit_addr = a.ranges.lo[hit - 1];
    err->first = first;
    err->last = last;
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(&err->code) =
        a.ranges.kind[hit - 1] == ORTKV_RANGE_UNCOMMITTED ? ORTKV_DERR_UNCOMMITTED : ORTKV_DERR_READONLY;
    return true;
  }
  return false;
}

}  // namespace ortkv
