// What the standalone CUDA timing harnesses share (attention_sweep.cu, paged_sweep.cu, pdl_chain.cu): the error check, a random
// float16 fill, and the time of one launch from CUDA graph replays of R launches. Included at file scope, after the
// kernels a harness times; its names live in namespace sweep (CK is a macro).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

namespace sweep {

// p[i] = a hash of (i, seed) as a float16 in [-1, 1): valid values for every 16-bit page, and finite codes and
// scales for the narrow ones (the work does not depend on the values).
__global__ void RandomFill(__half* p, int64_t n, unsigned seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed * 0x9E3779B9u;
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    p[i] = __float2half((x & 0xFFFF) / 32768.0f - 1.0f);
  }
}

// Microseconds per launch: the median over `reps` replays (after 3 untimed) of a graph of R launches, / R.
inline float TimeGraph(cudaGraphExec_t ge, cudaStream_t s, int reps, int R) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, s));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms * 1000.0f / R);
  }
  std::sort(t.begin(), t.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return t[t.size() / 2];
}

// TimeGraph of the graph that `launch(r)` for r < R captures on s.
template <typename F>
float Capture(cudaStream_t s, int R, int reps, F launch) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int r = 0; r < R; ++r) launch(r);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  const float us = TimeGraph(ge, s, reps, R);
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return us;
}

// Whether case `ci` is among `only`: comma-separated indices ("0,4,10"), or without a comma one digit per case ("04").
inline bool Selected(const char* only, int ci) {
  if (std::strchr(only, ',') == nullptr) return ci < 10 && std::strchr(only, '0' + ci) != nullptr;
  for (const char* p = only; *p != '\0';) {
    char* end = nullptr;
    const long x = std::strtol(p, &end, 10);
    if (end == p) return false;
    if (x == ci) return true;
    p = *end == ',' ? end + 1 : end;
  }
  return false;
}

}  // namespace sweep
