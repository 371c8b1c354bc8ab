// Linear's checks and its CPU kernel (Note [Linear] in ortkv/linear.h): float32, and float16 computed in
// float32. The reference path: plain dot products with 8 independent float32 partial sums per (row, column)
// (so the compiler vectorizes them), parallelized by the caller over columns.
#include <cstring>
#include <sstream>
#include <vector>

#include "codecs.h"
#include "ortkv/linear.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ortkv {

Status PlanLinear(const std::string& node, const TensorArg& x, const TensorArg& w, LinearView* view) {
  const std::string where = "Linear node '" + node + "': ";
  if (x.dims.empty()) {
    return Status(Code::kInvalidArgument, where + "input X '" + x.name + "' is a scalar; it must be [..., K] (rank >= 1)");
  }
  if (w.dims.size() != 2) {
    return Status(Code::kInvalidArgument, where + "weight W '" + w.name + "' is " + ShapeText(w.dims) + " (rank " +
                                              std::to_string(w.dims.size()) +
                                              "); it must be [N, K] (rank 2, torch's Linear layout: W^T of MatMul's B)");
  }
  if (x.elem_type != w.elem_type) {
    return Status(Code::kInvalidArgument, where + "X '" + x.name + "' is " + ElemTypeName(x.elem_type) + " but W '" +
                                              w.name + "' is " + ElemTypeName(w.elem_type) +
                                              "; both must have the same float type");
  }
  const int64_t K = x.dims.back(), N = w.dims[0];
  if (w.dims[1] != K) {
    return Status(Code::kInvalidArgument, where + "X '" + x.name + "' " + ShapeText(x.dims) + " has K = " +
                                              std::to_string(K) + " but W '" + w.name + "' " + ShapeText(w.dims) +
                                              " has K = " + std::to_string(w.dims[1]) +
                                              "; W must be [N, K] with X's last dim as K (transpose a MatMul weight)");
  }
  if (K % kLinearKMultiple != 0) {
    return Status(Code::kInvalidArgument, where + "K = " + std::to_string(K) + " (X '" + x.name + "' " +
                                              ShapeText(x.dims) + ") is not a multiple of 8; Linear reads W in "
                                              "16-byte vectors of 8 elements: use MatMul for this matrix");
  }
  int64_t M = 1;
  for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
  view->x = x.data;
  view->w = w.data;
  view->M = M;
  view->K = K;
  view->N = N;
  view->elem_type = x.elem_type;
  return Status::Ok();
}

namespace {

// float16 bits -> float32 through a 256 KiB table built once (exact: codecs::F16BitsToF32 per entry): the
// conversion where the CPU has no F16C.
const float* HalfTable() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = codecs::F16BitsToF32(static_cast<uint16_t>(h));
    return t;
  }();
  return table.data();
}

// n float16 values -> float32, exact either way: F16C's vcvtph2ps 8 at a time where the CPU has it (checked once;
// the function is compiled for it alone, so the library still loads on any x86-64), else the table.
#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void HalfToFloatF16c(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = HalfTable()[src[i]];
}
#endif

void HalfToFloat(const uint16_t* src, float* dst, int64_t n) {
#if defined(__x86_64__)
  static const bool f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  if (f16c) return HalfToFloatF16c(src, dst, n);
#endif
  const float* table = HalfTable();
  for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
}

inline float Dot(const float* x, const float* w, int64_t K) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t k = 0; k < K; k += 8) {  // K % 8 == 0 (PlanLinear)
    for (int j = 0; j < 8; ++j) acc[j] += x[k + j] * w[k + j];
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

void LinearCpu(const LinearView& v, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t K = v.K, N = v.N;
  if (v.elem_type == kFloat32) {
    const float* x = static_cast<const float*>(v.x);
    const float* w = static_cast<const float*>(v.w);
    float* y = static_cast<float*>(v.y);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m = m0; m < m1; ++m) y[m * N + n] = Dot(x + m * K, w + n * K, K);
    }
    return;
  }
  // float16: the task's X rows converted once, each W row once per task, into float32 buffers
  const uint16_t* x = static_cast<const uint16_t*>(v.x);
  const uint16_t* w = static_cast<const uint16_t*>(v.w);
  uint16_t* y = static_cast<uint16_t*>(v.y);
  thread_local std::vector<float> xf, wf;
  xf.resize(static_cast<size_t>((m1 - m0) * K));
  wf.resize(static_cast<size_t>(K));
  HalfToFloat(x + m0 * K, xf.data(), (m1 - m0) * K);
  for (int64_t n = n0; n < n1; ++n) {
    HalfToFloat(w + n * K, wf.data(), K);
    for (int64_t m = m0; m < m1; ++m) {
      y[m * N + n] = codecs::F32ToF16Bits(Dot(xf.data() + (m - m0) * K, wf.data(), K));
    }
  }
}

}  // namespace ortkv
