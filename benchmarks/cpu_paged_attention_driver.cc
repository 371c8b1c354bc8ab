// The CPU PagedCacheAttention kernel driven from C++, without ORT or Python, next to dense CacheAttention on the
// same shapes in the same process: one decode token of SmolLM2-135M shapes (9 query heads, 3 KV heads, head size
// 64) over L keys, B rows, on 1 or 2 threads taking tasks from one counter, dense and paged calls alternating
// pass by pass. Each side rotates over >= 256 MiB of its own caches / pools (a model's layers: K/V come from DRAM);
// the pages (of PAGE_SIZE tokens, shuffled in the pool) hold random floats in [-1, 1) encoded by the format's codec.
// Prints us per call (medians of 15 passes) and paged / dense. ORTKV_CPU_ISA=baseline|avx2|avx512 forces a kernel
// copy (Note [CPU attention ISA dispatch]). Build from the repository root:
//
//   g++ -O3 -std=c++17 -pthread -Icustom_ops/include -Icustom_ops/codecs -Icustom_ops/kernels/cpu \
//       benchmarks/cpu_paged_attention_driver.cc custom_ops/kernels/cpu/paged_attention.cc \
//       custom_ops/kernels/cpu/paged_update.cc custom_ops/kernels/cpu/cache_attention.cc \
//       custom_ops/kernels/cache_update_plan.cc -o paged_driver
//   ./paged_driver KEYS THREADS BATCH FORMATS [PAGE_SIZE] [LAYERS]    e.g. ./paged_driver 8192 2 1 F16,INT8,INT4 16
//
// LAYERS (default 1): each pool slot holds that many layers' pages back to back, as a model's pool does (layer l at
// l * page_bytes), and the calls rotate over the layers: a layer's pages then lie LAYERS page sizes apart. 1.5K keys
// x 1 row, pages of 16, LAYERS 1 vs 30 (SmolLM2's), five alternated runs on a 2-core AMD EPYC (AVX2) VM: F16
// 0.87-1.02 vs 0.84-1.01, INT4 1.11-1.19 vs 1.10-1.16 (no difference beyond the runs' spread).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention_block.h"
#include "codecs.h"
#include "cpu_attention_driver.h"
#include "ortkv/cache_attention.h"
#include "ortkv/paged.h"

using namespace ortkv;
using codecs::PageFormat;
using ortkv_drivers::AlternatingMedians;
using ortkv_drivers::DenseDecodeView;
using ortkv_drivers::kD;
using ortkv_drivers::kHkv;
using ortkv_drivers::kHq;

namespace {

// One helper thread for the whole run (a thread started per call would cost more than a short call), spinning
// between calls: Go(f) runs f on this thread and on the helper (threads == 2) and returns when both are done.
class Pair {
 public:
  explicit Pair(int threads) : threads_(threads) {
    if (threads_ > 1) helper_ = std::thread([this] { Loop(); });
  }
  ~Pair() {
    if (threads_ > 1) {
      quit_ = true;
      gen_.fetch_add(1);
      helper_.join();
    }
  }
  template <typename F>
  void Go(F&& f) {
    if (threads_ <= 1) return f();
    job_ = f;
    done_.store(false);
    gen_.fetch_add(1);
    f();
    while (!done_.load()) {
    }
  }

 private:
  void Loop() {
    int64_t seen = 0;
    for (;;) {
      while (gen_.load() == seen) {
      }
      seen = gen_.load();
      if (quit_) return;
      job_();
      done_.store(true);
    }
  }
  int threads_;
  std::thread helper_;
  std::function<void()> job_;
  std::atomic<int64_t> gen_{0};
  std::atomic<bool> done_{true}, quit_{false};
};

template <typename View, typename Run>
void RunTasks(const View& a, Pair& pair, Run run) {
  std::atomic<int64_t> next{0};
  pair.Go([&] {
    thread_local std::vector<float> sc;
    sc.resize(std::max<size_t>(sc.size(), a.scratch_floats()));
    for (int64_t t; (t = next++) < a.tasks();) run(a, t, t + 1, sc.data());
  });
}

bool FormatOf(const std::string& s, PageFormat* f) {
  for (int i = 0; i < codecs::kNumPageFormats; ++i)
    if (s == codecs::FormatName(static_cast<PageFormat>(i))) return *f = static_cast<PageFormat>(i), true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s KEYS THREADS BATCH FORMATS [PAGE_SIZE] [LAYERS]\n", argv[0]);
    return 2;
  }
  const int64_t L = std::atoll(argv[1]), B = std::atoll(argv[3]);
  const int threads = std::atoi(argv[2]);
  const int64_t ps = argc > 5 ? std::atoll(argv[5]) : 16;
  const int64_t NL = argc > 6 ? std::atoll(argv[6]) : 1;
  std::vector<PageFormat> formats;
  for (const char* p = argv[4]; *p;) {
    const char* e = std::strchr(p, ',');
    const std::string name = e ? std::string(p, e) : std::string(p);
    PageFormat f;
    if (!FormatOf(name, &f)) {
      std::fprintf(stderr, "unknown format %s\n", name.c_str());
      return 2;
    }
    formats.push_back(f);
    p = e ? e + 1 : p + name.size();
  }
  Pair pair(threads);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<float> q(B * kHq * kD), out(B * kHq * kD);
  for (auto& x : q) x = uni(rng);
  std::vector<int64_t> start(B, L - 1);

