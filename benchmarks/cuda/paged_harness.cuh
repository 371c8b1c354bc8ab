// What the paged kernels' harnesses (paged_sweep.cu, update_sweep.cu) provide in place of the package's other
// translation units (not linked into them), and their Status check. Included at file scope after
// custom_ops/kernels/cuda/paged_cuda.cu.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ortkv {

const char* ElemTypeName(int32_t t) { return t == kFloat16 ? "float16" : t == kInt64 ? "int64" : "other"; }
Status CudaAttentionKernelChoice(int* level) {  // as cache_attention.cu: unset = newest, v1 / v2 / v3
  const char* e = std::getenv("ORTKV_CUDA_ATTENTION");
  *level = (e == nullptr || *e == '\0') ? 0 : (e[0] == 'v' && e[1] >= '1' && e[1] <= '3' && e[2] == '\0') ? e[1] - '0' : -1;
  return *level < 0 ? Status(Code::kInvalidArgument, "ORTKV_CUDA_ATTENTION: set v1, v2 or v3") : Status::Ok();
}

bool CudaEarlyLaunch() {  // as cache_attention.cu: ORTKV_CUDA_EARLY=0 launches plainly
  const char* e = std::getenv("ORTKV_CUDA_EARLY");
  return !(e != nullptr && std::strcmp(e, "0") == 0);
}

}  // namespace ortkv

// A plan or launch that must succeed: its message and exit 2 otherwise.
#define OK(x)                                                                                      \
  do {                                                                                             \
    ::ortkv::Status s_ = (x);                                                                      \
    if (!s_.ok()) {                                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_.message().c_str());        \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)
