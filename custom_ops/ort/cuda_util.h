// Helpers of the CUDA op kernels (CUDA builds): the deferred device error, the SM count, and device
// scratch memory from ORT's allocator.
#pragma once
#if defined(ORTKV_WITH_CUDA)
#include <atomic>
#include <cstddef>

#include "ort_util.h"
#include "ortkv/cache_attention.h"
#include "ortkv/core.h"

namespace ortkv_ort {

// Note [CUDA deferred errors] (ortkv/core.h): an error a kernel found on the device in an earlier
// launch, as the OrtStatus of this Compute; nullptr when there is none. One pinned-memory read per
// pair of words; when a code is set, the Compute's stream is synchronized first (Note [Settled reports]).
inline OrtStatus* TakeDeviceError(OrtKernelContext* ctx) {
  if (ortkv_core_device_error_pending() == 0) return nullptr;  // also 0 before any word was added
  void* stream = nullptr;
  OrtStatus* s = g_api->KernelContext_GetGPUComputeStream(ctx, &stream);
  if (s != nullptr) return s;
  if (stream != nullptr) ortkv::CudaSettleReports(stream);
  char msg[1024];
  const int code = ortkv_core_take_device_error(msg, sizeof(msg));
  if (code == ORTKV_DERR_NONE) return nullptr;
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, msg);
}

// The SM count of a device, queried once per device.
inline int CachedSmCount(int device) {
  static std::atomic<int> counts[64];
  if (device < 0 || device >= 64) return ortkv::CudaSmCount(device);
  int n = counts[device].load(std::memory_order_relaxed);
  if (n == 0) {
    n = ortkv::CudaSmCount(device);
    if (n <= 0) n = 132;  // the query failed: assume an H100 / H200 (only the split count depends on it)
    counts[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Device memory from ORT's allocator for the kernel's device, freed at scope exit. The free happens
// when Compute returns, before the kernels that use it ran: ORT's CUDA allocator hands memory out
// again only to work on the same compute stream, which runs after them (as ORT's own CUDA kernels
// rely on for their scratch buffers). No cudaMalloc in a step once ORT's arena has grown.
struct DeviceScratch {
  OrtAllocator* alloc = nullptr;
  void* ptr = nullptr;
  OrtStatus* Alloc(OrtKernelContext* ctx, int device_id, size_t bytes) {
    OrtMemoryInfo* info = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->CreateMemoryInfo("Cuda", OrtArenaAllocator, device_id, OrtMemTypeDefault, &info));
    OrtStatus* s = g_api->KernelContext_GetAllocator(ctx, info, &alloc);
    g_api->ReleaseMemoryInfo(info);
    if (s != nullptr) return s;
    ptr = alloc->Alloc(alloc, bytes);
    if (ptr == nullptr) {
      return g_api->CreateStatus(ORT_RUNTIME_EXCEPTION,
                                 "[ortkv:E_RUNTIME] CacheAttention: ORT's CUDA allocator returned no workspace");
    }
    return nullptr;
  }
  ~DeviceScratch() {
    if (alloc != nullptr) {
      if (ptr != nullptr) alloc->Free(alloc, ptr);
      g_api->ReleaseAllocator(alloc);
    }
  }
};

}  // namespace ortkv_ort
#endif