  // dense: float32 BNSH caches
  const size_t per = static_cast<size_t>(B * kHkv * L * kD);
  const int dense_layers = static_cast<int>(std::max<int64_t>(3, (int64_t{256} << 20) / static_cast<int64_t>(per * 8)));
  std::vector<std::vector<float>> ks(dense_layers), vs(dense_layers);
  for (int i = 0; i < dense_layers; ++i) {
    ks[i].resize(per), vs[i].resize(per);
    for (size_t j = 0; j < per; ++j) ks[i][j] = uni(rng), vs[i][j] = uni(rng);
  }
  std::vector<float> partial;
  auto dense = [&](int i) {
    const CacheAttentionView a = DenseDecodeView(q.data(), ks[i].data(), vs[i].data(), out.data(), start.data(), B, L,
                                                 partial);
    RunTasks(a, pair, CacheAttentionCpu);
    CacheAttentionCombine(a);
  };

  std::printf("L=%lld B=%lld threads=%d page_size=%lld isa=%s\n", static_cast<long long>(L),
              static_cast<long long>(B), threads, static_cast<long long>(ps),
              attn_cpu::CpuIsaName(attn_cpu::CpuIsaOnce().isa));
  for (const PageFormat f : formats) {
    const codecs::PageShape shape{static_cast<int32_t>(kHkv), static_cast<int32_t>(ps), static_cast<int32_t>(kD)};
    const int64_t page_bytes = static_cast<int64_t>(codecs::LayoutOf(f, shape).page_bytes);
    const int64_t W = L / ps, n_pages = B * W;
    const int layers = static_cast<int>(std::max<int64_t>(3, (int64_t{256} << 20) / (n_pages * page_bytes)));
    // 64 distinct encoded pages, copied over every pool
    std::vector<std::vector<uint8_t>> tmpl(64, std::vector<uint8_t>(page_bytes));
    std::vector<float> vals(2 * kHkv * ps * kD);
    for (auto& t : tmpl) {
      for (auto& x : vals) x = uni(rng);
      codecs::PageView pv;
      pv.base = t.data(), pv.format = f, pv.shape = shape, pv.layout = codecs::LayoutOf(f, shape);
      const Status s = codecs::EncodePage(pv, vals.data());
      if (!s.ok()) {
        std::fprintf(stderr, "%s\n", s.message().c_str());
        return 1;
      }
    }
    const int64_t slot = NL * page_bytes;
    std::vector<std::vector<uint8_t>> pools((layers + NL - 1) / NL, std::vector<uint8_t>(n_pages * slot));
    for (auto& p : pools)
      for (int64_t i = 0; i < n_pages * NL; ++i)
        std::memcpy(p.data() + i * page_bytes, tmpl[i % 64].data(), page_bytes);
    std::vector<int64_t> dir(2 * n_pages);
    for (int64_t i = 0; i < n_pages; ++i) dir[2 * i] = static_cast<int64_t>(f), dir[2 * i + 1] = i * slot;
    std::vector<int32_t> table(n_pages);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    auto paged = [&](int i) {
      TensorArg tq, tpool, tdir, ttab, tstart;
      tq.data = q.data(), tq.elem_type = kFloat32, tq.dims = {B, 1, kHq * kD}, tq.name = "q";
      tpool.data = pools[i / NL].data(), tpool.elem_type = 2, tpool.dims = {n_pages * slot}, tpool.name = "pool";
      tdir.data = dir.data(), tdir.elem_type = kInt64, tdir.dims = {n_pages, 2}, tdir.name = "directory";
      ttab.data = table.data(), ttab.elem_type = 6, ttab.dims = {B, W}, ttab.name = "table";
      tstart.data = start.data(), tstart.elem_type = kInt64, tstart.dims = {B}, tstart.name = "start";
      PagedAttrs at;
      at.layer = i % NL, at.num_layers = NL, at.kv_num_heads = kHkv, at.page_size = ps;
      PagedAttentionView a;
      const Status s =
          PlanPagedCacheAttention("driver", tq, tpool, tdir, ttab, tstart, kHq, at, 0.125f, out.data(), &a);
      if (!s.ok()) {
        std::fprintf(stderr, "%s\n", s.message().c_str());
        std::exit(1);
      }
      partial.resize(std::max<int64_t>(1, a.partial_floats()));
      a.partial = partial.data();
      RunTasks(a, pair, PagedCacheAttentionCpu);
      PagedCacheAttentionCombine(a);
    };
    const auto [d, p] = AlternatingMedians(15, dense_layers, dense, layers, paged);
    std::printf("  %-9s dense %8.1f us  paged %8.1f us  paged / dense %.2f\n", codecs::FormatName(f), d * 1e6,
                p * 1e6, p / d);
  }
  return 0;
}
