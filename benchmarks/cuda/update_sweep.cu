// Standalone timing of the CUDA PagedRotaryCacheUpdate of a decode step (no ONNX Runtime): the resolved update of
// custom_ops/kernels/cuda/paged_cuda.cu (Note [Paged CUDA resolved update]) called through its plan
// (PlanPagedCacheUpdateCuda) and launch (PagedCacheUpdateCuda), as the paged decoder runs it: SmolLM2's heads
// (9 / 3 / 64), qkv rows with the query, key and value columns, rotary tables, F16 pages of 16 tokens, one token per
// row written at position L - 1 of rows of L tokens. The counterpart of paged_sweep.cu for the update:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DORTKV_WITH_CUDA -I custom_ops/include -I custom_ops/codecs \
//        -I custom_ops/kernels benchmarks/cuda/update_sweep.cu custom_ops/kernels/cpu/paged_update.cc \
//        -o /tmp/update_sweep
//   /tmp/update_sweep [reps] [batch sizes, e.g. 1,8] [L]
//
// Rows per case (us per launch, CUDA graph replays of R launches, median of `reps`):
//   plain / early / two: the update launched plainly (ORTKV_CUDA_PAGED_UPDATE=plain), as a programmatic dependent
//     (the default), and as the memset + check + store kernels (=two), each launch after the last (a chain of
//     updates: an early launch may overlap the update before it);
//   after spin: what the update adds behind a kernel that lets its dependents start at once and then runs ~spin ns
//     on every SM (a decode layer's QKV projection does that: Note [Linear GEMV]), i.e. the graph [spin, update] x R
//     minus [spin, nop] x R, where nop is an empty programmatic dependent: the part of the update the projection
//     does not hide;
//   floor: the same for a kernel that does the dense update's work (each row's position, its qkv row rotated into
//     a dense cache and the query output; no checks), launched the same way: the least an update can add there.
// The update's output is checked once against the floor's (the pages' written rows against the dense rows, and
// q_out).
#include "../../custom_ops/kernels/cuda/paged_cuda.cu"
#include "paged_harness.cuh"
#include "sweep_common.cuh"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace ortkv {
namespace {

constexpr int64_t kHq = 9, kHkv = 3, kD = 64, kPs = 16, kW = (kHq + 2 * kHkv) * kD;

__device__ __forceinline__ unsigned long long Now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The kernel before: lets its dependents start, then spins `ns` (every block), then waits for the one before it.
__global__ void Spin(int ns, unsigned long long* sink) {
  asm volatile("griddepcontrol.launch_dependents;" :::);
  const unsigned long long t0 = Now();
  while (Now() - t0 < static_cast<unsigned long long>(ns)) {
  }
  if (threadIdx.x == 0) sink[blockIdx.x] += 1;
}

__global__ void Nop() {
  asm volatile("griddepcontrol.launch_dependents;" :::);
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The dense update's work without its checks: block b = row b; each thread one (head, pair) of the row's qkv:
// the query and the key rotated by the position's tables, the value copied; keys / values into a dense
// [B, cap, Hkv, D] cache, the query into q_out.
__global__ void Floor(const __half* qkv, const __half* cos, const __half* sin, const int64_t* pos, __half* kc,
                      __half* vc, __half* q_out, int64_t cap) {
  asm volatile("griddepcontrol.launch_dependents;" :::);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int64_t b = blockIdx.x, p = pos[b];
  const __half* row = qkv + b * kW;
  for (int i = threadIdx.x; i < kW / 2; i += blockDim.x) {
    const int c = 2 * i, head = c / kD, d = c % kD;
    const float x0 = __half2float(row[c]), x1 = __half2float(row[c + 1]);
    float y0 = x0, y1 = x1;
    if (head < kHq + kHkv) {  // rotated (interleaved pairs)
      const float co = __half2float(cos[p * (kD / 2) + d / 2]), si = __half2float(sin[p * (kD / 2) + d / 2]);
      y0 = x0 * co - x1 * si;
      y1 = x0 * si + x1 * co;
    }
    __half* out = head < kHq ? q_out + b * kHq * kD + head * kD + d
                  : head < kHq + kHkv ? kc + ((b * cap + p) * kHkv + (head - kHq)) * kD + d
                                      : vc + ((b * cap + p) * kHkv + (head - kHq - kHkv)) * kD + d;
    out[0] = __float2half(y0);
    out[1] = __float2half(y1);
  }
}

cudaLaunchConfig_t Cfg(unsigned grid, unsigned block, cudaStream_t s, cudaLaunchAttribute* at) {
  cudaLaunchConfig_t c{};
  c.gridDim = grid;
  c.blockDim = block;
  c.stream = s;
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = at;
  c.numAttrs = 1;
  return c;
}

int Main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  std::vector<int64_t> batches = {1, 8};
  if (argc > 2) {
    batches.clear();
    for (const char* p = argv[2]; *p != '\0';) {
      char* end = nullptr;
      batches.push_back(std::strtoll(p, &end, 10));
      p = *end == ',' ? end + 1 : end;
    }
  }
  const int64_t L = argc > 3 ? std::atoll(argv[3]) : 144;  // a decode step's rows: 16 prompt + 128 new tokens
  const int spin_ns = 4000, R = 64;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned long long* sink = nullptr;
  CK(cudaMalloc(&sink, sms * 8));
  std::printf("rows of %lld tokens, pages of %lld, heads %lld / %lld / %lld, R %d, spin %d ns\n", (long long)L,
              (long long)kPs, (long long)kHq, (long long)kHkv, (long long)kD, R, spin_ns);
  std::printf("%3s | %-28s %8s\n", "B", "variant", "us");
  for (const int64_t B : batches) {
    const int64_t W = (L + kPs - 1) / kPs + 1, n_pages = B * W;  // a spare column: the table is wider than the rows
    const auto lay = codecs::LayoutOf(codecs::PageFormat::kF16, codecs::PageShape{kHkv, static_cast<int>(kPs), kD});
    const int64_t page_bytes = static_cast<int64_t>(lay.page_bytes);
    std::vector<int64_t> dir(2 * n_pages);
    for (int64_t i = 0; i < n_pages; ++i) dir[2 * i] = static_cast<int64_t>(codecs::PageFormat::kF16), dir[2 * i + 1] = i * page_bytes;
    std::vector<int32_t> ids(n_pages), tab(B * W);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
    std::copy(ids.begin(), ids.end(), tab.begin());
    std::vector<int64_t> pos(B, L - 1);
    uint8_t* pool;
    int64_t *d_dir, *d_pos;
    int32_t* d_tab;
    __half *qkv, *cs, *sn, *q_out, *q_out2, *kc, *vc;
    const int64_t rot_rows = L + kPs;
    CK(cudaMalloc(&pool, n_pages * page_bytes));
    CK(cudaMemset(pool, 0, n_pages * page_bytes));
    CK(cudaMalloc(&d_dir, dir.size() * 8));
    CK(cudaMemcpy(d_dir, dir.data(), dir.size() * 8, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_tab, tab.size() * 4));
    CK(cudaMemcpy(d_tab, tab.data(), tab.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_pos, B * 8));
    CK(cudaMemcpy(d_pos, pos.data(), B * 8, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&qkv, B * kW * 2));
    CK(cudaMalloc(&cs, rot_rows * kD));
    CK(cudaMalloc(&sn, rot_rows * kD));
    CK(cudaMalloc(&q_out, B * kHq * kD * 2));
    CK(cudaMalloc(&q_out2, B * kHq * kD * 2));
    CK(cudaMalloc(&kc, B * L * kHkv * kD * 2));
    CK(cudaMalloc(&vc, B * L * kHkv * kD * 2));
    sweep::RandomFill<<<64, 256, 0, s>>>(qkv, B * kW, 5u);
    sweep::RandomFill<<<64, 256, 0, s>>>(cs, rot_rows * kD / 2, 6u);
    sweep::RandomFill<<<64, 256, 0, s>>>(sn, rot_rows * kD / 2, 7u);
    CK(cudaStreamSynchronize(s));

    TensorArg tpool, tdir, ttab, tk, tv, tpos;
    tpool.data = pool, tpool.elem_type = 2, tpool.dims = {n_pages * page_bytes}, tpool.name = "pool";
    tdir.data = d_dir, tdir.elem_type = kInt64, tdir.dims = {n_pages, 2}, tdir.name = "directory";
    ttab.data = d_tab, ttab.elem_type = 6, ttab.dims = {B, W}, ttab.name = "table";
    tk.data = qkv + kHq * kD, tk.elem_type = kFloat16, tk.dims = {B, 1, kHkv * kD}, tk.name = "k";
    tv.data = qkv + (kHq + kHkv) * kD, tv.elem_type = kFloat16, tv.dims = {B, 1, kHkv * kD}, tv.name = "v";
    tpos.data = d_pos, tpos.elem_type = kInt64, tpos.dims = {B}, tpos.name = "position";
    PagedAttrs at;
    at.layer = 0, at.num_layers = 1, at.kv_num_heads = kHkv, at.page_size = kPs;
    PagedUpdateCudaView v;
    OK(PlanPagedCacheUpdateCuda("sweep", tpool, tdir, ttab, tk, tv, tpos, at, &v));
    v.src_stride = kW;
    v.cos = cs, v.sin = sn, v.rotary_rows = rot_rows;
    v.q = qkv, v.q_out = q_out, v.heads = kHq;
    const size_t owners = OwnerBytesOf(v);  // for the two-kernel path (ORTKV_CUDA_PAGED_UPDATE=two) too
    void* flag = nullptr;
    CK(cudaMalloc(&flag, 256 + owners));
    v.flag = flag;
    v.owners = reinterpret_cast<unsigned int*>(static_cast<char*>(flag) + 256);
    void* err = nullptr;  // the deferred-error word pair
    CK(cudaMalloc(&err, 4096));
    CK(cudaMemset(err, 0, 4096));
    v.error_word = err;

    // the check: the update against the floor on the same qkv
    OK(PagedCacheUpdateCuda(v, s));
    {
      cudaLaunchAttribute a1[1];
      cudaLaunchConfig_t c = Cfg(static_cast<unsigned>(B), 128, s, a1);
      CK(cudaLaunchKernelEx(&c, Floor, static_cast<const __half*>(qkv), static_cast<const __half*>(cs),
                            static_cast<const __half*>(sn), static_cast<const int64_t*>(d_pos), kc, vc, q_out2, L));
    }
    CK(cudaStreamSynchronize(s));
    std::vector<__half> hp(n_pages * page_bytes / 2), hk(B * L * kHkv * kD), hv(hk.size()), hq(B * kHq * kD),
        hq2(hq.size());
    CK(cudaMemcpy(hp.data(), pool, n_pages * page_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hk.data(), kc, hk.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hv.data(), vc, hv.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hq.data(), q_out, hq.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hq2.data(), q_out2, hq.size() * 2, cudaMemcpyDeviceToHost));
    float worst = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = L - 1, id = tab[b * W + p / kPs], r = p % kPs;
      const __half* page = hp.data() + id * page_bytes / 2;
      for (int64_t h = 0; h < kHkv; ++h)
        for (int64_t d = 0; d < kD; ++d) {
          const int64_t row = (h * kPs + r) * kD + d;  // F16 rows: [K: Hkv][ps][D], then V (LayoutOf)
          worst = std::max(worst, std::fabs(__half2float(page[lay.k_payload / 2 + row]) -
                                            __half2float(hk[((b * L + p) * kHkv + h) * kD + d])));
          worst = std::max(worst, std::fabs(__half2float(page[lay.v_payload / 2 + row]) -
                                            __half2float(hv[((b * L + p) * kHkv + h) * kD + d])));
        }
    }
    for (size_t i = 0; i < hq.size(); ++i) worst = std::max(worst, std::fabs(__half2float(hq[i]) - __half2float(hq2[i])));
    std::printf("B %lld: update vs floor max |diff| %.5f\n", (long long)B, worst);

    auto row = [&](const char* name, float us) { std::printf("%3lld | %-28s %8.2f\n", (long long)B, name, us); };
    auto update = [&](const char* path) {
      if (path) setenv("ORTKV_CUDA_PAGED_UPDATE", path, 1); else unsetenv("ORTKV_CUDA_PAGED_UPDATE");
      OK(PagedCacheUpdateCuda(v, s));
    };
    auto floor_launch = [&]() {
      cudaLaunchAttribute a1[1];
      cudaLaunchConfig_t c = Cfg(static_cast<unsigned>(B), 128, s, a1);
      CK(cudaLaunchKernelEx(&c, Floor, static_cast<const __half*>(qkv), static_cast<const __half*>(cs),
                            static_cast<const __half*>(sn), static_cast<const int64_t*>(d_pos), kc, vc, q_out2, L));
    };
    auto nop = [&]() {
      cudaLaunchAttribute a1[1];
      cudaLaunchConfig_t c = Cfg(1, 32, s, a1);
      CK(cudaLaunchKernelEx(&c, Nop));
    };
    auto spin = [&]() { Spin<<<sms, 128, 0, s>>>(spin_ns, sink); };  // plain: starts after the update before it
    for (int round = 0; round < 2; ++round) {
      row("plain", sweep::Capture(s, R, reps, [&](int) { update("plain"); }));
      row("early (chain)", sweep::Capture(s, R, reps, [&](int) { update(nullptr); }));
      row("two kernels", sweep::Capture(s, R, reps, [&](int) { update("two"); }));
      const float base = sweep::Capture(s, R, reps, [&](int) { spin(); nop(); });
      row("after spin: early", sweep::Capture(s, R, reps, [&](int) { spin(); update(nullptr); }) - base);
      row("after spin: plain", sweep::Capture(s, R, reps, [&](int) { spin(); update("plain"); }) - base);
      row("after spin: floor", sweep::Capture(s, R, reps, [&](int) { spin(); floor_launch(); }) - base);
      row("spin + nop", base);
    }
    unsetenv("ORTKV_CUDA_PAGED_UPDATE");
    for (void* p : std::vector<void*>{pool, d_dir, d_tab, d_pos, qkv, cs, sn, q_out, q_out2, kc, vc, flag, err})
      CK(cudaFree(p));
  }
  CK(cudaFree(sink));
  return 0;
}

}  // namespace
}  // namespace ortkv

int main(int argc, char** argv) { return ortkv::Main(argc, argv); }
