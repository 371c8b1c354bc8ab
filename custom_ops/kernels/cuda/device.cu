// CUDA helpers of the op adapters: the SM count of a device and the process-wide error word of
// Note [CUDA deferred errors] (ortkv/core.h).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

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

void CudaSettleReports(void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &capture) != cudaSuccess) {
    cudaGetLastError();  // clear it: the word is taken as it is
    return;
  }
  if (capture != cudaStreamCaptureStatusNone) return;
  if (cudaStreamSynchronize(s) != cudaSuccess) cudaGetLastError();  // a sticky error surfaces at the next launch
}

// Note [CUDA error word lifetime]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Seen on the H200: after ORT tore down the CUDA provider of the last session, the next session's
// kernels ran in a context where the word registered earlier was not mapped, and a word mapped
// twice (registered again in the new context) never received the device's writes. So the words are
// pages of plain host memory of ours (never freed, so the core's pointers stay valid), one page per
// CUDA context, page-locked and mapped with cuMemHostRegister in that context only. Every launch
// looks its page up in the context of the stream it launches on (cuStreamGetCtx, a host-side lookup,
// no synchronization; driver entry points through the runtime, so the library still needs no
// libcuda at load) and registers a fresh page for a context it has not seen. The core reads every
// page (ortkv_core_add_device_error). ORT 1.31's CUDA provider gave each session its own context in
// the tests, so this costs 4 KiB of host memory per session that launched an ortkv CUDA kernel (the
// page is unpinned with its context; at most 1024 pages: later contexts get no report, the kernels
// still refuse bad rows).
namespace {
using StreamGetCtxFn = CUresult (*)(CUstream, CUcontext*);
using CtxPushFn = CUresult (*)(CUcontext);
using CtxPopFn = CUresult (*)(CUcontext*);
using HostRegisterFn = CUresult (*)(void*, size_t, unsigned int);
using HostGetDevicePointerFn = CUresult (*)(CUdeviceptr*, void*, unsigned int);

struct Driver {
  StreamGetCtxFn stream_get_ctx = nullptr;
  CtxPushFn push = nullptr;
  CtxPopFn pop = nullptr;
  HostRegisterFn host_register = nullptr;
  HostGetDevicePointerFn host_get_device_pointer = nullptr;
  bool ok = false;
};

template <typename F>
bool Entry(const char* name, F* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    return false;
  }
  *fn = reinterpret_cast<F>(p);
  return true;
}

const Driver& GetDriver() {
  static Driver d = [] {
    Driver x;
    x.ok = Entry("cuStreamGetCtx", &x.stream_get_ctx) && Entry("cuCtxPushCurrent", &x.push) &&
           Entry("cuCtxPopCurrent", &x.pop) && Entry("cuMemHostRegister", &x.host_register) &&
           Entry("cuMemHostGetDevicePointer", &x.host_get_device_pointer);
    return x;
  }();
  return d;
}
}  // namespace

void* CudaErrorWord(void* stream) {
  static std::mutex mu;
  static std::vector<void*> pages;  // one per context the words were mapped in; never freed
  const Driver& drv = GetDriver();
  if (!drv.ok) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  CUcontext ctx = nullptr;
  if (drv.stream_get_ctx(static_cast<CUstream>(stream), &ctx) != CUDA_SUCCESS || ctx == nullptr) return nullptr;
  if (drv.push(ctx) != CUDA_SUCCESS) return nullptr;
  CUdeviceptr dev = 0;
  bool found = false;
  for (auto it = pages.rbegin(); it != pages.rend() && !found; ++it)
    found = drv.host_get_device_pointer(&dev, *it, 0) == CUDA_SUCCESS;
  if (!found && pages.size() < 1024) {  // a context we have not seen: a fresh page, registered in it only
    void* p = nullptr;
    if (posix_memalign(&p, 4096, 4096) == 0) {
      std::memset(p, 0, 4096);
      if (drv.host_register(p, 4096, CU_MEMHOSTREGISTER_DEVICEMAP) == CUDA_SUCCESS &&
          drv.host_get_device_pointer(&dev, p, 0) == CUDA_SUCCESS) {
        pages.push_back(p);
        ortkv_core_add_device_error(static_cast<ortkv_device_error*>(p));
        found = true;
      }
    }
  }
  CUcontext popped = nullptr;
  drv.pop(&popped);
  return found ? reinterpret_cast<void*>(dev) : nullptr;
}

}  // namespace ortkv
