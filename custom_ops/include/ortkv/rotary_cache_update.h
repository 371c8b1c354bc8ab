// RotaryCacheUpdate and SwiGLU: framework-free descriptions and kernels.
//
// Note [RotaryCacheUpdate]
// ~~~~~~~~~~~~~~~~~~~~~~~~
//   q_rot, k_cache_out, v_cache_out = RotaryCacheUpdate(qkv, k_cache, v_cache, positions, cos_cache, sin_cache)
//   attributes num_heads (H), kv_num_heads (Hkv), seq_axis (the caches' layout, as CacheUpdate's)
//
// What one decode step did with ~7 nodes per layer (Split of the fused QKV projection, two
// com.microsoft.RotaryEmbedding, a Reshape + Transpose of K and V into the cache's layout, two CacheUpdate)
// as ONE node and one kernel launch: at one token per step each of those kernels moves a few KiB and costs a
// launch and a graph gap (issue 10: ~10 us of a 1.7 ms H200 step per layer), on the CPU a node dispatch.
//   * qkv [B, T, (H + 2 Hkv) D] comes straight from the fused QKV MatMul: q is columns [0, H D), k the next
//     Hkv D, v the last Hkv D (the builder's [wq | wk | wv]), each head's D values contiguous.
//   * Token t of row b is at position p = positions[b] + t (positions: a scalar or [B], as CacheUpdate's).
//     q and k are rotated as com.microsoft.RotaryEmbedding with interleaved=1 and the full head rotated
//     (llama.cpp's row order): for each pair i < D / 2, with c = cos_cache[p, i], s = sin_cache[p, i],
//         y[2i] = x[2i] c - x[2i+1] s,   y[2i+1] = x[2i+1] c + x[2i] s
//     (the same products and sum as ORT's CPU kernel; float32 arithmetic on CUDA for float16 / bfloat16, one
//     rounding at the store).
//   * q_rot [B, T, H D] is a new output; rotated k and plain v are stored into k_cache / v_cache at p in the
//     caches' layout (seq_axis: -2 / 2 BNSH [B, Hkv, capacity, D], 1 BSNH [B, capacity, Hkv, D], 0 SBNH
//     [capacity, B, Hkv, D]; rank 4). Nothing else of a cache is written.
//   * Outputs 1 and 2 MUST alias inputs 1 and 2 (GetAliasMap), exactly as CacheUpdate's output 0 does
//     (Note [Aliasing CacheUpdate output]): the kernel compares the pointers and refuses before any store.
//   * Validation is CacheUpdate's (PlanCacheWrite: types, layout, positions, capacity, overlap, protected ranges;
//     on CUDA the position checks run on the device, Note [CUDA deferred errors]) plus the shapes that tie the
//     inputs together (qkv's width, heads, D even, the rotary tables [rows, D / 2] with rows >= capacity, so
//     that every position a cache can hold has its row and the tables need no check of their own on the device).
//   * CPU: float32 (as CacheAttention's CPU kernel). CUDA: float32, float16, bfloat16; positions in device memory,
//     one launch, no allocation, no host sync: a decode step stays capturable as a CUDA graph.
//
// Note [SwiGLU]
// ~~~~~~~~~~~~~
//   y = SwiGLU(x): x [..., 2F] -> y [..., F],  y = silu(x[..., :F]) * x[..., F:],  silu(g) = g * sigmoid(g)
// The llama MLP's gate / up from ONE fused MatMul ([wg | wu]), activated in one node instead of Split + (Mul,
// Sigmoid: fused by ORT into QuickGelu) + Mul: one kernel launch instead of three. Arithmetic in float32,
// one rounding at the store. onnxruntime 1.32 has a com.microsoft.SwiGLU that takes this fused form (its `up`
// input omitted), but neither a CPU kernel in the CPU wheel nor (as far as we could check) the op in 1.31,
// the GPU wheel this project runs, so ortkv has its own.
#pragma once
#include <cstdint>
#include <string>

#include "ortkv/cache_update.h"
#include "ortkv/status.h"

namespace ortkv {

struct RotaryCacheUpdateView {
  const void* qkv = nullptr;  // [rows, n, (heads + 2 kv_heads) head_size]
  void* q_out = nullptr;      // [rows, n, heads head_size]
  const void* cos = nullptr;  // [table_rows, head_size / 2]
  const void* sin = nullptr;
  CacheUpdateView k, v;       // the two cache writes (their `values` point at qkv's k / v columns: unused)
  int64_t rows = 0, n = 0, heads = 0, kv_heads = 0, head_size = 0, table_rows = 0;
  int32_t elem_type = 0;      // ONNX element type of every float tensor
  int layout = 0;             // 0 SBNH, 1 BSNH, 2 BNSH (the sequence axis of the rank-4 caches)

  int64_t width() const { return (heads + 2 * kv_heads) * head_size; }
  // element offset of (row b, kv head h, position p) in a cache, at element 0 of the head
  int64_t cache_offset(int64_t b, int64_t h, int64_t p) const {
    const int64_t cap = k.capacity;
    switch (layout) {
      case 0: return ((p * rows + b) * kv_heads + h) * head_size;
      case 1: return ((b * cap + p) * kv_heads + h) * head_size;
      default: return ((b * kv_heads + h) * cap + p) * head_size;
    }
  }
};

// Validates every input of a RotaryCacheUpdate node and fills `view` (nothing is written). read_positions:
// false for the CUDA kernel (positions in device memory, checked there).
Status PlanRotaryCacheUpdate(const std::string& node, const TensorArg& qkv, const TensorArg& k_cache,
                             const TensorArg& v_cache, const TensorArg& positions, const TensorArg& cos_cache,
                             const TensorArg& sin_cache, int64_t heads, int64_t kv_heads, int64_t seq_axis,
                             bool read_positions, RotaryCacheUpdateView* view);

// One head's interleaved rotary in float32 (half = head_size / 2 pairs), ORT's CPU form (Note [Rotary bit for bit]):
// fma(x0, c, -(x1 s)), fma(x0, s, x1 c) where the CPU has AVX2 and FMA, else the products and a sum.
void RotateInterleaved(const float* x, const float* c, const float* s, int64_t half, float* y);

// CPU (float32): tokens [begin, end) of the rows * n tokens (token = b * n + t).
void RotaryCacheUpdateCpu(const RotaryCacheUpdateView& view, int64_t begin_token, int64_t end_token);

// SwiGLU (Note [SwiGLU]): rows of 2 * f inputs -> rows of f outputs.
Status CheckSwiGLU(const std::string& node, const TensorArg& x, int64_t* rows, int64_t* f);
void SwiGLUCpu(const float* x, float* y, int64_t f, int64_t begin_row, int64_t end_row);

#if defined(ORTKV_WITH_CUDA)
// One launch on `stream`; positions in device memory; `ranges_k` / `ranges_v` as CacheUpdateCuda's. Every block
// checks both caches' writes first; a bad row is reported into `error_word` (word [0]) with `label_k` (positions,
// and protected ranges of the key cache) or `label_v` (protected ranges of the value cache).
Status RotaryCacheUpdateCuda(const RotaryCacheUpdateView& view, const DeviceRangeCheck& ranges_k,
                             const DeviceRangeCheck& ranges_v, void* error_word, int32_t label_k, int32_t label_v,
                             void* stream);
Status SwiGLUCuda(const void* x, void* y, int32_t elem_type, int64_t rows, int64_t f, void* stream);
#endif

}  // namespace ortkv
