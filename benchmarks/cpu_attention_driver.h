// Shared by the CPU attention drivers (cpu_attention_kernel_driver.cc, cpu_paged_attention_driver.cc): the dense
// CacheAttention view of one decode token of SmolLM2-135M shapes over L keys of B rows of float32 BNSH caches.
#pragma once
#include <algorithm>
#include <vector>

#include "attention_block.h"
#include "ortkv/cache_attention.h"

namespace ortkv_drivers {

constexpr int64_t kHq = 9, kHkv = 3, kD = 64;

// q [B, kHq * kD], k / v [B, kHkv, L, kD], out like q; start[b] = L - 1; `partial` is resized to the split-K
// workspace the view needs.
inline ortkv::CacheAttentionView DenseDecodeView(const float* q, const float* k, const float* v, float* out,
                                                 const int64_t* start, int64_t B, int64_t L,
                                                 std::vector<float>& partial) {
  ortkv::CacheAttentionView a;
  a.q = q, a.k = k, a.v = v, a.out = out;
  a.start = start, a.start_stride = 1;
  a.B = B, a.T = 1, a.Hq = kHq, a.Hkv = kHkv, a.D = kD, a.C = L;
  a.row_stride = kHkv * L * kD, a.tok_stride = kD, a.head_stride = L * kD, a.scale = 0.125f;
  a.splits = ortkv::attn_cpu::CpuSplits(a.units(), L);
  partial.resize(std::max<int64_t>(1, a.partial_floats()));
  a.partial = partial.data();
  return a;
}

}  // namespace ortkv_drivers
