// CUDA helpers of the op adapters: the SM count of a device and the process-wide error word of
// Note [CUDA deferred errors] (ortkv/core.h).
#include <cuda_runtime.h>

#include <mutex>

#include "ortkv/cache_attention.h"
#include "ortkv/core.h"

namespace ortkv {

int CudaSmCount(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // clear it: the caller falls back to a fixed guess
    return 0;
  }
  return n;
}

void* CudaErrorWord() {
  static std::once_flag once;
  static void* device_ptr = nullptr;
  std::call_once(once, [] {
    void* host = nullptr;
    // mapped + portable: every device writes it through one pointer (UVA), the host reads it without a copy
    if (cudaHostAlloc(&host, sizeof(ortkv_device_error), cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      cudaGetLastError();
      return;
    }
    *static_cast<ortkv_device_error*>(host) = ortkv_device_error{};
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, host, 0) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    ortkv_core_set_device_error(static_cast<ortkv_device_error*>(host));
    device_ptr = dev;
  });
  return device_ptr;
}

}  // namespace ortkv
