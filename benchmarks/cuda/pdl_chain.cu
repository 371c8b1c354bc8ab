// What a chain of programmatic-dependent launches costs, apart from any attention kernel: a CUDA graph of R launches
// of one kernel that triggers its dependents at once (griddepcontrol.launch_dependents), spins `pre` ns, waits for
// the kernel before it (griddepcontrol.wait), spins `post` ns, and stores one word; time per launch = replay time / R,
// median of the replays. Part 1: kernel parameters of 64 .. 4,000 bytes (a PagedCacheAttention launch passes ~800,
// a dense CacheAttention launch ~160); part 2: work before vs after the wait. Answers (H200, 2026-12-04,
// benchmarks/results/paged_attention_cuda_h200.md): the parameters' size costs nothing up to 1,600 bytes, work
// before the wait is hidden, work after it adds one for one, and a launch of 3 blocks costs 0.46 us (12 blocks 0.71).
//
//   nvcc -O2 -arch=sm_90 -std=c++17 benchmarks/cuda/pdl_chain.cu -o /tmp/pdl_chain && /tmp/pdl_chain
#include "sweep_common.cuh"

__device__ __forceinline__ unsigned long long Now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <int N>
struct Params {
  unsigned long long* out;
  int pre_ns, post_ns;
  char pad[N - 16];
};

template <int N>
__global__ void Chained(const Params<N> p) {
  asm volatile("griddepcontrol.launch_dependents;" :::);
  const unsigned long long t0 = Now();
  while (Now() - t0 < static_cast<unsigned long long>(p.pre_ns)) {
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const unsigned long long t1 = Now();
  while (Now() - t1 < static_cast<unsigned long long>(p.post_ns)) {
  }
  if (threadIdx.x == 0) p.out[blockIdx.x] += static_cast<unsigned long long>(p.pad[N - 17]);
}

// us per launch: a graph of R launches (programmatic when `pdl`), median of 25 replays (sweep::Capture)
template <int N>
float PerLaunch(unsigned long long* out, int R, int blocks, bool pdl, int pre_ns, int post_ns) {
  Params<N> p{};
  p.out = out, p.pre_ns = pre_ns, p.post_ns = post_ns;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const float us = sweep::Capture(s, R, 25, [&](int) {
    cudaLaunchConfig_t c{};
    c.gridDim = blocks;
    c.blockDim = 128;
    c.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    c.attrs = at;
    c.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&c, Chained<N>, p));
  });
  CK(cudaStreamDestroy(s));
  return us;
}

int main() {
  unsigned long long* out;
  CK(cudaMalloc(&out, 1 << 20));
  CK(cudaMemset(out, 0, 1 << 20));
  std::printf("part 1: parameter bytes (no spin), us per launch\n");
  for (int blocks : {3, 12, 132})
    for (int pdl : {1, 0})
      std::printf("  blocks %3d programmatic %d | 64 B %.3f  160 B %.3f  512 B %.3f  800 B %.3f  1600 B %.3f  4000 B %.3f\n",
                  blocks, pdl, PerLaunch<64>(out, 256, blocks, pdl, 0, 0), PerLaunch<160>(out, 256, blocks, pdl, 0, 0),
                  PerLaunch<512>(out, 256, blocks, pdl, 0, 0), PerLaunch<800>(out, 256, blocks, pdl, 0, 0),
                  PerLaunch<1600>(out, 256, blocks, pdl, 0, 0), PerLaunch<4000>(out, 256, blocks, pdl, 0, 0));
  std::printf("part 2: ns spun before / after the wait (programmatic, 64 B), us per launch\n");
  for (int blocks : {3, 12})
    for (int post : {0, 1000, 2000}) {
      std::printf("  blocks %2d after %4d |", blocks, post);
      for (int pre : {0, 250, 500, 1000, 1500, 2000, 3000})
        std::printf(" before %d: %.3f", pre, PerLaunch<64>(out, 128, blocks, true, pre, post));
      std::printf("\n");
    }
  return 0;
}
