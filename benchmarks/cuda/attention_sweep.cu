// Standalone timing of the dense CUDA decode attention (no ONNX Runtime): the kernels of
// custom_ops/kernels/cuda/cache_attention.cu called directly (v2, v3 at several split counts and ring depths,
// v3's cluster merge, each kernel alone without its merge), a read-only kernel with the same access pattern
// (the bandwidth a decode kernel of that shape could reach), and a device-to-device copy; v3's output is
// checked against v2's on random caches. It builds in ~30 s with nvcc alone, so kernel variants can be
// compared on a GPU machine without building the package or installing onnxruntime-gpu. The copy here is a
// cudaMemcpyAsync node in a CUDA graph (on the H200: 2,770 GB/s read + write, vs 4,235 for a stream copy in
// benchmarks/bench_cache_attention_cuda.py, which the repository's figures use).
// Every figure is from CUDA graph replays of R launches over R distinct cache pairs (>= 256 MiB in all,
// so K / V come from HBM), time per launch = replay time / R, median of `reps` replays.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DORTKV_WITH_CUDA -I custom_ops/include -I custom_ops/kernels/cuda \
//        benchmarks/cuda/attention_sweep.cu -o /tmp/attention_sweep
//   /tmp/attention_sweep [reps] [cases, e.g. 069 or 0,6,10: indices into `cases`]
#include "../../custom_ops/kernels/cuda/cache_attention.cu"
#include "sweep_common.cuh"

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <vector>

