// Linear: Y[..., N] = X[..., K] @ W^T with W [N, K] (torch's Linear layout), no bias.
//
// Note [Linear]
// ~~~~~~~~~~~~~
//   Y = Linear(X, W): X [..., K] (M = the product of the leading dims), W [N, K], Y [..., N], one float type.
// W is row-major [N, K]: output column n reads the K contiguous values of row n (Gemm's transB form). The
// builder stores each projection transposed once at build time, and the tied LM head passes the embedding
// table [vocab, E] as it is (one copy of the 56.6 MB table for the lookup and the head).
// Why it exists: a batch-1 CUDA decode step of SmolLM2-135M float16 runs 121 projections at M = 1 (fused QKV
// 576 -> 960, output 576 -> 576, fused gate / up 576 -> 3072, down 1536 -> 576 per layer x 30, and the LM head
// 576 -> 49152). Through ORT's MatMul each is a cuBLAS GEMM of ~3.7 us (441.6 us of a 1.007 ms kernel step on
// the H200), where their bytes (0.66-3.5 MB) need < 1 us at ~4 TB/s: cuBLAS's M = 1 kernels do not keep
// enough loads in flight. A GEMV of our own at ~1.5-2 us per call is the margin between the step measured
// (1.31-1.36 ms) and the goal (<= 1.26 ms, 1.05x llama.cpp's 757 tok/s).
// Paths:
//   * CUDA, small M (LinearUsesGemv, Note [Linear path choice]: M <= 4, or M <= 8 with N <= 1024, W within
//     8 MiB): LinearGemvCuda, our GEMV (Note [Linear GEMV] in custom_ops/kernels/cuda/linear.cu): W read exactly
//     once with 16-byte loads, X staged in shared memory, fp32 accumulators, no workspace, no atomics, no
//     allocation, no host sync (graph-capturable).
//   * CUDA otherwise (prefill; decode at batch > 8; the LM head): cuBLAS cublasGemmEx (W^T x X, fp32 compute)
//     on the node's compute stream, cuBLAS dlopen'd at first use (Note [Linear cuBLAS] in
//     custom_ops/ort/linear_op.cc).
//   * CPU float32: a tile kernel (AVX-512 or AVX2 + FMA, 4 rows of W per tile, software prefetch; Note [Linear CPU
//     GEMV] in custom_ops/kernels/cpu/linear.cc) that streams W faster than ORT's MLAS MatMul at M = 1, so the
//     float32 CPU decoders' projections and tied LM head are Linear (models.linear_projections in
//     python/ortkv/generate/models.py); attribute activation="swiglu" fuses the MLP's SwiGLU into the gate / up
//     product (Note [Linear SwiGLU epilogue]).
//   * CPU float16: computed in float32 (converted per element, exact) with one rounding at the store: the reference
//     path, which also lets a float16 model run on the CPU.
// Accumulation is float32 on every path; float16 / bfloat16 outputs are rounded once (nearest even).
// K must be a multiple of 8 on every path (the GEMV's 16-byte loads of 8 elements; the same contract on the
// CPU so that a model that loads on one EP loads on the other): other K are refused by name with the remedy
// to use MatMul.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "ortkv/cache_update.h"
#include "ortkv/status.h"

