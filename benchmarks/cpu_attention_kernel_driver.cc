// The CPU CacheAttention kernel functions driven from C++, without ORT or Python: one decode token of
// SmolLM2-135M shapes (9 query heads, 3 KV heads, head size 64, float32 BNSH) over L keys, B rows, on
// 1 or 2 std::threads taking tasks from one counter. cold: rotating over >= 256 MiB of K/V (a model's
// layers, read from DRAM); hot: the first layer repeated. Prints GB/s of K+V read per call (medians of
// 15 passes). ORTKV_CPU_ISA=baseline|avx2|avx512 forces a kernel copy (Note [CPU attention ISA dispatch]).
// Used for the figures in Note [CPU attention native width]. Build from the repository root:
//
//   g++ -O3 -std=c++17 -pthread -Icustom_ops/include -Icustom_ops/kernels/cpu \
//       benchmarks/cpu_attention_kernel_driver.cc custom_ops/kernels/cpu/cache_attention.cc \
//       custom_ops/kernels/cache_update_plan.cc -o attn_driver
//   ./attn_driver KEYS THREADS [BATCH]      e.g. ./attn_driver 8192 1
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "attention_block.h"
#include "cpu_attention_driver.h"
#include "ortkv/cache_attention.h"

using namespace ortkv;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s KEYS THREADS [BATCH]\n", argv[0]);
    return 2;
  }
  const int64_t L = std::atoll(argv[1]);
  const int threads = std::atoi(argv[2]);
  const int64_t B = argc > 3 ? std::atoll(argv[3]) : 1;
  const int64_t Hq = ortkv_drivers::kHq, Hkv = ortkv_drivers::kHkv, D = ortkv_drivers::kD;
  const size_t per = static_cast<size_t>(B * Hkv * L * D);
  const int layers = static_cast<int>(std::max<int64_t>(3, (int64_t{256} << 20) / static_cast<int64_t>(per * 8)));
  std::vector<std::vector<float>> ks(layers), vs(layers);
  for (int i = 0; i < layers; ++i) ks[i].assign(per, 0.01f * (i % 7)), vs[i].assign(per, 0.5f);
  std::vector<float> q(B * Hq * D, 0.1f), out(B * Hq * D);
  std::vector<int64_t> start(B, L - 1);
  std::vector<float> partial;
  auto run = [&](int i) {
    CacheAttentionView a =
        ortkv_drivers::DenseDecodeView(q.data(), ks[i].data(), vs[i].data(), out.data(), start.data(), B, L, partial);
    std::atomic<int64_t> next{0};
    auto work = [&] {
      std::vector<float> sc(a.scratch_floats());
      for (int64_t t; (t = next++) < a.tasks();) CacheAttentionCpu(a, t, t + 1, sc.data());
    };
    if (threads <= 1) {
      work();
    } else {
      std::thread th(work);
      work();
      th.join();
    }
    CacheAttentionCombine(a);
  };
  const auto [cold, hot] = ortkv_drivers::AlternatingMedians(15, layers, run, layers, [&](int) { run(0); });
  const double bytes = 2.0 * static_cast<double>(per) * 4;
  std::printf("L=%lld B=%lld threads=%d isa=%s: cold %.1f GB/s (%.0f us per call), hot %.1f GB/s\n",
              static_cast<long long>(L), static_cast<long long>(B), threads,
              attn_cpu::CpuIsaName(attn_cpu::CpuIsaOnce().isa), bytes / cold / 1e9, cold * 1e6,
              bytes / hot / 1e9);
  return 0;
}