namespace ortkv {
int CudaSmCount(int device) {  // as custom_ops/kernels/cuda/device.cu (not linked: it needs the core library)
  int n = 0;
  return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess ? n : 0;
}
namespace {

using sweep::Capture;
using sweep::RandomFill;
using sweep::TimeGraph;

// Reads what AttentionKernelV2 reads (one unit's K and V rows [j0, j1) of head hk of row b, 16 bytes per
// thread, TPK threads per row) and folds it into one word per block: the streaming floor of that grid.
template <int TPK, int U>
__global__ void __launch_bounds__(128) ReadKernel(const Args a, unsigned* sink) {
  const int64_t S = a.splits;
  int64_t blk = blockIdx.x;
  const int64_t split = blk % S;
  const int64_t unit = blk / S;
  const int64_t hk = unit % a.Hkv, b = unit / a.Hkv;
  const int64_t L = a.C;
  int64_t chunk = (L + S - 1) / S;
  const int64_t j0 = split * chunk < L ? split * chunk : L;
  const int64_t j1 = j0 + chunk < L ? j0 + chunk : L;
  const int tid = threadIdx.x, sub = tid % TPK, kg = tid / TPK;
  constexpr int kNkg = 128 / TPK;
  const uint4* kb = reinterpret_cast<const uint4*>(static_cast<const __half*>(a.k) + b * a.row_stride + hk * a.head_stride + sub * 8);
  const uint4* vb = reinterpret_cast<const uint4*>(static_cast<const __half*>(a.v) + b * a.row_stride + hk * a.head_stride + sub * 8);
  const int64_t ts = a.tok_stride / 8;  // uint4 per token
  unsigned x = 0;
  for (int64_t j = j0 + kg; j < j1; j += kNkg * U) {
    uint4 r[2 * U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t jj = j + u * kNkg;
      if (jj < j1) {
        r[2 * u] = __ldcs(kb + jj * ts);
        r[2 * u + 1] = __ldcs(vb + jj * ts);
      } else {
        r[2 * u] = r[2 * u + 1] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < 2 * U; ++u) x ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  if (x == 0x12345678u) sink[blockIdx.x] = x;
}

struct Case {
  int Hq, Hkv, D;
  int64_t L, B, C;  // keys L in a cache of capacity C (0: L)
};

int Main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int dev = 0, sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  // copy bandwidth
  const size_t cb = size_t(1) << 30;
  void *c0, *c1;
  CK(cudaMalloc(&c0, cb));
  CK(cudaMalloc(&c1, cb));
  CK(cudaMemset(c0, 1, cb));
  const float copy_us = Capture(s, 4, reps, [&](int) { CK(cudaMemcpyAsync(c1, c0, cb, cudaMemcpyDeviceToDevice, s)); });
  const double copy_gbs = 2.0 * cb / (copy_us * 1e3);
  std::printf("copy: %.1f us per GiB, %.0f GB/s read+write, SMs %d\n", copy_us, copy_gbs, sms);
  CK(cudaFree(c1));
  unsigned* sink;
  CK(cudaMalloc(&sink, 1 << 24));

  const Case cases[] = {{9, 3, 64, 8192, 8}, {9, 3, 64, 8192, 64}, {9, 3, 64, 32768, 8}, {9, 3, 64, 131072, 8},
                        {32, 8, 128, 8192, 8}, {32, 8, 128, 32768, 8}, {9, 3, 64, 8192, 1}, {9, 3, 64, 131072, 1},
                        {9, 3, 64, 128, 1, 2048}, {9, 3, 64, 128, 8, 2048}, {9, 3, 64, 16, 1}, {9, 3, 64, 128, 1},
                        {9, 3, 64, 1024, 1},
                        {9, 3, 64, 1024, 1, 2048}, {9, 3, 64, 512, 1}, {9, 3, 64, 1024, 8}};  // 13-15: Note [Cluster split chunks]
  std::printf("%-12s %7s %3s %8s | %-28s %8s %7s %7s\n", "heads", "L", "B", "MiB", "kernel", "us", "GB/s", "/copy");
  const char* only = argc > 2 ? argv[2] : nullptr;  // e.g. "04" or "0,4,10": the cases to run
  for (int ci = 0; ci < static_cast<int>(sizeof(cases) / sizeof(cases[0])); ++ci) {
    Case c = cases[ci];
    if (c.C == 0) c.C = c.L;
    if (only != nullptr && !sweep::Selected(only, ci)) continue;
    const int64_t per_tensor = c.B * c.C * c.Hkv * c.D;  // elements
    const double bytes = 2.0 * c.B * c.L * c.Hkv * c.D * 2;  // read per node
    int R = static_cast<int>((256.0 * 1048576 + 4.0 * per_tensor - 1) / (4.0 * per_tensor));
    if (R > 64) R = 64;
    if (R < 2) R = 2;
    std::vector<__half*> ks(R), vs(R);
    for (int r = 0; r < R; ++r) {
      CK(cudaMalloc(&ks[r], per_tensor * 2));
      CK(cudaMalloc(&vs[r], per_tensor * 2));
      CK(cudaMemcpy(ks[r], c0, per_tensor * 2, cudaMemcpyDeviceToDevice));  // 0x0101: small finite halves
      CK(cudaMemcpy(vs[r], c0, per_tensor * 2, cudaMemcpyDeviceToDevice));
    }
    __half *q, *out;
    int64_t* start;
    float* partial;
    CK(cudaMalloc(&q, c.B * c.Hq * c.D * 2));
    CK(cudaMemset(q, 0, c.B * c.Hq * c.D * 2));
    CK(cudaMalloc(&out, c.B * c.Hq * c.D * 2));
    std::vector<int64_t> st(c.B, c.L - 1);
    CK(cudaMalloc(&start, c.B * 8));
    CK(cudaMemcpy(start, st.data(), c.B * 8, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&partial, size_t(c.B) * c.Hq * 512 * (c.D + 2) * 4));
    const auto free_case = [&]() {
      for (int r = 0; r < R; ++r) {
        CK(cudaFree(ks[r]));
        CK(cudaFree(vs[r]));
      }
      CK(cudaFree(q));
      CK(cudaFree(out));
      CK(cudaFree(start));
      CK(cudaFree(partial));
    };
    CacheAttentionCudaView v;
    v.q = q;
    v.out = out;
    v.start = start;
    v.start_stride = 1;
    v.elem_type = kFloat16;
    v.B = c.B;
    v.T = 1;
    v.Hq = c.Hq;
    v.Hkv = c.Hkv;
    v.D = c.D;
    v.C = c.C;
    if (std::getenv("BNSH") != nullptr) {  // BNSH=1: each head's rows contiguous (as a page's)
      v.row_stride = c.C * c.Hkv * c.D;
      v.tok_stride = c.D;
      v.head_stride = c.C * c.D;
    } else {
      v.row_stride = c.C * c.Hkv * c.D;  // BSNH
      v.tok_stride = c.Hkv * c.D;
      v.head_stride = c.D;
    }
    v.scale = 0.125f;
    v.vec = true;
    v.partial = partial;
    // the plan's splits (PlanCacheAttentionCuda; Note [Cluster split chunks]: head sizes 64 / 128 run v3)
    v.splits = AttnCudaSplits(c.C, v.units(), sms, c.D == 64 || c.D == 128);
    auto row = [&](const char* name, float us) {
      std::printf("%2d/%d/%-7d %7lld %3lld %8.1f | %-28s %8.2f %7.0f %6.0f%%\n", c.Hq, c.Hkv, c.D, (long long)c.L,
                  (long long)c.B, bytes / 1048576, name, us, bytes / (us * 1e3), 100.0 * bytes / (us * 1e3) / copy_gbs);
    };
    auto with = [&](int r) {
      CacheAttentionCudaView w = v;
      w.k = ks[r];
      w.v = vs[r];
      return w;
    };
    auto run_level = [&](const char* level, int r) {
      setenv("ORTKV_CUDA_ATTENTION", level, 1);
      if (!CacheAttentionCuda(with(r), s).ok()) std::exit(2);
    };
    // correctness: v3 against v2 on random K / V / q (the timing caches hold 0x0101 halves)
    {
      std::vector<__half> hq(c.B * c.Hq * c.D);
      for (size_t i = 0; i < hq.size(); ++i) hq[i] = __float2half(std::sin(0.37f * i));
      CK(cudaMemcpy(q, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
      RandomFill<<<1024, 256, 0, s>>>(ks[0], per_tensor, 1u);
      RandomFill<<<1024, 256, 0, s>>>(vs[0], per_tensor, 2u);
      std::vector<__half> o2(hq.size()), o3(hq.size());
      run_level("v2", 0);
      CK(cudaMemcpyAsync(o2.data(), out, o2.size() * 2, cudaMemcpyDeviceToHost, s));
      run_level("v3", 0);
      CK(cudaMemcpyAsync(o3.data(), out, o3.size() * 2, cudaMemcpyDeviceToHost, s));
      if (c.D == 64) {  // the cluster merge at min(splits, 8)
        std::vector<__half> oc(hq.size());
        Args a{};
        a.q = q; a.out = out; a.start = start; a.start_stride = 1; a.B = c.B; a.T = 1; a.Hq = c.Hq; a.Hkv = c.Hkv;
        a.D = c.D; a.C = c.C; a.row_stride = v.row_stride; a.tok_stride = v.tok_stride; a.head_stride = v.head_stride;
        a.scale = 0.125f; a.head_blocks = 1; a.partial = partial; a.err = nullptr; a.label = 0; a.tpk = 8;
        a.k = ks[0]; a.v = vs[0];
        a.splits = std::min<int64_t>(8, std::max<int64_t>(2, v.splits));
        CK((v3::LaunchWith<__half, 64, 4, 4>(a, v.units(), s, true)));
        CK(cudaMemcpyAsync(oc.data(), out, oc.size() * 2, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        float wc = 0;
        for (size_t i = 0; i < o2.size(); ++i) wc = std::max(wc, std::fabs(__half2float(o2[i]) - __half2float(oc[i])));
        std::printf("   v3 cluster (S=%lld) vs v2 max |diff| %.5f\n", (long long)a.splits, wc);
      }
      std::vector<__half> oe(hq.size());
      {  // v3 launched early (programmatic dependent), same splits as the production launch
        Args a{};
        a.q = q; a.out = out; a.start = start; a.start_stride = 1; a.B = c.B; a.T = 1; a.Hq = c.Hq; a.Hkv = c.Hkv;
        a.D = c.D; a.C = c.C; a.row_stride = v.row_stride; a.tok_stride = v.tok_stride; a.head_stride = v.head_stride;
        a.scale = 0.125f; a.head_blocks = 1; a.partial = partial; a.err = nullptr; a.label = 0; a.tpk = 8;
        a.k = ks[0]; a.v = vs[0];
        CK(cudaMemsetAsync(out, 0, oe.size() * 2, s));
        if (c.D == 64) {
          a.splits = v2::WaveSplits(v.splits, v.units(), v3::BlocksPerSm<__half, 64, 4, 4>());
          CK((v3::LaunchWith<__half, 64, 4, 4>(a, v.units(), s, false, true)));
        } else {
          a.splits = v2::WaveSplits(v.splits, v.units(), v3::BlocksPerSm<__half, 128, 4, 3>());
          CK((v3::LaunchWith<__half, 128, 4, 3>(a, v.units(), s, false, true)));
        }
        CK(cudaMemcpyAsync(oe.data(), out, oe.size() * 2, cudaMemcpyDeviceToHost, s));
      }
      CK(cudaStreamSynchronize(s));
      float we = 0;
      for (size_t i = 0; i < o2.size(); ++i) we = std::max(we, std::fabs(__half2float(o2[i]) - __half2float(oe[i])));
      std::printf("   v3 early vs v2 max |diff| %.5f\n", we);
      float worst = 0;
      for (size_t i = 0; i < o2.size(); ++i) worst = std::max(worst, std::fabs(__half2float(o2[i]) - __half2float(o3[i])));
      std::printf("   v3 vs v2 max |diff| %.5f (|out| ~%.3f)\n", worst, std::fabs(__half2float(o2[1])));
      if (std::getenv("RANDOM") != nullptr) {  // RANDOM=1: timing caches of random halves and this q (as paged_sweep)
        for (int r = 1; r < R; ++r) {
          RandomFill<<<1024, 256, 0, s>>>(ks[r], per_tensor, 1u + 2 * r);
          RandomFill<<<1024, 256, 0, s>>>(vs[r], per_tensor, 2u + 2 * r);
        }
        CK(cudaStreamSynchronize(s));
      } else {
        CK(cudaMemset(q, 0, hq.size() * 2));
      }
    }
    row("v2 (attention + combine)", Capture(s, R, reps, [&](int r) { run_level("v2", r); }));
    row("v3 (attention + combine)", Capture(s, R, reps, [&](int r) { run_level("v3", r); }));
    if (std::getenv("QUICK") != nullptr) {  // QUICK=1: the two rows above only
      free_case();
      continue;
    }
    {
      auto sweep = [&](auto launch, const char* tag, int per_sm) {
        for (int64_t S0 : {v.splits / 2, v.splits, v.splits * 2}) {
          Args a{};
          a.q = q; a.out = out; a.start = start; a.start_stride = 1; a.B = c.B; a.T = 1; a.Hq = c.Hq; a.Hkv = c.Hkv;
          a.D = c.D; a.C = c.C; a.row_stride = v.row_stride; a.tok_stride = v.tok_stride; a.head_stride = v.head_stride;
          a.scale = 0.125f; a.head_blocks = 1; a.partial = partial; a.err = nullptr; a.label = 0; a.tpk = 8;
          a.splits = v2::WaveSplits(std::max<int64_t>(1, std::min<int64_t>(S0, 512)), v.units(), per_sm);
          if (S0 > v.splits) a.splits = std::min<int64_t>(S0, 512);
          char name[64];
          std::snprintf(name, sizeof name, "%s S=%lld", tag, (long long)a.splits);
          row(name, Capture(s, R, reps, [&](int r) {
                a.k = ks[r];
                a.v = vs[r];
                launch(a, v.units());
              }));
          if (c.D == 64) {
            std::snprintf(name, sizeof name, "%s S=%lld kernel only", tag, (long long)a.splits);
            row(name, Capture(s, R, reps, [&](int r) {
                  a.k = ks[r];
                  a.v = vs[r];
                  v3::AttentionKernelV3<__half, 64, 4, 4, false><<<unsigned(v.units() * a.splits), 128, v3::Cfg<64, 4, 4>::kSmem, s>>>(a);
                }));
          }
        }
      };
      if (c.D == 64) {
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 64, 4, 3>(a, base, s, false); }, "v3 NW4 ST3", v3::BlocksPerSm<__half, 64, 4, 3>());
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 64, 4, 4>(a, base, s, false); }, "v3 NW4 ST4", v3::BlocksPerSm<__half, 64, 4, 4>());
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 64, 4, 4>(a, base, s, false, true); }, "v3 NW4 ST4 early", v3::BlocksPerSm<__half, 64, 4, 4>());
        // deeper rings put more of a block's tiles before the wait of the early start (2026-12-02)
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 64, 4, 6>(a, base, s, false, true); }, "v3 NW4 ST6 early", v3::BlocksPerSm<__half, 64, 4, 6>());
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 64, 4, 8>(a, base, s, false, true); }, "v3 NW4 ST8 early", v3::BlocksPerSm<__half, 64, 4, 8>());
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 64, 8, 4>(a, base, s, false, true); }, "v3 NW8 ST4 early", v3::BlocksPerSm<__half, 64, 8, 4>());
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 64, 2, 8>(a, base, s, false, true); }, "v3 NW2 ST8 early", v3::BlocksPerSm<__half, 64, 2, 8>());
        sweep([&](Args& a, int64_t base) { a.splits = std::min<int64_t>(a.splits, 8); v3::LaunchWith<__half, 64, 4, 4>(a, base, s, true); }, "v3 ST4 cluster<=8", v3::BlocksPerSm<__half, 64, 4, 4>());
        sweep([&](Args& a, int64_t base) { a.splits = std::min<int64_t>(a.splits, 16); v3::LaunchWith<__half, 64, 4, 4>(a, base, s, true); }, "v3 ST4 cluster<=16", v3::BlocksPerSm<__half, 64, 4, 4>());
      } else {
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 128, 4, 2>(a, base, s, false); }, "v3 NW4 ST2", v3::BlocksPerSm<__half, 128, 4, 2>());
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 128, 4, 3>(a, base, s, false); }, "v3 NW4 ST3", v3::BlocksPerSm<__half, 128, 4, 3>());
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 128, 4, 3>(a, base, s, false, true); }, "v3 NW4 ST3 early", v3::BlocksPerSm<__half, 128, 4, 3>());
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 128, 4, 5>(a, base, s, false, true); }, "v3 NW4 ST5 early", v3::BlocksPerSm<__half, 128, 4, 5>());
        sweep([&](Args& a, int64_t base) { v3::LaunchWith<__half, 128, 4, 4>(a, base, s, false); }, "v3 NW4 ST4", v3::BlocksPerSm<__half, 128, 4, 4>());
      }
    }
    // Clustered v3 with bigger blocks (NW warps, ST-deep rings): S blocks per unit merge through distributed
    // shared memory, no partials and no combine launch; the grid need not be one block per SM. Printed with the
    // number of such clusters the device can hold at once (cudaOccupancyMaxActiveClusters; a launch the device
    // refuses falls back to the combine, so a row with "fits 0" is not a cluster figure).
    if (c.D == 64) {
      auto cl = [&](auto kernel, auto launch, const char* tag, size_t smem, int nw) {
        for (int64_t S : {4, 6, 8}) {
          Args a{};
          a.q = q; a.out = out; a.start = start; a.start_stride = 1; a.B = c.B; a.T = 1; a.Hq = c.Hq; a.Hkv = c.Hkv;
          a.D = c.D; a.C = c.C; a.row_stride = v.row_stride; a.tok_stride = v.tok_stride; a.head_stride = v.head_stride;
          a.scale = 0.125f; a.head_blocks = 1; a.partial = partial; a.err = nullptr; a.label = 0; a.tpk = 8;
          a.splits = S;
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(unsigned(v.units() * S));
          cfg.blockDim = dim3(nw * 32);
          cfg.dynamicSmemBytes = smem;
          cudaLaunchAttribute attr[1];
          attr[0].id = cudaLaunchAttributeClusterDimension;
          attr[0].val.clusterDim.x = unsigned(S);
          attr[0].val.clusterDim.y = 1;
          attr[0].val.clusterDim.z = 1;
          cfg.attrs = attr;
          cfg.numAttrs = 1;
          int fits = 0;
          if (cudaOccupancyMaxActiveClusters(&fits, kernel, &cfg) != cudaSuccess) { (void)cudaGetLastError(); fits = -1; }
          char name[64];
          std::snprintf(name, sizeof name, "%s cl S=%lld fits %d", tag, (long long)S, fits);
          row(name, Capture(s, R, reps, [&](int r) {
                a.k = ks[r];
                a.v = vs[r];
                launch(a, v.units());
              }));
        }
      };
      (void)v3::BlocksPerSm<__half, 64, 8, 3>();  // sets the kernels' shared-memory attributes
      (void)v3::BlocksPerSm<__half, 64, 8, 2>();
      (void)v3::BlocksPerSm<__half, 64, 4, 4>();
      cl(v3::AttentionKernelV3<__half, 64, 4, 4, true>, [&](Args& a, int64_t base) { CK((v3::LaunchWith<__half, 64, 4, 4>(a, base, s, true))); }, "v3 NW4 ST4", v3::Cfg<64, 4, 4>::kSmem, 4);
      cl(v3::AttentionKernelV3<__half, 64, 8, 3, true>, [&](Args& a, int64_t base) { CK((v3::LaunchWith<__half, 64, 8, 3>(a, base, s, true))); }, "v3 NW8 ST3", v3::Cfg<64, 8, 3>::kSmem, 8);
      cl(v3::AttentionKernelV3<__half, 64, 8, 2, true>, [&](Args& a, int64_t base) { CK((v3::LaunchWith<__half, 64, 8, 2>(a, base, s, true))); }, "v3 NW8 ST2", v3::Cfg<64, 8, 2>::kSmem, 8);
    }
    // the v2 attention kernel alone at several split counts
    const int gm = c.Hq / c.Hkv <= 4 ? c.Hq / c.Hkv : 8;
    for (int64_t S : {v.splits, v.splits * 2}) {
      if (S < 1 || S > 512) continue;
      Args a{};
      a.q = q; a.out = out; a.start = start; a.start_stride = 1; a.B = c.B; a.T = 1; a.Hq = c.Hq; a.Hkv = c.Hkv;
      a.D = c.D; a.C = c.C; a.row_stride = v.row_stride; a.tok_stride = v.tok_stride; a.head_stride = v.head_stride;
      a.scale = 0.125f; a.splits = S; a.head_blocks = 1; a.partial = partial; a.err = nullptr; a.label = 0; a.tpk = 8;
      char name[64];
      std::snprintf(name, sizeof name, "v2 kernel only S=%lld", (long long)S);
      const unsigned grid = static_cast<unsigned>(v.units() * S);
      row(name, Capture(s, R, reps, [&](int r) {
            a.k = ks[r];
            a.v = vs[r];
            if (c.D == 64 && gm == 3) v2::AttentionKernelV2<__half, 8, 3><<<grid, kThreads, 0, s>>>(a);
            else if (c.D == 128 && gm == 4) v2::AttentionKernelV2<__half, 16, 4><<<grid, kThreads, 0, s>>>(a);
          }));
      std::snprintf(name, sizeof name, "read floor S=%lld", (long long)S);
      row(name, Capture(s, R, reps, [&](int r) {
            a.k = ks[r];
            a.v = vs[r];
            if (c.D == 64) ReadKernel<8, 4><<<grid, 128, 0, s>>>(a, sink);
            else ReadKernel<16, 4><<<grid, 128, 0, s>>>(a, sink);
          }));
    }
    free_case();
  }
  return 0;
}

}  // namespace
}  // namespace ortkv

int main(int argc, char** argv) { return ortkv::Main(argc, argv); }
