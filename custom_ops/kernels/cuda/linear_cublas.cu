// Linear on CUDA where the GEMV does not run (Note [Linear path choice]): cuBLAS's cublasGemmEx, with cuBLAS loaded at run time (Note [Linear cuBLAS]).
// Host code only.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <library_types.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "ortkv/linear.h"

// Note [Linear cuBLAS]
// ~~~~~~~~~~~~~~~~~~~~
// Linear where LinearUsesGemv says no (Note [Linear path choice]: prefill, up to batch x prompt rows; decode at
// batch > 8, or > 4 on wide matrices; the 56.6 MB LM head at any M) is a GEMM that cuBLAS does at the device's
// rate, so the op calls cublasGemmEx: Y^T [N, M] (column-major, ldc = N) = op_T(W) [N, K] x X^T,
// i.e. A = W with CUBLAS_OP_T and lda = K, B = X with CUBLAS_OP_N and ldb = K, float16 / bfloat16 in and out,
// CUBLAS_COMPUTE_32F (fp32 accumulation, as the GEMV).
//   * cuBLAS is NOT linked: CI builds the CUDA kernels where there is nvcc but no GPU, and the library must
//     load there. The first GEMM dlopens libcublas.so.13, then libcublas.so.12 (one already in the process,
//     the one ORT's CUDA provider loaded, is preferred: RTLD_NOLOAD first) and resolves cublasCreate_v2,
//     cublasSetStream_v2, cublasSetWorkspace_v2, cublasGemmEx and cublasDestroy_v2 once. Without them the node
//     fails with E_RUNTIME naming the libraries tried and the M that needed cuBLAS.
//     The prototypes are declared here (cuBLAS's stable v2 C ABI), so no cuBLAS header is needed to build.
//   * Handles: one cuBLAS handle and one 4 MiB workspace (cudaMalloc'd with the handle) per (device, compute
//     stream), shared by the Linear nodes that run on that stream and freed when the last of them is
//     destroyed. (One per node would be 121 handles and 484 MiB of workspace for SmolLM2, all made at the first
//     prefill.) A stream runs its GEMMs one after the other, so they can share the workspace; a mutex guards
//     the host calls.
//   * CUDA graphs: the handle is made at the first cuBLAS call, which must not be inside a capture (ORT runs a
//     session once uncaptured before it captures; a capture that would create it is refused by name).
//     cublasSetWorkspace gives cuBLAS its workspace, so a captured GEMM allocates nothing. cublasSetStream
//     resets cuBLAS's workspace to its default pool, so the two are set together on every call (host-only
//     calls, a few hundred ns).
//   * Every cuBLAS status is checked and reported by its name (CUBLAS_STATUS_*).