namespace ortkv {

constexpr int64_t kLinearKMultiple = 8;  // elements per 16-byte load of float16 / bfloat16
constexpr int64_t kLinearGemvMaxM = 8;   // CUDA: the GEMV is compiled for M <= 8 (LinearUsesGemv picks the calls)
// The GEMV stages X [M, K] in shared memory; a larger X goes to cuBLAS (K > 24576 at M = 1 in float16).
constexpr int64_t kLinearGemvMaxXBytes = 48 << 10;
// Note [Linear path choice]: which CUDA path a call takes, from the H200's figures
// (benchmarks/results/linear_cuda_h200.md, us per call, GEMV / cuBLAS): the GEMV wins at M = 1..4 on the
// decoder's projections (M = 1: 2.2-3.2 vs 3.6-5.1) and at M = 8 on the narrow ones (N <= 1024: 3.3-4.3 vs
// 3.6-5.0), but not on the fused gate / up at M = 8 (5.1 vs 4.2) nor on the 56.6 MB LM head at any M (M = 1:
// 19.6 vs 18.1; M = 8: 42.3 vs 18.5: cuBLAS streams a large W at ~3.1 TB/s, the GEMV's one warp per 2 rows
// does not). So: the GEMV for M <= 4, or M <= 8 with N <= 1024, and W within 8 MiB; cuBLAS otherwise.
constexpr int64_t kLinearGemvMaxWeightBytes = 8 << 20;
constexpr bool LinearUsesGemv(int64_t M, int64_t K, int64_t N) {
  return M >= 1 && M <= kLinearGemvMaxM && M * K * 2 <= kLinearGemvMaxXBytes && N * K * 2 <= kLinearGemvMaxWeightBytes &&
         (M <= 4 || N <= 1024);
}

struct LinearView {
  const void* x = nullptr;  // [M, K]
  const void* w = nullptr;  // [N, K]
  void* y = nullptr;        // [M, N]
  int64_t M = 0, K = 0, N = 0;
  int32_t elem_type = 0;  // kFloat32, kFloat16 or kBFloat16
};

// Checks X [..., K] and W [N, K] (rank, same float type, K agreement, K % 8) and fills `view` except y. The
// messages name the node, the tensors, their shapes and the remedy. Element types are checked by the caller
// (they depend on the EP).
Status PlanLinear(const std::string& node, const TensorArg& x, const TensorArg& w, LinearView* view);

// CPU: Y rows [m0, m1) x columns [n0, n1), float32 (Note [Linear CPU GEMV] in custom_ops/kernels/cpu/linear.cc)
// or float16 (computed in float32, the reference path).
void LinearCpu(const LinearView& view, int64_t m0, int64_t m1, int64_t n0, int64_t n1);

// Note [Linear norm prologue] (CPU, float32): out[m, :] = (s / sqrt(mean(s^2) + epsilon)) * gamma with
// s = x[m, :] + skip[m, :] for each of the M rows of K; sum (if not null) receives s. The arithmetic of ORT's
// SkipSimplifiedLayerNormalization CPU kernel, operation for operation (a float sum of squares in order, a
// division by the root, then the product with gamma), so a fused node gives that node's bits.
void SkipRmsNormCpu(const float* x, const float* skip, const float* gamma, float epsilon, int64_t M, int64_t K,
                    float* out, float* sum);

// CPU, float32, activation "swiglu" (Note [Linear SwiGLU epilogue] in custom_ops/kernels/cpu/linear.cc): view.y is
// Y [M, N / 2]; fills rows [m0, m1) x columns [j0, j1) of silu(P[:, :N/2]) * P[:, N/2:], P = X W^T (N even).
void LinearSwiGLUCpu(const LinearView& view, int64_t m0, int64_t m1, int64_t j0, int64_t j1);

// CPU: refuses a bad ORTKV_CPU_ISA (the instruction set the float32 kernel runs, Note [CPU attention ISA dispatch])
// with E_INPUT naming the node; call before LinearCpu.
Status CheckLinearCpuIsa(const std::string& node);

// CPU decode calls (M <= kLinearCpuGemvMaxM, float32): N is split into at most kLinearCpuGemvTasks contiguous
// column ranges of whole kLinearCpuGemvRows-row groups, none under kLinearCpuGemvMinTaskBytes of W (Note [Linear
// CPU GEMV]).
constexpr int64_t kLinearCpuGemvMaxM = 4;
constexpr int64_t kLinearCpuGemvTasks = 16;  // Note [Linear GEMV tasks] in custom_ops/kernels/cpu/linear.cc
constexpr int64_t kLinearCpuGemvRows = 4;
constexpr int64_t kLinearCpuGemvMinTaskBytes = 64 << 10;

#if defined(ORTKV_WITH_CUDA)
// The GEMV (M <= 8, float16 / bfloat16, 16-byte aligned X, W and K % 8 == 0, X within kLinearGemvMaxXBytes):
// one launch on `stream`. rows_per_warp: output rows per warp, 1, 2 or 4 (Note [Linear GEMV]).
Status LinearGemvCuda(const LinearView& view, int rows_per_warp, void* stream);

struct LinearCublasHandle;  // a cuBLAS handle + workspace of one (device, stream)

// The cuBLAS path of one Linear kernel instance (Note [Linear cuBLAS] in custom_ops/kernels/cuda/linear_cublas.cu):
// cuBLAS dlopen'd at the first call, one handle + workspace per (device, stream) shared by the instances on
// that stream, created at the first call (refused inside a CUDA graph capture).
class LinearCublas {
 public:
  LinearCublas();
  ~LinearCublas();
  LinearCublas(const LinearCublas&) = delete;
  LinearCublas& operator=(const LinearCublas&) = delete;
  Status Run(const std::string& node, const LinearView& view, void* stream);

 private:
  std::mutex mu_;
  std::shared_ptr<LinearCublasHandle> handle_;
};
#endif

}  // namespace ortkv
