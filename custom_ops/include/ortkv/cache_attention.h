// CacheAttention: grouped-query attention of T new queries over a dense cache read in place.
//
// Note [CacheAttention]
// ~~~~~~~~~~~~~~~~~~~~~
// query  [B, T, Hq * D]; key/value cache [B, C, Hkv, D] (BSNH, seq_axis 1) or [B, Hkv, C, D] (BNSH);
// start  [B] (or a scalar): the position of the first new token of each row, i.e. the number of
// tokens the row held before this block (CacheUpdate wrote the block at [start, start + T)).
// Query t of row b attends to keys [0, start_b + t] (causal inside the new block); nothing past a
// row's own valid length is read, so rows of different lengths share one batch and no Slice or
// Concat of the cache is needed. Query head h reads KV head h / (Hq / Hkv).
//   out[b, t, h*D:(h+1)*D] = sum_j softmax_j(scale * q . k_j) v_j
#pragma once
#include <cstdint>
#include <string>

#include "ortkv/cache_update.h"
#include "ortkv/status.h"

namespace ortkv {

struct CacheAttentionView {
  const float* q = nullptr;    // [B, T, Hq * D]
  const float* k = nullptr;    // cache, see strides
  const float* v = nullptr;    // cache, same layout as k
  float* out = nullptr;        // [B, T, Hq * D]
  const int64_t* start = nullptr;
  int64_t start_stride = 0;    // 0: one start for all rows; 1: one per row
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, D = 0, C = 0;
  int64_t row_stride = 0, tok_stride = 0, head_stride = 0;  // elements, in k and v
  float scale = 1.0f;

  int64_t tasks() const { return B * Hkv * T; }  // one task: one (row, kv head, query token)
};

// Validates inputs and fills `view` (user-input errors name the node and the numbers).
Status PlanCacheAttention(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                          const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, float scale,
                          int64_t seq_axis, float* out, CacheAttentionView* view);

// CPU: tasks [begin, end); `scratch` holds (Hq / Hkv) * C floats.
void CacheAttentionCpu(const CacheAttentionView& view, int64_t begin, int64_t end, float* scratch);

}  // namespace ortkv
