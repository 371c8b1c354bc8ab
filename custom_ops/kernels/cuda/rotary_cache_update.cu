// CUDA RotaryCacheUpdate and SwiGLU (Note [RotaryCacheUpdate], Note [SwiGLU] in ortkv/rotary_cache_update.h):
// one launch each. RotaryCacheUpdate reads the positions from DEVICE memory and checks both cache writes on
// the device before any store (cache_write_check.cuh, Note [CUDA deferred errors]), so a decode step with it
// stays capturable as a CUDA graph: no host copy, no host sync, no allocation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "ortkv/rotary_cache_update.h"
#include "cache_write_check.cuh"
#include "device_common.cuh"

namespace ortkv {
namespace {

template <typename T>
struct RotaryArgs {
  CacheWriteCheck ck, cv;  // the two cache writes (positions, geometry, protected ranges)
  const T* qkv;
  T* q_out;
  const T* cos;
  const T* sin;
  int64_t rows, n, heads, kv_heads, head_size;
  int layout;  // 0 SBNH, 1 BSNH, 2 BNSH
  ortkv_device_error* err;
  int32_t label_k, label_v;
};

template <typename T>
__device__ __forceinline__ int64_t CacheOffset(const RotaryArgs<T>& a, int64_t b, int64_t h, int64_t p) {
  const int64_t cap = a.ck.capacity;
  if (a.layout == 0) return ((p * a.rows + b) * a.kv_heads + h) * a.head_size;
  if (a.layout == 1) return ((b * cap + p) * a.kv_heads + h) * a.head_size;
  return ((b * a.kv_heads + h) * cap + p) * a.head_size;
}

// grid.x walks the tokens (b, t), the threads of a block walk one token's (head, pair) of q, k and v.
template <typename T>
__global__ void RotaryCacheUpdateKernel(const RotaryArgs<T> a) {
  if (__syncthreads_or(ThreadFindsBadWrite(a.ck) | ThreadFindsBadWrite(a.cv))) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && !ReportBadWrite(a.ck, a.err, a.label_k))
      ReportBadWrite(a.cv, a.err, a.label_v);
    return;
  }
  const int64_t D = a.head_size, half = D / 2;
  const int64_t all = a.heads + 2 * a.kv_heads;
  const int64_t pairs = all * half;
  const int64_t tokens = a.rows * a.n;
  T* kc = reinterpret_cast<T*>(a.ck.cache);
  T* vc = reinterpret_cast<T*>(a.cv.cache);
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    const int64_t b = token / a.n, t = token % a.n;
    const int64_t p = a.ck.positions[b * a.ck.position_stride] + t;
    const T* x = a.qkv + token * all * D;
    for (int64_t j = threadIdx.x; j < pairs; j += blockDim.x) {
      const int64_t h = j / half, i = j % half;
      const T* src = x + h * D + 2 * i;
      if (h >= a.heads + a.kv_heads) {  // v: stored as it is
        T* dst = vc + CacheOffset(a, b, h - a.heads - a.kv_heads, p) + 2 * i;
        dst[0] = src[0];
        dst[1] = src[1];
        continue;
      }
      const float x0 = ToF(src[0]), x1 = ToF(src[1]);
      const float c = ToF(a.cos[p * half + i]), s = ToF(a.sin[p * half + i]);
      T* dst = h < a.heads ? a.q_out + (token * a.heads + h) * D + 2 * i
                           : kc + CacheOffset(a, b, h - a.heads, p) + 2 * i;
      dst[0] = FromF<T>(x0 * c - x1 * s);
      dst[1] = FromF<T>(x1 * c + x0 * s);
    }
  }
}

template <typename T>
cudaError_t LaunchRotary(const RotaryCacheUpdateView& v, const DeviceRangeCheck& rk, const DeviceRangeCheck& rv,
                         void* error_word, int32_t label_k, int32_t label_v, cudaStream_t stream) {
  RotaryArgs<T> a;
  a.ck = MakeCacheWriteCheck(v.k, rk);
  a.cv = MakeCacheWriteCheck(v.v, rv);
  a.qkv = static_cast<const T*>(v.qkv);
  a.q_out = static_cast<T*>(v.q_out);
  a.cos = static_cast<const T*>(v.cos);
  a.sin = static_cast<const T*>(v.sin);
  a.rows = v.rows;
  a.n = v.n;
  a.heads = v.heads;
  a.kv_heads = v.kv_heads;
  a.head_size = v.head_size;
  a.layout = v.layout;
  a.err = static_cast<ortkv_device_error*>(error_word);
  a.label_k = label_k;
  a.label_v = label_v;
  const int64_t pairs = (v.heads + 2 * v.kv_heads) * (v.head_size / 2);
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (pairs + 31) / 32 * 32)));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(v.rows * v.n, 8192));
  RotaryCacheUpdateKernel<T><<<blocks, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
__global__ void SwiGLUKernel(const T* x, T* y, int64_t rows, int64_t f) {
  const int64_t total = rows * f;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / f, i = k % f;
    const float g = ToF(x[r * 2 * f + i]), u = ToF(x[r * 2 * f + f + i]);
    y[k] = FromF<T>((g / (1.0f + __expf(-g))) * u);
  }
}

template <typename T>
cudaError_t LaunchSwiGLU(const void* x, void* y, int64_t rows, int64_t f, cudaStream_t stream) {
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((rows * f + threads - 1) / threads, 65535)));
  SwiGLUKernel<T><<<blocks, threads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), rows, f);
  return cudaGetLastError();
}

Status LaunchStatus(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(Code::kRuntime, std::string(op) + " CUDA launch failed: " + cudaGetErrorName(err) + ": " +
                                    cudaGetErrorString(err));
}

}  // namespace

Status RotaryCacheUpdateCuda(const RotaryCacheUpdateView& v, const DeviceRangeCheck& ranges_k,
                             const DeviceRangeCheck& ranges_v, void* error_word, int32_t label_k, int32_t label_v,
                             void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaError_t err;
  switch (v.elem_type) {
    case kFloat32: err = LaunchRotary<float>(v, ranges_k, ranges_v, error_word, label_k, label_v, stream); break;
    case kFloat16: err = LaunchRotary<__half>(v, ranges_k, ranges_v, error_word, label_k, label_v, stream); break;
    case kBFloat16:
      err = LaunchRotary<__nv_bfloat16>(v, ranges_k, ranges_v, error_word, label_k, label_v, stream);
      break;
    default: return Status(Code::kInvalidArgument, "RotaryCacheUpdate: unsupported element type");
  }
  return LaunchStatus("RotaryCacheUpdate", err);
}

Status SwiGLUCuda(const void* x, void* y, int32_t elem_type, int64_t rows, int64_t f, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (rows * f == 0) return Status::Ok();
  cudaError_t err;
  switch (elem_type) {
    case kFloat32: err = LaunchSwiGLU<float>(x, y, rows, f, stream); break;
    case kFloat16: err = LaunchSwiGLU<__half>(x, y, rows, f, stream); break;
    case kBFloat16: err = LaunchSwiGLU<__nv_bfloat16>(x, y, rows, f, stream); break;
    default: return Status(Code::kInvalidArgument, "SwiGLU: unsupported element type");
  }
  return LaunchStatus("SwiGLU", err);
}

}  // namespace ortkv
