// Shared by the CPU attention drivers (cpu_attention_kernel_driver.cc, cpu_paged_attention_driver.cc): the dense
// CacheAttention view of one decode token of SmolLM2-135M shapes over L keys of B rows of float32 BNSH caches.
#pragma once
#include <algorithm>
#include <chrono>
#include <utility>
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

// `passes` passes of na calls fa(i) then nb calls fb(i) (i = 0, 1, ...), the two alternating pass by pass; the
// medians over the passes of each side's seconds per call.
template <class FA, class FB>
std::pair<double, double> AlternatingMedians(int passes, int na, FA fa, int nb, FB fb) {
  std::vector<double> ta, tb;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < na; ++i) fa(i);
    const auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < nb; ++i) fb(i);
    const auto t2 = std::chrono::steady_clock::now();
    ta.push_back(std::chrono::duration<double>(t1 - t0).count() / na);
    tb.push_back(std::chrono::duration<double>(t2 - t1).count() / nb);
  }
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  return {ta[ta.size() / 2], tb[tb.size() / 2]};
}

}  // namespace ortkv_drivers
