// CacheUpdate: framework-free description and kernels.
//
// Note [CacheUpdate layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Any rank >= 3 cache is viewed as four factors around its sequence axis s (1 <= s < rank):
//
//     cache  : [rows = d0] x [outer = d1 .. d(s-1)] x [capacity = ds] x [token = d(s+1) .. ] elements
//     values : [rows]      x [outer]                x [n]              x [token]
//
//   BNSH [batch, heads, capacity, head_size] (seq_axis -2): outer = heads, token = head_size
//   BSNH [batch, capacity, heads, head_size] (seq_axis  1): outer = 1,     token = heads * head_size
//
// For every (row r, outer o) pair the n tokens of `values` are one contiguous run of n * token_bytes
// bytes, and their destination in `cache` is one contiguous run starting at token position[r]:
//
//     dst = cache  + ((r * outer + o) * capacity + position[r]) * token_bytes
//     src = values + ((r * outer + o) * n) * token_bytes
//
// so the update is rows * outer contiguous copies, and nothing outside [position, position + n) of
// any row is touched.
//
// Note [CacheUpdate SBNH]
// ~~~~~~~~~~~~~~~~~~~~~~~
// seq_axis 0 is the token-major layout SBNH [capacity, batch, ...token]: the batch is axis 1 and
// token t of row r lies at ((t * batch) + r) * token_bytes. A prefix of tokens [0, P) of the cache
// is then one contiguous byte range that holds every row's first P tokens, so memory committed by
// token count (an arena growing with the longest row) follows the tokens at any batch size, where a
// batch-major layout needs each row's own prefix committed. The update is rows * n copies of one
// token each (`token_major`): dst = cache + ((position[r] + t) * rows + r) * token_bytes,
// src = values + (t * rows + r) * token_bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ortkv/status.h"

namespace ortkv {

// ONNX TensorProto element types used by the cache ops.
enum ElemType : int32_t { kFloat32 = 1, kInt64 = 7, kFloat16 = 10, kBFloat16 = 16 };
const char* ElemTypeName(int32_t onnx_type);
size_t ElemSize(int32_t onnx_type);  // 0 for a type the cache ops do not take

// A tensor as the adapter sees it: pointer, element type, dims, and the graph value's name.
struct TensorArg {
  const void* data = nullptr;
  int32_t elem_type = 0;
  std::vector<int64_t> dims;
  std::string name;
};

// Everything a CacheUpdate kernel needs; built and validated by PlanCacheUpdate.
struct CacheUpdateView {
  void* cache = nullptr;              // rows * outer * capacity * token_bytes bytes
  const void* values = nullptr;       // rows * outer * n * token_bytes bytes
  const int64_t* positions = nullptr;  // host memory: positions[r * position_stride] for row r
  int64_t position_stride = 0;        // 0: one scalar for every row; 1: one position per row
  int64_t rows = 0;                   // d0
  int64_t outer = 0;                  // product of dims between axis 0 and the sequence axis
  int64_t capacity = 0;               // cache dim at the sequence axis
  int64_t n = 0;                      // values dim at the sequence axis (>= 1)
  int64_t token_bytes = 0;            // product of dims after the sequence axis * element size
  bool token_major = false;           // SBNH (seq_axis 0): one copy per (token, row), Note [CacheUpdate SBNH]

  int64_t position(int64_t r) const { return positions[r * position_stride]; }
  // copies: (row, outer) pairs, or (token, row) pairs when token_major
  int64_t pairs() const { return token_major ? rows * n : rows * outer; }
  int64_t pair_row(int64_t pair) const { return token_major ? pair % rows : pair / outer; }
  int64_t bytes_written() const { return rows * outer * n * token_bytes; }
};

// Validates cache / values / position against the op's contract and fills `view`. Every failure is
// a user-input error whose message names the node, the tensor and the numbers. Nothing is written.
Status PlanCacheUpdate(const std::string& node, const TensorArg& cache, const TensorArg& values,
                       const TensorArg& position, int64_t seq_axis, CacheUpdateView* view);

// The same checks without reading `position`'s values (they are in device memory for the CUDA
// kernel, which checks them on the device: Note [CUDA deferred errors] in ortkv/core.h).
Status PlanCacheUpdateDevice(const std::string& node, const TensorArg& cache, const TensorArg& values,
                             const TensorArg& position, int64_t seq_axis, CacheUpdateView* view);

// The same checks for another op that writes a cache the way CacheUpdate does (RotaryCacheUpdate): `op` names
// the op in the messages; read_positions false for positions in device memory (PlanCacheUpdateDevice).
Status PlanCacheWrite(const char* op, const std::string& node, const TensorArg& cache, const TensorArg& values,
                      const TensorArg& position, int64_t seq_axis, bool read_positions, CacheUpdateView* view);

// [first, last): the bytes that the update writes for one (row, outer) pair (see the Note).
void CacheUpdatePairSpan(const CacheUpdateView& view, int64_t pair, uintptr_t* first, uintptr_t* last);

// CPU: copies pairs [begin, end) (see the Note). Callers split the range across threads.
void CacheUpdateCpu(const CacheUpdateView& view, int64_t begin_pair, int64_t end_pair);

// Ranges the CUDA kernel must not write (write-protected or uncommitted, Note [Arena lease]),
// found on the host for the whole cache and checked on the device against each row's span.
constexpr int kMaxDeviceRanges = 8;
struct DeviceRangeCheck {
  int count = 0;
  uint64_t lo[kMaxDeviceRanges] = {}, hi[kMaxDeviceRanges] = {};
  int32_t kind[kMaxDeviceRanges] = {};  // ORTKV_RANGE_*
};

#if defined(ORTKV_WITH_CUDA)
// CUDA: one launch on `stream` (a cudaStream_t); `view.positions` is DEVICE memory. Every block
// first checks every row (position >= 0, position + n <= capacity, no span in `ranges`) and writes
// nothing if any is bad; block 0 reports the first bad row into `error_word` (device pointer of the
// ortkv_device_error, may be null) with `label`. Returns E_RUNTIME on a launch failure.
Status CacheUpdateCuda(const CacheUpdateView& view, const DeviceRangeCheck& ranges, void* error_word, int32_t label,
                       void* stream);
#endif

}  // namespace ortkv