namespace ortkv {
namespace {

using Handle = void*;  // cublasHandle_t
using CreateFn = int (*)(Handle*);
using DestroyFn = int (*)(Handle);
using SetStreamFn = int (*)(Handle, cudaStream_t);
using SetWorkspaceFn = int (*)(Handle, void*, size_t);
// cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
//              computeType, algo)
using GemmExFn = int (*)(Handle, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                         const void*, void*, int, int, int, int);

constexpr int kOpN = 0, kOpT = 1;                   // cublasOperation_t
constexpr int kCudaR16F = 2, kCudaR16BF = 14;       // cudaDataType
constexpr int kComputeF32 = 68;                     // CUBLAS_COMPUTE_32F
constexpr int kGemmDefault = -1;                    // CUBLAS_GEMM_DEFAULT
constexpr size_t kWorkspaceBytes = size_t{4} << 20;  // per (device, stream)
static_assert(kCudaR16F == CUDA_R_16F && kCudaR16BF == CUDA_R_16BF, "cudaDataType values (library_types.h)");
#if __has_include(<cublas_api.h>)  // where the toolkit has cuBLAS's headers, check the declared ABI against them
}  // namespace
}  // namespace ortkv
#include <cublas_api.h>
namespace ortkv {
namespace {
static_assert(kOpN == CUBLAS_OP_N && kOpT == CUBLAS_OP_T && kComputeF32 == CUBLAS_COMPUTE_32F &&
                  kGemmDefault == CUBLAS_GEMM_DEFAULT,
              "cuBLAS enum values");
#endif

const char* CublasStatusName(int s) {
  switch (s) {
    case 0: return "CUBLAS_STATUS_SUCCESS";
    case 1: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case 3: return "CUBLAS_STATUS_ALLOC_FAILED";
    case 7: return "CUBLAS_STATUS_INVALID_VALUE";
    case 8: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case 11: return "CUBLAS_STATUS_MAPPING_ERROR";
    case 13: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case 14: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case 15: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case 16: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_(unknown)";
  }
}

struct CublasTable {
  bool ok = false;
  std::string why, library;
  CreateFn create = nullptr;
  DestroyFn destroy = nullptr;
  SetStreamFn set_stream = nullptr;
  SetWorkspaceFn set_workspace = nullptr;
  GemmExFn gemm_ex = nullptr;
};

const CublasTable& Cublas() {
  static CublasTable t;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* names[] = {"libcublas.so.13", "libcublas.so.12"};
    void* lib = nullptr;
    for (int pass = 0; pass < 2 && lib == nullptr; ++pass) {  // pass 0: one already loaded in the process
      for (const char* n : names) {
        lib = dlopen(n, RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
        if (lib != nullptr) {
          t.library = n;
          break;
        }
      }
    }
    if (lib == nullptr) {
      const char* e = dlerror();
      t.why = std::string("neither libcublas.so.13 nor libcublas.so.12 could be loaded (") + (e ? e : "?") + ")";
      return;
    }
    const char* missing = nullptr;
    auto sym = [&](const char* name) {
      void* p = dlsym(lib, name);
      if (p == nullptr && missing == nullptr) missing = name;
      return p;
    };
    t.create = reinterpret_cast<CreateFn>(sym("cublasCreate_v2"));
    t.destroy = reinterpret_cast<DestroyFn>(sym("cublasDestroy_v2"));
    t.set_stream = reinterpret_cast<SetStreamFn>(sym("cublasSetStream_v2"));
    t.set_workspace = reinterpret_cast<SetWorkspaceFn>(sym("cublasSetWorkspace_v2"));
    t.gemm_ex = reinterpret_cast<GemmExFn>(sym("cublasGemmEx"));
    if (missing != nullptr) {
      t.why = t.library + " has no symbol " + missing;
      return;
    }
    t.ok = true;
  });
  return t;
}

}  // namespace

// One handle + workspace for a (device, stream): see the Note.
struct LinearCublasHandle {
  int device = -1;
  void* stream = nullptr;
  Handle handle = nullptr;
  void* workspace = nullptr;
  std::mutex mu;
  ~LinearCublasHandle() {
    int current = -1;
    const bool restore = cudaGetDevice(&current) == cudaSuccess && current != device;
    if (restore) cudaSetDevice(device);
    if (handle != nullptr) Cublas().destroy(handle);
    if (workspace != nullptr) cudaFree(workspace);
    if (restore) cudaSetDevice(current);
  }
};

