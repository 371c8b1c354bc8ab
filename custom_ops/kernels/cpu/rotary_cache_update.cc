// CPU RotaryCacheUpdate and SwiGLU, float32 (Note [RotaryCacheUpdate], Note [SwiGLU] in ortkv/rotary_cache_update.h).
#include <cmath>
#include <cstring>

#include "ortkv/rotary_cache_update.h"

namespace ortkv {
namespace {

// Note [Rotary bit for bit]
// The interleaved rotary of one head as ORT's CPU RotaryEmbedding computes it, so that the fused decoder keeps the
// unfused one's greedy tokens on the CPU: MLAS's AVX2 kernel (taken where the CPU has AVX2 and FMA) forms
//     y[2i] = fma(x[2i], c, -(x[2i+1] s)),   y[2i+1] = fma(x[2i], s, x[2i+1] c)
// (one rounding less than the products-then-sum of its scalar fallback, which other CPUs get). Matched bit for
// bit against com.microsoft.RotaryEmbedding in tests/test_rotary_cache_update.py.
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma"))) void RotateFma(const float* x, const float* c, const float* s, int64_t half,
                                                   float* y) {
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    y[2 * i] = __builtin_fmaf(x0, c[i], -(x1 * s[i]));
    y[2 * i + 1] = __builtin_fmaf(x0, s[i], x1 * c[i]);
  }
}
bool HasFma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#else
void RotateFma(const float*, const float*, const float*, int64_t, float*) {}
bool HasFma() { return false; }
#endif

void RotatePlain(const float* x, const float* c, const float* s, int64_t half, float* y) {
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    y[2 * i] = x0 * c[i] - x1 * s[i];
    y[2 * i + 1] = x1 * c[i] + x0 * s[i];
  }
}

}  // namespace

void RotateInterleaved(const float* x, const float* c, const float* s, int64_t half, float* y) {
  if (HasFma()) {
    RotateFma(x, c, s, half, y);
  } else {
    RotatePlain(x, c, s, half, y);
  }
}

void RotaryCacheUpdateCpu(const RotaryCacheUpdateView& v, int64_t begin_token, int64_t end_token) {
  const int64_t D = v.head_size, half = D / 2, W = v.width();
  const auto* qkv = static_cast<const float*>(v.qkv);
  auto* q_out = static_cast<float*>(v.q_out);
  auto* kc = static_cast<float*>(v.k.cache);
  auto* vc = static_cast<float*>(v.v.cache);
  const auto* cos = static_cast<const float*>(v.cos);
  const auto* sin = static_cast<const float*>(v.sin);
  for (int64_t token = begin_token; token < end_token; ++token) {
    const int64_t b = token / v.n, t = token % v.n;
    const int64_t p = v.k.position(b) + t;
    const float* x = qkv + token * W;
    const float* c = cos + p * half;
    const float* s = sin + p * half;
    for (int64_t h = 0; h < v.heads; ++h) RotateInterleaved(x + h * D, c, s, half, q_out + (token * v.heads + h) * D);
    for (int64_t h = 0; h < v.kv_heads; ++h) {
      const int64_t at = v.cache_offset(b, h, p);
      RotateInterleaved(x + (v.heads + h) * D, c, s, half, kc + at);
      std::memcpy(vc + at, x + (v.heads + v.kv_heads + h) * D, static_cast<size_t>(D) * sizeof(float));
    }
  }
}

void SwiGLUCpu(const float* x, float* y, int64_t f, int64_t begin_row, int64_t end_row) {
  for (int64_t r = begin_row; r < end_row; ++r) {
    const float* g = x + r * 2 * f;
    const float* u = g + f;
    float* o = y + r * f;
    for (int64_t i = 0; i < f; ++i) {
      const float sig = 1.0f / (1.0f + std::exp(-g[i]));
      o[i] = (g[i] * sig) * u[i];
    }
  }
}

}  // namespace ortkv
