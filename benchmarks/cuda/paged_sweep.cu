// Standalone timing of the CUDA PagedCacheAttention decode (no ONNX Runtime): custom_ops/kernels/cuda/paged_cuda.cu
// called directly through its plan (PlanPagedCacheAttentionCuda) and launch (PagedCacheAttentionCuda), for the
// page formats F16 / INT8 / INT4 (v3, and v2 through ORTKV_CUDA_ATTENTION=v2), pages shuffled or in pool order,
// SmolLM2's heads (9 / 3 / 64), pages of 16 tokens, float16 queries. v3's output is checked against v2's on the
// same pool. The counterpart of attention_sweep.cu (dense): a kernel variant can be timed on a GPU machine
// without installing onnxruntime-gpu or building the package, and since paged_cuda.cu takes minutes to compile,
// the binary can be built on a machine without a GPU and carried over:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DORTKV_WITH_CUDA -I custom_ops/include -I custom_ops/codecs \
//        -I custom_ops/kernels benchmarks/cuda/paged_sweep.cu custom_ops/kernels/cpu/paged_update.cc \
//        -o /tmp/paged_sweep        (paged_update.cc: the plans' shared pool checks)
//   /tmp/paged_sweep [reps] [cases, e.g. 03 or 0,4,9: indices into `cases`] [formats, e.g. F84: F16 INT8 INT4]
//                    [page size]
//
// Run on the H200 on 2026-12-01 and -02 (benchmarks/results/paged_attention_cuda_h200.md): v3 agrees with v2 on F16
// and INT4 pools (max |diff| <= 0.008); on INT8 pools of random bytes (codes up to +-128 times float16 scales up to 1)
// they differ by up to 0.88: such scores are in the hundreds, so the softmax is one-hot and v3's float16 query
// (and P) rounding picks among near ties; the ORT-level tests, tests/test_cuda_paged.py, check both against numpy
// on encoded pages.
// Every figure is from CUDA graph replays of R launches over R distinct pools (>= 256 MiB of F16 pages in all, so
// the pages come from HBM), time per launch = replay time / R, median of `reps` replays. The pools' bytes are
// random float16 values in [-1, 1): valid F16 pages, and for the narrow formats valid codes and finite scales
// (the decode work does not depend on the values).
#include "../../custom_ops/kernels/cuda/paged_cuda.cu"
#include "paged_harness.cuh"
#include "sweep_common.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace ortkv {
namespace {

using sweep::Capture;
using sweep::RandomFill;
using sweep::TimeGraph;

int64_t kPs = 16;  // argv[4]: the page size (a multiple of 16)

struct Case {
  int64_t L, B;
  int64_t C = 0;  // the page table's width in keys (0: L; wider: entries past the row are -1, as in a generation)
  int64_t W() const { return (C > 0 ? C : L) / kPs; }
};

// R pools of one format (each B * L / 16 pages), one directory and page table shared by all of them.
struct Pools {
  std::vector<uint8_t*> pool;
  int64_t* directory = nullptr;
  int32_t* table = nullptr;
  int64_t n_pages = 0, page_bytes = 0;
  void Free() {
    for (auto* p : pool) CK(cudaFree(p));
    CK(cudaFree(directory));
    CK(cudaFree(table));
  }
};

constexpr int64_t kHq = 9, kHkv = 3, kD = 64;

Pools MakePools(codecs::PageFormat f, const Case& c, int R, bool shuffled, cudaStream_t s) {
  Pools p;
  p.n_pages = c.B * c.L / kPs;
  p.page_bytes = static_cast<int64_t>(codecs::LayoutOf(f, codecs::PageShape{kHkv, static_cast<int>(kPs), kD}).page_bytes);
  std::vector<int64_t> dir(2 * p.n_pages);
  for (int64_t i = 0; i < p.n_pages; ++i) {
    dir[2 * i] = static_cast<int64_t>(f);
    dir[2 * i + 1] = i * p.page_bytes;
  }
  std::vector<int32_t> ids(p.n_pages), tab(c.B * c.W(), -1);
  std::iota(ids.begin(), ids.end(), 0);
  if (shuffled) std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
  for (int64_t b = 0; b < c.B; ++b)
    std::copy(ids.begin() + b * (c.L / kPs), ids.begin() + (b + 1) * (c.L / kPs), tab.begin() + b * c.W());
  CK(cudaMalloc(&p.directory, dir.size() * 8));
  CK(cudaMemcpy(p.directory, dir.data(), dir.size() * 8, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&p.table, tab.size() * 4));
  CK(cudaMemcpy(p.table, tab.data(), tab.size() * 4, cudaMemcpyHostToDevice));
  for (int r = 0; r < R; ++r) {
    uint8_t* q = nullptr;
    CK(cudaMalloc(&q, p.n_pages * p.page_bytes));
    RandomFill<<<1024, 256, 0, s>>>(reinterpret_cast<__half*>(q), p.n_pages * p.page_bytes / 2, 11u + r);
    p.pool.push_back(q);
  }
  CK(cudaStreamSynchronize(s));
  return p;
}

struct Node {  // one PagedCacheAttention call's view and workspaces
  PagedAttentionCudaView v;
  std::unique_ptr<PagedReportWords> words;  // the node's report words, as the op's kernel owns them
  void Free() {
    CK(cudaFree(v.partial));
    CK(cudaFree(v.flag));
    CK(cudaFree(v.block_flags));
    words.reset();
  }
};

Node Plan(const Pools& p, int r, const Case& c, const __half* q, __half* out, const int64_t* start, int sms,
          cudaStream_t s) {
  TensorArg tq, tpool, tdir, ttab, tstart;
  tq.data = q, tq.elem_type = kFloat16, tq.dims = {c.B, 1, kHq * kD}, tq.name = "q";
  tpool.data = p.pool[r], tpool.elem_type = 2, tpool.dims = {p.n_pages * p.page_bytes}, tpool.name = "pool";
  tdir.data = p.directory, tdir.elem_type = kInt64, tdir.dims = {p.n_pages, 2}, tdir.name = "directory";
  ttab.data = p.table, ttab.elem_type = 6, ttab.dims = {c.B, c.W()}, ttab.name = "table";
  tstart.data = start, tstart.elem_type = kInt64, tstart.dims = {c.B}, tstart.name = "start";
  PagedAttrs at;
  at.layer = 0, at.num_layers = 1, at.kv_num_heads = kHkv, at.page_size = kPs;
  Node n;
  OK(PlanPagedCacheAttentionCuda("sweep", tq, tpool, tdir, ttab, tstart, kHq, at, 0.0f, out, sms, &n.v));
  const size_t pb = std::max<size_t>(n.v.partial_bytes(), 16), fb = std::max<size_t>(n.v.block_flag_bytes(), 16);
  CK(cudaMalloc(&n.v.partial, pb));
  CK(cudaMalloc(&n.v.flag, 16));
  CK(cudaMalloc(&n.v.block_flags, fb));
  n.words = std::make_unique<PagedReportWords>();  // Note [Paged CUDA last block reports]
  OK(n.words->For(s, &n.v.report_words));
  return n;
}

int Main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  if (argc > 4) kPs = std::atoll(argv[4]);
  const char* only = argc > 2 ? argv[2] : nullptr;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // INT8 v3u / v3us: the uniform INT8 kernel (Note [Paged CUDA uniform INT8]), unless ORTKV_PAGED_UNIFORM_INT8=0;
  // its single rows (8192 1, 32768 1, ...) in 64-key steps unless ORTKV_PAGED_INT8_ROW_STEP=32 (builds before
  // a4265bd: only under ORTKV_PAGED_INT8_ROW_STEP=64)
  const Case cases[] = {{8192, 1}, {8192, 8}, {32768, 1}, {32768, 8}, {16, 1}, {1024, 1}, {16, 8},  // 4-6: short rows
                        {16, 1, 2048}, {128, 1, 2048},  // 7-8: a short row in a table of 2K keys
                        {128, 1},  // 9
                        {1024, 1, 2048}, {512, 1}, {1024, 8},  // 10-12: Note [Cluster split chunks]
                        {144, 8, 256},  // 13: a decode step's rows at batch 8 (one split)
                        {16384, 8}};  // 14: between the uniform INT4 kernel's two rings (Note [Paged CUDA uniform INT4])
  using codecs::PageFormat;
  const PageFormat formats[] = {PageFormat::kF16, PageFormat::kInt8, PageFormat::kInt4};
  std::printf("pages of %lld tokens\n%6s %3s %3s | %-22s %9s %8s\n", (long long)kPs, "L", "B", "R", "kernel", "us", "GB/s");
  for (int ci = 0; ci < static_cast<int>(sizeof(cases) / sizeof(cases[0])); ++ci) {
    if (only != nullptr && !sweep::Selected(only, ci)) continue;
    const Case c = cases[ci];
    const double f16_bytes = 2.0 * c.B * c.L * kHkv * kD * 2;
    const int R = std::min(256, std::max<int>(8, static_cast<int>(std::ceil(256.0 * 1048576 / f16_bytes))));
    __half *q, *out;
    int64_t* start;
    CK(cudaMalloc(&q, c.B * kHq * kD * 2));
    CK(cudaMalloc(&out, c.B * kHq * kD * 2));
    RandomFill<<<64, 256, 0, s>>>(q, c.B * kHq * kD, 3u);
    std::vector<int64_t> st(c.B, c.L - 1);
    CK(cudaMalloc(&start, c.B * 8));
    CK(cudaMemcpy(start, st.data(), c.B * 8, cudaMemcpyHostToDevice));
    for (const PageFormat f : formats) {
      if (argc > 3 && std::strchr(argv[3], f == PageFormat::kF16 ? 'F' : f == PageFormat::kInt8 ? '8' : '4') == nullptr)
        continue;  // argv[3]: the formats to run, e.g. F84 (all) or F
      for (const bool shuffled : {true, false}) {
        if (!shuffled && f != PageFormat::kF16) continue;
        Pools p = MakePools(f, c, R, shuffled, s);
        std::vector<Node> nodes;
        for (int r = 0; r < R; ++r) nodes.push_back(Plan(p, r, c, q, out, start, sms, s));
        const char* fname = f == PageFormat::kF16 ? "F16" : f == PageFormat::kInt8 ? "INT8" : "INT4";
        // v3 against v2 on pool 0
        std::vector<__half> o2(c.B * kHq * kD), o3(o2.size());
        setenv("ORTKV_CUDA_ATTENTION", "v2", 1);
        OK(PagedCacheAttentionCuda(nodes[0].v, s));
        CK(cudaMemcpyAsync(o2.data(), out, o2.size() * 2, cudaMemcpyDeviceToHost, s));
        setenv("ORTKV_CUDA_ATTENTION", "v3", 1);
        OK(PagedCacheAttentionCuda(nodes[0].v, s));
        CK(cudaMemcpyAsync(o3.data(), out, o3.size() * 2, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        float worst = 0, worst_u = 0;
        for (size_t i = 0; i < o2.size(); ++i) worst = std::max(worst, std::fabs(__half2float(o2[i]) - __half2float(o3[i])));
        {  // Note [Paged CUDA uniform 16-bit] / [... uniform INT4] / [... uniform INT8]: page_format set
          nodes[0].v.page_format = static_cast<int32_t>(f);
          OK(PagedCacheAttentionCuda(nodes[0].v, s));
          CK(cudaMemcpyAsync(o3.data(), out, o3.size() * 2, cudaMemcpyDeviceToHost, s));
          CK(cudaStreamSynchronize(s));
          nodes[0].v.page_format = -1;
          for (size_t i = 0; i < o2.size(); ++i)
            worst_u = std::max(worst_u, std::fabs(__half2float(o2[i]) - __half2float(o3[i])));
        }
        // "s": the node's static_tables set (Note [Paged CUDA static tables]: no late-page check after the wait)
        for (const char* level : {"v3u", "v3us", "v3", "v3s", "v2"}) {
          if (!shuffled && std::strcmp(level, "v2") == 0) continue;
          const bool u = std::strncmp(level, "v3u", 3) == 0, st = level[std::strlen(level) - 1] == 's';
          for (auto& n : nodes) {
            n.v.page_format = u ? static_cast<int32_t>(f) : -1;
            n.v.static_tables = st;
          }
          setenv("ORTKV_CUDA_ATTENTION", u || st ? "v3" : level, 1);  // read at each launch, so during the capture
          const float us = Capture(s, R, reps, [&](int r) { OK(PagedCacheAttentionCuda(nodes[r].v, s)); });
          char name[64];
          std::snprintf(name, sizeof name, "%s %s%s%s", fname, level, shuffled ? "" : " in order",
                        c.C > 0 ? (" table " + std::to_string(c.C)).c_str() : "");
          const double bytes = static_cast<double>(c.B) * (c.L / kPs) * p.page_bytes;  // pages read per node
          std::printf("%6lld %3lld %3d | %-22s %9.2f %8.0f   (v3 vs v2 max |diff| %.5f)\n", (long long)c.L,
                      (long long)c.B, R, name, us, bytes / (us * 1e3), u ? worst_u : worst);
        }
        unsetenv("ORTKV_CUDA_ATTENTION");
        for (auto& n : nodes) n.Free();
        p.Free();
      }
    }
    CK(cudaFree(q));
    CK(cudaFree(out));
    CK(cudaFree(start));
  }
  return 0;
}

}  // namespace
}  // namespace ortkv

int main(int argc, char** argv) { return ortkv::Main(argc, argv); }