namespace {

std::mutex g_handles_mu;
std::map<std::pair<int, void*>, std::weak_ptr<LinearCublasHandle>>& Handles() {
  static auto* m = new std::map<std::pair<int, void*>, std::weak_ptr<LinearCublasHandle>>();  // never destroyed
  return *m;
}

Status NeedCublas(const std::string& node, int64_t M, const std::string& why) {
  return Status(Code::kRuntime, "Linear node '" + node + "': M = " + std::to_string(M) +
                                    " rows need cuBLAS (the GEMV takes M <= 4, or M <= 8 with N <= 1024, and W "
                                    "within 8 MiB: Note [Linear path choice]), but " + why +
                                    ". Remedy: install the CUDA cuBLAS library that onnxruntime-gpu uses "
                                    "(nvidia-cublas)");
}

Status CudaFail(const std::string& node, const char* what, cudaError_t e) {
  return Status(Code::kRuntime, "Linear node '" + node + "': " + what + " failed: " + cudaGetErrorName(e) + ": " +
                                    cudaGetErrorString(e));
}

Status CublasFail(const std::string& node, const char* what, int s, const LinearView& v) {
  return Status(Code::kRuntime, "Linear node '" + node + "': " + what + " returned " + CublasStatusName(s) + " (" +
                                    std::to_string(s) + ") for M = " + std::to_string(v.M) + ", K = " +
                                    std::to_string(v.K) + ", N = " + std::to_string(v.N) + " (" + Cublas().library +
                                    ")");
}

// The (device, stream) handle, made here (outside any capture) when there is none alive.
Status Acquire(const std::string& node, const LinearView& v, cudaStream_t stream,
               std::shared_ptr<LinearCublasHandle>* out) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return CudaFail(node, "cudaGetDevice", e);
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto& slot = Handles()[{device, static_cast<void*>(stream)}];
  if (auto h = slot.lock()) {
    *out = std::move(h);
    return Status::Ok();
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) return CudaFail(node, "cudaStreamIsCapturing", e);
  if (capture != cudaStreamCaptureStatusNone) {
    return Status(Code::kRuntime, "Linear node '" + node + "': M = " + std::to_string(v.M) +
                                      " needs a cuBLAS handle, which cannot be created inside a CUDA graph capture. "
                                      "Remedy: run the session once without capture first (ORT does so by itself "
                                      "with enable_cuda_graph)");
  }
  auto h = std::make_shared<LinearCublasHandle>();
  h->device = device;
  h->stream = stream;
  const int s = Cublas().create(&h->handle);
  if (s != 0) {
    h->handle = nullptr;
    return CublasFail(node, "cublasCreate_v2", s, v);
  }
  e = cudaMalloc(&h->workspace, kWorkspaceBytes);
  if (e != cudaSuccess) {
    h->workspace = nullptr;
    return CudaFail(node, "cudaMalloc of the 4 MiB cuBLAS workspace", e);
  }
  slot = h;
  *out = std::move(h);
  return Status::Ok();
}

}  // namespace

LinearCublas::LinearCublas() = default;
LinearCublas::~LinearCublas() = default;

Status LinearCublas::Run(const std::string& node, const LinearView& v, void* stream_ptr) {
  const CublasTable& t = Cublas();
  if (!t.ok) return NeedCublas(node, v.M, t.why);
  if (v.M > INT32_MAX || v.N > INT32_MAX || v.K > INT32_MAX) {
    return Status(Code::kInvalidArgument, "Linear node '" + node + "': M = " + std::to_string(v.M) + ", K = " +
                                              std::to_string(v.K) + ", N = " + std::to_string(v.N) +
                                              " exceed cuBLAS's 32-bit sizes; split the call");
  }
  int dtype = 0;
  switch (v.elem_type) {
    case kFloat16: dtype = kCudaR16F; break;
    case kBFloat16: dtype = kCudaR16BF; break;
    default: return Status(Code::kInvalidArgument, "Linear node '" + node + "': cuBLAS path takes float16 / bfloat16");
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  std::shared_ptr<LinearCublasHandle> h;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!handle_ || handle_->stream != stream_ptr) {
      ORTKV_RETURN_IF_ERR(Acquire(node, v, stream, &handle_));
    }
    h = handle_;
  }
  std::lock_guard<std::mutex> lock(h->mu);
  int s = t.set_stream(h->handle, stream);
  if (s != 0) return CublasFail(node, "cublasSetStream_v2", s, v);
  s = t.set_workspace(h->handle, h->workspace, kWorkspaceBytes);  // after SetStream, which resets it
  if (s != 0) return CublasFail(node, "cublasSetWorkspace_v2", s, v);
  const float alpha = 1.0f, beta = 0.0f;
  const int M = static_cast<int>(v.M), N = static_cast<int>(v.N), K = static_cast<int>(v.K);
  s = t.gemm_ex(h->handle, kOpT, kOpN, N, M, K, &alpha, v.w, dtype, K, v.x, dtype, K, &beta, v.y, dtype, N, kComputeF32,
                kGemmDefault);
  if (s != 0) return CublasFail(node, "cublasGemmEx", s, v);
  return Status::Ok();
}

}  // namespace ortkv
